/* The CPU kernels of npu-pool (library.py builds this file with the system's C compiler
   and calls it through ctypes): attention over the KV cache that reads each query's own
   keys once (its scores and value sums on AMX tiles where the CPU has them:
   attention_amx.c), RoPE with
   the K/V writes, and RMSNorm. Every sum runs in one fixed order that depends only on its
   own row, so a row's results do not depend on what shares its launch. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"
#ifdef __AVX512F__
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_ATTENTION 1 /* attention_avx2.c */
void score_keys64_avx2(const float *q, int n, const char *k, int64_t k_step, int dtype,
                       float scale, float *scores);
void weigh_values_avx2(const float *p, int64_t p_step, int nq, int n, const char *const *v,
                       int block, int64_t v_step, int dtype, int vdim, float *acc);
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define HAVE_AMX_ATTENTION 1 /* attention_amx.c */
int amx_request(void);
void amx_begin(void);
void amx_end(void);
void amx_scores(const uint16_t *qh, int nq, int first, int group, const int64_t *limit,
                int longest, const char *const *k, int64_t table_step, int common, int block,
                int64_t k_step, int dim, float scale, float *scores, uint32_t *qt,
                uint16_t *scratch, float *turn);
void amx_values(const float *p, int nq, int first, int group, const int64_t *limit,
                int longest, const char *const *v, int64_t table_step, int common, int block,
                int64_t v_step, int vdim, float *acc, uint16_t *pairs, uint16_t *pa,
                float *sums, const uint16_t *packed, int packed_keys);
void *amx_packs_new(int heads, int keys, int blocks, int vdim, size_t budget);
void amx_packs_free(void *handle);
int amx_pack(void *handle, int head, const char *const *v, int wanted, int block,
             int64_t v_step, int vdim, const uint16_t **pairs);
#define PACKED_VALUES_BYTES ((size_t)8 << 20) /* a thread's values packed once for its tasks */
#endif

#define LANES 16
#define MAX_QUERIES 4 /* queries a pass over a row's values serves (their sums in registers) */

/* keys and values are float32 (dtype 0) or bfloat16 (dtype 1): a bfloat16 is the top half
   of a float32, so widening one is a shift */
static inline const float *widen(const char *src, int dtype, int n, float *dst) {
    if (dtype == 0) return (const float *)src;
    const uint16_t *h = (const uint16_t *)src;
    for (int i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)h[i] << 16;
        memcpy(dst + i, &bits, sizeof(float));
    }
    return dst;
}

/* a . b over 16 lanes of partial sums, then one fixed tree of them */
static inline float dot_lanes(const float *a, const float *b, int n) {
    float part[LANES] = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; l++) part[l] += a[d + l] * b[d + l];
    for (int l = 0; d < n; d++, l++) part[l] += a[d] * b[d];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) part[l] += part[l + width];
    return part[0];
}

/* a . b: independent partial sums, then one fixed order of adding them */
static inline float dot(const float *a, const float *b, int n) {
#ifdef __AVX512F__
    if (n % 32 == 0) {
        __m512 even = _mm512_setzero_ps(), odd = even;
        for (int d = 0; d < n; d += 32) {
            even = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), even);
            odd = _mm512_fmadd_ps(_mm512_loadu_ps(a + d + 16), _mm512_loadu_ps(b + d + 16), odd);
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    }
#endif
    return dot_lanes(a, b, n);
}

/* e^x for x <= 0 (softmax after subtracting the maximum), as straight-line arithmetic the
   compiler vectorizes: x = k ln2 + r (|r| <= ln2 / 2), e^r by its Taylor polynomial, 2^k
   into the exponent */
static inline float exp_nonpositive(float x) {
    x = x > -87.0f ? x : -87.0f;
    float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - k * 0.693145752f - k * 1.42860677e-6f;
    float p = fmaf(r, 0.00138888892f, 0.00833333377f); /* Horner, fused (-ffp-contract=off) */
    p = fmaf(p, r, 0.0416666679f);
    p = fmaf(p, r, 0.166666672f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(float));
    return p * scale;
}

#ifdef __AVX512F__
/* softmax numerators of row[0..n) in place, zeros on to `width`; returns their sum: 16
   lanes at a time, key t in lane t % 16, then one fixed tree of the lanes */
