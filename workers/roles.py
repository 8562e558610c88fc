"""Every role as its own command, so a cluster scheduler can place each one (docs/cluster.md).

  asyncrl controller [key=value ...]        prepare the run folder and model, bind, print the addresses,
                                             serve until the learner finishes (foreground)
  asyncrl learner controller=ADDR [...]     one learner rank; run it under torchrun, any number of nodes
  asyncrl worker controller=ADDR [...]      a generation worker (workers/generator.py)

``asyncrl train`` (workers/launcher.py) is the one-machine launcher built from the same pieces:
``prepare_run`` (workers/prepare.py), then the controller, learner and worker entry points as child
processes.

Owns: the two role entry points (``run_controller``, ``run_learner``) and the learner's command-line
settings. Run preparation is ``workers/prepare.py``; the learner's run-setup request to the controller
(the run folder and model folder it serves, and the formats to publish) is ``workers/run_setup.py``.
Never: spawns processes (the launcher and the scheduler do), or reads a run configuration from
anywhere but the run folder (the learner finds the folder through the controller).

Invariant: the run folder is shared by the controller and the learner (on a cluster: a shared
filesystem), because each writes its checkpoints there and a resume reads both.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncrl.rundir import RunDir
from workers.prepare import prepare_run, publish_formats
from workers.run_setup import ask_run_setup


def run_controller(overrides: Sequence[str]) -> int:
    """``asyncrl controller``: the run's controller in the foreground; prints where the other roles connect."""
    from workers.controller import main as controller_main

    cfg, run_dir, model_dir, tokenizer_class = prepare_run(overrides, command="controller")
    print(f"asyncrl controller: run folder {run_dir}", flush=True)
    return controller_main(["--run-dir", str(run_dir), "--model-dir", str(model_dir),
                            "--publish-formats", ",".join(publish_formats(cfg)), "--announce",
                            "--tokenizer-class", tokenizer_class])


def parse_kv(argv: Sequence[str], prog: str, known: set[str], epilog: str) -> dict[str, str]:
    p = argparse.ArgumentParser(prog=prog, description=epilog.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    p.add_argument("overrides", nargs="*", help="key=value settings")
    args = p.parse_args(list(argv))
    kv = {}
    for ov in args.overrides:
        if "=" not in ov:
            p.error(f"{ov!r} is not key=value")
        k, v = ov.split("=", 1)
        if k not in known:
            p.error(f"unknown setting {k!r}; known: {sorted(known)}")
        kv[k] = v
    return kv


LEARNER_HELP = """one learner rank of a run whose controller is already serving (`asyncrl controller`)
Run it under torchrun; every rank asks the controller where the run folder and the model are:

  one node, G GPUs:
    torchrun --standalone --nproc-per-node=G -m asyncrl learner controller=tcp://HOST:PORT
  N nodes (the same command on each; SLURM: examples/slurm/asyncrl.sbatch):
    torchrun --nnodes=N --nproc-per-node=G --rdzv-backend=c10d --rdzv-endpoint=NODE0:29500 \\
             --rdzv-id=JOB -m asyncrl learner controller=tcp://HOST:PORT

settings (key=value):
  controller=tcp://HOST:PORT   required: the address `asyncrl controller` prints
  run_dir=DIR model_dir=DIR    where the run and model folders are on this host (default: the controller's
                               paths, which must then be on a filesystem shared with it)
  transport.keys_dir=DIR transport.key_name=NAME   CurveZMQ client keys (docs/security.md)
Rank 0 talks to the controller and serves the weights; the device follows learner.device (auto: NCCL on
GPUs, gloo on CPUs)."""


def run_learner(argv: Sequence[str]) -> int:
    """``asyncrl learner controller=ADDR``: this process is one rank (torchrun sets RANK/WORLD_SIZE)."""
    kv = parse_kv(argv, "asyncrl learner", {"controller", "run_dir", "model_dir", "transport.keys_dir",
                                            "transport.key_name"}, LEARNER_HELP)
    if "controller" not in kv:
        raise ValueError("controller=tcp://HOST:PORT is required (printed by `asyncrl controller`)")
    setup = ask_run_setup(kv["controller"], keys_dir=kv.get("transport.keys_dir", ""),
                          key_name=kv.get("transport.key_name", ""))
    run_dir = Path(kv.get("run_dir") or setup.run_dir)
    model_dir = Path(kv.get("model_dir") or setup.model_dir)
    # the run's config.json; the Hugging Face model's config.json
    for name, folder, marker in (("run_dir", run_dir, RunDir(run_dir).config),
                                 ("model_dir", model_dir, model_dir / "config.json")):
        if not marker.is_file():
            raise ValueError(f"{name} {folder} (from the controller) is not readable on this host "
                             f"({socket.gethostname()}); put the run folder on a filesystem shared with the "
                             f"controller, or pass {name}=DIR")
    from workers.learner import main as learner_main

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    return learner_main(["--run-dir", str(run_dir), "--model-dir", str(model_dir), "--controller", kv["controller"],
                         "--publish-formats", ",".join(setup.publish_formats)])
