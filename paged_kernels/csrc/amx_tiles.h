/* AMX tile helpers shared by the CPU kernels of this folder (included, not built on its own).
 *
 * HAVE_AMX_TILES is defined, and the helpers exist, where the compiler targets AMX-BF16 with
 * AVX-512 BF16 and BW (-march=native on Intel Sapphire Rapids and later) on Linux. A process must
 * be allowed to use the tile registers: amx_permitted() asks Linux once (arch_prctl) and says
 * whether it may. Every kernel using tiles keeps another path for when it may not.
 *
 * Where the compiler targets AVX-512 BF16 without AMX (AMD Zen 4 and later, Intel Cooper Lake),
 * HAVE_AMX_TILES is defined too, with AMX_TILES_EMULATED: the tile instructions these kernels use
 * (tile_loadconfig, tile_zero, tile_loadd, tile_stored, tile_dpbf16ps, tile_release: GCC's _tile_*
 * intrinsics where there is AMX) are done in software on eight 1 KB tiles per thread, a tile
 * product as VDPBF16PS over its 16 pairs (the B tile in 16 registers, each row of A broadcast a pair
 * at a time); the attention kernels' two products (scores, P V) have fused forms below
 * (emu_scores32, emu_pv32) that their emulated paths call instead. Much slower than a tile unit, but
 * the kernels' packed layouts make it a GEMM at AVX-512 BF16's rate, which the row-at-a-time kernels
 * beside them are not (2.0-2.6x them for long chunks on a 2-core AMD EPYC, Zen 5: python
 * benchmarks/cpu_kernels.py --part tiles). Only the shapes these kernels
 * configure are done: rows of 64 bytes (16 fp32 or 32 bf16), up to 16 rows. A row of C takes its 16
 * pairs in order in one fp32 chain (VDPBF16PS adds a pair's two products, then the sum, rounding to
 * nearest and treating denormals as zero): a row's result depends on that row and the tile it is
 * multiplied by alone, whatever the rows beside it. Results differ from the tile unit's by fp32
 * rounding.
 *
 * The layouts the tile products want (TDPBF16PS: C[16 x 16 fp32] += A[16 x 32 bf16] B[32 x 16
 * bf16], B with pairs of its rows interleaved, "VNNI"):
 *   - K for S = Q K^T: per 16 keys and 32 head dims, word[p][n] = (K[n][2p], K[n][2p + 1]), a 16 x 16
 *     transpose of the keys' 32-bit words (amx_pack_k16);
 *   - V for O = P V: per 32 keys and 16 head dims, row p = keys 2p and 2p + 1 interleaved
 *     (amx_pack_v32).
 */
#ifndef PAGEDSERVE_AMX_TILES_H
#define PAGEDSERVE_AMX_TILES_H

#include <stdint.h>
#include <string.h>

#include "avx512_math.h"
#include "bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) \
    && defined(HAVE_AVX512) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX_TILES 1
#define AMX_TILES_EMULATED 0
#elif defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(HAVE_AVX512)
#define HAVE_AMX_TILES 1
#define AMX_TILES_EMULATED 1
#endif

#ifdef HAVE_AMX_TILES
/* The tile registers: literals, as GCC's tile intrinsics paste them into the instruction. */
#define T_Q 0
#define T_K 2
#define T_S0 3
#define T_S1 4
#define T_P 5
#define T_V 6
#define T_O 7

