"""Transport overhead: asyncrl framing vs raw pyzmq on the same bytes, measured side by side.

1. Finished samples (512-token responses): encode + send + receive + decode through asyncrl's
   channels, next to raw pyzmq sending the already-encoded bytes (no encode/decode), PUSH/PULL over
   tcp loopback between two processes (a persistent sender process per path). Beside msgs/s, the CPU
   microseconds per message of both processes (all threads), which a busy machine does not inflate.
2. Weight publication of a ~100 MB state (a Qwen2-like list of tensors): WeightServer -> WeightClient
   fetch, next to raw pyzmq ROUTER/DEALER multipart of the same buffers and a plain memory copy.

The compared paths alternate round by round (order shuffled per round, ``--rounds``, at least 5); the
headline ratios are the median of the per-round ratios with their min, max and spread, next to the
load average seen during the rounds (the machine is shared).

Run: ``python scripts/bench_transport.py [--quick] [--rounds N] [--json PATH]``.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import numpy as np
import zmq

import protocols as P
from asyncrl.bench.measure import interleaved, load_average_stats, print_ratio, ratio_stats
from asyncrl.bench.report import comma_list, parser, print_table, write_json
from asyncrl.transport import WeightClient, WeightServer, ZmqChannel

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


def _sender(conn, address: str, mode: str) -> None:
    """A persistent sending process: on ``n`` from the pipe it sends n samples; once the receiver says it
    has them all, it answers the CPU seconds the round cost this process."""
    samples = [make_sample(i) for i in range(64)]
    encoded = [P.encode(s) for s in samples]
    if mode == "raw":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, -1)
        sock.connect(address)
        send = lambda i: sock.send(encoded[i % 64])  # noqa: E731
    else:
        ch = ZmqChannel.connect(zmq.PUSH, address)
        send = lambda i: ch.send(samples[i % 64])  # noqa: E731
    while (n := conn.recv()) is not None:
        c0 = time.process_time()
        for i in range(n):
            send(i)
        conn.recv()  # the receiver has them all: zmq's I/O thread is done with this round too
        conn.send(time.process_time() - c0)
    if mode == "raw":
        sock.close()
        ctx.term()
    else:
        time.sleep(0.5)  # linger=0 on our channels: let the queue drain before closing
        ch.close()


class SamplePath:
    """One compared path of the samples benchmark: a receiving socket here and a persistent sender
    process, so rounds can alternate between paths without process start-up in the way.

    A round sends ``n`` samples; its figure is messages/s (wall clock, first to last message).
    ``cpu_us`` records the CPU microseconds per message of the sending and the receiving process (all
    their threads: zmq's I/O threads and the kernel's tcp work included) in each round: the cost of the
    path itself, which time slices lost to other processes on a shared machine do not inflate.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        if mode == "raw":
            self.ctx = zmq.Context()
            self.sock = self.ctx.socket(zmq.PULL)
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            address = f"tcp://127.0.0.1:{port}"
        else:
            self.ch = ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0", accept=P.FinishedSample)
            address = self.ch.address
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_sender, args=(child, address, mode), daemon=True)
        self.proc.start()
        self.cpu_us: list[float] = []

    def run(self, n: int) -> float:
        self.conn.send(n)
        c0 = time.process_time()
        for i in range(n):
            if self.mode == "raw":
                self.sock.recv()
            else:
                env = self.ch.recv(60.0)
                assert env is not None and isinstance(env.msg, P.FinishedSample)
            if i == 0:
                t0 = time.perf_counter()
        dt = time.perf_counter() - t0
        recv_cpu = time.process_time() - c0
        self.conn.send("cpu")
        send_cpu = self.conn.recv()
        self.cpu_us.append(1e6 * (recv_cpu + send_cpu) / n)
        return (n - 1) / dt

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)
        if self.mode == "raw":
            self.sock.close()
            self.ctx.term()
        else:
            self.ch.close()


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


