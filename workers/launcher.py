"""Local launcher: ``asyncrl train [key=value ...]`` starts and supervises one training job.
(``asyncrl replay`` is ``workers/replay.py``, built on the same ``Launcher``.)

Starts, in order: the controller, the learner (``learner.world_size`` ranks under torchrun; one rank
alone at world size 1) and
``rollout.num_workers`` generation workers, each a child process tracked by PID. Follows
``metrics.jsonl`` for the live progress line; when the learner finishes, stops the workers, waits for
the controller, draws the plots and writes ``summary.json``. Ctrl-C (or SIGTERM) stops every child by
PID, the learner first writing a resumable checkpoint. Any child that dies unexpectedly stops the run
with one line naming its fatal error and its log file, then the tail of that log.
Process trees: each child leads its own process group, so ``stop`` ends the whole tree it started (the
learner's ranks under torchrun included) through that group's id, which is the
child's PID; never by name. One live job per run folder: the launcher holds the run-folder lock
(``asyncrl.rundir.lock``) and hands it to the controller. The children run in the caller's working
directory, against which ``workers/prepare.py`` resolved the configuration's relative paths.
Only here: process spawning and signals. Everything checkable (configuration, transport, task, model,
prompts) is checked before the first spawn, by the run preparation in ``workers/prepare.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from asyncrl.config.schema import TrainConfig
from asyncrl.rundir import RunDir
from workers.gpus import gpu_plan, visible_gpus
from workers.prepare import prepare_run, publish_formats

ROOT = Path(__file__).resolve().parent.parent
MAX_WORKER_RESTARTS = 8  # a worker that keeps crashing is a bug to see, not to hide forever

# Timeouts (seconds): each bounds a wait for a child that may hang; a healthy child ends it at once.
CONTROLLER_START_TIMEOUT_S = 120.0
"""How long the launcher waits for the controller to write ``controller.json`` (it is listening)."""
START_POLL_S = 0.1
"""How often the launcher looks for ``controller.json`` meanwhile."""
SUPERVISE_POLL_S = 0.5
"""How often the launcher's loop reads new metrics and checks its children."""
STOP_GRACE_S = 30.0
"""After SIGTERM, how long a child may take to exit before it is killed."""
LEARNER_STOP_GRACE_S = 120.0
"""The same for the learner on Ctrl-C: it writes a resumable checkpoint before it exits."""
KILL_WAIT_S = 10.0
"""After SIGKILL, how long to wait for the kernel to reap the child."""
CONTROLLER_EXIT_TIMEOUT_S = 60.0
"""After the learner finished, how long the controller may take to write its final files and exit."""


def learner_command(world_size: int, args: list[str]) -> list[str]:
    """The learner's command line: its ranks under a torchrun agent (``asyncrl torchrun``, for which a
    SIGTERM is a stop, not a crash), or at world size 1 the one rank itself (a one-rank group on an
    in-process store, ``init_distributed``), which saves the agent's process and its copy of torch beside a
    small run (docs/benchmarks.md §8)."""
    module = ["-m", "workers.learner", *args]
    if world_size == 1:
        return [sys.executable, "-u", *module]
    return [sys.executable, "-m", "workers.torchrun", "--standalone", f"--nproc_per_node={world_size}", *module]


class ChildStartError(RuntimeError):
    """The controller exited (or never listened) before the run began; the message is one line: its fatal
    error (e.g. a resume it refused, with the fix) and its log file."""


class Child:
    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str],
                 pass_fds: tuple[int, ...] = ()) -> None:
        self.name, self.log_path = name, log_path
        self.log_file = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        # start_new_session: a terminal's Ctrl-C reaches the launcher only; it stops children by PID.
        # The child's process group id is its PID: stop() ends grandchildren through it.
        self.proc = subprocess.Popen(args, stdout=self.log_file, stderr=subprocess.STDOUT, cwd=os.getcwd(),
                                     env=env, start_new_session=True, pass_fds=pass_fds)

    def fatal_line(self) -> str:
        """One line: the child's fatal error (the signal that killed it, else the last exception or exit
        message in its log) and the log."""
        rc = self.proc.returncode
        if rc is not None and rc < 0:
            try:
                cause = f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                cause = f"killed by signal {-rc}"
        else:
            cause = fatal_error(self.log_path)
        return f"{self.name} failed (exit {rc}): {cause}  [log: {self.log_path}]"

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        self.log_file.close()


