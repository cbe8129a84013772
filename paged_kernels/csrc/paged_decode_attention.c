/* Paged decode attention for the CPU: one query token per sequence over its paged K/V cache.
 *
 * The twin of paged_kernels.reference's decode path (same arguments after flattening, same result up to
 * float rounding); the CPU attention backend ("cpu") calls it for the decode rows of a step. The
 * torch reference must gather every sequence's K/V blocks into a scratch copy before SDPA reads
 * them again; this loop reads each cached K/V row once, straight from the cache, with an online
 * softmax (flash-decoding style), so a decode step moves a third of the bytes.
 *
 * Work items are (sequences, KV head) pairs, spread over OpenMP threads; the `group` query heads
 * that share a KV head are handled together, so each K/V row is loaded once for all of them (GQA),
 * and sequences that share their first block (a cached prompt prefix) form one item and go chunk
 * by chunk together, so a shared block is read from memory once for all of them.
 * The cache may have any strides in its first three dims (block, token in block, KV head); rows of
 * head_dim values must be contiguous. Built by paged_kernels/native.py with -O3 -march=native -fopenmp.
 *
 * Two entry points: `_f32` (fp32 query, cache and output) and `_bf16` (bf16 query, cache and output).
 * The bf16 one widens each loaded value to fp32 (a bf16 is the top half of an fp32, so widening is a
 * shift) or, on AVX512-BF16, multiplies bf16 pairs exactly into fp32 sums; scores, the softmax and
 * the accumulators are fp32, and only the output row is rounded to bf16 (to nearest even), once.
 *
 * Two loops: plain C (item_scalar: any head size, any CPU) and, when the compiler targets AVX-512,
 * an intrinsics loop for head sizes 64 and 128 (seq_chunk: chunks of 128 cached tokens scored 16
 * at a time, softmax by a vector exp, the next block prefetched).
 * Each (head size, dtype) gets its own OpenMP loop, so the head size is a compile-time constant
 * inside it.
 *
 * With AMX tiles (bf16, `tiles` set by the caller), the chunks of a cached prefix that all sequences
 * of an item share are scored and summed for all their rows at once as tile products
 * (shared_chunk_amx); a row's result is then within bf16 rounding of its result alone, no longer
 * bit for bit (the weights are rounded to bf16 for P V). With AVX-512 BF16 but no AMX the tiles
 * are emulated (amx_tiles.h's fused emu_scores32 and emu_pv32): 2.2x the row loop for 16 or more rows
 * over a shared 1,024-token prefix, 1.5x for 12 (four rows of a group of three) on an AMD EPYC (Zen 5).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 128

/* Element i of a row of fp32 or bf16 values, as fp32; BF16 is a compile-time constant at each call. */
static inline __attribute__((always_inline)) float load(const void *row, int64_t i, const int BF16) {
    return BF16 ? bf16_to_f32(((const bf16_t *)row)[i]) : ((const float *)row)[i];
}

/* One call's arguments. Strides are in elements (of fp32 or bf16, as the entry point says). */
struct args {
    const char *query, *key_cache, *value_cache;
    int64_t q_stride_tok, q_stride_head, c_stride_block, c_stride_tok, c_stride_head, bt_stride;
    const int32_t *block_tables, *seq_lens;
    char *out;
    int64_t o_stride_tok, o_stride_head;
    int num_kv_heads, group, block_size;
    float scale;
    int tiles;  /* bf16: run the chunks an item's sequences share on AMX tiles (amx_tiles.h) */
};

/* The item's output rows: each query head's accumulator over its softmax denominator, in the entry
 * point's dtype (bf16 rounded once, to nearest even). */
static inline __attribute__((always_inline)) void store_rows(const struct args *a, int s, int h,
                                                              float acc[][MAX_HEAD_DIM], const float *denom,
                                                              const int HD, const int BF16)
{
    const int64_t elem = BF16 ? (int64_t)sizeof(bf16_t) : (int64_t)sizeof(float);
    for (int g = 0; g < a->group; g++) {
        char *o = a->out + (s * a->o_stride_tok + (int64_t)(h * a->group + g) * a->o_stride_head) * elem;
        const float inv = 1.f / denom[g];
        if (BF16) for (int d = 0; d < HD; d++) ((bf16_t *)o)[d] = f32_to_bf16(acc[g][d] * inv);
        else for (int d = 0; d < HD; d++) ((float *)o)[d] = acc[g][d] * inv;
    }
}

