"""Value lists and defaults that the run configuration checks and the code that acts on them shares.

Owns the one definition of each; ``asyncrl.config`` validates against them and the modules named beside each
import them from here, so the configuration needs none of those modules (docs/architecture.md §2).
Never: imports anything, not even the standard library (it is the floor of the layer list,
tests/unit/test_layers.py). Wire-level lists (weight formats, the AQN draw policy) are ``protocols.values``'.
"""

PROMPT_FORMATS = ("auto", "chat", "raw")
"""``task.prompt_format`` (``asyncrl.tasks.prompts.resolve_prompt_format``)."""
STRICT_FORMATS = ("tag", "boxed", "last_number")
EXTRACT_FORMATS = (*STRICT_FORMATS, "plain")
ANSWER_FORMATS = ("math_verify", *EXTRACT_FORMATS)
"""Every ``task.answer_format`` some task accepts (jsonl_math: math_verify and the strict ones;
reasoning_gym: the extract ones; ``asyncrl.tasks.answers``)."""
TASK_NAMES = ("addition", "addition2", "jsonl_math", "reasoning_gym")
"""``task.name``: the names of ``asyncrl.tasks.registry.TASKS``, in its order (a unit test holds them equal)."""

DECODE_STEPS = ("auto", "static", "eager")
"""``rollout.decode_step`` / ``NativeEngine(decode_step=...)``. ``static``: static shapes, no host sync
(``asyncrl.engine.native.static_step``); ``eager``: the reference path (``DecoderRunner.decode``); ``auto``: static for a
natively supported model."""
CUDA_GRAPHS = ("auto", "true", "false")
"""``rollout.cuda_graphs`` / ``NativeEngine(cuda_graphs=...)``. ``auto``: CUDA graphs of the static step on CUDA
devices; ``true``: CUDA only (refused on a CPU)."""
COMPILE_STEPS = CUDA_GRAPHS
"""``rollout.compile``. ``auto``: the static step's body compiled by Inductor on CUDA (a failed build is logged
as an error and the step runs uncompiled), not on a CPU; ``true``: compiled anywhere (a failed build stops the
engine, naming the fix); ``false``: never (``asyncrl.engine.native.build.resolve_compile``)."""
PREWARM = CUDA_GRAPHS
"""``rollout.prewarm`` / ``NativeEngine(prewarm=...)``. ``true``: the runner of every batch/span bucket of the
static step (its CUDA graph, its compiled body) is built when the engine is built, on a K/V cache sized to
``max_seq_len``; ``auto``: on when the step runs buckets (CUDA graphs or a compiled step)."""
OVERLAP = CUDA_GRAPHS
"""``rollout.overlap`` / ``NativeEngine(overlap=...)``. ``auto``: on for CUDA devices: a static step's results are
read after the next step is launched (the host's bookkeeping overlaps the device); ``true``: on any device."""
STARTUP_TIMEOUT_S = 600.0
"""How long a started SGLang server may take to generate its first token: the default of
``sglang.startup_timeout_s`` (``asyncrl.engine.sglang.server``, which ``scripts/sglang_cpu_server.py`` imports
under SGLang's own interpreter)."""

LR_SCHEDULES = ("constant", "linear", "cosine")
"""``learner.lr_schedule`` (``asyncrl.learner.options.LRSchedule.kind``)."""
BASE_FORMATS = ("", "int8", "nvfp4", "mxfp4")
"""``learner.base_format``: the format a LoRA policy's frozen base is held in (``asyncrl.learner.packed``);
"" = fp32."""

FSYNC_POLICIES = ("always", "every_n", "rotation", "never")
"""``log.fsync``: when the trajectory log's writer syncs to disk (``asyncrl.log.trajectory``)."""
