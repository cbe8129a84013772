/* AVX-512 helpers shared by the CPU kernels of this folder (included, not built on its own):
 * HAVE_AVX512 is defined, and the helpers exist, only where the compiler targets AVX-512 F + DQ
 * (-march=native on such a CPU); every kernel keeps a plain C loop for the other machines.
 */
#ifndef PAGEDSERVE_AVX512_MATH_H
#define PAGEDSERVE_AVX512_MATH_H

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define HAVE_AVX512 1

/* e^x for 16 lanes: x = n ln2 + r (Cody-Waite, |r| <= ln2/2), e^r by its degree-6 Taylor polynomial
 * (relative error < 2e-7 on that range), scaled by 2^n. Inputs below -87.3 give ~0, never NaN. */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* e^x for 16 lanes to ~5e-5 relative: exp16 with a degree-4 polynomial, for weights rounded to
 * bf16 (8 significant bits) afterwards. Inputs below -87.3 give ~0, never NaN. */
static inline __attribute__((always_inline)) __m512 exp16_bf16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
    __m512 p = _mm512_set1_ps(1.f / 24);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* 16 bf16 values (in a register, or loaded from p) widened to fp32 (a bf16 is the top half of an fp32). */
static inline __attribute__((always_inline)) __m512 widen_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) __m512 widen16_bf16(const uint16_t *p) {
    return widen_bf16(_mm256_loadu_si256((const __m256i *)p));
}

/* 16 fp32 values rounded to bf16 as f32_to_bf16 does (nearest, ties to even; NaN stays NaN). With
 * AVX512-BF16 one instruction, which also flushes subnormal results (below 1.2e-38) to zero; without
 * it, the same rounding in AVX-512 F operations (1.6x slower for SiLU * up). */
static inline __attribute__((always_inline)) __m256i narrow16_bf16(__m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(rounded);
#endif
}

/* SiLU(g) * up for 16 lanes of a gate and an up value (fp32 values of bf16s), as torch rounds
 * `F.silu(gate) * up` on bf16 tensors: bf16(bf16(g / (1 + e^-g)) * u). The one definition both
 * cpu_fused_ops.c's silu_mul_bf16 and the tile GEMM's gate/up epilogue use: their bits agree. */
static inline __attribute__((always_inline)) __m256i silu_mul16_bf16(__m512 g, __m512 u) {
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    return narrow16_bf16(_mm512_mul_ps(widen_bf16(narrow16_bf16(silu)), u));
}
#endif

#endif