/* The attention of one work item (sequence s, KV head h) for its `group` query heads: plain C. */
static inline __attribute__((always_inline)) void item_scalar(const struct args *a, int64_t item,
                                                               const int HD, const int BF16)
{
    const int64_t elem = BF16 ? (int64_t)sizeof(bf16_t) : (int64_t)sizeof(float);
    const int s = (int)(item / a->num_kv_heads), h = (int)(item % a->num_kv_heads), group = a->group;
    const int len = a->seq_lens[s], block_size = a->block_size;
    float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
    float running_max[MAX_GROUP], denom[MAX_GROUP], p[MAX_GROUP][MAX_BLOCK_SIZE];
    for (int g = 0; g < group; g++) {
        const void *qs = a->query + (s * a->q_stride_tok + (int64_t)(h * group + g) * a->q_stride_head) * elem;
        for (int d = 0; d < HD; d++) { q[g][d] = load(qs, d, BF16) * a->scale; acc[g][d] = 0.f; }
        running_max[g] = -FLT_MAX;
        denom[g] = 0.f;
    }
    const int32_t *table = a->block_tables + s * a->bt_stride;
    for (int start = 0; start < len; start += block_size) {
        const int n = len - start < block_size ? len - start : block_size;
        const int64_t base = (int64_t)table[start / block_size] * a->c_stride_block + h * a->c_stride_head;
        const char *kb = a->key_cache + base * elem, *vb = a->value_cache + base * elem;
        for (int g = 0; g < group; g++) {  /* scores of this block's tokens */
            float block_max = running_max[g];
            for (int t = 0; t < n; t++) {
                const void *k = kb + t * a->c_stride_tok * elem;
                float dot = 0.f;
                for (int d = 0; d < HD; d++) dot += q[g][d] * load(k, d, BF16);
                p[g][t] = dot;
                block_max = dot > block_max ? dot : block_max;
            }
            const float rescale = expf(running_max[g] - block_max);
            float sum = 0.f;
            for (int t = 0; t < n; t++) { p[g][t] = expf(p[g][t] - block_max); sum += p[g][t]; }
            denom[g] = denom[g] * rescale + sum;
            running_max[g] = block_max;
            float acc_row[MAX_HEAD_DIM];  /* register-resident across tokens */
            for (int d = 0; d < HD; d++) acc_row[d] = acc[g][d] * rescale;
            for (int t = 0; t < n; t++) {
                const void *v = vb + t * a->c_stride_tok * elem;
                const float w = p[g][t];
                for (int d = 0; d < HD; d++) acc_row[d] += w * load(v, d, BF16);
            }
            for (int d = 0; d < HD; d++) acc[g][d] = acc_row[d];
        }
    }
    store_rows(a, s, h, acc, denom, HD, BF16);
}

#include "avx512_math.h"
#include "amx_tiles.h"
#ifdef HAVE_AVX512

/* 16 values of a row of fp32 or bf16 (widened: a bf16 is the top half of an fp32). */
static inline __attribute__((always_inline)) __m512 load16(const void *row, int64_t i, const int BF16) {
    if (BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const bf16_t *)row + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)row + i);
}

/* The sums of sixteen vectors' lanes, as the sixteen lanes of one (lane i: the sum of v[i]).
 * Four rounds of pairing halves (512 -> 256 -> 128 -> 64 -> 32 bits): 45 one-uop shuffles and adds
 * in all. The last round leaves the sum of input 4m + j in lane 4j + m, so the inputs are read in
 * that transposed order and the result comes out in order. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int k = 0; k < 8; k++) {  /* lane halves i, i+8 of an input pair */
        const __m512 a = v[4 * ((2 * k) % 4) + (2 * k) / 4], b = v[4 * ((2 * k + 1) % 4) + (2 * k + 1) / 4];
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int k = 0; k < 4; k++)
        x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; k++)
        y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

#define TILE 16  /* cached tokens per tile: one score per lane */

/* The mask of the first min(n, 16) lanes. */
static inline __attribute__((always_inline)) __mmask16 first_lanes(int n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}


/* The dot product of a query row with a cached K row (fp32 or bf16 as BF16 says), as 16 partial sums.
 * DP (bf16 rows on AVX512-BF16): raw bf16 query pairs times K pairs by the BF16 dot product (exact
 * products, fp32 sums); otherwise the fp32, pre-scaled query times the widened K row. */
static inline __attribute__((always_inline)) __m512 dot16(const float *qf, const bf16_t *qb, const char *k,
                                                         const int HD, const int BF16, const int DP) {
#ifdef __AVX512BF16__
    if (DP) {
        __m512 d = _mm512_setzero_ps();
        for (int j = 0; j < HD / 32; j++)
            d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_loadu_si512(qb + 32 * j),
                                 (__m512bh)_mm512_loadu_si512((const bf16_t *)k + 32 * j));
        return d;
    }
#endif
    (void)qb;
    (void)DP;
    __m512 d = _mm512_mul_ps(_mm512_load_ps(qf), load16(k, 0, BF16));
    for (int j = 1; j < HD / 16; j++) d = _mm512_fmadd_ps(_mm512_load_ps(qf + 16 * j), load16(k, 16 * j, BF16), d);
    return d;
}

