"""What README.md and docs/*.md say about the code names things the code has.

The pages are references: a name they give must be one a reader can find. These tests read every page
and check, without running anything:

* every repository path they name (``asyncrl/...``, ``workers/...``, ``protocols/...``, ``scripts/...``,
  ``tests/...``, ``configs/...``, ``examples/...``, ``benchmarks/...``; a pattern with ``*`` or ``{...}``
  matches a file) exists, so a moved or removed module fails here until the pages follow it;
* every dotted Python name under ``asyncrl``, ``workers`` or ``protocols`` (``asyncrl.learner.options.resolve_autocast``)
  is a module of the repository and, after the module, a name defined or imported at its top level;
* every backticked ``Class.member`` of a class the repository defines names a method, property, field or
  attribute of that class (or of a base class the repository defines);
* every ``asyncrl ...`` command in a code span or block is a sub-command of the CLI (``log`` and ``keys``
  with their own sub-commands and ``--flags``); the ``key=value`` settings of ``asyncrl worker`` /
  ``asyncrl learner`` are keys of their role configs, those of ``train`` / ``controller`` / ``replay`` keys of
  the run's schema, a config group (``algo=tbpo`` is ``configs/algo/tbpo.yaml``) or a replay option;
* every metric name (``actor/...``, ``learner/...``, ``controller/...``, ...) is emitted somewhere under
  ``asyncrl/`` or ``workers/``: grep-level, a string literal of the code holds the name, or its first and
  last parts when the code builds it (``f"samples/{status.value}"``);
* a default quoted as ``(N)`` after a key, or in a table column headed "default", is what ``asyncrl
  train`` runs with (tests/unit/test_docs_config.py reads the other forms);
* the protocol version and floor the pages quote are ``protocols``' own.

Deliberate mentions of names outside this repository (verl's and AReaL's) are allow-listed below, each
with the reason. Never: imports torch, starts a process, or edits a page.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import glob
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_TOPS = ("asyncrl", "workers", "protocols", "scripts")
PATH_TOPS = ("asyncrl", "workers", "protocols", "scripts", "tests", "configs", "examples", "benchmarks")

NOT_PATHS = {
    "examples/gspo_trainer",  # verl's examples folder (docs/algorithms.md cites the GSPO recipe there)
    "examples/math/*.yaml",  # AReaL's example configs (docs/algorithms.md, the sources read)
    "workers/alive", "workers/dead", "workers/left", "workers/weight_sync_s",  # metric names (docs/metrics.md)
}
SPEC_METRICS = {
    # docs/algorithms.md names the specification's metrics beside the code's and says which name the
    # code logs instead (D11, D17, D21); these are the specification's, never emitted
    "data/filtered_group_frac", "actor/grad_norm", "adv/zero_std_group_frac", "uaq/code_change_frac",
}
METRIC_TOPS = ("actor", "mismatch", "is", "rs", "decoupled", "acr", "gspo", "tbpo", "stale", "data", "learner",
               "time", "quant", "aqn", "transport", "weights", "train", "eval", "staleness", "gate", "workers",
               "controller", "throughput", "samples", "control", "log", "batches", "adv", "uaq")
CONFIG_GROUPS = ("model", "task", "algo", "quant", "rollout", "learner", "experiment")


# ---------------------------------------------------------------------------------------------- reading


def page_lines() -> list[tuple[str, int, str, bool]]:
    """(page, line number, text, inside a fenced block) for every line of every page."""
    out = []
    for page in PAGES:
        fenced = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            out.append((str(page.relative_to(ROOT)), n, line, fenced))
    return out


def code_text() -> list[tuple[str, int, str]]:
    """(page, line, text) of what the pages write as code: fenced lines whole, else each `span`."""
    out = []
    for page, n, line, fenced in page_lines():
        if fenced:
            out.append((page, n, line))
        else:
            out.extend((page, n, m.group(1)) for m in re.finditer(r"`([^`]+)`", line))
    return out


@functools.cache
def code_trees() -> dict[str, ast.Module]:
    """Every Python file of the code's packages, parsed: module name -> tree."""
    trees = {}
    for top in CODE_TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            trees[name] = ast.parse(path.read_text(), filename=str(path))
    return trees


