"""House rules that a reader of imports can check (docs/architecture.md §2, §5)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocols", "asyncrl", "workers", "scripts")
HARD_LINE_LIMIT = 800


def python_files(*tops: str) -> list[Path]:
    return sorted(p for t in tops for p in (ROOT / t).rglob("*.py") if ".venv" not in p.parts)


def imported_modules(path: Path, *, module_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    mods: set[str] = set()
    for node in tree.body if module_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    return mods


def _top(mod: str) -> str:
    return mod.split(".")[0]


@pytest.mark.parametrize("path", python_files("protocols"), ids=lambda p: str(p.relative_to(ROOT)))
def test_protocols_imports_only_msgspec_and_the_standard_library(path):
    # numpy may be imported lazily inside a helper (Array.to_numpy), never at module level.
    allowed = set(sys.stdlib_module_names) | {"msgspec", "protocols"}
    bad = {m for m in imported_modules(path, module_level_only=True) if _top(m) not in allowed}
    assert not bad, f"{path.name} imports {bad}; protocols must stay msgspec + stdlib"


def in_bench(path: Path) -> bool:
    """A module of asyncrl/bench: the benchmarks' shared code, at the top beside workers (not the library)."""
    return path.relative_to(ROOT).parts[:2] == ("asyncrl", "bench")


LIBRARY = [p for p in python_files("asyncrl") if not in_bench(p)]


