"""Process group and FSDP2 sharding for the learner (torch 2.13 ``fully_shard``).

Owns: joining the process group (torchrun env vars, or a one-process group when run alone),
sharding any Hugging Face causal LM with FSDP2 (each decoder block the model names in
``_no_split_modules``, then the root),
and the few collectives the learner needs (batch broadcast, sums, the full state dict).

Never does: DDP. ``shard_model`` always shards (tests use it at world size 1 too); the learner
process shards only at world size > 1 (``policy.prepare_policy``): at world size 1 the FSDP2
wrapper shards nothing and still adds a little time and memory (docs/benchmarks.md §6), and plain
modules go through the same step, clipping, state-dict and DCP code (DCP reshards plain tensors <->
DTensors).

Invariants:
* Master weights are fp32 (``shard_model`` casts them); an optional ``param_dtype`` only changes
  the dtype FSDP2 all-gathers for compute (MixedPrecisionPolicy); gradients reduce in fp32.
* Gradient reduction is a plain SUM across ranks, not FSDP2's default mean: the loss on each
  rank already divides by the *global* token/sequence count (docs/algorithms.md §5), so the sum of
  the per-rank gradients is the gradient of the global loss. ``shard_model`` sets
  ``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)`` on every
  FSDP module (both are per module, not inherited).

FSDP2 on CPU + gloo (torch 2.13, checked with two processes): fully_shard, all-gather,
reduce-scatter (``reduce_scatter_tensor`` with SUM and AVG), DTensor grad-norm
(``clip_grad_norm_`` returns a replicated DTensor), AdamW on DTensor parameters, DCP save/load
with resharding and ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` all work;
no configuration change is needed beyond the sum reduction above. See docs/learner.md.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from asyncrl.learner.batch import LearnerBatch

__all__ = [
    "DistInfo",
    "init_distributed",
    "shard_model",
    "decoder_layers",
    "broadcast_batch",
    "all_reduce_sum",
    "full_state_dict",
    "barrier",
    "close_distributed",
]


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process sits: rank, world size, and the device/backend it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_INFO: DistInfo | None = None


def init_distributed(backend: str | None = None, *, timeout_s: float = 600.0) -> DistInfo:
    """Join (or create) the default process group and return this rank's ``DistInfo``.

    Reads the torchrun variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Without
    them the process forms a one-rank group on an in-process store (no port, no torchrun).
    ``backend`` defaults to "gloo" on CPU and "cpu:gloo,cuda:nccl" when CUDA is available (NCCL for
    tensors on the GPU, gloo for the CPU-side objects DCP and the full state dict move).
    Idempotent: a second call returns the first result.
    """
    global _INFO
    if _INFO is not None and dist.is_initialized():
        return _INFO
    use_cuda = torch.cuda.is_available()
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    if "nccl" in backend and not use_cuda:
        raise ValueError(f"backend {backend!r} needs CUDA, which is not available; use backend='gloo' on CPU")
    timeout = datetime.timedelta(seconds=timeout_s)
    env_ws = os.environ.get("WORLD_SIZE")
    if env_ws is not None:
        for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise ValueError(
                    f"WORLD_SIZE is set but {var} is not; launch with torchrun or set all of them"
                )
        rank, world_size = int(os.environ["RANK"]), int(env_ws)
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    else:
        rank, world_size, local_rank = 0, 1, 0
    device = torch.device("cuda", local_rank) if use_cuda and "nccl" in backend else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if env_ws is not None:
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    _INFO = DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)
    return _INFO


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks of a Hugging Face causal LM, also under a PEFT wrapper: the outermost modules whose
    class is one of the model's own ``_no_split_modules`` (``Qwen3DecoderLayer``, ``MixtralDecoderLayer``,
    ...), in module order; ``model.model.layers`` for a model that does not declare them."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        model = get_base()
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    found: list[torch.nn.Module] = []
    inside: set[str] = set()
    for name, module in model.named_modules():
        # by the class and its bases: fully_shard swaps a module's class for an FSDP subclass of it
        is_block = any(c.__name__ in kinds for c in type(module).__mro__)
        if is_block and not any(name.startswith(f"{p}.") for p in inside):
            found.append(module)
            inside.add(name)
    if found:
        return found
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules and has no model.layers ModuleList, so the "
            "learner cannot find its decoder blocks to shard and checkpoint; use a Hugging Face causal LM that "
            "declares them (every AutoModelForCausalLM decoder in transformers does)"
        )
    return list(layers)


def shard_model(
    model: torch.nn.Module,
    info: DistInfo,
    *,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2 and return it (now also an ``FSDPModule``).

    Casts to fp32 master weights on ``info.device``, applies ``fully_shard`` to each decoder
    layer and then to the root (embeddings, final norm and lm_head, tied or not, live in the
    root group), and switches gradient reduction to SUM (see the module docstring).
    ``param_dtype`` (e.g. torch.bfloat16 on GPU) sets the compute dtype of the all-gathered
    parameters; gradients are reduced and stored in fp32.
    """
    if isinstance(model, FSDPModule):
        raise ValueError("model is already sharded; call shard_model once per model")
    if not dist.is_initialized():
        raise ValueError("no process group: call init_distributed() before shard_model()")
    model.to(device=info.device, dtype=torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def broadcast_batch(batch: LearnerBatch | None, info: DistInfo, src: int = 0) -> LearnerBatch:
    """Give every rank the step batch that ``src`` holds (others pass None). Pickled over the
    default group; the batch stays on CPU."""
    if info.world_size == 1:
        if batch is None:
            raise ValueError("world size 1: the only rank must pass the batch")
        return batch
    obj = [batch if info.rank == src else None]
    dist.broadcast_object_list(obj, src=src)
    assert isinstance(obj[0], LearnerBatch)
    return obj[0]


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a float64 CPU vector over ranks (returns a new tensor; identity at world size 1)."""
    out = values.detach().to(dtype=torch.float64).clone()
    if info.world_size > 1:
        t = out.to(info.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        out = t.cpu()
    return out


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def close_distributed() -> None:
    """Leave the process group: a barrier, then ``destroy_process_group``.

    The barrier matters on gloo: destroying the group while a peer still has traffic in flight
    aborted a probe process once ("terminate called without an active exception").
    """
    global _INFO
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
    _INFO = None


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) fp32 state dict on CPU, on rank 0; an empty dict on other ranks.

    Collective: every rank must call it. Used for weight publication and export.
    """
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out: dict[str, torch.Tensor] = {}
    for name, value in get_model_state_dict(model, options=opts).items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state dict entry {name!r} is a {type(value).__name__}, not a tensor; weight "
                             "publication and export take models whose state is tensors only (no extra state)")
        out[name] = value
    return out
