/* bfloat16 linear layers of the CPU kernels' own (built with kernels.c into one library),
   for CPUs where oneDNN's bfloat16 products run below what float32 multiply-adds reach: on
   one Intel CPU without AMX, `vdpbf16ps` issues on one port where float32 multiply-adds
   have two (bench/RESULTS.md). The weight is packed once into blocks of 16 outputs x 2
   inputs (one 64-byte vector per pair of inputs), widened to float32 in registers, each
   output summed over its inputs in order by float32 multiply-adds and rounded to bfloat16
   once. That order depends on nothing but the output's own row, so a row's bits are the
   same for every number of rows, in prefill and decode alike. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define BLOCK 16   /* outputs a vector */
#define COLUMNS 3  /* vectors of outputs a pass: 48 outputs */
#define ROWS 8     /* rows a pass: ROWS x COLUMNS sums held in registers */
#define ROWS2 4    /* rows a pass of the 8-lane paths: 4 x 2 vectors of sums */

/* the packed size, in uint16, of an [outputs, inputs] weight */
int64_t packed_linear_size(int outputs, int inputs) {
    int64_t blocks = (outputs + BLOCK - 1) / BLOCK, pairs = (inputs + 1) / 2;
    return blocks * pairs * BLOCK * 2;
}

/* weight [outputs, inputs] bfloat16 (rows `stride` apart) into `packed`: block b, pair p
   holds outputs 16b..16b+15, each with its inputs 2p and 2p+1 side by side; past the edges,
   zeros */
void pack_linear(const uint16_t *weight, int outputs, int inputs, int64_t stride,
                 uint16_t *packed) {
    int blocks = (outputs + BLOCK - 1) / BLOCK, pairs = (inputs + 1) / 2;
    for (int b = 0; b < blocks; b++)
        for (int p = 0; p < pairs; p++)
            for (int lane = 0; lane < BLOCK; lane++)
                for (int e = 0; e < 2; e++) {
                    int o = b * BLOCK + lane, i = 2 * p + e;
                    uint16_t value = o < outputs && i < inputs ? weight[o * stride + i] : 0;
                    packed[(((int64_t)b * pairs + p) * BLOCK + lane) * 2 + e] = value;
                }
}

#ifdef HAVE_AVX512
/* rows 0..R of x [rows, inputs] (float32, `x_stride` a row) times the packed blocks
   b0..b0+C, into out (bfloat16, `out_stride` a row), `outputs` wide in all. A pair's vector
   holds 16 outputs' weights for inputs 2p (low halves) and 2p+1 (high halves): a shift and a
   mask make them float32, and float32 multiply-adds (two ports, where `vdpbf16ps` has one)
   add input 2p, then 2p+1, to each output's sum. `w` points at block b0. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride,
                                                       const uint16_t *w, int pairs, int b0,
                                                       const float *bias, uint16_t *out,
                                                       int64_t out_stride, int outputs,
                                                       const int R, const int C) {
    __m512 acc[ROWS][COLUMNS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const uint16_t *block[COLUMNS];
    for (int c = 0; c < C; c++) block[c] = w + (int64_t)c * pairs * BLOCK * 2;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int p = 0; p < pairs; p++) {
        __m512 even[COLUMNS], odd[COLUMNS];
        for (int c = 0; c < C; c++) {
            __m512i pair = _mm512_loadu_si512(block[c] + (int64_t)p * BLOCK * 2);
            even[c] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
            odd[c] = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
        }
        for (int r = 0; r < R; r++) {
            __m512 x0 = _mm512_set1_ps(x[r * x_stride + 2 * p]);
            __m512 x1 = _mm512_set1_ps(x[r * x_stride + 2 * p + 1]);
            for (int c = 0; c < C; c++) {
                acc[r][c] = _mm512_fmadd_ps(x0, even[c], acc[r][c]);
                acc[r][c] = _mm512_fmadd_ps(x1, odd[c], acc[r][c]);
            }
        }
    }
    for (int c = 0; c < C; c++) {
        int o = (b0 + c) * BLOCK, left = outputs - o;
        __mmask16 keep = left >= BLOCK ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias + o) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            __m256i half = narrow16(_mm512_add_ps(acc[r][c], add));
            _mm256_mask_storeu_epi16(out + r * out_stride + o, keep, half);
        }
    }
}

#define TILE_ROWS(R, C) \
    tile(x + (int64_t)r0 * x_stride, x_stride, w, pairs, b0, bias, out + (int64_t)r0 * out_stride, \
         out_stride, outputs, R, C)

/* rows r0..r0+rows (at most ROWS) of the C blocks from b0, `w` pointing at block b0 */

