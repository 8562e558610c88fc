"""Load a run configuration: Hydra compose -> merge onto the structured schema -> dataclasses.

Owns: turning ``key=value`` overrides and the YAML groups in ``configs/`` into a validated
``TrainConfig``, and writing the resolved config of a run and building it again from that JSON (a run
folder's ``config.json`` is read back by ``workers/run_config.py``).
Never: returns a ``DictConfig``; lets a Hydra/OmegaConf exception escape without saying which key
to change (they become ``ValueError``; a value of the wrong type names the key, the type, the value and
what the key accepts: ``wrong_type_message``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.config.schema import TrainConfig, to_dict, validate

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
GROUPS = ("model", "task", "algo", "quant", "rollout", "learner")
GLOBAL_GROUPS = ("experiment",)
"""Groups whose files set keys anywhere (``# @package _global_``), chosen with ``+experiment=NAME``."""


def schema_keys(schema: type = TrainConfig, prefix: str = "") -> dict[str, type | None]:
    """Every dotted key of ``schema`` -> its dataclass type for sections, ``None`` for leaves."""
    out: dict[str, type | None] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            out[key] = kind
            out |= schema_keys(kind, prefix=f"{key}.")
        else:
            out[key] = None
    return out


def nearest_key(key: str, known: Sequence[str]) -> str | None:
    """The valid key closest to ``key`` (same section first, then by leaf name, then anywhere); a leaf that only
    lacks a prefix (``slots`` of ``rollout.worker_slots``) is close. Of keys sharing a leaf name the first in
    ``known`` (schema order) is named: a worker's ``device`` is ``rollout.device``, not ``sglang.device``."""
    section, _, leaf = key.rpartition(".")
    same = [k for k in known if k.rpartition(".")[0] == section]
    for pool, word, name in ((same, key, lambda k: k), (list(known), leaf, lambda k: k.rpartition(".")[2]),
                             (list(known), key, lambda k: k)):
        names: dict[str, str] = {}
        for k in pool:
            names.setdefault(name(k), k)
        hit = difflib.get_close_matches(word, list(names), n=1, cutoff=0.6)
        if hit:
            return names[hit[0]]
    return next((k for k in known if k.endswith(f"_{leaf}")), None)


def check_known_keys(tree: Any, *, source: str = "configuration", schema: type = TrainConfig,
                     where: str = "A '+' never adds a key: every valid key is in asyncrl/config/schema.py") -> None:
    """``ValueError`` for the first key of ``tree`` (nested dicts) that ``schema`` does not have, naming the
    nearest valid key, then ``where`` (where the valid keys are listed). Values of dict-typed keys (free-form settings) are
    not checked. ``asyncrl worker`` / ``asyncrl learner`` check their settings here too
    (``asyncrl.config.roles``)."""
    known = schema_keys(schema)

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, dict):
            return
        for k, v in node.items():
            key = f"{prefix}{k}"
            if key not in known:
                near = nearest_key(key, list(known))
                hint = f"did you mean {near}?" if near else "no valid key is close to it."
                raise ValueError(f"unknown configuration key {key!r} (in the {source}); {hint} {where}")
            if known[key] is not None:
                walk(v, f"{key}.")

    walk(tree, "")


def leaf_field(key: str, schema: type = TrainConfig) -> tuple[Any, Any] | None:
    """The annotated type (``X | None`` unwrapped to ``X``) and the default of the dotted leaf ``key`` of
    ``schema``; ``None`` when ``key`` is not a leaf of it."""
    node: Any = schema
    for part in key.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return None
        f, node = fields[part], typing.get_type_hints(node)[part]
    if isinstance(node, type) and dataclasses.is_dataclass(node):
        return None
    args = [a for a in typing.get_args(node) if a is not type(None)]
    if typing.get_origin(node) in (typing.Union, types.UnionType) and len(args) == 1:
        node = args[0]
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    return node, default