static float softmax_row(float *row, int n, int width) {
    float top[LANES], part[LANES];
    __m512 most16 = _mm512_set1_ps(-INFINITY), sum16 = _mm512_setzero_ps();
    __m512 tops[4] = {most16, most16, most16, most16}; /* four chains: the maximum is the
                                                          same whatever the order */
    int t = 0;
    for (; t + 4 * LANES <= n; t += 4 * LANES) /* row > top ? row : top, lane by lane */
        for (int c = 0; c < 4; c++)
            tops[c] = _mm512_max_ps(_mm512_loadu_ps(row + t + c * LANES), tops[c]);
    for (; t + LANES <= n; t += LANES) tops[0] = _mm512_max_ps(_mm512_loadu_ps(row + t), tops[0]);
    most16 = _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
    __mmask16 tail = (__mmask16)((1u << (n - t)) - 1);
    most16 = _mm512_mask_max_ps(most16, tail, _mm512_maskz_loadu_ps(tail, row + t), most16);
    _mm512_storeu_ps(top, most16);
    float most = top[0];
    for (int l = 1; l < LANES; l++) most = top[l] > most ? top[l] : most;
    const __m512 m = _mm512_set1_ps(most);
    for (t = 0; t + LANES <= n; t += LANES) {
        __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row + t), m));
        _mm512_storeu_ps(row + t, e);
        sum16 = _mm512_add_ps(sum16, e);
    }
    if (t < n) {
        __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + t), m));
        _mm512_mask_storeu_ps(row + t, tail, e);
        sum16 = _mm512_mask_add_ps(sum16, tail, sum16, e);
    }
    for (t = n; t < width; t++) row[t] = 0.0f;
    _mm512_storeu_ps(part, sum16);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) part[l] += part[l + w];
    return part[0];
}
#else
/* softmax numerators of row[0..n) in place, zeros on to `width`; returns their sum */
static float softmax_row(float *row, int n, int width) {
    float top[LANES], part[LANES] = {0};
    for (int l = 0; l < LANES; l++) top[l] = -INFINITY;
    int t = 0;
    for (; t + LANES <= n; t += LANES)
        for (int l = 0; l < LANES; l++) top[l] = row[t + l] > top[l] ? row[t + l] : top[l];
    for (int l = 0; t < n; t++, l++) top[l] = row[t] > top[l] ? row[t] : top[l];
    float most = top[0];
    for (int l = 1; l < LANES; l++) most = top[l] > most ? top[l] : most;
    for (t = 0; t < n; t++) row[t] = exp_nonpositive(row[t] - most);
    for (t = n; t < width; t++) row[t] = 0.0f;
    for (t = 0; t + LANES <= n; t += LANES)
        for (int l = 0; l < LANES; l++) part[l] += row[t + l];
    for (int l = 0; t < n; t++, l++) part[l] += row[t];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) part[l] += part[l + width];
    return part[0];
}
#endif

#ifdef __AVX512F__
/* 16 channels of a value row, widened to float32 */
static inline __m512 load16(const char *row, int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)row);
    __m256i half = _mm256_loadu_si256((const __m256i *)row);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

/* acc[j][0..vdim) = sum over t < n of p[j][t] * value t, in order of t, for `nq` (at most
   MAX_QUERIES) queries in one pass over the values: each value row is read once, and the
   sums stay in registers (AVX-512: 64 channels a pass). Value t is row t % block of block
   v[t / block] (rows `v_step` elements apart): the cache's blocks, in the request's order */
static void weigh_values(const float *p, int64_t p_step, int nq, int n, const char *const *v,
                         int block, int64_t v_step, int dtype, int vdim, float *acc,
                         float *wide) {
    size_t elem = dtype == 0 ? 4 : 2;
    int d0 = 0;
#ifdef __AVX512F__
    if (dtype == 1) /* a 32-bit word holds channels 2w (low half) and 2w + 1 (high half): a
                       shift and a mask widen 32 channels, evens and odds in two vectors */
        for (; d0 + 64 <= vdim; d0 += 64) {
            const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
            __m512 a[MAX_QUERIES][4];
            for (int j = 0; j < MAX_QUERIES; j++)
                for (int c = 0; c < 4; c++) a[j][c] = _mm512_setzero_ps();
            const char *run = n > 0 ? v[0] + (size_t)d0 * 2 : NULL; /* this block's rows */
            for (int t = 0, at = 0; t < n; t++, at++) {
                if (at == block) run = v[t / block] + (size_t)d0 * 2, at = 0;
                const char *row = run + (size_t)at * v_step * 2;
                __m512i w0 = _mm512_loadu_si512(row), w1 = _mm512_loadu_si512(row + 64);
                __m512 x[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)),
                               _mm512_castsi512_ps(_mm512_and_si512(w0, high)),
                               _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)),
                               _mm512_castsi512_ps(_mm512_and_si512(w1, high))};
                for (int j = 0; j < MAX_QUERIES; j++) {
                    if (j >= nq) break;
                    __m512 w = _mm512_set1_ps(p[j * p_step + t]);
                    for (int c = 0; c < 4; c++) a[j][c] = _mm512_fmadd_ps(w, x[c], a[j][c]);
                }
            }
            /* evens and odds back into channel order: lane m of the first 16 is channel m,
               lane m / 2 of the evens (m even) or of the odds (m odd, index + 16) */
            const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                                   17, 1, 16, 0);
            const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
            for (int j = 0; j < nq; j++)
                for (int c = 0; c < 4; c += 2) {
                    float *dst = acc + j * vdim + d0 + 16 * c;
                    _mm512_storeu_ps(dst, _mm512_permutex2var_ps(a[j][c], first, a[j][c + 1]));
                    _mm512_storeu_ps(dst + 16,
                                     _mm512_permutex2var_ps(a[j][c], second, a[j][c + 1]));
                }
        }
