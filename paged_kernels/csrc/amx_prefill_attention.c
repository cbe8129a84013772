/* Prefill attention for a bf16 paged KV cache on AMX tiles (Intel Sapphire Rapids and later).
 *
 * The prefill chunks of a step, in one call: a chunk is q_len query tokens, the last q_len positions
 * of its sequence's seq_len; token i attends to the first seq_len - q_len + i + 1 positions (its
 * causal prefix), read through the sequence's block table. A flash-attention loop per (chunk, query
 * head, block of 16 tokens), the work items spread over the threads:
 *
 *   S = Q K^T      16 tokens x 32 keys, two TDPBF16PS per 16 keys and 32 head dims (fp32 sums)
 *   softmax        online, in fp32 with AVX-512 (row max, e^x, row sum), masked past each token
 *   O += P V       P rounded to bf16 (as SDPA's CPU kernel does), 16 head dims per tile
 *
 * The tiles want K^T and V in pair-interleaved (VNNI) layout: before the loop every 32-key block
 * the chunks read is packed once per KV head (K transposed into 16 x 16 tiles of dim pairs, V's
 * rows interleaved in pairs; positions past seq_len are zeros, never attended). Blocks that read
 * the same cache rows are packed once for all chunks: prefix caching gives sequences the same
 * cache blocks for a shared prompt prefix, and a step that prefills many chunks after one cached
 * prefix would otherwise repack it for each. A chunk's result is the same whichever chunks share
 * its call (the same arithmetic on the same packed values).
 *
 * Built where the compiler targets AMX-BF16 and AVX-512 BF16 (-march=native on such a CPU), and
 * with the tiles emulated where it targets AVX-512 BF16 alone (amx_tiles.h; amx_prefill_emulated()
 * says 1); elsewhere amx_prefill_available() says 0 and the caller keeps its other paths. The
 * process must be allowed to use the tile registers: the first call asks Linux (arch_prctl) and
 * says 0 if refused.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"

#ifdef HAVE_AMX_TILES
#define QB 16 /* query tokens per block (tile rows) */
#define KB 32 /* keys per block (two S tiles, one P tile's columns) */
#define MAX_D 128
/* The score of a masked key and the maximum before any key: finite (the kernels build with
 * -ffinite-math-only); e^(LOWEST - x) is ~0 and masked weights are set to exactly 0. */
#define LOWEST (-1e30f)
#define RESCALE_MARGIN 8.f

/* The packed K and V of 32 keys ("a slot") for one KV head: K as the two B tiles of S = Q K^T per
 * 32 head dims (amx_tiles.h's amx_pack_k16: keys 0-15, then 16-31), then V as the B tiles of
 * O = P V per 16 head dims (amx_pack_v32). Bytes per slot and KV head: */
static inline int64_t slot_bytes(int head_dim) { return (int64_t)head_dim * 128; }

/* Pack keys [32 c, 32 c + 32) of a sequence (its block table, seq_len) for KV head `kv` into `slot`;
 * positions past seq_len are zeros, never attended. */
static void pack_slot(char *slot, const bf16_t *key_cache, const bf16_t *value_cache, const int32_t *table, int seq_len,
                      int c, int head_dim, int block_size, int64_t s_block, int64_t s_pos, int64_t offset) {
    const bf16_t *krows[KB], *vrows[KB];
    for (int k = 0; k < KB; k++) {
        const int64_t pos = (int64_t)c * KB + k;
        krows[k] = pos < seq_len ? amx_cache_row(key_cache, table, pos, block_size, s_block, s_pos, offset) : NULL;
        vrows[k] = pos < seq_len ? amx_cache_row(value_cache, table, pos, block_size, s_block, s_pos, offset) : NULL;
    }
    uint32_t *kt = (uint32_t *)slot;
    amx_pack_k16(kt, krows, head_dim);
    amx_pack_k16(kt + (head_dim / 32) * 256, krows + 16, head_dim);
    amx_pack_v32((bf16_t *)(slot + slot_bytes(head_dim) / 2), vrows, head_dim);
}

