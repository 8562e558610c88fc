"""The embedded default model: a tiny character-level Qwen2 built locally from a seed, never downloaded.

Owns: the byte vocabulary, the HF tokenizer (``tokenizers`` byte-level BPE without merges, i.e. one token
per UTF-8 byte, saved as ``PreTrainedTokenizerFast`` so ``AutoTokenizer.from_pretrained(folder)`` works), the model config, the
seeded initialisation, and ``make_tiny_model`` / ``ensure_tiny_model``.

Must never: depend on transformers' own weight initialisation (it may change between releases) or on
torch's global RNG; weights come from a private ``torch.Generator`` seeded with ``seed``.

Invariants: the same seed (and the same pinned transformers/safetensors/tokenizers) gives the same bytes
in every file; vocab size of the model equals the tokenizer's, so every sampled id decodes.
Token ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``<unk>`` (never produced), then one id per byte:
``id = 4 + byte`` (so ``"0"`` is 52, ``"+"`` is 47, ``" "`` is 36, ``"\\n"`` is 14). Any text round-trips.
The tokenizer prepends ``<bos>`` when ``add_special_tokens=True`` (the default).
"""

from __future__ import annotations

from pathlib import Path

import torch

from asyncrl.models._files import default_models_dir, ensure_folder

TINY_NAME = "tiny-qwen2-char"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
TINY_ARCH = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
INIT_STD = 0.02


def byte_alphabet() -> list[str]:
    """The 256 byte-level symbols (GPT-2 ``bytes_to_unicode``), in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_tiny_tokenizer():
    """Byte-level ``PreTrainedTokenizerFast`` with no merges: one token per UTF-8 byte, plus specials.

    It is exactly the pipeline transformers' ``Qwen2Tokenizer`` rebuilds from ``vocab`` + ``merges`` (NFC,
    Qwen2 split regex, ByteLevel), so ``AutoTokenizer.from_pretrained(folder)`` (which picks
    ``Qwen2Tokenizer`` for model_type qwen2) and ``tokenizers.Tokenizer.from_file`` agree on every string.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(byte_alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=TINY_ARCH["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def tiny_config():
    """The ``Qwen2Config`` of the tiny model (about 0.8M parameters, untied embeddings)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(SPECIAL_TOKENS) + 256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        **TINY_ARCH,
    )


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Seeded init in place: norms 1, biases 0, every other tensor N(0, 0.02) (tied tensors drawn once)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # named_parameters yields a tied tensor once
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param.dtype) * INIT_STD)
    return model


def build_tiny_model(seed: int = 0):
    """A freshly initialised ``Qwen2ForCausalLM`` (fp32): N(0, 0.02) matrices, zero biases, unit norms."""
    from transformers import Qwen2ForCausalLM

    return init_weights(Qwen2ForCausalLM(tiny_config()).float(), seed).eval()


def make_tiny_model(out: str | Path, seed: int = 0) -> Path:
    """Write the tiny model + tokenizer as an HF folder at ``out`` (created; must be empty or absent)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(seed)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    build_tiny_tokenizer().save_pretrained(out)
    return out


def ensure_tiny_model(folder: str | Path | None = None, seed: int = 0) -> Path:
    """Return an HF folder with the tiny model, building it on first use (atomic; never downloads).

    ``folder`` defaults to ``default_models_dir() / f"tiny-qwen2-char-seed{seed}"``.
    """
    folder = Path(folder) if folder is not None else default_models_dir() / f"{TINY_NAME}-seed{seed}"
    return ensure_folder(folder, lambda tmp: make_tiny_model(tmp, seed))
