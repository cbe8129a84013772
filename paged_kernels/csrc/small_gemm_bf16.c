/* A bf16 linear layer on AMX tiles for the batches of decode steps and short prefills:
 * y = bf16(x . W^T + bias), fp32 sums.
 *
 * oneDNN's GEMM costs tens of microseconds a call beyond its memory traffic at 1-64 rows (a
 * SmolLM2-135M decode step of one token spends ~13 ms in its 120 decoder-layer GEMMs, ~8.5 of
 * which reading the weights needs) and runs below the tiles' rate up to ~1,000 rows. Here the
 * weight is laid out once (small_gemm_pack_bf16) as the B tiles of TDPBF16PS: per 16 output
 * columns, line p holds the columns' input pairs (2p, 2p + 1), so the 16 lines of a 32-input block
 * are one 1 KB tile, read straight from the packed weight. x needs no packing: a tile of 16 rows x
 * 32 inputs is loaded with x's row stride.
 *
 * With out_features a multiple of 32, a work item is 32 rows x 32 columns (four C tiles fed by two
 * A and two B tiles, each load feeding two products), column pair by column pair so that a pair's
 * weight comes from memory once and from the core's cache for its further rows: at any row count,
 * 1 to 64 included, this beats an item of 16 columns for all rows (four C tiles, each weight tile
 * read once but each A tile loaded for one product: at 64 rows the loads of x from L2 outweigh the
 * weight's traffic). Otherwise (up to 64 rows) the 16-column items. A bias (bf16) is added to the
 * fp32 sums before the rounding, as oneDNN adds it.
 *
 * Each output is the same chain of tile products over its inputs, in the same order, whatever the
 * rows beside it and the path: a row's result depends on that row alone (batch-invariant). It
 * differs from oneDNN's only in the order of the fp32 sums; the tiles treat denormal inputs as zero.
 *
 * Without AMX (or where Linux refuses the process the tile registers) small_gemm_bf16_available()
 * says 0 and callers keep oneDNN: amx_tiles.h's emulation of the tiles with AVX-512 BF16 beats
 * oneDNN only at one or two rows (SmolLM2-135M's 120 layer GEMMs on a 2-core AMD EPYC: 9.5 vs
 * 11.5 ms at one row, 13.3 vs 11.8 at eight), and a packed model pads its steps to eight rows.
 * Built by paged_kernels/native.py.
 */
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16.h"

#if defined(HAVE_AMX_TILES) && !AMX_TILES_EMULATED
#define SMALL_GEMM_TILES 1 /* the tile unit itself */
#endif

#define GROUP 16            /* output columns per work item: one C tile's width */
#define CHUNK_BLOCKS 4      /* row blocks of 16 whose C tiles a work item holds at once */

int small_gemm_bf16_available(void)
{
#ifdef SMALL_GEMM_TILES
    return amx_permitted();
#else
    return 0;
#endif
}

/* packed[((c / 16) * (k / 2) + p) * 32 + (c % 16) * 2 + j] = w[c * ldw + 2p + j] for the weight w
 * [n, k] (bf16 rows): n a multiple of 16, k of 32 (the caller checks). */
void small_gemm_pack_bf16(const bf16_t *w, int64_t ldw, bf16_t *packed, int64_t n, int64_t k)
{
    const int64_t pairs = k / 2;
    for (int64_t c = 0; c < n; c++) {
        bf16_t *line = packed + (c / GROUP) * pairs * (2 * GROUP) + (c % GROUP) * 2;
        const bf16_t *row = w + c * ldw;
        for (int64_t p = 0; p < pairs; p++) {
            line[p * 2 * GROUP] = row[2 * p];
            line[p * 2 * GROUP + 1] = row[2 * p + 1];
        }
    }
}

#ifdef SMALL_GEMM_TILES
/* Tiles: C0..C3 the outputs of a chunk's row blocks 0..3 (16 rows each), A a block of x; the last
 * row block of x (its rows may be fewer) goes to C_LAST and A_LAST; B the weight's tile. */
#define T_C0 0
#define T_C1 1
#define T_C2 2
#define T_C3 3
#define T_A 4
#define T_A_LAST 5
#define T_B 6
#define T_C_LAST 7

static void configure(int last_rows)
{
    struct amx_tile_config cfg;
    amx_full_tiles(&cfg);
    cfg.rows[T_A_LAST] = cfg.rows[T_C_LAST] = last_rows;
    tile_loadconfig(&cfg);
}