/* Where the tile starting at token `start` of the item's sequence lies in the cache (an element
 * offset: block, head, token in block), and how many tokens it has: at most TILE, at most `end - start`,
 * never past its block's end. */
static inline __attribute__((always_inline)) int tile_at(const struct args *a, const int32_t *table, int64_t head,
                                                         int start, int end, int64_t *offset) {
    const int in_block = start % a->block_size;
    int n = end - start < TILE ? end - start : TILE;
    if (n > a->block_size - in_block) n = a->block_size - in_block;
    *offset = (int64_t)table[start / a->block_size] * a->c_stride_block + head + in_block * a->c_stride_tok;
    return n;
}

/* Start reading the K and V rows of the block after the one that ends at token `end` (if the
 * sequence goes on): its loads then overlap this block's arithmetic instead of stalling it. Into L2
 * (T1): the same prefetches into L1 (T0) measured 30 % slower, 64 lines a block at once being more
 * than L1's miss buffers hold. */
static inline __attribute__((always_inline)) void prefetch_next_block(const struct args *a, const int32_t *table,
                                                                      int64_t head, int end, int len,
                                                                      const int HD, const int64_t elem) {
    if (end >= len || end % a->block_size) return;
    const int n = len - end < a->block_size ? len - end : a->block_size;
    const int64_t base = ((int64_t)table[end / a->block_size] * a->c_stride_block + head) * elem;
    const int64_t row = a->c_stride_tok * elem;
    for (int t = 0; t < n; t++)
        for (int64_t c = 0; c < HD * elem; c += 64) {
            _mm_prefetch(a->key_cache + base + t * row + c, _MM_HINT_T1);
            _mm_prefetch(a->value_cache + base + t * row + c, _MM_HINT_T1);
        }
}

#define CHUNK 128  /* cached tokens scored before their softmax and V pass (a multiple of TILE) */

/* Pass 3 of one tile for G query heads at once (G <= 4, head size 64, both compile-time constants):
 * each V row is widened once, into registers, and goes into all G accumulator rows, which stay in
 * registers through the tile. */
