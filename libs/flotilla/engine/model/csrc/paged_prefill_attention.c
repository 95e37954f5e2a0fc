/* Prefill attention on the CPU for one sequence's chunk of queries, reading K/V in place through its block table.
 *
 * The chunk's queries are at positions start..start+num_queries-1; query p sees keys 0..p (causal), so a chunk
 * after a prefix hit or an earlier chunk reads the earlier keys from the cache without gathering them (the torch
 * path copies every block of the context into one tensor first, then runs SDPA over the copy).
 *
 * Flash-attention order. First the call's keys are transposed once, per KV head, into blocks of KEY_BLOCK keys
 * laid out [D][KEY_BLOCK] (64 keys with AVX-512, else 16), which every query tile then shares. One work item is a
 * tile of queries of one KV head (QUERY_TILE queries x the G query heads that share it); it walks the key blocks
 * with a running max and sum per row, so no score matrix is ever stored. Rows go ROW_BLOCK at a time: their scores
 * for a key block are ROW_BLOCK x KEY_VECTORS independent accumulators (24 with AVX-512: enough to keep both FMA
 * pipes busy), the softmax's max, sum and rescale are paid once per key block, and the V pass keeps the rows'
 * outputs in registers across the block's keys, loading each V row (read in place) once for all the rows. Masks
 * are applied only on blocks that need them (the diagonal, the window's edge, the last keys), a vector at a time.
 * On an AMD EPYC (2 threads) this layout ran 1.7-1.8x the one before it (16-key tiles, K transposed per tile and
 * query tile, 4 x 1 accumulators), which itself ran 1.2-1.9x torch's CPU flash SDPA (docs/performance.md).
 *
 * Layouts (float32):
 *   q   [num_queries, H, D], rows q_stride floats apart (q is a slice of the layer's fused qkv output)
 *   out [num_queries, H, D], contiguous
 *   kv (a layer) [2, num_blocks, KVH, block_size, D] (head-major inside a block); table [W] int64
 * window > 0: query p sees keys p-window+1..p only; softcap > 0: scores -> softcap * tanh(scores / softcap).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "head_dims.h"
#include "vector_exp.h"

/* A vector of keys' scores: 16 where the CPU has AVX-512, else 8. A key block is KEY_VECTORS of them. */
#if defined(__AVX512F__)
#define WIDTH 16
#define KEY_VECTORS 4
#define ROW_BLOCK 6    /* rows scored and weighed together: 6 x 4 accumulators of the 32 registers (4 rows: 8% slower) */
#define VALUE_CHUNKS 4 /* vectors of each row's output held in registers by the V pass */
typedef v16f vec;
typedef v16i vec_int;
#define exp_vec exp16
#define select_vec select16
#define LANES ((vec_int){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15})
#else
#define WIDTH 8
#define KEY_VECTORS 2 /* AVX2 has 16 vector registers: 4 rows x 2 vectors of accumulators */
#define ROW_BLOCK 4
#define VALUE_CHUNKS 2
typedef v8f vec;
typedef v8i vec_int;
#define exp_vec exp8
#define select_vec select8
#define LANES ((vec_int){0, 1, 2, 3, 4, 5, 6, 7})
#endif
#define KEY_BLOCK (WIDTH * KEY_VECTORS) /* keys per online-softmax update: 64 with AVX-512 */
#define QUERY_TILE 64                   /* queries per work item */

/* One vector of type VT from or to floats at p (unaligned): a vector at a time, so that arrays of them stay in
 * registers (a memcpy of a whole array went through the stack). */
#define LOAD(VT, p) ({ VT loaded_; memcpy(&loaded_, (p), sizeof loaded_); loaded_; })
#define STORE(p, x) memcpy((p), &(x), sizeof(x))

