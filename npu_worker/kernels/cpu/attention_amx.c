/* Attention on AMX tiles (library.py builds this file into the kernels; kernels.c calls it
   where the CPU and the compiler have AMX-BF16 and the kernel lets the process use its
   tiles). One tile product gives 16 keys' scores against 16 queries; each score is its
   key's and its query's own dot product, summed pair by pair in channel order, so a query's
   scores do not depend on which queries or keys share its tiles. After the softmax, two
   tile products add 32 keys' values, weighted by their numerators split in two bfloat16s
   (a high part and the rest, so about 16 bits of each where a single bfloat16 keeps 8), to
   16 queries' sums of 16 channels; each sum runs over its query's keys in order, 32 at a
   time, and the keys of other queries in the tile add exact zeros. Values are made into the
   products' operands once a thread for every task reading the same blocks (`amx_pack`), the
   same operands as made for one task alone. Decode and prefill rows both come here, so a
   token's bits are the same whichever launch computes it. */
#include <stdint.h>
#include <stdlib.h>
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

/* 16 rows of 16 floats (a[i] row i) transposed in place: a[i] lane j <- a[j] lane i. Within
   128-bit lanes first (pairs, then pairs of pairs: b[4g + c] lane k holds column 4k + c of
   rows 4g..4g+3), then the 128-bit lanes across each four of those */
static inline void transpose16(__m512 *a) {
    __m512 b[16];
    for (int i = 0; i < 16; i += 2) {
        __m512 lo = _mm512_unpacklo_ps(a[i], a[i + 1]), hi = _mm512_unpackhi_ps(a[i], a[i + 1]);
        a[i] = lo, a[i + 1] = hi;
    }
    for (int i = 0; i < 16; i += 4)
        for (int h = 0; h < 2; h++) {
            __m512d x = _mm512_castps_pd(a[i + h]), y = _mm512_castps_pd(a[i + 2 + h]);
            b[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
            b[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
        }
    for (int c = 0; c < 4; c++) {
        __m512 u0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x44);
        __m512 u1 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xEE);
        __m512 u2 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x44);
        __m512 u3 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xEE);
        a[c] = _mm512_shuffle_f32x4(u0, u2, 0x88);
        a[4 + c] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
        a[8 + c] = _mm512_shuffle_f32x4(u1, u3, 0x88);
        a[12 + c] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
    }
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

/* 16 keys of a block: their first row, the rows' stride in bytes, their first position and
   how many of them are wanted */
struct keys16 {
    const char *rows;
    size_t stride;
    int at, left;
};

/* one tile product's scores (16 keys x 16 queries at `turn`) query by query into
   scores[j * longest + at..], times `scale`, for queries j0..j1-1 */
static inline void turn_scores(const float *turn, struct keys16 g, int j0, int j1, int longest,
                               __m512 scaled, float *scores) {
    __m512 x[16];
    for (int i = 0; i < 16; i++) x[i] = _mm512_loadu_ps(turn + 16 * i);
    transpose16(x); /* x[j]: query j's scores of these keys */
    __mmask16 keep = (__mmask16)((1u << g.left) - 1);
    for (int j = j0; j < j1; j++)
        _mm512_mask_storeu_ps(scores + (size_t)j * longest + g.at, keep,
                              _mm512_mul_ps(x[j], scaled));
}

/* the scores of queries j0..j1-1 of the tile against `wanted` keys of the block at `keys`
   (positions t0..), one tile product each 16 */
