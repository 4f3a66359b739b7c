/* bfloat16 linear layers on AMX tiles (library.py builds this file into the kernels; the
   products.py probe runs it where it beats oneDNN's products and the kernels' multiply-adds).
   The weight is `pack_linear`'s (matmul.c): block b, pair p holds outputs 16b..16b+15, each
   with inputs 2p and 2p+1 side by side, which is a tile's right operand as it lies (16
   pairs of inputs a tile, 64 bytes a pair). One tile product adds 32 inputs of 16 rows
   against 16 outputs; each of its sums is its row's and its output's own, pair of inputs by
   pair in order, chunk after chunk of 32 inputs from zero, so a row's bits depend on
   nothing but the row, whatever the number of rows and whichever rows share its tiles. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define BLOCK 16 /* outputs a tile's columns, rows a tile's rows */
#define CHUNK 32 /* inputs a tile product adds */
#define MEMORY_FENCE() __asm__ volatile("" ::: "memory") /* as in attention_amx.c */

int amx_request(void);
void amx_begin(void);
void amx_end(void);

/* a tile of sums (16 rows x 16 floats in `sums`) plus the bias, rounded, into rows
   r0.. (of `rows`) and outputs 16b.. (of `outputs`) of out */
static inline void store_sums(const float *sums, const float *bias, int b, int outputs,
                              int r0, int rows, uint16_t *out, int64_t out_stride) {
    int o = b * BLOCK, left = outputs - o < BLOCK ? outputs - o : BLOCK;
    __mmask16 mask = (__mmask16)((1u << left) - 1);
    __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + o) : _mm512_setzero_ps();
    int n = rows - r0 < BLOCK ? rows - r0 : BLOCK;
    for (int r = 0; r < n; r++) {
        __m512 sum = _mm512_add_ps(_mm512_loadu_ps(sums + r * BLOCK), add);
        _mm256_mask_storeu_epi16(out + (int64_t)(r0 + r) * out_stride + o, mask,
                                 narrow16(sum));
    }
}

/* bfloat16 bits (in the low halves of 32-bit lanes) widened to float32 */
static inline __m512 widened16(__m256i half) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* silu(gate) * up for a tile of gate sums and one of up sums (16 rows x 16 floats each),
   each step rounded to bfloat16 as the unfused form rounds it: the products' outputs, the
   activation (x / (1 + e^-x), e^-|x| from `exp_nonpositive16`), then their product; into
   rows r0.. (of `rows`) and outputs 16b.. of out */
static inline void store_gated(const float *gate, const float *up, int b, int outputs, int r0,
                               int rows, uint16_t *out, int64_t out_stride) {
    int o = b * BLOCK, left = outputs - o < BLOCK ? outputs - o : BLOCK;
    __mmask16 mask = (__mmask16)((1u << left) - 1);
    const __m512 one = _mm512_set1_ps(1.0f);
    int n = rows - r0 < BLOCK ? rows - r0 : BLOCK;
    for (int r = 0; r < n; r++) {
        __m512 g = widened16(narrow16(_mm512_loadu_ps(gate + r * BLOCK)));
        __m512 u = widened16(narrow16(_mm512_loadu_ps(up + r * BLOCK)));
        __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        __m512 sigmoid = _mm512_div_ps(one, _mm512_add_ps(one, e)); /* of |g| */
        __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        sigmoid = _mm512_mask_mul_ps(sigmoid, negative, sigmoid, e); /* e / (1 + e) */
        __m512 act = widened16(narrow16(_mm512_mul_ps(g, sigmoid)));
        _mm256_mask_storeu_epi16(out + (int64_t)(r0 + r) * out_stride + o, mask,
                                 narrow16(_mm512_mul_ps(act, u)));
    }
}

/* rows r0..r0+16 of x (each `x_bytes` apart) by blocks b, b+1 (two = 2) over every chunk of
   inputs: tiles 0..3 the sums (row tile i, block j: 2i + j), 4 and 5 the rows, 6 and 7 the
   blocks. `second` says whether rows r0+16.. exist */