/* Horizontal max and sum by halving (a tree of vector ops, not one scalar step per lane). */
static inline v8f max8(v8f a, v8f b) { return (v8f)select8(a > b, a, b); }
#if WIDTH == 16
static inline vec max_vec(vec a, vec b) { return (vec)select16(a > b, a, b); }
#else
static inline vec max_vec(vec a, vec b) { return max8(a, b); }
#endif

static inline v8f fold(vec x, int is_max) {
#if WIDTH == 16
    const v8f low = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8f high = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    return is_max ? max8(low, high) : low + high;
#else
    (void)is_max;
    return x;
#endif
}

static inline float hmax(vec x) {
    v8f m = fold(x, 1);
    m = max8(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3));
    m = max8(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5));
    m = max8(m, __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6));
    return m[0];
}

static inline float hsum(vec x) {
    v8f m = fold(x, 0);
    m += __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3);
    m += __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5);
    m += __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6);
    return m[0];
}

/* The keys of one call, shared by its work items: positions key_base.. in blocks of KEY_BLOCK, each block's K
 * transposed per KV head into [D][KEY_BLOCK] (zeros past the last key), and every key's row in the cache: KV head
 * j's K (or V) of the key is D floats at (row + j * block_size) * D. */
typedef struct {
    float *keys_t;   /* [KVH][num_blocks][D][KEY_BLOCK] */
    int64_t *rows;   /* [num_blocks * KEY_BLOCK] (cache block * KVH * block_size + offset), -1 past the last key */
    int64_t key_base, num_blocks;
} Keys;

/* Per-thread scratch of a work item: its rows' queries (pre-scaled, contiguous; padded to whole row blocks with
 * zeros), outputs, positions (-1 on padding: it sees no key), running max and sum. */
typedef struct {
    float *queries, *outputs, *row_max, *row_sum;
    int64_t *positions;
} Scratch;

static int scratch_alloc(Scratch *s, int64_t rows, int64_t D) {
    s->queries = aligned_alloc(64, sizeof(float) * ((rows * D + 15) & ~15));
    s->outputs = aligned_alloc(64, sizeof(float) * ((rows * D + 15) & ~15));
    s->row_max = malloc(sizeof(float) * rows);
    s->row_sum = malloc(sizeof(float) * rows);
    s->positions = malloc(sizeof(int64_t) * rows);
    return s->queries && s->outputs && s->row_max && s->row_sum && s->positions ? 0 : -2;
}

static void scratch_free(Scratch *s) {
    free(s->queries);
    free(s->outputs);
    free(s->row_max);
    free(s->row_sum);
    free(s->positions);
}

/* Key block `block` of the call: rows, and K transposed for every KV head. */
static void transpose_key_block(const Keys *keys, const float *k_cache, const int64_t *table, int64_t block_size,
                                int64_t num_kv_heads, int64_t D, int64_t last_position, int64_t block) {
    int64_t *rows = keys->rows + block * KEY_BLOCK;
    for (int i = 0; i < KEY_BLOCK; i++) {
        const int64_t key = keys->key_base + block * KEY_BLOCK + i;
        rows[i] = key <= last_position ? table[key / block_size] * num_kv_heads * block_size + key % block_size : -1;
    }
    for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++) {
        float *kt = keys->keys_t + (kv_head * keys->num_blocks + block) * D * KEY_BLOCK;
        for (int i = 0; i < KEY_BLOCK; i++) {
            const float *k = rows[i] < 0 ? NULL : k_cache + (rows[i] + kv_head * block_size) * D;
            for (int64_t d = 0; d < D; d++) kt[d * KEY_BLOCK + i] = k ? k[d] : 0.0f;
        }
    }
}

