"""Transport: ZeroMQ channels, weight publication/fetch. The only library code that touches zmq.

See ``channel`` for the socket kinds and their guarantees, ``weights`` for the weight path.
"""

from asyncrl.transport.channel import (
    ChannelClosed,
    ChannelStats,
    ChannelTimeout,
    Envelope,
    InProcChannel,
    ZmqChannel,
    is_loopback,
    shared_context,
)
from asyncrl.transport.weights import PublishedVersion, WeightClient, WeightFetchError, WeightServer

__all__ = [
    "ChannelClosed",
    "ChannelStats",
    "ChannelTimeout",
    "Envelope",
    "InProcChannel",
    "PublishedVersion",
    "WeightClient",
    "WeightFetchError",
    "WeightServer",
    "ZmqChannel",
    "is_loopback",
    "shared_context",
]