static inline __attribute__((always_inline)) void v_tile_grouped(float acc[][MAX_HEAD_DIM], float p[][CHUNK], int off,
                                                                  const char *vb, int64_t row, int n,
                                                                  const int BF16, const int G) {
    __m512 r[4][4];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 4; j++) r[g][j] = _mm512_load_ps(&acc[g][16 * j]);
    for (int t = 0; t < n; t++) {
        __m512 v[4];
        for (int j = 0; j < 4; j++) v[j] = load16(vb + t * row, 16 * j, BF16);
        for (int g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(p[g][off + t]);
            for (int j = 0; j < 4; j++) r[g][j] = _mm512_fmadd_ps(w, v[j], r[g][j]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 4; j++) _mm512_store_ps(&acc[g][16 * j], r[g][j]);
}

/* One sequence's running state for one KV head (seq_chunk): its group's query rows and their
 * online-softmax accumulators. */
struct seq_state {
    float q[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(64)));
    bf16_t qb[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float acc[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float running_max[MAX_GROUP], denom[MAX_GROUP];
};

#ifdef __AVX512BF16__
#define SCORE_DP(BF16) (BF16)  /* bf16 scores by pair dot products: raw bf16 query, scaled afterwards */
#else
#define SCORE_DP(BF16) 0
#endif

/* The state of sequence s, KV head h before its first chunk. */
static inline __attribute__((always_inline)) void seq_begin(const struct args *a, int s, int h, struct seq_state *st,
                                                            const int HD, const int BF16)
{
    const int64_t elem = BF16 ? (int64_t)sizeof(bf16_t) : (int64_t)sizeof(float);
    const int DP = SCORE_DP(BF16), NV = HD / 16;
    for (int g = 0; g < a->group; g++) {
        const char *qs = a->query + (s * a->q_stride_tok + (int64_t)(h * a->group + g) * a->q_stride_head) * elem;
        if (DP) memcpy(st->qb[g], qs, HD * sizeof(bf16_t));
        for (int j = 0; j < NV; j++) {
            if (!DP) _mm512_store_ps(&st->q[g][16 * j], _mm512_mul_ps(load16(qs, 16 * j, BF16), _mm512_set1_ps(a->scale)));
            _mm512_store_ps(&st->acc[g][16 * j], _mm512_setzero_ps());
        }
        st->running_max[g] = -FLT_MAX;
        st->denom[g] = 0.f;
    }
}

/* item_scalar's contract, vectorised (head_dim % 16 == 0), one chunk at a time: the chunk of
 * sequence s, KV head h that starts at cached token `chunk` (a multiple of CHUNK), three passes:
 *   1. scores: tiles of up to 16 tokens (one block's), a query head's 16 scores being 16 dot
 *      products (dot16) reduced together (sum16) and stored to the chunk's score rows;
 *   2. the softmax of each query head over the chunk: one max, exp16 over the rows, one rescale of
 *      the running sums (online softmax between chunks, as flash-decoding does);
 *   3. V: the accumulator rows take each tile's V rows, widened once per tile (v_tile_grouped: all
 *      the group's rows in registers, for head size 64 and groups up to 4; otherwise a row at a
 *      time, bf16 V widened once into L1 scratch and fp32 V read straight from the cache).
 * Scoring a whole chunk before its softmax keeps the dependent steps (max, exp, rescale) off the
 * per-tile path, and each block's K and V rows are prefetched while the block before is scored, so
 * reading the scattered blocks overlaps the arithmetic (benchmarks/cpu_kernels.py). A sequence's
 * result depends only on its own chunks, taken in order: how chunks of several sequences
 * interleave (group_avx512) never changes it. */
static inline __attribute__((always_inline)) void seq_chunk(const struct args *a, int s, int h, struct seq_state *st,
                                                            int chunk, const int HD, const int BF16)
{
    const int64_t elem = BF16 ? (int64_t)sizeof(bf16_t) : (int64_t)sizeof(float);
    const int len = a->seq_lens[s], NV = HD / 16, group = a->group, DP = SCORE_DP(BF16);
    float vt[TILE][MAX_HEAD_DIM] __attribute__((aligned(64)));  /* a tile's V rows widened (bf16, wide groups) */
    float p[MAX_GROUP][CHUNK] __attribute__((aligned(64)));  /* the chunk's scores, then its weights */
    const __m512 score_scale = _mm512_set1_ps(DP ? a->scale : 1.f), lowest = _mm512_set1_ps(-FLT_MAX);
    const int32_t *table = a->block_tables + s * a->bt_stride;
    const int64_t head = h * a->c_stride_head, row = a->c_stride_tok * elem;
    const int end = len - chunk < CHUNK ? len : chunk + CHUNK, cn = end - chunk;
    int64_t offset;
    for (int start = chunk, n; start < end; start += n) {  /* 1. scores */
        n = tile_at(a, table, head, start, end, &offset);
        prefetch_next_block(a, table, head, start + n, len, HD, elem);
        const char *kb = a->key_cache + offset * elem;
        const __mmask16 valid = first_lanes(n);
        for (int g = 0; g < group; g++) {
            __m512 dots[TILE];
            for (int t = 0; t < TILE; t++)  /* rows past the tile's end are never read */
                dots[t] = t < n ? dot16(st->q[g], st->qb[g], kb + t * row, HD, BF16, DP) : _mm512_setzero_ps();
            const __m512 scores = _mm512_mul_ps(sum16(dots), score_scale);
            _mm512_mask_storeu_ps(&p[g][start - chunk], valid, scores);
        }
    }
    for (int g = 0; g < group; g++) {  /* 2. the softmax over the chunk */
        __m512 top = lowest;
        for (int i = 0; i < cn; i += 16) {
            const __mmask16 valid = first_lanes(cn - i);
            top = _mm512_max_ps(top, _mm512_mask_loadu_ps(lowest, valid, &p[g][i]));
        }
        const float chunk_max = _mm512_reduce_max_ps(top);
        const float new_max = chunk_max > st->running_max[g] ? chunk_max : st->running_max[g];
        const __m512 shift = _mm512_set1_ps(new_max);
        __m512 sum = _mm512_setzero_ps();
        for (int i = 0; i < cn; i += 16) {
            const __mmask16 valid = first_lanes(cn - i);
            const __m512 e = _mm512_maskz_mov_ps(
                valid, exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(lowest, valid, &p[g][i]), shift)));
            _mm512_storeu_ps(&p[g][i], e);
            sum = _mm512_add_ps(sum, e);
        }
        const float rescale = expf(st->running_max[g] - new_max);
        st->denom[g] = st->denom[g] * rescale + _mm512_reduce_add_ps(sum);
        st->running_max[g] = new_max;
        for (int j = 0; j < NV; j++)
            _mm512_store_ps(&st->acc[g][16 * j], _mm512_mul_ps(_mm512_load_ps(&st->acc[g][16 * j]), _mm512_set1_ps(rescale)));
    }
    for (int start = chunk, n; start < end; start += n) {  /* 3. V */
        n = tile_at(a, table, head, start, end, &offset);
        const char *vb = a->value_cache + offset * elem;
        if (HD == 64 && group <= 4) {  /* accumulators in registers */
            switch (group) {
            case 1: v_tile_grouped(st->acc, p, start - chunk, vb, row, n, BF16, 1); break;
            case 2: v_tile_grouped(st->acc, p, start - chunk, vb, row, n, BF16, 2); break;
            case 3: v_tile_grouped(st->acc, p, start - chunk, vb, row, n, BF16, 3); break;
            default: v_tile_grouped(st->acc, p, start - chunk, vb, row, n, BF16, 4); break;
            }
            continue;
        }
        if (BF16)
            for (int t = 0; t < n; t++)
                for (int j = 0; j < NV; j++) _mm512_store_ps(&vt[t][16 * j], load16(vb + t * row, 16 * j, 1));
        for (int g = 0; g < group; g++) {
            const float *w = &p[g][start - chunk];
            __m512 acc_row[MAX_HEAD_DIM / 16];
            for (int j = 0; j < NV; j++) acc_row[j] = _mm512_load_ps(&st->acc[g][16 * j]);
            for (int t = 0; t < n; t++) {
                const __m512 wt = _mm512_set1_ps(w[t]);
                for (int j = 0; j < NV; j++)
                    acc_row[j] = _mm512_fmadd_ps(wt, BF16 ? _mm512_load_ps(&vt[t][16 * j]) : load16(vb + t * row, 16 * j, 0),
                                                 acc_row[j]);
            }
            for (int j = 0; j < NV; j++) _mm512_store_ps(&st->acc[g][16 * j], acc_row[j]);
        }
    }
}