static void tile_rows(const float *x, int64_t x_stride, const uint16_t *w, int pairs, int b0,
                      const float *bias, uint16_t *out, int64_t out_stride, int outputs,
                      int r0, int rows, int C) {
#define CASE(R)                                   \
    case R:                                       \
        if (C == 3) TILE_ROWS(R, 3);              \
        else if (C == 2) TILE_ROWS(R, 2);         \
        else TILE_ROWS(R, 1);                     \
        break;
    switch (rows) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    }
#undef CASE
}
#endif

#if defined(HAVE_AVX512) || defined(HAVE_AVX2)
/* float32 to bfloat16 as narrow16 does, for 16 outputs in two vectors, into out */
static inline void narrow16x2(__m256 lo, __m256 hi, uint16_t *out, int left) {
    __m256i r[2];
    __m256 v[2] = {lo, hi};
    for (int h = 0; h < 2; h++) {
        __m256i bits = _mm256_castps_si256(v[h]);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
        __m256i rounded = _mm256_srli_epi32(up, 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v[h], v[h], _CMP_UNORD_Q));
        r[h] = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
    }
    /* packus works within 128-bit halves: [lo0-3, hi0-3, lo4-7, hi4-7], then reorder */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8);
    if (left >= BLOCK) {
        _mm256_storeu_si256((__m256i *)out, packed);
    } else {
        uint16_t lanes[BLOCK];
        _mm256_storeu_si256((__m256i *)lanes, packed);
        memcpy(out, lanes, (size_t)left * sizeof(uint16_t));
    }
}

/* R rows of sums for block b's 16 outputs, plus the bias, rounded to bfloat16 into out */
static inline void store_rows(__m256 acc[][2], int R, int b, const float *bias, uint16_t *out,
                              int64_t out_stride, int outputs) {
    int o = b * BLOCK, left = outputs - o;
    float add[BLOCK] = {0};
    if (bias)
        for (int k = 0; k < BLOCK && k < left; k++) add[k] = bias[o + k];
    __m256 add0 = _mm256_loadu_ps(add), add1 = _mm256_loadu_ps(add + 8);
    for (int r = 0; r < R; r++)
        narrow16x2(_mm256_add_ps(acc[r][0], add0), _mm256_add_ps(acc[r][1], add1),
                   out + r * out_stride + o, left);
}
#endif

#ifdef HAVE_AVX2
/* The AVX-512 path's arithmetic 8 lanes at a time: a block's 16 outputs are two vectors, and
   each output's sum takes input 2p, then 2p+1, by the same float32 multiply-adds, so every
   output gets the AVX-512 path's bits. 4 rows x 2 vectors of sums fit AVX2's 16 registers.
   `w` points at block b. */

static inline __attribute__((always_inline)) void tile2(const float *x, int64_t x_stride,
                                                        const uint16_t *w, int pairs, int b,
                                                        const float *bias, uint16_t *out,
                                                        int64_t out_stride, int outputs,
                                                        const int R) {
    __m256 acc[ROWS2][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int p = 0; p < pairs; p++) {
        const uint16_t *pair = w + (int64_t)p * BLOCK * 2;
        __m256i v0 = _mm256_loadu_si256((const __m256i *)pair);
        __m256i v1 = _mm256_loadu_si256((const __m256i *)(pair + BLOCK));
        __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));
        __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
        for (int r = 0; r < R; r++) {
            __m256 x0 = _mm256_set1_ps(x[r * x_stride + 2 * p]);
            __m256 x1 = _mm256_set1_ps(x[r * x_stride + 2 * p + 1]);
            acc[r][0] = _mm256_fmadd_ps(x0, even0, acc[r][0]);
            acc[r][0] = _mm256_fmadd_ps(x1, odd0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(x0, even1, acc[r][1]);
            acc[r][1] = _mm256_fmadd_ps(x1, odd1, acc[r][1]);
        }
    }
    store_rows(acc, R, b, bias, out, out_stride, outputs);
}

