"""Module swapping: turn a Hugging Face Llama/Qwen2 causal LM into a quantised actor.

Owns: which linears are quantised (`is_target_linear`), the `keep_full_precision` matching rule,
`quantize_model` and the format marker `model_format` reads back.

Selection rule (shared with publication, which sees only state-dict names): a module is quantised
iff it is an `nn.Linear` whose own name is one of `TARGET_LINEARS` (the attention and MLP projections of
Llama/Qwen2/Qwen3/Mistral blocks and MoE attention and shared experts, plus the fused or differently named
projections of other families: Phi-3 qkv_proj/gate_up_proj, GPT-NeoX query_key_value/dense/dense_h_to_4h/
dense_4h_to_h, Qwen2-MoE shared_expert_gate), or, with ``head=True``
(``quant.lm_head``), the output head `lm_head`; and no `keep_full_precision` entry matches its
qualified name. An entry matches when it equals a contiguous run of dotted components of the name:
"down_proj" matches every down_proj, "layers.0" every module of block 0, "model.layers.0.mlp.up_proj"
that one module. Norms are never swapped (they are not linears). With tied embeddings a quantised head
is a quantised copy of the embedding matrix. The token embedding (`EMBED`, a lookup, not a matmul) stays
full precision unless ``embedding=True`` (``quant.embedding``): then it becomes int8 row codes
(embedding.py), in every quantised format; a tied int8 head and the embedding then share one table.

Must never: quantise anything `publish` would not, or touch modules other than the swapped linears.
Cast or move the model before converting it: `.to(dtype)` after conversion would cast float8 codes and
scales, and `.to(device)` dissolves the sibling fusion (call `fuse_siblings` again).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .embedding import QuantEmbedding
from .errors import QuantError
from .formats import check_format
from .fused import fuse_siblings
from .linear import LINEAR_CLASSES, QuantLinear

TARGET_LINEARS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "query_key_value",
    "dense",
    "dense_h_to_4h",
    "dense_4h_to_h",
    "shared_expert_gate",
)
HEAD = "lm_head"
EMBED = "model.embed_tokens"
"""The token embedding ``quant.embedding`` quantises (Llama/Qwen2/Qwen3/Mistral naming)."""
SHARED_TABLE_FORMATS = ("int8", "int8_wo")
"""Formats whose tied output head holds the embedding's own int8 row codes (embedding.py)."""
DEFAULT_KEEP_FULL_PRECISION: tuple[str, ...] = ("embed_tokens",)
_FORMAT_ATTR = "asyncrl_quant_format"


def name_matches(name: str, entry: str) -> bool:
    """True when `entry` is a contiguous run of the dotted components of `name`."""
    return f".{entry}." in f".{name}."


def is_target_linear(module_name: str, keep_full_precision: Sequence[str], *, head: bool = False) -> bool:
    """Selection rule on a module's qualified name (see the module docstring)."""
    if module_name.rsplit(".", 1)[-1] not in TARGET_LINEARS and not (head and module_name == HEAD):
        return False
    return not any(name_matches(module_name, e) for e in keep_full_precision)


def is_target_weight(tensor_name: str, keep_full_precision: Sequence[str], *, head: bool = False) -> bool:
    """Selection rule on a state-dict key (`<module>.weight`)."""
    return tensor_name.endswith(".weight") and is_target_linear(
        tensor_name[: -len(".weight")], keep_full_precision, head=head
    )


def quantizes_head(model: nn.Module) -> bool:
    """Whether `quantize_model` swapped the output head of `model` (``head=True``)."""
    return isinstance(getattr(model, HEAD, None), QuantLinear)


def quantizes_embedding(model: nn.Module) -> bool:
    """Whether `quantize_model` turned the token embedding into int8 codes (``embedding=True``)."""
    return isinstance(module_or_none(model, EMBED), QuantEmbedding)


def module_or_none(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule ``name`` of ``model``, or None."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def model_format(model: nn.Module) -> str:
    """The format `quantize_model` converted `model` to ("fp32" for an unconverted model)."""
    return getattr(model, _FORMAT_ATTR, "fp32")


def quantize_model(
    model: nn.Module,
    fmt: str,
    *,
    keep_full_precision: Sequence[str] = DEFAULT_KEEP_FULL_PRECISION,
    fp8_activations: bool = True,
    head: bool = False,
    embedding: bool = False,
) -> nn.Module:
    """Swap the attention/MLP projections of `model` for quantised linears, in place.

    fp32 leaves the model untouched. bf16 stores the swapped weights in bf16 and runs their matmul
    in bf16 (input cast to bf16, output cast back, bias added in full precision); everything else
    stays in the model's dtype. `fp8_activations` chooses W8A8 (True, default) or weight-only fp8.
    The q/k/v and gate/up siblings are fused (fused.py; fp32 excepted); after moving the model to
    another device call `asyncrl.quant.fuse_siblings(model)` again. ``head=True`` also swaps `lm_head`
    (the selection rule in the module docstring); publish with the same ``head``. ``embedding=True`` also
    turns `EMBED` into int8 row codes (`QuantEmbedding`; publish with the same ``embedding``).
    Returns `model`. Raises QuantError for a model already converted or without any target linear.
    """
    check_format(fmt)
    if model_format(model) != "fp32":
        raise QuantError(
            f"model is already converted to {model_format(model)!r}; convert a fresh full-precision "
            "model (quantising twice would compound the rounding)"
        )
    if fmt == "fp32":
        return model
    cls = LINEAR_CLASSES[fmt]
    opts = {"act_quant": fp8_activations} if fmt == "fp8" else {}
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and is_target_linear(name, keep_full_precision, head=head)
    ]
    if not targets:
        raise QuantError(
            f"no attention/MLP projection ({', '.join(TARGET_LINEARS)}) found outside "
            f"keep_full_precision={tuple(keep_full_precision)}; expected a Llama/Qwen2 causal LM"
        )
    emb = None
    if embedding:
        found = module_or_none(model, EMBED)
        if not isinstance(found, nn.Embedding):
            raise QuantError(f"quant.embedding quantises the token embedding {EMBED!r}, which this model does not "
                             "have as an nn.Embedding; set quant.embedding=false")
        emb = found
    head_mod = getattr(model, HEAD, None)
    shared = (emb is not None and head and fmt in SHARED_TABLE_FORMATS and isinstance(head_mod, nn.Linear)
              and head_mod.weight is emb.weight)
    # Quantise everything first so a bad weight leaves the model untouched.
    swapped: list[tuple[str, nn.Module]] = [
        (name, cls.from_linear(mod, name=f"{name}.weight", **opts)) for name, mod in targets]
    if emb is not None and not shared:
        swapped.append((EMBED, QuantEmbedding.from_embedding(emb, name=f"{EMBED}.weight")))
    elif emb is not None:
        swapped.append((EMBED, QuantEmbedding.sharing(dict(swapped)[HEAD], emb)))
    for name, qmod in swapped:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, qmod)
    fuse_siblings(model)
    setattr(model, _FORMAT_ATTR, fmt)
    return model
