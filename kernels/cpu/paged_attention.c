/*
 * Paged attention, one query token at a time, reading keys and values where they lie in the
 * paged cache: no gather of a sequence's context into a dense tensor first.
 *
 * Work item i is query token rows[i]: it attends over positions [0, context_lens[i]) of
 * sequence seqs[i], whose blocks are block_tables[seqs[i], :] (a decode attends over its whole
 * sequence; a prompt token over the positions up to its own: causal); with a sliding window
 * (window > 0), over the last `window` of them only. Caches are
 * [num_blocks, block_size, num_kv_heads, head_dim] and outputs [tokens, num_q_heads, head_dim],
 * contiguous; queries the same with any row stride (a view of the fused QKV projection). The
 * query heads that share a KV head (grouped-query attention) are done together, so each key and
 * value row comes from memory once (and from L1 for the group's other heads).
 *
 * One pass over the context with an online softmax (running maximum and sum, the accumulator
 * rescaled when the maximum grows), in float32 whatever the storage dtype, block by block. A
 * software prefetch of the next block won in isolation and lost in the engine, so there is none.
 * The (token, KV head) pairs are shared out over torch's own OpenMP threads: this library links
 * libgomp.so.1, which is the copy torch already loaded, so there is one thread pool, not two.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 256

/* Eight floats as one value (GCC / clang vector extensions: one AVX register, or two SSE ones). */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8_f32(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX2__)
#include <immintrin.h>
/* One widening load (GCC splits the portable form below into halves, a third slower here). */
static inline v8f load8_bf16(const uint16_t *p) {
    const __m128i half = _mm_loadu_si128((const __m128i *)p);
    return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
#else
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline v8f load8_bf16(const uint16_t *p) {
    v8u16 half;
    memcpy(&half, p, sizeof half);
    v8u32 bits = __builtin_convertvector(half, v8u32) << 16;
    v8f v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
#endif

static inline float sum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/*
 * One block's scores (q . k for each query head of the group and each key) and its values'
 * weighted sum, for a head_dim of NV * 8 known at compile time. A query head's vectors stay in
 * registers while it meets the block's keys two at a time, each with two partial sums (four
 * independent chains of FMAs, not one chain of NV); its accumulator stays in registers while the
 * block's values stream past (the block's rows of this KV head are a few KB: they stay in L1 from
 * one query head to the next).
 */
#define DEFINE_BLOCK_KERNELS(SUFFIX, T, LOAD8, NV)                                                   \
    static inline void scores_##SUFFIX(const float (*q)[MAX_HEAD_DIM], int64_t group, const T *k, \
                                       int64_t stride, int64_t count, float (*scores)[MAX_BLOCK], \
                                       int64_t head_dim) {                                           \
        (void)head_dim; /* NV * 8 */                                                                 \
        for (int64_t g = 0; g < group; g++) {                                                        \
            v8f qv[NV];                                                                              \
            for (int c = 0; c < NV; c++) qv[c] = load8_f32(q[g] + 8 * c);                            \
            int64_t j = 0;                                                                           \
            for (; j + 2 <= count; j += 2) {                                                         \
                const T *k0 = k + j * stride, *k1 = k0 + stride;                                     \
                v8f a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0};                                          \
                for (int c = 0; c < NV; c += 2) {                                                    \
                    a0 += qv[c] * LOAD8(k0 + 8 * c);                                                 \
                    a1 += qv[c] * LOAD8(k1 + 8 * c);                                                 \
                    b0 += qv[c + 1] * LOAD8(k0 + 8 * c + 8);                                         \
                    b1 += qv[c + 1] * LOAD8(k1 + 8 * c + 8);                                         \
                }                                                                                    \
                scores[g][j] = sum8(a0 + b0);                                                        \
                scores[g][j + 1] = sum8(a1 + b1);                                                    \
            }                                                                                        \
            if (j < count) {                                                                         \
                const T *k0 = k + j * stride;                                                        \
                v8f a0 = {0}, b0 = {0};                                                              \
                for (int c = 0; c < NV; c += 2) {                                                    \
                    a0 += qv[c] * LOAD8(k0 + 8 * c);                                                 \
                    b0 += qv[c + 1] * LOAD8(k0 + 8 * c + 8);                                         \
                }                                                                                    \
                scores[g][j] = sum8(a0 + b0);                                                        \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    static inline void values_##SUFFIX(float (*acc)[MAX_HEAD_DIM], int64_t group, const T *v,     \
                                       int64_t stride, int64_t count,                                \
                                       const float (*weights)[MAX_BLOCK], int64_t head_dim) {        \
        (void)head_dim;                                                                              \
        for (int64_t g = 0; g < group; g++) {                                                        \
            v8f av[NV];                                                                              \
            for (int c = 0; c < NV; c++) av[c] = load8_f32(acc[g] + 8 * c);                          \
            for (int64_t j = 0; j < count; j++) {                                                    \
                const T *row = v + j * stride;                                                       \
                const float w = weights[g][j];                                                       \
                for (int c = 0; c < NV; c++) av[c] += w * LOAD8(row + 8 * c);                        \
            }                                                                                        \
            memcpy(acc[g], av, sizeof av);                                                           \
        }                                                                                            \
    }

/* Any head_dim: plain loops. */
#define DEFINE_BLOCK_KERNELS_ANY(SUFFIX, T, TO_FLOAT)                                                \
    static inline void scores_##SUFFIX(const float (*q)[MAX_HEAD_DIM], int64_t group, const T *k, \
                                       int64_t stride, int64_t count, float (*scores)[MAX_BLOCK], \
                                       int64_t head_dim) {                                           \
        for (int64_t j = 0; j < count; j++)                                                          \
            for (int64_t g = 0; g < group; g++) {                                                    \
                float dot = 0.0f;                                                                    \
                for (int64_t d = 0; d < head_dim; d++) dot += q[g][d] * TO_FLOAT(k[j * stride + d]); \
                scores[g][j] = dot;                                                                  \
            }                                                                                        \
    }                                                                                                \
    static inline void values_##SUFFIX(float (*acc)[MAX_HEAD_DIM], int64_t group, const T *v,     \
                                       int64_t stride, int64_t count,                                \
                                       const float (*weights)[MAX_BLOCK], int64_t head_dim) {        \
        for (int64_t j = 0; j < count; j++)                                                          \
            for (int64_t g = 0; g < group; g++)                                                      \
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] += weights[g][j] * TO_FLOAT(v[j * stride + d]); \
    }

