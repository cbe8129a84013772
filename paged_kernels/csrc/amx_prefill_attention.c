/* Prefill attention for a bf16 paged KV cache on AMX tiles (Intel Sapphire Rapids and later).
 *
 * One sequence's chunk of q_len query tokens, the last q_len positions of its seq_len: token i
 * attends to the first seq_len - q_len + i + 1 positions (its causal prefix), read through the
 * sequence's block table. A flash-attention loop per (query head, block of 16 tokens):
 *
 *   S = Q K^T      16 tokens x 32 keys, two TDPBF16PS per 16 keys and 32 head dims (fp32 sums)
 *   softmax        online, in fp32 with AVX-512 (row max, e^x, row sum), masked past each token
 *   O += P V       P rounded to bf16 (as SDPA's CPU kernel does), 16 head dims per tile
 *
 * The tiles want K^T and V in pair-interleaved (VNNI) layout: before the loop each KV head's K is
 * transposed into 16 x 16 tiles of dim pairs and V's rows are interleaved in pairs, once per call
 * for all query blocks (positions past seq_len are zeros, never attended).
 *
 * Built only where the compiler targets AMX-BF16 and AVX-512 BF16 (-march=native on such a CPU);
 * elsewhere amx_prefill_available() says 0 and the caller keeps its other paths. The process must
 * be allowed to use the tile registers: the first call asks Linux (arch_prctl) and says 0 if refused.
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

/* K of one KV head as B tiles of S = Q K^T (amx_tiles.h): tile (16 keys, 32 dims) at
 * kt + (tile * halves + half) * 256 words; positions past seq_len are zeros. */
static void pack_k(uint32_t *kt, const bf16_t *cache, const int32_t *table, int seq_len, int num_tiles,
                   int head_dim, int block_size, int64_t s_block, int64_t s_pos, int64_t offset) {
    for (int t = 0; t < num_tiles; t++) {
        const bf16_t *rows[16];
        for (int n = 0; n < 16; n++) {
            const int64_t pos = (int64_t)t * 16 + n;
            rows[n] = pos < seq_len ? amx_cache_row(cache, table, pos, block_size, s_block, s_pos, offset) : NULL;
        }
        amx_pack_k16(kt + (int64_t)t * (head_dim / 32) * 256, rows, head_dim);
    }
}

/* V of one KV head as B tiles of O = P V (amx_tiles.h): block of 32 keys, 16 dims at
 * vv + (block * dtiles + dtile) * 512; positions past seq_len are zeros. */
static void pack_v(bf16_t *vv, const bf16_t *cache, const int32_t *table, int seq_len, int num_blocks,
                   int head_dim, int block_size, int64_t s_block, int64_t s_pos, int64_t offset) {
    for (int b = 0; b < num_blocks; b++) {
        const bf16_t *rows[KB];
        for (int k = 0; k < KB; k++) {
            const int64_t pos = (int64_t)b * KB + k;
            rows[k] = pos < seq_len ? amx_cache_row(cache, table, pos, block_size, s_block, s_pos, offset) : NULL;
        }
        amx_pack_v32(vv + (int64_t)b * (head_dim / 16) * 512, rows, head_dim);
    }
}

struct call {
    const bf16_t *q;
    int64_t q_tok, q_head;
    bf16_t *out;
    int64_t o_tok, o_head;
    const uint32_t *kt; /* per KV head: k_stride words */
    const bf16_t *vv;   /* per KV head: v_stride elements */
    int64_t k_stride, v_stride;
    int q_len, seq_len, num_heads, group, head_dim;
    float scale;
};