static void tile2_rows(const float *x, int64_t x_stride, const uint16_t *w, int pairs, int b,
                       const float *bias, uint16_t *out, int64_t out_stride, int outputs,
                       int r0, int rows) {
    const float *xr = x + (int64_t)r0 * x_stride;
    uint16_t *outr = out + (int64_t)r0 * out_stride;
    switch (rows) {
        case 1: tile2(xr, x_stride, w, pairs, b, bias, outr, out_stride, outputs, 1); break;
        case 2: tile2(xr, x_stride, w, pairs, b, bias, outr, out_stride, outputs, 2); break;
        case 3: tile2(xr, x_stride, w, pairs, b, bias, outr, out_stride, outputs, 3); break;
        default: tile2(xr, x_stride, w, pairs, b, bias, outr, out_stride, outputs, 4); break;
    }
}
#endif

#if defined(HAVE_AVX512) || defined(HAVE_AVX2)
/* x [rows, inputs] bfloat16 into wide [rows, width] float32, padded with a zero to even */
static void widen_rows(const uint16_t *x, int rows, int inputs, int64_t x_stride, float *wide,
                       int width) {
    for (int r = 0; r < rows; r++) {
        for (int i = 0; i < inputs; i++) {
            uint32_t bits = (uint32_t)x[(int64_t)r * x_stride + i] << 16;
            memcpy(wide + (int64_t)r * width + i, &bits, sizeof(float));
        }
        if (width > inputs) wide[(int64_t)r * width + inputs] = 0.0f;
    }
}
#endif

/* out [rows, outputs] = x [rows, inputs] times the packed weight (+ bias, float32), all
   bfloat16 but the bias; x's rows `x_stride` elements apart, out's `out_stride`. Returns
   nonzero where this build has neither AVX-512 (F and BW) nor AVX2 with FMA, or memory ran
   out. */
int linear_bf16(const uint16_t *x, int rows, int inputs, int64_t x_stride, const uint16_t *w,
                int outputs, const float *bias, uint16_t *out, int64_t out_stride, int threads) {
#ifdef HAVE_AVX512
    int pairs = (inputs + 1) / 2, blocks = (outputs + BLOCK - 1) / BLOCK;
    int groups = (blocks + COLUMNS - 1) / COLUMNS, width = 2 * pairs;
    float *wide = malloc((size_t)rows * width * sizeof(float)); /* x in float32, padded even */
    if (!wide) return 2;
    widen_rows(x, rows, inputs, x_stride, wide, width);
    /* column groups outer: each weight block comes from memory once for all the rows */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int g = 0; g < groups; g++) {
        int b0 = g * COLUMNS, C = blocks - b0 < COLUMNS ? blocks - b0 : COLUMNS;
        for (int r0 = 0; r0 < rows; r0 += ROWS) {
            int R = rows - r0 < ROWS ? rows - r0 : ROWS;
            tile_rows(wide, width, w + (int64_t)b0 * pairs * BLOCK * 2, pairs, b0, bias, out,
                      out_stride, outputs, r0, R, C);
        }
    }
    free(wide);
    return 0;
#elif defined(HAVE_AVX2)
    int pairs = (inputs + 1) / 2, blocks = (outputs + BLOCK - 1) / BLOCK, width = 2 * pairs;
    float *wide = malloc((size_t)rows * width * sizeof(float));
    if (!wide) return 2;
    widen_rows(x, rows, inputs, x_stride, wide, width);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < blocks; b++)
        for (int r0 = 0; r0 < rows; r0 += ROWS2) {
            int R = rows - r0 < ROWS2 ? rows - r0 : ROWS2;
            tile2_rows(wide, width, w + (int64_t)b * pairs * BLOCK * 2, pairs, b, bias, out,
                       out_stride, outputs, r0, R);
        }
    free(wide);
    return 0;
#else
    (void)x; (void)rows; (void)inputs; (void)x_stride; (void)w; (void)outputs; (void)bias;
    (void)out; (void)out_stride; (void)threads;
    return 1;
#endif
}

/* MXFP4 weights read as stored (DeepSeek-V4's routed experts): e2m1 values two a byte, the
   even input in the low nibble, and a UE8M0 power of two per 32 inputs. Laid out (by the
   caller) in blocks of 16 outputs: block b, pair p holds 16 bytes, output k's inputs 2p and
   2p+1; block b, group g holds the 16 outputs' scale bytes for inputs 32g..32g+31. Each
   value is widened in registers (a table of the 8 magnitudes, the sign bit, times its power
   of two: exact, and exactly the bfloat16 a dequantized copy holds), then summed as
   `linear_bf16` sums (input 2p, then 2p + 1, one chain a sum from zero), so the outputs
   have the bits of `linear_bf16` over the dequantized weight, at every row count. */