@functools.cache
def classes() -> dict[str, tuple[set[str], set[str]]]:
    """Class name -> (its members: defs, fields, class and instance attributes; its base-class names)."""
    found: dict[str, tuple[set[str], set[str]]] = {}
    for tree in code_trees().values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            members, bases = found.setdefault(node.name, (set(), set()))
            bases.update(b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, (ast.Name, ast.Attribute)))
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets if isinstance(t, ast.Name))
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    members.add(sub.attr)
    return found


def class_has(name: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
    members, bases = classes()[name]
    return member in members or any(class_has(b, member, seen | {name}) for b in bases
                                    if b in classes() and b not in seen)


def top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    # lazy re-exports (asyncrl/_lazy.py): the names a package's __all__ promises
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            with contextlib.suppress(ValueError):
                names.update(ast.literal_eval(node.value))
    return names


@functools.cache
def string_literals() -> frozenset[str]:
    """Every string constant (f-string pieces included) of asyncrl/ and workers/."""
    out: set[str] = set()
    for name, tree in code_trees().items():
        if name.split(".")[0] in ("asyncrl", "workers"):
            out.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return frozenset(out)


# ---------------------------------------------------------------------------------------------- paths


PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(PATH_TOPS)})/[\w./*{{}},<>-]*[\w*}}/])")


def path_exists(text: str) -> bool:
    text = text.rstrip("/")
    if "*" in text or "{" in text or "<" in text:
        pattern = re.sub(r"\{[^}]*\}?|<[^>]*>?", "*", text)
        pattern = pattern.split("{")[0].split(",")[0]
        return bool(glob.glob(str(ROOT / pattern)) or glob.glob(str(ROOT / pattern) + "*"))
    return (ROOT / text).exists() or (ROOT / f"{text}.py").exists()


def test_every_repository_path_the_docs_name_exists():
    missing = sorted({f"{page}:{n}: {m.group(1)}" for page, n, line, _ in page_lines()
                      for m in PATH.finditer(line)
                      if m.group(1).rstrip("/") not in NOT_PATHS and not path_exists(m.group(1))})
    assert not missing, "paths the docs name that the repository does not have:\n" + "\n".join(missing)


def test_the_path_reader_finds_paths_and_patterns():
    line = "see `asyncrl/learner/step.py`, configs/algo/*.yaml and runs/x/model/ (not controller/workers/dead)"
    assert [m.group(1) for m in PATH.finditer(line)] == ["asyncrl/learner/step.py", "configs/algo/*.yaml"]
    assert path_exists("configs/algo/*.yaml") and path_exists("asyncrl/learner/step") and not path_exists("asyncrl/nope.py")


# ---------------------------------------------------------------------------------------------- Python names


DOTTED = re.compile(r"(?<![\w/.])((?:asyncrl|workers|protocols)(?:\.[A-Za-z_]\w*)+)")


def resolve(dotted: str) -> str | None:
    """None when ``dotted`` names something the code has, else what is missing."""
    parts = dotted.split(".")
    trees = code_trees()
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if module in trees:
            rest = parts[i:]
            break
    else:
        return f"no module {parts[0]}"
    if not rest:
        return None
    if rest[0] not in top_level_names(trees[module]):
        return f"{module} has no {rest[0]}"
    if len(rest) > 1 and rest[0] in classes() and not class_has(rest[0], rest[1]):
        return f"{rest[0]} has no {rest[1]}"
    return None


def test_every_dotted_python_name_the_docs_give_is_defined():
    wrong = []
    for page, n, line, _ in page_lines():
        for m in DOTTED.finditer(line):
            if m.group(1).startswith("tests."):
                continue
            why = resolve(m.group(1))
            if why is not None:
                wrong.append(f"{page}:{n}: {m.group(1)} ({why})")
    assert not wrong, "dotted names the code does not define:\n" + "\n".join(wrong)


MEMBER = re.compile(r"`([A-Z]\w*)\.([a-z_]\w*)")


def test_every_class_member_the_docs_name_exists():
    wrong = sorted({f"{page}:{n}: {cls}.{member}" for page, n, line, _ in page_lines()
                    for cls, member in MEMBER.findall(line)
                    if cls in classes() and not class_has(cls, member)})
    assert not wrong, "Class.member mentions the class does not have:\n" + "\n".join(wrong)


def test_the_name_readers_resolve_and_refuse():
    assert resolve("asyncrl.learner.options.resolve_autocast") is None
    assert resolve("asyncrl.algo.policy_loss") is None  # re-exported by the package
    assert resolve("asyncrl.models.prepare.NO_SUCH_NAME") == "asyncrl.models.prepare has no NO_SUCH_NAME"
    assert class_has("ControllerCore", "poll") and not class_has("ControllerCore", "no_such_member")


# ---------------------------------------------------------------------------------------------- commands


COMMAND = re.compile(r"(?:^|(?<=[\s/`]))asyncrl ([a-z][^`#|]*)")


def documented_commands() -> list[tuple[str, int, list[str]]]:
    out = []
    for page, n, text in code_text():
        for m in COMMAND.finditer(text):
            words = m.group(1).replace("\\", " ").split()
            out.append((page, n, words))
    return out


def sub_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001


def keys_help(sub: str) -> str | None:
    """``asyncrl keys SUB --help`` (None: no such sub-command)."""
    from workers.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), \
            contextlib.suppress(SystemExit):
        main(["keys", sub, "--help"])
    return out.getvalue() or None


def settings(words: list[str]) -> list[tuple[str, str]]:
    """The ``key=value`` words of a command line (not placeholders such as ``[key=value``)."""
    return [tuple(w.lstrip("+").split("=", 1)) for w in words  # type: ignore[misc]
            if re.fullmatch(r"\+?[a-z_][\w.]*=\S*", w) and not w.startswith("key=")]  # key=value: a placeholder


def replay_options() -> set[str]:
    """``replay.*`` keys: the ``REPLAY_OPTIONS`` table of the replay's preparation, wherever it lives."""
    for tree in code_trees().values():
        for node in tree.body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "REPLAY_OPTIONS"
                                                     for t in node.targets)):
                return set(ast.literal_eval(node.value))
    raise AssertionError("REPLAY_OPTIONS (the replay's own keys) is defined nowhere under workers/")


def run_setting_problem(key: str, value: str, command: str) -> str | None:
    from asyncrl.config.loader import schema_keys

    keys = schema_keys()
    if key in CONFIG_GROUPS and re.fullmatch(r"[a-z0-9_]+", value):
        return None if (ROOT / "configs" / key / f"{value}.yaml").is_file() else f"no configs/{key}/{value}.yaml"
    if key in keys or any(key.startswith(k + ".") and keys[k] is None for k in keys if "." in k):
        return None
    if command == "replay" and (key == "run" or key in replay_options()):
        return None
    return f"{key} is not a setting of asyncrl {command}"


def test_every_asyncrl_command_the_docs_show_exists_with_its_flags_and_settings():
    from asyncrl.config.roles import LearnerRoleConfig, WorkerRoleConfig, role_keys
    from workers.cli import build_parser

    commands = sub_parsers(build_parser())
    roles = {"worker": set(role_keys(WorkerRoleConfig)), "learner": set(role_keys(LearnerRoleConfig))}
    found, wrong = 0, []
    for page, n, words in documented_commands():
        where, sub = f"{page}:{n}: asyncrl {' '.join(words)}", words[0]
        if sub not in commands:
            continue  # prose such as "asyncrl trains ..." inside a span is not a command line
        found += 1
        flags = [w.split("=")[0] for w in words[1:] if w.startswith("--")]
        if sub in ("log", "keys") and len(words) > 1:
            if sub == "log":
                tools = sub_parsers(commands["log"])
                text = tools[words[1]].format_help() if words[1] in tools else None
            else:
                text = keys_help(words[1])
            if text is None:
                wrong.append(f"{where}: no sub-command {words[1]!r}")
            wrong += [f"{where}: no flag {f}" for f in flags if f not in text] if text else []
        elif sub in roles:
            wrong += [f"{where}: {k} is not a setting of asyncrl {sub}" for k, _ in settings(words[1:])
                      if k not in roles[sub]]
        elif sub in ("train", "controller", "replay", "demo"):
            wrong += [f"{where}: {why}" for k, v in settings(words[1:])
                      if (why := run_setting_problem(k, v, sub)) is not None]
    assert found >= 30, f"the command reader found only {found} asyncrl commands; fix COMMAND"
    assert not wrong, "asyncrl commands of the docs that the CLI does not take:\n" + "\n".join(wrong)


# ---------------------------------------------------------------------------------------------- metrics


METRIC = re.compile(rf"`((?:{'|'.join(METRIC_TOPS)})/[\w/{{}}<>=*.|…-]+)`")
PLACEHOLDER = re.compile(r"\{[^}]*\}|<[^>]*>|…|eta=j")


def emitted(name: str) -> bool:
    """Whether the code emits ``name`` (grep-level: see the module docstring)."""
    lits = string_literals()
    if name.startswith("controller/") and not any(name in s for s in lits):
        name = name.removeprefix("controller/")  # ControllerCore.metrics prefixes its counters
    if any(name in s for s in lits):
        return True
    parts = [p for p in name.split("/") if p and not PLACEHOLDER.fullmatch(p)]

    def built(part: str) -> bool:
        rx = re.compile("(?:^|/)" + ".*".join(map(re.escape, part.split("*"))) + "(?:$|/)")
        return any(rx.search(s) for s in lits)

    return bool(parts) and built(parts[0]) and all(built(alt) for alt in parts[-1].split("|"))


def test_every_metric_the_docs_name_is_emitted_by_the_code():
    names = {(page, n, m.group(1)) for page, n, line, _ in page_lines() for m in METRIC.finditer(line)
             if not m.group(1).endswith((".py", ".md", ".yaml"))}
    assert len(names) > 100, "the metric reader found too few names; fix METRIC"
    wrong = sorted(f"{page}:{n}: {name}" for page, n, name in names if name not in SPEC_METRICS and not emitted(name))
    assert not wrong, "metrics the docs name that no code emits:\n" + "\n".join(wrong)


def test_the_metric_reader_sees_built_names_and_refuses_unknown_ones():
    assert emitted("learner/grad_norm") and emitted("controller/samples/late")  # f"samples/{status.value}"
    assert emitted("quant/{fmt}/published_bytes") and emitted("learner/skipped_*_minibatches")
    assert not emitted("controller/control/no_such_counter")


# ---------------------------------------------------------------------------------------------- defaults


PAREN_DEFAULT = re.compile(r"`(?P<key>[a-z_]+\.[a-z_.]+)` \((?P<value>[0-9][0-9.e-]*|true|false)\)")
CELL_DEFAULT = re.compile(r"`(?P<key>[a-z_]+\.[a-z_.]+)` (?P<value>[0-9][0-9.e-]*|true|false)\b")


def quoted_defaults() -> list[tuple[str, int, str, str]]:
    """(page, line, key, value) for ``key` (N)`` anywhere and ``key` N`` in a table whose header says default."""
    out = []
    header = ""
    for page, n, line, fenced in page_lines():
        if fenced:
            continue
        if line.startswith("|"):
            header = header or line
        else:
            header = ""
        forms = [PAREN_DEFAULT] + ([CELL_DEFAULT] if "default" in header and line != header else [])
        out += [(page, n, m.group("key"), m.group("value")) for rx in forms for m in rx.finditer(line)]
    return out


def test_defaults_quoted_beside_a_key_are_the_defaults():
    from asyncrl.config.loader import load_train_config, schema_keys

    cfg, keys = load_train_config([]), schema_keys()
    quoted, wrong = quoted_defaults(), []
    assert len(quoted) >= 10, "the default reader found too few quoted defaults; fix PAREN_DEFAULT / CELL_DEFAULT"
    for page, n, key, text in quoted:
        if key not in keys:
            continue  # tests/unit/test_docs_config.py names unknown keys
        actual: object = cfg
        for part in key.split("."):
            actual = getattr(actual, part)
        value: object = {"true": True, "false": False}.get(text, text)
        if isinstance(value, str):
            value = float(value)
        if actual != value:
            wrong.append(f"{page}:{n}: {key} quoted as {text}, the default is {actual!r}")
    assert not wrong, wrong


# ---------------------------------------------------------------------------------------------- protocol


def test_the_protocol_version_and_floor_the_docs_quote_are_the_code_s():
    from protocols.messages import PROTOCOL_FLOOR_MINOR, PROTOCOL_MAJOR, PROTOCOL_VERSION

    floor = f"{PROTOCOL_MAJOR}.{PROTOCOL_FLOOR_MINOR}"
    versions = [(p, n, m.group(1)) for p, n, line, _ in page_lines()
                for m in re.finditer(r"protocol version `?(\d+\.\d+)", line, re.I)]
    floors = [(p, n, m.group(1) or m.group(2)) for p, n, line, _ in page_lines()
              for m in re.finditer(r"(\d+\.\d+) (?:is the )?floor|floor (?:of |is )?`?(\d+\.\d+)", line, re.I)]
    assert versions and floors, "no protocol version or floor quoted; fix the patterns"
    wrong = [f"{p}:{n}: protocol version {v}, the code's is {PROTOCOL_VERSION}" for p, n, v in versions
             if v != PROTOCOL_VERSION]
    wrong += [f"{p}:{n}: protocol floor {v}, the code's is {floor}" for p, n, v in floors if v != floor]
    assert not wrong, wrong


# ---------------------------------------------------------------------------------------------- cluster blocks


def fenced_blocks() -> list[tuple[str, int, list[str]]]:
    """(page, first line, the block's lines with continuations joined) of every fenced block."""
    out: list[tuple[str, int, list[str]]] = []
    current: list[str] | None = None
    for page, n, line, fenced in page_lines():
        if fenced and current is None:
            current = []
            out.append((page, n, current))
        elif not fenced:
            current = None
            continue
        assert current is not None
        if current and current[-1].endswith("\\"):
            current[-1] = current[-1][:-1] + " " + line.strip()
        else:
            current.append(line.strip())
    return out


def test_a_cluster_block_s_workers_fetch_formats_its_controller_publishes():
    """A block that starts a controller and workers is one run: each worker's format must be published
    (a worker asking for another is refused), SGLang workers fetching their full-precision wire format."""
    from asyncrl.config.loader import load_train_config
    from asyncrl.config.roles import WorkerRoleConfig, parse_role
    from asyncrl.config.schema import sglang_wire_format
    from workers.prepare import publish_formats

    checked, wrong = 0, []
    for page, n, lines in fenced_blocks():
        ctl = [ln.split("asyncrl controller", 1)[1].split() for ln in lines if ln.startswith("asyncrl controller")]
        workers = [ln.split("asyncrl worker", 1)[1].split() for ln in lines if ln.startswith("asyncrl worker")]
        if len(ctl) != 1 or not workers:
            continue
        cfg = load_train_config([w for w in ctl[0] if "=" in w and not w.startswith("[")])
        published = publish_formats(cfg)
        for words in workers:
            role = parse_role(WorkerRoleConfig, [w for w in words if "=" in w and not w.startswith("[")],
                              command="worker")
            serving = role.quant.fmt or cfg.quant.fmt
            fetch = sglang_wire_format(serving) if role.rollout.engine == "sglang" else serving
            checked += 1
            if fetch not in published:
                wrong.append(f"{page}:{n}: a worker {' '.join(words)} fetches {fetch}; the run publishes {published}")
    assert checked, "no fenced block with a controller and its workers; README.md's cluster block is one"
    assert not wrong, wrong
