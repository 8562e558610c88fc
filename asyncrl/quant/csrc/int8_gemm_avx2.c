/* Exact int8 x int8 -> int32 GEMM for x86 CPUs with AVX2 and no int8 dot-product instruction.
 *
 * out[m, n] = sum_k a[m, k] * b[n, k]   a: [M, K] activation codes in [-127, 127] (row stride lda),
 *                                        b: [N, K] weight codes, any int8 (row stride ldb),
 *                                        out: [M, N] int32 (row stride ldo).
 *
 * Each 32-byte step takes |b| as unsigned bytes and moves b's sign onto a (vpsignb), so that vpmaddubsw
 * multiplies u8 x s8 pairs: |b| <= 128 and |a| <= 127 make every pair sum at most 2 * 128 * 127 = 32512, below
 * int16's saturation; vpmaddwd against ones widens the pairs to int32 and the sums add in int32. So the result is
 * the exact integer sum (that of torch._int_mm), whatever the order, while it fits int32: K up to 133143 for
 * weight codes in [-127, 127] (int8.INT8_MAX_K), 132104 with -128 among them.
 * (vpsignb zeroes a lane whose b is 0: its product is 0 either way.)
 *
 * asyncrl_int8_linear runs a whole W8A8 linear with that GEMM, as int8.py's rules in torch ops would, bit for bit:
 * the per-token activation quantization (scale = max(fp32(max|x| / 127), 2^-126), codes = rne(fp32(x / scale)):
 * IEEE division and round-to-nearest-even, as torch's CPU ops compute them) and the epilogue
 * y = fp32(fp32(fp32(acc) * sx) * sw) + bias, three correctly rounded operations (built with -ffp-contract=off:
 * never contracted into an FMA). A row holding a NaN gets a NaN scale, so its outputs are NaN, as in torch.
 *
 * Loops: four rows of b at a time (read from memory once, kept in L1 while every row pair of a passes over
 * them), two rows of a per pass (each loaded b vector serves both); leftover rows and columns run the same
 * arithmetic one at a time, and K % 32 is finished in scalar code.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* Where the sums go: int32 sums (y == NULL), or the epilogue's fp32 outputs. */
typedef struct {
    int32_t *acc;        /* [M, ldo] int32, or NULL */
    float *y;            /* [M, ldo] fp32, or NULL */
    const float *sx;     /* [M] per-row activation scales (epilogue) */
    const float *sw;     /* [N] per-column weight scales (epilogue) */
    const float *bias;   /* [N] or NULL (epilogue) */
    int64_t ldo;
} Out;

static inline void store(const Out *o, int64_t m, int64_t n, int32_t s) {
    if (o->y == NULL) {
        o->acc[m * o->ldo + n] = s;
        return;
    }
    float v = (float)s;
    v = v * o->sx[m];
    v = v * o->sw[n];
    if (o->bias != NULL) v = v + o->bias[n];
    o->y[m * o->ldo + n] = v;
}

/* acc += sum over the 32 lanes of a * b, given ub = |b| (unsigned) and the b vector for its sign. */
#define DOT(acc, av, ub, bv) \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ub, _mm256_sign_epi8(av, bv)), ones))

static int32_t dot_tail(const int8_t *a, const int8_t *b, int64_t k0, int64_t K) {
    int32_t s = 0;
    for (int64_t k = k0; k < K; k++) s += (int32_t)a[k] * (int32_t)b[k];
    return s;
}

/* Rows m0 .. M-1 of a against row n of b. */
static void one_column(const int8_t *a, const int8_t *b, const Out *out, int64_t m0, int64_t n, int64_t M,
                       int64_t K, int64_t lda) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t K32 = K & ~(int64_t)31;
    for (int64_t m = m0; m < M; m++) {
        const int8_t *x = a + m * lda;
        __m256i c = _mm256_setzero_si256();
        for (int64_t k = 0; k < K32; k += 32) {
            __m256i bv = _mm256_loadu_si256((const __m256i *)(b + k));
            __m256i av = _mm256_loadu_si256((const __m256i *)(x + k));
            DOT(c, av, _mm256_sign_epi8(bv, bv), bv);
        }
        store(out, m, n, hsum8(c) + dot_tail(x, b, K32, K));
    }
}