static inline void tile_pass(const char *x0, const char *x1, size_t x_bytes, const char *w0,
                             const char *w1, int chunks, int two, int second, float *sums) {
    MEMORY_FENCE(); /* the last pass's sums read before these overwrite them */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < chunks; c++) {
        size_t at = (size_t)c * CHUNK * 2, wat = (size_t)c * (CHUNK / 2) * 64;
        _tile_loadd(4, x0 + at, x_bytes);
        _tile_loadd(6, w0 + wat, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_loadd(7, w1 + wat, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (second) {
            _tile_loadd(5, x1 + at, x_bytes);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, sums, 64);
    if (two) _tile_stored(1, sums + 256, 64);
    if (second) {
        _tile_stored(2, sums + 512, 64);
        if (two) _tile_stored(3, sums + 768, 64);
    }
    MEMORY_FENCE();
}

/* x's last rows short of a tile (rows % 16 of them) copied where zeros follow them, so a
   tile reads 16 rows; NULL where there are none, or memory ran out (`*failed` 2) */
static uint16_t *padded_tail(const uint16_t *x, int rows, int inputs, int64_t x_stride,
                             int *failed) {
    int full = rows / BLOCK, tail = rows % BLOCK;
    if (!tail) return NULL;
    uint16_t *padded = calloc((size_t)BLOCK * inputs, sizeof(uint16_t));
    if (!padded) {
        *failed = 2;
        return NULL;
    }
    for (int r = 0; r < tail; r++)
        memcpy(padded + (size_t)r * inputs, x + (int64_t)(full * BLOCK + r) * x_stride,
               (size_t)inputs * 2);
    return padded;
}

/* tile t of x's rows: its first row and the bytes between its rows (the padded tail's own) */
static inline const char *row_tile(const uint16_t *x, int64_t x_stride, int t, int full,
                                   const uint16_t *padded, int inputs, size_t *stride) {
    *stride = t < full ? (size_t)x_stride * 2 : (size_t)inputs * 2;
    return t < full ? (const char *)(x + (int64_t)t * BLOCK * x_stride) : (const char *)padded;
}

/* The two products below: each pass is two blocks of the packed weight (b, b + 1 of a
   linear layer's; gate's block b and up's for a gated one) by up to two tiles of x's rows,
   passes outermost, so each weight block comes from memory once for all the rows */
static int tile_products(const uint16_t *x, int rows, int inputs, int64_t x_stride,
                         const uint16_t *w, int outputs, const float *bias, uint16_t *out,
                         int64_t out_stride, int threads, int gated) {
    if (!amx_request()) return 1;
    if (inputs % CHUNK || (gated && outputs % (2 * BLOCK))) return 3;
    int wide = gated ? outputs / 2 : outputs; /* out's outputs */
    int blocks = (wide + BLOCK - 1) / BLOCK, passes = gated ? blocks : (blocks + 1) / 2;
    int chunks = inputs / CHUNK, full = rows / BLOCK, failed = 0;
    int row_tiles = full + (rows % BLOCK ? 1 : 0);
    size_t block_bytes = (size_t)inputs / 2 * 64;
    uint16_t *padded = padded_tail(x, rows, inputs, x_stride, &failed);
    if (failed) return failed;
    #pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        float *sums = aligned_alloc(64, 4 * 256 * sizeof(float));
        if (!sums) failed = 2;
        else amx_begin();
        #pragma omp for schedule(static)
        for (int g = 0; g < passes; g++) {
            if (!sums) continue;
            int b = gated ? g : 2 * g, two = gated || b + 1 < blocks;
            const char *w0 = (const char *)w + (size_t)b * block_bytes;
            const char *w1 = (const char *)w + (size_t)(gated ? blocks + g : b + 1) * block_bytes;
            for (int t = 0; t < row_tiles;) { /* two tiles of rows a pass where both are x's */
                size_t stride;
                const char *x0 = row_tile(x, x_stride, t, full, padded, inputs, &stride);
                int second = t + 1 < full;
                tile_pass(x0, second ? x0 + BLOCK * stride : NULL, stride, w0, w1, chunks, two,
                          second, sums);
                for (int r = 0; r <= second; r++) {
                    const float *mine = sums + 512 * r;
                    int r0 = (t + r) * BLOCK;
                    if (gated) {
                        store_gated(mine, mine + 256, b, wide, r0, rows, out, out_stride);
                        continue;
                    }
                    store_sums(mine, bias, b, wide, r0, rows, out, out_stride);
                    if (two) store_sums(mine + 256, bias, b + 1, wide, r0, rows, out, out_stride);
                }
                t += second ? 2 : 1;
            }
        }
        if (sums) amx_end();
        free(sums);
    }
    free(padded);
    return failed;
}

/* out [rows, outputs] = x [rows, inputs] times the packed weight (+ bias, float32), as
   `linear_bf16` takes them; inputs a multiple of 32. Returns 1 where this build or the
   kernel gives no tiles, 3 where inputs is not a multiple of 32, 2 where memory ran out */
int linear_bf16_tiles(const uint16_t *x, int rows, int inputs, int64_t x_stride,
                      const uint16_t *w, int outputs, const float *bias, uint16_t *out,
                      int64_t out_stride, int threads) {
    return tile_products(x, rows, inputs, x_stride, w, outputs, bias, out, out_stride, threads,
                         0);
}

/* out [rows, outputs / 2] = silu(x gate) * (x up), where the packed weight holds gate's
   `outputs / 2` outputs, then up's (a multiple of 16 each), inputs a multiple of 32: gate's
   block b and up's block b in one pass, their sums rounded to bfloat16 as `linear_bf16_tiles`
   rounds them, then the activation and product as `store_gated`. `linear_bf16_tiles`'s
   arguments, `bias` NULL (a gated pair with biases takes the unfused form: 3 otherwise), and
   its returns */
int gated_bf16_tiles(const uint16_t *x, int rows, int inputs, int64_t x_stride,
                     const uint16_t *w, int outputs, const float *bias, uint16_t *out,
                     int64_t out_stride, int threads) {
    if (bias) return 3;
    return tile_products(x, rows, inputs, x_stride, w, outputs, NULL, out, out_stride, threads,
                         1);
}

#else
int gated_bf16_tiles(const uint16_t *x, int rows, int inputs, int64_t x_stride,
                     const uint16_t *w, int outputs, const float *bias, uint16_t *out,
                     int64_t out_stride, int threads) {
    (void)x; (void)rows; (void)inputs; (void)x_stride; (void)w; (void)outputs; (void)bias;
    (void)out; (void)out_stride; (void)threads;
    return 1;
}

int linear_bf16_tiles(const uint16_t *x, int rows, int inputs, int64_t x_stride,
                      const uint16_t *w, int outputs, const float *bias, uint16_t *out,
                      int64_t out_stride, int threads) {
    (void)x; (void)rows; (void)inputs; (void)x_stride; (void)w; (void)outputs; (void)bias;
    (void)out; (void)out_stride; (void)threads;
    return 1;
}
#endif

/* 1 where this build has the tile product and the kernel lets the process use the tiles */
int tiles_available(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
    return amx_request();
#else
    return 0;
#endif
}
