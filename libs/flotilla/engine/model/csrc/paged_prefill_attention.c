/* Prefill attention on the CPU for one sequence's chunk of queries, reading K/V in place through its block table.
 *
 * The chunk's queries are at positions start..start+num_queries-1; query p sees keys 0..p (causal), so a chunk
 * after a prefix hit or an earlier chunk reads the earlier keys from the cache without gathering them (the torch
 * path copies every block of the context into one tensor first, then runs SDPA over the copy).
 *
 * Flash-attention order: one work item is a tile of queries of one KV head (QUERY_TILE queries x the G query
 * heads that share it); it walks the keys KEY_TILE at a time (16 with AVX-512, else 8) with a running max and sum
 * per row, so no score matrix is ever stored. A tile of keys' K rows is transposed into a [D][KEY_TILE] block
 * once and scored against every row of the tile, four rows at a time (one load of the block per four FMAs); the
 * V pass reads V rows in place, each chunk of a row loaded once for four rows. Masks are applied only on tiles
 * that need them (the diagonal, the window's edge, the last keys). Against torch's CPU flash SDPA on one thread
 * (CPU time, AMD EPYC): 512 queries of 8 heads over 4 KV heads of 32, 2.26 against 3.41 ms; 12 over 4 of 64,
 * 5.0 against 9.2 ms; 2,048 of 9 over 3 of 64, 53 against 65 ms (SDPA without the block gather it also needs).
 *
 * Layouts (float32):
 *   q   [num_queries, H, D], rows q_stride floats apart (q is a slice of the layer's fused qkv output)
 *   out [num_queries, H, D], contiguous
 *   kv (a layer) [2, num_blocks, block_size, KVH, D]; table [W] int64
 * window > 0: query p sees keys p-window+1..p only; softcap > 0: scores -> softcap * tanh(scores / softcap).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "head_dims.h"
#include "vector_exp.h"

/* Keys per step: one vector of scores per row, 16 wide where the CPU has AVX-512, else 8. */
#if defined(__AVX512F__)
#define KEY_TILE 16
typedef v16f vkeys;
#define exp_keys exp16
#else
#define KEY_TILE 8
typedef v8f vkeys;
#define exp_keys exp8
#endif
#define QUERY_TILE 64 /* queries per work item: its rows reuse each transposed key block (16 or 32: 2-10% slower) */
#define ROW_BLOCK 4   /* rows scored together against one key block */

/* Horizontal max and sum by halving (a tree of vector ops, not one scalar step per lane). */
static inline v8f max8(v8f a, v8f b) { return (v8f)select8(a > b, a, b); }

static inline v8f fold_keys(vkeys x, int is_max) {
#if KEY_TILE == 16
    const v8f low = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8f high = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    return is_max ? max8(low, high) : low + high;
#else
    (void)is_max;
    return x;
#endif
}

static inline float hmax_keys(vkeys x) {
    v8f m = fold_keys(x, 1);
    m = max8(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3));
    m = max8(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5));
    m = max8(m, __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6));
    return m[0];
}

static inline float hsum_keys(vkeys x) {
    v8f m = fold_keys(x, 0);
    m += __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3);
    m += __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5);
    m += __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6);
    return m[0];
}

/* Per-thread scratch: the tile's queries (pre-scaled, contiguous), outputs, running max and sum, the transposed
 * key block. */
typedef struct {
    float *queries, *outputs, *row_max, *row_sum, *keys_t;
    int64_t *positions;
} Scratch;

static int scratch_alloc(Scratch *s, int64_t rows, int64_t D) {
    s->queries = aligned_alloc(64, sizeof(float) * ((rows * D + 15) & ~15));
    s->outputs = aligned_alloc(64, sizeof(float) * ((rows * D + 15) & ~15));
    s->keys_t = aligned_alloc(64, sizeof(float) * ((D * KEY_TILE + 15) & ~15));
    s->row_max = malloc(sizeof(float) * rows);
    s->row_sum = malloc(sizeof(float) * rows);
    s->positions = malloc(sizeof(int64_t) * rows);
    return s->queries && s->outputs && s->keys_t && s->row_max && s->row_sum && s->positions ? 0 : -2;
}

static void scratch_free(Scratch *s) {
    free(s->queries);
    free(s->outputs);
    free(s->keys_t);
    free(s->row_max);
    free(s->row_sum);
    free(s->positions);
}

/* Scores of ROW_BLOCK rows (or fewer: `rows`) against the transposed key block: out[r][i] = q_r . k_i. A full
 * block of rows gets code without the row checks (its accumulators then stay in registers). */