#ifdef HAVE_AMX_TILES
/* Work items of at least this many query rows (sequences x group) run their shared chunks on tiles. */
#define TILED_MIN_ROWS 8

/* Tokens [0, n) that are the same cached blocks for every sequence of the item (prefix caching
 * handed them the same blocks), within every sequence's length. */
static int shared_prefix(const struct args *a, const int *seqs, int n) {
    const int32_t *first = a->block_tables + (int64_t)seqs[0] * a->bt_stride;
    int shortest = a->seq_lens[seqs[0]];
    for (int i = 1; i < n; i++)
        shortest = a->seq_lens[seqs[i]] < shortest ? a->seq_lens[seqs[i]] : shortest;
    int b = 0;
    for (; (int64_t)b * a->block_size < shortest; b++) {
        int same = 1;
        for (int i = 1; i < n && same; i++)
            same = a->block_tables[(int64_t)seqs[i] * a->bt_stride + b] == first[b];
        if (!same)
            break;
    }
    return b * a->block_size < shortest ? b * a->block_size : shortest;
}

/* seq_chunk for every sequence of the item at once, for a chunk inside the prefix they share: the
 * item's query rows (sequence-major, `group` rows each) 16 at a time on AMX tiles, S = Q K^T and
 * O = P V as tile products over the chunk's K and V, packed once for all rows. The online softmax
 * is seq_chunk's (fp32, per row, one maximum per chunk), on the same states; only the weights are
 * rounded to bf16 for P V (as SDPA's CPU kernel does), so a row's result is within bf16 rounding of
 * what it gets alone, not bit for bit. */