struct amx_tile_config {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

#if !AMX_TILES_EMULATED
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_permitted(void) {
    static int state = 0; /* 0: not asked, 1: granted, -1: refused */
    if (state == 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

/* The tile instructions the kernels use: the hardware's. */
#define tile_loadconfig(cfg) _tile_loadconfig(cfg)
#define tile_zero(t) _tile_zero(t)
#define tile_loadd(t, base, stride) _tile_loadd(t, base, stride)
#define tile_stored(t, base, stride) _tile_stored(t, base, stride)
#define tile_dpbf16ps(c, a, b) _tile_dpbf16ps(c, a, b)
#define tile_release() _tile_release()
#else
static inline int amx_permitted(void) { return 1; }

/* The calling thread's eight tiles. A tile is 16 rows of 64 bytes in `data`, or, once loaded and
 * until a product adds into it, a view of the memory it was loaded from (`src`, `stride`): a load
 * copies nothing, and the product reads A and B where they lie. A view reads its memory when used,
 * so a kernel must not write that memory between a tile's load and its use (none of this folder
 * does). `zeroed`: the tile is all zeros (a product then starts its sums from registers). */
struct amx_emu_tiles {
    float data[8][256] __attribute__((aligned(64)));
    const char *src[8];
    int64_t stride[8];
    uint8_t rows[8];
    uint8_t zeroed[8];
};
static __thread struct amx_emu_tiles amx_emu __attribute__((aligned(64)));

static inline __attribute__((always_inline)) void amx_emu_loadconfig(const struct amx_tile_config *cfg) {
    struct amx_emu_tiles *e = &amx_emu;
    for (int t = 0; t < 8; t++) {
        e->rows[t] = cfg->rows[t];
        e->src[t] = NULL;
        e->zeroed[t] = 0;
    }
}

static inline __attribute__((always_inline)) void amx_emu_zero(int t) {
    struct amx_emu_tiles *e = &amx_emu;
    e->src[t] = NULL;
    e->zeroed[t] = 1;
}

static inline __attribute__((always_inline)) void amx_emu_loadd(int t, const void *base, int64_t stride) {
    struct amx_emu_tiles *e = &amx_emu;
    e->src[t] = (const char *)base;
    e->stride[t] = stride;
    e->zeroed[t] = 0;
}

static inline __attribute__((always_inline)) void amx_emu_stored(int t, void *base, int64_t stride) {
    struct amx_emu_tiles *e = &amx_emu;
    const int rows = e->rows[t];
    if (e->zeroed[t]) {
        for (int r = 0; r < rows; r++)
            _mm512_storeu_si512((char *)base + r * stride, _mm512_setzero_si512());
    } else if (e->src[t]) {
        for (int r = 0; r < rows; r++)
            _mm512_storeu_si512((char *)base + r * stride, _mm512_loadu_si512(e->src[t] + r * e->stride[t]));
    } else {
        for (int r = 0; r < rows; r++)
            _mm512_storeu_si512((char *)base + r * stride, _mm512_load_si512(e->data[t] + 16 * r));
    }
}

/* Row r of tile t (its data, or the memory it views). */
static inline __attribute__((always_inline)) const char *amx_emu_row(const struct amx_emu_tiles *e, int t, int r) {
    return e->src[t] ? e->src[t] + r * e->stride[t] : (const char *)(e->data[t] + 16 * r);
}

/* C[r] += sum over pairs k of A[r][k] . B[k] for C's rows r, each row one chain over k = 0..15 (the
 * same order whatever the rows beside it), eight rows at a time for independent chains. */
#define AMX_EMU_PAIR(acc, a, k) \
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)(a)[k]), b[k])
#define AMX_EMU_ROWS(n)                                                                     \
    do {                                                                                    \
        __m512 acc[n];                                                                      \
        const uint32_t *ar[n];                                                              \
        for (int i = 0; i < n; i++) {                                                       \
            acc[i] = zeroed ? _mm512_setzero_ps() : _mm512_load_ps(c + 16 * (r + i));       \
            ar[i] = (const uint32_t *)amx_emu_row(e, ta, r + i);                             \
        }                                                                                   \
        for (int k = 0; k < 16; k++)                                                        \
            for (int i = 0; i < n; i++)                                                     \
                AMX_EMU_PAIR(acc[i], ar[i], k);                                             \
        for (int i = 0; i < n; i++)                                                         \
            _mm512_store_ps(c + 16 * (r + i), acc[i]);                                      \
    } while (0)
