"""The models benchmarks build or load, and the rollout workload's prompts.

Owns: the 22M random Qwen2 with the proportions of Qwen2-0.5B (``QWEN2_22M``, ``build_qwen2_22m``),
random-weight models of real Hub shapes built on a device (``SHAPES``: Qwen2.5-0.5B, Qwen2.5-1.5B and
SmolLM2-135M, as published; ``build_shape``), the kernels a converted model's linears run (``kernel_counts``),
the tiny and SmolLM2 folders (``model_folder``, ``load_model``, ``load_fp32``), and the rollout workload's
requests in a model's own prompt format (``RolloutPrompts``).
Never: downloads anything (weights are drawn, converted from an installed package or built from a seed).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from asyncrl.bench.report import ROOT

QWEN2_22M: dict[str, Any] = dict(vocab_size=4096, hidden_size=512, intermediate_size=2816, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                                 tie_word_embeddings=True)
"""A Qwen2 of 22.0M parameters with Qwen2-0.5B's proportions (MLP 5.5x hidden, 2 KV heads, tied embeddings)."""

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                   rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
}
ROLLOUT_QUESTIONS = ("What is 17 - 25?", "Compute 6 * 7 - 9.", "What is the sum of 48 and 75?",
                     "Is 91 a prime number? Explain briefly.", "What is 3 + 4 * 5?", "Compute -8 - 13.",
                     "What is half of 126?", "Add 19, 23 and 8.")


def build_qwen2_22m(seed: int = 0) -> Any:
    """``QWEN2_22M`` with seeded random fp32 weights, in eval mode (the same model in every process)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**QWEN2_22M)).eval()


def build_shape(shape: str, device: str, *, layers: int | None = None, seed: int = 0) -> Any:
    """A random-weight fp32 causal LM of ``shape``'s config, built on ``device``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if shape not in SHAPES:
        raise SystemExit(f"--shapes: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    kind, kw = SHAPES[shape]
    kw = dict(kw)
    if layers:
        kw["num_hidden_layers"] = min(layers, kw["num_hidden_layers"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**kw)) if kind == "qwen2" else LlamaForCausalLM(LlamaConfig(**kw))
    model.eval()
    model.generation_config.eos_token_id = None  # random weights: exactly --new-tokens tokens
    model.generation_config.pad_token_id = 0
    return model


def kernel_counts(model: Any) -> str:
    """``kernel:count`` of the quantized linears of ``model`` (``nn.Linear`` when it has none)."""
    from asyncrl.quant.linear import QuantLinear

    c = Counter(m.kernel for m in model.modules() if isinstance(m, QuantLinear))
    return ",".join(f"{k}:{n}" for k, n in sorted(c.items())) or "nn.Linear"


def model_folder(spec: str) -> Path:
    """The HF folder of ``tiny`` (built from seed 0 under the repository's ``.cache/models``, where a run
    started from the repository root keeps it), ``smollm2`` (converted on first use) or ``spec``, a folder."""
    from asyncrl.models import ensure_smollm2, ensure_tiny_model

    if spec == "tiny":
        return ensure_tiny_model(ROOT / ".cache" / "models" / "tiny-qwen2-char-seed0", seed=0)
    return ensure_smollm2() if spec == "smollm2" else Path(spec)


def load_model(spec: str) -> tuple[Any, Any, str]:
    """(model in eval mode, tokenizer, folder) of ``model_folder(spec)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(model_folder(spec))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return model, AutoTokenizer.from_pretrained(folder), folder


def load_fp32(spec: str) -> Any:
    """``model_folder(spec)`` loaded in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_folder(spec)), dtype=torch.float32)


class RolloutPrompts:
    """The rollout workload's requests: questions in the model's own prompt format, its stop tokens."""

    def __init__(self, tok: Any, folder: str) -> None:
        from asyncrl.tasks.prompts import PromptEncoder, stop_token_ids

        enc = PromptEncoder(tok, "auto")
        self.format = enc.format
        self.ids = [enc.encode(q) for q in ROLLOUT_QUESTIONS]
        self.stops = tuple(stop_token_ids(folder, tok))
        if not self.stops:
            raise SystemExit(f"{folder}: no EOS id in its tokenizer, config.json or generation_config.json; the "
                             "rollout workload needs a stop token (use --workloads fixed)")

    def prompt(self, i: int) -> list[int]:
        return self.ids[i % len(self.ids)]
