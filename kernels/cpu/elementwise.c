/*
 * The element-wise steps of a decoder layer, one pass over memory each: RMSNorm with the
 * residual add fused in, RoPE on queries and keys in place, SiLU(gate) * up, and the copy of
 * the new keys and values into their cache slots.
 *
 * In torch each of these is 5-25 small operators (casts to float32 and back, slices, a cat),
 * and at decode batch sizes a step spends more time dispatching them than computing. The math
 * matches the torch reference: float32 arithmetic whatever the storage dtype, rounded once on
 * the way out (RMSNorm rounds the normalised value to the storage dtype before the weight
 * multiply, as the reference and Hugging Face do).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Below this many elements a step runs on the calling thread: waking the other threads costs
   more than the work, and on a busy machine a parallel region can wait a scheduler tick for a
   thread that is not running. */
#define PARALLEL_MIN_ELEMENTS (1 << 16)

/* out = norm(x (+ residual)) * weight; with a residual, summed = x + residual (rounded). */
#define DEFINE_RMS_NORM(NAME, T, TO_FLOAT, FROM_FLOAT)                                               \
    void NAME(const T *x, const T *residual, T *summed, const T *weight, T *out, int64_t rows,      \
              int64_t hidden, float eps) {                                                           \
        _Pragma("omp parallel for schedule(static) if (rows * hidden >= PARALLEL_MIN_ELEMENTS)")     \
        for (int64_t row = 0; row < rows; row++) {                                                   \
            const T *x_row = x + row * hidden;                                                       \
            T *out_row = out + row * hidden;                                                         \
            const T *res_row = residual ? residual + row * hidden : 0;                               \
            T *sum_row = residual ? summed + row * hidden : 0;                                       \
            float sum = 0.0f;                                                                        \
            for (int64_t i = 0; i < hidden; i++) {                                                   \
                float value = TO_FLOAT(x_row[i]);                                                    \
                if (res_row) {                                                                       \
                    const T rounded = FROM_FLOAT(value + TO_FLOAT(res_row[i]));                      \
                    sum_row[i] = rounded;                                                            \
                    value = TO_FLOAT(rounded);                                                       \
                }                                                                                    \
                sum += value * value;                                                                \
            }                                                                                        \
            const float inverse = 1.0f / sqrtf(sum / (float)hidden + eps);                           \
            const T *source = res_row ? sum_row : x_row;                                             \
            for (int64_t i = 0; i < hidden; i++) {                                                   \
                float normed = TO_FLOAT(FROM_FLOAT(TO_FLOAT(source[i]) * inverse));                  \
                out_row[i] = FROM_FLOAT(normed * TO_FLOAT(weight[i]));                               \
            }                                                                                        \
        }                                                                                            \
    }

/* Rotates heads [T, H, D] (row stride `stride` elements, head stride D) in place, rotate-half
   (neox) layout over the first `rotary_dim` dims; cos_sin is [max_position, rotary_dim] float32. */
#define DEFINE_ROTARY(NAME, T, TO_FLOAT, FROM_FLOAT)                                                 \
    void NAME(const int64_t *positions, T *query, int64_t query_stride, int64_t num_q_heads, T *key, \
              int64_t key_stride, int64_t num_k_heads, int64_t head_dim, const float *cos_sin,       \
              int64_t rotary_dim, int64_t tokens) {                                                  \
        const int64_t half = rotary_dim / 2;                                                         \
        _Pragma("omp parallel for schedule(static) if (tokens * (num_q_heads + num_k_heads) * head_dim >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t t = 0; t < tokens; t++) {                                                       \
            const float *cos = cos_sin + positions[t] * rotary_dim;                                  \
            const float *sin = cos + half;                                                           \
            for (int64_t h = 0; h < num_q_heads + num_k_heads; h++) {                                \
                T *head = h < num_q_heads ? query + t * query_stride + h * head_dim                  \
                                          : key + t * key_stride + (h - num_q_heads) * head_dim;     \
                for (int64_t i = 0; i < half; i++) {                                                 \
                    const float first = TO_FLOAT(head[i]), second = TO_FLOAT(head[i + half]);        \
                    head[i] = FROM_FLOAT(first * cos[i] - second * sin[i]);                          \
                    head[i + half] = FROM_FLOAT(second * cos[i] + first * sin[i]);                   \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }

/* [T, 2I] (gate | up) -> [T, I] */
#define DEFINE_SILU_AND_MUL(NAME, T, TO_FLOAT, FROM_FLOAT)                                           \
    void NAME(const T *x, T *out, int64_t rows, int64_t width) {                                     \
        _Pragma("omp parallel for schedule(static) if (rows * width >= PARALLEL_MIN_ELEMENTS)")      \
        for (int64_t row = 0; row < rows; row++) {                                                   \
            const T *gate = x + row * 2 * width, *up = gate + width;                                 \
            T *out_row = out + row * width;                                                          \
            _Pragma("omp simd")                                                                      \
            for (int64_t i = 0; i < width; i++) {                                                    \
                const float g = TO_FLOAT(gate[i]);                                                   \
                /* rounded to the storage dtype between the two, as torch's silu then mul */        \
                const float activated = TO_FLOAT(FROM_FLOAT(g / (1.0f + expf(-g))));                 \
                out_row[i] = FROM_FLOAT(activated * TO_FLOAT(up[i]));                                \
            }                                                                                        \
        }                                                                                            \
    }

DEFINE_RMS_NORM(rms_norm_f32, float, f32_to_float, float_to_f32)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_ROTARY(rotary_f32, float, f32_to_float, float_to_f32)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, f32_to_float, float_to_f32)
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, bf16_to_float, float_to_bf16)

/* Copies each token's keys and values (row_bytes each, rows `*_stride` bytes apart: views of the
   fused QKV output) to cache slot slots[t] of caches laid out [slot][row_bytes]. A negative slot
   is a padding token (a captured decode graph's spare rows): nothing is written for it. */
void write_kv_cache(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                    char *key_cache, char *value_cache, const int64_t *slots, int64_t tokens,
                    int64_t row_bytes) {
    _Pragma("omp parallel for schedule(static) if (tokens * row_bytes >= 4 * PARALLEL_MIN_ELEMENTS)")
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(key_cache + slots[t] * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(value_cache + slots[t] * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
}