/* C += A(x's row block at xb) B, the block loaded into tile A. Tile numbers must be literals. */
#define PRODUCT(C, A, xb)                      \
    do {                                       \
        tile_loadd(A, (xb), ldx * 2);         \
        tile_dpbf16ps(C, A, T_B);             \
    } while (0)

static inline __attribute__((always_inline)) void store(int tile, float *acc, const bf16_t *bias, bf16_t *y,
                                                         int64_t ldy, int rows)
{
    switch (tile) {
    case T_C0: tile_stored(T_C0, acc, GROUP * sizeof(float)); break;
    case T_C1: tile_stored(T_C1, acc, GROUP * sizeof(float)); break;
    case T_C2: tile_stored(T_C2, acc, GROUP * sizeof(float)); break;
    case T_C3: tile_stored(T_C3, acc, GROUP * sizeof(float)); break;
    default: tile_stored(T_C_LAST, acc, GROUP * sizeof(float)); break;
    }
    const __m512 b = bias ? widen16_bf16(bias) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++)
        _mm256_storeu_si256((__m256i *)(y + r * ldy),
                            narrow16_bf16(_mm512_add_ps(_mm512_loadu_ps(acc + r * GROUP), b)));
}

/* One chunk of up to CHUNK_BLOCKS row blocks for 16 columns: y and x point at the chunk's first
 * row (y at its columns); `last`: the chunk's last block is x's last (C_LAST, last_rows rows).
 * `wg`: the columns' packed weight, k / 32 tiles. */
static inline __attribute__((always_inline)) void chunk(const bf16_t *x, int64_t ldx, const bf16_t *wg, int64_t k,
                                                        const bf16_t *bias, bf16_t *y, int64_t ldy, int blocks,
                                                        int last, int last_rows, float *acc)
{
    const int full = last ? blocks - 1 : blocks;  /* blocks in C0..C3 */
    if (full > 0) tile_zero(T_C0);
    if (full > 1) tile_zero(T_C1);
    if (full > 2) tile_zero(T_C2);
    if (full > 3) tile_zero(T_C3);
    if (last) tile_zero(T_C_LAST);
    const bf16_t *xl = x + (int64_t)full * 16 * ldx;
    for (int64_t kb = 0; kb < k / 32; kb++) {
        const int64_t o = kb * 32;
        tile_loadd(T_B, wg + kb * 16 * 2 * GROUP, 2 * GROUP * sizeof(bf16_t));
        if (full > 0) PRODUCT(T_C0, T_A, x + o);
        if (full > 1) PRODUCT(T_C1, T_A, x + 16 * ldx + o);
        if (full > 2) PRODUCT(T_C2, T_A, x + 32 * ldx + o);
        if (full > 3) PRODUCT(T_C3, T_A, x + 48 * ldx + o);
        if (last) PRODUCT(T_C_LAST, T_A_LAST, xl + o);
    }
    for (int t = 0; t < full; t++)
        store(T_C0 + t, acc, bias, y + (int64_t)16 * t * ldy, ldy, 16);
    if (last)
        store(T_C_LAST, acc, bias, y + (int64_t)16 * full * ldy, ldy, last_rows);
}

/* out_features a multiple of 32, any row count: a work item is 32 rows x 32 columns, four C
 * tiles fed by two A and two B tiles per 32 inputs (each tile load feeds two products). Items go
 * column pair by column pair, so a pair's weight is read from memory once and from the core's
 * cache for its further row pairs. The last row pair may hold fewer rows: its own tile shapes. */
#define T_C00 0 /* row block 0, column group 0 */
#define T_C01 1
#define T_C10 2 /* row block 1 */
#define T_C11 3
#define T_A0 4
#define T_A1 5
#define T_B0 6
#define T_B1 7

static void configure_pair(int rows0, int rows1)
{
    struct amx_tile_config cfg;
    amx_full_tiles(&cfg);
    cfg.rows[T_C00] = cfg.rows[T_C01] = cfg.rows[T_A0] = rows0;
    if (rows1)
        cfg.rows[T_C10] = cfg.rows[T_C11] = cfg.rows[T_A1] = rows1;
    tile_loadconfig(&cfg);
}

