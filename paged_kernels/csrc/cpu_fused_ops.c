/* Fused element-wise ops of a bf16 decoder layer on the CPU: one pass over memory where torch takes
 * four to eight (each with its own temporary and bf16 <-> fp32 conversions).
 *
 * The twins of worker_service.models.layers' torch code in a bf16 model, computed the same way
 * (fp32 arithmetic, each bf16 rounding where torch rounds), so results agree with it up to fp32
 * summation order (and FMA contraction): RMSNorm (optionally after adding a bf16 sub-layer output to
 * the fp32 residual stream, in place), rotary embedding (in place, on the q and k heads of a fused
 * QKV output) and SiLU(gate) * up of a fused gate/up output. Rows are spread over OpenMP threads
 * when there are enough of them to pay for it. Plain C99 + OpenMP: GCC vectorises the inner loops
 * (-O3 -march=native); RMSNorm and SiLU's exp have AVX-512 loops where the CPU has it
 * (avx512_math.h: RMSNorm 1.6x the vectorised C on 512-2,048 tokens).
 * Built by paged_kernels/native.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "avx512_math.h"
#include "bf16.h"

/* Elements per call below which one thread does the work (a parallel region costs microseconds). */
#define PARALLEL_MIN_ELEMENTS 16384

/* out[t] = bf16(weight * bf16(x[t] / sqrt(mean(x[t]^2) + eps))) for each of `rows` rows of `dim`
 * values. With `residual` (bf16), x[t] += residual[t] first, written back to x (fp32). */
void rms_norm_bf16(float *x, int64_t x_stride, const bf16_t *residual, int64_t r_stride,
                   const bf16_t *weight, bf16_t *out, int64_t o_stride, int64_t rows, int64_t dim,
                   float eps, int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        float *xr = x + t * x_stride;
        bf16_t *o = out + t * o_stride;
#ifdef HAVE_AVX512
        if (dim % 16 == 0) {  /* the same steps, 16 values at a time (sums in another order) */
            const bf16_t *rr = residual ? residual + t * r_stride : NULL;
            __m512 squares = _mm512_setzero_ps();
            for (int64_t d = 0; d < dim; d += 16) {
                __m512 v = _mm512_loadu_ps(xr + d);
                if (rr) {
                    v = _mm512_add_ps(v, widen16_bf16(rr + d));
                    _mm512_storeu_ps(xr + d, v);
                }
                squares = _mm512_fmadd_ps(v, v, squares);
            }
            const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps));
            for (int64_t d = 0; d < dim; d += 16) {
                const __m512 normed = widen_bf16(narrow16_bf16(_mm512_mul_ps(_mm512_loadu_ps(xr + d), inv)));
                _mm256_storeu_si256((__m256i *)(o + d), narrow16_bf16(_mm512_mul_ps(widen16_bf16(weight + d), normed)));
            }
            continue;
        }
#endif
        if (residual) {
            const bf16_t *rr = residual + t * r_stride;
            for (int64_t d = 0; d < dim; d++) xr[d] += bf16_to_f32(rr[d]);
        }
        float sum = 0.f;
        for (int64_t d = 0; d < dim; d++) sum += xr[d] * xr[d];
        const float inv = 1.f / sqrtf(sum / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++)
            o[d] = f32_to_bf16(bf16_to_f32(weight[d]) * bf16_to_f32(f32_to_bf16(xr[d] * inv)));
    }
}

/* Rotary embedding in place on `heads` heads of each of `rows` tokens (bf16; head h of token t at
 * x + t * tok_stride + h * head_stride, head_dim contiguous values): dimension i pairs with
 * i + head_dim/2 (Hugging Face's rotate_half), cos/sin fp32 rows of `table_stride` values picked by
 * each token's position; the result is rounded to bf16 once. */