/* Scores of ROW_BLOCK rows against a transposed key block: acc[r][v] holds keys v*WIDTH.. of row r. */
static inline __attribute__((always_inline)) void score_rows(const float *queries, const float *kt,
                                                             vec acc[ROW_BLOCK][KEY_VECTORS], const int64_t D) {
    for (int r = 0; r < ROW_BLOCK; r++)
        for (int v = 0; v < KEY_VECTORS; v++) acc[r][v] = (vec){0};
    for (int64_t d = 0; d < D; d++) {
        vec k[KEY_VECTORS];
        for (int v = 0; v < KEY_VECTORS; v++) k[v] = LOAD(vec, kt + d * KEY_BLOCK + v * WIDTH);
        for (int r = 0; r < ROW_BLOCK; r++) {
            const float qd = queries[r * D + d];
            for (int v = 0; v < KEY_VECTORS; v++) acc[r][v] += qd * k[v];
        }
    }
}

/* out_r = out_r * correction_r + sum_i p_r[i] * v_i for the ROW_BLOCK rows over the `count` keys whose V rows are
 * v_rows[i], features d0.. in CHUNKS vectors of type VT (W floats): the rows' chunks stay in registers across the
 * keys and each V chunk is loaded once for all the rows. */
#define WEIGH_VALUES_PASS(VT, W, CHUNKS)                                                         \
    {                                                                                            \
        VT acc[ROW_BLOCK][CHUNKS];                                                               \
        for (int r = 0; r < ROW_BLOCK; r++) {                                                    \
            for (int c = 0; c < CHUNKS; c++)                                                     \
                acc[r][c] = LOAD(VT, outputs + r * D + d0 + c * W) * correction[r];              \
        }                                                                                        \
        for (int i = 0; i < count; i++) {                                                        \
            VT v[CHUNKS];                                                                        \
            for (int c = 0; c < CHUNKS; c++) v[c] = LOAD(VT, v_rows[i] + d0 + c * W);            \
            for (int r = 0; r < ROW_BLOCK; r++)                                                  \
                for (int c = 0; c < CHUNKS; c++) acc[r][c] += p[r][i] * v[c];                    \
        }                                                                                        \
        for (int r = 0; r < ROW_BLOCK; r++)                                                      \
            for (int c = 0; c < CHUNKS; c++) STORE(outputs + r * D + d0 + c * W, acc[r][c]);     \
    }

static inline __attribute__((always_inline)) void weigh_values(float *outputs, const float *correction,
                                                               const float (*p)[KEY_BLOCK],
                                                               const float *const *v_rows, int count,
                                                               const int64_t D) {
    int64_t d0 = 0;
    for (; d0 + VALUE_CHUNKS * WIDTH <= D; d0 += VALUE_CHUNKS * WIDTH) WEIGH_VALUES_PASS(vec, WIDTH, VALUE_CHUNKS)
    for (; d0 + 2 * WIDTH <= D; d0 += 2 * WIDTH) WEIGH_VALUES_PASS(vec, WIDTH, 2)
    for (; d0 + WIDTH <= D; d0 += WIDTH) WEIGH_VALUES_PASS(vec, WIDTH, 1)
#if WIDTH == 16
    for (; d0 + 8 <= D; d0 += 8) WEIGH_VALUES_PASS(v8f, 8, 1)
#endif
}
#undef WEIGH_VALUES_PASS

/* The online-softmax step of one row for one key block: its scores (masked where they must be) become weights p
 * relative to the row's new running max; returns the factor the row's earlier sum and output are scaled by. */
