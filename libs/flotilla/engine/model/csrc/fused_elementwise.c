/* The element-wise work of a Llama layer on the CPU in one pass each, float32, rows in parallel.
 *
 * In torch each of these is 2-10 ops, each a pass over memory and an OpenMP region of its own (a region is
 * what costs most on a machine whose cores are shared). The arithmetic is transformers' step for step, built
 * without FMA contraction: RoPE is bit-equal to the torch path, RMSNorm differs only in the order of its sum
 * of squares, SiLU in its exp (exp_vectorisable).
 *
 *   add_rms_norm_f32   x [rows, n] (+= delta when delta != NULL, in place), out = weight * (x * rsqrt(mean(x^2) + eps))
 *   silu_mul_f32       gate_up [rows, 2 * n] -> out [rows, n] = silu(gate) * up
 *   rope_neox_f32      q/k heads in place inside qkv [rows, row_stride]: x * cos + rotate_half(x) * sin on the
 *                      first rotary_dim features of each head; cos_sin [2, rows, rotary_dim]
 *   write_rows_f32     new K (or V) [tokens, KVH, D], tokens src_stride floats apart, into rows of a layer's K
 *                      (or V) viewed as [num_rows, D]
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_exp.h"

/* Below this many elements a pass runs on one thread: it takes microseconds, while waking a parked OpenMP thread
 * (and, on shared cores, waiting for it to be scheduled) can take milliseconds. */
#define PARALLEL_MIN_ELEMENTS (1 << 20)

void add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out, int64_t rows, int64_t n,
                      float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n > PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n;
        if (delta != 0) {
            const float *dr = delta + r * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) xr[i] = xr[i] + dr[i];
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; i++) squares += xr[i] * xr[i];
        const float scale = 1.0f / sqrtf(squares / (float)n + eps);
        float *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = weight[i] * (xr[i] * scale);
    }
}

static inline v8f silu_mul8(v8f gate, v8f up) { return gate / (1.0f + exp8(-gate)) * up; }
static inline v16f silu_mul16(v16f gate, v16f up) { return gate / (1.0f + exp16(-gate)) * up; }

/* Whole vectors of WIDTH floats from i on (VF and SILU_MUL of that width), unaligned loads and stores. */
#define SILU_MUL_VECTORS(VF, WIDTH, SILU_MUL)          \
    for (; i + WIDTH <= n; i += WIDTH) {                \
        VF g, u, result;                                \
        memcpy(&g, gate + i, sizeof g);                 \
        memcpy(&u, up + i, sizeof u);                   \
        result = SILU_MUL(g, u);                        \
        memcpy(o + i, &result, sizeof result);          \
    }

/* Sixteen at a time where the CPU has AVX-512 (one zmm per step: 1.16 -> 0.67 ms for tiny's 2,048 x 704 on one
 * thread of an AMD EPYC), then eight; the same arithmetic either way. */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n > PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * n;
        const float *up = gate + n;
        float *o = out + r * n;
        int64_t i = 0;
#if defined(__AVX512F__)
        SILU_MUL_VECTORS(v16f, 16, silu_mul16)
#endif
        SILU_MUL_VECTORS(v8f, 8, silu_mul8)
        if (i < n) {  /* the tail through the same arithmetic, padded with zeros */
            v8f g = {0}, u = {0}, result;
            memcpy(&g, gate + i, sizeof(float) * (n - i));
            memcpy(&u, up + i, sizeof(float) * (n - i));
            result = silu_mul8(g, u);
            memcpy(o + i, &result, sizeof(float) * (n - i));
        }
    }
}
#undef SILU_MUL_VECTORS

static void rotate_heads(float *x, const float *cos, const float *sin, int64_t num_heads, int64_t head_dim,
                         int64_t half) {
    for (int64_t h = 0; h < num_heads; h++) {
        float *a = x + h * head_dim;
        float *b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * cos[i] + (-x2) * sin[i];
            b[i] = x2 * cos[half + i] + x1 * sin[half + i];
        }
    }
}

void rope_neox_f32(float *qkv, const float *cos_sin, int64_t rows, int64_t row_stride, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, int num_threads) {
    const int64_t half = rotary_dim / 2;
    const float *cos_table = cos_sin, *sin_table = cos_sin + rows * rotary_dim;
    const int64_t elements = rows * (num_heads + num_kv_heads) * head_dim;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (elements > PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float *q = qkv + r * row_stride;
        const float *cos = cos_table + r * rotary_dim, *sin = sin_table + r * rotary_dim;
        rotate_heads(q, cos, sin, num_heads, head_dim, half);
        rotate_heads(q + num_heads * head_dim, cos, sin, num_kv_heads, head_dim, half);
    }
}

/* A step's new K (or V) into the KV cache: token i's KV head h (head_dim floats at src + i * src_stride + h *
 * head_dim, a slice of the fused qkv output) goes to row rows[i * num_kv_heads + h] of the cache viewed as
 * [num_rows, head_dim] (kv_cache.cache_rows). torch's index_copy_ needed the slice copied out first: ~120 us a
 * layer for a 64-token decode step against ~60 for this loop. Returns -1, having written nothing, when a row is
 * out of range. */
int write_rows_f32(const float *src, int64_t src_stride, const int64_t *rows, float *cache, int64_t num_rows,
                   int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int num_threads) {
    const int64_t num_writes = num_tokens * num_kv_heads;
    for (int64_t j = 0; j < num_writes; j++)
        if (rows[j] < 0 || rows[j] >= num_rows) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_writes * head_dim > PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < num_tokens; i++)
        for (int64_t h = 0; h < num_kv_heads; h++)
            memcpy(cache + rows[i * num_kv_heads + h] * head_dim, src + i * src_stride + h * head_dim,
                   sizeof(float) * head_dim);
    return 0;
}