#endif
#ifdef __AVX512F__
    for (; d0 + 64 <= vdim; d0 += 64) {
        __m512 a[MAX_QUERIES][4];
        for (int j = 0; j < MAX_QUERIES; j++)
            for (int c = 0; c < 4; c++) a[j][c] = _mm512_setzero_ps();
        const char *run = n > 0 ? v[0] + (size_t)d0 * elem : NULL;
        for (int t = 0, at = 0; t < n; t++, at++) {
            if (at == block) run = v[t / block] + (size_t)d0 * elem, at = 0;
            const char *row = run + (size_t)at * v_step * elem;
            __m512 x[4];
            for (int c = 0; c < 4; c++) x[c] = load16(row + 16 * c * elem, dtype);
            for (int j = 0; j < MAX_QUERIES; j++) {
                if (j >= nq) break;
                __m512 w = _mm512_set1_ps(p[j * p_step + t]);
                for (int c = 0; c < 4; c++) a[j][c] = _mm512_fmadd_ps(w, x[c], a[j][c]);
            }
        }
        for (int j = 0; j < nq; j++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + j * vdim + d0 + 16 * c, a[j][c]);
    }
#endif
    if (d0 == vdim) return;
    for (int j = 0; j < nq; j++) memset(acc + j * vdim + d0, 0, sizeof(float) * (vdim - d0));
    for (int t = 0; t < n; t++) {
        const float *value =
            widen(v[t / block] + (size_t)(t % block) * v_step * elem, dtype, vdim, wide);
        for (int j = 0; j < nq; j++)
            for (int d = d0; d < vdim; d++) acc[j * vdim + d] += p[j * p_step + t] * value[d];
    }
}

#ifdef __AVX512F__
/* Sums of 16 vectors' lanes, as one vector (lane i: the sum of a[i]'s lanes), by one fixed
   tree: pairs of lanes, then of pairs, then of 128-bit quarters, so a key's sum does not
   depend on its neighbours. The steps are separate so a caller can build the tree as its
   partial sums arrive. */
static inline __m512 pair_lanes(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
static inline __m512 pair_pairs(__m512 a, __m512 b) {
    __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b));
    __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b));
    return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
}
static inline __m512 pair_quarters(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
static inline __m512 sum16(const __m512 *a) {
    __m512 c[4];
    for (int i = 0; i < 4; i++)
        c[i] = pair_pairs(pair_lanes(a[4 * i], a[4 * i + 1]),
                          pair_lanes(a[4 * i + 2], a[4 * i + 3]));
    return pair_quarters(pair_quarters(c[0], c[1]), pair_quarters(c[2], c[3]));
}

/* float32 keys: each key row loaded once for all `nq` queries (held in registers), one
   horizontal sum per query and key; four loads a key cost more than the sums */
static void score_keys64_f32(const float *q, int nq, const int *n, int longest, const char *k,
                             int64_t k_step, float scale, float *scores) {
    __m512 qv[MAX_QUERIES][4];
    for (int j = 0; j < MAX_QUERIES; j++)
        for (int c = 0; c < 4; c++)
            qv[j][c] = j < nq ? _mm512_loadu_ps(q + j * 64 + 16 * c) : _mm512_setzero_ps();
    int most = 0; /* keys any of the queries sees */
    for (int j = 0; j < nq; j++) most = n[j] > most ? n[j] : most;
    for (int t = 0; t < most; t++) {
        const float *row = (const float *)k + (size_t)t * k_step;
        __m512 x[4];
        for (int c = 0; c < 4; c++) x[c] = _mm512_loadu_ps(row + 16 * c);
        for (int j = 0; j < MAX_QUERIES; j++) {
            if (j >= nq) break;
            if (t >= n[j]) continue;
            __m512 even = _mm512_fmadd_ps(qv[j][2], x[2], _mm512_mul_ps(qv[j][0], x[0]));
            __m512 odd = _mm512_fmadd_ps(qv[j][3], x[3], _mm512_mul_ps(qv[j][1], x[1]));
            float sum = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
            scores[(size_t)j * longest + t] = sum * scale;
        }
    }
}

#ifdef __AVX512BF16__
/* 16 lanes whose sum is q . key for 64 bfloat16 channels (pairs multiplied, float32 sums) */
static inline __m512 dot64_bf16(__m512bh q0, __m512bh q1, const char *row) {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_loadu_si512(row));
    return _mm512_dpbf16_ps(acc, q1, (__m512bh)_mm512_loadu_si512(row + 64));
}