void rope_bf16(bf16_t *x, int64_t tok_stride, int64_t head_stride, int64_t rows, int64_t heads,
               int64_t head_dim, const int64_t *positions, const float *cos_table, const float *sin_table,
               int64_t table_stride, int num_threads)
{
    const int64_t half = head_dim / 2;
    #pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_table + positions[t] * table_stride, *s = sin_table + positions[t] * table_stride;
        for (int64_t h = 0; h < heads; h++) {
            bf16_t *v = x + t * tok_stride + h * head_stride;
            int64_t i = 0;
#ifdef HAVE_AVX512
            for (; i + 16 <= half; i += 16) {  /* the same steps, 16 pairs at a time */
                const __m512 a = widen16_bf16(v + i), b = widen16_bf16(v + i + half);
                const __m256i lo = narrow16_bf16(_mm512_fmadd_ps(a, _mm512_loadu_ps(c + i),
                                                                 _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b),
                                                                               _mm512_loadu_ps(s + i))));
                const __m256i hi = narrow16_bf16(_mm512_fmadd_ps(b, _mm512_loadu_ps(c + i + half),
                                                                 _mm512_mul_ps(a, _mm512_loadu_ps(s + i + half))));
                _mm256_storeu_si256((__m256i *)(v + i), lo);
                _mm256_storeu_si256((__m256i *)(v + i + half), hi);
            }
#endif
            for (; i < half; i++) {
                const float a = bf16_to_f32(v[i]), b = bf16_to_f32(v[i + half]);
                v[i] = f32_to_bf16(a * c[i] + -b * s[i]);
                v[i + half] = f32_to_bf16(b * c[i + half] + a * s[i + half]);
            }
        }
    }
}

/* out[t, i] = bf16(bf16(silu(g)) * u) with g = x[t, i], u = x[t, inter + i] (a fused gate/up GEMM's
 * output row: gate then up), silu(g) = g / (1 + e^-g) in fp32, rounded where torch rounds
 * (`F.silu(gate) * up` on bf16 tensors); `rows` rows of `inter` outputs. One pass where torch takes
 * two over the strided halves (2.1x faster for a 2,048-token chunk, 1.7x for 64 tokens). */
void silu_mul_bf16(const bf16_t *x, int64_t x_stride, bf16_t *out, int64_t o_stride, int64_t rows,
                   int64_t inter, int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        const bf16_t *g = x + t * x_stride, *u = g + inter;
        bf16_t *o = out + t * o_stride;
        int64_t i = 0;
#ifdef HAVE_AVX512
        for (; i + 16 <= inter; i += 16)
            _mm256_storeu_si256((__m256i *)(o + i), silu_mul16_bf16(widen16_bf16(g + i), widen16_bf16(u + i)));
#endif
        for (; i < inter; i++) {
            const float a = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(a / (1.f + expf(-a)))) * bf16_to_f32(u[i]));
        }
    }
}

/* The logits of the rows that sample, from the LM-head GEMM's bf16 output: out[r] = fp32(logits[r]),
 * except that the `k` largest of each row (ties to the lower token id) are recomputed exactly, as
 * the fp32 dot product of the row's hidden state with the token's weight row (bf16 operands widened,
 * fp32 sums in a fixed order). A bf16 output has steps of 1/16 at a logit of 10: near-ties become
 * exact ties, and only the few largest decide greedy decoding and the head of a sampled
 * distribution. One pass per row (widen, store, keep the k largest: a block of 16 is looked at one
 * by one only when its max beats the k-th kept), then k dot products; each row on its own, so a
 * row's result never depends on the batch. k <= 64. */
#define REFINE_MAX_K 64

/* The `k` largest values of a bf16 row of `vocab` (ties to the lower token id), descending, into
 * top_value / top_id; returns how many were kept (min(k, vocab)). With `widened`, every value is also
 * stored there as fp32 (the row refine_logits_bf16 writes). `has_nan` (unless NULL): whether the
 * row holds a NaN (the selection's order is then meaningless). A block of 16 is looked at one by one
 * only when its max beats the k-th kept. */
