"""The learner's run-setup request: ``asyncrl learner`` asks the controller where the run is.

Owns: both sides of that one exchange (the ``Hello`` a learner sends with
``capabilities={"request": SETUP_REQUEST}``, the ``RunSetup`` the controller answers in its ``Welcome``:
the run folder, the model folder and the formats to publish), and what ``asyncrl controller`` prints once
it listens (its addresses and the other roles' commands).
Never: prepares a run folder (``workers/prepare.py``), starts a process, or runs a role's loop; it imports
no other module of ``workers``, so the controller, the roles and the launcher all depend on it and it on
none of them.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from protocols import RunSetup
from protocols.setup import SETUP_REQUEST

SETUP_TIMEOUT_S = 120.0
"""How long ``asyncrl learner`` waits for the controller to say where the run is."""


def setup_reply(run_dir: Path, model_dir: Path, formats: Sequence[str]) -> RunSetup:
    """What the controller tells a learner that asks where the run is (``Welcome.run``)."""
    return RunSetup(run_dir=str(Path(run_dir).resolve()), model_dir=str(Path(model_dir).resolve()),
                    publish_formats=list(formats))


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


def announce(addresses: dict[str, str], run_dir: Path) -> None:
    """What ``asyncrl controller`` prints once it listens: its addresses and the commands of the other roles."""
    ctl = addresses["control"]
    print(json.dumps({"control": ctl, "samples": addresses["samples"], "run_dir": str(run_dir)}), flush=True)
    print(f"learner: asyncrl torchrun --nnodes=N --nproc-per-node=G --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 "
          f"-m asyncrl learner controller={ctl}\nworkers: asyncrl worker controller={ctl} [rollout.engine=sglang ...]",
          flush=True)
