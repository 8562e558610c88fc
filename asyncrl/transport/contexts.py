"""Process-level ZeroMQ plumbing: the shared and private contexts, and the address peers dial.

Owns: ``shared_context`` (one per process), ``private_context``/``end_context`` (a context whose last
messages must leave before the process ends), ``advertised`` (a wildcard bind address as peers dial it).
Never: creates or closes a socket (``asyncrl.transport.channel`` does); ends the shared context.
"""

from __future__ import annotations

import threading

import zmq

from asyncrl.transport.zap import shutdown_security


def advertised(address: str, advertise_host: str = "") -> str:
    """The address peers should dial for a socket bound to ``address`` (wildcards replaced)."""
    import socket

    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if address.startswith(wildcard):
            return f"tcp://{advertise_host or socket.gethostname()}:{address[len(wildcard):]}"
    return address


_CONTEXT_LOCK = threading.Lock()


def shared_context() -> zmq.Context:
    """The process-wide context (thread-safe; sockets are not, each stays in one thread)."""
    with _CONTEXT_LOCK:
        return zmq.Context.instance()


def private_context() -> zmq.Context:
    """A context for channels whose last messages must leave before the process ends: close those
    channels with ``linger_s`` > 0, then ``end_context`` waits until the messages have left."""
    return zmq.Context()


def end_context(context: zmq.Context) -> None:
    """Terminate a private context once all its channels are closed.

    Returns when every message its channels had sent has left (``zmq_ctx_term``: the real flush), or
    when the longest ``linger_s`` they were closed with has passed (a peer that is gone). A channel
    still open would make this wait forever, so close them all first. Stops the context's ZAP thread
    first (its sockets belong to the context too).
    """
    if context is shared_context():
        raise ValueError("end_context ends a private_context(); the shared context lives as long as the process")
    shutdown_security(context)
    context.term()
