"""The ``asyncrl`` command line: one entry point, sub-commands dispatched lazily.

Owns argument parsing only. Each sub-command imports its implementation when it runs, so
``asyncrl --help`` stays fast and never imports torch or zmq. Configuration errors are printed as one
line that says what to change, with exit code 2, before any process starts; a resume of a finished
run says so and exits 0 without touching the run folder.

  asyncrl train [key=value ...]           continuous asynchronous training (Hydra overrides)
  asyncrl demo                            the main job on the embedded default (= train)
  asyncrl worker controller=ADDR [...]    join a running job as a generation worker
  asyncrl controller [key=value ...]      a run's controller alone (cluster: each role its own command)
  asyncrl learner controller=ADDR [...]   one learner rank, under torchrun (any number of nodes)
  asyncrl torchrun [torchrun args]        torchrun, for which SIGTERM or Ctrl-C stops the learner cleanly (exit 0)
  asyncrl replay run=runs/NAME [...]      retrain from a run's trajectory log (bit-identical on CPU)
  asyncrl log inspect PATH                summary of a trajectory log (exit 1: damage or exactly-once broken)
  asyncrl log repair PATH                 salvage a log with interior damage, explicitly
  asyncrl log show RUN [--last N|--step K] decoded prompts and completions with rewards and versions
  asyncrl keys generate DIR               CurveZMQ keys for transport.keys_dir=DIR

``asyncrl worker`` and ``asyncrl learner`` read their ``key=value`` settings like ``train`` does: typed role
configs (``asyncrl.config.roles``), with ``role_argv`` here for ``--help``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _cmd_log_inspect(args: argparse.Namespace) -> int:
    from asyncrl.log.inspect import inspect_main

    return inspect_main(args.path, as_json=args.json)


def _cmd_log_show(args: argparse.Namespace) -> int:
    from workers.log_show import show_main

    return show_main(args.run, last=args.last, step=args.step, tokenizer=args.tokenizer)


def _cmd_log_repair(args: argparse.Namespace) -> int:
    from asyncrl.controller.recovery import repair_main

    return repair_main(args.path)


def _cmd_train(args: argparse.Namespace) -> int:
    from workers.launcher import run_train

    return run_train(args.overrides)


def _cmd_demo(args: argparse.Namespace) -> int:
    from workers.launcher import run_train

    print("asyncrl demo: GRPO-style training of the embedded tiny Qwen2 on single-digit addition, two int8 "
          "workers, eta=2, ACR objective (configs/train.yaml)")
    return run_train(["run_name=demo", *args.overrides])


def _cmd_replay(args: argparse.Namespace) -> int:
    from workers.replay import run_replay

    return run_replay(args.overrides)


def _cmd_keys(args: argparse.Namespace) -> int:
    from workers.keys import keys_main

    return keys_main(args.rest)


def _cmd_worker(args: argparse.Namespace) -> int:
    from workers.generator.process import main as worker_main

    return worker_main(args.overrides)


def _cmd_controller(args: argparse.Namespace) -> int:
    from workers.roles import run_controller

    return run_controller(args.overrides)


def _cmd_learner(args: argparse.Namespace) -> int:
    from workers.roles import run_learner

    return run_learner(args.rest)


def _cmd_torchrun(args: argparse.Namespace) -> int:
    from workers.torchrun import main as torchrun_main

    return torchrun_main(args.rest)


CONTROLLER_HELP = """a run's controller alone, in the foreground (docs/cluster.md)
Prepares the run folder and the model like `asyncrl train` (same key=value settings; resume=RUN resumes),
binds transport.host:transport.port, prints its addresses, then serves until the learner finishes:

  asyncrl controller transport.host=0.0.0.0 transport.port=5555 transport.keys_dir=keys/ [key=value ...]
  asyncrl torchrun --nnodes=N ... -m asyncrl learner controller=tcp://THIS_HOST:5555  (training nodes)
  asyncrl worker controller=tcp://THIS_HOST:5555 [rollout.engine=sglang ...]     (generation nodes)

