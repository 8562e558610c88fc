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
 * Loops: four rows of b at a time (read from memory once, kept in L1 while every row pair of a passes over
 * them), two rows of a per pass (each loaded b vector serves both); leftover rows and columns run the same
 * arithmetic one at a time, and K % 32 is finished in scalar code.
 */
#include <immintrin.h>
#include <stdint.h>

static inline int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* acc += sum over the 32 lanes of a * b, given ub = |b| (unsigned) and the b vector for its sign. */
#define DOT(acc, av, ub, bv) \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ub, _mm256_sign_epi8(av, bv)), ones))

static int32_t dot_tail(const int8_t *a, const int8_t *b, int64_t k0, int64_t K) {
    int32_t s = 0;
    for (int64_t k = k0; k < K; k++) s += (int32_t)a[k] * (int32_t)b[k];
    return s;
}

/* Rows m0..m1 of a against one row of b: out column n. */
static void one_column(const int8_t *a, const int8_t *b, int32_t *out, int64_t M, int64_t K, int64_t lda,
                       int64_t ldo) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t K32 = K & ~(int64_t)31;
    for (int64_t m = 0; m < M; m++) {
        const int8_t *x = a + m * lda;
        __m256i c = _mm256_setzero_si256();
        for (int64_t k = 0; k < K32; k += 32) {
            __m256i bv = _mm256_loadu_si256((const __m256i *)(b + k));
            __m256i av = _mm256_loadu_si256((const __m256i *)(x + k));
            DOT(c, av, _mm256_sign_epi8(bv, bv), bv);
        }
        out[m * ldo] = hsum8(c) + dot_tail(x, b, K32, K);
    }
}

void asyncrl_int8_gemm(const int8_t *a, const int8_t *b, int32_t *out, int64_t M, int64_t N, int64_t K,
                       int64_t lda, int64_t ldb, int64_t ldo) {
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
            int32_t *o = out + m * ldo + n, *p = o + ldo;
            o[0] = hsum8(c0) + dot_tail(x, b0, K32, K);
            o[1] = hsum8(c1) + dot_tail(x, b1, K32, K);
            o[2] = hsum8(c2) + dot_tail(x, b2, K32, K);
            o[3] = hsum8(c3) + dot_tail(x, b3, K32, K);
            p[0] = hsum8(d0) + dot_tail(y, b0, K32, K);
            p[1] = hsum8(d1) + dot_tail(y, b1, K32, K);
            p[2] = hsum8(d2) + dot_tail(y, b2, K32, K);
            p[3] = hsum8(d3) + dot_tail(y, b3, K32, K);
        }
        for (int64_t j = 0; j < 4 && m < M; j++)  /* an odd last row of a */
            one_column(a + m * lda, b + (n + j) * ldb, out + m * ldo + n + j, M - m, K, lda, ldo);
    }
    for (; n < N; n++)  /* the last N % 4 rows of b */
        one_column(a, b + n * ldb, out + n, M, K, lda, ldo);
}