#if defined(HAVE_AVX512) || defined(HAVE_AVX2)
static inline __m256 fp4_widened(__m128i nibbles, __m256 table, __m256 scale) {
    __m256i index = _mm256_cvtepu8_epi32(nibbles); /* the low 8 bytes */
    __m256 magnitude = _mm256_permutevar8x32_ps(table, index); /* the low 3 bits */
    __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(index, 3), 31);
    return _mm256_mul_ps(_mm256_or_ps(magnitude, _mm256_castsi256_ps(sign)), scale);
}

static inline __m256 e8m0_widened(__m128i bytes) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(bytes), 23));
}

static inline __attribute__((always_inline)) void fp4_tile(const float *x, int64_t x_stride,
                                                           const uint8_t *w, const uint8_t *s,
                                                           int pairs, int b, const float *bias,
                                                           uint16_t *out, int64_t out_stride,
                                                           int outputs, const int R) {
    __m256 acc[ROWS2][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m128i low = _mm_set1_epi8(0x0f);
    __m256 scale0 = _mm256_setzero_ps(), scale1 = _mm256_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        if (p % 16 == 0) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(s + (int64_t)(p / 16) * BLOCK));
            scale0 = e8m0_widened(bytes);
            scale1 = e8m0_widened(_mm_srli_si128(bytes, 8));
        }
        __m128i raw = _mm_loadu_si128((const __m128i *)(w + (int64_t)p * BLOCK));
        __m128i evens = _mm_and_si128(raw, low), odds = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        __m256 even0 = fp4_widened(evens, table, scale0);
        __m256 even1 = fp4_widened(_mm_srli_si128(evens, 8), table, scale1);
        __m256 odd0 = fp4_widened(odds, table, scale0);
        __m256 odd1 = fp4_widened(_mm_srli_si128(odds, 8), table, scale1);
        for (int r = 0; r < R; r++) {
            __m256 x0 = _mm256_set1_ps(x[r * x_stride + 2 * p]);
            __m256 x1 = _mm256_set1_ps(x[r * x_stride + 2 * p + 1]);
            acc[r][0] = _mm256_fmadd_ps(x0, even0, acc[r][0]);
            acc[r][0] = _mm256_fmadd_ps(x1, odd0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(x0, even1, acc[r][1]);
            acc[r][1] = _mm256_fmadd_ps(x1, odd1, acc[r][1]);
        }
    }
    store_rows(acc, R, b, bias, out, out_stride, outputs);
}
#endif

/* 1 where this build has the MXFP4 product (AVX2 with FMA, or AVX-512) */
int mxfp4_available(void) {
#if defined(HAVE_AVX512) || defined(HAVE_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* out [rows, outputs] = x [rows, inputs] (bfloat16) times an MXFP4 weight laid out as
   above (`w`: blocks x inputs/2 x 16 bytes, `s`: blocks x inputs/32 x 16), plus the bias
   (float32), rounded to bfloat16 once. Nonzero: no such product in this build (1), memory
   ran out (2), inputs not a multiple of 32 (3). */
int linear_mxfp4(const uint16_t *x, int rows, int inputs, int64_t x_stride, const uint8_t *w,
                 const uint8_t *s, int outputs, const float *bias, uint16_t *out,
                 int64_t out_stride, int threads) {
#if defined(HAVE_AVX512) || defined(HAVE_AVX2)
    if (inputs % 32) return 3;
    int pairs = inputs / 2, groups = inputs / 32, blocks = (outputs + BLOCK - 1) / BLOCK;
    float *wide = malloc((size_t)rows * inputs * sizeof(float));
    if (!wide) return 2;
    widen_rows(x, rows, inputs, x_stride, wide, inputs);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < blocks; b++) {
        const uint8_t *wb = w + (int64_t)b * pairs * BLOCK, *sb = s + (int64_t)b * groups * BLOCK;
        for (int r0 = 0; r0 < rows; r0 += ROWS2) {
            const float *xr = wide + (int64_t)r0 * inputs;
            uint16_t *outr = out + (int64_t)r0 * out_stride;
            switch (rows - r0 < ROWS2 ? rows - r0 : ROWS2) {
                case 1: fp4_tile(xr, inputs, wb, sb, pairs, b, bias, outr, out_stride, outputs, 1); break;
                case 2: fp4_tile(xr, inputs, wb, sb, pairs, b, bias, outr, out_stride, outputs, 2); break;
                case 3: fp4_tile(xr, inputs, wb, sb, pairs, b, bias, outr, out_stride, outputs, 3); break;
                default: fp4_tile(xr, inputs, wb, sb, pairs, b, bias, outr, out_stride, outputs, 4); break;
            }
        }
    }
    free(wide);
    return 0;
#else
    (void)x; (void)rows; (void)inputs; (void)x_stride; (void)w; (void)s; (void)outputs;
    (void)bias; (void)out; (void)out_stride; (void)threads;
    return 1;
#endif
}

