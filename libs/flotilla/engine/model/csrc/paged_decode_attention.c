/* Decode attention on the CPU that reads K/V straight through block tables.
 *
 * One query token per sequence, sequences in parallel. K and V are read once, in place, and never copied:
 * memory traffic is what bounds decode on a CPU (the torch path gathers whole blocks first and then
 * reads the copy again).
 *
 * Layouts (float32):
 *   q            [B, H, D], sequence b's heads at q + b * q_stride (a slice of the layer's fused qkv output, read
 *                in place: copying it out cost ~70 us a layer on small's 64 rows)
 *   out          [B, H, D], contiguous
 *   kv (a layer) [2, num_blocks, KVH, block_size, D]: head-major inside a block, so one KV head's keys of a block
 *                are one contiguous run of block_size * D floats, read in order (kv_cache.py: 1.4x the
 *                token-major layout with 128-token blocks)
 *   block_tables [B, W] int64, context_lens [B] int64
 *
 * window > 0: a sliding-window layer, the query (at context_len - 1) sees only the last `window` keys, and the
 * older ones are never read. softcap > 0: scores become softcap * tanh(scores / softcap) (Gemma 2). 0 turns
 * either off.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "head_dims.h"
#include "vector_exp.h"

/* The keys t..end-1 of `block` for one KV head in one K or V cache: the first one's row (rows are D floats apart),
 * and the start of the head's run in the next block (NULL after the last block). */
typedef struct {
    const float *row;
    const float *next_block;
    int64_t end;
} BlockSpan;

/* Ask for the first line of the next block's run while this one is read: blocks lie anywhere in the cache, so the
 * hardware prefetcher, which follows addresses, cannot see the next run coming; once asked, it streams the rest
 * of the run. Prefetching every line of the next run's matching rows as each tile was read instead was much
 * slower (small, 128-token blocks: 4.4-4.7 against 2.7-3.0 ms a layer, loadtest/bench_kv_layout.py). */
static inline void prefetch_next_block(const BlockSpan *span) {
    if (span->next_block != NULL) __builtin_prefetch(span->next_block);
}

/* One past the last key of `block` that the context holds. */
static inline int64_t block_end(int64_t block, int64_t block_size, int64_t context_len) {
    return (block + 1) * block_size < context_len ? (block + 1) * block_size : context_len;
}

/* head_cache: the K or V cache from KV head j's run in block 0 on (cache + j * block_size * D); block_stride: the
 * floats of one block of all heads (KVH * block_size * D). */
static inline BlockSpan block_span(const float *head_cache, const int64_t *table, int64_t block, int64_t t,
                                   int64_t context_len, int64_t block_size, int64_t block_stride, int64_t D) {
    const int64_t end = block_end(block, block_size, context_len);
    BlockSpan span = {head_cache + table[block] * block_stride + (t - block * block_size) * D, NULL, end};
    if (end < context_len) span.next_block = head_cache + table[block + 1] * block_stride;
    return span;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TILE 8 /* keys scored together: their 8 dot products are summed into one vector by one add tree */

/* q . k_i for the TILE keys i whose rows start at k, D floats apart, over D features (D % 8 == 0), as one vector
 * of TILE scores: each key's products accumulate in its own register (no horizontal sum per key; that was most of
 * the K pass), then one hadd tree folds the eight into one. */
static inline __attribute__((always_inline)) __m256 dot_tile(const float *q, const float *k, const int64_t D) {
    __m256 acc[TILE];
    for (int i = 0; i < TILE; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int i = 0; i < TILE; i++) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + i * D + d), acc[i]);
    }
    const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* each 128-bit half holds keys 0-3 (s0123) or 4-7 (s4567) summed over half of the features */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* out_h = sum_t p_h[t] * v_t over keys first..context_len-1 for one query head h whose KV head's runs start at
 * v_head (D % 8 == 0, D <= 128): the D features accumulate in registers across all the keys, two keys at a time
 * (two independent chains hide the FMA latency). */
