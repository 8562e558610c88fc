"""Every role as its own command, so a cluster scheduler can place each one (docs/cluster.md).

  asyncrl controller [key=value ...]        prepare the run folder and model, bind, print the addresses,
                                             serve until the learner finishes (foreground)
  asyncrl learner controller=ADDR [...]     one learner rank; run it under torchrun, any number of nodes
  asyncrl worker controller=ADDR [...]      a generation worker (workers/generator/process.py)

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


LEARNER_HELP = """one learner rank of a run whose controller is already serving (`asyncrl controller`)
Run it under `asyncrl torchrun` (torchrun's arguments; SIGTERM or Ctrl-C to it stops the learner with a
resumable checkpoint and exit status 0, where plain torchrun exits 1 with a traceback); every rank asks the
controller where the run folder and the model are:

  one node, G GPUs:
    asyncrl torchrun --standalone --nproc-per-node=G -m asyncrl learner controller=tcp://HOST:PORT
  N nodes (the same command on each; SLURM: examples/slurm/asyncrl.sbatch):
    asyncrl torchrun --nnodes=N --nproc-per-node=G --rdzv-backend=c10d --rdzv-endpoint=NODE0:29500 \\
             --rdzv-id=JOB -m asyncrl learner controller=tcp://HOST:PORT"""
LEARNER_NOTE = """Rank 0 talks to the controller and serves the weights; the device follows learner.device (auto: NCCL on
GPUs, gloo on CPUs)."""


def run_learner(argv: Sequence[str]) -> int:
    """``asyncrl learner controller=ADDR``: this process is one rank (torchrun sets RANK/WORLD_SIZE)."""
    from asyncrl.config.roles import LearnerRoleConfig, parse_role
    from workers.role_cli import role_argv

    head, _, usage = LEARNER_HELP.partition("\n")
    role = parse_role(LearnerRoleConfig, role_argv(argv, command="learner", description=head, usage_text=usage,
                                                   schema=LearnerRoleConfig, note=LEARNER_NOTE), command="learner")
    setup = ask_run_setup(role.controller, keys_dir=role.transport.keys_dir, key_name=role.transport.key_name)
    run_dir = Path(role.run_dir or setup.run_dir)
    model_dir = Path(role.model_dir or setup.model_dir)
    # the run's config.json; the Hugging Face model's config.json
    for name, folder, marker in (("run_dir", run_dir, RunDir(run_dir).config),
                                 ("model_dir", model_dir, model_dir / "config.json")):
        if not marker.is_file():
            raise ValueError(f"{name} {folder} (from the controller) is not readable on this host "
                             f"({socket.gethostname()}); put the run folder on a filesystem shared with the "
                             f"controller, or pass {name}=DIR")
    from workers.learner.process import main as learner_main

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    return learner_main(["--run-dir", str(run_dir), "--model-dir", str(model_dir), "--controller", role.controller,
                         "--publish-formats", ",".join(setup.publish_formats)])
