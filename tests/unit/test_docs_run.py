"""README's commands and docs/metrics.md checked against a real short run of the embedded default.

One short ``asyncrl train`` (the embedded tiny model on single-digit addition, real controller,
learner and workers over loopback; a few steps) runs once for this module in a temporary folder,
named ``runs/demo`` as in README.md. Then:

* every ``asyncrl ...`` line of README's "Running it" block either runs as written (those that take
  seconds: the ``log`` tools on ``runs/demo``, ``keys generate``, and ``train resume=runs/demo``, which on
  the finished run says there is nothing to resume), or has its ``key=value`` settings
  loaded and validated the way ``asyncrl train`` does before any process starts (the full training
  runs, which take minutes) and its sub-command's ``--help`` printed;
* ``--help`` works for every sub-command of ``asyncrl``;
* docs/metrics.md and the run's ``metrics.jsonl`` agree both ways: every name the run logs is
  documented, and every documented name is logged by the run unless its row (or the heading above
  it) says when it is logged with the word "only" ("only with ``algo=tbpo``", "only when
  ``kl_coef > 0``").

Never: kills processes it did not start (``tests.conftest.ProcessTracker`` ends exactly its own), or
edits README.md; a README line that cannot run here fails the test with the line.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, ProcessTracker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # real processes; the run shares 2 cores

ROOT = Path(REPO_ROOT)
SHORT = ["run_name=demo", "learner.total_steps=4", "learner.eval_every=4", "learner.ckpt_every=2",
         "task.eval_size=16", "rollout.groups_per_step=2"]
RUN_AS_WRITTEN = ("log", "keys")  # sub-commands of README's block that finish in seconds on runs/demo


def runs_as_written(args: list[str]) -> bool:
    """Whether a README line finishes in seconds here: the log tools, keys, and a resume of the finished
    runs/demo (which says so and changes nothing)."""
    return args[0] in RUN_AS_WRITTEN or (args[0] == "train" and any(a.startswith("resume=") for a in args))
RECORD_FIELDS = {"step", "time"}  # every record's own fields; the glossary documents them as such


def asyncrl(tracker: ProcessTracker, cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = tracker.python("-m", "asyncrl", *args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(errors="replace"), "")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """A folder holding ``runs/demo``: a finished short run of the embedded default."""
    cwd = tmp_path_factory.mktemp("docs-run")
    tracker = ProcessTracker()
    try:
        res = asyncrl(tracker, cwd, "train", *SHORT)
    finally:
        tracker.stop_all()
    assert res.returncode == 0, res.stdout[-4000:]
    assert (cwd / "runs" / "demo" / "metrics.jsonl").is_file()
    return cwd


def readme_commands() -> list[list[str]]:
    """The ``asyncrl ...`` lines of README's "Running it" block, as argument lists (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Running it", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    out = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0].endswith("asyncrl"):
            out.append(words[1:])
    return out


def test_readme_running_it_lists_commands():
    cmds = readme_commands()
    assert len(cmds) >= 10 and {c[0] for c in cmds} >= {"train", "worker", "log", "replay", "keys"}


def help_text(words: list[str], capsys) -> str:
    """``asyncrl WORDS --help`` in this process (the CLI imports no torch for it): its exit code must be 0."""
    from workers.cli import main

    with pytest.raises(SystemExit) as done:
        main([*words, "--help"])
    out = capsys.readouterr().out
    assert done.value.code in (0, None) and "usage: asyncrl" in out, (words, out[-2000:])
    return out


@pytest.mark.parametrize("args", readme_commands(), ids=lambda a: " ".join(a))
def test_readme_command(args: list[str], demo_run: Path, capsys):
    if runs_as_written(args):
        tracker = ProcessTracker()
        try:
            res = asyncrl(tracker, demo_run, *args, timeout=300)
        finally:
            tracker.stop_all()
        assert res.returncode == 0, f"`asyncrl {' '.join(args)}` in runs/demo's folder:\n{res.stdout[-3000:]}"
        return
    help_text(args[:1], capsys)
    settings = [a for a in args[1:] if "=" in a]
    if args[0] == "train":
        from asyncrl.config.loader import load_train_config
        from asyncrl.config.schema import validate

        validate(load_train_config(settings))


def test_every_subcommand_has_help(capsys):
    from workers.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices  # noqa: SLF001 - argparse's own table
    commands = [[name] for name in subs] + [["log", n] for n in ("inspect", "show", "repair")] + [["keys", "generate"]]
    for words in commands:
        help_text(words, capsys)


# --- docs/metrics.md against the run's metrics.jsonl ---------------------------------------------


def glossary() -> list[tuple[str, re.Pattern[str], bool]]:
    """(documented name, its pattern, conditional) for every name in a table row of docs/metrics.md.

    ``{fmt}`` stands for a format, ``eta=j`` for a staleness, a trailing ``/*`` for any name under that
    prefix. A row is conditional when it, or the nearest heading above it, says "only".
    """
    out = []
    heading = ""
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if line.startswith("#"):
            heading = line
            continue
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        conditional = bool(re.search(r"\bonly\b", line + " " + heading))
        for name in re.findall(r"`([^`]+)`", first):
            if "/" not in name and name not in RECORD_FIELDS and name not in ("checkpoint", "done"):
                continue
            rx = re.escape(name).replace(r"\{fmt\}", "[a-z0-9_]+").replace("eta=j", r"eta=\d+")
            rx = rx[: -len(r"/\*")] + "/.+" if name.endswith("/*") else rx
            out.append((name, re.compile(rx + "$"), conditional))
    return out


def logged_names(run: Path) -> set[str]:
    names: set[str] = set()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        names |= set(json.loads(line))
    return names


def test_the_glossary_reader_finds_patterns():
    found = {name: (rx, cond) for name, rx, cond in glossary()}
    rx, _ = found["mismatch/by_staleness/eta=j/kl_k3"]
    assert rx.match("mismatch/by_staleness/eta=12/kl_k3") and not rx.match("mismatch/by_staleness/eta=x/kl_k3")
    assert found["controller/*"][0].match("controller/samples_logged")
    assert found["step"] and not found["step"][1]


def test_every_metric_the_run_logs_is_in_the_glossary(demo_run: Path):
    patterns = [rx for _, rx, _ in glossary()]
    missing = sorted(n for n in logged_names(demo_run / "runs" / "demo") if not any(rx.match(n) for rx in patterns))
    assert not missing, f"add these metrics to docs/metrics.md (a short run of the default logs them): {missing}"


def test_every_unconditional_glossary_entry_is_logged_by_the_run(demo_run: Path):
    names = logged_names(demo_run / "runs" / "demo")
    absent = [doc for doc, rx, cond in glossary() if not cond and not any(rx.match(n) for n in names)]
    assert not absent, ("docs/metrics.md lists metrics a run of the default does not log: remove them, or say "
                        f"in their row when they are logged ('only with ...'): {absent}")