def wrong_type_message(key: str, given: str, kind: Any, default: Any = None,
                       table: dict[str, tuple[str, str]] | None = None) -> str:
    """One line for a value of the wrong type: the key, the value as given, the type the key takes and what
    it accepts (true/false; a whole number; a number), with its range from ``table`` (``RANGES`` of
    ``asyncrl/config/ranges.py`` unless told) when it has one, in the words of the range errors."""
    from asyncrl.config.ranges import INTERVALS, RANGES

    table = RANGES if table is None else table
    allowed = f"; allowed: {INTERVALS[key].describe()} ({table[key][1]})" if key in table else ""
    example = f", e.g. {key}={default}" if default is not None and not isinstance(default, bool) else ""
    origin = typing.get_origin(kind) or kind
    if kind is bool:
        return f"{key}={given} is not a bool; allowed: true or false"
    if kind is int:
        return (f"{key}={given} is not an int; it must be a whole number, written without a decimal point or "
                f"exponent{example}{allowed}")
    if kind is float:
        return f"{key}={given} is not a float; it must be a number{example}{allowed}"
    if origin in (list, tuple):
        items = ",".join(map(str, default)) if default else "a,b"
        return f"{key}={given} is not a list; give one in brackets, e.g. {key}=[{items}] ({key}=[] for none)"
    if origin is dict:
        return f"{key}={given} is not a mapping; give one in braces, e.g. {key}={{name: value}}"
    return f"{key}={given} is not {getattr(kind, '__name__', kind)}"


def parse_bool(key: str, value: str) -> bool:
    """``true``/``false`` (any case) as a bool; anything else is a ``ValueError`` naming ``key`` and both."""
    word = value.strip().lower()
    if word not in ("true", "false"):
        raise ValueError(wrong_type_message(key, value, bool))
    return word == "true"


def type_error(error: BaseException, overrides: Sequence[str] = (), schema: type = TrainConfig,
               table: dict[str, tuple[str, str]] | None = None) -> str | None:
    """``wrong_type_message`` for a Hydra/OmegaConf error that is a value of the wrong type for a leaf key of
    ``schema`` (the error itself, or the cause Hydra wraps as "Error merging override"); the value as the
    last of ``overrides`` that sets the key wrote it. ``None`` for any other error."""
    from omegaconf.errors import ValidationError

    cause = error if isinstance(error, ValidationError) else error.__cause__
    key = getattr(cause, "full_key", None) if isinstance(cause, ValidationError) else None
    leaf = leaf_field(key, schema) if isinstance(key, str) else None
    if key is None or leaf is None:
        return None
    given = [ov.split("=", 1)[1] for ov in overrides if "=" in ov and ov.split("=", 1)[0].lstrip("+~") == key]
    value = getattr(cause, "value", None)
    return wrong_type_message(key, given[-1] if given else str(value), *leaf, table=table)


def structured(source: Any = TrainConfig) -> Any:
    """``OmegaConf.structured(source)`` (the schema class, or a ``TrainConfig``) with every section
    writable: library configs nested in the schema (``asyncrl.algo.AlgoConfig``) are frozen
    dataclasses, which OmegaConf would otherwise make read-only nodes that no override can change."""
    from omegaconf import DictConfig, OmegaConf

    node = OmegaConf.structured(source)

    def writable(n: Any) -> None:
        OmegaConf.set_readonly(n, False)
        if isinstance(n, DictConfig):
            for key in n:
                child = n._get_node(key)
                if OmegaConf.is_config(child):
                    writable(child)

    writable(node)
    return node


def to_train_config(node: Any) -> TrainConfig:
    """The ``TrainConfig`` of a composed node; a section's own validation error (a library config
    refusing a value) names the section's key, e.g. ``algo.eps_low=...``."""
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.to_object(node)
    except ValueError as e:
        raise ValueError(_with_section(str(e))) from None
    assert isinstance(cfg, TrainConfig)
    return cfg


def _with_section(message: str) -> str:
    """``eps_low=2.0 must ...`` -> ``algo.eps_low=2.0 must ...`` when one section has that leaf."""
    head = message.split("=", 1)[0].split(" ", 1)[0]
    keys = [k for k in schema_keys() if k.rpartition(".")[2] == head and "." in k]
    return f"{keys[0].rpartition('.')[0]}.{message}" if len(keys) == 1 and message.startswith(head) else message