static inline __attribute__((always_inline)) void amx_emu_dpbf16ps(int tc, int ta, int tb) {
    struct amx_emu_tiles *e = &amx_emu;
    float *c = e->data[tc];
    const int rows = e->rows[tc];
    if (e->src[tc]) { /* C was loaded: its values come in now */
        for (int r = 0; r < rows; r++)
            _mm512_store_ps(c + 16 * r, _mm512_loadu_ps((const float *)(e->src[tc] + r * e->stride[tc])));
        e->src[tc] = NULL;
    }
    const int zeroed = e->zeroed[tc];
    e->zeroed[tc] = 0;
    __m512bh b[16];
    for (int k = 0; k < 16; k++)
        b[k] = (__m512bh)_mm512_loadu_ps((const float *)amx_emu_row(e, tb, k));
    int r = 0;
    for (; r + 8 <= rows; r += 8)
        AMX_EMU_ROWS(8);
    for (; r + 4 <= rows; r += 4)
        AMX_EMU_ROWS(4);
    for (; r < rows; r++)
        AMX_EMU_ROWS(1);
}

/* The two products the attention kernels are made of, for their emulated paths: a tile product
 * emulated alone reads each broadcast A pair once for one B register and keeps eight chains, which
 * on a CPU with two 512-bit VDPBF16PS pipes (AMD Zen 5) is bound by loads and latency; fused over
 * the tiles that share A, a broadcast feeds two or four products and sixteen chains run at once.
 * Each value is the same fp32 chain, in the same pair order, as the tile products it replaces. */

/* s[r][0..32) = Q[r] . K for 16 query rows (q: bf16, q_stride elements a row, 32 * halves head
 * dims) against 32 keys packed by amx_pack_k16 (keys 0-15 at k0, 16-31 at k1, the head dims' halves
 * 256 words apart); s: fp32, s_stride floats a row. */
static inline __attribute__((always_inline)) void emu_scores32(float *s, int64_t s_stride, const bf16_t *q,
                                                                int64_t q_stride, const uint32_t *k0,
                                                                const uint32_t *k1, int halves) {
    for (int r0 = 0; r0 < 16; r0 += 8) {
        __m512 lo[8], hi[8];
        for (int i = 0; i < 8; i++)
            lo[i] = hi[i] = _mm512_setzero_ps();
        for (int h = 0; h < halves; h++)
            for (int k = 0; k < 16; k++) {
                const __m512bh b0 = (__m512bh)_mm512_load_si512(k0 + h * 256 + k * 16);
                const __m512bh b1 = (__m512bh)_mm512_load_si512(k1 + h * 256 + k * 16);
                for (int i = 0; i < 8; i++) {
                    const __m512bh a = (__m512bh)_mm512_set1_epi32(
                        (int)((const uint32_t *)(q + (r0 + i) * q_stride + h * 32))[k]);
                    lo[i] = _mm512_dpbf16_ps(lo[i], a, b0);
                    hi[i] = _mm512_dpbf16_ps(hi[i], a, b1);
                }
            }
        for (int i = 0; i < 8; i++) {
            _mm512_storeu_ps(s + (r0 + i) * s_stride, lo[i]);
            _mm512_storeu_ps(s + (r0 + i) * s_stride + 16, hi[i]);
        }
    }
}

/* o[r][0..16 dtiles) += P[r] . V for 16 rows: P 32 bf16 weights a row (p_stride elements), V packed
 * by amx_pack_v32 (dtiles tiles of 512 at vv, dtiles a multiple of 4); o: fp32, o_stride floats a
 * row. */
static inline __attribute__((always_inline)) void emu_pv32(float *o, int64_t o_stride, const bf16_t *p,
                                                            int64_t p_stride, const bf16_t *vv, int dtiles) {
    for (int t0 = 0; t0 < dtiles; t0 += 4)
        for (int r0 = 0; r0 < 16; r0 += 4) {
            __m512 acc[4][4];
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++)
                    acc[i][j] = _mm512_loadu_ps(o + (r0 + i) * o_stride + (t0 + j) * 16);
            for (int k = 0; k < 16; k++) {
                __m512bh b[4];
                for (int j = 0; j < 4; j++)
                    b[j] = (__m512bh)_mm512_load_si512(vv + (t0 + j) * 512 + k * 32);
                for (int i = 0; i < 4; i++) {
                    const __m512bh a =
                        (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)(p + (r0 + i) * p_stride))[k]);
                    for (int j = 0; j < 4; j++)
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
                }
            }
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++)
                    _mm512_storeu_ps(o + (r0 + i) * o_stride + (t0 + j) * 16, acc[i][j]);
        }
}