/* q . key for the four keys at `row`, `row + step`, ..., summed as `sum16` sums them */
static inline __m512 four_keys(__m512bh q0, __m512bh q1, const char *row, size_t step) {
    __m512 b0 = pair_lanes(dot64_bf16(q0, q1, row), dot64_bf16(q0, q1, row + step));
    __m512 b1 = pair_lanes(dot64_bf16(q0, q1, row + 2 * step), dot64_bf16(q0, q1, row + 3 * step));
    return pair_pairs(b0, b1);
}

/* bfloat16 keys: scores of `nq` queries (bfloat16 [nq, 64]) against keys 0..n[j], 16 keys a
   block with no horizontal sum per key: the same tree as `sum16`, so the same bits. With
   `v`, the first query's pass fetches each block's value rows while it scores the keys: in
   a whole launch they come from memory, and the value pass after the softmax then finds
   them in cache. */
static void score_keys64(const uint16_t *qh, int nq, const int *n, int longest, const char *k,
                         int64_t k_step, float scale, float *scores, const char *v,
                         int64_t v_step) {
    size_t step = (size_t)k_step * 2;
    const __m512 scaled = _mm512_set1_ps(scale);
    for (int j = 0; j < nq; j++) {
        __m512bh q0 = (__m512bh)_mm512_loadu_si512(qh + j * 64);
        __m512bh q1 = (__m512bh)_mm512_loadu_si512(qh + j * 64 + 32);
        float *out = scores + (size_t)j * longest;
        int t0 = 0;
        for (; t0 + LANES <= n[j]; t0 += LANES) {
            const char *row = k + (size_t)t0 * step;
            if (j == 0 && v != NULL)
                for (int i = 0; i < LANES; i++) {
                    const char *value = v + (size_t)(t0 + i) * v_step * 2;
                    _mm_prefetch(value, _MM_HINT_T0);
                    _mm_prefetch(value + 64, _MM_HINT_T0);
                }
            __m512 d0 = pair_quarters(four_keys(q0, q1, row, step),
                                      four_keys(q0, q1, row + 4 * step, step));
            __m512 d1 = pair_quarters(four_keys(q0, q1, row + 8 * step, step),
                                      four_keys(q0, q1, row + 12 * step, step));
            _mm512_storeu_ps(out + t0, _mm512_mul_ps(pair_quarters(d0, d1), scaled));
        }
        if (t0 < n[j]) { /* the last keys, the rest of the block's lanes zeros */
            int m = n[j] - t0;
            __m512 part[LANES];
            for (int i = 0; i < LANES; i++)
                part[i] = i < m ? dot64_bf16(q0, q1, k + (size_t)(t0 + i) * step)
                                : _mm512_setzero_ps();
            _mm512_mask_storeu_ps(out + t0, (__mmask16)((1u << m) - 1),
                                  _mm512_mul_ps(sum16(part), scaled));
        }
    }
}
#endif
#endif

/* float32 to bfloat16, rounding to nearest even (as torch does) */
static inline uint16_t narrow(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof(float));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* n float32s to bfloat16, as `narrow` rounds each (16 at a time where the CPU has AVX-512) */
static void narrow_row(const float *src, uint16_t *dst, int n) {
    int d = 0;
#ifdef __AVX512F__
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i quiet = _mm512_set1_epi32(0x7fc0);
    for (; d + LANES <= n; d += LANES) {
        __m512 x = _mm512_loadu_ps(src + d);
        __m512i bits = _mm512_castps_si512(x);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
        __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(bias, odd));
        __m512i rounded = _mm512_srli_epi32(up, 16);
        rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), quiet);
        _mm256_storeu_si256((__m256i *)(dst + d), _mm512_cvtepi32_epi16(rounded));
    }
#endif
    for (; d < n; d++) dst[d] = narrow(src[d]);
}

/* one (row, KV head): its `queries` query vectors [queries, dim] (S positions x the heads
   of its group; `q` widened to float32, `qh` as stored when that is bfloat16), position
   s's queries seeing keys 0..limit[s]-1; key (value) t is row t % block of k[t / block]
   (v[t / block]), rows `k_step` (`v_step`) elements apart. With `table_step` > 0 (on AMX
   tiles only) position s reads its own table, k[s * table_step + t / block], the first
   `common` blocks the same for all. Each key's score is its own dot product and each value
   sum runs in order of t, so where the blocks lie changes no bit. The outputs go to `out`
   in the cache's dtype */
