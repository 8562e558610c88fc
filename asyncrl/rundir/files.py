"""Durable small files: atomic replace, checksummed JSON, and a clear message when the disk is full.

Owns: writing a file so that a reader sees the old content or the new, never a half-written one
(temporary file in the same folder, fsync, rename; the temporary is removed on any failure), the
``sha256`` header of checksummed JSON files, ``DiskFullError`` ("disk full at PATH") and ``NotWritableError``
("PATH is not writable").
Never: imports torch or zmq; retries a failed write.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Any


class DiskFullError(OSError):
    """No space left on the device while writing ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.message = f"disk full at {path}; free space (or move the run folder) and resume"
        super().__init__(errno.ENOSPC, self.message)
        self.path = str(path)

    def __str__(self) -> str:
        return self.message


class NotWritableError(ValueError):
    """A folder a run must write into refuses writes (a read-only filesystem, no permission)."""


def raise_if_not_writable(err: OSError, path: str | Path, what: str, fix: str) -> None:
    """Re-raise ``err`` as ``NotWritableError`` ("WHAT PATH is not writable (why); FIX") when it is EROFS,
    EACCES or EPERM (call inside ``except OSError``)."""
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        raise NotWritableError(f"{what} {path} is not writable ({os.strerror(err.errno)}); {fix}") from None


class ChecksumError(ValueError):
    """A checksummed file does not match its checksum: it is damaged and must not be loaded."""


def raise_if_disk_full(err: OSError, path: str | Path) -> None:
    """Re-raise ``err`` as ``DiskFullError`` when it is ENOSPC/EDQUOT (call inside ``except OSError``)."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT) and not isinstance(err, DiskFullError):
        raise DiskFullError(path) from err


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically; on failure ``path`` is untouched and no temporary remains."""
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise_if_disk_full(e, path)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


CHECKSUM_PREFIX = "sha256 "


def write_checksummed_json(path: str | Path, obj: Any, **dumps_kw: Any) -> None:
    """``sha256 <hex of the JSON text>\\n<JSON text>``, written atomically."""
    text = json.dumps(obj, **dumps_kw)
    atomic_write_text(path, f"{CHECKSUM_PREFIX}{sha256_bytes(text.encode())}\n{text}")


def read_checksummed_json(path: str | Path, **loads_kw: Any) -> Any:
    """The object of ``write_checksummed_json``; ``ChecksumError`` if the file is damaged or has no checksum."""
    raw = Path(path).read_bytes()
    head, sep, body = raw.partition(b"\n")
    if not sep or not head.startswith(CHECKSUM_PREFIX.encode()):
        raise ChecksumError(f"{path} has no checksum header; it was not written by this asyncrl or is damaged")
    if head[len(CHECKSUM_PREFIX):].decode(errors="replace") != sha256_bytes(body):
        raise ChecksumError(f"{path} does not match its checksum: the file is damaged")
    return json.loads(body, **loads_kw)
