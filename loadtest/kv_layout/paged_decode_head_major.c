/* A candidate K/V layout for the CPU decode kernel, for loadtest/bench_kv_layout.py only (the engine does not use
 * it): a layer as [2, num_blocks, KVH, block_size, D], each KV head's rows of a block contiguous (vLLM's CPU
 * attention reads such blocks, 128 tokens by default), against the engine's [2, num_blocks, block_size, KVH, D].
 *
 * The engine's kernel is included whole so that this one reuses its dot products and exponentials, and so that
 * the benchmark builds both from one file. Same arithmetic per key, so outputs agree with the engine's to
 * float32 rounding. Covers what the benchmark needs: D of 32 or 64, no window, no soft-cap, AVX2.
 */
#include "paged_decode_attention.c"

#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void attend_head_major_d(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *table, int64_t context_len,
    int64_t block_size, int64_t num_heads, int64_t num_kv_heads, float scale, float *scores, float *out,
    const int64_t D) {
    const int64_t group = num_heads / num_kv_heads, num_keys = context_len;
    const int64_t head_rows = block_size * D, block_stride = num_kv_heads * head_rows;
    const int64_t num_blocks = (context_len + block_size - 1) / block_size;
    /* K: one KV head at a time, its rows of each block read in order (one contiguous run per block) */
    for (int64_t j = 0; j < num_kv_heads; j++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            const float *k = k_cache + table[b] * block_stride + j * head_rows;
            if (b + 1 < num_blocks) __builtin_prefetch(k_cache + table[b + 1] * block_stride + j * head_rows);
            const int64_t first = b * block_size, end = block_end(b, block_size, context_len);
            int64_t t = first;
            for (; t + TILE <= end; t += TILE)
                for (int64_t h = j * group; h < (j + 1) * group; h++)
                    _mm256_storeu_ps(scores + h * num_keys + t, _mm256_mul_ps(dot_tile(q + h * D, k + (t - first) * D,
                                                                                       D, D), _mm256_set1_ps(scale)));
            for (; t < end; t++)
                for (int64_t h = j * group; h < (j + 1) * group; h++) {
                    float dot = 0.0f;
                    for (int64_t d = 0; d < D; d++) dot += q[h * D + d] * k[(t - first) * D + d];
                    scores[h * num_keys + t] = dot * scale;
                }
        }
    }
    float *sums = scores + num_heads * num_keys;
    exponentiate_rows(scores, num_heads, num_keys, sums);
    /* V: one query head at a time over its KV head's contiguous runs, the output in registers */
    for (int64_t h = 0; h < num_heads; h++) {
        const int64_t j = h / group;
        const float *p = scores + h * num_keys;
        __m256 even[8], odd[8];
        for (int64_t d = 0; d < D / 8; d++) even[d] = odd[d] = _mm256_setzero_ps();
        for (int64_t b = 0; b < num_blocks; b++) {
            const float *v = v_cache + table[b] * block_stride + j * head_rows;
            if (b + 1 < num_blocks) __builtin_prefetch(v_cache + table[b + 1] * block_stride + j * head_rows);
            const int64_t first = b * block_size, end = block_end(b, block_size, context_len);
            int64_t t = first;
            for (; t + 1 < end; t += 2) {
                const __m256 p0 = _mm256_broadcast_ss(p + t), p1 = _mm256_broadcast_ss(p + t + 1);
                for (int64_t d = 0; d < D / 8; d++) {
                    even[d] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + (t - first) * D + 8 * d), even[d]);
                    odd[d] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v + (t + 1 - first) * D + 8 * d), odd[d]);
                }
            }
            if (t < end) {
                const __m256 p0 = _mm256_broadcast_ss(p + t);
                for (int64_t d = 0; d < D / 8; d++)
                    even[d] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + (t - first) * D + 8 * d), even[d]);
            }
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sums[h]);
        for (int64_t d = 0; d < D / 8; d++)
            _mm256_storeu_ps(out + h * D + 8 * d, _mm256_mul_ps(_mm256_add_ps(even[d], odd[d]), inv));
    }
}
#endif

/* The engine kernel's arguments, the cache in the candidate layout. -1: a case this candidate does not cover. */
int paged_decode_attention_head_major_f32(const float *q, const float *kv, const int64_t *block_tables,
                                          const int64_t *context_lens, float *out, int64_t num_seqs,
                                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                          int64_t num_blocks, int64_t block_size, int64_t table_width, float scale,
                                          int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if ((head_dim != 32 && head_dim != 64) || num_kv_heads < 1 || num_heads % num_kv_heads) return -1;
    const float *v_cache = kv + num_blocks * block_size * num_kv_heads * head_dim;
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t capacity = 0;
        float *scores = NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_seqs; b++) {
            scores = scores_at_least(scores, &capacity, num_heads * (context_lens[b] + 1));
            if (scores == NULL) {
                status = -2;
                continue;
            }
            const int64_t row = b * num_heads * head_dim;
#define ATTEND(D) attend_head_major_d(q + row, kv, v_cache, block_tables + b * table_width, context_lens[b], \
                                      block_size, num_heads, num_kv_heads, scale, scores, out + row, D)
            if (head_dim == 32) ATTEND(32);
            else ATTEND(64);
#undef ATTEND
        }
        free(scores);
    }
    return status;
#else
    return -1;
#endif
}