@pytest.mark.parametrize("path", [p for p in LIBRARY if p.name != "__main__.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_library_never_imports_workers_or_scripts(path):
    # asyncrl/__main__.py is exempt: ``python -m asyncrl`` is an entry point, like the console script.
    bad = {m for m in imported_modules(path) if _top(m) in ("workers", "scripts", "tests")}
    assert not bad, f"{path} imports {bad}: dependency direction is scripts -> workers -> asyncrl -> protocols"


@pytest.mark.parametrize("path", [p for p in python_files("asyncrl", "workers", "protocols") if not in_bench(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_below_the_benchmarks_imports_their_package(path):
    bad = {m for m in imported_modules(path) if m == "asyncrl.bench" or m.startswith("asyncrl.bench.")}
    assert not bad, f"{path} imports {bad}: asyncrl/bench serves scripts/ and tests only"


@pytest.mark.parametrize("path", python_files("scripts"), ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_are_scripts(path):
    # What scripts share lives in asyncrl/bench; a script neither edits sys.path nor imports another script.
    siblings = {p.stem for p in python_files("scripts")}
    bad = {m for m in imported_modules(path) if _top(m) == "scripts" or m in siblings}
    assert not bad, f"{path} imports {bad}: move what scripts share into asyncrl/bench"
    assert "sys.path" not in path.read_text(), f"{path} edits sys.path; import the installed packages instead"
ARGV_PARSERS = {"argparse", "optparse", "getopt", "click", "typer"}


def reads_sys_argv(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    return any(isinstance(n, ast.Attribute) and n.attr == "argv" and isinstance(n.value, ast.Name)
               and n.value.id == "sys" for n in ast.walk(tree)) or any(
        isinstance(n, ast.ImportFrom) and n.module == "sys" and any(a.name == "argv" for a in n.names)
        for n in ast.walk(tree))


@pytest.mark.parametrize("path", [p for p in python_files("asyncrl")
                                  if "transport" not in p.relative_to(ROOT / "asyncrl").parts],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_transport_package_imports_zmq(path):
    bad = {m for m in imported_modules(path) if _top(m) == "zmq"}
    assert not bad, f"{path} imports {bad}; sockets belong in asyncrl/transport (add a helper there)"


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_argv_parsing_in_the_library(path):
    # Not even asyncrl/__main__.py: it hands over to workers/cli.py, which reads argv. asyncrl/bench is not the
    # library: it holds the benchmark scripts' shared options (asyncrl/bench/report.py).
    bad = {m for m in imported_modules(path) if _top(m) in ARGV_PARSERS}
    assert not bad and not reads_sys_argv(path), (
        f"{path} parses the command line ({bad or 'sys.argv'}); argv belongs in workers/ (e.g. workers/cli.py)")


# Standard library only, importing nothing of asyncrl: the lazy-export helper, what the processor can do, and the
# algorithm's options (the run schema nests them; asyncrl.algo takes them as they are).
LEAF_MAY_IMPORT = {"asyncrl._lazy", "asyncrl.machine", "asyncrl.config.algo"}


@pytest.mark.parametrize("leaf", ["algo", "quant"])
def test_math_packages_are_leaves(leaf):
    for helper in LEAF_MAY_IMPORT:
        assert {_top(m) for m in imported_modules(ROOT / (helper.replace(".", "/") + ".py"))} <= set(
            sys.stdlib_module_names) | {"__future__"}
    for path in python_files(f"asyncrl/{leaf}"):
        others = {m for m in imported_modules(path)
                  if m.startswith("asyncrl.") and not m.startswith(f"asyncrl.{leaf}") and m not in LEAF_MAY_IMPORT}
        assert not others, f"{path} imports {others}; asyncrl/{leaf} is a leaf package"


# The controller's systems logic (admission, group accounting, batch assembly) runs without torch,
# numpy or sockets: each of these modules imports the standard library and the others of this list only.
# The rule is per module, not per package: the rest of asyncrl/controller (scoring, core) needs numpy,
# the tokenizer and the tasks (but not torch: tests/unit/controller/test_no_torch.py).
STDLIB_ONLY = ("asyncrl/controller/__init__.py", "asyncrl/controller/versions.py", "asyncrl/controller/gate.py",
               "asyncrl/controller/buffer.py", "asyncrl/controller/assembler.py", "asyncrl/controller/workers.py",
               "asyncrl/controller/admission.py", "asyncrl/controller/scores.py")


def _module_name(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


@pytest.mark.parametrize("rel", STDLIB_ONLY)
def test_controller_systems_logic_uses_the_standard_library_only(rel):
    allowed = set(sys.stdlib_module_names)
    siblings = {_module_name(r) for r in STDLIB_ONLY}
    bad = {m for m in imported_modules(ROOT / rel) if _top(m) not in allowed and m not in siblings}
    assert not bad, f"{rel} imports {bad}; it must stay standard library only (and import only {sorted(siblings)})"


SIM_MAY_IMPORT = ("asyncrl.sim", "asyncrl.controller", "asyncrl.config", "asyncrl.log", "asyncrl.metrics",
                  "asyncrl.rundir")


@pytest.mark.parametrize("path", python_files("asyncrl/sim"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_simulator_models_the_controller_with_its_own_code_and_reads_run_folders_only(path):
    # asyncrl/sim calls the controller's own admission, gate, buffer and assembler (so its model cannot
    # drift from them) and reads run folders; it never reaches into the learner, engine or transport.
    others = {m for m in imported_modules(path) if _top(m) not in sys.stdlib_module_names and m != "__future__"
              and not any(m == allowed or m.startswith(allowed + ".") for allowed in SIM_MAY_IMPORT)}
    assert not others, f"{path} imports {others}; asyncrl/sim may import only {SIM_MAY_IMPORT} and the stdlib"


@pytest.mark.parametrize("path", [p for p in python_files("asyncrl", "workers", "protocols")
                                  if p.relative_to(ROOT).parts[:2] != ("asyncrl", "sim")],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_in_the_system_depends_on_its_simulator(path):
    bad = {m for m in imported_modules(path) if m == "asyncrl.sim" or m.startswith("asyncrl.sim.")}
    assert not bad, f"{path} imports {bad}; the simulator models the system, the system never needs it"


def test_the_simulators_event_kernel_is_standard_library_only():
    bad = {m for m in imported_modules(ROOT / "asyncrl/sim/kernel.py") if _top(m) not in sys.stdlib_module_names}
    assert not bad, f"asyncrl/sim/kernel.py imports {bad}; the event kernel knows nothing of asyncrl"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``path`` imports anywhere (lazy imports too), relative ones resolved.
    ``from pkg import sub`` counts as an import of ``pkg.sub`` only (the parent package is always loaded first).
    In a folder of scripts (no ``__init__.py``: ``scripts/``), a bare ``import sibling`` is the sibling module,
    found through the script's own folder on ``sys.path``."""
    mod = module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    script_folder = not (path.parent / "__init__.py").exists()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
            found |= subs
            if len(subs) < len(node.names):
                found.add(base)
    out = set()
    for m in found:
        if script_folder and _top(m) not in {_top(k) for k in known} and f"{pkg}.{m}" in known:
            m = f"{pkg}.{m}"
        while m and m not in known:
            m = m.rpartition(".")[0]
        if m and m != mod:
            out.add(m)
    return out


def import_graph(*tops: str) -> dict[str, set[str]]:
    """Module -> the modules of ``tops`` it imports, a function-local (lazy) import counted like any other:
    it is still a dependency, only a later one."""
    paths = {module_name(p): p for p in python_files(*tops)}
    return {m: module_imports(p, set(paths)) for m, p in paths.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import one another (strongly connected components of more than one
    module, Tarjan's algorithm), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in sorted(graph.get(m, ())):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(found)


def test_the_cycle_finder_counts_lazy_imports(tmp_path, monkeypatch):
    # Three real files: a imports b at module level, b imports c inside a function, c imports a lazily
    # too; d imports a only. The finder sees the one cycle a -> b -> c -> a, and d outside it.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.c import g\n    return g\n")
    (pkg / "c.py").write_text("def g():\n    from . import a\n    return a\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph("pkg")
    assert graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_no_import_cycle_in_any_package():
    # A cycle (quant/fused.py <-> quant/linear.py was one; workers/controller.py, roles.py and launcher.py
    # through function-local imports another) means two modules are one in disguise: merge them, or move
    # what both need into a third, or declare a Protocol on the lower side.
    cycles = import_cycles(import_graph(*PACKAGES))
    assert not cycles, "import cycles (lazy imports count): " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("path", python_files(*PACKAGES, "tests"), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_exceeds_the_hard_line_limit(path):
    n = len(path.read_text().splitlines())
    assert n <= HARD_LINE_LIMIT, f"{path} has {n} lines; split it (hard limit {HARD_LINE_LIMIT})"


@pytest.mark.parametrize("module,forbidden", [
    ("protocols", ("torch", "zmq", "numpy")),
    ("asyncrl", ("torch", "zmq")),
    ("workers.cli", ("torch", "zmq")),
    ("asyncrl.config.roles", ("torch", "zmq")),  # with the schema and the loader
    ("asyncrl.log", ("torch", "zmq")),
    ("asyncrl.log.replay", ("torch", "zmq")),
    ("asyncrl.controller", ("torch", "zmq", "numpy")),
    ("asyncrl.sim", ("torch", "zmq", "numpy")),
    ("asyncrl.rundir.checkpoints", ("torch", "zmq", "numpy")),
    ("asyncrl.rundir.lock", ("torch", "zmq", "numpy")),
    ("asyncrl.rundir.paths", ("torch", "zmq", "numpy", "msgspec")),
])
def test_cheap_modules_import_without_heavy_dependencies(module, forbidden):
    code = f"import sys, {module}; bad = [m for m in {forbidden!r} if m in sys.modules]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