/* One query head's block of up to 16 tokens starting at token i0. */
static void query_block(const struct call *c, int head, int i0) {
    const int D = c->head_dim, halves = D / 32, dtiles = D / 16;
    const int kv = head / c->group, rows = c->q_len - i0 < QB ? c->q_len - i0 : QB;
    const int64_t ctx = c->seq_len - c->q_len;
    const uint32_t *kt = c->kt + kv * c->k_stride;
    const bf16_t *vv = c->vv + kv * c->v_stride;
    bf16_t qpad[QB * MAX_D] __attribute__((aligned(64)));
    float s[QB * KB] __attribute__((aligned(64)));
    bf16_t p[QB * KB] __attribute__((aligned(64)));
    float o[QB * MAX_D] __attribute__((aligned(64)));
    float tmp[QB * 16] __attribute__((aligned(64)));
    float m[QB] __attribute__((aligned(64))), alpha[QB] __attribute__((aligned(64)));
    float lacc[QB * 16] __attribute__((aligned(64)));

    const bf16_t *qbase = c->q + i0 * c->q_tok + head * c->q_head;
    int64_t qstride = c->q_tok * 2; /* bytes */
    if (rows < QB) { /* the chunk's last, partial block: zero-padded rows (their results are dropped) */
        memset(qpad, 0, sizeof qpad);
        for (int r = 0; r < rows; r++)
            memcpy(qpad + r * D, qbase + r * c->q_tok, D * sizeof(bf16_t));
        qbase = qpad;
        qstride = D * 2;
    }
    memset(o, 0, (size_t)QB * D * sizeof(float));
    memset(lacc, 0, sizeof lacc);
    float threshold[QB]; /* a row's maximum is raised when an unscaled score passes this */
    for (int r = 0; r < QB; r++) {
        m[r] = LOWEST;
        threshold[r] = LOWEST;
    }
    /* keys the block's last real token attends: [0, ctx + i0 + rows) */
    const int64_t num_keys = ctx + i0 + rows;
    const int num_kblocks = (int)((num_keys + KB - 1) / KB);
    const __m512 scale = _mm512_set1_ps(c->scale), lowest = _mm512_set1_ps(LOWEST);
    for (int b = 0; b < num_kblocks; b++) {
        _tile_zero(T_S0);
        _tile_zero(T_S1);
        for (int h = 0; h < halves; h++) {
            _tile_loadd(T_Q, qbase + h * 32, qstride);
            _tile_loadd(T_K, kt + ((int64_t)(2 * b) * halves + h) * 256, 64);
            _tile_dpbf16ps(T_S0, T_Q, T_K);
            _tile_loadd(T_K, kt + ((int64_t)(2 * b + 1) * halves + h) * 256, 64);
            _tile_dpbf16ps(T_S1, T_Q, T_K);
        }
        _tile_stored(T_S0, s, KB * sizeof(float));
        _tile_stored(T_S1, s + 16, KB * sizeof(float));
        /* Online softmax with the row maximum raised only when a score passes it by more than
         * RESCALE_MARGIN (FlashAttention-4's conditional rescaling): the weights stay below e^8,
         * and most blocks rescale nothing. Exact: any maximum gives the same quotient. Scores
         * stay unscaled until the exponent (fused: s * scale - m); masks only on the blocks the
         * causal diagonal crosses. */
        const int whole = (int64_t)(b + 1) * KB <= ctx + i0 + 1; /* every row sees all 32 keys */
        for (int r = 0; r < QB; r++) {
            __m512 slo = _mm512_load_ps(s + r * KB), shi = _mm512_load_ps(s + r * KB + 16);
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
            /* the row's sum, lane-wise until the end */
            float *acc = lacc + r * 16;
            const __m512 sum = _mm512_add_ps(plo, phi);
            _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_load_ps(acc), _mm512_set1_ps(a), sum));
        }
        _tile_loadd(T_P, p, KB * sizeof(bf16_t));
        for (int t = 0; t < dtiles; t++) {
            _tile_zero(T_O);
            _tile_loadd(T_V, vv + ((int64_t)b * dtiles + t) * 512, 64);
            _tile_dpbf16ps(T_O, T_P, T_V);
            _tile_stored(T_O, tmp, 16 * sizeof(float));
            for (int r = 0; r < QB; r++) { /* alpha 1 (no rescale) adds exactly */
                float *row = o + r * D + t * 16;
                _mm512_store_ps(row, _mm512_fmadd_ps(_mm512_load_ps(row), _mm512_set1_ps(alpha[r]),
                                                     _mm512_load_ps(tmp + r * 16)));
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(lacc + r * 16)));
        bf16_t *dst = c->out + (i0 + r) * c->o_tok + head * c->o_head;
        for (int d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + r * D + d), inv)));
    }
}