static void attend_row(const float *q, const uint16_t *qh, int queries, const int64_t *limit,
                       int seq, int group, const char *const *k, const char *const *v,
                       int64_t table_step, int common, int block, int64_t k_step,
                       int64_t v_step, int dtype, int dim, int vdim, float scale, char *out,
                       int64_t out_seq_step, int64_t out_head_step, float *work, int amx,
                       void *packs, int head) {
    int longest = 0;
    for (int s = 0; s < seq; s++) if (limit[s] > longest) longest = (int)limit[s];
    size_t elem = dtype == 0 ? 4 : 2;
    float *wide = work, *scores = work + dim + vdim;
    float *acc = scores + (size_t)queries * (longest > 0 ? longest : 1);
    float *total = acc + (size_t)queries * vdim;
    int t = 0;
    (void)qh; /* read only where the CPU multiplies bfloat16 pairs */
    (void)amx, (void)packs, (void)head;
#ifdef HAVE_AMX_ATTENTION
    if (amx) { /* bfloat16 keys of 32-192 channels: 16 queries a tile product */
        uint32_t *qt = (uint32_t *)(total + queries);
        uint16_t *scratch = (uint16_t *)(qt + 6 * 256);
        float *turn = (float *)(scratch + 16 * dim);
        for (int i = 0; i < queries; i += 16) {
            int nq = queries - i < 16 ? queries - i : 16;
            amx_scores(qh + (size_t)i * dim, nq, i, group, limit, longest, k, table_step,
                       common, block, k_step, dim, scale, scores + (size_t)i * longest, qt,
                       scratch, turn);
        }
        t = longest;
    }
#endif
#ifdef __AVX512F__
#ifdef __AVX512BF16__
    int blocked = dim == 64;
#else
    int blocked = dim == 64 && dtype == 0; /* bfloat16 keys take the portable loop below */
#endif
    if (blocked && t == 0) {
        for (int i = 0; i < queries; i += MAX_QUERIES) {
            int nq = queries - i < MAX_QUERIES ? queries - i : MAX_QUERIES, n[MAX_QUERIES];
            for (int t0 = 0; t0 < longest; t0 += block) { /* a block's keys: theirs */
                for (int j = 0; j < nq; j++) {
                    int left = (int)limit[(i + j) / group] - t0;
                    n[j] = left < 0 ? 0 : left < block ? left : block;
                }
                const char *keys = k[t0 / block];
                float *at = scores + (size_t)i * longest + t0;
#ifdef __AVX512BF16__
                if (dtype == 1)
                    score_keys64(qh + (size_t)i * dim, nq, n, longest, keys, k_step, scale, at,
                                 i == 0 ? v[t0 / block] : NULL, v_step);
                else
#endif
                    score_keys64_f32(q + (size_t)i * dim, nq, n, longest, keys, k_step, scale,
                                     at);
            }
        }
        t = longest;
    }
#elif defined(HAVE_AVX2_ATTENTION)
    if (dim == 64) {
        for (int i = 0; i < queries; i++)
            for (int t0 = 0; t0 < limit[i / group]; t0 += block) {
                int left = (int)limit[i / group] - t0;
                score_keys64_avx2(q + (size_t)i * dim, left < block ? left : block,
                                  k[t0 / block], k_step, dtype, scale,
                                  scores + (size_t)i * longest + t0);
            }
        t = longest;
    }
#endif
    for (; t < longest; t++) {
        const float *key =
            widen(k[t / block] + (size_t)(t % block) * k_step * elem, dtype, dim, wide);
        for (int s = 0; s < seq; s++) {
            if (t >= limit[s]) continue;
            for (int i = s * group; i < (s + 1) * group; i++)
                scores[(size_t)i * longest + t] = dot(q + (size_t)i * dim, key, dim) * scale;
        }
    }
    for (int s = 0; s < seq; s++)
        for (int i = s * group; i < (s + 1) * group; i++)
            total[i] = softmax_row(scores + (size_t)i * longest, (int)limit[s], longest);
#ifdef HAVE_AMX_ATTENTION
    if (amx && vdim % 32 == 0) { /* numerators as two bfloat16s by 32 keys' values */
        uint16_t *pairs = (uint16_t *)(total + queries) + 2 * 6 * 256 + 16 * (size_t)dim + 512;
        uint16_t *pa = pairs + 2048;
        float *sums = (float *)(pa + 1024);
        const uint16_t *packed = NULL;
        int packed_keys = 0, wanted = longest; /* the keys every position reads alike */
        if (table_step > 0) wanted = common * block < wanted ? common * block : wanted;
        if (packs && seq > 1 && wanted >= 32) /* positions alike: likely more tasks' too */
            packed_keys = amx_pack(packs, head, v, wanted, block, v_step, vdim, &packed);
        for (int i = 0; i < queries; i += 16) {
            int nq = queries - i < 16 ? queries - i : 16;
            amx_values(scores + (size_t)i * longest, nq, i, group, limit, longest, v,
                       table_step, common, block, v_step, vdim, acc + (size_t)i * vdim, pairs,
                       pa, sums, packed, packed_keys);
        }
    } else
#endif
#ifdef HAVE_AVX2_ATTENTION
    if (vdim % 32 == 0)
        weigh_values_avx2(scores, longest, queries, longest, v, block, v_step, dtype, vdim,
                          acc);
    else
#endif
    if (table_step > 0) /* each position's values through its own table, up to its own keys */
        for (int s = 0; s < seq; s++)
            for (int i = s * group; i < (s + 1) * group; i += MAX_QUERIES) {
                int nq = (s + 1) * group - i < MAX_QUERIES ? (s + 1) * group - i : MAX_QUERIES;
                weigh_values(scores + (size_t)i * longest, longest, nq, (int)limit[s],
                             v + s * table_step, block, v_step, dtype, vdim,
                             acc + (size_t)i * vdim, wide + dim);
            }
    else
        for (int i = 0; i < queries; i += MAX_QUERIES) {
            int nq = queries - i < MAX_QUERIES ? queries - i : MAX_QUERIES;
            weigh_values(scores + (size_t)i * longest, longest, nq, longest, v, block, v_step,
                         dtype, vdim, acc + (size_t)i * vdim, wide + dim);
        }
    for (int s = 0; s < seq; s++)
        for (int g = 0; g < group; g++) {
            int i = s * group + g;
            size_t at = (size_t)(s * out_seq_step + g * out_head_step);
            float inv = total[i] > 0.0f ? 1.0f / total[i] : 0.0f;
            float *sums = acc + (size_t)i * vdim;
            if (dtype == 0)
                for (int d = 0; d < vdim; d++) ((float *)out)[at + d] = sums[d] * inv;
            else {
                for (int d = 0; d < vdim; d++) sums[d] *= inv;
                narrow_row(sums, (uint16_t *)out + at, vdim);
            }
        }
}

