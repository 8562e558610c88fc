"""ZeroMQ channels: the only library code that touches zmq sockets directly.

Owns: socket creation with asyncrl's options (linger 0, high-water marks, receive timeouts),
binding/connecting (loopback by default; tcp and ipc), and decoding with per-reason error counters.
With a ``CurveConfig`` (``keys``) the socket speaks CurveZMQ: a bound socket accepts only allow-listed client keys, a connected one
authenticates the server; handshake outcomes are counted in ``stats.auth``.
Never: blocks forever (every receive takes a timeout; sends past the high-water mark time out);
lets a malformed frame escape as an exception from ``recv`` (it is counted, optionally answered with
an ``Error``, and the loop keeps serving); imports torch.

Interface (docs/architecture.md §3): ``send(msg, to=None, payload=None, timeout_s=None)``,
``recv(timeout_s) -> Envelope | None``, ``close()``. Socket kinds:
  ROUTER/DEALER  control and work (request/reply with peer identities)
  PUSH/PULL      streaming finished samples (PUSH blocks at the HWM: backpressure, nothing dropped)
  PUB/SUB        weight announcements (may drop for slow joiners; fetch-by-request fills the gap)
Without ``curve`` a channel is a plain zmq socket, exactly as before keys existed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from asyncrl.transport.contexts import shared_context
from asyncrl.transport.keys import CurveConfig
from asyncrl.transport.stats import ChannelStats
from asyncrl.transport.zap import secure_socket
from protocols import (
    Error,
    Message,
    ProtocolError,
    WeightChunk,
    decode_frames,
    decode_single,
    decoder_for,
    encode_frames,
    encode_into,
)

DEFAULT_HWM = 1000
ZERO_COPY_BYTES = 64 * 1024
_ENCODE_BUF_BYTES = 64 * 1024
"""A channel encodes into one reused buffer of this size (``encode_into``) and zmq copies the message
out of it: no fresh bytes object per message, whose allocation and first write cost as much as the
copy. A larger message grows the buffer for that send only."""
_NOBLOCK = int(zmq.NOBLOCK)


class ChannelTimeout(TimeoutError):
    """A send could not complete within its timeout (receiver stalled past the high-water mark)."""


class ChannelClosed(RuntimeError):
    """The channel was used after ``close()``."""


class Envelope(msgspec.Struct):
    """One received message. ``peer`` is the sender identity on ROUTER sockets, else None.

    A msgspec Struct rather than a dataclass: built once per received message, and its C constructor
    is cheaper than a slots dataclass's (and than keyword construction). Never sent."""

    msg: Any
    peer: bytes | None = None
    payload: memoryview | bytes | None = None

    def sender(self) -> bytes:
        """``peer`` of an envelope received on a ROUTER socket (which always sets it)."""
        if self.peer is None:
            raise ValueError("this envelope has no sender identity: only a ROUTER channel's recv() sets peer")
        return self.peer