static void score_block(const char *keys, int t0, int wanted, int j0, int j1, int longest,
                        int block, size_t row_bytes, int dim, __m512 scaled, float *scores,
                        uint16_t *scratch, float *turn) {
    int chunks = dim / CHANNELS;
    for (int a = 0; a < wanted; a += KEYS) {
        struct keys16 g = {keys + (size_t)a * row_bytes, row_bytes, t0 + a,
                           wanted - a < KEYS ? wanted - a : KEYS};
        if (block - a < KEYS) { /* the block ends inside these 16 rows: its last ones */
            int have = block - a;
            for (int i = 0; i < KEYS; i++) {
                uint16_t *row = scratch + (size_t)i * dim;
                if (i < have) memcpy(row, g.rows + i * row_bytes, dim * 2);
                else memset(row, 0, dim * 2);
            }
            g.rows = (const char *)scratch, g.stride = (size_t)dim * 2;
            MEMORY_FENCE();
        }
        _tile_zero(0);
        for (int c = 0; c < chunks; c++) {
            _tile_loadd(1, g.rows + c * CHANNELS * 2, g.stride);
            add_chunk(c);
        }
        _tile_stored(0, turn, 64);
        MEMORY_FENCE();
        turn_scores(turn, g, j0, j1, longest, scaled, scores);
    }
}

/* Scores of `nq` (at most 16) bfloat16 queries qh [nq, dim] (dim a multiple of 32, at most
   192), queries first.. of a task whose positions each have `group` of them: query j's
   position s = (first + j) / group sees keys 0..limit[s]-1, and scores[j * longest + t] =
   (query j . key t) * scale for t below the tile's largest limit. Key t is row t % block
   of k[s * table_step + t / block] (bfloat16, rows `k_step` elements apart): with
   table_step 0 every position reads one table; else each its own, the first `common`
   blocks the same for all. A block every query reads is one tile product for all of them;
   a position's own block, one for its queries. Each 16 keys' scores come from one tile
   product, then turn query by query. Needs `amx_begin` on this thread; qt holds 6 * 256
   words, scratch 16 * dim bfloat16s, turn 256 floats. */
void amx_scores(const uint16_t *qh, int nq, int first, int group, const int64_t *limit,
                int longest, const char *const *k, int64_t table_step, int common, int block,
                int64_t k_step, int dim, float scale, float *scores, uint32_t *qt,
                uint16_t *scratch, float *turn) {
    int chunks = dim / CHANNELS, most = 0;
    int s0 = first / group, s1 = (first + nq - 1) / group; /* the tile's positions */
    for (int s = s0; s <= s1; s++) most = limit[s] > most ? (int)limit[s] : most;
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
    const __m512 scaled = _mm512_set1_ps(scale);
    size_t row_bytes = (size_t)k_step * 2;
    for (int t0 = 0; t0 < most; t0 += block) { /* a block of the cache: its keys */
        int b = t0 / block;
        if (table_step == 0 || b < common) {
            int wanted = most - t0 < block ? most - t0 : block;
            score_block(k[b], t0, wanted, 0, nq, longest, block, row_bytes, dim, scaled,
                        scores, scratch, turn);
            continue;
        }
        for (int s = s0; s <= s1; s++) { /* each position's own block */
            int wanted = (int)limit[s] - t0 < block ? (int)limit[s] - t0 : block;
            if (wanted <= 0) continue;
            int j0 = s * group - first, j1 = (s + 1) * group - first;
            score_block(k[s * table_step + b], t0, wanted, j0 < 0 ? 0 : j0, j1 < nq ? j1 : nq,
                        longest, block, row_bytes, dim, scaled, scores, scratch, turn);
        }
    }
}

/* value sums (tile c, 16 channels) += the numerators' high parts (tile 4), then their low
   parts (tile 7), times 32 keys' values of channels c*16.. (tile 5 or 6, as pairs of keys) */
static inline void add_values(int c, const uint16_t *pairs) {
    switch (c) {
    case 0: _tile_loadd(5, pairs, 64); _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(0, 7, 5); break;
    case 1:
        _tile_loadd(6, pairs + 512, 64); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(1, 7, 6);
        break;
    case 2:
        _tile_loadd(5, pairs + 1024, 64); _tile_dpbf16ps(2, 4, 5); _tile_dpbf16ps(2, 7, 5);
        break;
    case 3:
        _tile_loadd(6, pairs + 1536, 64); _tile_dpbf16ps(3, 4, 6); _tile_dpbf16ps(3, 7, 6);
        break;
    }
}

