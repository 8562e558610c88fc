"""Byte layout of a trajectory-log segment and the scanner that finds its intact prefix.

Layout of one segment file::

    MAGIC (8 bytes)  frame(header)  frame(record) frame(record) ...
    frame = uint32 little-endian body length | uint32 little-endian CRC32(body) | body (msgpack)

Owns: framing, CRC checks and the rule for what counts as intact. A frame that is torn (length
prefix past the end of the file, short header), corrupt (CRC mismatch, oversized length) or
undecodable is reported with its byte offset and reason; the scanner then searches forward for the
next intact frame (length fits, CRC matches, body decodes as a record). If one exists, the damage is
*interior* corruption: the bytes in between are skipped and reported, every record after them is
returned. If none exists, the damage is a *torn tail* (a write cut short by a crash): the only kind a
writer may repair by truncating.
Never: raises on corrupt *content*; only ``LogFormatError`` for a file that is not a log at all
(bad magic / header) or has another schema version. Never returns a record whose CRC did not match.
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
    """Damaged bytes ``[offset, resume_at)`` of a segment and why; ``resume_at`` is None for a torn tail."""

    path: str
    offset: int
    reason: str
    resume_at: int | None = None

    @property
    def torn_tail(self) -> bool:
        return self.resume_at is None

    @property
    def skipped_bytes(self) -> int | None:
        return None if self.resume_at is None else self.resume_at - self.offset

    def __str__(self) -> str:
        if self.torn_tail:
            return f"{self.path}: torn tail at byte {self.offset}: {self.reason}"
        return (f"{self.path}: corrupt record at byte {self.offset}: {self.reason}; intact records resume at "
                f"byte {self.resume_at} ({self.skipped_bytes} bytes skipped)")


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


def _decode_at(buf: memoryview, offset: int) -> tuple[Any, int, str]:
    """(record, offset after it, "") for an intact, decodable frame at ``offset``, else (None, 0, reason)."""
    body, reason = _read_frame(buf, offset)
    if body is None:
        return None, 0, reason
    try:
        return _DEC_RECORD.decode(body), offset + FRAME_HEAD.size + len(body), ""
    except msgspec.MsgspecError as e:
        return None, 0, f"undecodable record: {e}"


def _resync(buf: memoryview, start: int) -> int | None:
    """Offset of the next intact, decodable frame after ``start``, or None (a torn tail)."""
    n = len(buf)
    for o in range(start + 1, n - FRAME_HEAD.size + 1):
        length, crc = FRAME_HEAD.unpack_from(buf, o)
        if 0 < length <= n - o - FRAME_HEAD.size and zlib.crc32(buf[o + FRAME_HEAD.size : o + FRAME_HEAD.size + length]) == crc:
            rec, _, _ = _decode_at(buf, o)
            if rec is not None:
                return o
    return None


def scan_segment(data: bytes, path: str) -> tuple[LogHeader, list[tuple[int, Any]], int, list[Corruption]]:
    """(header, [(offset, record)], end of the intact prefix, corruptions in file order).

    The intact prefix ends at the first corruption (or the end of the file). Records after an
    interior corruption are returned too; only the last corruption can be a torn tail.
    """
    buf = memoryview(data)
    header, offset = read_header(buf, path)
    records: list[tuple[int, Any]] = []
    corruptions: list[Corruption] = []
    prefix_end: int | None = None
    while offset < len(buf):
        rec, after, reason = _decode_at(buf, offset)
        if rec is None:
            if prefix_end is None:
                prefix_end = offset
            resume = _resync(buf, offset)
            corruptions.append(Corruption(path, offset, reason, resume))
            if resume is None:
                break
            offset = resume
            continue
        records.append((offset, rec))
        offset = after
    return header, records, offset if prefix_end is None else prefix_end, corruptions
