/* Paged decode attention for the CPU: one query token per sequence over its paged K/V cache.
 *
 * The twin of kernels.reference's decode path (same arguments after flattening, same result up to
 * float rounding); the CPU attention backend ("cpu") calls it for the decode rows of a step. The
 * torch reference must gather every sequence's K/V blocks into a scratch copy before SDPA reads
 * them again; this loop reads each cached K/V row once, straight from the cache, with an online
 * softmax (flash-decoding style), so a decode step moves a third of the bytes.
 *
 * Work items are (sequence, KV head) pairs, spread over OpenMP threads; the `group` query heads
 * that share a KV head are handled together, so each K/V row is loaded once for all of them (GQA).
 * The cache may have any strides in its first three dims (block, token in block, KV head); rows of
 * head_dim values must be contiguous. Built by kernels/native.py with -O3 -march=native -fopenmp.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 128

static inline __attribute__((always_inline)) void decode_impl(
    const float *query, int64_t q_stride_tok, int64_t q_stride_head,
    const float *key_cache, const float *value_cache,
    int64_t c_stride_block, int64_t c_stride_tok, int64_t c_stride_head,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    float *out, int64_t o_stride_tok, int64_t o_stride_head,
    int num_seqs, int num_heads, int num_kv_heads, int block_size, float scale, int num_threads,
    const int HD)
{
    const int group = num_heads / num_kv_heads;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < (int64_t)num_seqs * num_kv_heads; item++) {
        const int s = (int)(item / num_kv_heads), h = (int)(item % num_kv_heads);
        const int len = seq_lens[s];
        float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
        float running_max[MAX_GROUP], denom[MAX_GROUP], p[MAX_GROUP][MAX_BLOCK_SIZE];
        for (int g = 0; g < group; g++) {
            const float *qs = query + s * q_stride_tok + (int64_t)(h * group + g) * q_stride_head;
            for (int d = 0; d < HD; d++) { q[g][d] = qs[d] * scale; acc[g][d] = 0.f; }
            running_max[g] = -FLT_MAX;
            denom[g] = 0.f;
        }
        const int32_t *table = block_tables + s * bt_stride;
        for (int start = 0; start < len; start += block_size) {
            const int n = len - start < block_size ? len - start : block_size;
            const int64_t base = (int64_t)table[start / block_size] * c_stride_block + h * c_stride_head;
            const float *kb = key_cache + base, *vb = value_cache + base;
            for (int g = 0; g < group; g++) {  /* scores of this block's tokens */
                float block_max = running_max[g];
                for (int t = 0; t < n; t++) {
                    const float *k = kb + t * c_stride_tok;
                    float dot = 0.f;
                    for (int d = 0; d < HD; d++) dot += q[g][d] * k[d];
                    p[g][t] = dot;
                    block_max = dot > block_max ? dot : block_max;
                }
                const float rescale = expf(running_max[g] - block_max);
                float sum = 0.f;
                for (int t = 0; t < n; t++) { p[g][t] = expf(p[g][t] - block_max); sum += p[g][t]; }
                denom[g] = denom[g] * rescale + sum;
                running_max[g] = block_max;
                float a[MAX_HEAD_DIM];  /* the accumulator row, register-resident across tokens */
                for (int d = 0; d < HD; d++) a[d] = acc[g][d] * rescale;
                for (int t = 0; t < n; t++) {
                    const float *v = vb + t * c_stride_tok, w = p[g][t];
                    for (int d = 0; d < HD; d++) a[d] += w * v[d];
                }
                for (int d = 0; d < HD; d++) acc[g][d] = a[d];
            }
        }
        for (int g = 0; g < group; g++) {
            float *o = out + s * o_stride_tok + (int64_t)(h * group + g) * o_stride_head;
            const float inv = 1.f / denom[g];
            for (int d = 0; d < HD; d++) o[d] = acc[g][d] * inv;
        }
    }
}

/* Limits (checked by the caller, kernels/cpu.py): num_heads % num_kv_heads == 0, group <= 16,
 * head_dim <= 256, block_size <= 128, every seq_len >= 1. */
void paged_decode_attention_f32(
    const float *query, int64_t q_stride_tok, int64_t q_stride_head,
    const float *key_cache, const float *value_cache,
    int64_t c_stride_block, int64_t c_stride_tok, int64_t c_stride_head,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    float *out, int64_t o_stride_tok, int64_t o_stride_head,
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
    int num_threads)
{
#define DECODE(HD) decode_impl(query, q_stride_tok, q_stride_head, key_cache, value_cache, \
    c_stride_block, c_stride_tok, c_stride_head, block_tables, bt_stride, seq_lens, out, \
    o_stride_tok, o_stride_head, num_seqs, num_heads, num_kv_heads, block_size, scale, num_threads, HD)
    /* common head sizes get constant trip counts (fully vectorised inner loops) */
    if (head_dim == 64) DECODE(64);
    else if (head_dim == 128) DECODE(128);
    else DECODE(head_dim);
#undef DECODE
}
