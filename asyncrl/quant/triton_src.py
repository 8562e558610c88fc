"""Triton kernel bodies of asyncrl/quant/triton_kernels.py (which documents the rules and launches them).

These are plain Python functions, not yet ``triton.jit``-decorated: triton_kernels.py decorates them when it
first needs them, so whether they compile for a GPU or run under Triton's interpreter (``TRITON_INTERPRET=1``)
is read at that moment, not when this module is imported. Only triton_kernels.py imports this module, and only
where the ``triton`` package is installed.

Only builtins of ``triton.language`` are called (``tl.full``, not ``tl.zeros``; ``tl.reduce`` with the combine
function of ``tl.max``, which the interpreter recognises, not ``tl.max``): the library's own jit functions are
decorated when triton is first imported, so under an interpreter turned on later they would still be compiled-
mode functions the interpreter cannot call.

Every conversion that must give fixed bits is written as integer operations on the fp32 bit pattern (bf16 and
E4M3 rounding, E2M1 / E4M3 / E8M0 decoding) and every division as ``div_rn``: Triton's ``/`` is an approximate
division on a GPU, its float casts are not round-to-nearest-even under the interpreter, and neither has FP8
types on every architecture. The results are then the same on a GPU and under the interpreter.
"""

import triton.language as tl


def wo_gemm_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, M, N, K, KS, stride_xm, stride_xk, stride_wn,
                   stride_sn, stride_ym,
                   FMT: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, BF16_DOT: tl.constexpr, OUT_BF16: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, n] = sum_k bf16(x[m, k]) * bf16(W[n, k]) (+ bias[n]), fp32 accumulation, W decoded in registers.

    FMT 0 int8_wo: w_ptr int8 codes [N, K], s_ptr fp32 [N]; W = fp32(code * s[n]).
    FMT 1 nvfp4: w_ptr uint8 packed [N, KS/2], s_ptr uint8 (E4M3 bytes) [N, KS/16], gs_ptr fp32 [];
                 W = fp32(e2m1(code) * fp32(e4m3(sb) * gs)).
    FMT 2 mxfp4: w_ptr uint8 packed [N, KS/2], s_ptr uint8 (E8M0 bytes) [N, KS/32]; W = e2m1(code) * 2**(b-127).
    K is the logical in_features (x's columns), KS the stored columns (K padded to the block for fp4).
    BF16_DOT: tl.dot on bf16 operands (a GPU's tensor cores); else on the same bf16 values held in fp32
    (the interpreter, whose dot does not take bf16): the same exact products either way.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    if FMT == 1:
        gs = tl.load(gs_ptr)
    if FMT == 0:
        srow = tl.load(s_ptr + rn, mask=n_ok, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # bf16 rounding (to nearest, ties to even) on the fp32 pattern; the result is exact in bf16
        xu = x.to(tl.float32).to(tl.uint32, bitcast=True)
        xb = ((xu + 0x7FFF + ((xu >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        if FMT == 0:
            c = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            w = c.to(tl.float32) * srow[:, None]
        else:
            # packed bytes of columns [k0, k0 + BLOCK_K): byte j holds element 2j (low nibble) and 2j+1 (high)
            rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            byte = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :],
                           mask=n_ok[:, None] & (rb[None, :] * 2 < KS), other=0).to(tl.uint32)
            codes = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_N, BLOCK_K))  # element order
            mag = codes & 7
            # E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 as fp32 bits: m >= 2 is 2**((m >> 1) - 1) * (1 + (m & 1) / 2)
            bits = tl.where(mag >= 2, (((mag >> 1) + 126) << 23) | ((mag & 1) << 22),
                            tl.where(mag == 1, 0x3F000000, 0))
            v = (bits | ((codes & 8) << 28)).to(tl.float32, bitcast=True)
            sb = tl.load(s_ptr + rn[:, None] * stride_sn + rk[None, :] // BLOCK,
                         mask=n_ok[:, None] & (rk[None, :] < KS), other=0).to(tl.uint32)
            if FMT == 1:  # E4M3 byte (a non-negative block scale) -> fp32, subnormals mant * 2**-9
                e = (sb >> 3) & 0xF
                mt = sb & 7
                s = tl.where(e == 0, mt.to(tl.float32) * 0.001953125,
                             (((e + 120) << 23) | (mt << 20)).to(tl.float32, bitcast=True))
                w = v * (s * gs)
            else:  # E8M0 biased exponent b -> 2**(b - 127); b == 0 is the subnormal 2**-127
                s = tl.where(sb > 0, sb << 23, 0x400000).to(tl.float32, bitcast=True)
                w = v * s
        wu = w.to(tl.uint32, bitcast=True)
        wb = ((wu + 0x7FFF + ((wu >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        if BF16_DOT:
            acc += tl.dot(xb.to(tl.bfloat16), tl.trans(wb.to(tl.bfloat16)))
        else:
            acc += tl.dot(xb, tl.trans(wb), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if OUT_BF16:  # round to nearest even on the pattern (the interpreter's cast truncates)
        au = acc.to(tl.uint32, bitcast=True)
        acc = ((au + 0x7FFF + ((au >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, QMAX: tl.constexpr, FP8: tl.constexpr,
                     BLOCK: tl.constexpr):
    """One row: s = max(fp32(amax / QMAX), 2**-126); int8 codes rne(fp32(x / s)) (QMAX 127), or E4M3 bytes
    e4m3_rne(clamp(fp32(x / s), -448, 448)) (QMAX 448, FP8). Two passes over the row (amax, then codes)."""
    row = tl.program_id(0)
    xrow = x_ptr + row * stride_xm
    amax = tl.full((BLOCK,), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        x = tl.load(xrow + rk, mask=rk < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x))
    # tl.max's own reduction, named directly (see the module docstring)
    scale = tl.maximum(tl.math.div_rn(tl.reduce(amax, 0, tl.standard._elementwise_max), QMAX),
                       1.1754943508222875e-38)  # 2**-126
    tl.store(s_ptr + row, scale)
    qrow = q_ptr + row * K
    for k0 in range(0, K, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        x = tl.load(xrow + rk, mask=rk < K, other=0.0)
        v = tl.math.div_rn(x, tl.broadcast_to(scale, (BLOCK,)))
        if FP8:
            v = tl.minimum(tl.maximum(v, -448.0), 448.0)
            u = v.to(tl.uint32, bitcast=True)
            a = u & 0x7FFFFFFF
            # normal E4M3 (|v| >= 2**-6): the fp32 pattern rounded to 3 mantissa bits, rebiased (127 - 7) << 3
            normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
            # below 2**-6: the multiple of 2**-9 nearest |v| (ties to even) is the code itself (8 = 2**-6)
            sub = ((a.to(tl.float32, bitcast=True) * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
            code = tl.where(a >= 0x3C800000, normal, sub) | ((u >> 24) & 0x80)
            tl.store(qrow + rk, code.to(tl.uint8), mask=rk < K)
        else:
            r = (v + 12582912.0) - 12582912.0  # 1.5 * 2**23: fp32 addition rounds |v| <= 127 to an integer, RNE
            tl.store(qrow + rk, r.to(tl.int8), mask=rk < K)