static inline __attribute__((always_inline)) void weigh_values(const float *p, const float *v_head,
                                                               const int64_t *table, int64_t first,
                                                               int64_t context_len, int64_t block_size,
                                                               int64_t block_stride, float *out, const int64_t D) {
    __m256 even[16], odd[16];
    for (int64_t d = 0; d < D / 8; d++) even[d] = odd[d] = _mm256_setzero_ps();
    for (int64_t block = first / block_size, t = first; t < context_len; block++) {
        const BlockSpan span = block_span(v_head, table, block, t, context_len, block_size, block_stride, D);
        prefetch_next_block(&span);
        const float *v = span.row;
        for (; t + 1 < span.end; t += 2, v += 2 * D) {
            const __m256 p0 = _mm256_broadcast_ss(p + t - first), p1 = _mm256_broadcast_ss(p + t + 1 - first);
            for (int64_t d = 0; d < D / 8; d++) {
                even[d] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + 8 * d), even[d]);
                odd[d] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v + D + 8 * d), odd[d]);
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

/* With AVX-512, where a GQA group's query heads fit in registers (D % 16 == 0, group * D / 16 <= 16 vectors), K and V
 * are read one row at a time, in address order, each row loaded once for every query head of its group. The AVX2
 * tiles below hop across 8 rows and repeat their reads per query head, and with K/V in DRAM they read at ~20 GB/s
 * where a plain walk of the same runs read ~27-35. Small (12 heads, 4 KV heads, D 64): 19% less time a layer, 11%
 * less a 64-sequence decode step; tiny (D 32, where a reduction per key and head cost about what the ordered reads
 * saved): no change measurable, until the keys' scores were folded a tile at a time (score_tiles_group). */
#if defined(__AVX512F__)
#define GROUP_VECTORS 16
static inline int group_in_registers(int64_t group, int64_t D) {
    return D % 16 == 0 && group * (D / 16) <= GROUP_VECTORS;
}

/* Scores of the keys t..span_end-1 (rows from k, D floats apart) for query heads first_head.. of one group. */
static inline __attribute__((always_inline)) void score_rows_group(const float *q, const float *k, int64_t t,
                                                                   int64_t span_end, int64_t first,
                                                                   int64_t first_head, int64_t group,
                                                                   int64_t num_keys, float scale, float softcap,
                                                                   float *scores, const int64_t D) {
    __m512 qv[GROUP_VECTORS];
    for (int64_t i = 0; i < group * (D / 16); i++) qv[i] = _mm512_loadu_ps(q + first_head * D + 16 * i);
    for (; t < span_end; t++, k += D) {
        __m512 kv[GROUP_VECTORS];
        for (int64_t d = 0; d < D / 16; d++) kv[d] = _mm512_loadu_ps(k + 16 * d);
        for (int64_t g = 0; g < group; g++) {
            __m512 acc = _mm512_mul_ps(qv[g * (D / 16)], kv[0]);
            for (int64_t d = 1; d < D / 16; d++) acc = _mm512_fmadd_ps(qv[g * (D / 16) + d], kv[d], acc);
            scores[(first_head + g) * num_keys + t - first] = capped(_mm512_reduce_add_ps(acc) * scale, softcap);
        }
    }
}

/* Sixteen vectors folded into one: lane i of the result is the sum of a[i]'s lanes. 45 shuffles and adds for
 * sixteen sums, where a reduction of each vector on its own costs about eight. */
static inline __attribute__((always_inline)) __m512 sum_sixteen(const __m512 *a) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++) /* each 128-bit lane: a[2i], a[2i+1], a[2i], a[2i+1] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* each 128-bit lane: a[4i..4i+3] */
        const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* 128-bit lanes: low [a0-3, a0-3, a4-7, a4-7], high [a8-11, a8-11, a12-15, a12-15] */
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                      _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xdd));
}

/* Whether score_tiles_group's registers fit in the 32 vector registers: the group's queries, a key row and 16
 * accumulators. Groups of 1-4 only (compiled apart); no soft-cap (its tanh stays in the row-by-row code). */
static inline int tiles_fit(int64_t group, int64_t D, float softcap) {
    return softcap <= 0.0f && group <= 4 && (group + 1) * (D / 16) <= 16;
}

