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

/* Ask for the row of token `offset` of the next block while this block's row is read: blocks lie anywhere in
 * the cache, so the hardware prefetcher, which follows addresses, cannot see the next one coming (reading K/V
 * through scattered blocks ran at about half the speed of reading them in order). */
static inline void prefetch_row(const float *next_block, int64_t offset, int64_t token_stride) {
    if (next_block == NULL) return;
    const char *row = (const char *)(next_block + offset * token_stride);
    for (int64_t byte = 0; byte < token_stride * (int64_t)sizeof(float); byte += 64) __builtin_prefetch(row + byte);
}

/* The keys t..end-1 of `block` in one K or V cache: the first one's row, and the next block's first row to
 * prefetch (NULL after the last block). */
typedef struct {
    const float *row;
    const float *next_block;
    int64_t end;
} BlockSpan;

static inline BlockSpan block_span(const float *cache, const int64_t *table, int64_t block, int64_t t,
                                   int64_t context_len, int64_t block_size, int64_t token_stride) {
    const int64_t end = (block + 1) * block_size < context_len ? (block + 1) * block_size : context_len;
    BlockSpan span = {cache + (table[block] * block_size + t - block * block_size) * token_stride, NULL, end};
    if (end < context_len) span.next_block = cache + table[block + 1] * block_size * token_stride;
    return span;
}

/* One sequence, all heads, over keys first..context_len-1, three passes: scores (reads K once, token-major so
 * each token's heads are one contiguous read), softmax (vectorised expf over the keys), weighted sum of V (reads
 * V once). Keys are walked block by block and heads by KV head then query head of its group: no integer
 * division in the loops (a 64-bit divide per token and per head was about half of the kernel's time). */
static void attend_sequence(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                            int64_t first, int64_t context_len, int64_t block_size, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, float scale, float softcap, float *scores,
                            float *out) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t num_keys = context_len - first;
    for (int64_t block = first / block_size, t = first; t < context_len; block++) {
        const BlockSpan span = block_span(k_cache, table, block, t, context_len, block_size, token_stride);
        const float *k_token = span.row;
        for (; t < span.end; t++, k_token += token_stride) {
            prefetch_row(span.next_block, t - block * block_size, token_stride);
            float *score_t = scores + t - first;
            for (int64_t j = 0; j < num_kv_heads; j++) {
                const float *k = k_token + j * head_dim;
                for (int64_t h = j * group; h < (j + 1) * group; h++) {
                    const float *qh = q + h * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * k[d];
                    const float score = dot * scale;
                    score_t[h * num_keys] = softcap > 0.0f ? softcap * tanhf(score / softcap) : score;
                }
            }
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float *row = scores + h * num_keys;
        float max_score = -INFINITY, total = 0.0f;
        for (int64_t t = 0; t < num_keys; t++) max_score = row[t] > max_score ? row[t] : max_score;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < num_keys; t++) {
            row[t] = expf(row[t] - max_score);
            total += row[t];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < num_keys; t++) row[t] *= inv;
    }
    memset(out, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t block = first / block_size, t = first; t < context_len; block++) {
        const BlockSpan span = block_span(v_cache, table, block, t, context_len, block_size, token_stride);
        const float *v_token = span.row;
        for (; t < span.end; t++, v_token += token_stride) {
            prefetch_row(span.next_block, t - block * block_size, token_stride);
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
            const int64_t needed = num_heads * (context_lens[b] - first);
            if (needed > capacity) {
                free(scores);
                capacity = needed;
                scores = malloc(sizeof(float) * capacity);
                if (scores == NULL) {
                    status = -2;
                    capacity = 0;
                    continue;
                }
            }
            const int64_t row = b * num_heads * head_dim;
            attend_sequence(q + row, k_cache, v_cache, block_tables + b * table_width, first, context_lens[b],
                            block_size, num_heads, num_kv_heads, head_dim, scale, softcap, scores, out + row);
        }
        free(scores);
    }
    return status;
}
