"""Blocking JSON-over-HTTP client for one SGLang server, with a timeout on every request.

Owns: the transport between ``SGLangEngine`` and an SGLang HTTP server (``python -m sglang.launch_server``):
one short-lived ``http.client`` connection per call (so any thread may call at any time), the mapping of
transport failures to ``SGLangError`` subclasses whose messages name the fix, and the JSON decoding.

Must never: retry a request on its own (the engine decides what is safe to repeat), wait without a
timeout, or import torch / SGLang (stdlib only: this runs in the asyncrl process, not the server's venv).

Invariants: every method returns or raises within ``timeout`` seconds (plus the OS connect time);
``SGLangUnavailableError`` means "nothing answered" (refused, reset, timed out) and ``SGLangRequestError``
means "the server answered with an error status or a body that is not what the endpoint documents".
"""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit


class SGLangError(RuntimeError):
    """Base class for failures talking to an SGLang server."""


class SGLangUnavailableError(SGLangError):
    """No answer: connection refused or reset, or no response within the timeout."""


class SGLangRequestError(SGLangError):
    """The server answered, but with an error status or a malformed body."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def parse_base_url(url: str) -> tuple[str, int]:
    """``"http://host:port"`` -> ``(host, port)``; ``ValueError`` naming the expected form otherwise."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(
            f"SGLang url must look like 'http://127.0.0.1:30000' (no path, http only), got {url!r}"
        )
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"SGLang url {url!r} has an invalid port") from exc
    return parts.hostname, port or 80


class SGLangHTTP:
    """Calls one SGLang server at ``base_url``; thread-safe (a new connection per call)."""

    def __init__(self, base_url: str, *, timeout_s: float = 30.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.host, self.port = parse_base_url(base_url)
        self.base_url = f"http://{self.host}:{self.port}"
        self.timeout_s = float(timeout_s)

    def request(
        self, method: str, path: str, payload: Any = None, *, timeout: float | None = None
    ) -> tuple[int, bytes]:
        """Send one request; return ``(status, body)`` for any status. Raises ``SGLangUnavailableError``."""
        timeout = self.timeout_s if timeout is None else timeout
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except TimeoutError as exc:
            raise SGLangUnavailableError(
                f"SGLang at {self.base_url} did not answer {method} {path} within {timeout:.1f} s; "
                "the server may be overloaded, paused or hung: check its log, or raise the engine's timeout"
            ) from exc
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            raise SGLangUnavailableError(
                f"no SGLang server answers at {self.base_url} ({method} {path}: {exc.__class__.__name__}: "
                f"{exc}); start one (scripts/sglang_cpu_server.py, or python -m sglang.launch_server) "
                "or fix the url"
            ) from exc
        finally:
            conn.close()

    def post(
        self, path: str, payload: Any = None, *, timeout: float | None = None, expect_json: bool = True
    ) -> Any:
        """POST JSON; return the decoded JSON answer (``None`` for an empty body, the text when
        ``expect_json=False``). Raises ``SGLangRequestError`` on any non-200 status."""
        status, body = self.request("POST", path, {} if payload is None else payload, timeout=timeout)
        return self._decode(path, status, body, expect_json)

    def get(self, path: str, *, timeout: float | None = None, expect_json: bool = True) -> Any:
        """GET; same return and errors as ``post``."""
        status, body = self.request("GET", path, timeout=timeout)
        return self._decode(path, status, body, expect_json)

    def _decode(self, path: str, status: int, body: bytes, expect_json: bool) -> Any:
        text = body.decode("utf-8", errors="replace")
        if status != 200:
            hint = (
                "the request was rejected; the message above says why"
                if 400 <= status < 500
                else "the server failed internally; see its log"
            )
            raise SGLangRequestError(
                f"SGLang at {self.base_url} answered {path} with HTTP {status}: {_short(text)} ({hint})",
                status=status,
                body=text,
            )
        if not expect_json:
            return text
        if not body.strip():
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise SGLangRequestError(
                f"SGLang at {self.base_url} answered {path} with a body that is not JSON: {_short(text)!r}; "
                "is something else listening on that port?",
                status=status,
                body=text,
            ) from exc


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