class WeightPaths:
    """The three compared weight paths, each alive for the whole benchmark so rounds can interleave:
    a memcpy of the same buffers, raw pyzmq ROUTER/DEALER from a child process, and WeightServer ->
    WeightClient from another child process."""

    def __init__(self, total_mb: int, tmpdir: str) -> None:
        ctx = mp.get_context("spawn")
        self.state = weight_state(total_mb)
        self.nbytes = sum(a.nbytes for _, a in self.state)
        self.dst = [np.empty_like(a) for _, a in self.state]
        ready = ctx.Event()
        raw_addr = f"ipc://{tmpdir}/raw-weights"
        self.raw_proc = ctx.Process(target=_raw_weight_server, args=(raw_addr, total_mb, ready))
        self.raw_proc.start()
        ready.wait(120)
        self.zc = zmq.Context()
        self.dealer = self.zc.socket(zmq.DEALER)
        self.dealer.connect(raw_addr)
        ready, self.stop = ctx.Event(), ctx.Event()
        addrs = (f"ipc://{tmpdir}/ann", f"ipc://{tmpdir}/fetch")
        self.our_proc = ctx.Process(target=_our_weight_server, args=(addrs, total_mb, ready, self.stop))
        self.our_proc.start()
        ready.wait(120)
        self.client = WeightClient(*addrs)

    def memcpy(self) -> float:
        return _timed(lambda: [np.copyto(d, a) for d, (_, a) in zip(self.dst, self.state, strict=True)])

    def raw(self) -> float:
        def fetch() -> int:
            self.dealer.send(b"fetch")
            got = 0
            while True:
                frames = self.dealer.recv_multipart(copy=False)
                if frames[0].bytes == b"end":
                    return got
                got += len(frames[1].buffer)

        return _timed(fetch)

    def ours(self) -> float:
        return _timed(lambda: self.client.fetch())

    def close(self) -> None:
        self.dealer.send(b"stop")
        self.raw_proc.join(30)
        self.dealer.close()
        self.zc.term()
        self.client.close()
        self.stop.set()
        self.our_proc.join(30)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_samples(n: int, rounds: int) -> tuple[list[dict], dict]:
    """Part 1: asyncrl framing vs raw pyzmq, rounds interleaved."""
    msg_bytes = len(P.encode(make_sample(0)))
    sp = {"raw": SamplePath("raw"), "ours": SamplePath("ours")}
    try:
        s = interleaved({k: (lambda path=path: path.run(n)) for k, path in sp.items()}, rounds)
    finally:
        for path in sp.values():
            path.close()
    raw_v, ours_v = s["values"]["raw"], s["values"]["ours"]
    framing = ratio_stats(ours_v, raw_v)
    cpu = {k: path.cpu_us[1:] for k, path in sp.items()}  # the first entry is the warm-up round
    framing_cpu = ratio_stats(cpu["raw"], cpu["ours"])  # cost ratio as a speed: raw us / our us
    s["cpu_us"] = cpu
    s_load = load_average_stats(s["load"])
    sample_rows = [
        {"path": "raw pyzmq (pre-encoded bytes)", "msgs_per_s": statistics.median(raw_v),
         "MB_per_s": statistics.median(raw_v) * msg_bytes / 2**20, "ratio_vs_raw": 1.0,
         "cpu_us_per_msg": statistics.median(cpu["raw"]), "cpu_ratio": 1.0},
        {"path": "asyncrl (encode+send+recv+decode)", "msgs_per_s": statistics.median(ours_v),
         "MB_per_s": statistics.median(ours_v) * msg_bytes / 2**20, "ratio_vs_raw": framing["ratio_median"],
         "ratio_min": framing["ratio_min"], "ratio_max": framing["ratio_max"], "spread": framing["spread"],
         "cpu_us_per_msg": statistics.median(cpu["ours"]), "cpu_ratio": framing_cpu["ratio_median"]},
    ]
    print_table(f"finished samples ({RESPONSE_TOKENS}-token responses, {msg_bytes} B each, {n} msgs, tcp loopback; "
                f"median msgs/s of {rounds} interleaved rounds)",
                sample_rows, ["path", "msgs_per_s", "MB_per_s", "ratio_vs_raw", "ratio_min", "ratio_max", "spread",
                              "cpu_us_per_msg", "cpu_ratio"])
    print_ratio("framing asyncrl / raw pyzmq, msgs/s (aim >= 0.8)", framing, s_load)
    print_ratio("framing raw / asyncrl, CPU us per message (both processes, all threads)", framing_cpu)
    return sample_rows, {"framing_vs_raw": framing, "framing_cpu_vs_raw": framing_cpu, "load": s_load,
                         "per_round": s}


