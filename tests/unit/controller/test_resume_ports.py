"""The ports a resumed controller binds (``asyncrl.controller.recovery``): its predecessor's, read from
``controller.json``, or any free one (said in the log) when one of them is taken meanwhile."""

from __future__ import annotations

import json
import logging

import zmq

from asyncrl.controller.recovery import bind_first, previous_ports
from asyncrl.transport import ZmqChannel, end_context, private_context


def router(address: str) -> ZmqChannel:
    return ZmqChannel.bind(zmq.ROUTER, address)


def test_a_resumed_controller_binds_the_previous_port_or_another_when_it_is_taken(tmp_path, caplog):
    # The first controller's socket lives in a context of its own: ending that context returns once the
    # socket is really closed and its port released (a plain close() releases it later, in ZeroMQ's I/O thread).
    ctx = private_context()
    first = ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", context=ctx)
    port = int(first.address.rsplit(":", 1)[1])
    (tmp_path / "controller.json").write_text(json.dumps({"control": f"tcp://ctl-host:{port}",
                                                          "samples": "tcp://ctl-host:41237"}))
    assert previous_ports(tmp_path / "controller.json") == (port, 41237)
    assert previous_ports(tmp_path / "missing.json") == (0, 0)
    with caplog.at_level(logging.WARNING, logger="asyncrl.controller"):
        other = bind_first(router, "127.0.0.1", [port, 0], "control")  # still held by the first
    assert other.address != first.address and "start them again with its new address" in caplog.text
    first.close()
    end_context(ctx)
    other.close()
    again = bind_first(router, "127.0.0.1", [port, 0], "control")  # free again: the live roles find it there
    assert again.address == f"tcp://127.0.0.1:{port}"
    again.close()