/* q [B, S, H, D] (heads and channels contiguous, tokens `q_row` elements apart: a slice of
   a fused projection's output) and out [B, S, H, Dv] (contiguous), in the cache's dtype;
   k, v: one layer's cache of blocks of `block` positions, strides in elements (block, head,
   position; channels contiguous); tables [B, width]: row b's positions p lie in block tables[b][p / block]
   (a cache of one block a slot: tables [B, 1], block its positions); positions [B, S]:
   query (b, s) sees its row's keys 0..positions[b, s], none when that is at or past
   `span` (a padding row's scratch position) */
int decode_attention(const void *q, int64_t q_row, const void *k, const void *v,
                     const int64_t *tables, int width, int block, const int64_t *positions, void *out, int batch,
                     int seq, int heads, int kv_heads, int dim, int vdim, int64_t k_slot,
                     int64_t k_head, int64_t k_pos, int64_t v_slot, int64_t v_head,
                     int64_t v_pos, int span, int dtype, float scale, int threads) {
    int group = heads / kv_heads, failed = 0;
    int blocks = span > 0 ? (span + block - 1) / block : 1; /* a row's blocks it reads */
    if (blocks > width) return 2;
    /* a task: one run of positions of one row and KV head. In decode a row's positions
       (S1, or S2 with MTP) are one run. A prefill launch passes each token as a row of its
       own (S1): consecutive rows that read the same blocks (one request's tokens) are one
       run of up to 16 queries, so they share their passes over the keys. A prefill row
       passed whole (S > 4) is split so each thread has about eight tasks, at least 16
       positions each. A query's scores and sums are its own, so how positions are grouped
       changes no bit. Tasks go to whichever thread is free next: a launch's rows differ in
       length (a prefill launch's padding, all at its end, reads nothing), and on a busy CPU
       one thread may be held up */
    int amx = 0;
#ifdef HAVE_AMX_ATTENTION
    amx = dtype == 1 && dim % 32 == 0 && dim <= 192 && amx_request();
#endif
    int *starts = malloc(((size_t)batch * seq + 1) * 2 * sizeof(int)), runs = 0;
    int *commons = starts + (size_t)batch * seq + 1, longest_run = 1, mixed = 0;
    if (!starts) return 1;
    if (seq == 1) {
        int most = group >= 16 ? 1 : 16 / group;
        for (int b = 0; b < batch;) {
            int m = 1, common = blocks;
            while (m < most && b + m < batch) {
                const int64_t *mine = tables + (size_t)(b + m) * width;
                int same = 0; /* leading blocks this row shares with the run's first */
                while (same < blocks && mine[same] == tables[(size_t)b * width + same]) same++;
                /* the same blocks; on AMX tiles, rows that share their first blocks (a
                   cached prefix) too, each reading its own after them */
                if (same < blocks && !(amx && same > 0)) break;
                common = same < common ? same : common;
                m++;
            }
            mixed |= common < blocks;
            commons[runs] = common;
            starts[runs++] = b;
            b += m;
            longest_run = m > longest_run ? m : longest_run;
        }
    } else {
        int parts = 1, rows = batch * kv_heads;
        if (threads > 1) {
            parts = (8 * threads + rows - 1) / rows;
            int most = (seq + 15) / 16;
            parts = parts < most ? parts : most;
        }
        int per = (seq + parts - 1) / parts;
        for (int b = 0; b < batch; b++)
            for (int s0 = 0; s0 < seq; s0 += per)
                commons[runs] = blocks, starts[runs++] = b * seq + s0;
        longest_run = per;
    }
    starts[runs] = batch * seq;
    size_t elem = dtype == 0 ? 4 : 2;
    int queries = longest_run * group; /* a task's most */
    size_t work_floats = dim + vdim + (size_t)queries * (span > 0 ? span : 1)
                         + (size_t)queries * (vdim + 1) + 6 * 256 + 8 * (size_t)dim + 256
                         + (amx ? 2560 + 64 : 0); /* amx_values: pairs, numerators, sums */
    #pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        float *work = malloc(work_floats * sizeof(float));
        float *qrow = malloc((size_t)queries * dim * sizeof(float));
        uint16_t *qh = malloc((size_t)queries * dim * sizeof(uint16_t));
        int64_t *limit = malloc((size_t)longest_run * sizeof(int64_t));
        size_t tables_read = (size_t)blocks * (mixed ? longest_run : 1);
        const char **kb = malloc(tables_read * 2 * sizeof(char *)), **vb = kb + tables_read;
        if (!work || !qrow || !qh || !limit || !kb) failed = 1;
        void *packs = NULL;
#ifdef HAVE_AMX_ATTENTION
        if (amx) amx_begin();
        if (amx && vdim % 32 == 0)
            packs = amx_packs_new(kv_heads, span, blocks, vdim, PACKED_VALUES_BYTES);
#endif
        #pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < runs * kv_heads; task++) {
            if (!work || !qrow || !qh || !limit || !kb) continue;
            int r = task / kv_heads, h = task % kv_heads;
            int first = starts[r], n = starts[r + 1] - first; /* positions first.. of [B*S] */
            int b = first / seq;
            for (int s = 0; s < n; s++) {
                int64_t position = positions[first + s];
                limit[s] = position < span ? position + 1 : 0;
            }
            for (int s = 0; s < n; s++)
                for (int g = 0; g < group; g++) {
                    size_t i = (size_t)s * group + g;
                    const char *src = (const char *)q
                        + (((size_t)first + s) * q_row + ((size_t)h * group + g) * dim) * elem;
                    if (dtype == 0) {
                        memcpy(qrow + i * dim, src, sizeof(float) * dim);
                    } else {
                        memcpy(qh + i * dim, src, sizeof(uint16_t) * dim);
                        widen(src, dtype, dim, qrow + i * dim);
                    }
                }
            int common = commons[r], own = common < blocks ? n : 1; /* tables read */
            for (int s = 0; s < own; s++)
                for (int j = 0; j < blocks; j++) { /* where the blocks of this head lie */
                    int64_t at = tables[(size_t)(b + s) * width + j];
                    size_t kat = (size_t)(at * k_slot + h * k_head);
                    size_t vat = (size_t)(at * v_slot + h * v_head);
                    kb[s * blocks + j] = (const char *)k + kat * elem;
                    vb[s * blocks + j] = (const char *)v + vat * elem;
                }
            char *o = (char *)out + ((size_t)first * heads + h * group) * vdim * elem;
            attend_row(qrow, qh, n * group, limit, n, group, kb, vb, own > 1 ? blocks : 0,
                       common, block, k_pos, v_pos, dtype, dim, vdim, scale, o,
                       (int64_t)heads * vdim, vdim, work, amx, packs, h);
        }