def run_weights(total_mb: int, rounds: int) -> tuple[list[dict], dict]:
    """Part 2: weight fetch vs raw pyzmq and memcpy, rounds interleaved."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        paths = WeightPaths(total_mb, tmp)
        try:
            w = interleaved({"memcpy": paths.memcpy, "raw": paths.raw, "ours": paths.ours}, rounds)
        finally:
            paths.close()
    wv = w["values"]
    w_load = load_average_stats(w["load"])
    fetch = ratio_stats(wv["raw"], wv["ours"])  # speed ratio = time(raw) / time(ours)
    vs_mem = ratio_stats(wv["memcpy"], wv["ours"])
    raw_mem = ratio_stats(wv["memcpy"], wv["raw"])
    gb = paths.nbytes / 2**30
    med = {k: statistics.median(v) for k, v in wv.items()}
    weight_rows = [
        {"path": "memcpy (np.copyto)", "seconds": med["memcpy"], "GB_per_s": gb / med["memcpy"],
         "speed_vs_memcpy": 1.0, "speed_vs_raw": float("nan")},
        {"path": "raw pyzmq ROUTER/DEALER", "seconds": med["raw"], "GB_per_s": gb / med["raw"],
         "speed_vs_memcpy": raw_mem["ratio_median"], "speed_vs_raw": 1.0},
        {"path": "asyncrl WeightServer->Client", "seconds": med["ours"], "GB_per_s": gb / med["ours"],
         "speed_vs_memcpy": vs_mem["ratio_median"], "speed_vs_raw": fetch["ratio_median"],
         "ratio_min": fetch["ratio_min"], "ratio_max": fetch["ratio_max"], "spread": fetch["spread"]},
    ]
    print_table(f"weight publication ({paths.nbytes / 2**20:.0f} MB fp32 state, ipc, median of {rounds} interleaved "
                "rounds; speed ratios are per-round time ratios)",
                weight_rows, ["path", "seconds", "GB_per_s", "speed_vs_memcpy", "speed_vs_raw", "ratio_min",
                              "ratio_max", "spread"])
    print_ratio("weight fetch asyncrl / raw pyzmq speed (aim >= 0.8)", fetch, w_load)
    return weight_rows, {"fetch_vs_raw": fetch, "fetch_vs_memcpy": vs_mem, "load": w_load, "per_round": w}


def main() -> int:
    p = parser("bench_transport", __doc__)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 21; --quick 11; min 5)")
    p.add_argument("--parts", default="samples,weights", help="which parts to run (default: %(default)s)")
    args = p.parse_args()
    parts = comma_list(args.parts, "--parts", ("samples", "weights"))
    n = 3_000 if args.quick else 10_000
    rounds = max(5, args.rounds or (11 if args.quick else 21))
    tables, ratios = {}, {}
    if "samples" in parts:
        tables["samples"], ratios["samples"] = run_samples(n, rounds)
    if "weights" in parts:
        tables["weights"], ratios["weights"] = run_weights(100, rounds)
    write_json(args.json, "bench_transport", tables, args, rounds=rounds, messages_per_round=n, ratios=ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