/* HEAD_DIM is `head_dim` (any size) or a constant; KERNELS names the block kernels for it. The
   query and the output are of type Q (read with Q_TO_FLOAT, written with Q_FROM_FLOAT), the cache
   of type T: a float32 model over a bfloat16 cache reads its float32 query and writes float32
   output, rounding nothing but the cached keys and values. */
#define DEFINE_PAGED_ATTENTION(NAME, Q, Q_TO_FLOAT, Q_FROM_FLOAT, T, HEAD_DIM, KERNELS)                  \
    static int NAME(const Q *query, int64_t query_stride, const T *key_cache, const T *value_cache, \
                    Q *out, const int32_t *block_tables, int64_t block_table_stride,                 \
                    const int32_t *rows, const int32_t *seqs, const int32_t *context_lens,           \
                    int64_t num_items, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,  \
                    int64_t block_size, float scale, int64_t window) {                               \
        const int64_t group = num_q_heads / num_kv_heads;                                            \
        if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || block_size > MAX_BLOCK ||                \
            group * num_kv_heads != num_q_heads)                                                     \
            return -1;                                                                               \
        const int64_t token_stride = num_kv_heads * (HEAD_DIM); /* between cache slots */              \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")                                 \
        for (int64_t item = 0; item < num_items; item++) {                                           \
            for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++) {                           \
                float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];                      \
                float scores[MAX_GROUP][MAX_BLOCK], running_max[MAX_GROUP], running_sum[MAX_GROUP];  \
                const int64_t first_head = kv_head * group, row = rows[item];                        \
                for (int64_t g = 0; g < group; g++) {                                                \
                    const Q *q_row = query + row * query_stride + (first_head + g) * (HEAD_DIM);        \
                    for (int64_t d = 0; d < (HEAD_DIM); d++) {                                         \
                        q[g][d] = Q_TO_FLOAT(q_row[d]) * scale;                                      \
                        acc[g][d] = 0.0f;                                                            \
                    }                                                                                \
                    running_max[g] = -3.0e38f;                                                       \
                    running_sum[g] = 0.0f;                                                           \
                }                                                                                    \
                const int64_t length = context_lens[item];                                           \
                const int32_t *blocks = block_tables + seqs[item] * block_table_stride;              \
                /* A window starts mid-block: the first stretch runs to the end of its block. */      \
                const int64_t first = window > 0 && length > window ? length - window : 0;           \
                for (int64_t start = first, count; start < length; start += count) {                 \
                    const int64_t offset = start % block_size, room = block_size - offset;           \
                    count = length - start < room ? length - start : room;                           \
                    const int64_t base = (int64_t)blocks[start / block_size] * block_size + offset;  \
                    const int64_t first_slot = base * token_stride + kv_head * (HEAD_DIM);           \
                    scores_##KERNELS(q, group, key_cache + first_slot, token_stride, count,          \
                                     scores, head_dim);                                                \
                    for (int64_t g = 0; g < group; g++) {                                            \
                        float block_max = running_max[g];                                            \
                        for (int64_t j = 0; j < count; j++)                                          \
                            block_max = scores[g][j] > block_max ? scores[g][j] : block_max;         \
                        const float correction = expf(running_max[g] - block_max);                   \
                        float sum = 0.0f;                                                            \
                        _Pragma("omp simd reduction(+ : sum)")                                       \
                        for (int64_t j = 0; j < count; j++) {                                        \
                            scores[g][j] = expf(scores[g][j] - block_max);                           \
                            sum += scores[g][j];                                                     \
                        }                                                                            \
                        running_sum[g] = running_sum[g] * correction + sum;                          \
                        running_max[g] = block_max;                                                  \
                        _Pragma("omp simd")                                                          \
                        for (int64_t d = 0; d < (HEAD_DIM); d++) acc[g][d] *= correction;              \
                    }                                                                                \
                    values_##KERNELS(acc, group, value_cache + first_slot, token_stride, count,      \
                                     (const float(*)[MAX_BLOCK])scores, head_dim);                     \
                }                                                                                    \
                for (int64_t g = 0; g < group; g++) {                                                \
                    Q *out_row = out + (row * num_q_heads + first_head + g) * (HEAD_DIM);              \
                    const float inverse = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;      \
                    for (int64_t d = 0; d < (HEAD_DIM); d++) out_row[d] = Q_FROM_FLOAT(acc[g][d] * inverse); \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        return 0;                                                                                    \
    }