/* FP8 weights read as stored (DeepSeek's float8 e4m3 with a float32 scale per block of
   inputs): laid out (by the caller) as `linear_bf16`'s packed weight is, a byte a value
   (block b, pair p: 16 outputs' inputs 2p and 2p+1 side by side), and a scale per block of
   16 outputs and `group` inputs. Each block of 16 outputs is widened once per call into a
   buffer of `linear_bf16`'s layout, each value exactly as a dequantized copy holds it: e4m3
   as a half float (F16C widens it exactly), times 256 times its scale (one rounding, that
   of e4m3 x scale in float32), rounded to bfloat16; then the same tiles sum it. So the
   outputs have the bits of `linear_bf16` over the dequantized weight, at every row count;
   the widening is paid once per block, whatever the number of rows. */
#if (defined(HAVE_AVX512) || defined(HAVE_AVX2)) && defined(__F16C__)
#define HAVE_FP8 1
#ifdef HAVE_AVX512
#define FP8_COLUMNS COLUMNS
#else
#define FP8_COLUMNS 1
#endif

/* 16 e4m3 bytes times `scale` (the block's scale x 256) in float32, two vectors: each
   byte as a half float (e4m3's one NaN as a half-float NaN), widened exactly by F16C */
static inline void fp8_scaled16(const uint8_t *src, __m256 scale, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
    __m256i magnitude = _mm256_and_si256(h, _mm256_set1_epi16(0x7f));
    __m256i half = _mm256_or_si256(_mm256_slli_epi16(magnitude, 7),
                                   _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8));
    __m256i nan = _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7f));
    half = _mm256_or_si256(half, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)));
    *lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(half)), scale);
    *hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(half, 1)), scale);
}

/* those 16 values rounded to bfloat16, into dst */
static inline void fp8_widened16(const uint8_t *src, __m256 scale, uint16_t *dst) {
    __m256 lo, hi;
    fp8_scaled16(src, scale, &lo, &hi);
    narrow16x2(lo, hi, dst, BLOCK);
}

/* the same where the scale is a power of two from 2^-100 to 2^100 (DeepSeek-V4's UE8M0
   scales): e4m3 (4 significant bits) times it is exact in bfloat16, so the rounding is a
   cut of the low halves */
static inline void fp8_widened16_exact(const uint8_t *src, __m256 scale, uint16_t *dst) {
    __m256 lo, hi;
    fp8_scaled16(src, scale, &lo, &hi);
    __m256i top = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(lo), 16),
                                      _mm256_srli_epi32(_mm256_castps_si256(hi), 16));
    /* a NaN's cut keeps its sign and payload; torch's rounding gives 0x7fc0 */
    __m256i out = _mm256_permute4x64_epi64(top, 0xd8);
    __m256i quiet = _mm256_cmpgt_epi16(_mm256_and_si256(out, _mm256_set1_epi16(0x7fff)),
                                       _mm256_set1_epi16(0x7f80));
    out = _mm256_blendv_epi8(out, _mm256_set1_epi16(0x7fc0), quiet);
    _mm256_storeu_si256((__m256i *)dst, out);
}

/* whether e4m3 x `scale` is exact in bfloat16 for every e4m3 value */
static inline int exact_scale(float scale) {
    uint32_t bits;
    memcpy(&bits, &scale, sizeof bits);
    int exponent = (int)((bits >> 23) & 0xff) - 127;
    return (bits & 0x7fffff) == 0 && exponent >= -100 && exponent <= 100;
}