/* The SiLU * up epilogue of one row block: gate sums in acc (16 rows x 16 columns), up sums beside
 * them (acc + 16 * GROUP); y[r, j] = bf16(bf16(silu(g)) * u) with g and u the sums rounded to bf16
 * as the plain GEMM rounds them (+0 added, as for a missing bias), then silu_mul16_bf16
 * (avx512_math.h): exactly silu_mul_bf16 (cpu_fused_ops.c) of the plain GEMM's output. */
static inline __attribute__((always_inline)) void store_silu_mul(const float *acc, bf16_t *y, int64_t ldy, int rows)
{
    const __m512 zero = _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 g = widen_bf16(narrow16_bf16(_mm512_add_ps(_mm512_loadu_ps(acc + r * GROUP), zero)));
        const __m512 u = widen_bf16(narrow16_bf16(_mm512_add_ps(_mm512_loadu_ps(acc + (16 + r) * GROUP), zero)));
        _mm256_storeu_si256((__m256i *)(y + r * ldy), silu_mul16_bf16(g, u));
    }
}

/* One 32 x 32 item: rows0 (+ rows1) rows, the two column groups w0 and w1. `silu`: the groups are
 * the gate's and the up's same 16 columns, and y gets their SiLU * up (16 columns). */
static inline __attribute__((always_inline)) void pair_item(const bf16_t *x, int64_t ldx, const bf16_t *w0,
                                                            const bf16_t *w1, int64_t k, const bf16_t *bias,
                                                            bf16_t *y, int64_t ldy, int rows0, int rows1, float *acc,
                                                            const int silu)
{
    tile_zero(T_C00);
    tile_zero(T_C01);
    if (rows1) {
        tile_zero(T_C10);
        tile_zero(T_C11);
    }
    for (int64_t kb = 0; kb < k / 32; kb++) {
        const int64_t o = kb * 32;
        tile_loadd(T_B0, w0 + kb * 16 * 2 * GROUP, 2 * GROUP * sizeof(bf16_t));
        tile_loadd(T_B1, w1 + kb * 16 * 2 * GROUP, 2 * GROUP * sizeof(bf16_t));
        tile_loadd(T_A0, x + o, ldx * 2);
        tile_dpbf16ps(T_C00, T_A0, T_B0);
        tile_dpbf16ps(T_C01, T_A0, T_B1);
        if (rows1) {
            tile_loadd(T_A1, x + 16 * ldx + o, ldx * 2);
            tile_dpbf16ps(T_C10, T_A1, T_B0);
            tile_dpbf16ps(T_C11, T_A1, T_B1);
        }
    }
    if (silu) {
        tile_stored(T_C00, acc, GROUP * sizeof(float));
        tile_stored(T_C01, acc + 16 * GROUP, GROUP * sizeof(float));
        store_silu_mul(acc, y, ldy, rows0);
        if (rows1) {
            tile_stored(T_C10, acc, GROUP * sizeof(float));
            tile_stored(T_C11, acc + 16 * GROUP, GROUP * sizeof(float));
            store_silu_mul(acc, y + 16 * ldy, ldy, rows1);
        }
        return;
    }
    store(T_C00, acc, bias, y, ldy, rows0);
    store(T_C01, acc, bias ? bias + GROUP : NULL, y + GROUP, ldy, rows0);
    if (rows1) {
        store(T_C10, acc, bias, y + 16 * ldy, ldy, rows1);
        store(T_C11, acc, bias ? bias + GROUP : NULL, y + 16 * ldy + GROUP, ldy, rows1);
    }
}

static void gemm_pairs(const bf16_t *x, int64_t ldx, const bf16_t *packed, const bf16_t *bias, bf16_t *y,
                       int64_t ldy, int64_t rows, int64_t n, int64_t k, int num_threads, const int silu)
{
    const int64_t row_pairs = (rows + 31) / 32, col_pairs = n / 32, group_elems = k * GROUP;
    const int last0 = (int)(rows - 32 * (row_pairs - 1) >= 16 ? 16 : rows - 32 * (row_pairs - 1));
    const int last1 = (int)(rows - 32 * (row_pairs - 1) > 16 ? rows - 32 * (row_pairs - 1) - 16 : 0);
    const int ragged = last0 != 16 || last1 != 16;
    #pragma omp parallel num_threads(num_threads)
    {
        float acc[2 * 16 * GROUP] __attribute__((aligned(64)));
        int shape = -1; /* 0: full pairs, 1: the last pair's shape */
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < col_pairs * row_pairs; item++) {
            const int64_t c = item / row_pairs, r = item % row_pairs;
            const int last = ragged && r == row_pairs - 1;
            if (shape != last) {
                configure_pair(last ? last0 : 16, last ? last1 : 16);
                shape = last;
            }
            const bf16_t *w0 = packed + 2 * c * group_elems;
            pair_item(x + r * 32 * ldx, ldx, w0, w0 + group_elems, k, bias ? bias + c * 32 : NULL,
                      y + r * 32 * ldy + c * (silu ? 16 : 32), ldy, last ? last0 : 16, last ? last1 : 16, acc, silu);
        }
        tile_release();
    }
}
#endif