#ifdef HAVE_AMX_ATTENTION
        if (amx) amx_end();
        amx_packs_free(packs);
#endif
        free(kb);
        free(work);
        free(qrow);
        free(qh);
        free(limit);
    }
    free(starts);
    return failed;
}

/* x[0..dim) rotated in place (rotate-half RoPE): x * cos + cat(-x2, x1) * sin, each product
   and sum rounded as torch rounds them (no fused multiply-adds: -ffp-contract=off), then
   narrowed to the tensor's dtype; `wide` holds 2 * dim floats */
static void rotate_row(const char *src, char *dst, int dtype, int dim, const float *cos,
                       const float *sin, float *wide) {
    float *x = wide, *y = wide + dim; /* a copy: src may be dst */
    if (dtype == 0) memcpy(x, src, sizeof(float) * dim);
    else widen(src, dtype, dim, x);
    int half = dim / 2;
    for (int d = 0; d < half; d++) y[d] = x[d] * cos[d] + -x[d + half] * sin[d];
    for (int d = half; d < dim; d++) y[d] = x[d] * cos[d] + x[d - half] * sin[d];
    if (dtype == 0) memcpy(dst, y, sizeof(float) * dim);
    else narrow_row(y, (uint16_t *)dst, dim);
}

/* A launch's queries rotated in place, its keys rotated into the cache, its values copied
   into it: token t [tokens] writes slot slots[t] at position positions[t]. q [tokens, heads,
   dim], k and v [tokens, kv_heads, dim] in the cache's dtype, heads and channels contiguous,
   tokens `q_row`, `k_row`, `v_row` elements apart (so they may be slices of one fused
   projection); cos and sin [tokens, dim] float32; cache strides in elements (slot, head,
   position) */
