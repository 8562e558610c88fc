"""A peer process for transport tests: speaks every message kind over a real socket.

Run as ``python tests/integration/wire_peer.py ROLE ADDRESS [ADDRESS2]``:
  dealer ADDR        send every example to a ROUTER, expect each echoed back, exit 0 if all match
  push ADDR          push every example (and a weight chunk with payload) to a PULL socket
  stall ADDR         connect a PULL socket and never read (backpressure tests); exits on SIGTERM
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import protocols as P  # noqa: E402


def _arr(x) -> P.Array:
    return P.Array.from_numpy(np.ascontiguousarray(x))


def example_messages() -> list:
    n = 5
    fs = P.FinishedSample(sample_id="g1/0", group_id="g1", prompt_ids=_arr(np.arange(4, dtype=np.int32)),
                          response_ids=_arr(np.arange(n, dtype=np.int32)),
                          behav_logp=_arr(-np.linspace(0.1, 1, n, dtype=np.float32)),
                          versions=_arr(np.array([3, 3, 4, 4, 4], np.int32)), finish_reason="length",
                          worker_id="w0", engine="native", quant_format="int8", timings={"gen_s": 0.5})
    ts = P.TrainSample(sample_id="g1/0", group_id="g1", prompt_ids=fs.prompt_ids, response_ids=fs.response_ids,
                       behav_logp=fs.behav_logp, versions=fs.versions, advantage=0.7, reward=1.0)
    spec = P.TensorSpec(name="model.layers.0.q_proj.codes", dtype="int8", shape=(4, 4), nbytes=16, role="codes")
    return [
        P.Hello(protocol_version=P.PROTOCOL_VERSION, role="generator", peer_id="w0", capabilities={"fmt": "int8"}),
        P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="ctl", latest_version=3),
        P.Reject(reason="major version mismatch"),
        P.WorkRequest(worker_id="w0", credits=8),
        P.RolloutAssignment(group_id="g1", sample_ids=["g1/0", "g1/1"], prompt_ids=fs.prompt_ids,
                            params=P.SamplingParams(temperature=0.7, max_new_tokens=16, stop_token_ids=[2]),
                            n_samples=2),
        P.NoWork(retry_after_s=0.1),
        fs,
        P.WeightAnnounce(version=4, fmt="int8", manifest=[spec], checksum="ab" * 32, total_bytes=16),
        P.WeightFetch(version=4, base_version=3, base_checksum="cd" * 32),
        P.WeightChunk(version=4, index=0, count=1, name=spec.name, dtype="int8", shape=(4, 4), nbytes=16),
        P.WeightDelta(version=4, fmt="int8", base_version=3, base_checksum="cd" * 32, manifest=[spec],
                      checksum="ab" * 32, parts=[P.DeltaPart(name=spec.name, kind="sparse", count=2, nbytes=10)],
                      total_bytes=10, full_bytes=16),
        P.WeightFetch(version=4, fmt="int8", bucket_bytes=1 << 20, bucket=2),
        P.WeightBucket(version=4, fmt="int8", index=0, bucket_bytes=64, nbytes=16, pieces=1,
                       digest="xxh3_128:" + "0" * 32, entries=[spec], last=True, checksum="ab" * 32, buckets=1,
                       total_bytes=16, full_bytes=16),
        ts,
        P.BatchRequest(step=4),
        P.TrainBatch(step=4, samples=[ts], metrics={"reward": 1.0}),
        P.VersionUpdate(version=5, metrics={"loss": 0.1}),
        P.Heartbeat(peer_id="w0", time=123.5, stats={"tokens_per_s": 900.0}),
        P.Goodbye(peer_id="w0", unfinished=["g1/1"], reason="SIGTERM"),
        P.Shutdown(reason="done"),
        P.Error(code="invalid", message="bad"),
    ]


def payload(msg) -> bytes | None:
    return bytes(range(16)) if isinstance(msg, P.WeightChunk) else None


def main() -> int:
    import zmq

    from asyncrl.transport import ZmqChannel

    role, address = sys.argv[1], sys.argv[2]
    if role == "dealer":
        ch = ZmqChannel.connect(zmq.DEALER, address)
        for msg in example_messages():
            ch.send(msg, payload=payload(msg))
            env = ch.recv(10.0)
            if env is None or env.msg != msg or (env.payload is not None and bytes(env.payload) != payload(msg)):
                print(f"echo mismatch for {type(msg).__name__}: {env}", flush=True)
                return 1
        ch.close()
        return 0
    if role == "push":
        from asyncrl.transport import end_context, private_context

        ctx = private_context()  # ended only once every message has left, however slowly this machine runs
        ch = ZmqChannel.connect(zmq.PUSH, address, context=ctx)
        for msg in example_messages():
            ch.send(msg, payload=payload(msg))
        ch.send(P.Shutdown(reason="end"))
        ch.close(linger_s=120.0)  # bounds only a receiver that is gone
        end_context(ctx)
        return 0
    if role == "stall":
        ch = ZmqChannel.connect(zmq.PULL, address, hwm=int(sys.argv[3]))
        print("ready", flush=True)
        while True:
            time.sleep(1)
    raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    raise SystemExit(main())