static void shared_chunk_amx(const struct args *a, const int *seqs, int n, int h, struct seq_state *st, int chunk,
                             const int HD) {
    const int G = a->group, R = n * G, halves = HD / 32, dtiles = HD / 16;
    const int32_t *table = a->block_tables + (int64_t)seqs[0] * a->bt_stride;
    const int64_t head = (int64_t)h * a->c_stride_head;
    uint32_t kt[(CHUNK / 16) * 4 * 256] __attribute__((aligned(64)));  /* head size <= 128 */
    bf16_t vv[(CHUNK / 32) * 8 * 512] __attribute__((aligned(64)));
    bf16_t q[16 * 128] __attribute__((aligned(64)));
    float s[16 * CHUNK] __attribute__((aligned(64)));
    bf16_t p[16 * CHUNK] __attribute__((aligned(64)));
    float tmp[16 * 16] __attribute__((aligned(64)));
    const bf16_t *rows[32];
    for (int b = 0; b < CHUNK / 32; b++) {
        for (int c = 0; c < 2; c++) {  /* 0: K, 1: V */
            const bf16_t *cache = (const bf16_t *)(c ? a->value_cache : a->key_cache);
            for (int k = 0; k < 32; k++)
                rows[k] = amx_cache_row(cache, table, chunk + 32 * b + k, a->block_size, a->c_stride_block,
                                        a->c_stride_tok, head);
            if (c) {
                amx_pack_v32(vv + (int64_t)b * dtiles * 512, rows, HD);
            } else {
                amx_pack_k16(kt + (int64_t)(2 * b) * halves * 256, rows, HD);
                amx_pack_k16(kt + (int64_t)(2 * b + 1) * halves * 256, rows + 16, HD);
            }
        }
    }
    amx_configure_tiles();
    const __m512 scale = _mm512_set1_ps(a->scale), lowest = _mm512_set1_ps(-FLT_MAX);
    for (int r0 = 0; r0 < R; r0 += 16) {
        const int nrows = R - r0 < 16 ? R - r0 : 16;
        for (int r = 0; r < 16; r++) {
            if (r < nrows)
                memcpy(q + r * HD, st[(r0 + r) / G].qb[(r0 + r) % G], HD * sizeof(bf16_t));
            else
                memset(q + r * HD, 0, HD * sizeof(bf16_t));
        }
        for (int b = 0; b < CHUNK / 32; b++) {
#if AMX_TILES_EMULATED
            emu_scores32(s + b * 32, CHUNK, q, HD, kt + (int64_t)(2 * b) * halves * 256,
                         kt + (int64_t)(2 * b + 1) * halves * 256, halves);
#else
            tile_zero(T_S0);
            tile_zero(T_S1);
            for (int hf = 0; hf < halves; hf++) {
                tile_loadd(T_Q, q + hf * 32, HD * sizeof(bf16_t));
                tile_loadd(T_K, kt + ((int64_t)(2 * b) * halves + hf) * 256, 64);
                tile_dpbf16ps(T_S0, T_Q, T_K);
                tile_loadd(T_K, kt + ((int64_t)(2 * b + 1) * halves + hf) * 256, 64);
                tile_dpbf16ps(T_S1, T_Q, T_K);
            }
            tile_stored(T_S0, s + b * 32, CHUNK * sizeof(float));
            tile_stored(T_S1, s + b * 32 + 16, CHUNK * sizeof(float));
#endif
        }
        for (int r = 0; r < 16; r++) {
            if (r >= nrows) {  /* rows past the item's: weights 0 (their products are dropped anyway) */
                memset(p + r * CHUNK, 0, CHUNK * sizeof(bf16_t));
                continue;
            }
            struct seq_state *sr = &st[(r0 + r) / G];
            const int g = (r0 + r) % G;
            __m512 v[CHUNK / 16], top = lowest;
            for (int j = 0; j < CHUNK / 16; j++) {
                v[j] = _mm512_mul_ps(_mm512_load_ps(s + r * CHUNK + 16 * j), scale);
                top = _mm512_max_ps(top, v[j]);
            }
            const float chunk_max = _mm512_reduce_max_ps(top);
            const float new_max = chunk_max > sr->running_max[g] ? chunk_max : sr->running_max[g];
            const __m512 shift = _mm512_set1_ps(new_max);
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < CHUNK / 16; j += 2) {
                const __m512 e0 = exp16(_mm512_sub_ps(v[j], shift)), e1 = exp16(_mm512_sub_ps(v[j + 1], shift));
                sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
                _mm512_store_si512(p + r * CHUNK + 16 * j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            }
            const float rescale = expf(sr->running_max[g] - new_max);
            sr->denom[g] = sr->denom[g] * rescale + _mm512_reduce_add_ps(sum);
            sr->running_max[g] = new_max;
            for (int j = 0; j < HD / 16; j++)
                _mm512_store_ps(&sr->acc[g][16 * j], _mm512_mul_ps(_mm512_load_ps(&sr->acc[g][16 * j]),
                                                                   _mm512_set1_ps(rescale)));
        }
#if AMX_TILES_EMULATED
        /* the chunk's P V for all head dims at once (emu_pv32), from zero, then into the rows' sums */
        float pv[16 * 128] __attribute__((aligned(64)));
        (void)tmp;
        memset(pv, 0, (size_t)16 * HD * sizeof(float));
        for (int b = 0; b < CHUNK / 32; b++)
            emu_pv32(pv, HD, p + b * 32, CHUNK, vv + (int64_t)b * dtiles * 512, dtiles);
        for (int r = 0; r < nrows; r++)
            for (int t = 0; t < dtiles; t++) {
                float *acc = &st[(r0 + r) / G].acc[(r0 + r) % G][16 * t];
                _mm512_store_ps(acc, _mm512_add_ps(_mm512_load_ps(acc), _mm512_load_ps(pv + r * HD + 16 * t)));
            }
#else
        for (int t = 0; t < dtiles; t++) {
            tile_zero(T_O);
            for (int b = 0; b < CHUNK / 32; b++) {
                tile_loadd(T_P, p + b * 32, CHUNK * sizeof(bf16_t));
                tile_loadd(T_V, vv + ((int64_t)b * dtiles + t) * 512, 64);
                tile_dpbf16ps(T_O, T_P, T_V);
            }
            tile_stored(T_O, tmp, 16 * sizeof(float));
            for (int r = 0; r < nrows; r++) {
                float *acc = &st[(r0 + r) / G].acc[(r0 + r) % G][16 * t];
                _mm512_store_ps(acc, _mm512_add_ps(_mm512_load_ps(acc), _mm512_load_ps(tmp + r * 16)));
            }
        }
#endif
    }
    tile_release();
}
#endif

/* Per-thread states for a group's sequences (grown on demand, kept for the thread's life). */
static __thread struct seq_state *thread_states;
static __thread int thread_states_len;