static inline __attribute__((always_inline)) float softmax_step(vec scores[KEY_VECTORS], int64_t t, int64_t position,
                                                                int64_t window, float softcap, float *row_max,
                                                                float *row_sum, float *p) {
    /* Only blocks on the diagonal, at the window's edge or past the last key need masks. */
    const int inside = t + KEY_BLOCK - 1 <= position && (window <= 0 || t > position - window);
    if (softcap > 0.0f) {
        float x[KEY_BLOCK];
        memcpy(x, scores, sizeof x);
        for (int i = 0; i < KEY_BLOCK; i++) x[i] = softcap * tanhf(x[i] / softcap);
        memcpy(scores, x, sizeof x);
    }
    if (!inside) { /* keys past the row's position or before its window get -inf, a vector at a time */
        const vec_int first_hidden = (vec_int){0} + (int32_t)(position - t + 1);
        const vec_int last_unseen = (vec_int){0} + (int32_t)(window > 0 ? position - window - t : -1);
        const vec minus_infinity = (vec){0} - INFINITY;
        for (int v = 0; v < KEY_VECTORS; v++) {
            const vec_int lane = LANES + v * WIDTH; /* key t + lane */
            scores[v] = select_vec((lane >= first_hidden) | (lane <= last_unseen), minus_infinity, scores[v]);
        }
    }
    vec m = scores[0];
    for (int v = 1; v < KEY_VECTORS; v++) m = max_vec(m, scores[v]);
    const float block_max = hmax(m);
    const float old_max = *row_max;
    const float new_max = block_max > old_max ? block_max : old_max;
    const float correction = new_max == old_max ? 1.0f : expf(old_max - new_max); /* 0 at the first keys */
    vec sum = {0};
    for (int v = 0; v < KEY_VECTORS; v++) {
        const vec weights = exp_vec(scores[v] - new_max);
        memcpy(p + v * WIDTH, &weights, sizeof weights);
        sum += weights;
    }
    *row_sum = *row_sum * correction + hsum(sum);
    *row_max = new_max;
    return correction;
}

static inline __attribute__((always_inline)) void attend_tile_d(
    const float *q, int64_t q_stride, const Keys *keys, const float *v_cache, int64_t block_size, int64_t num_heads,
    int64_t num_kv_heads, int64_t kv_head, int64_t start, int64_t first_query, int64_t last_query, float scale,
    int64_t window, float softcap, float *out, Scratch *s, const int64_t D) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t rows = (last_query - first_query) * group;
    const int64_t padded_rows = (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    /* Row r: query first_query + r / group, head kv_head * group + r % group; queries scaled once. */
    for (int64_t r = 0; r < padded_rows; r++) {
        float *dst = s->queries + r * D;
        s->row_max[r] = -INFINITY;
        s->row_sum[r] = 0.0f;
        if (r >= rows) {
            memset(dst, 0, sizeof(float) * D);
            s->positions[r] = -1;
            continue;
        }
        const int64_t query = first_query + r / group, head = kv_head * group + r % group;
        const float *src = q + query * q_stride + head * D;
        for (int64_t d = 0; d < D; d++) dst[d] = src[d] * scale;
        s->positions[r] = start + query;
    }
    memset(s->outputs, 0, sizeof(float) * padded_rows * D);
    const int64_t last_position = start + last_query - 1;
    const int64_t first_key = window > 0 && start + first_query - window + 1 > 0 ? start + first_query - window + 1 : 0;
    const float *v_rows[KEY_BLOCK];
    for (int64_t block = (first_key - keys->key_base) / KEY_BLOCK; keys->key_base + block * KEY_BLOCK <= last_position;
         block++) {
        const int64_t t = keys->key_base + block * KEY_BLOCK;
        const int count = last_position + 1 - t < KEY_BLOCK ? (int)(last_position + 1 - t) : KEY_BLOCK;
        const float *kt = keys->keys_t + (kv_head * keys->num_blocks + block) * D * KEY_BLOCK;
        for (int i = 0; i < count; i++)
            v_rows[i] = v_cache + (keys->rows[block * KEY_BLOCK + i] + kv_head * block_size) * D;
        for (int64_t r0 = 0; r0 < padded_rows; r0 += ROW_BLOCK) {
            const int64_t *positions = s->positions + r0;
            int64_t highest = positions[0];
            for (int b = 1; b < ROW_BLOCK; b++) highest = positions[b] > highest ? positions[b] : highest;
            if (t > highest) continue; /* no row of the block sees these keys yet */
            vec scores[ROW_BLOCK][KEY_VECTORS];
            score_rows(s->queries + r0 * D, kt, scores, D);
            /* The weights go through memory: the V pass broadcasts each from there (no lane shuffles). */
            float p[ROW_BLOCK][KEY_BLOCK] __attribute__((aligned(64)));
            float correction[ROW_BLOCK];
            for (int b = 0; b < ROW_BLOCK; b++) {
                if (t > positions[b] || (window > 0 && t + KEY_BLOCK - 1 <= positions[b] - window)) {
                    memset(p[b], 0, sizeof p[b]); /* none of these keys visible to this row */
                    correction[b] = 1.0f;
                    continue;
                }
                correction[b] = softmax_step(scores[b], t, positions[b], window, softcap, s->row_max + r0 + b,
                                             s->row_sum + r0 + b, p[b]);
            }
            weigh_values(s->outputs + r0 * D, correction, p, v_rows, count, D);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t query = first_query + r / group, head = kv_head * group + r % group;
        const float inv = 1.0f / s->row_sum[r];
        float *dst = out + (query * num_heads + head) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = s->outputs[r * D + d] * inv;
    }
}

static void attend_tile(const float *q, int64_t q_stride, const Keys *keys, const float *v_cache, int64_t block_size,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t kv_head, int64_t start,
                        int64_t first_query, int64_t last_query, float scale, int64_t window, float softcap,
                        float *out, Scratch *s) {
#define ATTEND(D) attend_tile_d(q, q_stride, keys, v_cache, block_size, num_heads, num_kv_heads, kv_head, start, \
                                first_query, last_query, scale, window, softcap, out, s, D)
    FLOTILLA_FOR_HEAD_DIM(head_dim, ATTEND)
#undef ATTEND
}