/* blocks b0..b0+C of the FP8 weight, widened into dst in `linear_bf16`'s packed layout */
static void fp8_blocks_widened(const uint8_t *w, const float *s, int pairs, int groups,
                               int group, int b0, int C, uint16_t *dst) {
    int per_group = group / 2; /* pairs a scale */
    for (int c = 0; c < C; c++) {
        int64_t offset = (int64_t)c * pairs * BLOCK * 2;
        const uint8_t *wb = w + (int64_t)(b0 + c) * pairs * BLOCK * 2;
        const float *sb = s + (int64_t)(b0 + c) * groups;
        for (int g = 0, p = 0; g < groups; g++) {
            __m256 scale = _mm256_set1_ps(sb[g] * 256.0f);
            int end = p + per_group < pairs ? p + per_group : pairs;
            if (exact_scale(sb[g]))
                for (; p < end; p++)
                    for (int e = 0; e < 2; e++)
                        fp8_widened16_exact(wb + (int64_t)p * BLOCK * 2 + e * BLOCK, scale,
                                            dst + offset + p * BLOCK * 2 + e * BLOCK);
            else
                for (; p < end; p++)
                    for (int e = 0; e < 2; e++)
                        fp8_widened16(wb + (int64_t)p * BLOCK * 2 + e * BLOCK, scale,
                                      dst + offset + p * BLOCK * 2 + e * BLOCK);
        }
    }
}
#endif

/* 1 where this build has the FP8 product (AVX2 with FMA and F16C, or AVX-512) */
int fp8_available(void) {
#ifdef HAVE_FP8
    return 1;
#else
    return 0;
#endif
}

/* out [rows, outputs] = x [rows, inputs] (bfloat16) times an FP8 weight laid out as above
   (`w`: blocks x pairs x 32 bytes, `s`: blocks x ceil(inputs / group) float32 scales), plus
   the bias (float32), rounded to bfloat16 once. Nonzero: no such product in this build (1),
   memory ran out (2), `group` not a positive even number (3). */
int linear_fp8(const uint16_t *x, int rows, int inputs, int64_t x_stride, const uint8_t *w,
               const float *s, int group, int outputs, const float *bias, uint16_t *out,
               int64_t out_stride, int threads) {
#ifdef HAVE_FP8
    if (group <= 0 || group % 2) return 3;
    int pairs = (inputs + 1) / 2, blocks = (outputs + BLOCK - 1) / BLOCK, width = 2 * pairs;
    int groups = (inputs + group - 1) / group, units = (blocks + FP8_COLUMNS - 1) / FP8_COLUMNS;
    float *wide = malloc((size_t)rows * width * sizeof(float));
    if (!wide) return 2;
    widen_rows(x, rows, inputs, x_stride, wide, width);
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        uint16_t *buffer = malloc((size_t)FP8_COLUMNS * pairs * BLOCK * 2 * sizeof(uint16_t));
        if (!buffer) {
            #pragma omp atomic write
            failed = 2;
        }
        #pragma omp for schedule(static)
        for (int u = 0; u < units; u++) {
            if (!buffer) continue;
            int b0 = u * FP8_COLUMNS, C = blocks - b0 < FP8_COLUMNS ? blocks - b0 : FP8_COLUMNS;
            fp8_blocks_widened(w, s, pairs, groups, group, b0, C, buffer);
#ifdef HAVE_AVX512
            for (int r0 = 0; r0 < rows; r0 += ROWS) {
                int R = rows - r0 < ROWS ? rows - r0 : ROWS;
                tile_rows(wide, width, buffer, pairs, b0, bias, out, out_stride, outputs, r0, R, C);
            }
#else
            for (int r0 = 0; r0 < rows; r0 += ROWS2) {
                int R = rows - r0 < ROWS2 ? rows - r0 : ROWS2;
                tile2_rows(wide, width, buffer, pairs, b0, bias, out, out_stride, outputs, r0, R);
            }
#endif
        }
        free(buffer);
    }
    free(wide);
    return failed;
#else
    (void)x; (void)rows; (void)inputs; (void)x_stride; (void)w; (void)s; (void)group;
    (void)outputs; (void)bias; (void)out; (void)out_stride; (void)threads;
    return 1;
#endif
}
