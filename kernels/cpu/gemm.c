/* A GEMM for CPUs with AVX2 and FMA: bfloat16 where oneDNN has none, float32 where oneDNN has
 * nothing wider than AVX2 either.
 *
 * oneDNN computes bfloat16 only with AVX-512 (or AVX-NE-CONVERT); on an AVX2-only CPU torch
 * falls back to a generic loop that runs several times slower than float32. Yet bfloat16 is
 * the faster format on such a machine too when weights stream from memory (a decode step reads
 * every weight once): half the bytes. This kernel keeps weights in their dtype and computes in
 * float32 registers: a bfloat16 is the top half of a float32, so widening is one shift.
 *
 *   y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]),  float32 products and sums, rounded to the
 *   dtype once at the end (as torch's and oneDNN's GEMMs do).
 *
 * Weights are packed once at load (by `cpu_ops.pack_linear_weight`, in torch) into column
 * blocks of BLOCK output features, transposed: packed[b][k][j] = W[b * BLOCK + j, k], zeros
 * past n. Each step of the inner loop then loads BLOCK contiguous weights for one k and
 * multiplies them into up to ROWS rows of x at once (a ROWS x BLOCK tile of float32 sums held
 * in 12 of AVX2's 16 registers): every weight read from memory feeds ROWS rows, and a block is
 * read front to back, which the hardware prefetcher follows (oneDNN's float32 at decode sizes,
 * 19 rows, streams the same weights a fifth to a third slower on the AVX2 EPYC measured).
 *
 * A block is read once from memory, by its first tile; the other tiles find it in L2. So while
 * a block's tiles compute, they ask for the next block (a software prefetch, once per 64-byte
 * line): memory and arithmetic overlap instead of taking turns. The lines are shared out over
 * the block's tiles and spread evenly over their steps: asked for all at once by the first tile,
 * they queued behind one core's few outstanding misses and that tile waited on them (one core
 * streams ~13 GB/s there, two ~26). On that EPYC, at 19 rows, the prefetch took the model's
 * float32 GEMMs from 58 to 42 ms a step, bfloat16's from 32 to 30; spreading it, float32's by
 * another 5-17 % at 12-96 rows (bfloat16, half the bytes, was hidden already).
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

int gemm_available(void) { return 1; }

/* Whether float32 should come here rather than to oneDNN: where oneDNN has nothing wider than
 * AVX2 either, this kernel's decode-sized GEMMs are faster (it streams weights in the order it
 * uses them); with AVX-512, oneDNN's float32 is twice as wide. */
int gemm_f32_preferred(void) {
#if defined(__AVX512F__)
    return 0;
#else
    return 1;
#endif
}

