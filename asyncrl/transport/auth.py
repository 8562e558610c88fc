"""CurveZMQ keys, the ZAP allow-list, authentication counters and the bind-address policy.

Owns: the keys folder (``asyncrl keys generate DIR``), turning it into a ``CurveConfig`` for a
server (bound sockets: controller ROUTER and PULL, learner weight PUB and ROUTER) or a client
(connected sockets: worker and learner DEALERs, worker PUSH, SUB and weight DEALER), applying that
config to a zmq socket, the one ZAP handler thread per zmq context that answers with the allow-list,
and the counters of accepted and denied handshakes (``transport/auth/*``).
Never: sends or reads asyncrl messages (``channel`` does); weakens a socket that has keys (a server
socket with keys enforces its ZAP domain, so without a running handler every client is refused);
writes a secret key readable by other users; imports torch.

Keys folder (every file is a zmq certificate written by ``zmq.auth``)::

    DIR/server.key             server public key            every host
    DIR/server.key_secret      server key pair              controller and learner hosts only
    DIR/<client>.key           a client's public key
    DIR/<client>.key_secret    that client's key pair       the host that runs that client
    DIR/clients/<client>.key   the allow-list servers read  remove a file to revoke, add one to admit

The allow-list is re-read when ``DIR/clients`` changes, so keys added with ``asyncrl keys add`` are
admitted, and removed ones refused, on the next connection attempt without a restart (established
sessions are not cut).

Counting: every secured socket gets a zmq monitor; the ZAP thread reads the monitor events and
counts per socket (``ChannelStats.auth``) and per process (``auth_metrics()``). Reasons:
``unknown_key`` (a CURVE client whose key is not in the allow-list), ``no_curve`` (a plain client at a
CURVE socket, when this side notices the mechanism mismatch first), ``aborted`` (the peer hung up
mid-handshake: a plain client that noticed the mismatch first, or a port scanner), ``bad_key`` (a client
holding the wrong server public key, or a corrupt handshake), ``protocol`` (any other ZMTP error), and
on the client side ``refused`` (the server denied our key). A client that keeps retrying is counted at
every attempt (zmq reconnects every 100 ms by default).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import logging
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("asyncrl.transport.auth")

SERVER_NAME = "server"
CLIENTS_DIR = "clients"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                   | zmq.EVENT_MONITOR_STOPPED)


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
    try:
        public, secret = zmq.auth.load_certificate(path)
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


# ---------------------------------------------------------------------- ZAP handler + monitors
class _Security:
    """One per zmq context: a thread that answers ZAP requests and reads socket monitors.

    The ZAP socket is bound here (caller thread) and then only used by the thread; monitor PAIR
    sockets are created and connected by the caller and handed over through a queue (a migration
    with a memory barrier, which zmq allows).
    """

    def __init__(self, context: zmq.Context) -> None:
        self._ctx = context
        self._zap = context.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)
        self._domains: dict[str, CurveConfig] = {}
        self._allow_cache: dict[str, tuple[float, frozenset[bytes]]] = {}
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.totals: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="asyncrl-zap", daemon=True)
        self._thread.start()

    def register(self, curve: CurveConfig) -> str:
        with self._lock:
            self._domains[curve.domain] = curve
        return curve.domain

    def watch(self, sock: zmq.Socket, server: bool, count: Callable[[str], None] | None) -> None:
        pair = sock.get_monitor_socket(_MONITOR_EVENTS)
        self._new.put((pair, server, count))

    def _allowed(self, domain: str) -> frozenset[bytes]:
        with self._lock:
            curve = self._domains.get(domain)
        if curve is None:
            return frozenset()
        if not curve.allowed_dir:
            return curve.allowed_keys
        try:
            stamp = os.stat(curve.allowed_dir).st_mtime_ns
        except OSError:
            stamp = -1
        cached = self._allow_cache.get(domain)
        if cached is None or cached[0] != stamp:
            cached = (stamp, curve.allowed())
            self._allow_cache[domain] = cached
        return cached[1]

    def _answer(self, frames: list[bytes]) -> None:
        version, request_id, domain, _address, _identity, mechanism = frames[:6]
        ok = (mechanism == b"CURVE" and len(frames) == 7
              and z85.encode(frames[6]) in self._allowed(domain.decode(errors="replace")))
        status = (b"200", b"OK", b"asyncrl") if ok else (b"400", b"key not in the allow-list", b"")
        self._zap.send_multipart([version, request_id, *status, b""])

    def _event(self, frames: list[bytes], server: bool, count: Callable[[str], None] | None) -> bool:
        ev = parse_monitor_message(frames)
        kind, value = ev["event"], ev["value"]
        if kind == zmq.EVENT_MONITOR_STOPPED:
            return False
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            reason = "accepted"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            reason = "unknown_key" if server else "refused"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            reason = "no_curve"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            reason = "bad_key"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            reason = "aborted"  # the peer hung up mid-handshake (value: errno), e.g. a plain client that saw CURVE
        else:
            reason = "protocol"
        with self._lock:
            self.totals[reason] += 1
            n = self.totals[reason]
        if count is not None:
            count(reason)
        if reason != "accepted" and n & (n - 1) == 0:  # 1st, 2nd, 4th, ...: a retrying client cannot flood the log
            log.warning("%s-side CURVE handshake failed: %s (%d so far; zmq event %#x value %#x)%s",
                        "server" if server else "client", reason, n, int(kind), int(value),
                        "; this key is not in the server's allow-list" if reason == "refused" else "")
        return True

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        monitors: dict[zmq.Socket, tuple[bool, Callable[[str], None] | None]] = {}
        while not self._stop.is_set():
            while not self._new.empty():
                pair, server, count = self._new.get()
                monitors[pair] = (server, count)
                poller.register(pair, zmq.POLLIN)
            for sock, _ in poller.poll(50):
                if sock is self._zap:
                    frames = self._zap.recv_multipart()
                    if len(frames) < 6:
                        self._zap.send_multipart([b"1.0", frames[1] if len(frames) > 1 else b"", b"400",
                                                  b"malformed ZAP request", b"", b""])
                    else:
                        self._answer(frames)
                    continue
                server, count = monitors[sock]
                if not self._event(sock.recv_multipart(), server, count):
                    poller.unregister(sock)
                    monitors.pop(sock)
                    sock.close(linger=0)
        for sock in monitors:
            sock.close(linger=0)
        self._zap.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


_SECURITY: dict[int, _Security] = {}
_SECURITY_LOCK = threading.Lock()


def _security(context: zmq.Context) -> _Security:
    with _SECURITY_LOCK:
        sec = _SECURITY.get(id(context))
        if sec is None:
            sec = _SECURITY[id(context)] = _Security(context)
        return sec


def secure_socket(sock: zmq.Socket, curve: CurveConfig, context: zmq.Context, *,
                  count: Callable[[str], None] | None = None) -> None:
    """Apply ``curve`` to ``sock`` before it binds (server side) or connects (client side).

    Server side: ``curve_server``, the secret key, the allow-list's ZAP domain (enforced: no handler,
    no connection); client side: its key pair and ``curve_serverkey``. Handshake outcomes are passed
    to ``count(reason)`` from the ZAP thread and added to ``auth_metrics()``.
    """
    sec = _security(context)
    if curve.is_server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
        sock.setsockopt(zmq.ZAP_DOMAIN, sec.register(curve).encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    else:
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)
    sec.watch(sock, curve.is_server, count)


def auth_metrics(context: zmq.Context | None = None, prefix: str = "transport/auth") -> dict[str, float]:
    """Handshake counters of every secured socket of ``context`` (default: the shared one); {} if none."""
    ctx = context or zmq.Context.instance()
    with _SECURITY_LOCK:
        sec = _SECURITY.get(id(ctx))
    if sec is None:
        return {}
    with sec._lock:
        totals = dict(sec.totals)
    return auth_counter_metrics(totals, prefix)


def auth_counter_metrics(counts: dict[str, int], prefix: str) -> dict[str, float]:
    """``{prefix}/accepted``, ``{prefix}/denied`` (all failures) and ``{prefix}/denied/<reason>``."""
    denied = {k: v for k, v in counts.items() if k != "accepted"}
    out = {f"{prefix}/accepted": float(counts.get("accepted", 0)), f"{prefix}/denied": float(sum(denied.values()))}
    out.update({f"{prefix}/denied/{k}": float(v) for k, v in sorted(denied.items())})
    return out


def shutdown_security(context: zmq.Context | None = None) -> None:
    """Stop the ZAP thread of ``context`` (before ``context.term()``); secured sockets stop accepting."""
    ctx = context or zmq.Context.instance()
    with _SECURITY_LOCK:
        sec = _SECURITY.pop(id(ctx), None)
    if sec is not None:
        sec.close()


# ------------------------------------------------------------------------------------------ CLI
def keys_main(argv: Iterable[str] | None = None) -> int:
    """``asyncrl keys generate DIR [--clients N] [--force]`` and ``asyncrl keys add DIR NAME``."""
    ap = argparse.ArgumentParser(prog="asyncrl keys", description="CurveZMQ keys for transport.keys_dir")
    sub = ap.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="a server key pair and N client key pairs (allow-listed)")
    gen.add_argument("dir")
    gen.add_argument("--clients", type=int, default=1,
                     help="client key pairs: 1 makes 'client', N>1 makes client-0..client-(N-1)")
    gen.add_argument("--force", action="store_true", help="replace existing keys of the same names")
    add = sub.add_parser("add", help="one more client key pair, admitted at once by running servers")
    add.add_argument("dir")
    add.add_argument("name")
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        if args.cmd == "generate":
            if args.clients < 1:
                raise ValueError("--clients must be >= 1")
            names = ["client"] if args.clients == 1 else [f"client-{i}" for i in range(args.clients)]
            written = generate_keys(args.dir, [SERVER_NAME, *names], overwrite=args.force)
        else:
            if not (Path(args.dir) / f"{SERVER_NAME}.key").is_file():
                raise ValueError(f"{args.dir} has no server.key; run `asyncrl keys generate {args.dir}` first")
            written = generate_keys(args.dir, [args.name])
    except ValueError as e:
        print(f"asyncrl keys: {e}")
        return 2
    root = Path(args.dir).resolve()
    for name, path in written.items():
        print(f"  {name:>12}: {path}")
    print(f"allow-list: {root / CLIENTS_DIR} (delete a .key there to revoke that client)\n"
          f"use: transport.keys_dir={root}  (a worker host needs server.key and its own <name>.key_secret)")
    return 0


__all__ = [
    "CurveConfig",
    "auth_counter_metrics",
    "auth_metrics",
    "check_bind_security",
    "client_curve",
    "generate_keys",
    "is_loopback",
    "keys_main",
    "load_client_keys",
    "load_server_keys",
    "read_allow_list",
    "secure_socket",
    "server_curve",
    "shutdown_security",
]