/* y [rows, n] (row stride ldy) = bf16(x [rows, k] (row stride ldx) . W^T + bias), W packed by
 * small_gemm_pack_bf16, bias [n] bf16 or NULL (added to the fp32 sums). Returns 0, or -1 where it
 * cannot run (no AMX, or n not a multiple of 16, k of 32). With n a multiple of 32, gemm_pairs; else
 * each work item is 16 columns of y, its weight (k / 32 tiles) read from memory once and from the
 * core's cache for each further chunk of 64 rows. */
int small_gemm_bf16(const bf16_t *x, int64_t ldx, const bf16_t *packed, const bf16_t *bias, bf16_t *y, int64_t ldy,
                    int64_t rows, int64_t n, int64_t k, int num_threads)
{
#ifdef SMALL_GEMM_TILES
    if (rows < 1 || n % GROUP || k % 32 || !amx_permitted())
        return -1;
    if (n % 32 == 0) {
        gemm_pairs(x, ldx, packed, bias, y, ldy, rows, n, k, num_threads, 0);
        return 0;
    }
    const int64_t blocks = (rows + 15) / 16, group_elems = k * GROUP, groups = n / GROUP;
    const int last_rows = (int)(rows - 16 * (blocks - 1));
    #pragma omp parallel num_threads(num_threads)
    {
        configure(last_rows);
        float acc[16 * GROUP] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            for (int64_t b0 = 0; b0 < blocks; b0 += CHUNK_BLOCKS) {
                const int nb = (int)(blocks - b0 < CHUNK_BLOCKS ? blocks - b0 : CHUNK_BLOCKS);
                chunk(x + b0 * 16 * ldx, ldx, packed + g * group_elems, k, bias ? bias + g * GROUP : NULL,
                      y + b0 * 16 * ldy + g * GROUP, ldy, nb, b0 + nb == blocks, last_rows, acc);
            }
        }
        tile_release();
    }
    return 0;
#else
    (void)x; (void)ldx; (void)packed; (void)bias; (void)y; (void)ldy; (void)rows; (void)n; (void)k; (void)num_threads;
    return -1;
#endif
}

/* y [rows, inter] (row stride ldy) = bf16(bf16(silu(g)) * u), g and u the gate's and the up's
 * outputs of x [rows, k] as small_gemm_bf16 computes and rounds them: a fused gate/up weight
 * [2 * inter, k] (gate rows, then up rows) packed by small_gemm_pack_bf16 with its 16-row groups
 * interleaved (gate group j, then up group j), so that a 32-column item holds one group of each.
 * The same bits as silu_mul_bf16 (cpu_fused_ops.c) of small_gemm_bf16's output, without writing
 * and reading that [rows, 2 * inter] output. Returns 0, or -1 where it cannot run (no AMX, or
 * inter not a multiple of 16, k of 32). */
int small_gemm_silu_mul_bf16(const bf16_t *x, int64_t ldx, const bf16_t *packed, bf16_t *y, int64_t ldy,
                             int64_t rows, int64_t inter, int64_t k, int num_threads)
{
#ifdef SMALL_GEMM_TILES
    if (rows < 1 || inter < 1 || inter % GROUP || k % 32 || !amx_permitted())
        return -1;
    gemm_pairs(x, ldx, packed, NULL, y, ldy, rows, 2 * inter, k, num_threads, 1);
    return 0;
#else
    (void)x; (void)ldx; (void)packed; (void)y; (void)ldy; (void)rows; (void)inter; (void)k; (void)num_threads;
    return -1;
#endif
}
