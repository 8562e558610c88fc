"""Transport overhead: asyncrl framing vs raw pyzmq on the same bytes, measured side by side.

1. Finished samples (512-token responses): encode + send + receive + decode through asyncrl's
   channels, next to raw pyzmq sending the already-encoded bytes (no encode/decode), PUSH/PULL over
   tcp loopback between two processes. Overhead = 1 - ours / raw.
2. Weight publication of a ~100 MB state (a Qwen2-like list of tensors): WeightServer -> WeightClient
   fetch, next to raw pyzmq ROUTER/DEALER multipart of the same buffers and a plain memory copy.

Run: ``python scripts/bench_transport.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import protocols as P  # noqa: E402
from asyncrl.transport import WeightClient, WeightServer, ZmqChannel  # noqa: E402
from scripts.benchlib import parser, print_table, write_json  # noqa: E402

RESPONSE_TOKENS = 512


def make_sample(i: int) -> P.FinishedSample:
    rng = np.random.default_rng(i)
    n = RESPONSE_TOKENS
    return P.FinishedSample(
        sample_id=f"group-{i}/0", group_id=f"group-{i}",
        prompt_ids=P.Array.from_numpy(rng.integers(0, 32000, 128, dtype=np.int32)),
        response_ids=P.Array.from_numpy(rng.integers(0, 32000, n, dtype=np.int32)),
        behav_logp=P.Array.from_numpy(-rng.random(n, dtype=np.float32)),
        versions=P.Array.from_numpy(np.full(n, 7, np.int32)),
        finish_reason="stop", worker_id="bench-worker", quant_format="int8", timings={"gen_s": 1.0},
    )


def _sender(address: str, n: int, mode: str) -> None:
    samples = [make_sample(i) for i in range(64)]
    if mode == "raw":
        encoded = [P.encode(s) for s in samples]
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, -1)
        sock.connect(address)
        for i in range(n):
            sock.send(encoded[i % 64])
        sock.close()
        ctx.term()
    else:
        ch = ZmqChannel.connect(zmq.PUSH, address)
        for i in range(n):
            ch.send(samples[i % 64])
        time.sleep(0.5)  # linger=0 on our channels: let the queue drain before closing
        ch.close()


def bench_samples(n: int, mode: str) -> float:
    """Messages per second received (and, for 'ours', decoded and validated)."""
    if mode == "raw":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        address = f"tcp://127.0.0.1:{port}"
    else:
        ch = ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0")
        address = ch.address
    proc = mp.get_context("spawn").Process(target=_sender, args=(address, n, mode))
    proc.start()
    t0 = None
    for i in range(n):
        if mode == "raw":
            sock.recv()
        else:
            env = ch.recv(60.0)
            assert env is not None and isinstance(env.msg, P.FinishedSample)
        if i == 0:
            t0 = time.perf_counter()
    dt = time.perf_counter() - t0
    proc.join()
    if mode == "raw":
        sock.close()
        ctx.term()
    else:
        ch.close()
    return (n - 1) / dt


def weight_state(total_mb: int) -> list[tuple[str, np.ndarray]]:
    """Tensors shaped like a small Qwen2 (hidden 1024), up to ``total_mb`` megabytes of fp32."""
    rng = np.random.default_rng(0)
    out, total, layer = [], 0, 0
    while total < total_mb * 2**20:
        for name, shape in (("q_proj", (1024, 1024)), ("k_proj", (256, 1024)), ("v_proj", (256, 1024)),
                            ("o_proj", (1024, 1024)), ("gate_proj", (2816, 1024)), ("up_proj", (2816, 1024)),
                            ("down_proj", (1024, 2816)), ("input_layernorm", (1024,))):
            a = rng.standard_normal(shape, dtype=np.float32)
            out.append((f"model.layers.{layer}.{name}.weight", a))
            total += a.nbytes
        layer += 1
    return out


def _raw_weight_server(address: str, total_mb: int, ready) -> None:
    state = weight_state(total_mb)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    ready.set()
    while True:
        peer, req = sock.recv_multipart()
        if req == b"stop":
            break
        for i, (_, a) in enumerate(state):
            sock.send_multipart([peer, b"h", memoryview(a).cast("B")], copy=False,
                                flags=0 if i < len(state) - 1 else 0)
        sock.send_multipart([peer, b"end"])
    sock.close()
    ctx.term()


def _our_weight_server(addresses, total_mb: int, ready, stop) -> None:
    state = weight_state(total_mb)
    server = WeightServer(addresses[0], addresses[1])
    specs = [P.TensorSpec(name=k, dtype="float32", shape=a.shape, nbytes=a.nbytes) for k, a in state]
    ann = P.WeightAnnounce(version=1, fmt="fp32", manifest=specs, checksum="", total_bytes=sum(s.nbytes for s in specs))
    server.publish(ann, [a for _, a in state])
    ready.set()
    stop.wait()
    server.close()


def bench_weights(total_mb: int, repeats: int, tmpdir: str) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    state = weight_state(total_mb)
    nbytes = sum(a.nbytes for _, a in state)
    # plain memory copy of the same bytes into preallocated buffers
    dst = [np.empty_like(a) for _, a in state]
    best_copy = min(_timed(lambda: [np.copyto(d, a) for d, (_, a) in zip(dst, state, strict=True)])
                    for _ in range(repeats))
    # raw pyzmq
    raw_addr = f"ipc://{tmpdir}/raw-weights"
    ready = ctx.Event()
    p = ctx.Process(target=_raw_weight_server, args=(raw_addr, total_mb, ready))
    p.start()
    ready.wait(60)
    zc = zmq.Context()
    dealer = zc.socket(zmq.DEALER)
    dealer.connect(raw_addr)

    def raw_fetch():
        dealer.send(b"fetch")
        got = 0
        while True:
            frames = dealer.recv_multipart(copy=False)
            if frames[0].bytes == b"end":
                return got
            got += len(frames[1].buffer)

    raw_fetch()  # warm the connection
    best_raw = min(_timed(raw_fetch) for _ in range(repeats))
    dealer.send(b"stop")
    p.join()
    dealer.close()
    zc.term()
    # asyncrl weight path
    ready, stop = ctx.Event(), ctx.Event()
    addrs = (f"ipc://{tmpdir}/ann", f"ipc://{tmpdir}/fetch")
    p = ctx.Process(target=_our_weight_server, args=(addrs, total_mb, ready, stop))
    p.start()
    ready.wait(60)
    client = WeightClient(*addrs)
    client.fetch()
    best_ours = min(_timed(lambda: client.fetch()) for _ in range(repeats))
    client.close()
    stop.set()
    p.join()
    return {"bytes": nbytes, "memcpy_s": best_copy, "raw_zmq_s": best_raw, "asyncrl_s": best_ours}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    args = parser("bench_transport", __doc__.splitlines()[0]).parse_args()
    import tempfile

    n = 5_000 if args.quick else 30_000
    total_mb = 100
    repeats = 2 if args.quick else 5
    raw = max(bench_samples(n, "raw") for _ in range(1 if args.quick else 2))
    ours = max(bench_samples(n, "ours") for _ in range(1 if args.quick else 2))
    msg_bytes = len(P.encode(make_sample(0)))
    sample_rows = [
        {"path": "raw pyzmq (pre-encoded bytes)", "msgs_per_s": raw, "MB_per_s": raw * msg_bytes / 2**20,
         "ratio_vs_raw": 1.0},
        {"path": "asyncrl (encode+send+recv+decode)", "msgs_per_s": ours, "MB_per_s": ours * msg_bytes / 2**20,
         "ratio_vs_raw": ours / raw},
    ]
    print_table(f"finished samples ({RESPONSE_TOKENS}-token responses, {msg_bytes} B each, {n} msgs, tcp loopback)",
                sample_rows, ["path", "msgs_per_s", "MB_per_s", "ratio_vs_raw"])
    print(f"framing overhead vs raw pyzmq: {100 * (1 - ours / raw):.1f}% (aim: < 20%)")
    with tempfile.TemporaryDirectory() as tmp:
        w = bench_weights(total_mb, repeats, tmp)
    gb = w["bytes"] / 2**30
    weight_rows = [
        {"path": "memcpy (np.copyto)", "seconds": w["memcpy_s"], "GB_per_s": gb / w["memcpy_s"],
         "ratio_vs_memcpy": 1.0, "ratio_vs_raw": w["raw_zmq_s"] / w["memcpy_s"]},
        {"path": "raw pyzmq ROUTER/DEALER", "seconds": w["raw_zmq_s"], "GB_per_s": gb / w["raw_zmq_s"],
         "ratio_vs_memcpy": w["memcpy_s"] / w["raw_zmq_s"], "ratio_vs_raw": 1.0},
        {"path": "asyncrl WeightServer->Client", "seconds": w["asyncrl_s"], "GB_per_s": gb / w["asyncrl_s"],
         "ratio_vs_memcpy": w["memcpy_s"] / w["asyncrl_s"], "ratio_vs_raw": w["raw_zmq_s"] / w["asyncrl_s"]},
    ]
    print_table(f"weight publication ({w['bytes'] / 2**20:.0f} MB fp32 state, ipc, best of {repeats})",
                weight_rows, ["path", "seconds", "GB_per_s", "ratio_vs_memcpy", "ratio_vs_raw"])
    print(f"weight-path overhead vs raw pyzmq: {100 * (1 - w['raw_zmq_s'] / w['asyncrl_s']):.1f}% (aim: < 20%)")
    write_json(args.json, "bench_transport", {"samples": sample_rows, "weights": weight_rows}, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