static struct seq_state *states_for(int n) {
    if (thread_states_len < n) {
        free(thread_states);
        thread_states = aligned_alloc(64, (size_t)n * sizeof(struct seq_state));
        thread_states_len = thread_states ? n : 0;
    }
    return thread_states;
}

/* A work item: the sequences seqs[0..n) (which share their first cached block: a common prefix)
 * for KV head h. They go chunk by chunk, every sequence's chunk c before anyone's chunk c + 1, so
 * the K/V rows of a block they share are read from memory once and from cache by the others; each
 * sequence's arithmetic is exactly what it would be alone. */
static inline __attribute__((always_inline)) void group_avx512(const struct args *a, const int *seqs, int n, int h,
                                                               const int HD, const int BF16)
{
    struct seq_state *st = states_for(n);
    if (st == NULL) {  /* out of memory for states: one sequence at a time, on the stack */
        struct seq_state one;
        for (int i = 0; i < n; i++) {
            seq_begin(a, seqs[i], h, &one, HD, BF16);
            for (int chunk = 0; chunk < a->seq_lens[seqs[i]]; chunk += CHUNK) seq_chunk(a, seqs[i], h, &one, chunk, HD, BF16);
            store_rows(a, seqs[i], h, one.acc, one.denom, HD, BF16);
        }
        return;
    }
    int longest = 0;
    for (int i = 0; i < n; i++) {
        seq_begin(a, seqs[i], h, &st[i], HD, BF16);
        longest = a->seq_lens[seqs[i]] > longest ? a->seq_lens[seqs[i]] : longest;
    }
#ifdef HAVE_AMX_TILES
    int tiled_until = 0;  /* chunks before it are shared by every sequence and run on tiles */
    if (BF16 && a->tiles && n * a->group >= TILED_MIN_ROWS && HD <= 128)
        tiled_until = shared_prefix(a, seqs, n) / CHUNK * CHUNK;
#endif
    for (int chunk = 0; chunk < longest; chunk += CHUNK) {
#ifdef HAVE_AMX_TILES
        if (chunk + CHUNK <= tiled_until) {
            shared_chunk_amx(a, seqs, n, h, st, chunk, HD);
            continue;
        }
#endif
        for (int i = 0; i < n; i++)
            if (chunk < a->seq_lens[seqs[i]]) seq_chunk(a, seqs[i], h, &st[i], chunk, HD, BF16);
    }
    for (int i = 0; i < n; i++) store_rows(a, seqs[i], h, st[i].acc, st[i].denom, HD, BF16);
}
#define GROUP_FAST group_avx512
#else
#define GROUP_FAST group_scalar
#endif

/* A work item without the AVX-512 loop: its sequences one after the other (no sharing of reads). */
static inline __attribute__((always_inline)) void group_scalar(const struct args *a, const int *seqs, int n, int h,
                                                               const int HD, const int BF16)
{
    for (int i = 0; i < n; i++) item_scalar(a, (int64_t)seqs[i] * a->num_kv_heads + h, HD, BF16);
}

/* One function per (head size, dtype), each with its own OpenMP loop: the loop body is outlined per
 * function, so HD reaches the item code as a constant (fully unrolled inner loops). Work items are
 * (group of sequences, KV head) pairs (see make_groups), spread over the threads dynamically
 * (sequences differ in length). */
#define VARIANT(NAME, GROUP, HD, BF16) \
static void NAME(const struct args *a, const int *order, const int *starts, int num_groups, int head_dim, \
                 int num_threads) { \
    (void)head_dim; \
    const int64_t num_items = (int64_t)num_groups * a->num_kv_heads; \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)") \
    for (int64_t item = 0; item < num_items; item++) { \
        const int gi = (int)(item / a->num_kv_heads), h = (int)(item % a->num_kv_heads); \
        GROUP(a, order + starts[gi], starts[gi + 1] - starts[gi], h, HD, BF16); \
    } \
}
VARIANT(decode_f32_64, GROUP_FAST, 64, 0)
VARIANT(decode_f32_128, GROUP_FAST, 128, 0)
VARIANT(decode_f32_any, group_scalar, head_dim, 0)
VARIANT(decode_bf16_64, GROUP_FAST, 64, 1)
VARIANT(decode_bf16_128, GROUP_FAST, 128, 1)
VARIANT(decode_bf16_any, group_scalar, head_dim, 1)
#undef VARIANT

/* The exported entry points: `_f32` takes fp32 query, caches and output; `_bf16` bf16 ones (raw bf16
 * bits as uint16), with fp32 arithmetic inside. Limits (checked by the caller, paged_kernels/cpu.py):
 * num_heads % num_kv_heads == 0, group <= 16, head_dim <= 256, block_size <= 128, every
 * seq_len >= 1. Strides are in elements. */
