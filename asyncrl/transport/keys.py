"""CurveZMQ key files and the bind-address policy: which sockets need keys, and the keys themselves.

Owns: the keys folder (written by ``asyncrl keys generate DIR``, ``workers/keys.py``), turning it into
a ``CurveConfig`` for a server (bound sockets: controller ROUTER and PULL, learner weight PUB and
ROUTER) or a client (connected sockets: worker and learner DEALERs, worker PUSH, SUB and weight
DEALER), the allow-list reader, and the rule that a non-loopback bind needs keys (or an explicit
``transport.insecure=true``).
Never: touches a socket (``zap.secure_socket`` applies a ``CurveConfig``); parses argv; writes a secret
key readable by other users, or uses one (group or other permission bits set: refused, naming the chmod);
imports torch.

Keys folder (every file is a zmq certificate written by ``zmq.auth``)::

    DIR/server.key             server public key            every host
    DIR/server.key_secret      server key pair              controller and learner hosts only
    DIR/<client>.key           a client's public key
    DIR/<client>.key_secret    that client's key pair       the host that runs that client
    DIR/clients/<client>.key   the allow-list servers read  remove a file to revoke, add one to admit

The allow-list is re-read when ``DIR/clients`` changes (``zap``), so keys added with ``asyncrl keys add``
are admitted, and removed ones refused, on the next connection attempt without a restart (established
connections are not cut).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import zmq.auth

log = logging.getLogger("asyncrl.transport.auth")

SERVER_NAME = "server"
CLIENTS_DIR = "clients"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


# ------------------------------------------------------------------------------------ addresses
def is_loopback(address: str) -> bool:
    """True for ipc:// and inproc:// addresses and tcp:// addresses on a loopback host."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    if not address.startswith("tcp://"):
        raise ValueError(f"unsupported address {address!r}: use tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    host = address[len("tcp://") :].rsplit(":", 1)[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def check_bind_security(address: str, *, keys: bool, insecure: bool) -> None:
    """Refuse to bind a non-loopback ``address`` without CURVE keys unless ``insecure`` is explicit.

    Loopback and ipc addresses are always allowed (only this host can reach them).
    """
    if is_loopback(address) or keys:
        return
    if insecure:
        log.warning("binding %s without CURVE keys (transport.insecure=true): any host that reaches it can "
                    "push samples, fetch weights and talk to the controller", address)
        return
    raise ValueError(
        f"refusing to bind {address} without CURVE keys: other hosts can reach it, and anyone who can would be "
        "able to push samples, fetch the weights and steer the controller. Make keys with "
        "`asyncrl keys generate DIR` and set transport.keys_dir=DIR (copy DIR to the worker hosts), or, on a "
        "network you trust, pass transport.insecure=true")


# ------------------------------------------------------------------------------------ key files
def generate_keys(directory: str | os.PathLike, names: Sequence[str] = (SERVER_NAME, "client"), *,
                  overwrite: bool = False) -> dict[str, Path]:
    """Write a CURVE key pair per name into ``directory``; returns ``{name: secret key file}``.

    ``"server"`` is the server pair; every other name is a client whose public key also goes into the
    allow-list ``directory/clients/<name>.key``. Secret files are created mode 0600. Existing keys are
    kept unless ``overwrite`` (replacing the server pair locks out every client holding the old one).
    """
    root = Path(directory)
    for name in names:
        if not name or "/" in name or name.startswith(".") or name == CLIENTS_DIR:
            raise ValueError(f"key name {name!r} is not a plain file name; use e.g. client-0 or worker-host-3")
    (root / CLIENTS_DIR).mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for name in names:
        secret = root / f"{name}.key_secret"
        if secret.exists() and not overwrite:
            raise ValueError(f"{secret} exists; keep it, pick another name, or pass overwrite=True (--force) "
                             "to replace it (clients holding the old key are then refused)")
        # Written into a private (0700) folder, made 0600, then moved: never readable by others.
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            public_tmp, secret_tmp = zmq.auth.create_certificates(tmp, name)
            os.chmod(secret_tmp, 0o600)
            os.replace(secret_tmp, secret)
            os.replace(public_tmp, root / f"{name}.key")
        if name != SERVER_NAME:
            shutil.copyfile(root / f"{name}.key", root / CLIENTS_DIR / f"{name}.key")
        out[name] = secret
    return out


def _read_pair(path: Path, what: str) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise ValueError(f"{path} not found: {what}; make keys with `asyncrl keys generate "
                         f"{path.parent}` and set transport.keys_dir to that folder")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:  # as ssh does: a secret others can read may have been copied; never use it silently
        raise ValueError(f"{path} is readable by other users (mode {mode:04o}): its secret key must be private; "
                         f"`chmod 600 {path}` if no one else could have read it, else make new keys with "
                         "`asyncrl keys generate`")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except PermissionError:
        raise ValueError(f"{path} cannot be read by this user: run as the user that owns it, or give it to this "
                         f"user (chown; keep it mode 600)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a zmq certificate ({e}); regenerate it with `asyncrl keys generate`") from None
    if secret is None:
        raise ValueError(f"{path} holds no secret key; use the .key_secret file written by `asyncrl keys generate`")
    return public, secret


def read_allow_list(directory: str | os.PathLike) -> frozenset[bytes]:
    """The z85 public keys of every ``*.key`` file in ``directory`` (missing folder: empty)."""
    d = Path(directory)
    if not d.is_dir():
        return frozenset()
    try:
        return frozenset(zmq.auth.load_certificates(d))
    except (OSError, ValueError) as e:
        log.error("cannot read the allow-list %s: %s; refusing every client until it is fixed", d, e)
        return frozenset()


@dataclasses.dataclass(frozen=True)
class CurveConfig:
    """One side's CURVE settings. Server side: ``server_key`` empty, clients from ``allowed_dir`` (re-read
    when it changes) and/or ``allowed_keys``. Client side: ``server_key`` is the server's public key.
    Keys are z85 bytes (40 characters)."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes = b""
    allowed_dir: str = ""
    allowed_keys: frozenset[bytes] = frozenset()

    def __post_init__(self) -> None:
        for field in ("public_key", "secret_key") + (("server_key",) if self.server_key else ()):
            if len(getattr(self, field)) != 40:
                raise ValueError(f"CurveConfig.{field} must be a 40-character z85 key; load keys with "
                                 "load_server_keys/load_client_keys")

    @property
    def is_server(self) -> bool:
        return not self.server_key

    @property
    def domain(self) -> str:
        """ZAP domain: one per allow-list, so servers with different allow-lists never share one."""
        h = hashlib.sha256(os.path.abspath(self.allowed_dir).encode() if self.allowed_dir else b"")
        for k in sorted(self.allowed_keys):
            h.update(k)
        return "asyncrl-" + h.hexdigest()[:16]

    def allowed(self) -> frozenset[bytes]:
        return self.allowed_keys | (read_allow_list(self.allowed_dir) if self.allowed_dir else frozenset())


def load_server_keys(directory: str | os.PathLike) -> CurveConfig:
    """Server side of ``directory``: ``server.key_secret`` and the allow-list ``clients/``."""
    root = Path(directory).resolve()
    public, secret = _read_pair(root / f"{SERVER_NAME}.key_secret", "a server needs the server key pair")
    if not read_allow_list(root / CLIENTS_DIR):
        raise ValueError(f"{root / CLIENTS_DIR} holds no client public key, so no worker could connect; "
                         f"run `asyncrl keys add {root} NAME` or `asyncrl keys generate {root}`")
    return CurveConfig(public_key=public, secret_key=secret, allowed_dir=str(root / CLIENTS_DIR))


def load_client_keys(directory: str | os.PathLike, name: str = "") -> CurveConfig:
    """Client side of ``directory``: the key pair ``<name>.key_secret`` and the server's public key.

    Without ``name``: ``client.key_secret`` if present, else the only client key pair in the folder
    (a worker host is given a folder with ``server.key`` and its own pair).
    """
    root = Path(directory).resolve()
    if not name:
        pairs = sorted(p.name[: -len(".key_secret")] for p in root.glob("*.key_secret"))
        clients = [p for p in pairs if p != SERVER_NAME]
        if "client" in clients or not clients:
            name = "client"
        elif len(clients) == 1:
            name = clients[0]
        else:
            raise ValueError(f"{root} holds several client key pairs ({', '.join(clients)}); give each host a "
                             "folder with server.key and only its own <name>.key_secret, or name the key")
    public, secret = _read_pair(root / f"{name}.key_secret", "a client needs its key pair")
    server_public_file = root / f"{SERVER_NAME}.key"
    if not server_public_file.is_file():
        raise ValueError(f"{server_public_file} not found: copy server.key from the keys folder the servers use")
    server_public, _ = zmq.auth.load_certificate(server_public_file)
    return CurveConfig(public_key=public, secret_key=secret, server_key=server_public)


def server_curve(transport) -> CurveConfig | None:
    """Server keys from a ``TransportConfig`` (``keys_dir``), or None when it names none."""
    return load_server_keys(transport.keys_dir) if transport.keys_dir else None


def client_curve(transport, name: str = "") -> CurveConfig | None:
    """Client keys from a ``TransportConfig`` (``keys_dir``), or None when it names none."""
    return load_client_keys(transport.keys_dir, name) if transport.keys_dir else None


__all__ = [
    "CLIENTS_DIR",
    "SERVER_NAME",
    "CurveConfig",
    "check_bind_security",
    "client_curve",
    "generate_keys",
    "is_loopback",
    "load_client_keys",
    "load_server_keys",
    "read_allow_list",
    "server_curve",
]