static inline __attribute__((always_inline)) void score_rows_n(const float *queries, const float *keys_t,
                                                               const int rows, vkeys *out, const int64_t D) {
    vkeys acc[ROW_BLOCK] = {{0}};
    for (int64_t d = 0; d < D; d++) {
        vkeys k;
        memcpy(&k, keys_t + d * KEY_TILE, sizeof k);
        for (int r = 0; r < rows; r++) acc[r] += queries[r * D + d] * k;
    }
    for (int r = 0; r < rows; r++) out[r] = acc[r];
}

static inline __attribute__((always_inline)) void score_rows(const float *queries, const float *keys_t, int rows,
                                                             vkeys *out, const int64_t D) {
    switch (rows) {
        case ROW_BLOCK: score_rows_n(queries, keys_t, ROW_BLOCK, out, D); break;
        case 3: score_rows_n(queries, keys_t, 3, out, D); break;
        case 2: score_rows_n(queries, keys_t, 2, out, D); break;
        default: score_rows_n(queries, keys_t, 1, out, D);
    }
}

/* For ROW_BLOCK rows (or fewer: `rows`) at once, out_r = out_r * correction_r + sum_i p_r[i] * v_i over the
 * `count` keys whose V rows are v_rows[i]: each V row's chunk is loaded once for all the rows. (Unlike score_rows,
 * code per row count measured 15-30% slower here; why was not looked into.) */
static inline __attribute__((always_inline)) void weigh_values(float *outputs, const float *correction,
                                                               const float (*p)[KEY_TILE], int rows,
                                                               const float *const *v_rows, int count,
                                                               const int64_t D) {
/* One body for both chunk widths (VT: v16f or v8f, WIDTH its floats). */
#define WEIGH_VALUES_IN_CHUNKS(VT, WIDTH)                                              \
    for (int64_t d = 0; d < D; d += WIDTH) {                                           \
        VT acc[ROW_BLOCK];                                                             \
        for (int r = 0; r < rows; r++) {                                               \
            memcpy(&acc[r], outputs + r * D + d, sizeof acc[r]);                       \
            acc[r] *= correction[r];                                                   \
        }                                                                              \
        for (int i = 0; i < count; i++) {                                              \
            VT v;                                                                      \
            memcpy(&v, v_rows[i] + d, sizeof v);                                       \
            for (int r = 0; r < ROW_BLOCK; r++)                                        \
                if (r < rows) acc[r] += p[r][i] * v;                                   \
        }                                                                              \
        for (int r = 0; r < rows; r++) memcpy(outputs + r * D + d, &acc[r], sizeof acc[r]); \
    }
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        WEIGH_VALUES_IN_CHUNKS(v16f, 16)
        return;
    }
#endif
    WEIGH_VALUES_IN_CHUNKS(v8f, 8)
#undef WEIGH_VALUES_IN_CHUNKS
}

