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
 *
 * Two entry points share one loop: `_f32` (fp32 query, cache and output) and `_bf16` (bf16 query,
 * cache and output). The bf16 one widens each loaded value to fp32 in registers (a bf16 is the top
 * half of an fp32, so widening is a shift) and keeps scores, the softmax and the accumulators in
 * fp32; only the output row is rounded to bf16 (to nearest even), once.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 128

typedef uint16_t bf16_t;

static inline __attribute__((always_inline)) float bf16_to_f32(bf16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline __attribute__((always_inline)) bf16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu))  /* NaN stays a (quiet) NaN */
        return (bf16_t)((bits >> 16) | 0x0040u);
    bits += 0x7fffu + ((bits >> 16) & 1u);  /* round to nearest, ties to even */
    return (bf16_t)(bits >> 16);
}

/* Element i of a row of fp32 or bf16 values, as fp32; BF16 is a compile-time constant at each call. */
static inline __attribute__((always_inline)) float load(const void *row, int64_t i, const int BF16) {
    return BF16 ? bf16_to_f32(((const bf16_t *)row)[i]) : ((const float *)row)[i];
}

/* Strides are in elements (of fp32 or bf16, as BF16 says). */
static inline __attribute__((always_inline)) void decode_impl(
    const void *query, int64_t q_stride_tok, int64_t q_stride_head,
    const void *key_cache, const void *value_cache,
    int64_t c_stride_block, int64_t c_stride_tok, int64_t c_stride_head,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    void *out, int64_t o_stride_tok, int64_t o_stride_head,
    int num_seqs, int num_heads, int num_kv_heads, int block_size, float scale, int num_threads,
    const int HD, const int BF16)
{
    const int64_t elem = BF16 ? (int64_t)sizeof(bf16_t) : (int64_t)sizeof(float);
    const char *q_base = query, *k_base = key_cache, *v_base = value_cache;
    char *o_base = out;
    const int group = num_heads / num_kv_heads;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < (int64_t)num_seqs * num_kv_heads; item++) {
        const int s = (int)(item / num_kv_heads), h = (int)(item % num_kv_heads);
        const int len = seq_lens[s];
        float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
        float running_max[MAX_GROUP], denom[MAX_GROUP], p[MAX_GROUP][MAX_BLOCK_SIZE];
        for (int g = 0; g < group; g++) {
            const void *qs = q_base + (s * q_stride_tok + (int64_t)(h * group + g) * q_stride_head) * elem;
            for (int d = 0; d < HD; d++) { q[g][d] = load(qs, d, BF16) * scale; acc[g][d] = 0.f; }
            running_max[g] = -FLT_MAX;
            denom[g] = 0.f;
        }
        const int32_t *table = block_tables + s * bt_stride;
        for (int start = 0; start < len; start += block_size) {
            const int n = len - start < block_size ? len - start : block_size;
            const int64_t base = (int64_t)table[start / block_size] * c_stride_block + h * c_stride_head;
            const char *kb = k_base + base * elem, *vb = v_base + base * elem;
            for (int g = 0; g < group; g++) {  /* scores of this block's tokens */
                float block_max = running_max[g];
                for (int t = 0; t < n; t++) {
                    const void *k = kb + t * c_stride_tok * elem;
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
                float a[MAX_HEAD_DIM];  /* the accumulator row, register-resident across tokens */
                for (int d = 0; d < HD; d++) a[d] = acc[g][d] * rescale;
                for (int t = 0; t < n; t++) {
                    const void *v = vb + t * c_stride_tok * elem;
                    const float w = p[g][t];
                    for (int d = 0; d < HD; d++) a[d] += w * load(v, d, BF16);
                }
                for (int d = 0; d < HD; d++) acc[g][d] = a[d];
            }
        }
        for (int g = 0; g < group; g++) {
            char *o = o_base + (s * o_stride_tok + (int64_t)(h * group + g) * o_stride_head) * elem;
            const float inv = 1.f / denom[g];
            if (BF16) for (int d = 0; d < HD; d++) ((bf16_t *)o)[d] = f32_to_bf16(acc[g][d] * inv);
            else for (int d = 0; d < HD; d++) ((float *)o)[d] = acc[g][d] * inv;
        }
    }
}

/* Common head sizes get constant trip counts (fully vectorised inner loops). */
#define DISPATCH(BF16) do { \
    if (head_dim == 64) DECODE(64, BF16); \
    else if (head_dim == 128) DECODE(128, BF16); \
    else DECODE(head_dim, BF16); } while (0)
#define DECODE(HD, BF16) decode_impl(query, q_stride_tok, q_stride_head, key_cache, value_cache, \
    c_stride_block, c_stride_tok, c_stride_head, block_tables, bt_stride, seq_lens, out, \
    o_stride_tok, o_stride_head, num_seqs, num_heads, num_kv_heads, block_size, scale, num_threads, HD, BF16)

/* The exported entry points: `_f32` takes fp32 query, caches and output; `_bf16` bf16 ones (raw bf16
 * bits as uint16), with fp32 arithmetic inside. Limits (checked by the caller, kernels/cpu.py):
 * num_heads % num_kv_heads == 0, group <= 16, head_dim <= 256, block_size <= 128, every
 * seq_len >= 1. Strides are in elements. */
#define ENTRY_POINT(NAME, T, BF16) \
void NAME( \
    const T *query, int64_t q_stride_tok, int64_t q_stride_head, \
    const T *key_cache, const T *value_cache, \
    int64_t c_stride_block, int64_t c_stride_tok, int64_t c_stride_head, \
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, \
    T *out, int64_t o_stride_tok, int64_t o_stride_head, \
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, \
    int num_threads) \
{ \
    DISPATCH(BF16); \
}

ENTRY_POINT(paged_decode_attention_f32, float, 0)
ENTRY_POINT(paged_decode_attention_bf16, bf16_t, 1)

#undef ENTRY_POINT
#undef DECODE
#undef DISPATCH
