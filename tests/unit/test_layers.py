"""The layers of the code, lowest first, and the rule that no module imports from a higher one
(docs/architecture.md §2). ``LAYERS`` is the one place the order is written.

A module belongs to the longest name of ``LAYERS`` that is it or a package above it. It may import its own
package and anything in a lower layer; the packages of one layer are independent of each other (none imports
another). Lazy imports inside functions count like any other (``test_layout.import_graph``)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.unit.test_layout import PACKAGES, ROOT, import_graph

LAYERS: list[tuple[str, ...]] = [
    ("protocols",),  # the wire contract: msgspec and the standard library
    ("asyncrl", "asyncrl.constants", "asyncrl._lazy", "asyncrl.machine"),  # standard library only
    ("asyncrl.config",),  # the run's settings, validated against protocols' and constants' value lists
    ("asyncrl.rundir", "asyncrl.algo", "asyncrl.quant", "asyncrl.tasks"),
    ("asyncrl.log", "asyncrl.metrics", "asyncrl.transport", "asyncrl.models"),
    ("asyncrl.engine",),
    ("asyncrl.learner", "asyncrl.controller"),
    ("asyncrl.sim",),  # models the controller with its own code; nothing imports it
    ("workers",),  # one package or file per process, the CLI and the process parts
    ("asyncrl.bench",),  # what the benchmark scripts share: runs processes through workers' launcher
    ("scripts", "asyncrl.__main__"),  # entry points: benchmarks and tools; ``python -m asyncrl`` (workers/cli.py)
]
LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str | None:
    """The name of ``LAYERS`` that ``module`` belongs to (None: not placed)."""
    parts = module.split(".")
    return next((u for u in (".".join(parts[:n]) for n in range(len(parts), 0, -1)) if u in LEVEL), None)


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of ``graph`` (module -> modules it imports) that goes up a layer or across a layer."""
    out = []
    for module, imported in sorted(graph.items()):
        src = unit_of(module)
        for dep in sorted(imported):
            dst = unit_of(dep)
            if src is None or dst is None or src == dst:
                continue
            if LEVEL[dst] > LEVEL[src]:
                out.append(f"{module} -> {dep}: up from layer {LEVEL[src]} ({src}) to {LEVEL[dst]} ({dst})")
            elif LEVEL[dst] == LEVEL[src]:
                out.append(f"{module} -> {dep}: across layer {LEVEL[src]} ({src} and {dst} are independent)")
    return out


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in import_graph(*PACKAGES) if unit_of(m) is None)
    assert not unplaced, f"modules in no layer (add their package to LAYERS in {__file__}): {unplaced}"


def test_no_module_imports_from_a_higher_layer():
    bad = violations(import_graph(*PACKAGES))
    assert not bad, "imports against the layers (move the code down, or the value into asyncrl.constants):\n" + \
        "\n".join(bad)


def test_the_check_sees_an_upward_and_a_sideways_import():
    graph = {"asyncrl.config.schema": {"asyncrl.engine.base", "asyncrl.constants", "asyncrl.config.algo"},
             "asyncrl.learner.step": {"asyncrl.controller.core"}, "asyncrl.controller.core": {"asyncrl.tasks"}}
    assert [v.split(":")[0] for v in violations(graph)] == ["asyncrl.config.schema -> asyncrl.engine.base",
                                                           "asyncrl.learner.step -> asyncrl.controller.core"]


def test_the_configuration_loads_only_its_layer_and_those_below():
    # every module of asyncrl/config, imported: nothing of asyncrl or workers above the configuration's layer
    config = sorted(m for m in import_graph("asyncrl") if unit_of(m) == "asyncrl.config")
    code = (f"import importlib, json, sys\nfor m in {config!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('asyncrl', 'protocols', "
            "'workers', 'scripts'))))")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True).stdout
    loaded = json.loads(out)
    above = [m for m in loaded if unit_of(m) is None or LEVEL[unit_of(m)] > LEVEL["asyncrl.config"]]
    assert not above, f"importing asyncrl.config loads {above}; it may load only protocols and asyncrl.constants"
    assert set(config) <= set(loaded)