static inline __m256 load8_bf16(const uint16_t *eight) {
    __m128i raw = _mm_loadu_si128((const __m128i *)eight);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

static inline __m256 load8_f32(const float *eight) { return _mm256_loadu_ps(eight); }

/* TILE: `rows` (<= ROWS, a constant at every call, so the compiler drops the dead rows and keeps
 * the sums in registers) rows of x (float32, row stride ldx) times one packed column block
 * (k x BLOCK of W), plus the block's bias (float32, BLOCK of them), into `rows` x `cols` of y,
 * prefetching the column block `next` into L2 as it goes.
 * BLOCKS: rows [first, first + count) of x against one column block, in tiles of at most ROWS
 * rows cut evenly (19 rows go as 5 + 5 + 5 + 4, not 6 + 6 + 6 + 1: every tile reads the whole
 * block). LINEAR: y [m, n] (row stride ldy) = x [m, k] (row stride ldx) . W^T + bias (W packed,
 * bias [n] or NULL); 0, or -1 when it could not allocate its float32 copies. */
#define DEFINE_GEMM(SUFFIX, T, LOAD8, TO_FLOAT, FROM_FLOAT)                                            \
    static inline __attribute__((always_inline)) void tile_##SUFFIX(                                   \
        int rows, const float *x, int64_t ldx, const T *block, int64_t k, const float *bias, T *y,      \
        int64_t ldy, int cols, const T *next, int64_t turn, int64_t turns) {                           \
        __m256 sum[ROWS][2];                                                                           \
        /* this tile's share of the next block's lines: one every `turns` of all tiles' steps */     \
        const int64_t per_line = 64 / (BLOCK * (int64_t)sizeof(T));                                    \
        const int64_t period = turns * per_line;                                                       \
        int64_t due = (period - turn * k % period) % period; /* steps to this tile's first line */  \
        const char *line = (const char *)(next + (turn * k + due) / turns * BLOCK);                    \
        _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) {                                       \
            sum[r][0] = _mm256_loadu_ps(bias);                                                         \
            sum[r][1] = _mm256_loadu_ps(bias + 8);                                                     \
        }                                                                                              \
        for (int64_t p = 0; p < k; p++) {                                                              \
            const __m256 w0 = LOAD8(block + p * BLOCK), w1 = LOAD8(block + p * BLOCK + 8);             \
            if (due == 0) {                                                                            \
                _mm_prefetch(line, _MM_HINT_T1);                                                       \
                line += 64; /* this tile's lines are consecutive */                                    \
                due = period;                                                                          \
            }                                                                                          \
            due--;                                                                                     \
            _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) {                                   \
                const __m256 xr = _mm256_broadcast_ss(x + r * ldx + p);                                \
                sum[r][0] = _mm256_fmadd_ps(xr, w0, sum[r][0]);                                        \
                sum[r][1] = _mm256_fmadd_ps(xr, w1, sum[r][1]);                                        \
            }                                                                                          \
        }                                                                                              \
        float out[BLOCK];                                                                              \
        _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) {                                       \
            _mm256_storeu_ps(out, sum[r][0]);                                                          \
            _mm256_storeu_ps(out + 8, sum[r][1]);                                                      \
            for (int j = 0; j < cols; j++) y[r * ldy + j] = FROM_FLOAT(out[j]);                        \
        }                                                                                              \
    }                                                                                                  \
                                                                                                       \
    static void blocks_##SUFFIX(const float *x, int64_t ldx, int64_t k, int64_t first, int64_t count,  \
                                const T *block, const float *bias, T *y, int64_t ldy, int cols,        \
                                const T *next) {                                                       \
        const int64_t turns = (count + ROWS - 1) / ROWS;                                               \
        for (int64_t r = first, left = count, tiles = turns; left > 0; tiles--) {                      \
            const int64_t rows = (left + tiles - 1) / tiles, turn = turns - tiles;                     \
            const float *xr = x + r * ldx;                                                             \
            T *yr = y + r * ldy;                                                                       \
            switch (rows) {                                                                            \
                case 6: tile_##SUFFIX(6, xr, ldx, block, k, bias, yr, ldy, cols, next, turn, turns); break;         \
                case 5: tile_##SUFFIX(5, xr, ldx, block, k, bias, yr, ldy, cols, next, turn, turns); break;         \
                case 4: tile_##SUFFIX(4, xr, ldx, block, k, bias, yr, ldy, cols, next, turn, turns); break;         \
                case 3: tile_##SUFFIX(3, xr, ldx, block, k, bias, yr, ldy, cols, next, turn, turns); break;         \
                case 2: tile_##SUFFIX(2, xr, ldx, block, k, bias, yr, ldy, cols, next, turn, turns); break;         \
                default: tile_##SUFFIX(1, xr, ldx, block, k, bias, yr, ldy, cols, next, turn, turns); break;        \
            }                                                                                          \
            r += rows;                                                                                 \
            left -= rows;                                                                              \
        }                                                                                              \
    }                                                                                                  \
                                                                                                       \
    int linear_##SUFFIX(const T *x, int64_t ldx, int64_t m, int64_t k, const T *packed, int64_t n,     \
                        const T *bias, T *y, int64_t ldy) {                                            \
        const int64_t blocks = (n + BLOCK - 1) / BLOCK;                                                \
        /* x in float32 (a copy unless it is float32 already), and a bias for every padded column */  \
        const int copy = sizeof(T) != sizeof(float);                                                   \
        float *wide = malloc(sizeof(float) * (size_t)((copy ? m * k : 0) + blocks * BLOCK));           \
        if (wide == NULL) return -1;                                                                   \
        float *wide_bias = wide + (copy ? m * k : 0);                                                  \
        const float *xf = copy ? wide : (const float *)(const void *)x;                                \
        const int64_t ldxf = copy ? k : ldx;                                                           \
        if (copy)                                                                                      \
            for (int64_t r = 0; r < m; r++)                                                            \
                for (int64_t p = 0; p < k; p++) wide[r * k + p] = TO_FLOAT(x[r * ldx + p]);            \
        for (int64_t j = 0; j < blocks * BLOCK; j++)                                                   \
            wide_bias[j] = bias != NULL && j < n ? TO_FLOAT(bias[j]) : 0.0f;                           \
        _Pragma("omp parallel if (m * n * k >= PARALLEL_MIN_MACS)") {                                  \
            for (int64_t first = 0; first < m; first += CHUNK) {                                       \
                const int64_t count = m - first < CHUNK ? m - first : CHUNK;                           \
                _Pragma("omp for schedule(static) nowait") for (int64_t b = 0; b < blocks; b++) {      \
                    const int cols = n - b * BLOCK < BLOCK ? (int)(n - b * BLOCK) : BLOCK;             \
                    blocks_##SUFFIX(xf, ldxf, k, first, count, packed + b * k * BLOCK,                 \
                                    wide_bias + b * BLOCK, y + b * BLOCK, ldy, cols,                   \
                                    packed + (b + 1 < blocks ? b + 1 : b) * k * BLOCK);                \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        free(wide);                                                                                    \
        return 0;                                                                                      \
    }

DEFINE_GEMM(bf16, uint16_t, load8_bf16, bf16_to_float, float_to_bf16)
DEFINE_GEMM(f32, float, load8_f32, f32_to_float, float_to_f32)

#else

/* Without AVX2 and FMA there is nothing here faster than torch's own GEMMs: callers keep those. */
int gemm_available(void) { return 0; }
int gemm_f32_preferred(void) { return 0; }

#define DEFINE_GEMM(SUFFIX, T)                                                                         \
    int linear_##SUFFIX(const T *x, int64_t ldx, int64_t m, int64_t k, const T *packed, int64_t n,     \
                        const T *bias, T *y, int64_t ldy) {                                            \
        (void)x, (void)ldx, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y, (void)ldy;   \
        return -1;                                                                                     \
    }

DEFINE_GEMM(bf16, uint16_t)
DEFINE_GEMM(f32, float)

#endif
