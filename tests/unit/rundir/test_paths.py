"""``RunDir`` owns every path of a run folder: each one lies inside the root, is listed in the layout of
``asyncrl/rundir/paths.py``'s docstring, and no other module of ``asyncrl/`` or ``workers/`` spells a
run-folder name itself (a new file of the run folder gets a ``RunDir`` property, not a literal)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import asyncrl.rundir.paths as paths_module
from asyncrl.rundir import RunDir
from asyncrl.rundir.checkpoints import LEARNER_CHECKPOINT_RE, controller_state_path

ROOT = Path(__file__).resolve().parents[3]
PATHS_PY = ROOT / "asyncrl" / "rundir" / "paths.py"


def every_path(run: RunDir) -> dict[str, Path]:
    """Each property of ``run``, and each method called with a sample argument."""
    out = {name: getattr(run, name) for name, attr in vars(RunDir).items() if isinstance(attr, property)}
    out["log_of"] = run.log_of("worker-0")
    out["learner_checkpoint"] = run.learner_checkpoint(12)
    out["controller_checkpoint"] = run.controller_checkpoint(12)
    methods = {n for n, a in vars(RunDir).items() if callable(a) and not n.startswith("_")}
    assert methods == {"log_of", "learner_checkpoint", "controller_checkpoint"}, "add the new method here"
    return out


def layout_entries() -> set[str]:
    """The first column of the layout block of the module docstring (a deeper indent continues a line)."""
    doc = paths_module.__doc__ or ""
    block = doc.split("Layout of", 1)[1].split("\n\n", 2)[1]
    return {line.split()[0] for line in block.splitlines() if line.startswith("    ") and line[4] != " "}


def as_layout(rel: str) -> str:
    return re.sub(r"\d{8}", "NNNNNNNN", rel).replace("logs/worker-0.log", "logs/<process>.log")


def test_every_path_lies_inside_the_root_and_is_in_the_layout(tmp_path):
    run = RunDir(tmp_path / "runs" / "r")
    entries = layout_entries()
    found = every_path(run)
    for name, path in found.items():
        assert path.is_relative_to(run.root) and path != run.root, name
        rel = path.relative_to(run.root).as_posix()
        listed = as_layout(rel)
        inside = any(e.startswith(listed + "/") for e in entries)  # a folder listed by its content (logs/)
        assert listed in entries or inside, f"RunDir.{name} ({rel}) is not in the layout docstring"
    listed_paths = {as_layout(p.relative_to(run.root).as_posix()) for p in found.values()}
    missing = {e for e in entries if e.rstrip("/") not in listed_paths}
    assert not missing, f"the layout lists {missing} but RunDir has no path for them"


def test_the_names_on_disk_are_the_ones_runs_have_always_used(tmp_path):
    run = RunDir(tmp_path)
    rel = {n: p.relative_to(tmp_path).as_posix() for n, p in every_path(run).items()}
    assert rel == {
        "lock": ".lock", "config": "config.json", "controller_address": "controller.json",
        "pids": "pids.json", "logs": "logs", "log_of": "logs/worker-0.log", "trajectories": "trajectories",
        "metrics": "metrics.jsonl", "health": "health.jsonl", "tb": "tb", "checkpoints": "checkpoints",
        "learner_checkpoint": "checkpoints/step_00000012", "latest": "checkpoints/latest",
        "controller_checkpoint": "checkpoints/controller-00000012.json",
        "controller_final_checkpoint": "checkpoints/controller-final.json", "model": "model",
        "learner_final": "learner_final.json", "controller_final": "controller_final.json", "plots": "plots",
        "summary": "summary.json",
    }
    assert controller_state_path(run.checkpoints, 12) == run.controller_checkpoint(12)
    m = LEARNER_CHECKPOINT_RE.match(run.learner_checkpoint(12).name)
    assert m and int(m.group(1)) == 12
    assert RunDir(tmp_path) == run and hash(RunDir(tmp_path)) == hash(run)  # frozen: a value


# Names of the run folder that no module other than paths.py may spell. The generic words (a folder
# called "model", a dict key "logs") count only as the right operand of ``/``, i.e. as a path join.
FILE_NAMES = {"config.json", "pids.json", "controller.json", "metrics.jsonl", "health.jsonl", "learner_final.json",
              "controller_final.json", "controller-final.json", "summary.json", ".lock"}
FOLDER_NAMES = {"logs", "trajectories", "checkpoints", "model", "tb", "plots", "latest"}
PREFIXES = {"step_", "controller-"}  # the constant parts of f"step_{version:08d}", f"controller-{...}.json"
HF_MODEL_FOLDER = {  # "config.json" of a Hugging Face model folder, not of the run folder
    ("asyncrl/models/_files.py", "config.json"),
    ("asyncrl/models/prepare.py", "config.json"),
    ("asyncrl/engine/sglang/requests.py", "config.json"),  # the served model's EOS ids
    ("asyncrl/engine/sglang/weights.py", "config.json"),  # the served model's names (tied head, experts)
    ("asyncrl/tasks/prompts.py", "config.json"),
    ("asyncrl/tasks/scoring.py", "config.json"),
    ("workers/roles.py", "config.json"),  # `asyncrl learner` checks the model folder is readable
    ("workers/controller.py", "config.json"),  # the model's config, sent to joining workers (model_info)
    ("workers/run_config.py", "config.json"),  # a moved model folder (model.path) must hold a model
}


def run_folder_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    joined = {id(n.right) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)}
    hits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        v = node.value
        if v in FILE_NAMES or v in PREFIXES or (v in FOLDER_NAMES and id(node) in joined):
            hits.append((node.lineno, v))
    return hits


def test_paths_py_imports_the_standard_library_only():
    tree = ast.parse(PATHS_PY.read_text())
    mods = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert {m.split(".")[0] for m in mods} <= set(sys.stdlib_module_names) | {"__future__"}, mods


def test_no_module_but_paths_py_spells_a_run_folder_name():
    found = []
    for top in ("asyncrl", "workers"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if path == PATHS_PY:
                continue
            found += [f"{rel}:{line}: {v!r}" for line, v in run_folder_literals(path)
                      if (rel, v) not in HF_MODEL_FOLDER]
    assert not found, "run-folder names outside asyncrl/rundir/paths.py (use RunDir):\n" + "\n".join(found)


def test_the_scan_finds_a_literal(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('from pathlib import Path\nrun = Path("r")\nA = run / "metrics.jsonl"\nB = run / "model"\n'
                   'C = {"model": 1}\nD = run / f"step_{3:08d}"\n')
    assert [v for _, v in run_folder_literals(bad)] == ["metrics.jsonl", "model", "step_"]