/* The block kernels of a cache dtype, for head_dim 64, 128 and any other. */
#define DEFINE_CACHE_KERNELS(CACHE, T, TO_FLOAT, LOAD8)                                              \
    DEFINE_BLOCK_KERNELS_ANY(CACHE##_any, T, TO_FLOAT)                                               \
    DEFINE_BLOCK_KERNELS(CACHE##_64, T, LOAD8, 8)                                                    \
    DEFINE_BLOCK_KERNELS(CACHE##_128, T, LOAD8, 16)

/* NAME: queries and outputs of type Q over a cache of type T whose block kernels are CACHE's. */
#define DEFINE_DISPATCH(NAME, Q, Q_TO_FLOAT, Q_FROM_FLOAT, T, CACHE)                                  \
    DEFINE_PAGED_ATTENTION(NAME##_any, Q, Q_TO_FLOAT, Q_FROM_FLOAT, T, head_dim, CACHE##_any)         \
    DEFINE_PAGED_ATTENTION(NAME##_64, Q, Q_TO_FLOAT, Q_FROM_FLOAT, T, 64, CACHE##_64)                \
    DEFINE_PAGED_ATTENTION(NAME##_128, Q, Q_TO_FLOAT, Q_FROM_FLOAT, T, 128, CACHE##_128)             \
    int NAME(const Q *query, int64_t query_stride, const T *key_cache, const T *value_cache, Q *out, \
             const int32_t *block_tables, int64_t block_table_stride, const int32_t *rows,           \
             const int32_t *seqs, const int32_t *context_lens, int64_t num_items,                    \
             int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,        \
             float scale, int64_t window) {                                                          \
        int (*kernel)(const Q *, int64_t, const T *, const T *, Q *, const int32_t *, int64_t,       \
                      const int32_t *, const int32_t *, const int32_t *, int64_t, int64_t, int64_t,  \
                      int64_t, int64_t, float, int64_t) =                                            \
            head_dim == 64 ? NAME##_64 : head_dim == 128 ? NAME##_128 : NAME##_any;                  \
        return kernel(query, query_stride, key_cache, value_cache, out, block_tables,                \
                      block_table_stride, rows, seqs, context_lens, num_items, num_q_heads,          \
                      num_kv_heads, head_dim, block_size, scale, window);                            \
    }

DEFINE_CACHE_KERNELS(f32_cache, float, f32_to_float, load8_f32)
DEFINE_CACHE_KERNELS(bf16_cache, uint16_t, bf16_to_float, load8_bf16)
DEFINE_DISPATCH(paged_attention_f32, float, f32_to_float, float_to_f32, float, f32_cache)
DEFINE_DISPATCH(paged_attention_bf16, uint16_t, bf16_to_float, float_to_bf16, uint16_t, bf16_cache)
DEFINE_DISPATCH(paged_attention_f32_bf16_cache, float, f32_to_float, float_to_f32, uint16_t, bf16_cache)