def _group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def load_train_config(overrides: Sequence[str] = (), *, config_name: str = "train") -> TrainConfig:
    """Compose ``configs/<config_name>.yaml`` with ``overrides`` and validate the result."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for ov in overrides:
        key = ov.split("=", 1)[0].lstrip("+~")
        if "=" not in ov:
            raise ValueError(f"override {ov!r} is not key=value (e.g. rollout.eta=2 or algo=tbpo)")
        if key in GROUPS + GLOBAL_GROUPS:
            choice = ov.split("=", 1)[1]
            if choice not in _group_options(key):
                more = "" if key in GLOBAL_GROUPS else f" (or set single keys, e.g. {key}.X=...)"
                raise ValueError(f"{key}={choice!r} is not a config in configs/{key}/; choose one of "
                                 f"{', '.join(_group_options(key))}{more}")
            if key in GLOBAL_GROUPS and not ov.startswith("+"):
                raise ValueError(f"{key} is an optional group: write +{ov}")
        elif "." in key or key in schema_keys():
            check_known_keys(_nested(key), source=f"override {ov!r}")
        else:
            check_known_keys({key: None}, source=f"override {ov!r}")
    ConfigStore.instance().store(name="train_schema", node=structured())
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            composed = compose(config_name=config_name, overrides=list(overrides))
        tree = OmegaConf.to_container(composed, resolve=False)
        check_known_keys(tree, source="composed configuration (an override or a configs/ file)")
        merged = OmegaConf.merge(structured(), composed)
        cfg = to_train_config(merged)
    except (HydraException, OmegaConfBaseException) as e:
        message = type_error(e, overrides) or unquoted_value(overrides) or f"bad configuration: {e}".replace("\n", " ")
        raise ValueError(message) from None
    return validate(cfg)


def unquoted_value(overrides: Sequence[str]) -> str:
    """The first override Hydra's grammar cannot read, with the quoting that makes it readable (a value with
    letters outside ASCII, spaces or brackets must be quoted), or "" when every one parses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for ov in overrides:
        try:
            parser.parse_override(ov)
        except HydraException:
            key, _, value = ov.partition("=")
            quoted = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
            return (f"override {ov!r} cannot be read: a value with characters other than ASCII letters, digits and "
                    f"-_./:+@ must be quoted, {key}={quoted} (in a shell: \"{key}={quoted}\")")
    return ""


def is_global(path: Path) -> bool:
    """A group file that sets keys of several sections (``# @package _global_`` in its header)."""
    head = [line for line in path.read_text().splitlines()[:5] if line.startswith("#")]
    return any("@package _global_" in line for line in head)


def _nested(dotted: str) -> dict[str, Any]:
    head, _, rest = dotted.partition(".")
    return {head: _nested(rest) if rest else None}


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True))


def config_from_dict(data: dict) -> TrainConfig:
    """Rebuild a ``TrainConfig`` from ``to_dict`` output (a run folder's config.json)."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(structured(), OmegaConf.create(data))
    return validate(to_train_config(merged))


def apply_overrides(cfg: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    """``cfg`` with ``key=value`` and ``group=choice`` overrides applied on top (replay, resume tools).

    A group choice merges that group's YAML delta onto the run's values, so ``algo=tbpo`` changes
    the objective and what the tbpo file sets, and keeps the rest of the run's algo settings.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = structured(cfg)
    dotlist = []
    for ov in overrides:
        if "=" not in ov:
            raise ValueError(f"override {ov!r} is not key=value (e.g. learner.lr=1e-4 or algo=tbpo)")
        key, value = ov.split("=", 1)
        if key.lstrip("+~") not in GROUPS:
            check_known_keys(_nested(key.lstrip("+~")), source=f"override {ov!r}")
        if key in GROUPS:
            path = CONFIG_DIR / key / f"{value}.yaml"
            if not path.is_file():
                raise ValueError(f"{key}={value!r} is not a config in configs/{key}/; choose one of "
                                 f"{', '.join(_group_options(key))}")
            loaded = OmegaConf.to_container(OmegaConf.load(path))
            if not isinstance(loaded, dict):
                raise ValueError(f"{path} must be a YAML mapping of keys (like the other files in configs/{key}/)")
            delta = {k: v for k, v in loaded.items() if k != "defaults"}
            merged = OmegaConf.merge(merged, delta if is_global(path) else {key: delta})
        else:
            dotlist.append(ov)
    try:
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(dotlist))
        out = to_train_config(merged)
    except OmegaConfBaseException as e:
        raise ValueError(type_error(e, overrides) or f"bad override: {e}".replace("\n", " ")) from None
    return validate(out)