static inline void store_values(int c, float *sums) {
    switch (c) {
    case 0: _tile_stored(0, sums, 64); break;
    case 1: _tile_stored(1, sums + 256, 64); break;
    case 2: _tile_stored(2, sums + 512, 64); break;
    case 3: _tile_stored(3, sums + 768, 64); break;
    }
}

/* float32 to bfloat16, as two: the high part rounded to nearest even, the low part the rest
   (exact in float32) rounded the same way, so high + low holds about 16 of the float's 24
   bits; 32 values, the first 16 in `a` */
static inline void split_bf16(__m512 a, __m512 b, __m512i *high, __m512i *low) {
    __m512i h = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        _mm512_castsi512_si256(h)), 16));
    __m512 hb = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        _mm512_extracti64x4_epi64(h, 1)), 16));
    *high = h;
    *low = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha));
}

/* the numerators of queries j0..j1-1 (rows `longest` apart) for keys t0..t0+31, those at or
   past `keys` zero, split in two bfloat16s (`split_bf16`): row j of `pa` (32 a row) the
   high parts, of `pa + 512` the low ones; the tiles' other rows zeros */
static void numerators(const float *p, int j0, int j1, int t0, int keys, int longest,
                       uint16_t *pa) {
    int left = keys - t0 < 32 ? keys - t0 : 32;
    __mmask16 lo = (__mmask16)(left >= 16 ? 0xffff : (1u << left) - 1);
    __mmask16 hi = (__mmask16)(left >= 32 ? 0xffff : left > 16 ? (1u << (left - 16)) - 1 : 0);
    for (int j = 0; j < 16; j++) {
        __m512i high = _mm512_setzero_si512(), low = high;
        if (j >= j0 && j < j1) {
            const float *at = p + (size_t)j * longest + t0;
            __m512 a = _mm512_maskz_loadu_ps(lo, at), b = _mm512_maskz_loadu_ps(hi, at + 16);
            split_bf16(a, b, &high, &low);
        }
        _mm512_storeu_si512(pa + j * 32, high);
        _mm512_storeu_si512(pa + 512 + j * 32, low);
    }
}

/* keys t0..t0+31 (those at or past `keys` zeros) of a table's value blocks, channels d0..
   d0 + 32 * halves, as the right operands of tile products: pair r (keys t0 + 2r, t0 + 2r + 1)
   of channel tile c at pairs[c * 512 + r * 32], each channel's two values side by side */
static void value_pairs(const char *const *v, int t0, int keys, int block, size_t row_bytes,
                        int d0, int halves, uint16_t *pairs) {
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41,
                                           9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2,
                                           33, 1, 32, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    for (int r = 0; r < 16; r++) {
        int t = t0 + 2 * r;
        const char *a = t < keys ? v[t / block] + (size_t)(t % block) * row_bytes + d0 * 2 : 0;
        const char *b = t + 1 < keys
            ? v[(t + 1) / block] + (size_t)((t + 1) % block) * row_bytes + d0 * 2 : 0;
        for (int h = 0; h < halves; h++) {
            __m512i x = a ? _mm512_loadu_si512(a + h * 64) : _mm512_setzero_si512();
            __m512i y = b ? _mm512_loadu_si512(b + h * 64) : _mm512_setzero_si512();
            _mm512_storeu_si512(pairs + (2 * h) * 512 + r * 32,
                                _mm512_permutex2var_epi16(x, first, y));
            _mm512_storeu_si512(pairs + (2 * h + 1) * 512 + r * 32,
                                _mm512_permutex2var_epi16(x, second, y));
        }
    }
}

