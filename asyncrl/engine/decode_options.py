"""The values of the native engine's decode-step settings, shared by the config, the worker and the engine.

Owns: ``DECODE_STEPS`` (``rollout.decode_step`` / ``NativeEngine(decode_step=...)``) and ``CUDA_GRAPHS``
(``rollout.cuda_graphs`` / ``NativeEngine(cuda_graphs=...)``).

Must never: import torch or any other engine module (``asyncrl.config.schema`` reads it at startup).
"""

from __future__ import annotations

DECODE_STEPS = ("auto", "static", "eager")
"""``static``: static shapes, no host sync (``asyncrl.engine.native.static_step``); ``eager``: the reference path
(``DecoderRunner.decode``); ``auto``: static for a natively supported model."""
CUDA_GRAPHS = ("auto", "true", "false")
"""``auto``: CUDA graphs of the static step on CUDA devices; ``true``: CUDA only (refused on a CPU)."""
