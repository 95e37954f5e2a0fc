/* Decode attention on the CPU that reads K/V straight through block tables.
 *
 * One query token per sequence, sequences in parallel. K and V are read once, in place, and never copied:
 * memory traffic is what bounds decode on a CPU (the torch path gathers whole blocks first and then
 * reads the copy again).
 *
 * Layouts (float32, contiguous):
 *   q            [B, H, D]                      out  [B, H, D]
 *   kv (a layer) [2, num_blocks, block_size, KVH, D]
 *   block_tables [B, W] int64, context_lens [B] int64
 *
 * window > 0: a sliding-window layer, the query (at context_len - 1) sees only the last `window` keys, and the
 * older ones are never read. softcap > 0: scores become softcap * tanh(scores / softcap) (Gemma 2). 0 turns
 * either off.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "head_dims.h"
#include "vector_exp.h"

/* Ask for `floats` of the row of token `offset` of the next block while this block's row is read: blocks lie
 * anywhere in the cache, so the hardware prefetcher, which follows addresses, cannot see the next one coming
 * (reading K/V through scattered blocks ran at about half the speed of reading them in order). */
static inline void prefetch_row(const float *next_block, int64_t offset, int64_t token_stride, int64_t floats) {
    if (next_block == NULL) return;
    const char *row = (const char *)(next_block + offset * token_stride);
    for (int64_t byte = 0; byte < floats * (int64_t)sizeof(float); byte += 64) __builtin_prefetch(row + byte);
}

/* The keys t..end-1 of `block` in one K or V cache: the first one's row, and the next block's first row to
 * prefetch (NULL after the last block). */
typedef struct {
    const float *row;
    const float *next_block;
    int64_t end;
} BlockSpan;

/* One past the last key of `block` that the context holds. */
static inline int64_t block_end(int64_t block, int64_t block_size, int64_t context_len) {
    return (block + 1) * block_size < context_len ? (block + 1) * block_size : context_len;
}

static inline BlockSpan block_span(const float *cache, const int64_t *table, int64_t block, int64_t t,
                                   int64_t context_len, int64_t block_size, int64_t token_stride) {
    const int64_t end = block_end(block, block_size, context_len);
    BlockSpan span = {cache + (table[block] * block_size + t - block * block_size) * token_stride, NULL, end};
    if (end < context_len) span.next_block = cache + table[block + 1] * block_size * token_stride;
    return span;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TILE 8 /* keys scored together: their 8 dot products are summed into one vector by one add tree */

/* q . k_i for the TILE keys i whose rows start at k, token_stride apart, over D features (D % 8 == 0), as one
 * vector of TILE scores: each key's products accumulate in its own register (no horizontal sum per key; that
 * was most of the K pass), then one hadd tree folds the eight into one. */
static inline __attribute__((always_inline)) __m256 dot_tile(const float *q, const float *k, int64_t token_stride,
                                                             const int64_t D) {
    __m256 acc[TILE];
    for (int i = 0; i < TILE; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int i = 0; i < TILE; i++) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + i * token_stride + d), acc[i]);
    }
    const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* each 128-bit half holds keys 0-3 (s0123) or 4-7 (s4567) summed over half of the features */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* out_h = sum_t p_h[t] * v_t over keys first..context_len-1 for one query head h of KV head j (D % 8 == 0,
 * D <= 128): the D features accumulate in registers across all the keys, two keys at a time (two independent
 * chains hide the FMA latency). */
static inline __attribute__((always_inline)) void weigh_values(const float *p, const float *v_cache,
                                                               const int64_t *table, int64_t first,
                                                               int64_t context_len, int64_t block_size,
                                                               int64_t token_stride, float *out, const int64_t D) {
    __m256 even[16], odd[16];
    for (int64_t d = 0; d < D / 8; d++) even[d] = odd[d] = _mm256_setzero_ps();
    for (int64_t block = first / block_size, t = first; t < context_len; block++) {
        const BlockSpan span = block_span(v_cache, table, block, t, context_len, block_size, token_stride);
        const float *v = span.row;
        for (; t + 1 < span.end; t += 2, v += 2 * token_stride) {
            prefetch_row(span.next_block, t - block * block_size, token_stride, D);  /* this head's part only */
            prefetch_row(span.next_block, t + 1 - block * block_size, token_stride, D);
            const __m256 p0 = _mm256_broadcast_ss(p + t - first), p1 = _mm256_broadcast_ss(p + t + 1 - first);
            for (int64_t d = 0; d < D / 8; d++) {
                even[d] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + 8 * d), even[d]);
                odd[d] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v + token_stride + 8 * d), odd[d]);
            }
        }
        if (t < span.end) {
            const __m256 p0 = _mm256_broadcast_ss(p + t - first);
            for (int64_t d = 0; d < D / 8; d++) even[d] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + 8 * d), even[d]);
            t++;
        }
    }
    for (int64_t d = 0; d < D / 8; d++) _mm256_storeu_ps(out + 8 * d, _mm256_add_ps(even[d], odd[d]));
}
#endif

