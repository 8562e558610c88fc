"""Encoding and decoding of asyncrl messages, and the one error type decoding may raise.

Owns: the cached msgspec encoder/decoders, the multi-frame layout (a msgpack header frame, optionally
followed by one raw payload frame for ``WeightChunk``), and the handshake version check (same major,
minor at least ``PROTOCOL_FLOOR_MINOR``).
Never: raises anything but ``ProtocolError`` from ``decode``/``decode_frames`` on bad input (random
bytes, truncated frames, unknown tags, wrong array sizes); imports zmq or torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, TypeVar

import msgspec

from protocols.messages import (
    PROTOCOL_FLOOR_MINOR,
    PROTOCOL_MAJOR,
    PROTOCOL_VERSION,
    Hello,
    Message,
    Reject,
    WeightChunk,
)

T = TypeVar("T")

MAX_FRAMES = 2


class ProtocolError(ValueError):
    """A frame could not be turned into a valid message.

    ``reason`` is a short machine-readable code used as a counter name:
    ``malformed`` (not msgpack / truncated), ``unknown_tag``, ``invalid`` (a field fails validation:
    wrong type, array size mismatch, ...), ``frames`` (wrong number or size of frames), ``version``.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_ENCODER = msgspec.msgpack.Encoder()


@cache
def decoder_for(typ: Any) -> msgspec.msgpack.Decoder:
    """One cached decoder per message type (or union)."""
    return msgspec.msgpack.Decoder(type=typ)


# The hot decoders, looked up by identity: hashing a union type for the cache costs more than
# decoding a small message.
_DECODERS: dict[int, msgspec.msgpack.Decoder] = {id(Message): decoder_for(Message)}


encode: Callable[[msgspec.Struct], bytes] = _ENCODER.encode
"""``encode(msg) -> bytes``: the cached encoder's bound method itself, not a function around it (one
Python call less per message on the send hot path)."""
encode_into: Callable[[msgspec.Struct, bytearray], None] = _ENCODER.encode_into
"""``encode_into(msg, buf)``: encode into a reused bytearray, resized to the message (same bytes as ``encode``)."""


def decode(buf: bytes | memoryview, typ: Any = Message) -> Any:
    """Decode one message of ``typ`` (default: any asyncrl message). Raises only ``ProtocolError``."""
    dec = _DECODERS.get(id(typ))
    if dec is None:
        dec = decoder_for(typ)
        if isinstance(typ, type):
            _DECODERS[id(typ)] = dec
    try:
        return dec.decode(buf)
    except DECODE_ERRORS as e:
        raise protocol_error(e) from None


DECODE_ERRORS = (msgspec.DecodeError, TypeError, ValueError, OverflowError, RecursionError)
"""Everything a msgspec decoder may raise on hostile bytes (``ValidationError`` is a ``DecodeError``;
the others are defensive: hostile nesting). ``protocol_error`` turns each into a ``ProtocolError``."""


def protocol_error(e: BaseException) -> ProtocolError:
    """The ``ProtocolError`` (with its counter ``reason``) for an exception of ``DECODE_ERRORS``."""
    if isinstance(e, msgspec.ValidationError):
        text = str(e)
        if "`$.type`" in text or "Missing required field `type`" in text:
            return ProtocolError("unknown_tag", f"unknown or missing message tag: {text}")
        return ProtocolError("invalid", f"message failed validation: {text}")
    if isinstance(e, msgspec.DecodeError):
        return ProtocolError("malformed", f"frame is not a valid msgpack message: {e}")
    return ProtocolError("malformed", f"frame could not be decoded: {e}")


def decode_single(buf: Any, dec: msgspec.msgpack.Decoder) -> Any:
    """``decode_frames([buf])[0]`` with the decoder of the accepted type already in hand (``decoder_for``):
    the receive hot path, one Python call around msgspec. ``buf`` may be any buffer; the message keeps
    no reference to it (every bytes/str field is copied out).
    Raises only ``ProtocolError``, like ``decode_frames`` (a ``WeightChunk`` needs its payload frame)."""
    try:
        msg = dec.decode(buf)
    except DECODE_ERRORS as e:
        raise protocol_error(e) from None
    if isinstance(msg, WeightChunk):
        raise ProtocolError("frames", f"WeightChunk {msg.name!r} arrived without its payload frame")
    return msg


def encode_frames(msg: msgspec.Struct, payload: bytes | memoryview | None = None) -> list:
    """Frames for one message: ``[header]`` or ``[header, payload]`` (payload only for WeightChunk)."""
    if isinstance(msg, WeightChunk):
        if payload is None or len(payload) != msg.nbytes:
            size = None if payload is None else len(payload)
            raise ValueError(f"WeightChunk {msg.name!r} declares {msg.nbytes} bytes, payload has {size}")
        return [encode(msg), payload]
    if payload is not None:
        raise ValueError(f"{type(msg).__name__} carries no payload frame")
    return [encode(msg)]


def decode_frames(frames: Sequence[bytes | memoryview], typ: Any = Message) -> tuple[Any, Any]:
    """Inverse of ``encode_frames``: ``(message, payload_or_None)``. Raises only ``ProtocolError``."""
    if not 1 <= len(frames) <= MAX_FRAMES:
        raise ProtocolError("frames", f"expected 1 or 2 frames, got {len(frames)}")
    msg = decode(frames[0], typ)
    if isinstance(msg, WeightChunk):
        if len(frames) != 2:
            raise ProtocolError("frames", f"WeightChunk {msg.name!r} arrived without its payload frame")
        if len(frames[1]) != msg.nbytes:
            raise ProtocolError(
                "frames", f"WeightChunk {msg.name!r} declares {msg.nbytes} bytes, payload has {len(frames[1])}"
            )
        return msg, frames[1]
    if len(frames) != 1:
        raise ProtocolError("frames", f"{type(msg).__name__} must be a single frame, got {len(frames)}")
    return msg, None


def parse_version(version: str) -> tuple[int, int]:
    try:
        major, minor = version.split(".")
        return int(major), int(minor)
    except ValueError:
        raise ProtocolError("version", f"protocol version {version!r} is not MAJOR.MINOR") from None


def version_refusal(version: str, peer: str) -> str | None:
    """Why a peer that announced protocol ``version`` cannot talk to this process, naming the fix; None
    when it can (same major, minor at least ``PROTOCOL_FLOOR_MINOR``)."""
    try:
        major, minor = parse_version(version)
    except ProtocolError as e:
        return str(e)
    if major != PROTOCOL_MAJOR:
        return (f"protocol major version mismatch: {peer} speaks {version}, this process speaks "
                f"{PROTOCOL_VERSION}; run the same asyncrl major version on both sides")
    if minor < PROTOCOL_FLOOR_MINOR:
        return (f"{peer} speaks protocol {version}, older than {PROTOCOL_MAJOR}.{PROTOCOL_FLOOR_MINOR}, the oldest "
                f"this process ({PROTOCOL_VERSION}) accepts; upgrade asyncrl on that side")
    return None


def check_hello(hello: Hello) -> Reject | None:
    """``None`` if the peer may connect, else the ``Reject`` to send back (``version_refusal``)."""
    reason = version_refusal(hello.protocol_version, f"peer {hello.peer_id!r}")
    return None if reason is None else Reject(reason=reason)
