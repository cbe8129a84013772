/* bf16 <-> fp32 for the CPU kernels of this folder (included, not built on its own).
 *
 * A bf16 is the top half of an fp32: widening is a shift; narrowing rounds to nearest, ties to even,
 * as torch does, and keeps NaN a (quiet) NaN. Plain C: GCC vectorises loops over them.
 */
#ifndef PAGEDSERVE_BF16_H
#define PAGEDSERVE_BF16_H

#include <stdint.h>
#include <string.h>

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

#endif