/* Values packed as tile operands once for every task of a thread that reads the same
   blocks: a prefill launch's tokens of one request, or decode rows sharing a cached
   prefix, each task one KV head of a few of them, would otherwise repack the same keys'
   values for each. One record a KV head: the blocks its packed keys came from and their
   operands, 32 keys (wholly present) at a time; a record is good for one call, while the
   cache is not written. */
struct amx_pack {
    const char **blocks; /* the value blocks the packed keys lie in */
    uint16_t *pairs;     /* per 32 keys and 64 channels, `value_pairs`'s 2048 bfloat16s */
    int num_blocks, keys;
};

void amx_packs_free(void *handle);

struct amx_packs {
    int heads, capacity, most_blocks; /* capacity: keys a record holds */
    struct amx_pack pack[];
};

/* records for `heads` KV heads of up to `keys` keys (of up to `blocks` blocks) of `vdim`
   channels each; NULL when they would take more than `budget` bytes or memory is short */
void *amx_packs_new(int heads, int keys, int blocks, int vdim, size_t budget) {
    int capacity = keys - keys % 32;
    size_t per_head = (size_t)(capacity / 32) * ((vdim + 63) / 64) * 2048 * sizeof(uint16_t);
    if (capacity <= 0 || per_head * heads > budget) return NULL;
    struct amx_packs *packs = calloc(1, sizeof(*packs) + heads * sizeof(struct amx_pack));
    if (!packs) return NULL;
    packs->heads = heads, packs->capacity = capacity, packs->most_blocks = blocks;
    for (int h = 0; h < heads; h++) {
        packs->pack[h].blocks = malloc(blocks * sizeof(char *));
        packs->pack[h].pairs = malloc(per_head);
        if (!packs->pack[h].blocks || !packs->pack[h].pairs) {
            packs->heads = h + 1;
            amx_packs_free(packs);
            return NULL;
        }
    }
    return packs;
}

void amx_packs_free(void *handle) {
    struct amx_packs *packs = handle;
    if (!packs) return;
    for (int h = 0; h < packs->heads; h++) {
        free(packs->pack[h].blocks);
        free(packs->pack[h].pairs);
    }
    free(packs);
}

/* Head `head`'s record made to hold the operands of keys 0..wanted-1 of the value table `v`
   (blocks of `block` keys, rows `v_step` elements apart), 32 keys at a time (a last part
   of fewer is left to `value_pairs`): what it holds from the same leading blocks is kept,
   the rest packed. Sets *pairs to its operands; returns how many keys they cover. */
int amx_pack(void *handle, int head, const char *const *v, int wanted, int block,
             int64_t v_step, int vdim, const uint16_t **pairs) {
    struct amx_packs *packs = handle;
    struct amx_pack *pk = &packs->pack[head];
    wanted = wanted < packs->capacity ? wanted : packs->capacity;
    wanted -= wanted % 32;
    int num_blocks = (wanted + block - 1) / block, same = 0;
    if (num_blocks > packs->most_blocks) return 0;
    while (same < num_blocks && same < pk->num_blocks && pk->blocks[same] == v[same]) same++;
    int kept = same * block - same * block % 32; /* 32 keys all in blocks that match */
    kept = kept < pk->keys ? kept : pk->keys;
    size_t per_group = (size_t)((vdim + 63) / 64) * 2048;
    for (int t0 = kept; t0 < wanted; t0 += 32)
        for (int d0 = 0; d0 < vdim; d0 += 64)
            value_pairs(v, t0, wanted, block, (size_t)v_step * 2, d0, vdim - d0 >= 64 ? 2 : 1,
                        pk->pairs + (size_t)(t0 / 32) * per_group + d0 / 64 * 2048);
    for (int b = same; b < num_blocks; b++) pk->blocks[b] = v[b];
    pk->num_blocks = num_blocks > same ? num_blocks : same;
    pk->keys = wanted > kept ? wanted : kept;
    *pairs = pk->pairs;
    return pk->keys;
}

