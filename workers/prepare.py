"""Run preparation: everything ``asyncrl train``, ``asyncrl controller`` and ``asyncrl replay`` do before
the first role process starts.

Owns: the run's configuration (a new one from the overrides, a resumed run's own with ``resume=RUN``,
a replay's from its source run), its paths made absolute against the caller's folder, the transport
checks (keys load, the bind address is allowed), the task, model-folder and prompt checks (in a
short-lived child process, ``preflight``), the new run folder with its ``config.json``, the list of
weight formats the learner publishes, and a replay's own options (``replay.allow_prefix``) with its
refusal of a run still training.
Never: starts or supervises a role process (``workers/launcher.py`` and ``workers/roles.py`` do), nor
loads torch or transformers into the calling process (the launcher supervises the run for hours).

Invariant: every check that can fail on the user's input runs here, so a bad configuration is one
``ValueError`` line before any role process exists, and no run folder is created for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from asyncrl.config.loader import load_train_config, save_config
from asyncrl.config.paths import resolve_paths
from asyncrl.config.schema import TrainConfig
from asyncrl.rundir import RunDir


class PreparedRun(NamedTuple):
    cfg: TrainConfig
    run_dir: Path
    model_dir: Path
    tokenizer_class: str
    """``AutoTokenizer``'s class for the model folder, which the controller loads without torch
    (``asyncrl.tasks.prompts.load_tokenizer``); "" when only ``AutoTokenizer`` can."""


def new_run_dir(cfg: TrainConfig) -> Path:
    """A new folder ``runs_dir/run_name``, or ``run_name-2``, ``-3``, ... when that name is taken."""
    base = Path(cfg.runs_dir) / cfg.run_name
    run_dir, i = base, 1
    while run_dir.exists():
        i += 1
        run_dir = base.with_name(f"{base.name}-{i}")
    try:
        run_dir.mkdir(parents=True)
    except OSError as e:
        from asyncrl.rundir.files import raise_if_not_writable

        raise_if_not_writable(e, cfg.runs_dir, "runs_dir", "pass runs_dir=DIR, a folder this user can write to")
        raise
    return run_dir


def check_transport(cfg: TrainConfig) -> None:
    """Keys load and the bind address is allowed, before any process starts (children run from ROOT)."""
    from asyncrl.transport import check_bind_security, server_curve

    if cfg.transport.keys_dir:
        cfg.transport.keys_dir = str(Path(cfg.transport.keys_dir).resolve())
    curve = server_curve(cfg.transport)
    check_bind_security(f"tcp://{cfg.transport.host}:{cfg.transport.port}", keys=curve is not None,
                        insecure=cfg.transport.insecure)


def publish_formats(cfg: TrainConfig) -> list[str]:
    """The run's format first (the primary), then the extra ones, without repeats. SGLang workers fetch a
    full-precision publication (an fp8 server quantizes bf16 on load), so that one is published too."""
    from asyncrl.config.schema import sglang_wire_format

    extra = [sglang_wire_format(cfg.quant.fmt)] if cfg.rollout.engine == "sglang" else []
    return list(dict.fromkeys([cfg.quant.fmt, *cfg.quant.extra_formats, *extra]))


def prepare_run(overrides: Sequence[str], *, command: str = "train") -> PreparedRun:
    """Config (new, or a resumed run's own with ``resume=RUN``), checks, model folder, run folder."""
    from asyncrl.config.schema import config_warnings

    resume = [o.split("=", 1)[1] for o in overrides if o.startswith("resume=")]
    if resume:  # the run's own configuration, with only the overrides a resume accepts (RunFinished: done)
        from workers.run_config import resume_config

        run_dir: Path | None = Path(resume[0]).resolve()
        cfg = resume_config(Path(resume[0]), overrides, command=command)
    else:
        cfg = load_train_config(list(overrides))  # bad configuration fails here, before any process starts
        run_dir = None
    resolve_paths(cfg)  # against the caller's folder, where the children also run
    for warning in config_warnings(cfg):
        print(f"asyncrl {command}: warning: {warning}")
    check_transport(cfg)
    model_dir, tokenizer_class = preflight(cfg, command)
    run_dir = run_dir or new_run_dir(cfg)
    save_config(cfg, RunDir(run_dir).config)
    return PreparedRun(cfg, run_dir, model_dir, tokenizer_class)


def _preflight_checks(cfg: TrainConfig, command: str) -> tuple[Path, str]:
    from asyncrl.models.prepare import check_prompt_lengths, check_prompts, check_task, prepare_model

    def say(m: str) -> None:
        print(f"asyncrl {command}: {m}", flush=True)

    check_task(cfg, log=say)
    model_dir = prepare_model(cfg, log=lambda m: print(m, flush=True))
    prompt_format, tokenizer_class = check_prompts(cfg, model_dir)
    say(f"prompts in {prompt_format} format")
    check_prompt_lengths(cfg, model_dir, log=say)
    return model_dir, tokenizer_class


def preflight(cfg: TrainConfig, command: str) -> tuple[Path, str]:
    """The checks that need the task, the model folder and its tokenizer (building the folder if it is
    missing), in a child process that ends with them: torch and transformers never load into the
    command's own process, which for ``asyncrl train`` then supervises the run for hours (docs/benchmarks.md
    §8 says what that saves). The child's ``ValueError`` (a bad dataset, a prompt too long, ...)
    is raised here as is. Returns the model folder and its tokenizer class (``PreparedRun``)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_preflight_checks, cfg, command).result()


class PreparedReplay(NamedTuple):
    cfg: TrainConfig
    source: Path
    """The run folder replayed."""
    source_log: Path
    """Its trajectory log, which the learner trains from."""
    run_dir: Path
    model_dir: Path
    prefix_steps: int | None = None
    """With ``replay.allow_prefix=true`` on a run still training: the steps its log held when the replay
    started, which are all the learner replays (the live run goes on logging); ``None``: the whole log."""


REPLAY_OPTIONS = {"replay.allow_prefix": "replay the steps logged so far of a run still training"}
"""``asyncrl replay``'s own options (besides ``run=``): not configuration keys, so never in a ``config.json``."""


def replay_options(overrides: Sequence[str]) -> tuple[dict[str, bool], list[str]]:
    """``replay.*`` options (true/false) out of ``overrides``, and the rest: ``ValueError`` for an unknown
    option, naming the nearest one, or a value that is not true/false."""
    from asyncrl.config.loader import nearest_key, parse_bool

    options = dict.fromkeys(REPLAY_OPTIONS, False)
    rest = []
    for ov in overrides:
        key, _, value = ov.partition("=")
        if not key.startswith("replay."):
            rest.append(ov)
            continue
        if key not in REPLAY_OPTIONS:
            near = nearest_key(key, list(REPLAY_OPTIONS))
            hint = f"did you mean {near}?" if near else f"the replay options are {', '.join(REPLAY_OPTIONS)}."
            takes = ", ".join(f"{k}=true|false" for k in REPLAY_OPTIONS)
            raise ValueError(f"unknown replay option {key!r}; {hint} (replay takes run=RUN, {takes} and "
                             "configuration overrides)")
        options[key] = parse_bool(key, value)
    return options, rest


def check_not_training(src: Path, src_log: Path, *, allow_prefix: bool, log: Callable[[str], None]) -> int | None:
    """``None`` when no live job holds ``src`` (the run has ended: replay its whole log). While one does (an
    ``asyncrl train`` or controller still writing the log) replay refuses, unless ``allow_prefix``: then the
    steps logged so far, which is what it replays, and it says so."""
    from asyncrl.log.replay import logged_steps
    from asyncrl.rundir.lock import run_lock_holder

    holder = run_lock_holder(src)
    if holder is None:
        return None
    by = "a live process" if holder == "unknown" else f"PID {holder}"
    steps = logged_steps(src_log)
    if not allow_prefix:
        logged = f"the {steps} steps it has logged so far" if steps else "the steps it has logged so far (none yet)"
        raise ValueError(f"{src} is still training (its run folder is held by {by}); wait for it to finish and "
                         f"replay it then, or pass replay.allow_prefix=true to replay {logged}")
    if steps == 0:
        raise ValueError(f"{src} is still training (its run folder is held by {by}) and has logged no step yet; "
                         "nothing to replay: wait for its first steps")
    log(f"asyncrl replay: replaying a prefix of {steps} steps of a run still training ({src}, {by}); "
        "steps it logs from now on are not replayed")
    return steps


def prepare_replay(overrides: Sequence[str], log: Callable[[str], None] = print) -> PreparedReplay:
    """``asyncrl replay run=runs/<name> [overrides]``: the source run's configuration with the overrides
    (``run_name`` defaults to ``<name>-replay``, beside the source run), the task and model checked, the log
    checked to be replayable on this model, and a new run folder holding the configuration. A run still
    training (a live job holds its folder) is refused, or with ``replay.allow_prefix=true`` replayed up to
    the steps logged so far (``check_not_training``)."""
    from asyncrl.config.loader import apply_overrides
    from asyncrl.log.replay import check_replayable
    from asyncrl.models.prepare import check_task, model_id, prepare_model
    from workers.run_config import read_run_config

    runs = [o.split("=", 1)[1] for o in overrides if o.startswith("run=")]
    if not runs:
        raise ValueError("replay needs run=runs/<name> (a run folder with a trajectory log)")
    options, rest = replay_options([o for o in overrides if not o.startswith("run=")])
    src = Path(runs[0]).resolve()
    src_log = RunDir(src).trajectories
    base = read_run_config(src)
    prefix_steps = check_not_training(src, src_log, allow_prefix=options["replay.allow_prefix"], log=log)
    if not any(o.startswith("run_name=") for o in rest):
        rest.append(f"run_name={src.name}-replay")
    cfg = apply_overrides(base, rest)
    resolve_paths(cfg)
    cfg.resume = ""
    cfg.runs_dir = str(src.parent) if not any(o.startswith("runs_dir=") for o in rest) else cfg.runs_dir
    check_task(cfg, log=lambda m: log(f"asyncrl replay: {m}"))  # the learner evaluates on it: a moved file fails here
    model_dir = prepare_model(cfg, log=log)
    for note in check_replayable(src_log, model_id=model_id(cfg, model_dir), salvage=cfg.log.salvage):
        log(f"asyncrl replay: {note}")
    run_dir = new_run_dir(cfg)
    save_config(cfg, RunDir(run_dir).config)
    return PreparedReplay(cfg, src, src_log, run_dir, model_dir, prefix_steps)