class ZmqChannel:
    """One zmq socket plus asyncrl's framing. Use the ``bind``/``connect`` constructors.

    ``curve``: server-side keys (``load_server_keys``) for ``bind``, client-side keys
    (``load_client_keys``) for ``connect``; None for a plain socket. ``max_message_bytes`` (> 0) makes
    zmq drop the connection of a peer that sends a larger message (hostile sizes), -1: no limit.
    ``accept``: the message type (or union) this socket receives, decoded by that type's own cached
    decoder; anything else is rejected as ``unknown_tag`` like a foreign tag (default: any message).
    """

    def __init__(
        self,
        kind: int,
        *,
        name: str = "",
        hwm: int = DEFAULT_HWM,
        reply_errors: bool = False,
        context: zmq.Context | None = None,
        identity: bytes | None = None,
        zero_copy_recv: bool = False,
        curve: CurveConfig | None = None,
        max_message_bytes: int = -1,
        accept: Any = Message,
    ) -> None:
        self.kind = kind
        self.accept = accept
        self._router = kind == zmq.ROUTER
        self._decoder = decoder_for(accept)  # looked up once: the receive hot path calls it directly
        self._encode_buf = bytearray(_ENCODE_BUF_BYTES)
        self.name = name or zmq.Socket.__name__
        self.stats = ChannelStats()
        self.reply_errors = reply_errors and kind == zmq.ROUTER
        self._ctx = context or shared_context()
        self._sock = self._ctx.socket(kind)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        if identity is not None:
            self._sock.setsockopt(zmq.IDENTITY, identity)
        if kind == zmq.ROUTER:
            # A full HWM or an unknown peer is an error we see, not a silent drop.
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if kind == zmq.SUB:
            self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        if max_message_bytes > 0:
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.curve = curve
        if curve is not None:  # before bind/connect: zmq reads security options at that moment
            self.stats.secured = True
            secure_socket(self._sock, curve, self._ctx, count=self.stats.count_auth)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        # pyzmq's Socket.send is a Python wrapper (DRAFT routing_id/group arguments, which asyncrl never
        # uses) around the Cython send; the hot path calls the Cython send itself, one Python frame less.
        self._send_copy = zmq.backend.Socket.send.__get__(self._sock)
        self._recv_frame = self._sock.recv
        self.address = ""
        self._closed = False
        # Large payloads (weights) are received without a copy; small messages are faster copied.
        self._zero_copy_recv = zero_copy_recv

    # ------------------------------------------------------------------ construction
    @classmethod
    def bind(cls, kind: int, address: str, **kwargs) -> ZmqChannel:
        """Bind to ``address``; ``tcp://127.0.0.1:0`` picks a free port (see ``.address``)."""
        ch = cls(kind, **kwargs)
        if ch.curve is not None and not ch.curve.is_server:
            ch.close()
            raise ValueError(f"binding {address!r} needs server keys (load_server_keys), got client keys")
        try:
            if address.startswith("tcp://") and address.endswith(":0"):
                address = address[:-2] + ":*"
            ch._sock.bind(address)
        except zmq.ZMQError as e:
            ch.close()
            raise ValueError(f"cannot bind {address!r}: {e}; choose a free port or another ipc path") from None
        ch.address = ch._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return ch

    @classmethod
    def connect(cls, kind: int, address: str, **kwargs) -> ZmqChannel:
        ch = cls(kind, **kwargs)
        if ch.curve is not None and ch.curve.is_server:
            ch.close()
            raise ValueError(f"connecting to {address!r} needs client keys (load_client_keys), got server keys")
        try:
            ch._sock.connect(address)
        except zmq.ZMQError as e:
            ch.close()
            raise ValueError(f"cannot connect to {address!r}: {e}") from None
        ch.address = address
        return ch

    # ---------------------------------------------------------------------------- send / recv
    def send(
        self,
        msg: msgspec.Struct,
        *,
        to: bytes | None = None,
        payload: bytes | memoryview | None = None,
        timeout_s: float | None = 10.0,
    ) -> None:
        """Send one message (to peer ``to`` on ROUTER). Raises ``ChannelTimeout`` past ``timeout_s``.

        The hot path (samples, control messages on a socket without peer identities) encodes and hands
        the one frame to zmq directly: no frame list, no size sum, no deadline unless the high-water
        mark is hit. Everything else (ROUTER, a ``WeightChunk`` and its payload) goes through
        ``encode_frames``, which checks the payload against the header."""
        if payload is None and not self._router and not isinstance(msg, WeightChunk):
            if self._closed:
                raise ChannelClosed(f"channel {self.name} is closed")
            buf = self._encode_buf
            encode_into(msg, buf)
            try:
                self._send_copy(buf, _NOBLOCK, True)  # zmq copies the bytes out: buf is free again
                self.stats.sent += 1
                return
            except zmq.Again:
                pass
            finally:
                if len(buf) > _ENCODE_BUF_BYTES:  # a large message (a batch): do not keep its buffer
                    self._encode_buf = bytearray(_ENCODE_BUF_BYTES)
            self._send_slow((bytes(buf),), timeout_s)  # a copy: buf is reused by the next send
            return
        frames = encode_frames(msg, payload)
        if self._router:
            if to is None:
                raise ValueError("a ROUTER channel needs the peer identity: send(msg, to=peer)")
            frames = [to, *frames]
        self.send_frames(frames, timeout_s=timeout_s)

    def send_frames(self, frames: Sequence[Any], *, timeout_s: float | None = 10.0) -> None:
        if self._closed:
            raise ChannelClosed(f"channel {self.name} is closed")
        if len(frames) == 1:  # one small frame, copied, no bookkeeping
            frame = frames[0]
            try:
                self._sock.send(frame, _NOBLOCK, copy=len(frame) < ZERO_COPY_BYTES)
                self.stats.sent += 1
                return
            except zmq.Again:
                pass
        self._send_slow(frames, timeout_s)

    def _send_slow(self, frames: Sequence[Any], timeout_s: float | None) -> None:
        """Multipart frames, or a send that met the high-water mark: retry until ``timeout_s``."""
        # Small messages are cheaper copied; large payloads (weights) go zero-copy.
        copy = sum(len(f) for f in frames) < ZERO_COPY_BYTES
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        refreshed = False
        while True:
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
                self.stats.sent += 1
                return
            except zmq.Again:
                pass
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    raise ChannelClosed(f"{self.name}: peer {frames[0]!r} is not connected") from None
                raise
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                if not refreshed:
                    # A non-blocking send does not always read the socket's pending commands (libzmq
                    # throttles that), among them the credit a reading peer's I/O thread returned:
                    # the pipe can look full when it is not. A zero-timeout poll reads them; then
                    # one more try, so timeout_s=0 means "if it fits now", not "if the last credit
                    # happened to be seen".
                    refreshed = True
                    self._sock.poll(0, zmq.POLLOUT)
                    continue
                raise ChannelTimeout(
                    f"{self.name}: send did not complete within {timeout_s}s (receiver stalled at the HWM)"
                )
            wait_ms = 100 if remaining is None else max(1, min(100, int(remaining * 1000)))
            self._sock.poll(wait_ms, zmq.POLLOUT)

    def recv(self, timeout_s: float) -> Envelope | None:
        """Next valid message, or None after ``timeout_s``. Bad frames are counted and skipped.

        The hot path is a single-frame message on a socket without peer identities: zmq's ``more`` flag
        is read from the received frame (no ``RCVMORE`` round trip, which costs as much as the receive),
        and its bytes go straight to the accepted type's cached decoder (``decode_single``). The bytes
        are copied out of the zmq frame first: decoding the frame in place was measured
        slower per 512-token sample than copying, then decoding. Multipart messages, and every message
        of a ROUTER socket (its first frame is the peer identity), take ``_parse`` and ``decode_frames``."""
        if self._closed:
            raise ChannelClosed(f"channel {self.name} is closed")
        deadline = None
        while True:
            try:  # fast path: a message is already queued, no poll needed
                frame = self._recv_frame(_NOBLOCK, False)  # copy=False: a zmq.Frame, with its ``more`` flag
            except zmq.Again:
                if deadline is None:
                    deadline = time.monotonic() + max(0.0, timeout_s)
                remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
                if not self._poller.poll(remaining_ms):
                    return None
                continue
            if frame.more or self._router:
                env = self._parse(self._rest_of(frame))
            else:
                try:
                    env = Envelope(decode_single(frame.bytes, self._decoder))
                except ProtocolError as e:
                    self.stats.reject(e.reason, str(e))
                    env = None
            if env is not None:
                self.stats.received += 1
                return env
            if deadline is None:
                deadline = time.monotonic() + max(0.0, timeout_s)
            if time.monotonic() >= deadline:
                return None

    def _rest_of(self, frame: zmq.Frame) -> list:
        """Every frame of the message whose first frame is ``frame`` (zmq delivers a multipart message
        atomically: the rest is already here). Small frames are copied out; the frames of a zero-copy
        channel (weights) stay zmq buffers."""
        frames = [frame]
        while frame.more:
            frame = self._sock.recv(0, copy=False)
            frames.append(frame)
        if self._zero_copy_recv:
            return [f.buffer for f in frames]
        return [f.bytes for f in frames]

    def _parse(self, frames: list) -> Envelope | None:
        peer = None
        if self._router:
            peer, frames = bytes(frames[0]), frames[1:]
        try:
            msg, payload = decode_frames(frames, self.accept)
        except ProtocolError as e:
            self.stats.reject(e.reason, str(e))
            if self.reply_errors and peer is not None:
                self._reply_error(peer, e)
            return None
        return Envelope(msg, peer, payload)

    def _reply_error(self, peer: bytes, err: ProtocolError) -> None:
        try:
            self.send(Error(code=err.reason, message=str(err)[:500]), to=peer, timeout_s=0.0)
        except (ChannelTimeout, ChannelClosed):
            self.stats.reject("error_reply_dropped", f"could not answer peer {peer!r}")

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket. By default unsent messages are dropped at once; with ``linger_s`` > 0 they
        may still leave within that time (wait for them with ``end_context`` on a private context)."""
        if not self._closed:
            self._closed = True
            if linger_s > 0 and self.stats.secured:
                # Stop the handshake monitor now, while the ZAP thread still reads it: a lingering socket
                # would go on reporting events, and zmq blocks its I/O thread on a monitor nobody reads
                # (end_context stops that thread), so the context could never end.
                self._sock.disable_monitor()
            # otherwise a secured socket's monitor stops with it (the ZAP thread sees that)
            self._sock.close(linger=max(0, int(linger_s * 1000)))

    def __enter__(self) -> ZmqChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ChannelPoller:
    """Waits on several channels at once, so one loop can serve them all without touching a socket.

    ``wait(timeout_s)`` blocks until at least one channel has a message to receive (or the timeout
    passes) and returns those channels; read them with ``recv(0.0)``. Channels must outlive the poller.
    """

    def __init__(self, channels: Sequence[ZmqChannel]) -> None:
        self._poller = zmq.Poller()
        self._channels: dict[zmq.Socket, ZmqChannel] = {}
        for ch in channels:
            self._poller.register(ch._sock, zmq.POLLIN)
            self._channels[ch._sock] = ch

    def wait(self, timeout_s: float) -> list[ZmqChannel]:
        """The channels with a message waiting, in registration order ([] after ``timeout_s``)."""
        ready = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        return [ch for sock, ch in self._channels.items() if sock in ready]


__all__ = ["ChannelClosed", "ChannelPoller", "ChannelTimeout", "Envelope", "ZmqChannel"]
