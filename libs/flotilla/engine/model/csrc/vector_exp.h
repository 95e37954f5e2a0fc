/* exp on 8 floats at a time, shared by the kernels under csrc/ (fused_elementwise.c: SiLU; paged_decode_attention.c:
 * softmax). Plain GCC/clang vector types: it builds wherever the kernels do, and -march picks the instructions. */
#ifndef FLOTILLA_VECTOR_EXP_H
#define FLOTILLA_VECTOR_EXP_H

#include <math.h>
#include <stdint.h>

/* exp(x) on 8 floats at a time in GCC/clang vector types (libm's expf is a scalar call here, and the vectoriser
 * does not see through the bit cast a scalar version needs): Cephes' expf, x = n ln2 + r with |r| <= ln2 / 2 in
 * two steps, a degree-5 polynomial, times 2^n from the exponent bits; within ~2 ulp of expf (torch's SLEEF exp:
 * 1 ulp). Past the float range: 0 below, infinity above, as expf. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f select8(v8i mask, v8f yes, v8f no) { return (v8f)(((v8i)yes & mask) | ((v8i)no & ~mask)); }

static inline v8f exp8(v8f x) {
    const v8f zero = {0}, low = zero - 87.0f, high = zero + 88.0f, inf = zero + INFINITY;
    const v8i below = x < low, above = x > high;
    const v8f clamped = select8(above, high, select8(below, low, x));
    const v8f t = clamped * 1.44269504088896341f + 0.5f;
    v8i i = __builtin_convertvector(t, v8i);                 /* truncation; floor for negative t below */
    i = i + (v8i)(__builtin_convertvector(i, v8f) > t);      /* true is -1 */
    const v8f n = __builtin_convertvector(i, v8f);
    v8f r = clamped - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v8f p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const v8f y = (p * r * r + r + 1.0f) * (v8f)((i + 127) << 23);
    return select8(above, inf, select8(below, zero, y));
}

#endif
