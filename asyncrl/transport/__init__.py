"""Transport: ZeroMQ channels, weight publication/fetch. The only library code that touches zmq.

See ``channel`` for the socket kinds and their guarantees, ``weights`` for the weight path, ``auth``
for CURVE keys, the ZAP allow-list, handshake counters and the bind-address policy.
"""

from asyncrl.transport.auth import (
    CurveConfig,
    auth_metrics,
    check_bind_security,
    client_curve,
    generate_keys,
    keys_main,
    load_client_keys,
    load_server_keys,
    server_curve,
)
from asyncrl.transport.channel import (
    ChannelClosed,
    ChannelStats,
    ChannelTimeout,
    Envelope,
    InProcChannel,
    ZmqChannel,
    advertised,
    is_loopback,
    shared_context,
)
from asyncrl.transport.weights import PublishedVersion, WeightClient, WeightFetchError, WeightServer

__all__ = [
    "ChannelClosed",
    "ChannelStats",
    "ChannelTimeout",
    "CurveConfig",
    "Envelope",
    "InProcChannel",
    "PublishedVersion",
    "WeightClient",
    "WeightFetchError",
    "WeightServer",
    "ZmqChannel",
    "advertised",
    "auth_metrics",
    "check_bind_security",
    "client_curve",
    "generate_keys",
    "is_loopback",
    "keys_main",
    "load_client_keys",
    "load_server_keys",
    "server_curve",
    "shared_context",
]
