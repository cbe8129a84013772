/* Write a step's new K/V rows into the paged KV cache on the CPU (reshape_and_cache).
 *
 * The twin of paged_kernels.reference.ref_reshape_and_cache: token t's row for KV head h goes to slot
 * slots[t] (block slots[t] / block_size, position slots[t] % block_size); slot -1 means "do not
 * store" (padding). Any strides on both sides (elements; rows of head_dim values contiguous), any
 * element size (a row is copied as bytes), so it serves fp32, bf16 and fp16 caches, block-major or
 * head-major, and K/V that are strided views of a fused QKV output. Replaces two index_copy_ calls
 * and the index arithmetic and copies around them (about ten torch ops a layer). Slots past the cache
 * are skipped and counted: the caller raises. Built by paged_kernels/native.py.
 */
#include <stdint.h>
#include <string.h>

/* Tokens per call below which one thread does the work. */
#define PARALLEL_MIN_TOKENS 256

int64_t cache_write(const char *key, int64_t k_stride_tok, int64_t k_stride_head,
                    const char *value, int64_t v_stride_tok, int64_t v_stride_head,
                    char *key_cache, char *value_cache,
                    int64_t c_stride_block, int64_t c_stride_tok, int64_t c_stride_head,
                    const int64_t *slots, int64_t num_tokens, int64_t num_slots,
                    int num_kv_heads, int head_dim, int block_size, int elem_bytes, int num_threads)
{
    const size_t row_bytes = (size_t)head_dim * (size_t)elem_bytes;
    int64_t bad = 0;
    #pragma omp parallel for num_threads(num_threads) reduction(+:bad) if (num_tokens >= PARALLEL_MIN_TOKENS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        if (slot >= num_slots) { bad++; continue; }
        const int64_t at = (slot / block_size) * c_stride_block + (slot % block_size) * c_stride_tok;
        for (int h = 0; h < num_kv_heads; h++) {
            memcpy(key_cache + (at + h * c_stride_head) * elem_bytes,
                   key + (t * k_stride_tok + h * k_stride_head) * elem_bytes, row_bytes);
            memcpy(value_cache + (at + h * c_stride_head) * elem_bytes,
                   value + (t * v_stride_tok + h * v_stride_head) * elem_bytes, row_bytes);
        }
    }
    return bad;
}