/* Scores of the keys t.. of a run (rows from k) for query heads first_head.. of one group, 16 / group keys at a
 * time, rows in address order: one accumulator per (head, key), all folded by one sum_sixteen (lane g * keys + i:
 * head g, key i) instead of one reduction per head and key, which left fewer rows in flight. Returns the first key
 * not scored: the last keys of the span (fewer than a tile) go row by row. Small's and tiny's heads (docs/
 * performance.md): the kernel 9-13% faster than row by row alone, K/V in DRAM. */
static inline __attribute__((always_inline)) int64_t score_tiles_group(const float *q, const float *k, int64_t t,
                                                                   int64_t span_end, int64_t first,
                                                                   int64_t first_head, const int64_t group,
                                                                   int64_t num_keys, float scale, float *scores,
                                                                   const int64_t D) {
    if ((group + 1) * (D / 16) > 16) return t; /* never taken (tiles_fit): bounds the arrays for the compiler */
    const int64_t keys = 16 / group;
    __m512 qv[GROUP_VECTORS];
    for (int64_t i = 0; i < group * (D / 16); i++) qv[i] = _mm512_loadu_ps(q + first_head * D + 16 * i);
    const __m512 scale_v = _mm512_set1_ps(scale);
    float *rows = scores + first_head * num_keys - first;
    for (; t + keys <= span_end; t += keys, k += keys * D) {
        __m512 acc[16];
        for (int64_t i = keys * group; i < 16; i++) acc[i] = _mm512_setzero_ps(); /* lanes no head uses */
        for (int64_t i = 0; i < keys; i++) {
            __m512 kv[GROUP_VECTORS];
            for (int64_t d = 0; d < D / 16; d++) kv[d] = _mm512_loadu_ps(k + i * D + 16 * d);
            for (int64_t g = 0; g < group; g++) {
                __m512 sum = _mm512_mul_ps(qv[g * (D / 16)], kv[0]);
                for (int64_t d = 1; d < D / 16; d++) sum = _mm512_fmadd_ps(qv[g * (D / 16) + d], kv[d], sum);
                acc[g * keys + i] = sum;
            }
        }
        float tile[16];
        _mm512_storeu_ps(tile, _mm512_mul_ps(sum_sixteen(acc), scale_v));
        for (int64_t g = 0; g < group; g++) memcpy(rows + g * num_keys + t, tile + g * keys, sizeof(float) * keys);
    }
    return t;
}

/* out_h = sum_t p_h[t] * v_t over keys first..context_len-1 for the `group` query heads h of the KV head whose runs
 * start at v_head (p: their probability rows, num_keys apart; out: their outputs, D apart). */
static inline __attribute__((always_inline)) void weigh_values_group(const float *p, int64_t num_keys,
                                                                     const float *v_head, const int64_t *table,
                                                                     int64_t first, int64_t context_len,
                                                                     int64_t block_size, int64_t block_stride,
                                                                     int64_t group, float *out, const int64_t D) {
    __m512 acc[GROUP_VECTORS];
    for (int64_t i = 0; i < group * (D / 16); i++) acc[i] = _mm512_setzero_ps();
    for (int64_t block = first / block_size, t = first; t < context_len; block++) {
        const BlockSpan span = block_span(v_head, table, block, t, context_len, block_size, block_stride, D);
        prefetch_next_block(&span);
        const float *v = span.row;
        for (; t < span.end; t++, v += D) {
            __m512 vv[GROUP_VECTORS];
            for (int64_t d = 0; d < D / 16; d++) vv[d] = _mm512_loadu_ps(v + 16 * d);
            for (int64_t g = 0; g < group; g++) {
                const __m512 weight = _mm512_set1_ps(p[g * num_keys + t - first]);
                for (int64_t d = 0; d < D / 16; d++)
                    acc[g * (D / 16) + d] = _mm512_fmadd_ps(weight, vv[d], acc[g * (D / 16) + d]);
            }
        }
    }
    for (int64_t i = 0; i < group * (D / 16); i++) _mm512_storeu_ps(out + 16 * i, acc[i]);
}
#endif

/* Scores of keys first..context_len-1 for every head: KV head by KV head, each of its runs read in order once, for
 * the whole group where it fits in registers (a tile of keys at a time where tiles_fit, else row by row), else a
 * tile of TILE keys scored for each query head of its group where D allows. */