static int top_k_bf16(const bf16_t *l, int64_t vocab, int k, float *widened, float *top_value, int64_t *top_id,
                      int *has_nan)
{
    int kept = 0;
    float threshold = -INFINITY;  /* a value must beat it to be kept (the k-th kept, once k are) */
    float block[16];
    /* NaN by its bits (the flags assume finite math): a magnitude above +inf's, 0x7F80, carries into
       bit 15 once 0x7F is added. A pass of its own: in the loop below it costs that loop its speed. */
    if (has_nan != NULL) {
        uint16_t carry = 0;
        for (int64_t i = 0; i < vocab; i++) carry |= (uint16_t)((l[i] & 0x7FFF) + 0x7F);
        *has_nan = (carry & 0x8000) != 0;
    }
    for (int64_t start = 0; start < vocab; start += 16) {
        const int64_t n = vocab - start < 16 ? vocab - start : 16;
        float *v = widened != NULL ? widened + start : block;
        float block_max = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            v[i] = bf16_to_f32(l[start + i]);
            block_max = v[i] > block_max ? v[i] : block_max;
        }
        if (kept == k && (k == 0 || !(block_max > threshold))) continue;
        for (int64_t i = 0; i < n; i++) {
            if (kept == k && !(v[i] > threshold)) continue;
            int at = kept < k ? kept++ : k - 1;  /* the slot it takes: the end, or the k-th's */
            while (at > 0 && top_value[at - 1] < v[i]) {
                top_value[at] = top_value[at - 1];
                top_id[at] = top_id[at - 1];
                at--;
            }
            top_value[at] = v[i];
            top_id[at] = start + i;
            if (kept == k) threshold = top_value[k - 1];
        }
    }
    return kept;
}

/* fp32 dot product of a bf16 hidden row and a bf16 weight row. Not inlined: the compiler may order
 * the sums as it likes (-fassociative-math), so both kernels call the one compiled copy and get the
 * same bits. */
static __attribute__((noinline)) float exact_dot_bf16(const bf16_t *h, const bf16_t *w, int64_t dim)
{
    float sum = 0.f;
    for (int64_t d = 0; d < dim; d++) sum += bf16_to_f32(h[d]) * bf16_to_f32(w[d]);
    return sum;
}

void refine_logits_bf16(const bf16_t *logits, int64_t l_stride, const bf16_t *hidden, int64_t h_stride,
                        const bf16_t *weight, int64_t w_stride, float *out, int64_t o_stride,
                        int64_t rows, int64_t vocab, int64_t dim, int k, int num_threads)
{
    if (k > vocab) k = (int)vocab;
    if (k > REFINE_MAX_K) k = REFINE_MAX_K;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (rows * vocab >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + r * o_stride;
        float top_value[REFINE_MAX_K];
        int64_t top_id[REFINE_MAX_K];
        const int kept = top_k_bf16(logits + r * l_stride, vocab, k, o, top_value, top_id, NULL);
        const bf16_t *h = hidden + r * h_stride;
        for (int j = 0; j < kept; j++) o[top_id[j]] = exact_dot_bf16(h, weight + top_id[j] * w_stride, dim);
    }
}

/* The token greedy decoding takes from the row refine_logits_bf16 would write, without writing it:
 * out_ids[r] = the first index of the row's largest value (torch's `max` over the row), the row being
 * the `k` largest logits recomputed exactly and the rest widened. Only the k + 1 largest can hold it:
 * the k exact values, or the largest of the others (the (k + 1)-th, first among equals, which beats
 * them all when every exact value fell below its bf16 rounding). A row holding a NaN (a logit or an
 * exact value) gets -1: the caller computes it the long way. */
void greedy_refined_bf16(const bf16_t *logits, int64_t l_stride, const bf16_t *hidden, int64_t h_stride,
                         const bf16_t *weight, int64_t w_stride, int64_t *out_ids,
                         int64_t rows, int64_t vocab, int64_t dim, int k, int num_threads)
{
    if (k > vocab) k = (int)vocab;
    if (k > REFINE_MAX_K) k = REFINE_MAX_K;
    const int k1 = k + 1 <= vocab ? k + 1 : k;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (rows * vocab >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float top_value[REFINE_MAX_K + 1];
        int64_t top_id[REFINE_MAX_K + 1];
        int has_nan;
        const int kept = top_k_bf16(logits + r * l_stride, vocab, k1, NULL, top_value, top_id, &has_nan);
        const int exact = kept < k ? kept : k;
        const bf16_t *h = hidden + r * h_stride;
        for (int j = 0; j < exact; j++) {
            top_value[j] = exact_dot_bf16(h, weight + top_id[j] * w_stride, dim);
            uint32_t bits;
            memcpy(&bits, &top_value[j], sizeof bits);
            has_nan |= (bits & 0x7FFFFFFFu) > 0x7F800000u;
        }
        if (has_nan) {
            out_ids[r] = -1;
            continue;
        }
        int best = 0;
        for (int j = 1; j < kept; j++)
            if (top_value[j] > top_value[best] || (top_value[j] == top_value[best] && top_id[j] < top_id[best])) best = j;
        out_ids[r] = kept ? top_id[best] : 0;
    }
}