/* What every sequence of a call shares. */
struct call {
    const bf16_t *q;
    int64_t q_tok, q_head;
    bf16_t *out;
    int64_t o_tok, o_head;
    const char *packed; /* slots x KV heads x slot_bytes */
    int num_heads, num_kv_heads, group, head_dim;
    float scale;
};

/* One sequence's chunk: its first query row (in q and out), its lengths, and the slot of each of
 * its 32-key blocks. */
struct chunk {
    int64_t row;
    int q_len, seq_len;
    const int32_t *slots;
};

/* The online softmax of one 32-key block of scores `sc` (16 rows of S = Q K^T, unscaled) into the
 * bf16 weights `p`, for rows i0.. of a chunk with `ctx` cached positions before it. A row's maximum
 * m is raised only when a score passes it by more than RESCALE_MARGIN (FlashAttention-4's
 * conditional rescaling): the weights stay below e^8, and most blocks rescale nothing. Exact: any
 * maximum gives the same quotient. Scores stay unscaled until the exponent (fused: s * scale - m);
 * masks only on the blocks the causal diagonal crosses. alpha[r]: the factor row r's sums so far
 * take (1: none); lacc: the rows' sums, lane-wise until the end. Returns whether any alpha is not 1. */
static inline __attribute__((always_inline)) int block_softmax(const struct call *c, const float *sc, bf16_t *p,
                                                               float *m, float *threshold, float *alpha, float *lacc,
                                                               int64_t ctx, int i0, int b) {
    const __m512 scale = _mm512_set1_ps(c->scale), lowest = _mm512_set1_ps(LOWEST);
    const int whole = (int64_t)(b + 1) * KB <= ctx + i0 + 1; /* every row sees all 32 keys */
    int rescaled = 0;
    for (int r = 0; r < QB; r++) {
        __m512 slo = _mm512_load_ps(sc + r * KB), shi = _mm512_load_ps(sc + r * KB + 16);
        __mmask16 mlo = 0xffff, mhi = 0xffff;
        if (!whole) { /* keys this row attends in the block: those before ctx + i0 + r + 1 */
            int64_t visible = ctx + i0 + r + 1 - (int64_t)b * KB;
            visible = visible < 0 ? 0 : (visible > KB ? KB : visible);
            mlo = visible >= 16 ? 0xffff : (__mmask16)((1u << visible) - 1);
            mhi = visible <= 16 ? 0 : (visible >= 32 ? 0xffff : (__mmask16)((1u << (visible - 16)) - 1));
            slo = _mm512_mask_mov_ps(lowest, mlo, slo);
            shi = _mm512_mask_mov_ps(lowest, mhi, shi);
        }
        const __m512 smax = _mm512_max_ps(slo, shi);
        float a = 1.f;
        if (_mm512_cmp_ps_mask(smax, _mm512_set1_ps(threshold[r]), _CMP_GT_OQ)) {
            const float block_max = _mm512_reduce_max_ps(smax) * c->scale;
            a = exp16(_mm512_set1_ps(m[r] - block_max))[0]; /* ~0 on the first block */
            m[r] = block_max;
            threshold[r] = (block_max + RESCALE_MARGIN) / c->scale;
            rescaled = 1;
        }
        alpha[r] = a;
        const __m512 vm = _mm512_set1_ps(m[r]);
        __m512 plo = exp16_bf16(_mm512_fmsub_ps(slo, scale, vm));
        __m512 phi = exp16_bf16(_mm512_fmsub_ps(shi, scale, vm));
        if (!whole) {
            plo = _mm512_maskz_mov_ps(mlo, plo);
            phi = _mm512_maskz_mov_ps(mhi, phi);
        }
        _mm512_store_si512(p + r * KB, (__m512i)_mm512_cvtne2ps_pbh(phi, plo)); /* keys 0-15, 16-31 */
        float *acc = lacc + r * 16;
        const __m512 sum = _mm512_add_ps(plo, phi);
        _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_load_ps(acc), _mm512_set1_ps(a), sum));
    }
    return rescaled;
}