static void gemm(const int8_t *a, const int8_t *b, const Out *out, int64_t M, int64_t N, int64_t K, int64_t lda,
                 int64_t ldb) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t K32 = K & ~(int64_t)31;
    int64_t n = 0;
    for (; n + 4 <= N; n += 4) {
        const int8_t *b0 = b + n * ldb, *b1 = b0 + ldb, *b2 = b1 + ldb, *b3 = b2 + ldb;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            const int8_t *x = a + m * lda, *y = x + lda;
            __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, d0 = c0, d1 = c0, d2 = c0, d3 = c0;
            for (int64_t k = 0; k < K32; k += 32) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(x + k));
                __m256i yv = _mm256_loadu_si256((const __m256i *)(y + k));
                __m256i bv, ub;
                bv = _mm256_loadu_si256((const __m256i *)(b0 + k)); ub = _mm256_sign_epi8(bv, bv);
                DOT(c0, xv, ub, bv); DOT(d0, yv, ub, bv);
                bv = _mm256_loadu_si256((const __m256i *)(b1 + k)); ub = _mm256_sign_epi8(bv, bv);
                DOT(c1, xv, ub, bv); DOT(d1, yv, ub, bv);
                bv = _mm256_loadu_si256((const __m256i *)(b2 + k)); ub = _mm256_sign_epi8(bv, bv);
                DOT(c2, xv, ub, bv); DOT(d2, yv, ub, bv);
                bv = _mm256_loadu_si256((const __m256i *)(b3 + k)); ub = _mm256_sign_epi8(bv, bv);
                DOT(c3, xv, ub, bv); DOT(d3, yv, ub, bv);
            }
            store(out, m, n, hsum8(c0) + dot_tail(x, b0, K32, K));
            store(out, m, n + 1, hsum8(c1) + dot_tail(x, b1, K32, K));
            store(out, m, n + 2, hsum8(c2) + dot_tail(x, b2, K32, K));
            store(out, m, n + 3, hsum8(c3) + dot_tail(x, b3, K32, K));
            store(out, m + 1, n, hsum8(d0) + dot_tail(y, b0, K32, K));
            store(out, m + 1, n + 1, hsum8(d1) + dot_tail(y, b1, K32, K));
            store(out, m + 1, n + 2, hsum8(d2) + dot_tail(y, b2, K32, K));
            store(out, m + 1, n + 3, hsum8(d3) + dot_tail(y, b3, K32, K));
        }
        for (int64_t j = 0; j < 4 && m < M; j++)  /* an odd last row of a */
            one_column(a, b + (n + j) * ldb, out, m, n + j, M, K, lda);
    }
    for (; n < N; n++)  /* the last N % 4 rows of b */
        one_column(a, b + n * ldb, out, 0, n, M, K, lda);
}

/* out[m, n] = sum_k a[m, k] * b[n, k] as int32 (row stride ldo). */
void asyncrl_int8_gemm(const int8_t *a, const int8_t *b, int32_t *out, int64_t M, int64_t N, int64_t K,
                       int64_t lda, int64_t ldb, int64_t ldo) {
    Out o = {out, NULL, NULL, NULL, NULL, ldo};
    gemm(a, b, &o, M, N, K, lda, ldb);
}

#define INT8_QMAX 127.0f
#define MIN_SCALE 0x1p-126f /* the smallest normal fp32: floor of every row scale (int8.MIN_SCALE) */

/* Per-token int8 codes q [M, K] (row stride K) and scales sx [M] of x [M, K] (row stride ldx). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int8_t *q, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * ldx;
        __m256 vmax = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
        for (int64_t k = 0; k < K8; k += 8) {
            __m256 v = _mm256_loadu_ps(r + k);
            vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        float amax = 0.0f;
        for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
        int nan = _mm256_movemask_ps(vnan) != 0;
        for (int64_t k = K8; k < K; k++) {
            float a = fabsf(r[k]);
            nan |= a != a;
            amax = a > amax ? a : amax;
        }
        float s = nan ? NAN : amax / INT8_QMAX;
        if (s < MIN_SCALE) s = MIN_SCALE;  /* a NaN stays */
        sx[m] = s;
        const __m256 vs = _mm256_set1_ps(s);
        int8_t *qr = q + m * K;
        for (int64_t k = 0; k < K8; k += 8) {
            __m256 c = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(r + k), vs),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m256i i32 = _mm256_cvtps_epi32(c);
            __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
            _mm_storel_epi64((__m128i *)(qr + k), _mm_packs_epi16(i16, i16));
        }
        for (int64_t k = K8; k < K; k++) {
            float c = nearbyintf(r[k] / s);
            qr[k] = c == c ? (int8_t)c : 0;
        }
    }
}

/* y [M, N] (row stride ldy) = the W8A8 linear of x [M, K] (row stride ldx) with weight codes w [N, K] (row
 * stride ldw), scales sw [N] and bias [N] (or NULL). q: scratch of M * K bytes; sx: [M], the row scales. */
void asyncrl_int8_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, int64_t N, int64_t ldw,
                         const float *sw, const float *bias, int8_t *q, float *sx, float *y, int64_t ldy) {
    quantize_rows(x, M, K, ldx, q, sx);
    Out o = {NULL, y, sx, sw, bias, ldy};
    gemm(q, w, &o, M, N, K, K, ldw);
}