_FATAL = re.compile(r"^(?:[\w.]+(?:Error|Exception|Exit|Interrupt)|ChildFailedError|[\w.]+Full\w*)\b.*|^(?:controller|worker|learner)[\w -]*: .*")


def fatal_error(log_path: Path) -> str:
    """The last line of a child's log that names an exception or a fatal message, else its last line."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError as e:
        return f"(log unreadable: {e})"
    for ln in reversed(lines):
        text = re.sub(r"^\[rank\d+\]:\s*", "", ln)  # torchrun prefixes a rank's stderr lines
        if _FATAL.match(text) and not text.startswith(("torch.distributed.elastic", "ChildFailedError")):
            return text
    return lines[-1] if lines else "(empty log)"


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class Launcher:
    def __init__(self, cfg: TrainConfig, run_dir: Path, model_dir: Path, lock_fd: int | None = None,
                 tokenizer_class: str = "") -> None:
        self.cfg, self.run_dir, self.model_dir, self.lock_fd = cfg, run_dir.resolve(), model_dir.resolve(), lock_fd
        self.tokenizer_class = tokenizer_class  # the controller loads it without torch (workers/roles.py)
        self.paths = RunDir(self.run_dir)
        self.children: list[Child] = []
        self.restarts = 0
        self.env = child_env()
        self.paths.logs.mkdir(exist_ok=True)

    def spawn(self, name: str, args: list[str], cuda_devices: str | None = None, *,
              lock_fd: int | None = None) -> Child:
        env = self.env if cuda_devices is None else self.env | {"CUDA_VISIBLE_DEVICES": cuda_devices}
        fds: tuple[int, ...] = ()
        if lock_fd is not None:  # the controller shares the launcher's run-folder lock
            from asyncrl.rundir.lock import INHERITED_ENV

            env, fds = {**env, INHERITED_ENV: str(lock_fd)}, (lock_fd,)
        child = Child(name, args, self.paths.log_of(name), env, pass_fds=fds)
        self.children.append(child)
        # Operators (and tests) can see exactly which processes this run started.
        self.paths.pids.write_text(json.dumps({c.name: c.proc.pid for c in self.children}))
        return child

    def start(self) -> None:
        fmts = ",".join(publish_formats(self.cfg))
        common = ["--run-dir", str(self.run_dir), "--model-dir", str(self.model_dir), "--publish-formats", fmts]
        self.paths.controller_address.unlink(missing_ok=True)  # a resumed run must not read the old address
        self.controller = self.spawn("controller", [sys.executable, "-m", "workers.controller", *common,
                                                    "--tokenizer-class", self.tokenizer_class], lock_fd=self.lock_fd)
        addr_file = self.paths.controller_address
        deadline = time.monotonic() + CONTROLLER_START_TIMEOUT_S
        while not addr_file.exists():
            if self.controller.proc.poll() is not None or time.monotonic() > deadline:
                self.controller.proc.poll()
                raise ChildStartError(f"controller did not start: {self.controller.fatal_line()}")
            time.sleep(START_POLL_S)
        self.address = json.loads(addr_file.read_text())["control"]
        W = self.cfg.learner.world_size
        learner_gpus, self.worker_gpus = gpu_plan(visible_gpus(), self.cfg)
        self.learner = self.spawn("learner", learner_command(W, ["--controller", self.address, *common]),
                                  cuda_devices=learner_gpus)
        self.workers = [self.spawn(f"worker-{i}", self.worker_args(f"worker-{i}"), cuda_devices=self.worker_gpus[i])
                        for i in range(self.cfg.rollout.num_workers)]

    def worker_args(self, name: str) -> list[str]:
        """``asyncrl worker`` for one of this run's workers: every setting of its ``WorkerRoleConfig`` (the
        run's engine, device, decode options, keys and ``sglang.*``), written by ``role_dotlist``."""
        from asyncrl.config.roles import role_dotlist, worker_role_for_run

        role = worker_role_for_run(self.cfg, controller=self.address, worker_id=name, log_dir=str(self.paths.logs))
        return [sys.executable, "-m", "workers.generator", *role_dotlist(role)]

    def restart_worker(self, dead: Child) -> None:
        """Replace a worker that died (its work was reissued by the controller), on the same GPU."""
        self.restarts += 1
        base = dead.name.split("-r")[0]
        name = f"{base}-r{self.restarts}"
        index = int(base.rsplit("-", 1)[1])
        gpus = getattr(self, "worker_gpus", [])
        self.workers.append(self.spawn(name, self.worker_args(name),
                                       cuda_devices=gpus[index] if index < len(gpus) else None))

    def stop(self, children: Sequence[Child] | None = None, grace_s: float = STOP_GRACE_S) -> None:
        chosen = list(self.children if children is None else children)
        targets = [c for c in chosen if c.proc.poll() is None]
        for c in targets:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in targets:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(timeout=KILL_WAIT_S)
        for c in chosen:  # whatever the child left behind in its process group (torchrun's ranks): by group id
            end_process_group(c.proc.pid)

    def close(self) -> None:
        for c in self.children:
            c.close()


