"""Every value list (the valid values of an option: objectives, aggregations, formats, tasks, ...) has
one definition, which every other module imports; a second copy drifts (a new objective used to touch
about eight files)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from asyncrl.config.algo import AGGREGATIONS, OBJECTIVES
from asyncrl.constants import TASK_NAMES
from protocols.values import FORMATS

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("protocols", "asyncrl", "workers", "scripts")


def _strings(node: ast.AST | None) -> tuple[str, ...] | None:
    """The values of a literal tuple/list/set of >= 2 strings, else None."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 2 and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return tuple(e.value for e in node.elts)  # type: ignore[attr-defined]
    return None


def value_list_definitions() -> dict[frozenset[str], list[str]]:
    """Value set -> where it is written out: an UPPER_CASE constant, a ``Literal[...]`` type, a
    membership test against >= 3 literal values, or the choices of a ``choice``/``_choice`` call."""
    found: dict[frozenset[str], list[str]] = defaultdict(list)
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            where = path.relative_to(ROOT)
            for n in ast.walk(ast.parse(path.read_text())):
                values, kind = None, ""
                if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None:
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    if any(isinstance(t, ast.Name) and t.id.isupper() for t in targets):
                        values, kind = _strings(n.value), "constant"
                elif isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "Literal":
                    values, kind = _strings(n.slice), "Literal"
                elif isinstance(n, ast.Compare) and isinstance(n.ops[0], ast.In | ast.NotIn):
                    values, kind = _strings(n.comparators[0]), "membership test"
                    values = values if values and len(values) >= 3 else None
                elif isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) in (
                        "choice", "_choice"):
                    values = next((v for v in map(_strings, n.args) if v), None)
                    kind = "choice"
                if values:
                    found[frozenset(values)].append(f"{where}:{getattr(n, 'lineno', '?')} ({kind})")
    return found


def test_every_value_list_has_one_definition():
    twice = {tuple(sorted(k)): v for k, v in value_list_definitions().items() if len(v) > 1}
    assert not twice, "value lists written out more than once (import the first instead):\n" + "\n".join(
        f"  {values}: {', '.join(where)}" for values, where in twice.items())


def test_the_scan_sees_the_lists_it_guards():
    # the scan finds each named list at its one home (so a copy anywhere else would be reported)
    found = value_list_definitions()
    assert found[frozenset(OBJECTIVES)] == [found[frozenset(OBJECTIVES)][0]]
    assert found[frozenset(OBJECTIVES)][0].startswith("asyncrl/config/algo.py")
    assert found[frozenset(AGGREGATIONS)][0].startswith("asyncrl/config/algo.py")
    assert found[frozenset(FORMATS)][0].startswith("protocols/values.py")
    # the task names are written once, beside the other lists the configuration checks
    assert len(found[frozenset(TASK_NAMES)]) == 1 and found[frozenset(TASK_NAMES)][0].startswith("asyncrl/constants.py")
