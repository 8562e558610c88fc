"""The docs name only configuration keys that exist, and the defaults they quote are the code's.

Every key and its default has one home, ``asyncrl/config/schema.py`` (the objective's options:
``asyncrl/config/algo.py``); README.md says so. The pages may name keys and, rarely, quote a default;
these tests keep such quotes from drifting:

* every backticked ``section.key`` (or ``section.key=value``) in README.md and docs/*.md whose section is
  a section of the run's config is a key of the schema (a free-form dict key below one, such as
  ``task.rg_config.max_digits``, counts), or a setting of ``asyncrl worker`` (``WorkerRoleConfig``);
* a default quoted in the forms the pages use (`` `key`, default `v` ``, `` `key=v`, the default ``,
  `` `key`, off/on by default ``, `` `key` empty, the default ``) equals what ``asyncrl train`` runs with;
* the ``ObjectiveConfig`` table of docs/algorithms.md §15 lists every field with its dataclass default.

Never: edits a page, or compares a figure (benchmarks are measurements, not defaults).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KEY = re.compile(r"`\+?(?P<key>[a-z_]+(?:\.[a-z_0-9]+)+)(?:=(?P<value>[^`]*))?`")
NOT_KEYS = {
    "learner.lrr",  # README's example of a mistyped key (the error suggests learner.lr)
    "model.norm", "model.embed_tokens.weight",  # module names of a Hugging Face Qwen2
    "model.safetensors", "learner.json", "learner.png",  # file names
}
QUOTED_DEFAULT = [
    re.compile(r"`(?P<key>[a-z_]+\.[a-z_.]+)`,? default `(?P<value>[^`]+)`"),
    re.compile(r"`(?P<key>[a-z_]+\.[a-z_.]+)=(?P<value>[^`]+)`,? the default"),
    re.compile(r"`(?P<key>[a-z_]+\.[a-z_.]+)(?:=[^`]*)?`,? (?P<value>off|on) by default"),
    re.compile(r"`(?P<key>[a-z_]+\.[a-z_.]+)` (?P<value>empty), the default"),
]


def schema_keys() -> dict[str, Any]:
    from asyncrl.config.loader import schema_keys as keys

    return keys()


def worker_keys() -> set[str]:
    from asyncrl.config.roles import WorkerRoleConfig, role_keys

    return set(role_keys(WorkerRoleConfig))


def mentioned_keys() -> list[tuple[str, str]]:
    keys = schema_keys()
    sections = {k.split(".")[0] for k in keys}
    out = []
    for page in PAGES:
        for m in KEY.finditer(page.read_text()):
            if m.group("key").split(".")[0] in sections:
                out.append((str(page.relative_to(ROOT)), m.group("key")))
    return out


def test_every_config_key_the_docs_name_exists():
    keys = schema_keys()
    known = set(keys) | worker_keys() | NOT_KEYS
    unknown = sorted({f"{page}: {key}" for page, key in mentioned_keys()
                      if key not in known and not any(key.startswith(k + ".") for k in keys)})
    assert not unknown, f"these keys are not in asyncrl/config/schema.py: {unknown}"


def parse(text: str) -> Any:
    text = text.strip().strip("`").strip('"')
    words = {"none": None, "null": None, "true": True, "on": True, "false": False, "off": False, "empty": "",
             "()": ()}
    if text.lower() in words:
        return words[text.lower()]
    try:
        return float(text) if any(c in text for c in ".e") or not text.lstrip("-").isdigit() else int(text)
    except ValueError:
        return text


def same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(a) == tuple(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def run_default(cfg: Any, dotted: str) -> Any:
    value = cfg
    for part in dotted.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


def test_defaults_quoted_in_the_docs_are_what_asyncrl_train_runs_with():
    from asyncrl.config.loader import load_train_config

    cfg = load_train_config([])
    quoted, wrong = 0, []
    for page in PAGES:
        for line in page.read_text().splitlines():
            for rx in QUOTED_DEFAULT:
                for m in rx.finditer(line):
                    quoted += 1
                    key, value = m.group("key"), parse(m.group("value"))
                    actual = run_default(cfg, key)
                    if not same(actual, value) and not (value == "" and actual in ("", None)):
                        wrong.append(f"{page.relative_to(ROOT)}: {key} quoted as {value!r}, the default is {actual!r}")
    assert quoted >= 3, "the quoted-default forms no longer match anything; update QUOTED_DEFAULT"
    assert not wrong, wrong


def objective_table() -> list[tuple[list[str], str]]:
    text = (ROOT / "docs" / "algorithms.md").read_text()
    table = text.split("### `ObjectiveConfig` (frozen)", 1)[1].split("\n\n", 2)[1]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((re.findall(r"`([a-z_]+)`", cells[0]), cells[1]))
    return rows


def test_the_objective_config_table_lists_every_field_with_its_default():
    from asyncrl.algo import ObjectiveConfig

    defaults = {f.name: f.default for f in dataclasses.fields(ObjectiveConfig)}
    rows = objective_table()
    listed = [name for names, _ in rows for name in names]
    assert sorted(listed) == sorted(defaults), f"table vs ObjectiveConfig fields: {set(listed) ^ set(defaults)}"
    for names, cell in rows:
        head = cell.split("→")[0].split(" (")[0]
        values = [parse(v) for v in re.split(r",\s*", head.strip())]
        if len(values) == 1:
            values = values * len(names)
        assert len(values) == len(names), f"cannot read the defaults of {names}: {cell!r}"
        for name, value in zip(names, values, strict=True):
            assert same(defaults[name], value), f"docs/algorithms.md §15: {name} default {value!r}, code {defaults[name]!r}"


@pytest.mark.parametrize("text,value", [("`None`", None), ('`"acr"`', "acr"), ("4e-4", 4e-4), ("2.0", 2.0),
                                        ("`()`", ()), ("`True`", True), ("8", 8)])
def test_the_default_reader(text: str, value: Any):
    assert same(parse(text), value) and type(parse(text)) is type(value)
