/* bfloat16 <-> float32 for the CPU kernels: bfloat16 is the top half of a float32. */
#ifndef BERTH_BF16_H
#define BERTH_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

/* The float32 "conversions", so that one kernel body serves both dtypes. */
static inline float f32_to_float(float value) { return value; }
static inline float float_to_f32(float value) { return value; }

#endif