/* o's rows (16 of D fp32) times their alpha. */
static inline __attribute__((always_inline)) void rescale_rows(float *o, const float *alpha, int D) {
    for (int r = 0; r < QB; r++)
        if (alpha[r] != 1.f)
            for (int d = 0; d < D; d += 16)
                _mm512_store_ps(o + r * D + d, _mm512_mul_ps(_mm512_load_ps(o + r * D + d), _mm512_set1_ps(alpha[r])));
}

/* Head size 64: O's four 16-dim tiles stay in tile registers from block to block (the tile
 * products add into them), stored and rescaled only in a block where some row's maximum rose. The
 * other tiles are then two for S and one each for A (Q, then P) and B (K, then V): all eight. */
#define T_A T_Q /* 0 */
#define T_B T_K /* 2 */
#define T_O0 1
#define T_O1 5
#define T_O2 6
#define T_O3 7

static inline __attribute__((always_inline)) void store_o64(float *o) {
    tile_stored(T_O0, o, 64 * sizeof(float));
    tile_stored(T_O1, o + 16, 64 * sizeof(float));
    tile_stored(T_O2, o + 32, 64 * sizeof(float));
    tile_stored(T_O3, o + 48, 64 * sizeof(float));
}

/* Where 32-key block b of chunk s lies packed for KV head kv: K's tiles, then V's (slot_bytes / 2 in). */
static inline __attribute__((always_inline)) const char *packed_block(const struct call *c, const struct chunk *s,
                                                                      int kv, int b) {
    return c->packed + ((int64_t)s->slots[b] * c->num_kv_heads + kv) * slot_bytes(c->head_dim);
}

/* S = Q K^T of one 32-key block, in two parts: the tile products into T_S0, T_S1 (two per 32 head
 * dims; Q through T_Q and K through T_K, the head-size-64 path's T_A and T_B), then their store into
 * sc (16 rows of 32 fp32). The head-size-64 loop puts the next block's products before this
 * block's softmax and their store after it. */
static inline __attribute__((always_inline)) void block_scores_issue(const bf16_t *qbase, int64_t qstride,
                                                                     const uint32_t *kt, int halves) {
    tile_zero(T_S0);
    tile_zero(T_S1);
    for (int h = 0; h < halves; h++) {
        tile_loadd(T_Q, qbase + h * 32, qstride);
        tile_loadd(T_K, kt + h * 256, 64);
        tile_dpbf16ps(T_S0, T_Q, T_K);
        tile_loadd(T_K, kt + (halves + h) * 256, 64);
        tile_dpbf16ps(T_S1, T_Q, T_K);
    }
}

static inline __attribute__((always_inline)) void block_scores_store(float *sc) {
    tile_stored(T_S0, sc, KB * sizeof(float));
    tile_stored(T_S1, sc + 16, KB * sizeof(float));
}