static inline float capped(float score, float softcap) {
    return softcap > 0.0f ? softcap * tanhf(score / softcap) : score;
}

/* Scores of keys first..context_len-1 for every head, token-major: each key's row (all its KV heads) is read
 * once, and a tile of TILE keys is scored per query head at a time where D allows. */
static inline __attribute__((always_inline)) void score_keys(const float *q, const float *k_cache,
                                                             const int64_t *table, int64_t first, int64_t context_len,
                                                             int64_t block_size, int64_t num_heads,
                                                             int64_t num_kv_heads, float scale, float softcap,
                                                             float *scores, const int64_t D) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * D;
    const int64_t num_keys = context_len - first;
    for (int64_t block = first / block_size, t = first; t < context_len; block++) {
        const BlockSpan span = block_span(k_cache, table, block, t, context_len, block_size, token_stride);
        const float *k_token = span.row;
#if defined(__AVX2__) && defined(__FMA__)
        if (D % 8 == 0) {
            for (; t + TILE <= span.end; t += TILE, k_token += TILE * token_stride) {
                /* one line of each row of the next block: enough to start the hardware prefetcher on it (whole
                 * rows queued so many prefetches that the tile's own loads waited: 7-12% slower on K/V in DRAM) */
                for (int i = 0; i < TILE; i++)
                    prefetch_row(span.next_block, t + i - block * block_size, token_stride, 64 / sizeof(float));
                for (int64_t j = 0; j < num_kv_heads; j++) {
                    for (int64_t h = j * group; h < (j + 1) * group; h++) {
                        float *row = scores + h * num_keys + t - first;
                        _mm256_storeu_ps(row, _mm256_mul_ps(dot_tile(q + h * D, k_token + j * D, token_stride, D),
                                                            _mm256_set1_ps(scale)));
                        if (softcap > 0.0f)
                            for (int i = 0; i < TILE; i++) row[i] = capped(row[i], softcap);
                    }
                }
            }
        }
#endif
        for (; t < span.end; t++, k_token += token_stride) {
            prefetch_row(span.next_block, t - block * block_size, token_stride, token_stride);
            float *score_t = scores + t - first;
            for (int64_t j = 0; j < num_kv_heads; j++) {
                const float *k = k_token + j * D;
                for (int64_t h = j * group; h < (j + 1) * group; h++) {
                    const float *qh = q + h * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qh[d] * k[d];
                    score_t[h * num_keys] = capped(dot * scale, softcap);
                }
            }
        }
    }
}

/* Each head's scores in place become exp(score - the head's max), and sums[h] their sum: the division is left to
 * the head's output (D multiplies, not one per key). exp 16 keys at a time with AVX-512, else 8 (libm's expf is a
 * scalar call). */
#define EXPONENTIATE_ROW(VF, WIDTH, EXP)           \
    {                                              \
        VF partial = {0};                          \
        for (; t + WIDTH <= num_keys; t += WIDTH) { \
            VF x;                                  \
            memcpy(&x, row + t, sizeof x);         \
            x = EXP(x - max_score);                \
            memcpy(row + t, &x, sizeof x);         \
            partial += x;                          \
        }                                          \
        for (int i = 0; i < WIDTH; i++) total += partial[i]; \
    }

static void exponentiate_rows(float *scores, int64_t num_heads, int64_t num_keys, float *sums) {
    for (int64_t h = 0; h < num_heads; h++) {
        float *row = scores + h * num_keys;
        float max_score = -INFINITY;
#pragma omp simd reduction(max : max_score)
        for (int64_t t = 0; t < num_keys; t++) max_score = row[t] > max_score ? row[t] : max_score;
        float total = 0.0f;
        int64_t t = 0;
#if defined(__AVX512F__)
        EXPONENTIATE_ROW(v16f, 16, exp16)
#endif
        EXPONENTIATE_ROW(v8f, 8, exp8)
        for (; t < num_keys; t++) {
            row[t] = expf(row[t] - max_score);
            total += row[t];
        }
        sums[h] = total;
    }
}
#undef EXPONENTIATE_ROW