/* One sequence's chunk of the step: its rows of q and out, its block table and positions, its keys. */
typedef struct {
    const float *q;
    float *out;
    const int64_t *table;
    int64_t start, num_queries;
    Keys keys;
} Chunk;

/* A work item: query tile `tile` of chunk `chunk` for one KV head; cost is the keys it reads. A transpose item:
 * key block `block` of chunk `chunk`. */
typedef struct {
    int64_t chunk, tile, kv_head, cost;
} WorkItem;

static int costlier_first(const void *a, const void *b) {
    const int64_t x = ((const WorkItem *)a)->cost, y = ((const WorkItem *)b)->cost;
    return (x < y) - (x > y);
}

/* Every prefill chunk of a step in one call (one OpenMP region per layer, not one per sequence: waking the
 * threads costs tens of microseconds each time, and a short prompt alone has too few tiles to keep both threads
 * busy). Chunk c: queries at positions starts[c].. (counts[c] of them) in rows row_offsets[c].. of q and out,
 * block table tables[c * table_width ..]. head_dim % 8 == 0 (the caller checks). Returns 0, -1 for bad head
 * counts, -2 when memory cannot be had. */
int paged_prefill_attention_batch_f32(const float *q, int64_t q_stride, const float *kv, const int64_t *tables,
                                      int64_t table_width, const int64_t *starts, const int64_t *row_offsets,
                                      const int64_t *counts, int64_t num_chunks, float *out, int64_t num_heads,
                                      int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                                      float scale, int64_t window, float softcap, int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim % 8 || num_chunks < 0) return -1;
    if (num_chunks == 0) return 0;
    const float *k_cache = kv;
    const float *v_cache = kv + num_blocks * block_size * num_kv_heads * head_dim;
    Chunk *chunks = malloc(sizeof(Chunk) * num_chunks);
    if (chunks == NULL) return -2;
    int64_t total_key_blocks = 0, total_items = 0;
    for (int64_t c = 0; c < num_chunks; c++) {
        Chunk *chunk = &chunks[c];
        chunk->q = q + row_offsets[c] * q_stride;
        chunk->out = out + row_offsets[c] * num_heads * head_dim;
        chunk->table = tables + c * table_width;
        chunk->start = starts[c];
        chunk->num_queries = counts[c];
        const int64_t last_position = starts[c] + counts[c] - 1;
        const int64_t first_key = window > 0 && starts[c] - window + 1 > 0 ? starts[c] - window + 1 : 0;
        chunk->keys.key_base = first_key / KEY_BLOCK * KEY_BLOCK;
        chunk->keys.num_blocks = counts[c] > 0 ? (last_position - chunk->keys.key_base) / KEY_BLOCK + 1 : 0;
        total_key_blocks += chunk->keys.num_blocks;
        total_items += (counts[c] + QUERY_TILE - 1) / QUERY_TILE * num_kv_heads;
    }
    float *keys_t = aligned_alloc(64, sizeof(float) * (total_key_blocks * num_kv_heads * head_dim * KEY_BLOCK + 16));
    int64_t *key_rows = malloc(sizeof(int64_t) * (total_key_blocks * KEY_BLOCK + 1));
    WorkItem *transposes = malloc(sizeof(WorkItem) * (total_key_blocks + 1));
    WorkItem *items = malloc(sizeof(WorkItem) * (total_items + 1));
    int status = keys_t && key_rows && transposes && items ? 0 : -2;
    if (status == 0) {
        int64_t blocks_so_far = 0, item = 0;
        for (int64_t c = 0; c < num_chunks; c++) {
            Chunk *chunk = &chunks[c];
            chunk->keys.keys_t = keys_t + blocks_so_far * num_kv_heads * head_dim * KEY_BLOCK;
            chunk->keys.rows = key_rows + blocks_so_far * KEY_BLOCK;
            for (int64_t block = 0; block < chunk->keys.num_blocks; block++)
                transposes[blocks_so_far + block] = (WorkItem){c, block, 0, 0};
            blocks_so_far += chunk->keys.num_blocks;
            for (int64_t tile = 0; tile * QUERY_TILE < chunk->num_queries; tile++) {
                const int64_t first = chunk->start + tile * QUERY_TILE;
                const int64_t last = first + QUERY_TILE < chunk->start + chunk->num_queries
                                         ? first + QUERY_TILE - 1 : chunk->start + chunk->num_queries - 1;
                const int64_t first_key = window > 0 && first - window + 1 > 0 ? first - window + 1 : 0;
                for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++)
                    items[item++] = (WorkItem){c, tile, kv_head, last + 1 - first_key};
            }
        }
        /* Items that read the most keys first, one at a time, so that the threads end together. */
        qsort(items, total_items, sizeof(WorkItem), costlier_first);
    }
    const int64_t rows = (QUERY_TILE * (num_heads / num_kv_heads) + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
#pragma omp parallel num_threads(num_threads) if (status == 0)
    {
        Scratch scratch = {0};
        const int ok = status == 0 && scratch_alloc(&scratch, rows, head_dim) == 0;
        if (!ok) status = -2;
        /* K transposed once per call, not once per query tile. */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < total_key_blocks; i++) {
            if (!ok) continue;
            const Chunk *chunk = &chunks[transposes[i].chunk];
            transpose_key_block(&chunk->keys, k_cache, chunk->table, block_size, num_kv_heads, head_dim,
                                chunk->start + chunk->num_queries - 1, transposes[i].tile);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < total_items; i++) {
            if (status != 0) continue;
            const Chunk *chunk = &chunks[items[i].chunk];
            const int64_t first = items[i].tile * QUERY_TILE;
            const int64_t last = first + QUERY_TILE < chunk->num_queries ? first + QUERY_TILE : chunk->num_queries;
            attend_tile(chunk->q, q_stride, &chunk->keys, v_cache, block_size, num_heads, num_kv_heads, head_dim,
                        items[i].kv_head, chunk->start, first, last, scale, window, softcap, chunk->out, &scratch);
        }
        scratch_free(&scratch);
    }
    free(chunks);
    free(keys_t);
    free(key_rows);
    free(transposes);
    free(items);
    return status;
}