/* One query head's block of up to 16 tokens starting at token i0 of chunk `s`. */
static void query_block(const struct call *c, const struct chunk *s, int head, int i0) {
    const int D = c->head_dim, halves = D / 32, dtiles = D / 16;
    const int kv = head / c->group, rows = s->q_len - i0 < QB ? s->q_len - i0 : QB;
    const int64_t ctx = s->seq_len - s->q_len, stride = slot_bytes(D);
    bf16_t qpad[QB * MAX_D] __attribute__((aligned(64)));
    float sc[2][QB * KB] __attribute__((aligned(64)));  /* this block's scores, and the next one's */
    bf16_t p[QB * KB] __attribute__((aligned(64)));
    float o[QB * MAX_D] __attribute__((aligned(64)));
    float tmp[QB * 16] __attribute__((aligned(64)));
    float m[QB] __attribute__((aligned(64))), alpha[QB] __attribute__((aligned(64)));
    float lacc[QB * 16] __attribute__((aligned(64)));

    const bf16_t *qbase = c->q + (s->row + i0) * c->q_tok + head * c->q_head;
    int64_t qstride = c->q_tok * 2; /* bytes */
    if (rows < QB) { /* the chunk's last, partial block: zero-padded rows (their results are dropped) */
        memset(qpad, 0, sizeof qpad);
        for (int r = 0; r < rows; r++)
            memcpy(qpad + r * D, qbase + r * c->q_tok, D * sizeof(bf16_t));
        qbase = qpad;
        qstride = D * 2;
    }
    memset(lacc, 0, sizeof lacc);
    float threshold[QB]; /* a row's maximum is raised when an unscaled score passes this */
    for (int r = 0; r < QB; r++) {
        m[r] = LOWEST;
        threshold[r] = LOWEST;
    }
    /* keys the block's last real token attends: [0, ctx + i0 + rows) */
    const int64_t num_keys = ctx + i0 + rows;
    const int num_kblocks = (int)((num_keys + KB - 1) / KB);
#if AMX_TILES_EMULATED
    /* Emulated tiles: each block's scores and P V as fused products (amx_tiles.h's emu_scores32,
     * emu_pv32), O in memory; the same chains as the tile products, block after block. The weights
     * of block b + 1 are made before block b's P V, which so reads weights stored a block earlier: read
     * straight after their store, each broadcast 4-byte pair waits for its 64-byte store to land
     * (64 tokens after 1,024 cached: 0.323 ms a layer that way, 0.299 this way, on an AMD Zen 5). */
    (void)tmp;
    bf16_t p_next[QB * KB] __attribute__((aligned(64)));
    float alpha_next[QB] __attribute__((aligned(64)));
    bf16_t *pw[2] = {p, p_next};
    float *aw[2] = {alpha, alpha_next};
    int rescaled[2];
    memset(o, 0, (size_t)QB * D * sizeof(float));
    for (int b = -1; b < num_kblocks; b++) {
        if (b + 1 < num_kblocks) { /* block b + 1's weights */
            const int n = (b + 1) & 1;
            const uint32_t *kt = (const uint32_t *)packed_block(c, s, kv, b + 1);
            emu_scores32(sc[n], KB, qbase, qstride / 2, kt, kt + halves * 256, halves);
            rescaled[n] = block_softmax(c, sc[n], pw[n], m, threshold, aw[n], lacc, ctx, i0, b + 1);
        }
        if (b < 0)
            continue;
        if (rescaled[b & 1] && b > 0)
            rescale_rows(o, aw[b & 1], D); /* some row's maximum rose: its sums so far scale down */
        emu_pv32(o, D, pw[b & 1], KB, (const bf16_t *)(packed_block(c, s, kv, b) + stride / 2), dtiles);
    }
#else
    if (D == 64) {
        tile_zero(T_O0);
        tile_zero(T_O1);
        tile_zero(T_O2);
        tile_zero(T_O3);
        /* Pipelined: the tile products of block b + 1's scores are issued before block b's
         * softmax (AVX-512) and stored after it, so the tile unit works while the vector units
         * do; the same arithmetic in the same order for every value. */
        block_scores_issue(qbase, qstride, (const uint32_t *)packed_block(c, s, kv, 0), 2);
        block_scores_store(sc[0]);
        for (int b = 0; b < num_kblocks; b++) {
            const char *slot = packed_block(c, s, kv, b);
            const bf16_t *vv = (const bf16_t *)(slot + stride / 2);
            const int more = b + 1 < num_kblocks;
            if (more)
                block_scores_issue(qbase, qstride, (const uint32_t *)packed_block(c, s, kv, b + 1), 2);
            const int rescaled = block_softmax(c, sc[b & 1], p, m, threshold, alpha, lacc, ctx, i0, b);
            if (more)
                block_scores_store(sc[(b + 1) & 1]);
            if (rescaled && b > 0) {
                store_o64(o); /* some row's maximum rose: its sums so far scale down */
                rescale_rows(o, alpha, 64);
                tile_loadd(T_O0, o, 64 * sizeof(float));
                tile_loadd(T_O1, o + 16, 64 * sizeof(float));
                tile_loadd(T_O2, o + 32, 64 * sizeof(float));
                tile_loadd(T_O3, o + 48, 64 * sizeof(float));
            }
            tile_loadd(T_A, p, KB * sizeof(bf16_t));
            tile_loadd(T_B, vv, 64);
            tile_dpbf16ps(T_O0, T_A, T_B);
            tile_loadd(T_B, vv + 512, 64);
            tile_dpbf16ps(T_O1, T_A, T_B);
            tile_loadd(T_B, vv + 2 * 512, 64);
            tile_dpbf16ps(T_O2, T_A, T_B);
            tile_loadd(T_B, vv + 3 * 512, 64);
            tile_dpbf16ps(T_O3, T_A, T_B);
        }
        store_o64(o);
    } else {
        memset(o, 0, (size_t)QB * D * sizeof(float));
        for (int b = 0; b < num_kblocks; b++) {
            const char *slot = packed_block(c, s, kv, b);
            const bf16_t *vv = (const bf16_t *)(slot + stride / 2);
            block_scores_issue(qbase, qstride, (const uint32_t *)slot, halves);
            block_scores_store(sc[0]);
            block_softmax(c, sc[0], p, m, threshold, alpha, lacc, ctx, i0, b);
            tile_loadd(T_P, p, KB * sizeof(bf16_t));
            for (int t = 0; t < dtiles; t++) {
                tile_zero(T_O);
                tile_loadd(T_V, vv + t * 512, 64);
                tile_dpbf16ps(T_O, T_P, T_V);
                tile_stored(T_O, tmp, 16 * sizeof(float));
                for (int r = 0; r < QB; r++) { /* alpha 1 (no rescale) adds exactly */
                    float *row = o + r * D + t * 16;
                    _mm512_store_ps(row, _mm512_fmadd_ps(_mm512_load_ps(row), _mm512_set1_ps(alpha[r]),
                                                         _mm512_load_ps(tmp + r * 16)));
                }
            }
        }
    }
#endif
    for (int r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(lacc + r * 16)));
        bf16_t *dst = c->out + (s->row + i0 + r) * c->o_tok + head * c->o_head;
        for (int d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + r * D + d), inv)));
    }
}


