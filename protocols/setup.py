"""The typed setup a controller hands a peer in its ``Welcome``.

Owns: ``WorkerSetup`` (what a generation worker needs to join: addresses, model architecture, EOS ids,
slots, heartbeat period, actor format), ``RunSetup`` (what ``asyncrl learner`` needs: the run folder,
the model folder, the formats to publish) and their validation.
Never: imports anything but msgspec and the standard library; reads files or sockets.

Invariant: a decoded ``WorkerSetup``/``RunSetup`` is well-formed (``__post_init__`` runs inside msgspec's
decoder), so a peer never parses a number or a JSON list out of a string.
"""

from __future__ import annotations

import json
import math

import msgspec


class _Struct(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """The options of every protocol Struct (``protocols.messages._Base``)."""


def _nonempty(owner: str, **fields: str) -> None:
    for name, value in fields.items():
        if not value:
            raise ValueError(f"{owner}.{name} must be a non-empty string; the controller fills it")


class WorkerSetup(_Struct, tag="worker_setup"):
    """Everything a generation worker learns from the controller when it joins.

    ``model_config`` is the model's Hugging Face ``config.json`` text (the architecture a native engine
    builds); ``quant_format`` is the published format this worker fetches (``actor_format``: the one it
    runs); ``max_seq_len`` 0 means the model's own limit; ``model_dir`` is the controller's model folder (an SGLang server started by the
    worker loads it when the folder is shared)."""

    samples_address: str
    weights_announce: str
    weights_fetch: str
    model_config: str
    worker_slots: int
    heartbeat_s: float
    quant_format: str
    eos_token_ids: list[int] = []
    model_id: str = ""
    model_dir: str = ""
    max_seq_len: int = 0
    quantize_head: bool = False
    """The run quantizes the output head too (``quant.lm_head``): a native worker of a quantized format
    converts its ``lm_head`` to load what is published."""
    group_size: int = 0
    """Samples per group (``algo.group_size``, since 1.4). Groups are assigned whole, so a worker asks for
    work only with at least this many free slots, and one with fewer slots in all can never be given
    any. 0: no such bound."""
    actor_format: str = ""
    """The format the worker's actor runs (since 1.7; empty: ``quant_format``), decided with it by the controller
    (``asyncrl.config.roles.worker_formats``: the worker's engine, its ``quant.fmt`` and the run's)."""
    quantize_embedding: bool = False
    """The run holds the token embedding as int8 codes (``quant.embedding``, since 1.8): a native worker of a
    quantized format converts its embedding to load what is published."""

    def __post_init__(self) -> None:
        _nonempty("WorkerSetup", samples_address=self.samples_address, weights_announce=self.weights_announce,
                  weights_fetch=self.weights_fetch, quant_format=self.quant_format)
        if self.worker_slots < 1:
            raise ValueError(f"WorkerSetup.worker_slots must be >= 1, got {self.worker_slots}; "
                             "set rollout.worker_slots to a positive number")
        if not (math.isfinite(self.heartbeat_s) and self.heartbeat_s > 0):
            raise ValueError(f"WorkerSetup.heartbeat_s must be a finite number > 0, got {self.heartbeat_s}; "
                             "set rollout.heartbeat_s to a positive number of seconds")
        if self.group_size < 0:
            raise ValueError(f"WorkerSetup.group_size must be >= 0 (0: not said), got {self.group_size}")
        if self.max_seq_len < 0:
            raise ValueError(f"WorkerSetup.max_seq_len must be >= 0 (0: the model's limit), got {self.max_seq_len}")
        bad = [t for t in self.eos_token_ids if t < 0]
        if bad:
            raise ValueError(f"WorkerSetup.eos_token_ids must be token ids >= 0, got {bad}")
        try:
            arch = json.loads(self.model_config)
        except ValueError:
            arch = None
        if not isinstance(arch, dict):
            raise ValueError("WorkerSetup.model_config must be the JSON text of the model's config.json "
                             f"(a JSON object), got {self.model_config[:40]!r}")

    def vocab_size(self) -> int | None:
        """Rows of the model's embedding, as its config says (None when it does not say)."""
        v = json.loads(self.model_config).get("vocab_size")
        return v if isinstance(v, int) and not isinstance(v, bool) else None


SETUP_REQUEST = "run_setup"
"""How a peer asks for the ``RunSetup``: ``Hello(role="client", capabilities={"request": SETUP_REQUEST})``."""


class RunSetup(_Struct, tag="run_setup"):
    """What the controller tells ``asyncrl learner`` that asks where the run is (docs/cluster.md)."""

    run_dir: str
    model_dir: str
    publish_formats: list[str] = []

    def __post_init__(self) -> None:
        _nonempty("RunSetup", run_dir=self.run_dir, model_dir=self.model_dir)
        if any(not f for f in self.publish_formats):
            raise ValueError(f"RunSetup.publish_formats must name formats, got {self.publish_formats}")
