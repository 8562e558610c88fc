"""The wire schema against its checked-in table: a Struct's fields change only with the protocol version.

``wire_schema.json`` (next to this file) holds, per protocol version, every Struct that can cross a
socket (the ``Message`` union and each Struct nested in it): its tag, ``array_like``, and its fields
in order as ``[name, type, default]`` (default ``null``: required). The test reads the Structs as
msgspec sees them (``msgspec.inspect``) and compares them with the table of ``PROTOCOL_VERSION``, and
checks that consecutive versions of the same major follow the evolution rules of
``protocols/messages.py`` (fields only appended, with defaults; tags unchanged; nothing removed).

After a deliberate change: bump ``PROTOCOL_MINOR`` (fields appended with defaults) or ``PROTOCOL_MAJOR``
(anything else) in ``protocols/messages.py``, then add the new version's table with
``python -m tests.unit.protocols.test_schema --write`` (it never rewrites a version already there).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

import protocols as P

TABLE = Path(__file__).with_name("wire_schema.json")
FIX = ("bump PROTOCOL_MINOR in protocols/messages.py (fields appended with defaults; PROTOCOL_MAJOR for "
       "anything else) and add the new version's table with `python -m tests.unit.protocols.test_schema --write`")

Schema = dict[str, dict[str, Any]]


def type_name(t: mi.Type) -> str:
    """A msgspec type as a short, stable string (``list[int]``, ``WorkerSetup | None``, ...)."""
    if isinstance(t, mi.StructType):
        return t.cls.__name__
    if isinstance(t, mi.UnionType):
        return " | ".join(type_name(u) for u in t.types)
    if isinstance(t, mi.ListType):
        return f"list[{type_name(t.item_type)}]"
    if isinstance(t, mi.VarTupleType):
        return f"tuple[{type_name(t.item_type)}, ...]"
    if isinstance(t, mi.TupleType):
        return f"tuple[{', '.join(type_name(u) for u in t.item_types)}]"
    if isinstance(t, mi.DictType):
        return f"dict[{type_name(t.key_type)}, {type_name(t.value_type)}]"
    simple = {mi.StrType: "str", mi.IntType: "int", mi.FloatType: "float", mi.BoolType: "bool",
              mi.BytesType: "bytes", mi.NoneType: "None", mi.AnyType: "Any"}
    for kind, name in simple.items():
        if isinstance(t, kind):
            return name
    raise TypeError(f"no table name for the msgspec type {t!r}; extend type_name()")


def default_text(f: mi.Field) -> str | None:
    if f.required:
        return None
    if f.default_factory is not msgspec.NODEFAULT:
        return f"{f.default_factory.__name__}()"
    if f.default == P.PROTOCOL_VERSION:  # Reject.server_version: the version itself, the same in every table
        return "PROTOCOL_VERSION"
    return repr(f.default)


def _structs(t: mi.Type, out: dict[str, mi.StructType]) -> None:
    if isinstance(t, mi.StructType):
        if t.cls.__name__ in out:
            return
        out[t.cls.__name__] = t
        for f in t.fields:
            _structs(f.type, out)
    elif isinstance(t, mi.UnionType):
        for u in t.types:
            _structs(u, out)
    elif isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        _structs(t.item_type, out)
    elif isinstance(t, mi.TupleType):
        for u in t.item_types:
            _structs(u, out)
    elif isinstance(t, mi.DictType):
        _structs(t.key_type, out)
        _structs(t.value_type, out)


def current_schema() -> Schema:
    """Every Struct reachable from ``protocols.Message``, as the table writes it."""
    found: dict[str, mi.StructType] = {}
    _structs(mi.type_info(P.Message), found)
    return {name: {"tag": st.tag, "array_like": st.array_like,
                   "fields": [[f.name, type_name(f.type), default_text(f)] for f in st.fields]}
            for name, st in sorted(found.items())}


def evolution_errors(old: Schema, new: Schema) -> list[str]:
    """Where ``new`` breaks the evolution rules against ``old`` (both of the same major version)."""
    errors = []
    for name, was in old.items():
        now = new.get(name)
        if now is None:
            errors.append(f"{name} was removed")
            continue
        if (now["tag"], now["array_like"]) != (was["tag"], was["array_like"]):
            errors.append(f"{name}: tag/array_like changed from {was['tag']!r}/{was['array_like']} "
                          f"to {now['tag']!r}/{now['array_like']}")
        kept, added = now["fields"][:len(was["fields"])], now["fields"][len(was["fields"]):]
        if kept != was["fields"]:
            errors.append(f"{name}: existing fields changed (name, type, default or order): "
                          f"{was['fields']} -> {kept}")
        errors += [f"{name}.{f[0]} was appended without a default" for f in added if f[2] is None]
        if now["array_like"] and added:
            errors.append(f"{name} is array_like: appending fields changes its wire layout")
    return errors


def _table() -> dict[str, Schema]:
    return json.loads(TABLE.read_text())


def _key(version: str) -> tuple[int, int]:
    return P.parse_version(version)


def test_the_structs_match_the_table_of_this_protocol_version():
    table = _table()
    assert P.PROTOCOL_VERSION in table, (
        f"wire_schema.json has no table for protocol {P.PROTOCOL_VERSION}; add it with "
        "`python -m tests.unit.protocols.test_schema --write`")
    want, got = table[P.PROTOCOL_VERSION], current_schema()
    changed = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
    detail = "; ".join(f"{n}: table {want.get(n)} != code {got.get(n)}" for n in changed)
    assert not changed, f"the wire Structs {changed} differ from the table of protocol {P.PROTOCOL_VERSION}: " \
                        f"{FIX}. Differences: {detail}"


def test_the_tables_of_one_major_version_follow_the_evolution_rules():
    versions = sorted(_table(), key=_key)
    assert versions and _key(versions[0])[1] <= P.PROTOCOL_FLOOR_MINOR, "the floor's table must stay in the file"
    table = _table()
    for old, new in zip(versions, versions[1:], strict=False):
        if _key(old)[0] == _key(new)[0]:
            assert not evolution_errors(table[old], table[new]), (old, new, evolution_errors(table[old], table[new]))


@pytest.mark.parametrize("edit,match", [
    (lambda s: s["Heartbeat"]["fields"].pop(), "existing fields changed"),
    (lambda s: s["Heartbeat"]["fields"].insert(0, ["gpu", "float", "0.0"]), "existing fields changed"),
    (lambda s: s["Heartbeat"]["fields"].__setitem__(1, ["time", "int", None]), "existing fields changed"),
    (lambda s: s["Heartbeat"]["fields"].append(["gpu", "float", None]), "Heartbeat.gpu was appended without"),
    (lambda s: s["Heartbeat"].__setitem__("tag", "beat"), "tag/array_like changed"),
    (lambda s: s["Array"]["fields"].append(["order", "str", "'C'"]), "array_like: appending"),
    (lambda s: s.pop("Goodbye"), "Goodbye was removed"),
])
def test_the_rule_check_catches_each_kind_of_breaking_change(edit, match):
    new = json.loads(json.dumps(current_schema()))
    edit(new)
    assert any(match in e for e in evolution_errors(current_schema(), new))
    ok = json.loads(json.dumps(current_schema()))
    ok["Heartbeat"]["fields"].append(["gpu_util", "float", "0.0"])  # what a minor version may do
    assert evolution_errors(current_schema(), ok) == []


def test_a_field_change_in_code_is_caught_against_the_table(monkeypatch):
    class Heartbeat(msgspec.Struct, kw_only=True, omit_defaults=True, tag="heartbeat"):
        peer_id: str
        time: float
        stats: dict[str, float] = {}
        version: int = -1
        gpu_util: float = 0.0

    monkeypatch.setattr(P, "Message", _replace(P.Message, P.Heartbeat, Heartbeat))
    got = current_schema()
    assert got["Heartbeat"]["fields"][-1] == ["gpu_util", "float", "0.0"]
    assert got != _table()[P.PROTOCOL_VERSION]
    assert evolution_errors(_table()[P.PROTOCOL_VERSION], got) == []  # an append with a default: a minor bump


def _replace(union: Any, old: type, new: type) -> Any:
    args = tuple(new if a is old else a for a in union.__args__)
    out = args[0]
    for a in args[1:]:
        out = out | a
    return out


def dump(table: dict[str, Schema]) -> str:
    """The table as JSON with one Struct field per line (a reviewable diff when a version is added)."""
    lines = ["{"]
    for i, (version, schema) in enumerate(table.items()):
        lines.append(f"  {json.dumps(version)}: {{")
        for j, (name, st) in enumerate(schema.items()):
            lines.append(f"    {json.dumps(name)}: {{\"tag\": {json.dumps(st['tag'])}, "
                         f"\"array_like\": {json.dumps(st['array_like'])}, \"fields\": [")
            lines += [f"      {json.dumps(f)}{',' if k < len(st['fields']) - 1 else ''}" for k, f in enumerate(st["fields"])]
            lines.append("    ]}" + ("," if j < len(schema) - 1 else ""))
        lines.append("  }" + ("," if i < len(table) - 1 else ""))
    return "\n".join([*lines, "}"]) + "\n"


def write_table() -> str:
    """Add the table of ``PROTOCOL_VERSION`` to wire_schema.json; refuses to rewrite an existing one."""
    table = _table() if TABLE.exists() else {}
    if P.PROTOCOL_VERSION in table:
        raise SystemExit(f"wire_schema.json already holds protocol {P.PROTOCOL_VERSION}: a released version's "
                         f"table never changes; {FIX}")
    table[P.PROTOCOL_VERSION] = current_schema()
    TABLE.write_text(dump(dict(sorted(table.items(), key=lambda kv: _key(kv[0])))))
    return f"added the table of protocol {P.PROTOCOL_VERSION} to {TABLE}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python -m tests.unit.protocols.test_schema --write")
    print(write_table())