/* A buffer per calling thread, kept from call to call (a fresh one would fault its pages in at
 * every layer) and grown to the largest need seen; NULL if it cannot grow. */
struct scratch {
    void *data;
    size_t capacity;
};

static void *scratch_get(struct scratch *s, size_t need) {
    if (need > s->capacity) {
        free(s->data);
        s->capacity = 0;
        s->data = aligned_alloc(64, (need + 63) / 64 * 64);
        if (!s->data)
            return NULL;
        s->capacity = need;
    }
    return s->data;
}

/* 32-key blocks that read the same cache rows get one slot: prefix caching gives sequences the
 * same blocks, so a cached prefix that several chunks of a step attend to is packed once. A block
 * is named by where its first and seventeenth rows lie and how many of its rows are in the
 * sequence (with block sizes that are multiples of 16, rows 0-15 and 16-31 are each contiguous in
 * one cache block). Open addressing over a power-of-two table. */
struct slot_key {
    int64_t first, second;
    int valid;
};

static int64_t row_at(const int32_t *table, int64_t pos, int block_size, int64_t s_block, int64_t s_pos) {
    return (int64_t)table[pos / block_size] * s_block + (pos % block_size) * s_pos;
}

/* Sequences [s0, s1) of the batch: slots assigned (dedup where the block size allows), packed, attended. */
static int run_group(const struct call *base, const bf16_t *key_cache, const bf16_t *value_cache, int64_t s_block,
                     int64_t s_pos, int64_t s_head, const int32_t *block_tables, const int32_t *table_rows,
                     int64_t bt_stride, const int32_t *seq_lens, const int32_t *q_lens, const int32_t *q_starts,
                     int s0, int s1, int block_size, int num_threads) {
    static __thread struct scratch packed_buf = {NULL, 0}, meta_buf = {NULL, 0};
    const int D = base->head_dim, num_kv = base->num_kv_heads, dedup = block_size % 16 == 0;
    int64_t total = 0, items = 0;
    for (int s = s0; s < s1; s++) {
        total += (seq_lens[s] + KB - 1) / KB;
        items += (int64_t)base->num_heads * ((q_lens[s] + QB - 1) / QB);
    }
    int64_t buckets = 16;
    while (buckets < 2 * total)
        buckets *= 2;
    /* metadata: per block its slot; per slot its (sequence, block); the hash table; the chunks; the work items */
    const size_t meta = (size_t)total * sizeof(int32_t) + (size_t)total * 2 * sizeof(int32_t) +
                        (size_t)buckets * (sizeof(struct slot_key) + sizeof(int32_t)) +
                        (size_t)(s1 - s0) * sizeof(struct chunk) + (size_t)items * 2 * sizeof(int32_t) + 256;
    char *m = scratch_get(&meta_buf, meta);
    if (!m)
        return -1;
    int32_t *block_slot = (int32_t *)m;
    int32_t *slot_source = block_slot + total;
    struct slot_key *keys = (struct slot_key *)(((uintptr_t)(slot_source + 2 * total) + 15) & ~(uintptr_t)15);
    int32_t *bucket_slot = (int32_t *)(keys + buckets);
    struct chunk *chunks = (struct chunk *)(((uintptr_t)(bucket_slot + buckets) + 15) & ~(uintptr_t)15);
    int32_t *work = (int32_t *)(chunks + (s1 - s0));
    for (int64_t i = 0; i < buckets; i++)
        bucket_slot[i] = -1;
    int32_t num_slots = 0;
    int64_t next = 0, w = 0;
    for (int s = s0; s < s1; s++) {
        const int32_t *table = block_tables + (int64_t)table_rows[s] * bt_stride;
        const int seq_len = seq_lens[s], nb = (seq_len + KB - 1) / KB;
        struct chunk *ch = &chunks[s - s0];
        ch->row = q_starts[s];
        ch->q_len = q_lens[s];
        ch->seq_len = seq_len;
        ch->slots = block_slot + next;
        for (int b = 0; b < nb; b++) {
            int32_t slot = -1;
            if (dedup) {
                const int64_t pos = (int64_t)b * KB;
                const int valid = seq_len - pos < KB ? (int)(seq_len - pos) : KB;
                const struct slot_key key = {row_at(table, pos, block_size, s_block, s_pos),
                                             valid > 16 ? row_at(table, pos + 16, block_size, s_block, s_pos) : -1,
                                             valid};
                uint64_t h = (uint64_t)key.first * 0x9E3779B97F4A7C15ull ^ (uint64_t)key.second * 0xC2B2AE3D27D4EB4Full ^
                             (uint64_t)key.valid;
                int64_t i = (int64_t)((h ^ (h >> 29)) & (uint64_t)(buckets - 1));
                while (bucket_slot[i] >= 0 && !(keys[i].first == key.first && keys[i].second == key.second &&
                                                 keys[i].valid == key.valid))
                    i = (i + 1) & (buckets - 1);
                if (bucket_slot[i] < 0) {
                    keys[i] = key;
                    bucket_slot[i] = num_slots++;
                    slot_source[2 * bucket_slot[i]] = s;
                    slot_source[2 * bucket_slot[i] + 1] = b;
                }
                slot = bucket_slot[i];
            } else {
                slot = num_slots++;
                slot_source[2 * slot] = s;
                slot_source[2 * slot + 1] = b;
            }
            block_slot[next + b] = slot;
        }
        next += nb;
        const int nq = (q_lens[s] + QB - 1) / QB;
        for (int qb = 0; qb < nq; qb++)
            for (int h = 0; h < base->num_heads; h++) {
                work[2 * w] = s - s0;
                work[2 * w + 1] = qb * QB * base->num_heads + h; /* token i0 * heads + head */
                w++;
            }
    }
    const int64_t stride = slot_bytes(D);
    char *packed = scratch_get(&packed_buf, (size_t)num_slots * num_kv * stride);
    if (!packed)
        return -1;
    struct call c = *base;
    c.packed = packed;
    const int64_t num_packs = (int64_t)num_slots * num_kv;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_packs; i++) {
            const int slot = (int)(i / num_kv), kv = (int)(i % num_kv);
            const int s = slot_source[2 * slot], b = slot_source[2 * slot + 1];
            pack_slot(packed + i * stride, key_cache, value_cache, block_tables + (int64_t)table_rows[s] * bt_stride,
                      seq_lens[s], b, D, block_size, s_block, s_pos, (int64_t)kv * s_head);
        }
        amx_configure_tiles();
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            const int token_head = work[2 * i + 1];
            query_block(&c, &chunks[work[2 * i]], token_head % c.num_heads, token_head / c.num_heads);
        }
        tile_release();
    }
    return 0;
}