Put the run folder (runs_dir) on a filesystem the learner nodes share: both write checkpoints into it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[6:18]))
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, text in (("train", _cmd_train, "continuous asynchronous training"),
                             ("demo", _cmd_demo, "train on the embedded default and print where results are"),
                             ("replay", _cmd_replay, "retrain from a run's trajectory log (run=runs/<name>)")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("overrides", nargs="*", help="key=value settings (see configs/ and asyncrl/config/schema.py)")
        p.set_defaults(func=func)
    wrk = sub.add_parser("worker", help="join a running job as a generation worker (worker --help: settings)",
                         add_help=False)
    wrk.add_argument("overrides", nargs=argparse.REMAINDER)
    wrk.set_defaults(func=_cmd_worker)
    ctl = sub.add_parser("controller", help="a run's controller alone (cluster: each role its own command)",
                         description=CONTROLLER_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ctl.add_argument("overrides", nargs="*", help="key=value settings, as for `asyncrl train`")
    ctl.set_defaults(func=_cmd_controller)
    from workers.roles import LEARNER_HELP  # no heavy import: roles imports torch/zmq only inside functions

    lrn = sub.add_parser("learner", help="one learner rank under torchrun: learner controller=ADDR",
                         description=LEARNER_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                         add_help=False)
    lrn.add_argument("rest", nargs=argparse.REMAINDER)
    lrn.set_defaults(func=_cmd_learner)

    tr = sub.add_parser("torchrun", help="torchrun (same arguments) for which SIGTERM stops the learner cleanly",
                        add_help=False)
    tr.add_argument("rest", nargs=argparse.REMAINDER)
    tr.set_defaults(func=_cmd_torchrun)

    keys = sub.add_parser("keys", help="CurveZMQ keys: generate DIR [--clients N] | add DIR NAME")
    keys.add_argument("rest", nargs=argparse.REMAINDER)
    keys.set_defaults(func=_cmd_keys)

    log = sub.add_parser("log", help="trajectory-log tools")
    log_sub = log.add_subparsers(dest="log_command", required=True)
    insp = log_sub.add_parser("inspect", help="counts, version range, staleness histogram, rewards")
    insp.add_argument("path", help="a trajectory log file, or a run folder holding trajectories.log")
    insp.add_argument("--json", action="store_true", help="print the summary as JSON")
    insp.set_defaults(func=_cmd_log_inspect)
    show = log_sub.add_parser("show", help="decoded prompts and completions with rewards, advantages, versions")
    show.add_argument("run", help="a run folder (runs/NAME) or its trajectories/ folder")
    show.add_argument("--last", type=int, default=None, help="the last N samples logged (default 8)")
    show.add_argument("--step", type=int, default=None, help="the samples learner step K trained on")
    show.add_argument("--tokenizer", default=None, help="a folder with the run's tokenizer (default: the run's model)")
    show.set_defaults(func=_cmd_log_show)
    rep = log_sub.add_parser("repair", help="remove damaged bytes, keep every intact record (originals kept)")
    rep.add_argument("path", help="a run folder (its checkpoints' log positions are moved too) or a log folder")
    rep.set_defaults(func=_cmd_log_repair)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("worker", "learner", "torchrun"):  # their own parsers (`asyncrl worker --help`)
        args = argparse.Namespace(command=argv[0], overrides=argv[1:], rest=argv[1:],
                                  func={"worker": _cmd_worker, "learner": _cmd_learner, "torchrun": _cmd_torchrun}[argv[0]])
    else:
        args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    # asyncrl.config loads neither torch nor zmq: the import is cheap
    from workers.run_config import RunFinished

    try:
        return int(func(args) or 0)
    except RunFinished as e:  # resume=RUN of a finished run: nothing to do, nothing changed
        print(f"asyncrl {args.command}: {e}")
        return 0
    except ValueError as e:
        print(f"asyncrl {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