int rope_store(void *q, const void *k, const void *v, const float *cos, const float *sin,
               const int64_t *slots, const int64_t *positions, void *k_cache, void *v_cache,
               int tokens, int heads, int kv_heads, int dim, int64_t q_row, int64_t k_row,
               int64_t v_row, int64_t k_slot, int64_t k_head, int64_t k_pos, int64_t v_slot,
               int64_t v_head, int64_t v_pos, int dtype) {
    size_t elem = dtype == 0 ? 4 : 2, row = (size_t)dim * elem;
    float *wide = malloc((size_t)dim * sizeof(float) * 2);
    if (!wide) return 1;
    for (int t = 0; t < tokens; t++) {
        const float *c = cos + (size_t)t * dim, *s = sin + (size_t)t * dim;
        for (int h = 0; h < heads; h++) {
            char *x = (char *)q + (size_t)t * q_row * elem + (size_t)h * row;
            rotate_row(x, x, dtype, dim, c, s, wide);
        }
        for (int h = 0; h < kv_heads; h++) {
            int64_t kat = slots[t] * k_slot + h * k_head + positions[t] * k_pos;
            int64_t vat = slots[t] * v_slot + h * v_head + positions[t] * v_pos;
            const char *key = (const char *)k + (size_t)t * k_row * elem + (size_t)h * row;
            const char *value = (const char *)v + (size_t)t * v_row * elem + (size_t)h * row;
            rotate_row(key, (char *)k_cache + (size_t)kat * elem, dtype, dim, c, s, wide);
            memcpy((char *)v_cache + (size_t)vat * elem, value, row);
        }
    }
    free(wide);
    return 0;
}

/* out = weight * narrow(x * 1 / sqrt(mean(x^2) + eps)) for each of `rows` rows of `size`
   (RMSNorm as Llama's reference computes it: float32 statistics, the normalised row rounded
   to the tensor's dtype before the weight); x, weight and out in the same dtype. The sum of
   squares runs over 16 lanes, then one fixed tree of them. */
int rms_norm(const void *x, const void *weight, void *out, int rows, int size, float eps,
             int dtype) {
    float *wide = malloc((size_t)size * sizeof(float) * 3);
    uint16_t *half = malloc((size_t)size * sizeof(uint16_t));
    if (!wide || !half) {
        free(wide);
        free(half);
        return 1;
    }
    float *w = wide + size, *scaled = wide + 2 * (size_t)size;
    if (dtype == 0) memcpy(w, weight, sizeof(float) * size);
    else widen((const char *)weight, dtype, size, w);
    size_t elem = dtype == 0 ? 4 : 2;
    for (int r = 0; r < rows; r++) {
        const char *src = (const char *)x + (size_t)r * size * elem;
        const float *h = dtype == 0 ? (const float *)src : widen(src, dtype, size, wide);
        float inv = 1.0f / sqrtf(dot_lanes(h, h, size) / (float)size + eps);
        char *dst = (char *)out + (size_t)r * size * elem;
        int d;
        if (dtype == 0)
            for (d = 0; d < size; d++) ((float *)dst)[d] = w[d] * (h[d] * inv);
        else { /* the normalised row rounded to bfloat16, then times the weight, rounded */
            for (d = 0; d < size; d++) scaled[d] = h[d] * inv;
            narrow_row(scaled, half, size);
            widen((const char *)half, dtype, size, scaled);
            for (d = 0; d < size; d++) scaled[d] = w[d] * scaled[d];
            narrow_row(scaled, (uint16_t *)dst, size);
        }
    }
    free(wide);
    free(half);
    return 0;
}