#endif

/* 1 where the tiles are emulated with AVX-512 BF16 (amx_tiles.h), 0 on AMX hardware or without tiles. */
int amx_prefill_emulated(void) {
#ifdef HAVE_AMX_TILES
    return AMX_TILES_EMULATED;
#else
    return 0;
#endif
}

int amx_prefill_available(int head_dim) {
#ifdef HAVE_AMX_TILES
    return (head_dim == 64 || head_dim == 128) && amx_permitted();
#else
    (void)head_dim;
    return 0;
#endif
}

/* Prefill chunks of several sequences in one call. Sequence i's chunk is q_lens[i] query tokens,
 * the last of its seq_lens[i] positions, at rows q_starts[i].. of q and out; its block table is row
 * table_rows[i] of block_tables (bt_stride entries per row, int32). Token j attends to the first
 * seq_len - q_len + j + 1 positions (its causal prefix). Each 32-key block of K/V is packed once
 * for all chunks that read it (a shared cached prefix), then every (chunk, query head, 16 query
 * tokens) is a work item over the threads. Strides are in elements; the cache is
 * [blocks][block_size][kv heads][D] by its strides. The packed K/V stay under `packed_budget` bytes:
 * sequences go in groups that fit (counted without sharing; a longer sequence goes alone, as one
 * group). Returns 0 when done, -1 when this call is not
 * for it (no AMX permission, head size, lengths, no memory): the caller then takes another path. */
