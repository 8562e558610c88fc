"""asyncrl's wire contract: msgspec Structs, the codec and the handshake rule.

Importable with msgspec and the standard library alone (no torch, no zmq, no numpy at import time),
so that a client in another project can speak the protocol. See ``protocols.messages`` for the
schema-evolution rules.
"""

from protocols.arrays import DTYPE_SIZES, Array, check_array
from protocols.codec import (
    ProtocolError,
    check_hello,
    decode,
    decode_frames,
    decode_single,
    decoder_for,
    encode,
    encode_frames,
    encode_into,
    parse_version,
    version_refusal,
)
from protocols.messages import *  # noqa: F403
from protocols.messages import (
    FINISH_REASONS,
    MESSAGE_TYPES,
    PROTOCOL_FLOOR_MINOR,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    ROLES,
    Message,
    SamplingParams,
)
from protocols.setup import RunSetup, WorkerSetup
from protocols.weights import BUCKET_DTYPE, DELTA_KINDS, DeltaPart, TensorSpec

__all__ = [
    "DTYPE_SIZES",
    "MESSAGE_TYPES",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "PROTOCOL_VERSION",
    "Array",
    "Message",
    "ProtocolError",
    "check_hello",
    "decode",
    "decode_frames",
    "decode_single",
    "decoder_for",
    "encode",
    "encode_frames",
    "encode_into",
    "parse_version",
    "version_refusal",
    "PROTOCOL_FLOOR_MINOR",
    "RunSetup",
    "WorkerSetup",
    "SamplingParams",
    "check_array",
    "TensorSpec",
    "DeltaPart",
    "DELTA_KINDS",
    "BUCKET_DTYPE",
    "ROLES",
    "FINISH_REASONS",
    *[t.__name__ for t in MESSAGE_TYPES],
]
