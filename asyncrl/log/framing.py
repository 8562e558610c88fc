"""Byte layout of a trajectory-log segment and the scanner that finds its intact prefix.

Layout of one segment file::

    MAGIC (8 bytes)  frame(header)  frame(record) frame(record) ...
    frame = uint32 little-endian body length | uint32 little-endian CRC32(body) | body (msgpack)

Owns: framing, CRC checks and the rule for what counts as intact. Scanning stops at the first frame
that is torn (length prefix past the end of the file, short header), corrupt (CRC mismatch, oversized
length) or undecodable, and reports its byte offset and reason; every frame before it is returned.
Never: raises on corrupt *content*; only ``LogFormatError`` for a file that is not a log at all
(bad magic / header) or has another schema version.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import Any

import msgspec

from asyncrl.log.records import SCHEMA_VERSION, LogHeader, Record

MAGIC = b"ARLTRAJ\x01"
FRAME_HEAD = struct.Struct("<II")
MAX_RECORD_BYTES = 256 * 1024 * 1024

_ENC = msgspec.msgpack.Encoder()
_DEC_RECORD = msgspec.msgpack.Decoder(type=Record)
_DEC_HEADER = msgspec.msgpack.Decoder(type=LogHeader)


class LogFormatError(ValueError):
    """The file is not a readable trajectory log of this schema version."""


@dataclasses.dataclass(frozen=True)
class Corruption:
    """Where the intact prefix of a segment ends and why."""

    path: str
    offset: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: torn or corrupt record at byte {self.offset}: {self.reason}"


def frame(body: bytes) -> bytes:
    return FRAME_HEAD.pack(len(body), zlib.crc32(body)) + body


def encode_record(record: Any) -> bytes:
    return frame(_ENC.encode(record))


def header_bytes(header: LogHeader) -> bytes:
    return MAGIC + frame(_ENC.encode(header))


def _read_frame(buf: memoryview, offset: int) -> tuple[bytes | None, str]:
    """(body, "") for an intact frame at ``offset``, else (None, reason)."""
    if offset + FRAME_HEAD.size > len(buf):
        return None, f"torn frame header ({len(buf) - offset} of {FRAME_HEAD.size} bytes)"
    length, crc = FRAME_HEAD.unpack_from(buf, offset)
    if length > MAX_RECORD_BYTES:
        return None, f"length prefix {length} exceeds the {MAX_RECORD_BYTES}-byte record limit"
    start = offset + FRAME_HEAD.size
    if start + length > len(buf):
        return None, f"length prefix {length} runs past the end of the file ({len(buf) - start} bytes left)"
    body = bytes(buf[start : start + length])
    if zlib.crc32(body) != crc:
        return None, "CRC32 mismatch"
    return body, ""


def read_header(buf: memoryview, path: str) -> tuple[LogHeader, int]:
    if bytes(buf[: len(MAGIC)]) != MAGIC:
        raise LogFormatError(f"{path} is not an asyncrl trajectory log (bad magic); pass a log written by asyncrl")
    body, reason = _read_frame(buf, len(MAGIC))
    if body is None:
        raise LogFormatError(f"{path}: the log header is damaged ({reason}); the file holds no readable record")
    try:
        header = _DEC_HEADER.decode(body)
    except msgspec.MsgspecError as e:
        raise LogFormatError(f"{path}: unreadable log header: {e}") from None
    if header.schema_version != SCHEMA_VERSION:
        raise LogFormatError(
            f"{path} has log schema version {header.schema_version}, this asyncrl reads version "
            f"{SCHEMA_VERSION}; use the asyncrl release that wrote it"
        )
    return header, len(MAGIC) + FRAME_HEAD.size + len(body)


def scan_segment(data: bytes, path: str) -> tuple[LogHeader, list[tuple[int, Any]], int, Corruption | None]:
    """(header, [(offset, record)], end of intact prefix, corruption or None)."""
    buf = memoryview(data)
    header, offset = read_header(buf, path)
    records: list[tuple[int, Any]] = []
    while offset < len(buf):
        body, reason = _read_frame(buf, offset)
        if body is None:
            return header, records, offset, Corruption(path, offset, reason)
        try:
            rec = _DEC_RECORD.decode(body)
        except msgspec.MsgspecError as e:
            return header, records, offset, Corruption(path, offset, f"undecodable record: {e}")
        records.append((offset, rec))
        offset += FRAME_HEAD.size + len(body)
    return header, records, offset, None