/* out = the probabilities times V, for every head; V's rows token-major, each read once. */
static void weigh_values_any(const float *scores, const float *v_cache, const int64_t *table, int64_t first,
                             int64_t context_len, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, float *out) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t num_keys = context_len - first;
    memset(out, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t block = first / block_size, t = first; t < context_len; block++) {
        const BlockSpan span = block_span(v_cache, table, block, t, context_len, block_size, token_stride);
        const float *v_token = span.row;
        for (; t < span.end; t++, v_token += token_stride) {
            prefetch_row(span.next_block, t - block * block_size, token_stride, token_stride);
            const float *p_t = scores + t - first;
            for (int64_t j = 0; j < num_kv_heads; j++) {
                const float *v = v_token + j * head_dim;
                for (int64_t h = j * group; h < (j + 1) * group; h++) {
                    const float p = p_t[h * num_keys];
                    float *o = out + h * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) o[d] += p * v[d];
                }
            }
        }
    }
}

/* One sequence, all heads, over keys first..context_len-1, three passes: scores (K read once), exponentials
 * (exp16 or exp8 over the keys; each head's output is divided by their sum at the end), the weighted sum of V (with AVX2 head by head, each query head of a group reading its KV
 * head's rows again from cache). Keys are walked block by block and heads by KV head
 * then query head of its group: no integer division in the loops (a 64-bit divide per token and per head was
 * about half of the kernel's time). The common head sizes get code of their own (D a constant: loops unrolled,
 * a head's output kept in registers). */
static inline __attribute__((always_inline)) void attend_sequence_d(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *table, int64_t first,
    int64_t context_len, int64_t block_size, int64_t num_heads, int64_t num_kv_heads, float scale, float softcap,
    float *scores, float *out, const int64_t D) {
    const int64_t num_keys = context_len - first;
    float *sums = scores + num_heads * num_keys; /* the caller's buffer holds num_heads more floats */
    score_keys(q, k_cache, table, first, context_len, block_size, num_heads, num_kv_heads, scale, softcap, scores, D);
    exponentiate_rows(scores, num_heads, num_keys, sums);
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0 && D <= 128) {
        const int64_t group = num_heads / num_kv_heads;
        for (int64_t h = 0; h < num_heads; h++)
            weigh_values(scores + h * num_keys, v_cache + (h / group) * D, table, first, context_len, block_size,
                         num_kv_heads * D, out + h * D, D);
    } else
#endif
        weigh_values_any(scores, v_cache, table, first, context_len, block_size, num_heads, num_kv_heads, D, out);
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = 1.0f / sums[h];
#pragma omp simd
        for (int64_t d = 0; d < D; d++) out[h * D + d] *= inv;
    }
}

static void attend_sequence(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                            int64_t first, int64_t context_len, int64_t block_size, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, float scale, float softcap, float *scores,
                            float *out) {
#define ATTEND(D) attend_sequence_d(q, k_cache, v_cache, table, first, context_len, block_size, num_heads, \
                                    num_kv_heads, scale, softcap, scores, out, D)
    FLOTILLA_FOR_HEAD_DIM(head_dim, ATTEND)
#undef ATTEND
}

/* A thread's scores buffer of at least `needed` floats: `scores` itself when it holds enough, else a new one (what
 * it held is dropped); NULL, with *capacity 0, when memory runs out. */
static float *scores_at_least(float *scores, int64_t *capacity, int64_t needed) {
    if (needed <= *capacity) return scores;
    free(scores);
    scores = malloc(sizeof(float) * needed);
    *capacity = scores == NULL ? 0 : needed;
    return scores;
}

int paged_decode_attention_f32(const float *q, const float *kv, const int64_t *block_tables,
                               const int64_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                               int64_t table_width, float scale, int64_t window, float softcap, int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads) return -1;
    const float *k_cache = kv;
    const float *v_cache = kv + num_blocks * block_size * num_kv_heads * head_dim;
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t capacity = 0;
        float *scores = NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_seqs; b++) {
            const int64_t first = window > 0 && context_lens[b] > window ? context_lens[b] - window : 0;
            /* scores, then each head's sum */
            scores = scores_at_least(scores, &capacity, num_heads * (context_lens[b] - first + 1));
            if (scores == NULL) {
                status = -2;
                continue;
            }
            const int64_t row = b * num_heads * head_dim;
            attend_sequence(q + row, k_cache, v_cache, block_tables + b * table_width, first, context_lens[b],
                            block_size, num_heads, num_kv_heads, head_dim, scale, softcap, scores, out + row);
        }
        free(scores);
    }
    return status;
}