/* The tile instructions the kernels use, emulated. */
#define tile_loadconfig(cfg) amx_emu_loadconfig((const struct amx_tile_config *)(cfg))
#define tile_zero(t) amx_emu_zero(t)
#define tile_loadd(t, base, stride) amx_emu_loadd((t), (base), (stride))
#define tile_stored(t, base, stride) amx_emu_stored((t), (base), (stride))
#define tile_dpbf16ps(c, a, b) amx_emu_dpbf16ps((c), (a), (b))
#define tile_release() ((void)0)
#endif

/* Position ``pos``'s row in a paged cache (``table``: the sequence's block ids; strides and
 * ``offset``, its KV head's, in elements). */
static inline __attribute__((always_inline)) const bf16_t *amx_cache_row(const bf16_t *cache, const int32_t *table,
                                                                         int64_t pos, int block_size, int64_t s_block,
                                                                         int64_t s_pos, int64_t offset) {
    return cache + (int64_t)table[pos / block_size] * s_block + (pos % block_size) * s_pos + offset;
}

/* A configuration with every tile 16 rows of 64 bytes (32 bf16 or 16 fp32); a caller may shorten
 * some tiles' rows before loading it. */
static inline void amx_full_tiles(struct amx_tile_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg->rows[t] = 16;
        cfg->colsb[t] = 64;
    }
}

/* Every tile 16 rows of 64 bytes; per thread, before its first tile instruction. */
static inline void amx_configure_tiles(void) {
    struct amx_tile_config cfg;
    amx_full_tiles(&cfg);
    tile_loadconfig(&cfg);
}

/* r[i] = row i of a 16 x 16 matrix of 32-bit words; on return r[i] = column i. Unpacks pair the
 * rows' words and double words within 128-bit lanes; two lane shuffles finish the 4 x 4 of lanes. */
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + j], lane L: rows 4i..4i+3 of column 4L + j */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
        r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}

/* The B tiles of S = Q K^T for 16 keys (rows[n]: key n's head_dim values, NULL for zeros):
 * head_dim / 32 tiles of 256 words at kt (64-byte aligned), tile h for dims 32h..32h+31. */
static inline void amx_pack_k16(uint32_t *kt, const bf16_t *const rows[16], int head_dim) {
    for (int h = 0; h < head_dim / 32; h++) {
        __m512i r[16];
        for (int n = 0; n < 16; n++)
            r[n] = rows[n] ? _mm512_loadu_si512(rows[n] + h * 32) : _mm512_setzero_si512();
        transpose16_epi32(r);
        for (int w = 0; w < 16; w++)
            _mm512_store_si512(kt + h * 256 + w * 16, r[w]);
    }
}

/* The B tiles of O = P V for 32 keys (rows[k]: key k's head_dim values, NULL for zeros):
 * head_dim / 16 tiles of 512 elements at vv (64-byte aligned), tile t for dims 16t..16t+15. */
static inline void amx_pack_v32(bf16_t *vv, const bf16_t *const rows[32], int head_dim) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int p = 0; p < 16; p++) {
        for (int d = 0; d < head_dim; d += 32) {
            const __m512i r0 = rows[2 * p] ? _mm512_loadu_si512(rows[2 * p] + d) : _mm512_setzero_si512();
            const __m512i r1 = rows[2 * p + 1] ? _mm512_loadu_si512(rows[2 * p + 1] + d) : _mm512_setzero_si512();
            /* dims d..d+15 go to tile d/16, d+16..d+31 to the next one */
            _mm512_store_si512(vv + (d / 16) * 512 + p * 32, _mm512_permutex2var_epi16(r0, lo, r1));
            _mm512_store_si512(vv + (d / 16 + 1) * 512 + p * 32, _mm512_permutex2var_epi16(r0, hi, r1));
        }
    }
}

#endif
#endif
