"""The run folder on disk, without torch: every path of it (``RunDir``, paths.py, which lists the layout),
durable files (atomic writes, checksummed JSON, disk-full errors), the one-job-per-folder lock, and the
checksum manifest of learner checkpoints with the choice of the verified checkpoint a resume starts from."""

from asyncrl.rundir.paths import RunDir

__all__ = ["RunDir"]
