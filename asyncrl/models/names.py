"""A model's tensors in the names of its checkpoint files, from the names transformers 5 gives them at run time.

Owns: ``checkpoint_state_dict``: transformers' own reverse weight conversion (the one ``save_pretrained``
applies) on a state dict, for a model given by its config. Transformers 5 fuses some checkpoint tensors on
load (a Qwen3-MoE's ``mlp.experts.{e}.gate_proj/up_proj.weight`` become ``mlp.experts.gate_up_proj
[E, 2I, H]``; Mixtral's ``block_sparse_moe.experts.{e}.w1/w2/w3`` likewise) and other programs (SGLang,
vLLM, older transformers) read the checkpoint names.

Must never: copy tensors it can view (a split of a fused tensor is a view of it), or build real weights: the
conversion reads a meta-device model of the config (no memory), cached for the last config asked.

Invariants: for a model ``m``, ``checkpoint_state_dict(m.config, m.state_dict())`` has exactly the keys
``m.save_pretrained`` writes (a tied ``lm_head.weight`` included when given), with the same values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_META: dict[str, Any] = {}


def _meta_model(config: Any) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    values = config.to_dict() if isinstance(config, PretrainedConfig) else dict(config)
    key = json.dumps(values, sort_keys=True, default=str)
    if key not in _META:
        if not isinstance(config, PretrainedConfig):
            values = dict(values)
            config = AutoConfig.for_model(values.pop("model_type"), **values)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        _META.clear()
        _META[key] = model
    return _META[key]


def checkpoint_state_dict(config: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (runtime names) in checkpoint names; ``config``: the model's ``PretrainedConfig`` or its
    config.json values. A model transformers converts nothing for comes back as given."""
    from transformers.core_model_loading import revert_weight_conversion

    if not (config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)):
        raise ValueError("the model's config has no model_type; pass the config.json of the model folder")
    return dict(revert_weight_conversion(_meta_model(config), dict(state)))
