"""Transport: ZeroMQ channels, weight publication/fetch. The only library code that touches zmq.

See ``channel`` for the socket kinds and their guarantees (``stats``: its counters; ``contexts``: zmq
contexts and advertised addresses), ``weights`` for the weight path (``weight_client`` its worker side,
``buckets`` the bucketed stream, ``served`` what the server holds per version), ``keys``
for CURVE key files and the bind-address policy, ``zap`` for the ZAP allow-list handler and the
handshake counters. The ``asyncrl keys`` command line lives in ``workers/keys.py``.
"""

from asyncrl.transport.channel import ChannelClosed, ChannelPoller, ChannelTimeout, Envelope, ZmqChannel
from asyncrl.transport.contexts import advertised, end_context, private_context, shared_context
from asyncrl.transport.keys import (
    CurveConfig,
    check_bind_security,
    client_curve,
    generate_keys,
    is_loopback,
    load_client_keys,
    load_server_keys,
    server_curve,
)
from asyncrl.transport.stats import ChannelStats
from asyncrl.transport.weight_client import BucketStream
from asyncrl.transport.weights import (
    LivePublication,
    PublishedVersion,
    WeightClient,
    WeightFetchCancelled,
    WeightFetchError,
    WeightServer,
)
from asyncrl.transport.zap import auth_metrics

__all__ = [
    "BucketStream",
    "ChannelClosed",
    "ChannelPoller",
    "ChannelStats",
    "ChannelTimeout",
    "CurveConfig",
    "Envelope",
    "LivePublication",
    "PublishedVersion",
    "WeightClient",
    "WeightFetchCancelled",
    "WeightFetchError",
    "WeightServer",
    "ZmqChannel",
    "advertised",
    "auth_metrics",
    "check_bind_security",
    "client_curve",
    "end_context",
    "generate_keys",
    "is_loopback",
    "load_client_keys",
    "load_server_keys",
    "private_context",
    "server_curve",
    "shared_context",
]
