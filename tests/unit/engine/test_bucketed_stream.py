"""``NativeEngine.load_stream``: a version streamed in buckets over real loopback sockets is loaded at a step
boundary while the engine serves, and a torn stream leaves the engine on its version, serving."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from asyncrl.engine.base import GenRequest
from asyncrl.engine.native.engine import NativeEngine
from asyncrl.quant import load_published, quantize_model
from asyncrl.transport import WeightClient, WeightFetchError, WeightServer
from asyncrl.transport.publication import publish_streamed
from tests.unit.engine.test_native import drain, ids, params

pytestmark = pytest.mark.timeout(600)
HANG_S = 120.0


def _versions(model, n: int) -> list[dict]:
    """``n`` state dicts of small successive updates of ``model`` (versions 1..n)."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 2e-5)
        out.append({k: v.clone() for k, v in m.state_dict().items()})
    return out


def _bytes_of(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_bucketed_stream_loads_at_a_step_boundary_while_serving_and_a_torn_one_keeps_the_version(tiny_hf):
    server = WeightServer(keep_versions=4)
    client = WeightClient(server.announce_address, server.fetch_address)
    engine = NativeEngine(copy.deepcopy(tiny_hf), quant_format="int8", max_batch_size=4)
    try:
        pubs = {}
        prev = None
        for v, sd in enumerate(_versions(tiny_hf, 3), start=1):
            prev, _ = publish_streamed(server, sd, "int8", version=v, prev=prev)
            pubs[v] = prev
        engine.submit([GenRequest("a", ids("12"), params(24))])
        results: dict = {}
        stepping = threading.Thread(target=lambda: results.update(drain(engine)))
        stepping.start()  # the engine decodes while the versions stream in
        for v in (1, 2):
            base = pubs[v - 1] if v > 1 else None
            with client.stream(v, fmt="int8", bucket_bytes=2000, timeout_s=HANG_S,
                               base_version=base.version if base else -1,
                               base_checksum=base.checksum if base else "") as stream:
                loaded = engine.load_stream(v, stream)
            assert engine.version == v and loaded.buckets > 4 and loaded.is_delta == (v > 1)
        stepping.join(HANG_S)
        versions = results["a"].versions.tolist()
        assert versions == sorted(versions) and set(versions) <= {0, 1, 2}  # each token from one whole version
        want = quantize_model(copy.deepcopy(tiny_hf), "int8")
        load_published(want, pubs[2])
        assert all(torch.equal(engine._model.state_dict()[k], t) for k, t in want.state_dict().items())

        held = _bytes_of(engine._model)
        with pytest.raises(WeightFetchError, match="timed out"):  # the server goes away after bucket 1
            with client.stream(3, fmt="int8", bucket_bytes=2000, timeout_s=3.0, base_version=2,
                               base_checksum=pubs[2].checksum) as stream:
                engine.load_stream(3, _stop_after(stream, server, 2))
        assert engine.version == 2
        assert all(torch.equal(engine._model.state_dict()[k], t) for k, t in held.items())
        engine.submit([GenRequest("b", ids("3"), params(3))])
        (res,) = drain(engine).values()
        assert res.versions.tolist() == [2, 2, 2]  # the engine goes on serving the version it held
        with pytest.raises(ValueError, match="not newer"):
            engine.load_stream(2, iter(()))
    finally:
        engine.close()
        client.close()
        server.close()


def _stop_after(stream, server: WeightServer, n: int):
    """The stream's buckets; once ``n`` went into the engine, the server is gone (its sockets closed)."""
    for i, bucket in enumerate(stream):
        if i + 1 == n:
            server.close()
        yield bucket
    raise AssertionError("the stream ended although its server was closed")