/* Sequences that share their first cached block share a prompt prefix (prefix caching hands them
 * the same blocks). Groups of such sequences, at most GROUP_SEQS each, become one work item per KV
 * head: order[starts[g]..starts[g + 1]) are group g's rows. Rows sharing nothing are groups of one,
 * in their own order. Returns the number of groups. */
#define GROUP_SEQS 16
struct keyed { int32_t block; int row; };

static int by_block(const void *x, const void *y) {
    const struct keyed *p = x, *q = y;
    if (p->block != q->block) return p->block < q->block ? -1 : 1;
    return p->row - q->row;
}

static int make_groups(const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int num_seqs,
                       int *order, int *starts) {
    struct keyed *keys = malloc((size_t)num_seqs * sizeof *keys);
    if (keys == NULL) {  /* no memory to sort: every row its own group */
        for (int i = 0; i < num_seqs; i++) order[i] = starts[i] = i;
        starts[num_seqs] = num_seqs;
        return num_seqs;
    }
    for (int i = 0; i < num_seqs; i++) {
        keys[i].block = seq_lens[i] > 0 ? block_tables[i * bt_stride] : -1 - i;
        keys[i].row = i;
    }
    qsort(keys, num_seqs, sizeof *keys, by_block);
    int groups = 0;
    for (int i = 0; i < num_seqs; i++) {
        if (i == 0 || keys[i].block != keys[i - 1].block || i - starts[groups - 1] == GROUP_SEQS)
            starts[groups++] = i;
        order[i] = keys[i].row;
    }
    starts[groups] = num_seqs;
    free(keys);
    return groups;
}

/* The exported entry points: `_f32` takes fp32 query, caches and output; `_bf16` bf16 ones (raw bf16
 * bits as uint16), with fp32 arithmetic inside. Limits (checked by the caller, paged_kernels/cpu.py):
 * num_heads % num_kv_heads == 0, group <= 16, head_dim <= 256, block_size <= 128, every
 * seq_len >= 1. Strides are in elements.
 * `tiles` (bf16 only): the chunks that all sequences of a work item share (a cached prompt prefix)
 * run on tiles (AMX, or emulated) for all of them at once (shared_chunk_amx) where the build and Linux allow; 0
 * keeps every row's arithmetic exactly what it is alone. */
#ifdef HAVE_AMX_TILES
#define TILES_ALLOWED(tiles) ((tiles) && amx_permitted())
#else
#define TILES_ALLOWED(tiles) 0
#endif
#define ENTRY_POINT(NAME, T, SUFFIX) \
void NAME( \
    const T *query, int64_t q_stride_tok, int64_t q_stride_head, \
    const T *key_cache, const T *value_cache, \
    int64_t c_stride_block, int64_t c_stride_tok, int64_t c_stride_head, \
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, \
    T *out, int64_t o_stride_tok, int64_t o_stride_head, \
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, \
    int num_threads, int tiles) \
{ \
    const struct args a = { \
        (const char *)query, (const char *)key_cache, (const char *)value_cache, \
        q_stride_tok, q_stride_head, c_stride_block, c_stride_tok, c_stride_head, bt_stride, \
        block_tables, seq_lens, (char *)out, o_stride_tok, o_stride_head, \
        num_kv_heads, num_heads / num_kv_heads, block_size, scale, TILES_ALLOWED(tiles)}; \
    int stack_order[256], stack_starts[257]; \
    int *order = num_seqs <= 256 ? stack_order : malloc((size_t)num_seqs * sizeof(int)); \
    int *starts = num_seqs <= 256 ? stack_starts : malloc((size_t)(num_seqs + 1) * sizeof(int)); \
    if (order == NULL || starts == NULL) { free(order == stack_order ? NULL : order); \
        free(starts == stack_starts ? NULL : starts); return; } \
    const int groups = make_groups(block_tables, bt_stride, seq_lens, num_seqs, order, starts); \
    if (head_dim == 64) decode_##SUFFIX##_64(&a, order, starts, groups, head_dim, num_threads); \
    else if (head_dim == 128) decode_##SUFFIX##_128(&a, order, starts, groups, head_dim, num_threads); \
    else decode_##SUFFIX##_any(&a, order, starts, groups, head_dim, num_threads); \
    if (order != stack_order) free(order); \
    if (starts != stack_starts) free(starts); \
}

ENTRY_POINT(paged_decode_attention_f32, float, f32)
ENTRY_POINT(paged_decode_attention_bf16, bf16_t, bf16)
#undef ENTRY_POINT

/* 1 when this build has the intrinsics loop for `head_dim` (AVX-512, head size 64 or 128), else 0:
 * the plain C loop is fine for decode rows, but prefill chunks go to SDPA without the fast loop. */
int paged_decode_attention_vectorized(int head_dim) {
#ifdef HAVE_AVX512
    return head_dim == 64 || head_dim == 128;
#else
    (void)head_dim;
    return 0;
#endif
}