/* Value sums of `nq` (at most 16) queries, queries first.. of a task whose positions each
   have `group` of them (position s = (first + j) / group sees keys 0..limit[s]-1):
   acc[j * vdim + d] = the sum over keys t of p[j][t] * value t's channel d, the numerators p
   (rows `longest` apart, zeros past each query's keys) split in two bfloat16s, a high part
   and the rest (about 16 bits of each, where torch's CPU attention keeps 8), 32 keys a tile
   product in order of t from 0, so a query's sums depend only on its numerators and its
   values: the keys other queries of the tile see add exact zeros. Value t is row t % block of
   v[s * table_step + t / block] (bfloat16, rows `v_step` elements apart): with table_step 0
   every position reads one table; else each its own, the first `common` blocks the same for
   all (32 keys wholly in them one product for every query, else one a position). Keys past
   the tile's (or the position's) last are zeros, whatever the cache holds there. vdim a
   multiple of 32. `packed` (from `amx_pack`) holds the operands of the shared keys' first
   `packed_keys` as `value_pairs` writes them, 32 keys wholly below the tile's keys read from
   there. Needs `amx_begin` on this thread; pairs holds 2048 bfloat16s, pa 1024, sums 1024
   floats. */
void amx_values(const float *p, int nq, int first, int group, const int64_t *limit,
                int longest, const char *const *v, int64_t table_step, int common, int block,
                int64_t v_step, int vdim, float *acc, uint16_t *pairs, uint16_t *pa,
                float *sums, const uint16_t *packed, int packed_keys) {
    int s0 = first / group, s1 = (first + nq - 1) / group, most = 0;
    for (int s = s0; s <= s1; s++) most = limit[s] > most ? (int)limit[s] : most;
    size_t row_bytes = (size_t)v_step * 2;
    for (int d0 = 0; d0 < vdim; d0 += 64) {
        int halves = vdim - d0 >= 64 ? 2 : 1, tiles = 2 * halves;
        for (int c = 0; c < tiles; c++) {
            switch (c) {
            case 0: _tile_zero(0); break;
            case 1: _tile_zero(1); break;
            case 2: _tile_zero(2); break;
            case 3: _tile_zero(3); break;
            }
        }
        for (int t0 = 0; t0 < most; t0 += 32) {
            int shared = table_step == 0 || t0 + 32 <= common * block;
            for (int s = s0; s <= s1; s++) {
                int j0 = 0, j1 = nq, keys = most;
                const char *const *table = v;
                if (!shared) { /* this position's queries over its own table */
                    j0 = s * group - first, j1 = (s + 1) * group - first;
                    j0 = j0 < 0 ? 0 : j0, j1 = j1 < nq ? j1 : nq;
                    keys = (int)limit[s], table = v + s * table_step;
                    if (t0 >= keys) continue;
                }
                MEMORY_FENCE(); /* the last products have read what these overwrite */
                numerators(p, j0, j1, t0, keys, longest, pa);
                const uint16_t *operands = pairs;
                if (shared && t0 + 32 <= keys && t0 + 32 <= packed_keys) /* packed already */
                    operands = packed + ((size_t)(t0 / 32) * ((vdim + 63) / 64) + d0 / 64) * 2048;
                else
                    value_pairs(table, t0, keys, block, row_bytes, d0, halves, pairs);
                MEMORY_FENCE();
                _tile_loadd(4, pa, 64);
                _tile_loadd(7, pa + 512, 64);
                for (int c = 0; c < tiles; c++) add_values(c, operands);
                if (shared) break;
            }
        }
        for (int c = 0; c < tiles; c++) store_values(c, sums);
        MEMORY_FENCE();
        for (int j = 0; j < nq; j++)
            for (int c = 0; c < tiles; c++)
                memcpy(acc + (size_t)j * vdim + d0 + 16 * c, sums + c * 256 + j * 16,
                       16 * sizeof(float));
    }
}
#endif
