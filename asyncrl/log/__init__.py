"""Trajectory log: writer, reader, record types (see ``trajectory`` and ``framing``)."""

from asyncrl.log.framing import Corruption, LogFormatError
from asyncrl.log.records import SCHEMA_VERSION, BatchRecord, EventRecord, LogHeader, Record, SampleRecord
from asyncrl.log.trajectory import (
    LogCorruptionError,
    LogLostError,
    LogScan,
    TrajectoryLogWriter,
    read_log,
    segment_paths,
    truncate_log,
)

__all__ = [
    "SCHEMA_VERSION",
    "BatchRecord",
    "Corruption",
    "EventRecord",
    "LogCorruptionError",
    "LogFormatError",
    "LogLostError",
    "LogHeader",
    "LogScan",
    "Record",
    "SampleRecord",
    "TrajectoryLogWriter",
    "read_log",
    "segment_paths",
    "truncate_log",
]
