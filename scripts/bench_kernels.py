#!/usr/bin/env python
"""CPU kernel choices of asyncrl.quant (and of bench_quant's sampler) against their alternatives.

Each row times the code path asyncrl uses (``chosen``) and the obvious alternative it replaced or
declined (``alternative``) on the same tensors, in one thread, rounds interleaved in shuffled order
(``asyncrl.bench.measure.interleaved``); ``alt_over_chosen`` is the median over rounds of alternative
time / chosen time, so above 1 means the chosen path is faster. Every pair computes the same values (the script
checks it before timing). Shapes are the 22M Qwen2 of ``bench_quant.py`` (``asyncrl.bench.models``; hidden 512,
MLP 2816) and SmolLM2-135M's projections (576 x 1536):

  fp4_block_amax     nvfp4 max |w| per 16-element block: an integer max over the sign-cleared bit
                     patterns (``asyncrl.quant.fp4``) vs ``aminmax(dim=2)`` of the floats
  fp4_zero_to_inf    +0 -> +inf in the block scales: four integer passes vs ``masked_fill_`` on a bool mask
  all_finite         NaN/inf check of a weight: one ``aminmax`` vs ``isfinite(t).all()`` (``asyncrl.quant.int8``)
  int8_row_absmax    max |w| per row of a weight: separate ``amax`` and ``amin`` row reductions vs
                     ``aminmax(dim=1)`` and vs ``abs().amax(dim=1)``
  int8_act_amax      max |x| per activation row, M = 64: ``abs().amax(dim=1)`` vs the inf-norm
  fp8_gemm           fp8 W8A8 on the CPU: an fp32 GEMM over the decoded codes vs ``torch._scaled_mm``
  int8_gemm          W8A8 at M = 1 and 16, K=576 and K=1536: the int8 kernel this CPU gets (``int_mm``,
                     torch._int_mm, with an int8 dot product; ``int_mm_avx2``, the C kernel of
                     ``asyncrl.quant.cpu_int8``, with AVX2 alone; ``int_mm_fp32``, fp32 GEMMs over the codes,
                     with neither) vs each other one and vs an fp32 GEMM of the same shape (run with
                     ASYNCRL_CPU_FLAGS="avx2 fma" to time the choice of a CPU without VNNI)
  int8_weight_only   int8 weight-only: an fp32 GEMM over the decoded weight vs ``torch._weight_int8pack_mm``
  sample_batch64     bench_quant's sampler, batch 64, vocab 4096: inverse CDF vs ``torch.multinomial``

A second table, ``chunks``: quantising every linear weight of the 22M model to nvfp4 and to int8 with the
row-chunk size (``CHUNK_ELEMENTS`` of ``asyncrl.quant.e2m1`` and ``asyncrl.quant.int8``) at 2**14..2**19
elements, each against the size the code uses (2**18).

Usage: ``python scripts/bench_kernels.py [--quick] [--smoke] [--rounds N] [--json PATH]`` (about two
minutes; ``--quick`` under one; ``--smoke`` seconds, small shapes, figures meaningless).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

from asyncrl.bench.measure import interleaved, load_average_stats, ratio_stats  # noqa: E402
from asyncrl.bench.report import parser, print_table, write_json  # noqa: E402

CHOSEN_CHUNK_LOG2 = 18
CHUNK_LOG2 = (14, 15, 16, 17, 18, 19)


def build_parser():
    p = parser("bench_kernels", __doc__, smoke=True)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per row (default 9, quick 5, smoke 1)")
    return p


def timer(fn: Callable[[], object], calls: int) -> Callable[[], float]:
    """A path for ``interleaved``: seconds per call of ``fn``, the mean of ``calls`` calls."""
    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls
    return run


def pairs(smoke: bool) -> list[tuple[str, str, str, str, Callable[[], object], Callable[[], object], int]]:
    """(row, shape, chosen, alternative, chosen fn, alternative fn, calls per timing); each pair is checked
    to compute the same values first."""
    import torch

    from asyncrl.quant import fp4, int8

    g = torch.Generator().manual_seed(0)
    n, k = (64, 64) if smoke else (2816, 512)  # an MLP weight of the 22M Qwen2
    sm_k, sm_n = (64, 96) if smoke else (576, 1536)  # a SmolLM2-135M MLP projection
    w = torch.randn(n, k, generator=g)
    blocks = w.view(n, k // 16, 16)
    scales = torch.rand(n, k // 16, generator=g)
    scales[::7] = 0.0
    inf = torch.tensor(float("inf"))
    act = torch.randn(64, sm_k, generator=g)
    one = torch.tensor(1.0)
    a8 = torch.randn(16, sm_k, generator=g).to(torch.float8_e4m3fn)
    w8 = torch.randn(sm_n, sm_k, generator=g).to(torch.float8_e4m3fn)
    a8f, w8f_t = a8.float(), w8.float().t().contiguous()
    xw = torch.randn(16, sm_k, generator=g)
    wq = torch.randint(-127, 128, (sm_n, sm_k), generator=g, dtype=torch.int8)
    sw = torch.rand(sm_n, generator=g) + 0.5
    wq_dec_t = (wq.float() * sw[:, None]).t().contiguous()
    logits = torch.randn(64, 4096 if not smoke else 256, generator=g)

    def absmax_rows_split():
        return torch.maximum(w.amax(dim=1), w.amin(dim=1).neg_()).abs_()

    def absmax_rows_aminmax():
        lo, hi = torch.aminmax(w, dim=1)
        return torch.maximum(hi, lo.neg()).abs_()

    def amax_blocks_aminmax():
        lo, hi = torch.aminmax(blocks, dim=2)
        return torch.maximum(hi, lo.neg())

    def inverse_cdf():
        cdf = torch.log_softmax(logits, dim=-1).exp_().cumsum_(dim=-1)
        return torch.searchsorted(cdf, torch.rand(cdf.shape[0], 1) * cdf[:, -1:]).clamp_(max=cdf.shape[1] - 1)

    def multinomial():
        return torch.multinomial(torch.log_softmax(logits, dim=-1).exp_(), 1)

    shape_w, shape_sm = f"[{n}, {k}]", f"M=16 K={sm_k} N={sm_n}"
    return [
        ("fp4_block_amax", f"{shape_w} in 16-element blocks", "integer max of bit patterns", "aminmax(dim=2)",
         lambda: fp4._block_amax(blocks), amax_blocks_aminmax, 5),
        ("fp4_zero_to_inf", f"[{n}, {k // 16}] block scales", "four integer passes", "masked_fill_(s == 0, inf)",
         lambda: fp4._zero_to_inf(scales.clone()), lambda: scales.clone().masked_fill_(scales == 0, inf), 20),
        ("all_finite", shape_w, "aminmax", "isfinite(t).all()",
         lambda: int8.all_finite(w), lambda: bool(torch.isfinite(w).all()), 5),
        ("int8_row_absmax", shape_w, "amax and amin per row", "aminmax(dim=1)",
         absmax_rows_split, absmax_rows_aminmax, 3),
        ("int8_row_absmax", shape_w, "amax and amin per row", "abs().amax(dim=1)",
         absmax_rows_split, lambda: w.abs().amax(dim=1), 5),
        ("int8_act_amax", f"M=64 K={sm_k}", "abs().amax(dim=1)", "vector_norm(inf, dim=1)",
         lambda: int8.row_amax(act), lambda: torch.linalg.vector_norm(act, float("inf"), dim=1, keepdim=True), 50),
        ("fp8_gemm", shape_sm, "fp32 mm of decoded codes", "torch._scaled_mm",
         lambda: torch.mm(a8f, w8f_t),
         lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32), 3),
        *int8_gemm_rows(g, sm_k, sm_n),
        ("int8_weight_only", shape_sm, "fp32 mm of the decoded weight", "torch._weight_int8pack_mm",
         lambda: torch.mm(xw, wq_dec_t), lambda: torch._weight_int8pack_mm(xw, wq, sw), 20),
        ("sample_batch64", f"[64, {logits.shape[1]}] logits", "inverse CDF", "torch.multinomial",
         inverse_cdf, multinomial, 20),
    ]


def int8_gemm_rows(g, k: int, n: int) -> list[tuple[str, str, str, str, Callable[[], object], Callable[[], object], int]]:
    """The W8A8 GEMM at M = 1 and 16 on SmolLM2's up (K=576) and down (K=1536) projections: the kernel
    ``select_kernel`` picks on this CPU against every other int8 kernel that runs here (all give the same int32
    sums) and against an fp32 GEMM of the same shape (``torch.mm``, what a full-precision actor runs)."""
    import torch

    from asyncrl.quant import int8
    from asyncrl.quant.cpu_int8 import int_mm_avx2, kernel_status
    from asyncrl.quant.kernels import select_kernel

    rows = []
    for m in (1, 16):
        for kk, nn in ((k, n), (n, k)):
            a = torch.randint(-127, 128, (m, kk), generator=g, dtype=torch.int8)
            w = torch.randint(-127, 128, (nn, kk), generator=g, dtype=torch.int8)
            af, wf = a.float(), w.float()
            paths = {"int_mm": lambda a=a, w=w: int8.int_mm(a, w.t()),
                     "int_mm_fp32": lambda af=af, wf=wf: int8.int_mm_fp32(af, wf.t()),
                     "fp32 GEMM": lambda af=af, wf=wf: torch.mm(af, wf.t())}
            if kernel_status() == "":
                paths["int_mm_avx2"] = lambda a=a, w=w: int_mm_avx2(a, w)
            chosen = select_kernel("int8", torch.device("cpu"), nn, kk)
            for other in paths:
                if other != chosen:
                    rows.append(("int8_gemm", f"M={m} K={kk} N={nn}", chosen, other, paths[chosen], paths[other],
                                 200 if m == 1 else 20))
    return rows


def check_same(row: str, chosen: Callable[[], object], alternative: Callable[[], object]) -> None:
    """Both paths compute the same values (the sampler rows draw different tokens, so only their shape agrees)."""
    import torch

    a, b = chosen(), alternative()
    if row == "sample_batch64":
        same = a.shape == b.shape
    elif isinstance(a, bool):
        same = a == b
    else:  # bit-identical, or (the GEMMs: fp32 sums in another order) within 1e-5 of the largest magnitude
        a, b = a.float().reshape(b.shape), b.float()
        same = torch.equal(a, b) or bool((a - b).abs().max() <= 1e-5 * b.abs().max())
    if not same:
        raise RuntimeError(f"{row}: the chosen path and the alternative disagree; the comparison would mean nothing")


def bench_pairs(rounds: int, smoke: bool) -> list[dict]:
    rows = []
    for row, shape, chosen_name, alt_name, chosen, alt, calls in pairs(smoke):
        check_same(row, chosen, alt)
        calls = 1 if smoke else calls
        got = interleaved({"chosen": timer(chosen, calls), "alternative": timer(alt, calls)}, rounds)
        st = ratio_stats(got["values"]["alternative"], got["values"]["chosen"])
        rows.append({"row": row, "shape": shape, "chosen": chosen_name, "alternative": alt_name,
                     "chosen_us": min(got["values"]["chosen"]) * 1e6, "alternative_us": min(got["values"]["alternative"]) * 1e6,
                     "alt_over_chosen": st["ratio_median"], "ratio_min": st["ratio_min"], "ratio_max": st["ratio_max"],
                     "spread": st["spread"], **load_average_stats(got["load"])})
        print(f"{row:18s} {alt_name} / {chosen_name}: {st['ratio_median']:.2f}x "
              f"[{st['ratio_min']:.2f}, {st['ratio_max']:.2f}]", flush=True)
    return rows


def bench_chunks(rounds: int, smoke: bool) -> list[dict]:
    """Quantise every linear weight of the 22M model (smoke: two small matrices) per chunk size."""
    import torch

    from asyncrl.quant import e2m1, fp4, int8

    if smoke:
        weights = [torch.randn(64, 128), torch.randn(96, 64)]
    else:
        from asyncrl.bench.models import build_qwen2_22m

        weights = [p.detach() for name, p in build_qwen2_22m(0).named_parameters() if p.dim() == 2 and "embed" not in name]
    quantizers = {"nvfp4": fp4.quantize_nvfp4, "int8": int8.quantize_int8_rows}
    scratch_defaults, chunk_defaults = e2m1.Scratch.__init__.__defaults__, int8.row_chunks.__defaults__

    def path(fmt: str, log2: int) -> Callable[[], float]:
        def run() -> float:
            e2m1.Scratch.__init__.__defaults__ = (1 << log2,)
            int8.row_chunks.__defaults__ = (1 << log2,)
            try:
                t0 = time.perf_counter()
                for wt in weights:
                    quantizers[fmt](wt)
                return time.perf_counter() - t0
            finally:
                e2m1.Scratch.__init__.__defaults__, int8.row_chunks.__defaults__ = scratch_defaults, chunk_defaults
        return run

    rows = []
    for fmt in quantizers:
        got = interleaved({log2: path(fmt, log2) for log2 in CHUNK_LOG2}, rounds)
        chosen = got["values"][CHOSEN_CHUNK_LOG2]
        for log2 in CHUNK_LOG2:
            st = ratio_stats(got["values"][log2], chosen)
            rows.append({"format": fmt, "chunk_log2": log2, "best_ms": min(got["values"][log2]) * 1e3,
                         "vs_chosen": st["ratio_median"], "ratio_min": st["ratio_min"], "ratio_max": st["ratio_max"],
                         **load_average_stats(got["load"])})
        print(f"{fmt} chunks: " + ", ".join(f"2**{r['chunk_log2']} {r['vs_chosen']:.2f}x" for r in rows
                                             if r["format"] == fmt), flush=True)
    return rows


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rounds = args.rounds or (1 if args.smoke else 5 if args.quick else 9)
    pair_rows = bench_pairs(rounds, args.smoke)
    chunk_rows = bench_chunks(rounds, args.smoke)
    print_table(f"chosen CPU path vs the alternative (median of {rounds} interleaved rounds; one thread)",
                pair_rows, ["row", "shape", "chosen", "alternative", "chosen_us", "alternative_us",
                                     "alt_over_chosen", "ratio_min", "ratio_max"])
    print_table("quantising the 22M model per row-chunk size (vs_chosen: time / time at 2**18)", chunk_rows,
                ["format", "chunk_log2", "best_ms", "vs_chosen", "ratio_min", "ratio_max"])
    write_json(args.json, "bench_kernels", {"pairs": pair_rows, "chunks": chunk_rows}, args,
               rounds=rounds, torch=torch.__version__, threads=torch.get_num_threads())
    return 0


if __name__ == "__main__":
    sys.exit(main())
