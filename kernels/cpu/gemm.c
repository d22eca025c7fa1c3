/* A bfloat16 GEMM for CPUs that have AVX2 and FMA but no bfloat16 matmul instructions.
 *
 * oneDNN computes bfloat16 only with AVX-512 (or AVX-NE-CONVERT); on an AVX2-only CPU torch
 * falls back to a generic loop that runs several times slower than float32. Yet bfloat16 is
 * the faster format on such a machine too when weights stream from memory (a decode step reads
 * every weight once): half the bytes. This kernel keeps weights in bfloat16 and computes in
 * float32 registers: a bfloat16 is the top half of a float32, so widening is one shift.
 *
 *   y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]),  every operand bfloat16, float32 sums,
 *   rounded to nearest-even into bfloat16 once at the end (as torch's and oneDNN's GEMMs do).
 *
 * Weights are packed once at load (by `cpu_ops.pack_linear_weight`, in torch) into column
 * blocks of BLOCK output features, transposed: packed[b][k][j] = W[b * BLOCK + j, k], zeros
 * past n. Each step of the inner loop then loads BLOCK contiguous weights for one k and
 * multiplies them into up to ROWS rows of x at once (a ROWS x BLOCK tile of float32 sums held
 * in 12 of AVX2's 16 registers): every weight read from memory feeds ROWS rows.
 *
 * Column blocks are shared out over torch's OpenMP threads (this library links the same
 * libgomp); large inputs are taken in chunks of CHUNK rows so a chunk of x stays in L2 while
 * every column block passes over it.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define BLOCK 16
#define ROWS 6
#define CHUNK 48
/* Below this many multiply-adds a parallel region costs more than it saves. */
#define PARALLEL_MIN_MACS (1 << 18)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int gemm_bf16_available(void) { return 1; }

static inline __m256 widen(const uint16_t *eight) {
    __m128i raw = _mm_loadu_si128((const __m128i *)eight);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

/* One tile: `rows` (<= ROWS) rows of x (float32, row stride ldx) times one packed column block
 * (k x BLOCK), plus the block's bias (float32, BLOCK of them), into `rows` x `cols` of y. */
static inline __attribute__((always_inline)) void tile(int rows, const float *x, int64_t ldx, const uint16_t *block, int64_t k,
                        const float *bias, uint16_t *y, int64_t ldy, int cols) {
    __m256 sum[ROWS][2];
    _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) {
        sum[r][0] = _mm256_loadu_ps(bias);
        sum[r][1] = _mm256_loadu_ps(bias + 8);
    }
    /* `rows` is a constant in each call below, so the compiler drops the dead rows. */
    for (int64_t p = 0; p < k; p++) {
        const __m256 w0 = widen(block + p * BLOCK), w1 = widen(block + p * BLOCK + 8);
        _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) {
            const __m256 xr = _mm256_broadcast_ss(x + r * ldx + p);
            sum[r][0] = _mm256_fmadd_ps(xr, w0, sum[r][0]);
            sum[r][1] = _mm256_fmadd_ps(xr, w1, sum[r][1]);
        }
    }
    float out[BLOCK];
    _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out, sum[r][0]);
        _mm256_storeu_ps(out + 8, sum[r][1]);
        for (int j = 0; j < cols; j++) y[r * ldy + j] = float_to_bf16(out[j]);
    }
}

/* Rows [first, first + count) of x against one column block, in tiles of at most ROWS rows cut
 * evenly (19 rows go as 5 + 5 + 5 + 4, not 6 + 6 + 6 + 1: every tile reads the whole block). */
static void rows_times_block(const float *x, int64_t k, int64_t first, int64_t count, const uint16_t *block,
                             const float *bias, uint16_t *y, int64_t ldy, int cols) {
    for (int64_t r = first, left = count, tiles = (count + ROWS - 1) / ROWS; left > 0; tiles--) {
        const int64_t rows = (left + tiles - 1) / tiles;
        const float *xr = x + r * k;
        uint16_t *yr = y + r * ldy;
        switch (rows) {
            case 6: tile(6, xr, k, block, k, bias, yr, ldy, cols); break;
            case 5: tile(5, xr, k, block, k, bias, yr, ldy, cols); break;
            case 4: tile(4, xr, k, block, k, bias, yr, ldy, cols); break;
            case 3: tile(3, xr, k, block, k, bias, yr, ldy, cols); break;
            case 2: tile(2, xr, k, block, k, bias, yr, ldy, cols); break;
            default: tile(1, xr, k, block, k, bias, yr, ldy, cols); break;
        }
        r += rows;
        left -= rows;
    }
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) . W^T + bias; W packed as above, bias
 * bfloat16 [n] or NULL. Returns 0, or -1 when it could not allocate its float32 copy of x. */
int linear_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                const uint16_t *bias, uint16_t *y, int64_t ldy) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    float *wide = malloc(sizeof(float) * (size_t)(m * k + blocks * BLOCK));
    if (wide == NULL) return -1;
    float *wide_bias = wide + m * k;
    for (int64_t r = 0; r < m; r++)
        for (int64_t p = 0; p < k; p++) wide[r * k + p] = bf16_to_float(x[r * ldx + p]);
    for (int64_t j = 0; j < blocks * BLOCK; j++) wide_bias[j] = bias != NULL && j < n ? bf16_to_float(bias[j]) : 0.0f;

    _Pragma("omp parallel if (m * n * k >= PARALLEL_MIN_MACS)") {
        for (int64_t first = 0; first < m; first += CHUNK) {
            const int64_t count = m - first < CHUNK ? m - first : CHUNK;
            _Pragma("omp for schedule(static) nowait") for (int64_t b = 0; b < blocks; b++) {
                const int cols = n - b * BLOCK < BLOCK ? (int)(n - b * BLOCK) : BLOCK;
                rows_times_block(wide, k, first, count, packed + b * k * BLOCK, wide_bias + b * BLOCK,
                                 y + b * BLOCK, ldy, cols);
            }
        }
    }
    free(wide);
    return 0;
}

#else

/* Without AVX2 and FMA there is nothing here faster than torch's own loop: callers keep it. */
int gemm_bf16_available(void) { return 0; }

int linear_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                const uint16_t *bias, uint16_t *y, int64_t ldy) {
    (void)x, (void)ldx, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y, (void)ldy;
    return -1;
}

#endif
