"""Prompt text -> the exact token ids a model expects, and the tokens that end its answer.

Owns: ``task.prompt_format`` (``chat``: the tokenizer's own chat template with the generation prompt,
``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``, with an optional system
message; ``raw``: the prompt text tokenized as is; ``auto``: chat when the tokenizer has a template),
the stop tokens of a model folder (its tokenizer's EOS, ``config.json`` and
``generation_config.json``, so ``<|im_end|>`` ends a chat answer), and loading a folder's tokenizer
(``load_tokenizer``), also without torch once ``AutoTokenizer``'s choice of class is known:
``AutoTokenizer`` imports torch through transformers' config classes, resident memory the controller
has no other use for (docs/benchmarks.md §8).
Never: decides what a prompt says (tasks do) or tokenizes anywhere but in the controller: the ids
made here travel to the workers, into the trajectory log and, through replay, back to the learner,
so a run is replayed with exactly the ids it trained on.

Invariants: ``PromptEncoder.encode`` is a pure function of the prompt text (same ids every call);
in ``chat`` format the ids equal ``apply_chat_template``'s output for the same messages; a ``chat``
request for a tokenizer without a chat template is a ``ValueError`` that names ``raw`` as the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.constants import PROMPT_FORMATS
from protocols.values import require_choice


def load_tokenizer(folder: str | Path, class_name: str = "") -> Any:
    """The tokenizer of the HF folder ``folder``. Without ``class_name``: ``AutoTokenizer``'s choice.
    With ``class_name`` (``tokenizer_class_name`` of that choice, taken where torch is loaded anyway:
    the preflight child), that class of transformers is imported by name and torch is not."""
    import transformers

    if not class_name:
        return transformers.AutoTokenizer.from_pretrained(str(folder))
    cls = getattr(transformers, class_name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ValueError(f"transformers {transformers.__version__} has no tokenizer class {class_name!r} for "
                         f"{folder}; run the controller without --tokenizer-class (AutoTokenizer decides)")
    return cls.from_pretrained(str(folder))


def tokenizer_class_name(tokenizer: Any) -> str:
    """What ``load_tokenizer(folder, class_name=...)`` needs to load ``tokenizer`` (an
    ``AutoTokenizer`` result) again without torch; "" for a class outside transformers (a
    folder's own tokenizer code), which only ``AutoTokenizer`` can load."""
    cls = type(tokenizer)
    return cls.__name__ if cls.__module__.startswith("transformers.") else ""


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_prompt_format(requested: str, tokenizer: Any) -> str:
    """``chat`` or ``raw`` for ``requested`` (``auto``/``chat``/``raw``) and this tokenizer."""
    require_choice("task.prompt_format", requested, PROMPT_FORMATS)
    if requested == "auto":
        return "chat" if has_chat_template(tokenizer) else "raw"
    if requested == "chat" and not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", "this model")
        raise ValueError(f"task.prompt_format=chat, but the tokenizer of {name} has no chat template; "
                         "use task.prompt_format=raw (base models and the tiny model)")
    return requested


class PromptEncoder:
    """Tokenizes prompts once, in the format the model was trained on (module docstring)."""

    def __init__(self, tokenizer: Any, prompt_format: str = "auto", system_prompt: str = "") -> None:
        self.tokenizer = tokenizer
        self.format = resolve_prompt_format(prompt_format, tokenizer)
        if system_prompt and self.format != "chat":
            raise ValueError("task.system_prompt needs task.prompt_format=chat (a raw prompt has no system turn); "
                             "put the instruction into the prompt text or drop task.system_prompt")
        self.system_prompt = system_prompt

    def messages(self, prompt: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return head + [{"role": "user", "content": prompt}]

    def encode(self, prompt: str) -> list[int]:
        if self.format == "raw":
            return [int(i) for i in self.tokenizer(prompt)["input_ids"]]
        out = self.tokenizer.apply_chat_template(self.messages(prompt), add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5 returns a BatchEncoding
        return [int(i) for i in ids]


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def stop_token_ids(model_dir: str | Path, tokenizer: Any | None = None) -> list[int]:
    """Sorted stop tokens of the model in ``model_dir``: EOS of the tokenizer, ``config.json`` and
    ``generation_config.json`` (SmolLM2-Instruct: ``<|im_end|>``, id 2)."""
    folder = Path(model_dir)
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            ids.update(_ids(json.loads(path.read_text()).get("eos_token_id")))
    if tokenizer is not None:
        ids.update(_ids(getattr(tokenizer, "eos_token_id", None)))
    return sorted(ids)
