"""Learner checkpoints (torch.distributed.checkpoint), Hugging Face export and the weights hash.

Owns the on-disk layout of a learner checkpoint and of an exported model (the names of the checkpoint
folders and of ``latest`` come from ``asyncrl.rundir.paths``):

    <root>/
      latest                     text: name of the newest complete checkpoint ("step_00000012")
      step_00000012/             one checkpoint = learner version 12 (12 completed steps)
        dcp/                     DCP files: {"model": ..., "optim": ...} (DTensors or plain
                                 tensors; trainable parameters only: a LoRA checkpoint holds
                                 the adapters, the base is the model folder's)
        learner.json             {"format", "version", "world_size", "scheduler": LRScheduler.state_dict()}
        extra.json               caller's state (e.g. the controller's), only if given
        checksums.json           sha256 of every file above (``asyncrl.rundir.checkpoints``)
      step_00000012.tmp/         a save in progress; renamed to step_... when every rank is done

Never does: decide *when* to save (the caller does, e.g. every N versions), or touch the optimiser
and model beyond state-dict get/set.

Invariants:
* A checkpoint directory without the ``.tmp`` suffix is complete; ``latest`` only ever names a
  complete one, so a crash mid-save resumes from the previous checkpoint.
* Every file of a checkpoint is checksummed when it is saved and verified before it is loaded:
  ``load_checkpoint`` raises ``ChecksumError`` rather than load a damaged shard (the resume point is
  chosen among verified checkpoints, ``asyncrl.rundir.checkpoints.choose_resume_point``).
* A save that fails (e.g. ``DiskFullError``) removes its ``.tmp`` folder; the previous checkpoint stays.
* DCP reshards on load: a checkpoint saved at world size W loads at any world size.
* Resuming restores weights, AdamW moments, learning-rate schedule position and ``version``; the
  next ``train_step`` produces ``version + 1``.
* ``state_dict_sha256`` hashes the full fp32 state dict in name order (name, dtype, shape, raw
  bytes), so it is the same at every world size for the same weights.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from asyncrl.learner.fsdp import DistInfo, barrier, full_state_dict
from asyncrl.learner.step import TrainState
from asyncrl.rundir.checkpoints import verify_manifest, write_manifest
from asyncrl.rundir.files import ChecksumError, DiskFullError, raise_if_disk_full
from asyncrl.rundir.paths import LATEST, LEARNER_CHECKPOINT_RE, learner_checkpoint_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "export_hf",
    "state_dict_sha256",
    "sha256_of_state_dict",
    "TOKENIZER_FILES",
]

CHECKPOINT_FORMAT = 1
FULL_BELOW_BYTES = 1 << 20  # a failed save with less free space than this was a full disk
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
"""Files copied from ``tokenizer_dir`` into an export when present."""


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".part")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    tmp.replace(path)


def save_checkpoint(
    root: str | Path,
    state: TrainState,
    info: DistInfo,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Save model, optimiser, scheduler, version (and ``extra`` as JSON) under ``root``.

    Collective: every rank calls it. Returns the checkpoint directory. ``keep_last`` (>= 1)
    deletes older complete checkpoints beyond the newest ``keep_last``.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if extra is not None:
        try:
            extra_text = json.dumps(extra, sort_keys=True)
        except TypeError as err:
            raise ValueError(f"extra checkpoint state must be JSON-serialisable: {err}") from err
    root = Path(root)
    final = root / learner_checkpoint_name(state.version)
    tmp = root / (final.name + ".tmp")
    if info.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier(info)
    try:
        _save_into(tmp, final, root, state, info, extra, keep_last, extra_text if extra is not None else "")
    except (OSError, RuntimeError, CheckpointException) as e:  # DCP wraps a writer's failure (a BaseException)
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # no half-written checkpoint is left behind
        if isinstance(e, OSError):
            raise_if_disk_full(e, tmp)
        if shutil.disk_usage(root).free < FULL_BELOW_BYTES:  # torch's writers report ENOSPC as "unexpected pos"
            raise DiskFullError(tmp) from e
        raise
    barrier(info)
    return final


def _save_into(tmp: Path, final: Path, root: Path, state: TrainState, info: DistInfo, extra: dict | None,
               keep_last: int | None, extra_text: str) -> None:
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer, options=_options(state.model))
    model_sd = _drop_frozen(state.model, model_sd)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    barrier(info)
    if info.is_main:
        sched = state.scheduler.state_dict()
        meta = {
            "format": CHECKPOINT_FORMAT,
            "version": state.version,
            "world_size": info.world_size,
            "scheduler": sched,
        }
        try:
            _write_json(tmp / "learner.json", meta)
        except TypeError as err:
            raise ValueError(
                f"scheduler state is not JSON-serialisable ({err}); use build_scheduler"
            ) from err
        if extra is not None:
            (tmp / "extra.json").write_text(extra_text)
        write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        latest_tmp = root / (LATEST + ".part")
        latest_tmp.write_text(final.name)
        latest_tmp.replace(root / LATEST)
        if keep_last is not None:
            done = sorted(p for p in root.iterdir() if p.is_dir() and LEARNER_CHECKPOINT_RE.match(p.name))
            for old in done[:-keep_last]:
                shutil.rmtree(old)


def _options(model: torch.nn.Module) -> StateDictOptions:
    """Frozen parameters (a LoRA policy's base) are not saved: they are the model folder's weights,
    so a LoRA checkpoint holds the adapters and their optimiser state only."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _drop_frozen(model: torch.nn.Module, sd: dict[str, Any]) -> dict[str, Any]:
    """Also drop frozen parameters under a second (tied) name, which ``ignore_frozen_params`` keeps."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in sd.items() if k not in frozen} if frozen else sd


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (by the ``latest`` file), or None."""
    root = Path(root)
    marker = root / LATEST
    if not marker.exists():
        return None
    path = root / marker.read_text().strip()
    return path if (path / "learner.json").exists() else None


def load_checkpoint(path: str | Path, state: TrainState, info: DistInfo) -> dict[str, Any] | None:
    """Load a checkpoint (a ``step_*`` directory, or a root holding ``latest``) into ``state``.

    Collective. ``state`` must hold a model sharded like the one saved (any world size) and an
    optimiser/scheduler built the same way. Sets ``state.version`` to the saved version and
    returns the saved ``extra`` dict (None if none was saved).
    """
    path = Path(path)
    if not (path / "learner.json").exists():
        resolved = latest_checkpoint(path)
        if resolved is None:
            raise ValueError(
                f"{path} is neither a learner checkpoint nor a folder with a 'latest' checkpoint"
            )
        path = resolved
    problem = verify_manifest(path)
    if problem is not None:
        raise ChecksumError(f"refusing to load a damaged checkpoint: {problem}")
    meta = json.loads((path / "learner.json").read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')} is not {CHECKPOINT_FORMAT}")
    opts = _options(state.model)
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer, options=opts)
    sd = {"model": _drop_frozen(state.model, model_sd), "optim": optim_sd}
    dcp.load(sd, checkpoint_id=str(path / "dcp"))
    set_state_dict(state.model, state.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                   options=opts)
    state.scheduler.load_state_dict(meta["scheduler"])
    state.version = int(meta["version"])
    extra_path = path / "extra.json"
    return json.loads(extra_path.read_text()) if extra_path.exists() else None


# ---------------------------------------------------------------------------- hashing


def sha256_of_state_dict(sd: dict[str, torch.Tensor]) -> str:
    """SHA-256 over (name, dtype, shape, raw bytes) of each tensor in name order; floating
    tensors are hashed as contiguous fp32 on CPU."""
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].detach()
        if t.is_floating_point():
            t = t.to(torch.float32)
        t = t.cpu().contiguous()
        h.update(f"{name}\0{str(t.dtype)}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def state_dict_sha256(model: torch.nn.Module, info: DistInfo) -> str:
    """Hash of the full fp32 state dict of ``model`` (sharded or not); same on every rank and at
    every world size. Collective."""
    sd = full_state_dict(model)
    digest = [sha256_of_state_dict(sd) if info.is_main else None]
    if info.world_size > 1:
        dist.broadcast_object_list(digest, src=0)
    assert isinstance(digest[0], str)
    return digest[0]


# ---------------------------------------------------------------------------- export


def _hf_config(model: torch.nn.Module) -> PretrainedConfig:
    from transformers import PretrainedConfig

    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise ValueError(f"{type(model).__name__} has no Hugging Face config; export_hf exports transformers models")
    return config


def _hf_class_name(model: torch.nn.Module) -> str:
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    for cls in type(model).__mro__:
        if issubclass(cls, PreTrainedModel) and not issubclass(cls, FSDPModule):
            return cls.__name__
    raise ValueError(
        f"{type(model).__name__} is not a Hugging Face PreTrainedModel; export_hf cannot name it"
    )


def export_hf(
    model: torch.nn.Module,
    tokenizer_dir: str | Path | None,
    out_dir: str | Path,
    info: DistInfo,
    *,
    state_dict_transform: Any = None,
    lora: Any = None,
) -> Path:
    """Write a Hugging Face folder that ``AutoModelForCausalLM.from_pretrained`` loads.

    Collective (the full state dict is gathered to rank 0, which writes): ``config.json``,
    ``model.safetensors`` (fp32, in the checkpoint names ``save_pretrained`` would write:
    ``asyncrl.models.names``), and the tokenizer files of ``tokenizer_dir`` (see
    ``TOKENIZER_FILES``). ``state_dict_transform`` (dict -> dict), if given, is applied to the
    full state dict first (e.g. undoing UAQ folding). A LoRA policy (``lora``: its
    ``policy.LoraSpec``) is exported merged, as a plain model of the base architecture.
    Returns ``out_dir``.
    """
    from safetensors.torch import save_file

    from asyncrl.learner.policy import base_model, policy_state_dict
    from asyncrl.models.names import checkpoint_state_dict

    out = Path(out_dir)
    sd = dict(policy_state_dict(model, lora))  # mutable below (transform, tied lm_head); LoRA: merged here
    hf = base_model(model)
    if info.is_main:
        if state_dict_transform is not None:
            sd = state_dict_transform(sd)
        config = copy.deepcopy(_hf_config(hf))
        config.architectures = [_hf_class_name(hf)]
        config.dtype = torch.float32
        if getattr(config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)  # tied to the embedding; transformers re-ties on load
        sd = checkpoint_state_dict(config, sd)  # the checkpoint's own names (per-expert tensors of a MoE)
        out.mkdir(parents=True, exist_ok=True)
        # No copy of what is already a contiguous fp32 tensor of its own (every parameter at world size 1, a
        # merged LoRA weight): a second full copy was the learner's peak at the end of a LoRA run.
        tensors: dict[str, torch.Tensor] = {}
        owners: set[int] = set()
        for k, v in sd.items():
            t = (v.detach().to(torch.float32) if v.is_floating_point() else v.detach()).contiguous()
            if t.untyped_storage().data_ptr() in owners or t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()  # safetensors writes no shared or partial storage
            owners.add(t.untyped_storage().data_ptr())
            tensors[k] = t
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(out))
        if tokenizer_dir is not None:
            src = Path(tokenizer_dir)
            if not src.is_dir():
                raise ValueError(f"tokenizer_dir {src} is not a folder; pass the model's folder or None")
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, out / name)
    barrier(info)
    return out
