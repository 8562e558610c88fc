"""A controller stand-in for worker tests: the sockets and weights a real ``asyncrl worker`` joins.

``worker_standin(tmp_path, worker_slots=..., formats=("fp32",), **setup_fields)`` builds the embedded tiny
model, publishes its weights in each format as version 0 on a real ``WeightServer``, binds the control ROUTER and the sample PULL
on loopback and fills the ``WorkerSetup`` a Welcome carries; the test drives the protocol itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import zmq

import protocols as P
from asyncrl.models import ensure_tiny_model
from asyncrl.quant import publish
from asyncrl.transport import WeightServer, ZmqChannel
from asyncrl.transport.publication import to_wire


@dataclasses.dataclass
class StandIn:
    ctl: ZmqChannel
    pull: ZmqChannel
    server: WeightServer
    setup: P.WorkerSetup
    model: Any  # the tiny model whose weights are published
    formats: tuple[str, ...]

    def publish(self, version: int) -> None:
        """Publish the model's current weights as ``version`` in every format."""
        for fmt in self.formats:
            self.server.publish(*to_wire(publish(self.model.state_dict(), fmt, version=version)))

    def welcome(self, env: Any) -> None:
        """Answer a worker's Hello with this stand-in's setup."""
        self.ctl.send(P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="stand-in", latest_version=0,
                                setup=self.setup), to=env.peer)


@contextlib.contextmanager
def worker_standin(tmp_path: Path, *, worker_slots: int, formats: tuple[str, ...] = ("fp32",),
                   **setup_fields: Any) -> Iterator[StandIn]:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = ensure_tiny_model(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    server = WeightServer()
    ctl = ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", reply_errors=True)
    pull = ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0")
    try:
        setup = P.WorkerSetup(samples_address=pull.address, weights_announce=server.announce_address,
                              weights_fetch=server.fetch_address, worker_slots=worker_slots, heartbeat_s=0.5,
                              model_config=AutoConfig.from_pretrained(model_dir).to_json_string(use_diff=False),
                              eos_token_ids=[2], quant_format="fp32", **setup_fields)
        stand = StandIn(ctl=ctl, pull=pull, server=server, setup=setup, model=model, formats=formats)
        stand.publish(0)
        yield stand
    finally:
        server.close()
        ctl.close()
        pull.close()
