/* Attention scores on AMX tiles (library.py builds this file into the kernels; kernels.c
   calls it where the CPU and the compiler have AMX-BF16 and the kernel lets the process use
   its tiles). One tile product gives 16 keys' scores against 16 queries; each score is its
   key's and its query's own dot product, summed pair by pair in channel order, so a query's
   scores do not depend on which queries or keys share its tiles. Decode and prefill rows
   both come here, so a token's bits are the same whichever launch computes it. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define KEYS 16    /* keys a tile: its rows */
/* The compiler's tile loads and stores name no memory they read or write: this orders the
   plain stores and loads around them */
#define MEMORY_FENCE() __asm__ volatile("" ::: "memory")
#define CHANNELS 32 /* bfloat16 channels a tile row holds */

/* 1 where the kernel lets this process use the tiles (asked once), else 0 */
int amx_request(void) {
    static int granted = -1;
    if (granted < 0)
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* eight tiles of 16 rows of 64 bytes (tile 0 the scores, 1 a block of keys, 2.. the
   queries' channels); a constant, as the compiler does not see `ldtilecfg` read a local */
static const struct tile_config TILES = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* this thread's tiles */
void amx_begin(void) { _tile_loadconfig(&TILES); }

void amx_end(void) { _tile_release(); }

/* e^x for x <= 0, lane by lane as kernels.c's `exp_nonpositive` computes one */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 shift = _mm512_set1_ps(12582912.0f);
    __m512 k = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), shift),
                             shift);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(0.693145752f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(k, _mm512_set1_ps(1.42860677e-6f)));
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00138888892f), _mm512_set1_ps(0.00833333377f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.0416666679f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.166666672f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* the queries' channels c*32.. (qt + c * 256) as a tile's right operand: row r holds
   channels c*32 + 2r and c*32 + 2r + 1 of each query (a 32-bit word a query) */
static inline void load_queries(int chunk, const uint32_t *qt) {
    switch (chunk) {
    case 0: _tile_loadd(2, qt, 64); break;
    case 1: _tile_loadd(3, qt + 256, 64); break;
    case 2: _tile_loadd(4, qt + 512, 64); break;
    case 3: _tile_loadd(5, qt + 768, 64); break;
    case 4: _tile_loadd(6, qt + 1024, 64); break;
    case 5: _tile_loadd(7, qt + 1280, 64); break;
    }
}

/* scores (tile 0) += 16 keys' channels c*32.. (tile 1) times the queries' (tile 2 + c) */
static inline void add_chunk(int chunk) {
    switch (chunk) {
    case 0: _tile_dpbf16ps(0, 1, 2); break;
    case 1: _tile_dpbf16ps(0, 1, 3); break;
    case 2: _tile_dpbf16ps(0, 1, 4); break;
    case 3: _tile_dpbf16ps(0, 1, 5); break;
    case 4: _tile_dpbf16ps(0, 1, 6); break;
    case 5: _tile_dpbf16ps(0, 1, 7); break;
    }
}

/* Softmax numerators of `nq` (at most 16) bfloat16 queries qh [nq, dim] (dim a multiple of
   32, at most 192) against their keys: query j sees keys 0..lim[j]-1, key t row t % block of
   k[t / block] (rows `k_step` elements apart, bfloat16). Writes p[t * 16 + j] for t below
   the largest lim (zero where t >= lim[j]) and totals[j], their sum (in order of t, four
   running sums by t % 4, then (0 + 1) + (2 + 3)); returns that largest lim. Scores are
   dot products times `scale`, less the query's largest. Needs `amx_begin` on this thread;
   qt holds 6 * 256 words, scratch 16 * dim bfloat16s. */
int amx_softmax(const uint16_t *qh, int nq, const int *lim, const char *const *k, int block,
                int64_t k_step, int dim, float scale, float *p, float *totals, uint32_t *qt,
                uint16_t *scratch) {
    int chunks = dim / CHANNELS, most = 0, limits[16];
    for (int j = 0; j < 16; j++) {
        limits[j] = j < nq ? lim[j] : 0;
        most = limits[j] > most ? limits[j] : most;
    }
    for (int c = 0; c < chunks; c++) {
        uint32_t *tile = qt + c * 256;
        for (int r = 0; r < 16; r++)
            for (int j = 0; j < 16; j++) {
                uint32_t word = 0;
                if (j < nq) memcpy(&word, qh + (size_t)j * dim + c * CHANNELS + 2 * r, 4);
                tile[r * 16 + j] = word;
            }
        MEMORY_FENCE();
        load_queries(c, qt);
    }
    size_t row_bytes = (size_t)k_step * 2;
    for (int t0 = 0; t0 < most; t0 += block) { /* a block of the cache: its keys */
        const char *keys = k[t0 / block];
        int wanted = most - t0 < block ? most - t0 : block;
        for (int a = 0; a < wanted; a += KEYS) {
            const char *rows = keys + (size_t)a * row_bytes;
            size_t stride = row_bytes;
            if (block - a < KEYS) { /* the block ends inside these 16 rows: its last ones */
                int have = block - a;
                for (int i = 0; i < KEYS; i++) {
                    if (i < have) memcpy(scratch + (size_t)i * dim, rows + i * row_bytes, dim * 2);
                    else memset(scratch + (size_t)i * dim, 0, dim * 2);
                }
                rows = (const char *)scratch, stride = (size_t)dim * 2;
                MEMORY_FENCE();
            }
            _tile_zero(0);
            for (int c = 0; c < chunks; c++) {
                _tile_loadd(1, rows + c * CHANNELS * 2, stride);
                add_chunk(c);
            }
            _tile_stored(0, p + (size_t)(t0 + a) * 16, 64);
        }
    }
    MEMORY_FENCE();
    const __m512i limit = _mm512_loadu_si512(limits);
    const __m512 scaled = _mm512_set1_ps(scale);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < most; t++) {
        __mmask16 seen = _mm512_cmpgt_epi32_mask(limit, _mm512_set1_epi32(t));
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(p + (size_t)t * 16), scaled);
        _mm512_storeu_ps(p + (size_t)t * 16, x);
        top = _mm512_mask_max_ps(top, seen, top, x);
    }
    __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                      _mm512_setzero_ps()};
    for (int t = 0; t < most; t++) {
        __mmask16 seen = _mm512_cmpgt_epi32_mask(limit, _mm512_set1_epi32(t));
        __m512 e = _mm512_maskz_mov_ps(
            seen, exp16(_mm512_sub_ps(_mm512_loadu_ps(p + (size_t)t * 16), top)));
        _mm512_storeu_ps(p + (size_t)t * 16, e);
        sums[t & 3] = _mm512_add_ps(sums[t & 3], e);
    }
    __m512 total = _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3]));
    float all[16];
    _mm512_storeu_ps(all, total);
    for (int j = 0; j < nq; j++) totals[j] = all[j];
    return most;
}
#endif