int amx_prefill_attention_batch(const bf16_t *q, int64_t q_tok, int64_t q_head, const bf16_t *key_cache,
                                const bf16_t *value_cache, int64_t s_block, int64_t s_pos, int64_t s_head,
                                const int32_t *block_tables, int64_t bt_stride, const int32_t *table_rows,
                                const int32_t *seq_lens, const int32_t *q_lens, const int32_t *q_starts, int num_seqs,
                                bf16_t *out, int64_t o_tok, int64_t o_head, int num_heads, int num_kv_heads,
                                int head_dim, int block_size, float scale, int64_t packed_budget, int num_threads) {
#ifndef HAVE_AMX_TILES
    (void)q, (void)q_tok, (void)q_head, (void)key_cache, (void)value_cache, (void)s_block, (void)s_pos;
    (void)s_head, (void)block_tables, (void)bt_stride, (void)table_rows, (void)seq_lens, (void)q_lens;
    (void)q_starts, (void)num_seqs, (void)out, (void)o_tok, (void)o_head, (void)num_heads, (void)num_kv_heads;
    (void)head_dim, (void)block_size, (void)scale, (void)packed_budget, (void)num_threads;
    return -1;
#else
    if (!amx_prefill_available(head_dim) || num_heads % num_kv_heads || num_seqs < 1)
        return -1;
    for (int s = 0; s < num_seqs; s++)
        if (q_lens[s] < 1 || q_lens[s] > seq_lens[s])
            return -1;
    const struct call base = {q, q_tok, q_head, out, o_tok, o_head, NULL,
                              num_heads, num_kv_heads, num_heads / num_kv_heads, head_dim, scale};
    const size_t per_block = (size_t)num_kv_heads * slot_bytes(head_dim);
    for (int s0 = 0; s0 < num_seqs;) { /* groups whose packed K/V fit the budget (counted without dedup) */
        int s1 = s0;
        size_t bytes = 0;
        while (s1 < num_seqs) {
            const size_t more = (size_t)((seq_lens[s1] + KB - 1) / KB) * per_block;
            if (s1 > s0 && bytes + more > (size_t)packed_budget)
                break;
            bytes += more;
            s1++;
        }
        if (run_group(&base, key_cache, value_cache, s_block, s_pos, s_head, block_tables, table_rows, bt_stride,
                      seq_lens, q_lens, q_starts, s0, s1, block_size, num_threads))
            return -1;
        s0 = s1;
    }
    return 0;
#endif
}