static inline __attribute__((always_inline)) void attend_tile_d(
    const float *q, int64_t q_stride, const float *k_cache, const float *v_cache, const int64_t *table,
    int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t kv_head, int64_t start, int64_t first_query,
    int64_t last_query, float scale, int64_t window, float softcap, float *out, Scratch *s, const int64_t D) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * D;
    const int64_t rows = (last_query - first_query) * group;
    /* Row r: query first_query + r / group, head kv_head * group + r % group; queries scaled once. */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t query = first_query + r / group, head = kv_head * group + r % group;
        const float *src = q + query * q_stride + head * D;
        for (int64_t d = 0; d < D; d++) s->queries[r * D + d] = src[d] * scale;
        s->positions[r] = start + query;
        s->row_max[r] = -INFINITY;
        s->row_sum[r] = 0.0f;
    }
    memset(s->outputs, 0, sizeof(float) * rows * D);
    const int64_t last_position = start + last_query - 1;
    const int64_t first_key = window > 0 && start + first_query - window + 1 > 0 ? start + first_query - window + 1 : 0;
    const float *v_rows[KEY_TILE];
    for (int64_t t = first_key; t <= last_position; t += KEY_TILE) {
        const int count = last_position + 1 - t < KEY_TILE ? (int)(last_position + 1 - t) : KEY_TILE;
        for (int i = 0; i < KEY_TILE; i++) {
            if (i >= count) {
                for (int64_t d = 0; d < D; d++) s->keys_t[d * KEY_TILE + i] = 0.0f;
                continue;
            }
            const int64_t key = t + i;
            const int64_t slot = table[key / block_size] * block_size + key % block_size;
            const float *k = k_cache + slot * token_stride + kv_head * D;
            for (int64_t d = 0; d < D; d++) s->keys_t[d * KEY_TILE + i] = k[d];
            v_rows[i] = v_cache + slot * token_stride + kv_head * D;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
            const int block_rows = rows - r0 < ROW_BLOCK ? (int)(rows - r0) : ROW_BLOCK;
            vkeys scores[ROW_BLOCK];
            score_rows(s->queries + r0 * D, s->keys_t, block_rows, scores, D);
            /* The weights go through memory: the V pass broadcasts each from there (no lane shuffles). */
            float p[ROW_BLOCK][KEY_TILE] __attribute__((aligned(64)));
            float correction[ROW_BLOCK];
            for (int b = 0; b < block_rows; b++) {
                const int64_t r = r0 + b, position = s->positions[r];
                if (t > position || (window > 0 && t + count - 1 <= position - window)) {  /* all masked */
                    memset(p[b], 0, sizeof p[b]);
                    correction[b] = 1.0f;
                    continue;
                }
                vkeys x = scores[b];
                /* Only tiles on the diagonal, at the window's edge or at the end need masks. */
                const int inside = count == KEY_TILE && t + KEY_TILE - 1 <= position &&
                                   (window <= 0 || t > position - window);
                if (!inside || softcap > 0.0f) {
                    for (int i = 0; i < KEY_TILE; i++) {
                        if (softcap > 0.0f) x[i] = softcap * tanhf(x[i] / softcap);
                        if (i >= count || t + i > position || (window > 0 && t + i <= position - window))
                            x[i] = -INFINITY;
                    }
                }
                const float tile_max = hmax_keys(x);
                const float old_max = s->row_max[r];
                const float new_max = tile_max > old_max ? tile_max : old_max;
                correction[b] = new_max == old_max ? 1.0f : expf(old_max - new_max);  /* 0 at the first keys */
                const vkeys weights = exp_keys(x - new_max);
                memcpy(p[b], &weights, sizeof weights);
                s->row_sum[r] = s->row_sum[r] * correction[b] + hsum_keys(weights);
                s->row_max[r] = new_max;
            }
            weigh_values(s->outputs + r0 * D, correction, p, block_rows, v_rows, count, D);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t query = first_query + r / group, head = kv_head * group + r % group;
        const float inv = 1.0f / s->row_sum[r];
        float *dst = out + (query * num_heads + head) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = s->outputs[r * D + d] * inv;
    }
}

static void attend_tile(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                        const int64_t *table, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t kv_head, int64_t start, int64_t first_query, int64_t last_query,
                        float scale, int64_t window, float softcap, float *out, Scratch *s) {
#define ATTEND(D) attend_tile_d(q, q_stride, k_cache, v_cache, table, block_size, num_heads, num_kv_heads, kv_head, \
                                start, first_query, last_query, scale, window, softcap, out, s, D)
    FLOTILLA_FOR_HEAD_DIM(head_dim, ATTEND)
#undef ATTEND
}

/* head_dim % 8 == 0 (the caller checks). Returns 0, -1 for bad head counts, -2 when scratch cannot be had. */
int paged_prefill_attention_f32(const float *q, int64_t q_stride, const float *kv, const int64_t *table, float *out,
                                int64_t num_queries, int64_t start, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale, int64_t window,
                                float softcap, int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim % 8) return -1;
    const float *k_cache = kv;
    const float *v_cache = kv + num_blocks * block_size * num_kv_heads * head_dim;
    const int64_t num_tiles = (num_queries + QUERY_TILE - 1) / QUERY_TILE;
    const int64_t rows = QUERY_TILE * (num_heads / num_kv_heads);
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        Scratch scratch;
        const int ok = scratch_alloc(&scratch, rows, head_dim) == 0;
        if (!ok) status = -2;
        /* Later tiles see more keys: hand them out first, one at a time, so the threads end together. */
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t tile = num_tiles - 1; tile >= 0; tile--) {
            for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++) {
                if (!ok) continue;
                const int64_t first = tile * QUERY_TILE;
                const int64_t last = first + QUERY_TILE < num_queries ? first + QUERY_TILE : num_queries;
                attend_tile(q, q_stride, k_cache, v_cache, table, block_size, num_heads, num_kv_heads, head_dim,
                            kv_head, start, first, last, scale, window, softcap, out, &scratch);
            }
        }
        scratch_free(&scratch);
    }
    return status;
}
