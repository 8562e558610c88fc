"""Every role as its own command, so a cluster scheduler can place each one (docs/cluster.md).

  asyncrl controller [key=value ...]        prepare the run folder and model, bind, print the addresses,
                                             serve until the learner finishes (foreground)
  asyncrl learner controller=ADDR [...]     one learner rank; run it under torchrun, any number of nodes
  asyncrl worker controller=ADDR [...]      a generation worker (workers/generator.py)

``asyncrl train`` (workers/launcher.py) is the one-machine launcher built from the same pieces:
``prepare_run`` here, then the controller, learner and worker entry points as child processes.

Owns: preparing a run folder (``prepare_run``), the learner's run-setup request to the controller (the
run folder and model folder it serves, and the formats to publish), and the two role entry points.
Never: spawns processes (the launcher and the scheduler do), or reads a run configuration from
anywhere but the run folder (the learner finds the folder through the controller).

Invariant: the run folder is shared by the controller and the learner (on a cluster: a shared
filesystem), because each writes its checkpoints there and a resume reads both.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from asyncrl.config import TrainConfig, load_train_config, save_config
from asyncrl.rundir import RunDir
from protocols import RunSetup

SETUP_REQUEST = "run_setup"  # Hello(role="client", capabilities={"request": SETUP_REQUEST})


class PreparedRun(NamedTuple):
    cfg: TrainConfig
    run_dir: Path
    model_dir: Path
    tokenizer_class: str
    """``AutoTokenizer``'s class for the model folder, which the controller loads without torch
    (``asyncrl.controller.prompts.load_tokenizer``); "" when only ``AutoTokenizer`` can."""


def prepare_run(overrides: Sequence[str], *, command: str = "train") -> PreparedRun:
    """Config (new, or a resumed run's own with ``resume=RUN``), checks, model folder, run folder."""
    from asyncrl.config.schema import config_warnings
    from workers.launcher import check_transport, new_run_dir, resolve_paths

    resume = [o.split("=", 1)[1] for o in overrides if o.startswith("resume=")]
    if resume:  # the run's own configuration, with only the overrides a resume accepts (RunFinished: done)
        from asyncrl.config.resume import resume_config

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
    command's own process, which for ``asyncrl train`` then supervises the run for hours (about 0.4 GB
    less resident beside the run). The child's ``ValueError`` (a bad dataset, a prompt too long, ...)
    is raised here as is. Returns the model folder and its tokenizer class (``PreparedRun``)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_preflight_checks, cfg, command).result()


def run_controller(overrides: Sequence[str]) -> int:
    """``asyncrl controller``: the run's controller in the foreground; prints where the other roles connect."""
    from workers.controller import main as controller_main
    from workers.launcher import publish_formats

    cfg, run_dir, model_dir, tokenizer_class = prepare_run(overrides, command="controller")
    print(f"asyncrl controller: run folder {run_dir}", flush=True)
    return controller_main(["--run-dir", str(run_dir), "--model-dir", str(model_dir),
                            "--publish-formats", ",".join(publish_formats(cfg)), "--announce",
                            "--tokenizer-class", tokenizer_class])


def setup_reply(run_dir: Path, model_dir: Path, formats: Sequence[str]) -> RunSetup:
    """What the controller tells a learner that asks where the run is (``Welcome.run``)."""
    return RunSetup(run_dir=str(Path(run_dir).resolve()), model_dir=str(Path(model_dir).resolve()),
                    publish_formats=list(formats))


SETUP_TIMEOUT_S = 120.0
"""How long ``asyncrl learner`` waits for the controller to say where the run is."""


def ask_run_setup(controller: str, *, keys_dir: str = "", key_name: str = "",
                  timeout_s: float = SETUP_TIMEOUT_S) -> RunSetup:
    """Ask the controller at ``controller`` for the run folder, the model folder and the formats to publish."""
    import zmq

    import protocols as P
    from asyncrl.transport import ZmqChannel, load_client_keys

    curve = load_client_keys(keys_dir, key_name) if keys_dir else None
    peer = f"learner-setup-{socket.gethostname()}-{os.getpid()}"
    ch = ZmqChannel.connect(zmq.DEALER, controller, name="learner-setup", identity=peer.encode(), curve=curve)
    try:
        ch.send(P.Hello(protocol_version=P.PROTOCOL_VERSION, role="client", peer_id=peer,
                        capabilities={"request": SETUP_REQUEST}))
        env = ch.recv(timeout_s)
    finally:
        ch.close()
    if env is None:
        raise ValueError(f"no answer from a controller at {controller} within {timeout_s:.0f} s; start "
                         "`asyncrl controller` first and pass the address it prints (controller=tcp://HOST:PORT)")
    if not isinstance(env.msg, P.Welcome):
        raise ValueError(f"the controller at {controller} did not describe its run: {env.msg!r}")
    return env.msg.run_setup()


LEARNER_HELP = """one learner rank of a run whose controller is already serving (`asyncrl controller`)
Run it under torchrun; every rank asks the controller where the run folder and the model are:

  one node, G GPUs:
    torchrun --standalone --nproc-per-node=G -m asyncrl learner controller=tcp://HOST:PORT
  N nodes (the same command on each; SLURM: examples/slurm/asyncrl.sbatch):
    torchrun --nnodes=N --nproc-per-node=G --rdzv-backend=c10d --rdzv-endpoint=NODE0:29500 \\
             --rdzv-id=JOB -m asyncrl learner controller=tcp://HOST:PORT"""
LEARNER_NOTE = """Rank 0 talks to the controller and serves the weights; the device follows learner.device (auto: NCCL on
GPUs, gloo on CPUs)."""


def run_learner(argv: Sequence[str]) -> int:
    """``asyncrl learner controller=ADDR``: this process is one rank (torchrun sets RANK/WORLD_SIZE)."""
    from asyncrl.config.roles import LearnerRoleConfig, parse_role
    from workers.cli import role_argv

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
    from workers.learner import main as learner_main

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    return learner_main(["--run-dir", str(run_dir), "--model-dir", str(model_dir), "--controller", role.controller,
                         "--publish-formats", ",".join(setup.publish_formats)])


def announce(addresses: dict[str, str], run_dir: Path) -> None:
    """What ``asyncrl controller`` prints once it listens: its addresses and the commands of the other roles."""
    ctl = addresses["control"]
    print(json.dumps({"control": ctl, "samples": addresses["samples"], "run_dir": str(run_dir)}), flush=True)
    print(f"learner: torchrun --nnodes=N --nproc-per-node=G --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 "
          f"-m asyncrl learner controller={ctl}\nworkers: asyncrl worker controller={ctl} [engine=sglang ...]",
          flush=True)
