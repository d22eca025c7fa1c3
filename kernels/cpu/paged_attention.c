/*
 * Paged attention, one query token at a time, reading keys and values where they lie in the
 * paged cache: no gather of a sequence's context into a dense tensor first.
 *
 * Work item i is query token rows[i]: it attends over positions [0, context_lens[i]) of
 * sequence seqs[i], whose blocks are block_tables[seqs[i], :] (a decode attends over its whole
 * sequence; a prompt token over the positions up to its own: causal). Caches are
 * [num_blocks, block_size, num_kv_heads, head_dim] and outputs [tokens, num_q_heads, head_dim],
 * contiguous; queries the same with any row stride (a view of the fused QKV projection). The
 * query heads that share a KV head (grouped-query attention) are done together, so each key and
 * value row is loaded once.
 *
 * One pass over the context with an online softmax (running maximum and sum, the accumulator
 * rescaled when the maximum grows), in float32 whatever the storage dtype. The (token, KV head)
 * pairs are shared out over torch's own OpenMP threads: this library links libgomp.so.1,
 * which is the copy torch already loaded, so there is one thread pool, not two.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 256

/* HEAD_DIM is `head_dim` (any size) or a constant the compiler unrolls the inner loops for. */
#define DEFINE_PAGED_ATTENTION(NAME, T, TO_FLOAT, FROM_FLOAT, HEAD_DIM)                              \
    static int NAME(const T *query, int64_t query_stride, const T *key_cache, const T *value_cache, \
                    T *out, const int32_t *block_tables, int64_t block_table_stride,                 \
                    const int32_t *rows, const int32_t *seqs, const int32_t *context_lens,           \
                    int64_t num_items, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,  \
                    int64_t block_size, float scale) {                                               \
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
                    const T *q_row = query + row * query_stride + (first_head + g) * (HEAD_DIM);        \
                    for (int64_t d = 0; d < (HEAD_DIM); d++) {                                         \
                        q[g][d] = TO_FLOAT(q_row[d]) * scale;                                        \
                        acc[g][d] = 0.0f;                                                            \
                    }                                                                                \
                    running_max[g] = -3.0e38f;                                                       \
                    running_sum[g] = 0.0f;                                                           \
                }                                                                                    \
                const int64_t length = context_lens[item];                                           \
                const int32_t *blocks = block_tables + seqs[item] * block_table_stride;              \
                for (int64_t start = 0; start < length; start += block_size) {                       \
                    const int64_t count = length - start < block_size ? length - start : block_size; \
                    const int64_t base = (int64_t)blocks[start / block_size] * block_size;           \
                    for (int64_t j = 0; j < count; j++) {                                            \
                        const T *k_row = key_cache + (base + j) * token_stride + kv_head * (HEAD_DIM); \
                        for (int64_t g = 0; g < group; g++) {                                        \
                            float dot = 0.0f;                                                        \
                            _Pragma("omp simd reduction(+ : dot)")                                   \
                            for (int64_t d = 0; d < (HEAD_DIM); d++) dot += q[g][d] * TO_FLOAT(k_row[d]); \
                            scores[g][j] = dot;                                                      \
                        }                                                                            \
                    }                                                                                \
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
                    for (int64_t j = 0; j < count; j++) {                                            \
                        const T *v_row = value_cache + (base + j) * token_stride + kv_head * (HEAD_DIM); \
                        for (int64_t g = 0; g < group; g++) {                                        \
                            const float p = scores[g][j];                                            \
                            _Pragma("omp simd")                                                      \
                            for (int64_t d = 0; d < (HEAD_DIM); d++) acc[g][d] += p * TO_FLOAT(v_row[d]); \
                        }                                                                            \
                    }                                                                                \
                }                                                                                    \
                for (int64_t g = 0; g < group; g++) {                                                \
                    T *out_row = out + (row * num_q_heads + first_head + g) * (HEAD_DIM);              \
                    const float inverse = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;      \
                    for (int64_t d = 0; d < (HEAD_DIM); d++) out_row[d] = FROM_FLOAT(acc[g][d] * inverse); \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        return 0;                                                                                    \
    }

#define DEFINE_DISPATCH(NAME, T, TO_FLOAT, FROM_FLOAT)                                               \
    DEFINE_PAGED_ATTENTION(NAME##_any, T, TO_FLOAT, FROM_FLOAT, head_dim)                            \
    DEFINE_PAGED_ATTENTION(NAME##_64, T, TO_FLOAT, FROM_FLOAT, 64)                                   \
    DEFINE_PAGED_ATTENTION(NAME##_128, T, TO_FLOAT, FROM_FLOAT, 128)                                 \
    int NAME(const T *query, int64_t query_stride, const T *key_cache, const T *value_cache, T *out, \
             const int32_t *block_tables, int64_t block_table_stride, const int32_t *rows,           \
             const int32_t *seqs, const int32_t *context_lens, int64_t num_items,                    \
             int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,        \
             float scale) {                                                                          \
        int (*kernel)(const T *, int64_t, const T *, const T *, T *, const int32_t *, int64_t,       \
                      const int32_t *, const int32_t *, const int32_t *, int64_t, int64_t, int64_t,  \
                      int64_t, int64_t, float) =                                                     \
            head_dim == 64 ? NAME##_64 : head_dim == 128 ? NAME##_128 : NAME##_any;                  \
        return kernel(query, query_stride, key_cache, value_cache, out, block_tables,                \
                      block_table_stride, rows, seqs, context_lens, num_items, num_q_heads,          \
                      num_kv_heads, head_dim, block_size, scale);                                    \
    }

DEFINE_DISPATCH(paged_attention_f32, float, f32_to_float, float_to_f32)
DEFINE_DISPATCH(paged_attention_bf16, uint16_t, bf16_to_float, float_to_bf16)
