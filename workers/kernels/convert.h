/* Scalar conversions between fp32 and the 16-bit kinds the kernels read and write: bf16 (round
 * to nearest even, NaN kept a NaN) and fp16 (exact widening; narrowing rounds to nearest even,
 * as torch's .half()). Included by every kernel (workers/kernels/build.py hashes the headers
 * into each build's key, so a change here rebuilds them all). */
#ifndef PANTHEON_KERNELS_CONVERT_H
#define PANTHEON_KERNELS_CONVERT_H

#include <math.h>
#include <stdint.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h) { /* exact, subnormals included */
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    union { uint32_t u; float f; } v;
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
    if (em >= 0x7c00u) {
        v.u = sign | 0x7f800000u | ((uint32_t)(em & 0x3ffu) << 13);
        return v.f;
    }
    v.u = em << 13;
    v.f *= 0x1p112f; /* rebias the exponent (127 - 15): exact, subnormal halves too */
    v.u |= sign;
    return v.f;
#endif
}

static inline uint16_t f32_to_f16(float f) { /* round to nearest even, as torch's .half() */
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t sign = (v.u >> 16) & 0x8000u, a = v.u & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and up: infinity */
    if (a < 0x38800000u) /* below 2^-14: a subnormal half, in units of 2^-24 */
        return (uint16_t)(sign | (uint32_t)lrintf(fabsf(f) * 0x1p24f));
    a -= 0x38000000u; /* rebias the exponent (127 - 15) */
    return (uint16_t)(sign | ((a + 0x0fffu + ((a >> 13) & 1u)) >> 13));
}

/* Element i of an array of kind 0 (fp32) or 1 (bf16), the numbering every kernel shares for
 * activations, as fp32; and the store of v into such an array (bf16 rounded to nearest even). */
static inline float load_kind(const void *p, int kind, int64_t i) {
    return kind == 1 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_kind(void *p, int kind, int64_t i, float v) {
    if (kind == 1)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

#endif