def end_process_group(pgid: int) -> None:
    """SIGKILL what is left of the process group a child led (its group id is the child's PID)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_train(overrides: Sequence[str]) -> int:
    from asyncrl.rundir.lock import acquire_run_lock

    resume = [o.split("=", 1)[1] for o in overrides if o.startswith("resume=")]
    if resume:  # not a run folder, or a finished run: said before the folder's lock is taken
        from workers.run_config import check_resumable

        check_resumable(Path(resume[0]).resolve())
    held = [acquire_run_lock(Path(resume[0]).resolve())] if resume else []  # a second resume is refused here
    try:
        cfg, run_dir, model_dir, tokenizer_class = prepare_run(overrides)  # as `asyncrl controller` does
        if not held:
            held.append(acquire_run_lock(run_dir))
        return _train(cfg, run_dir, model_dir, held[0], tokenizer_class)
    finally:
        for fd in held:
            os.close(fd)


def _train(cfg: TrainConfig, run_dir: Path, model_dir: Path, lock_fd: int, tokenizer_class: str = "") -> int:
    from asyncrl.metrics import Progress, format_summary, make_plots, write_summary

    launcher = Launcher(cfg, run_dir, model_dir, lock_fd=lock_fd, tokenizer_class=tokenizer_class)
    print(f"asyncrl train: run folder {run_dir}")
    interrupted = {"flag": False}

    def on_signal(*_):
        interrupted["flag"] = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    progress = Progress(cfg.learner.total_steps)
    try:
        try:
            launcher.start()
        except ChildStartError as e:  # its own error says what to change: no traceback, no "resume with" hint
            print(e)
            return 1
        print(f"controller at {launcher.address}  (join more workers: asyncrl worker controller={launcher.address})")
        rc = supervise(launcher, ProgressFeed(run_dir, progress), interrupted=lambda: interrupted["flag"])
    finally:
        progress.close()
        launcher.stop()
        launcher.close()
        for s, h in old.items():
            signal.signal(s, h)
    if rc != 0:
        print(f"run stopped (exit {rc}); resume with: asyncrl train resume={run_dir}")
        return rc
    plots = make_plots(run_dir)
    summary = build_summary(run_dir, wall_seconds=time.monotonic() - t0)
    write_summary(run_dir, summary)
    print(format_summary(summary))
    print(f"results: {run_dir} (summary.json, metrics.jsonl, tb/, trajectories/, checkpoints/, model/, "
          f"{len(plots)} plots in plots/)")
    return 0


class ProgressFeed:
    """The run's new ``metrics.jsonl`` records and training-health alarms (``health.jsonl``, one line
    each), read from where the last ``read`` stopped into the live progress line."""

    def __init__(self, run_dir: Path, progress) -> None:
        from asyncrl.metrics.health_log import health_path

        self.metrics, self.health, self.progress = RunDir(run_dir).metrics, health_path(run_dir), progress
        self.offset = self.health_offset = 0

    def read(self) -> None:
        from asyncrl.metrics import tail_metrics
        from asyncrl.metrics.health_log import format_alarm

        records, self.offset = tail_metrics(self.metrics, self.offset)
        for r in records:
            self.progress.update(int(r["step"]), r)
        alarms, self.health_offset = tail_metrics(self.health, self.health_offset)
        for a in alarms:
            self.progress.note(format_alarm(a))


def supervise(launcher: Launcher, feed: ProgressFeed, *, interrupted: Callable[[], bool]) -> int:
    """Follow the run until the learner finishes (0), a child fails (its exit status; the others are
    stopped) or the launcher is interrupted (130: the learner first writes a resumable checkpoint). A worker
    that dies meanwhile is restarted, up to ``MAX_WORKER_RESTARTS`` in all; the run goes on."""
    reported: set[Child] = set()
    while True:
        feed.read()
        if interrupted():
            print("\ninterrupted: stopping the learner (it writes a resumable checkpoint) and every worker")
            launcher.stop([launcher.learner], grace_s=LEARNER_STOP_GRACE_S)
            launcher.stop()
            rc = 130
            break
        ended = _run_ended(launcher)
        if ended is not None:
            rc = ended
            break
        _restart_failed_workers(launcher, reported)
        time.sleep(SUPERVISE_POLL_S)
    feed.read()
    return rc


def _run_ended(launcher: Launcher) -> int | None:
    """The run's exit status once the learner has exited or the controller failed (every child then
    stopped), else None."""
    learner, controller = launcher.learner, launcher.controller
    if learner.proc.poll() is not None:
        if learner.proc.returncode != 0:
            print(f"\n{learner.fatal_line()}\n{learner.tail()}")
            launcher.stop()
            return learner.proc.returncode
        controller.proc.wait(timeout=CONTROLLER_EXIT_TIMEOUT_S) if _alive(controller) else None
        launcher.stop()
        if controller.proc.returncode not in (None, 0):  # e.g. its log lost at the end: no summary of it
            print(f"\n{controller.fatal_line()}\n{controller.tail()}")
            return controller.proc.returncode
        return 0
    if controller.proc.poll() not in (None, 0):  # 0: it finished with the learner
        print(f"\n{controller.fatal_line()}\n{controller.tail()}")
        launcher.stop()
        return controller.proc.returncode
    return None


def _restart_failed_workers(launcher: Launcher, reported: set[Child]) -> None:
    for w in list(launcher.workers):
        if w.proc.poll() not in (None, 0) and w not in reported:
            reported.add(w)  # elastic: the controller reissues its work; the run goes on
            print(f"\n{w.fatal_line()}; its assignments are reissued")
            if launcher.restarts < MAX_WORKER_RESTARTS:
                launcher.restart_worker(w)
                print(f"restarted {w.name} (restart {launcher.restarts} of {MAX_WORKER_RESTARTS}; "
                      f"add more with: asyncrl worker controller={launcher.address})")


def _alive(c: Child) -> bool:
    return c.proc.poll() is None


def build_summary(run_dir: Path, *, wall_seconds: float) -> dict:
    from asyncrl.metrics.health_log import summarize_alarms

    learner = json.loads(RunDir(run_dir).learner_final.read_text())
    controller = json.loads(RunDir(run_dir).controller_final.read_text())
    return {
        "final_train_reward": last_reward(run_dir),
        "eval_accuracy": learner.get("eval/accuracy"),
        "learner_steps": learner["version"],
        "wall_seconds": wall_seconds,
        "max_consumed_staleness": controller["max_consumed_staleness"],
        "samples_logged": controller["samples_logged"],
        "state_dict_sha256": learner["state_dict_sha256"],
        "run_dir": str(run_dir),
        **summarize_alarms(run_dir),  # training-health alarms raised (health.jsonl)
    }


def last_reward(run_dir: Path) -> float:
    """The mean of the run's last five ``train/reward_mean`` values (NaN before the first)."""
    from asyncrl.metrics import read_metrics

    rewards = [r["train/reward_mean"] for r in read_metrics(run_dir) if r.get("train/reward_mean") is not None]
    last = rewards[-5:]
    return sum(last) / len(last) if last else float("nan")