int amx_prefill_available(int head_dim) {
    return (head_dim == 64 || head_dim == 128) && amx_permitted();
}

/* Returns 0 when done, -1 when this call is not for it (no AMX permission, head size): the caller
 * then takes another path. Strides are in elements; the cache is [blocks][block_size][kv heads][D]
 * by its strides, block_table int32. */
int amx_prefill_attention(const bf16_t *q, int64_t q_tok, int64_t q_head, const bf16_t *key_cache,
                          const bf16_t *value_cache, int64_t s_block, int64_t s_pos, int64_t s_head,
                          const int32_t *block_table, int seq_len, int q_len, bf16_t *out, int64_t o_tok,
                          int64_t o_head, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                          int num_threads) {
    if (!amx_prefill_available(head_dim) || q_len < 1 || q_len > seq_len || num_heads % num_kv_heads)
        return -1;
    const int num_kblocks = (seq_len + KB - 1) / KB, num_ktiles = num_kblocks * 2;
    const int64_t k_stride = (int64_t)num_ktiles * (head_dim / 32) * 256; /* words */
    const int64_t v_stride = (int64_t)num_kblocks * (head_dim / 16) * 512; /* elements */
    /* the packed K and V: one buffer per calling thread, kept from call to call (a fresh one would
     * fault its pages in at every layer) and grown to the longest sequence seen */
    static __thread void *packed = NULL;
    static __thread size_t capacity = 0;
    const size_t k_bytes = (size_t)num_kv_heads * k_stride * sizeof(uint32_t);
    const size_t need = k_bytes + (size_t)num_kv_heads * v_stride * sizeof(bf16_t);
    if (need > capacity) {
        free(packed);
        capacity = 0;
        packed = aligned_alloc(64, need);
        if (!packed)
            return -1;
        capacity = need;
    }
    uint32_t *kt = packed;
    bf16_t *vv = (bf16_t *)((char *)packed + k_bytes);
    struct call c = {q, q_tok, q_head, out, o_tok, o_head, kt, vv, k_stride, v_stride,
                     q_len, seq_len, num_heads, num_heads / num_kv_heads, head_dim, scale};
    const int num_qblocks = (q_len + QB - 1) / QB;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int h = 0; h < 2 * num_kv_heads; h++) { /* K and V of each KV head */
            const int kv = h / 2;
            if (h % 2 == 0)
                pack_k(kt + kv * k_stride, key_cache, block_table, seq_len, num_ktiles, head_dim, block_size,
                       s_block, s_pos, kv * s_head);
            else
                pack_v(vv + kv * v_stride, value_cache, block_table, seq_len, num_kblocks, head_dim, block_size,
                       s_block, s_pos, kv * s_head);
        }
        amx_configure_tiles();
#pragma omp for schedule(dynamic, 1)
        for (int w = 0; w < num_heads * num_qblocks; w++)
            query_block(&c, w % num_heads, (w / num_heads) * QB);
        _tile_release();
    }
    return 0;
}

#else

int amx_prefill_available(int head_dim) {
    (void)head_dim;
    return 0;
}

int amx_prefill_attention(const bf16_t *q, int64_t q_tok, int64_t q_head, const bf16_t *key_cache,
                          const bf16_t *value_cache, int64_t s_block, int64_t s_pos, int64_t s_head,
                          const int32_t *block_table, int seq_len, int q_len, bf16_t *out, int64_t o_tok,
                          int64_t o_head, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                          int num_threads) {
    (void)q, (void)q_tok, (void)q_head, (void)key_cache, (void)value_cache, (void)s_block, (void)s_pos;
    (void)s_head, (void)block_table, (void)seq_len, (void)q_len, (void)out, (void)o_tok, (void)o_head;
    (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale, (void)num_threads;
    return -1;
}

#endif