static inline __attribute__((always_inline)) void score_keys(const float *q, const float *k_cache,
                                                             const int64_t *table, int64_t first, int64_t context_len,
                                                             int64_t block_size, int64_t num_heads,
                                                             int64_t num_kv_heads, float scale, float softcap,
                                                             float *scores, const int64_t D) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t block_stride = num_kv_heads * block_size * D;
    const int64_t num_keys = context_len - first;
    for (int64_t j = 0; j < num_kv_heads; j++) {
        const float *k_head = k_cache + j * block_size * D;
        for (int64_t block = first / block_size, t = first; t < context_len; block++) {
            const BlockSpan span = block_span(k_head, table, block, t, context_len, block_size, block_stride, D);
            prefetch_next_block(&span);
            const float *k = span.row;
#if defined(__AVX512F__)
            if (group_in_registers(group, D)) {
                if (tiles_fit(group, D, softcap)) {
                    const int64_t span_start = t;
                    switch (group) {
#define TILES(G) t = score_tiles_group(q, k, t, span.end, first, j * (G), G, num_keys, scale, scores, D)
                        case 1: TILES(1); break;
                        case 2: TILES(2); break;
                        case 3: TILES(3); break;
                        default: TILES(4); break;
#undef TILES
                    }
                    k += (t - span_start) * D;
                }
                score_rows_group(q, k, t, span.end, first, j * group, group, num_keys, scale, softcap, scores, D);
                t = span.end;
                continue;
            }
#endif
#if defined(__AVX2__) && defined(__FMA__)
            if (D % 8 == 0) {
                for (; t + TILE <= span.end; t += TILE, k += TILE * D) {
                    for (int64_t h = j * group; h < (j + 1) * group; h++) {
                        float *row = scores + h * num_keys + t - first;
                        _mm256_storeu_ps(row, _mm256_mul_ps(dot_tile(q + h * D, k, D), _mm256_set1_ps(scale)));
                        if (softcap > 0.0f)
                            for (int i = 0; i < TILE; i++) row[i] = capped(row[i], softcap);
                    }
                }
            }
#endif
            for (; t < span.end; t++, k += D) {
                for (int64_t h = j * group; h < (j + 1) * group; h++) {
                    const float *qh = q + h * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qh[d] * k[d];
                    scores[h * num_keys + t - first] = capped(dot * scale, softcap);
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

/* out = the probabilities times V, for every head, any D: KV head by KV head, each run read once for its group. */
static void weigh_values_any(const float *scores, const float *v_cache, const int64_t *table, int64_t first,
                             int64_t context_len, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, float *out) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t block_stride = num_kv_heads * block_size * head_dim;
    const int64_t num_keys = context_len - first;
    memset(out, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t j = 0; j < num_kv_heads; j++) {
        const float *v_head = v_cache + j * block_size * head_dim;
        for (int64_t block = first / block_size, t = first; t < context_len; block++) {
            const BlockSpan span = block_span(v_head, table, block, t, context_len, block_size, block_stride,
                                              head_dim);
            prefetch_next_block(&span);
            const float *v = span.row;
            for (; t < span.end; t++, v += head_dim) {
                for (int64_t h = j * group; h < (j + 1) * group; h++) {
                    const float p = scores[h * num_keys + t - first];
                    float *o = out + h * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) o[d] += p * v[d];
                }
            }
        }
    }
}

/* One sequence, all heads, over keys first..context_len-1, three passes: scores (K read once), exponentials
 * (exp16 or exp8 over the keys; each head's output is divided by their sum at the end), the weighted sum of V (a
 * group's heads together with AVX-512 where they fit in registers; else with AVX2 head by head, each query head of a
 * group reading its KV head's runs again from cache). Keys are walked
 * block by block: no integer division in the loops (a 64-bit divide per token and per head was about half of the
 * kernel's time). The common head sizes get code of their own (D a constant: loops unrolled, a head's output kept
 * in registers). */
static inline __attribute__((always_inline)) void attend_sequence_d(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *table, int64_t first,
    int64_t context_len, int64_t block_size, int64_t num_heads, int64_t num_kv_heads, float scale, float softcap,
    float *scores, float *out, const int64_t D) {
    const int64_t num_keys = context_len - first;
    float *sums = scores + num_heads * num_keys; /* the caller's buffer holds num_heads more floats */
    score_keys(q, k_cache, table, first, context_len, block_size, num_heads, num_kv_heads, scale, softcap, scores, D);
    exponentiate_rows(scores, num_heads, num_keys, sums);
    const int64_t group = num_heads / num_kv_heads;
#if defined(__AVX512F__)
    if (group_in_registers(group, D)) {
        for (int64_t j = 0; j < num_kv_heads; j++)
            weigh_values_group(scores + j * group * num_keys, num_keys, v_cache + j * block_size * D, table, first,
                               context_len, block_size, num_kv_heads * block_size * D, group, out + j * group * D, D);
    } else
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0 && D <= 128) {
        for (int64_t h = 0; h < num_heads; h++)
            weigh_values(scores + h * num_keys, v_cache + (h / group) * block_size * D, table, first, context_len,
                         block_size, num_kv_heads * block_size * D, out + h * D, D);
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

/* The thread pool of the engine's CPU matmul (csrc/spin_pool.h, compiled into panel_gemm.c), set by
 * decode_kernel.py where that library loads: its workers are still spinning from the step's qkv matmul when the
 * layer's attention starts, where an OpenMP region would wake a sleeping thread (~45 us under
 * OMP_WAIT_POLICY=PASSIVE) while the pool's worker spins beside it. NULL: OpenMP. */
typedef void (*pool_item_fn)(void *context, int64_t item);
typedef void (*pool_run_fn)(int num_threads, int64_t spin_ns, pool_item_fn fn, void *context, int64_t items);
static pool_run_fn pool_run;
static int64_t pool_spin_ns;

void paged_decode_attention_use_pool(void *run, int64_t spin_ns) {
    pool_run = (pool_run_fn)run;
    pool_spin_ns = spin_ns;
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *block_tables, *context_lens;
    float *out;
    int64_t q_stride, num_heads, num_kv_heads, head_dim, block_size, table_width, window;
    float scale, softcap;
    _Atomic int status;
} DecodeTask;

/* One sequence, on whichever pool thread takes it; each thread keeps its scores buffer for the next call. */
static void attend_pool_item(void *context, int64_t b) {
    DecodeTask *t = context;
    static __thread float *scores;
    static __thread int64_t capacity;
    const int64_t first = t->window > 0 && t->context_lens[b] > t->window ? t->context_lens[b] - t->window : 0;
    scores = scores_at_least(scores, &capacity, t->num_heads * (t->context_lens[b] - first + 1));
    if (scores == NULL) {
        t->status = -2;
        return;
    }
    attend_sequence(t->q + b * t->q_stride, t->k_cache, t->v_cache, t->block_tables + b * t->table_width, first,
                    t->context_lens[b], t->block_size, t->num_heads, t->num_kv_heads, t->head_dim, t->scale,
                    t->softcap, scores, t->out + b * t->num_heads * t->head_dim);
}

int paged_decode_attention_f32(const float *q, int64_t q_stride, const float *kv, const int64_t *block_tables,
                               const int64_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                               int64_t table_width, float scale, int64_t window, float softcap, int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads) return -1;
    const float *k_cache = kv;
    const float *v_cache = kv + num_blocks * block_size * num_kv_heads * head_dim;
    if (pool_run != NULL) {
        DecodeTask task = {q, k_cache, v_cache, block_tables, context_lens, out, q_stride, num_heads, num_kv_heads,
                           head_dim, block_size, table_width, window, scale, softcap, 0};
        pool_run(num_threads, pool_spin_ns, attend_pool_item, &task, num_seqs);
        return task.status;
    }
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
            attend_sequence(q + b * q_stride, k_cache, v_cache, block_tables + b * table_width, first,
                            context_lens[b], block_size, num_heads, num_kv_heads, head_dim, scale, softcap, scores,
                            out + b * num_heads * head_dim);
        }
        free(scores);
    }
    return status;
}
