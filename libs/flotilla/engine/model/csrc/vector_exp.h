/* exp on 8 or 16 floats at a time, shared by the kernels under csrc/ (fused_elementwise.c: SiLU; paged_*_attention.c:
 * softmax). Plain GCC/clang vector types: it builds wherever the kernels do, and -march picks the instructions. */
#ifndef FLOTILLA_VECTOR_EXP_H
#define FLOTILLA_VECTOR_EXP_H

#include <math.h>
#include <stdint.h>

/* exp(x) on 8 (exp8) or 16 (exp16) floats at a time in GCC/clang vector types (libm's expf is a scalar call here,
 * and the vectoriser does not see through the bit cast a scalar version needs): Cephes' expf, x = n ln2 + r with
 * |r| <= ln2 / 2 in two steps, a degree-5 polynomial, times 2^n from the exponent bits; within ~2 ulp of expf
 * (torch's SLEEF exp: 1 ulp). Past the float range: 0 below, infinity above, as expf. One body for both widths. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#define FLOTILLA_DEFINE_EXP(NAME, SELECT, VF, VI)                                                               \
    static inline VF SELECT(VI mask, VF yes, VF no) { return (VF)(((VI)yes & mask) | ((VI)no & ~mask)); }    \
    static inline VF NAME(VF x) {                                                                            \
        const VF zero = {0}, low = zero - 87.0f, high = zero + 88.0f, inf = zero + INFINITY;                 \
        const VI below = x < low, above = x > high;                                                          \
        const VF clamped = SELECT(above, high, SELECT(below, low, x));                                       \
        const VF t = clamped * 1.44269504088896341f + 0.5f;                                                  \
        VI i = __builtin_convertvector(t, VI);             /* truncation; floor for negative t below */      \
        i = i + (VI)(__builtin_convertvector(i, VF) > t);  /* true is -1 */                                  \
        const VF n = __builtin_convertvector(i, VF);                                                         \
        VF r = clamped - n * 0.693359375f;                                                                   \
        r = r - n * -2.12194440e-4f;                                                                         \
        VF p = zero + 1.9875691500e-4f;                                                                      \
        p = p * r + 1.3981999507e-3f;                                                                        \
        p = p * r + 8.3334519073e-3f;                                                                        \
        p = p * r + 4.1665795894e-2f;                                                                        \
        p = p * r + 1.6666665459e-1f;                                                                        \
        p = p * r + 5.0000001201e-1f;                                                                        \
        const VF y = (p * r * r + r + 1.0f) * (VF)((i + 127) << 23);                                         \
        return SELECT(above, inf, SELECT(below, zero, y));                                                   \
    }

FLOTILLA_DEFINE_EXP(exp8, select8, v8f, v8i)
FLOTILLA_DEFINE_EXP(exp16, select16, v16f, v16i)

#endif
