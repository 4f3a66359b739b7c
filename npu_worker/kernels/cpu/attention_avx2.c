/* The attention's inner loops on CPUs with AVX2 and FMA but no AVX-512 (built with kernels.c
   into one library, which calls them from `attend_row`). Without them the attention runs the
   portable loops, which the compiler vectorizes with the sums in memory: 0.06-0.13 of the
   memory's speed on such a CPU (bench/RESULTS.md). Here the sums stay in registers, and
   each runs in one fixed order that depends only on its own row: a key's 64 products in 8
   lanes, then one tree of the lanes; a value channel's sum in order of the keys. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#define KEYS 8 /* keys a block: their sums in 8 registers, then one vector of 8 scores */
#define VALUE_QUERIES 3 /* queries a pass over the values: 3 x 4 sums in registers */

/* lane i: the sum of a[i]'s 8 lanes, by one fixed tree (pairs, then pairs of pairs, then the
   two 128-bit halves) */
static inline __m256 sum8(const __m256 *a) {
    __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}

/* channels c..c+15 of a key or value row as two float32 vectors: bfloat16 (dtype 1) as the
   even channels (a 32-bit word's low half, shifted up) and the odd ones (its high half,
   masked); float32 as they lie */
static inline void load16x2(const char *row, int dtype, int c, __m256 *first, __m256 *second) {
    if (dtype == 1) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(row + (size_t)c * 2));
        *first = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        *second = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        *first = _mm256_loadu_ps((const float *)row + c);
        *second = _mm256_loadu_ps((const float *)row + c + 8);
    }
}

/* q [64] float32 in the order load16x2 gives a row's channels */
static void arrange_query(const float *q, int dtype, float *out) {
    if (dtype == 0) {
        memcpy(out, q, 64 * sizeof(float));
        return;
    }
    for (int c = 0; c < 64; c += 16)
        for (int w = 0; w < 8; w++) {
            out[c + w] = q[c + 2 * w];
            out[c + 8 + w] = q[c + 2 * w + 1];
        }
}

/* q . key for `m` keys at `row`, `row + step`, ... (zeros past m), as one vector */
static inline __attribute__((always_inline)) __m256 score_block(const float *qa, const char *row,
                                                                size_t step, int dtype,
                                                                const int m) {
    __m256 acc[KEYS];
    for (int i = 0; i < KEYS; i++) acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < 64; c += 16) {
        __m256 q0 = _mm256_loadu_ps(qa + c), q1 = _mm256_loadu_ps(qa + c + 8);
        for (int i = 0; i < m; i++) {
            __m256 k0, k1;
            load16x2(row + i * step, dtype, c, &k0, &k1);
            acc[i] = _mm256_fmadd_ps(q0, k0, acc[i]);
            acc[i] = _mm256_fmadd_ps(q1, k1, acc[i]);
        }
    }
    return sum8(acc);
}

/* scores[t] = scale * q . key t for t < n: a query (float32 [64]) against a head's keys 64
   channels wide, `k_step` elements apart */
void score_keys64_avx2(const float *q, int n, const char *k, int64_t k_step, int dtype,
                       float scale, float *scores) {
    size_t step = (size_t)k_step * (dtype == 0 ? 4 : 2);
    const __m256 scaled = _mm256_set1_ps(scale);
    float qa[64], tail[KEYS];
    arrange_query(q, dtype, qa);
    int t = 0;
    for (; t + KEYS <= n; t += KEYS)
        _mm256_storeu_ps(scores + t,
                         _mm256_mul_ps(score_block(qa, k + t * step, step, dtype, KEYS), scaled));
    if (t == n) return;
    int m = n - t;
    __m256 last;
    switch (m) {
        case 1: last = score_block(qa, k + t * step, step, dtype, 1); break;
        case 2: last = score_block(qa, k + t * step, step, dtype, 2); break;
        case 3: last = score_block(qa, k + t * step, step, dtype, 3); break;
        case 4: last = score_block(qa, k + t * step, step, dtype, 4); break;
        case 5: last = score_block(qa, k + t * step, step, dtype, 5); break;
        case 6: last = score_block(qa, k + t * step, step, dtype, 6); break;
        default: last = score_block(qa, k + t * step, step, dtype, 7); break;
    }
    _mm256_storeu_ps(tail, _mm256_mul_ps(last, scaled));
    memcpy(scores + t, tail, (size_t)m * sizeof(float));
}

/* 32 channels of `NQ` queries' weighted sums over keys 0..n, in order of the keys, into
   acc (rows `acc_step` apart, in channel order); value t is row t % block of v[t / block],
   from byte `offset` on */
static inline __attribute__((always_inline)) void values32(const float *p, int64_t p_step,
                                                           const int NQ, int n,
                                                           const char *const *v, int block,
                                                           size_t offset, size_t v_step,
                                                           int dtype, float *acc,
                                                           int64_t acc_step) {
    __m256 a[VALUE_QUERIES][4];
    for (int j = 0; j < NQ; j++)
        for (int c = 0; c < 4; c++) a[j][c] = _mm256_setzero_ps();
    const char *run = n > 0 ? v[0] + offset : NULL; /* this block's rows */
    for (int t = 0, at = 0; t < n; t++, at++) {
        if (at == block) run = v[t / block] + offset, at = 0;
        const char *row = run + at * v_step;
        for (int h = 0; h < 2; h++) {
            __m256 x0, x1;
            load16x2(row, dtype, 16 * h, &x0, &x1);
            for (int j = 0; j < NQ; j++) {
                __m256 w = _mm256_broadcast_ss(p + j * p_step + t);
                a[j][2 * h] = _mm256_fmadd_ps(w, x0, a[j][2 * h]);
                a[j][2 * h + 1] = _mm256_fmadd_ps(w, x1, a[j][2 * h + 1]);
            }
        }
    }
    for (int j = 0; j < NQ; j++)
        for (int h = 0; h < 2; h++) {
            float *dst = acc + j * acc_step + 16 * h;
            __m256 x0 = a[j][2 * h], x1 = a[j][2 * h + 1];
            if (dtype == 1) { /* evens and odds back into channel order */
                __m256 lo = _mm256_unpacklo_ps(x0, x1), hi = _mm256_unpackhi_ps(x0, x1);
                x0 = _mm256_permute2f128_ps(lo, hi, 0x20);
                x1 = _mm256_permute2f128_ps(lo, hi, 0x31);
            }
            _mm256_storeu_ps(dst, x0);
            _mm256_storeu_ps(dst + 8, x1);
        }
}

/* acc[j][0..vdim) = sum over t < n of p[j][t] * value t, for `nq` queries; vdim a multiple
   of 32, value t row t % block of block v[t / block], rows `v_step` elements apart */
void weigh_values_avx2(const float *p, int64_t p_step, int nq, int n, const char *const *v,
                       int block, int64_t v_step, int dtype, int vdim, float *acc) {
    size_t elem = dtype == 0 ? 4 : 2, step = (size_t)v_step * elem;
    for (int d0 = 0; d0 < vdim; d0 += 32)
        for (int j = 0; j < nq; j += VALUE_QUERIES) {
            const float *pj = p + j * p_step;
            size_t at = d0 * elem;
            float *out = acc + (size_t)j * vdim + d0;
            switch (nq - j) {
                case 1: values32(pj, p_step, 1, n, v, block, at, step, dtype, out, vdim); break;
                case 2: values32(pj, p_step, 2, n, v, block, at, step, dtype, out, vdim); break;
                default: values32(pj, p_step, 3, n, v, block, at, step, dtype, out, vdim); break;
            }
        }
}
#endif
