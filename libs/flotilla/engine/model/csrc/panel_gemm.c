/* out[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the engine's CPU linears, on the threads of spin_pool.h; and a
 * Llama MLP's gate/up matmul with SiLU(gate) * up applied to its tiles before they are stored.
 *
 * oneDNN does the same matmuls as fast per core, but each call opens an OpenMP region, and under
 * OMP_WAIT_POLICY=PASSIVE waking its second thread costs ~70 us a call on the project's VM, as much as the
 * matmul itself at a tiny model's shapes (docs/performance.md, "Where a decode step waits"). Here the workers
 * of spin_pool.h are still spinning from the previous matmul of the step.
 *
 * W is packed once into panels of PANEL columns: panel p holds W[p*PANEL + j][k] at [p][k][j], columns past N
 * zero. Gated, W is [2I, K] (gate rows, then up rows) and panel p holds the gate rows p*16 + j in its first 16
 * columns and the matching up rows in its last 16, so one tile holds both halves of 16 outputs. One item of work
 * is one panel for a block of rows: ROWS rows at a time, each a register tile of ROWS x PANEL accumulators, the
 * panel's K x PANEL floats read from cache once per tile and each x element broadcast once. Each row's sums run
 * in the same order whatever rows and threads share the call, so its result is the same bit for bit. */
#include <stdint.h>
#include <string.h>

#include "spin_pool.h"
#include "vector_exp.h"

#define PANEL 32
#define HALF (PANEL / 2)
/* A tile's accumulators: ROWS x PANEL / 16 vectors of 16 floats. AVX-512 has 32 registers (16 accumulators,
 * two panel vectors, a broadcast); with AVX2 a 16-float vector takes two of its 16 registers. */
#if defined(__AVX512F__)
#define ROWS 8
#else
#define ROWS 3
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* Floats of packed weight for W [n, k]: whole panels. Gated, n is 2I and each panel covers 16 outputs. */
int64_t panel_gemm_packed_floats(int64_t n, int64_t k, int gated) {
    const int64_t per_panel = gated ? HALF : PANEL, outputs = gated ? n / 2 : n;
    return (outputs + per_panel - 1) / per_panel * PANEL * k;
}

void panel_gemm_pack_f32(const float *w, int64_t n, int64_t k, int gated, float *packed) {
    memset(packed, 0, sizeof(float) * panel_gemm_packed_floats(n, k, gated));
    for (int64_t row = 0; row < n; row++) { /* W's row `row` is one packed column */
        int64_t column = row;
        if (gated) { /* up row I + j sits 16 columns after gate row j, in the same panel */
            const int64_t half = n / 2, output = row % half;
            column = output / HALF * PANEL + (row >= half ? HALF : 0) + output % HALF;
        }
        float *panel = packed + column / PANEL * PANEL * k + column % PANEL;
        for (int64_t i = 0; i < k; i++) panel[i * PANEL] = w[row * k + i];
    }
}

/* rows (1..ROWS) of a panel's outputs from x's rows: PANEL of them, `cols` real; gated, SiLU(gate) * up for HALF
 * of them. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t k, const float *panel, const float *bias,
                                                       float *out, int64_t ldo, int cols, const int rows,
                                                       const int gated) {
    v16 acc[ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = (v16){0};
    for (int64_t i = 0; i < k; i++) {
        const v16 b0 = *(const v16 *)(panel + i * PANEL), b1 = *(const v16 *)(panel + i * PANEL + 16);
        for (int r = 0; r < rows; r++) {
            const float a = x[r * k + i];
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
        }
    }
    float row[PANEL];
    for (int r = 0; r < rows; r++) {
        if (bias != NULL) {
            acc[r][0] += *(const v16 *)bias;
            acc[r][1] += *(const v16 *)(bias + 16);
        }
        int width = PANEL;
        if (gated) {
            const v16 gate = acc[r][0];
            acc[r][0] = gate / (1.0f + exp16(-gate)) * acc[r][1];
            width = HALF;
        }
        if (cols == width) {
            *(v16 *)(out + r * ldo) = acc[r][0];
            if (!gated) *(v16 *)(out + r * ldo + 16) = acc[r][1];
        } else { /* the last panel: only its real columns */
            *(v16 *)row = acc[r][0];
            *(v16 *)(row + 16) = acc[r][1];
            memcpy(out + r * ldo, row, sizeof(float) * cols);
        }
    }
}

/* Rows a work item covers: all of a decode step's; for a prefill step's thousands, blocks whose x (block x K
 * floats) stays in a core's L2 while the item's panel walks over it. */
#define ROW_BLOCK 256

typedef struct {
    const float *x, *packed, *bias;
    float *out;
    int64_t m, n, k, panels, row_block; /* n: out's width (I, gated) */
    int gated;
} gemm_task;

static void panel_item(void *context, int64_t item) {
    const gemm_task *whole = context;
    const int64_t first_row = item / whole->panels * whole->row_block, p = item % whole->panels;
    gemm_task block = *whole;
    block.x += first_row * whole->k;
    block.out += first_row * whole->n;
    block.m = whole->m - first_row < whole->row_block ? whole->m - first_row : whole->row_block;
    const gemm_task *t = &block;
    const float *panel = t->packed + p * PANEL * t->k;
    const int64_t per_panel = t->gated ? HALF : PANEL, col = p * per_panel;
    const int cols = t->n - col < per_panel ? (int)(t->n - col) : (int)per_panel;
    float bias[PANEL] = {0};
    if (t->bias != NULL) memcpy(bias, t->bias + col, sizeof(float) * cols);
    const float *b = t->bias != NULL ? bias : NULL;
    int64_t r = 0;
    /* Each row count and mode compiled apart (constant `rows` and `gated`: the tile's loops unroll). With fewer
     * than 8 ROWS the cases past ROWS - 1 never run; `% ROWS` keeps their constant in the tile's bounds. */
#define TILES(gated_)                                                                                     \
    for (; r + ROWS <= t->m; r += ROWS)                                                                   \
        tile(t->x + r * t->k, t->k, panel, b, t->out + r * t->n + col, t->n, cols, ROWS, gated_);         \
    switch (t->m - r) { /* the rows left over */                                                          \
        REST(1, gated_) REST(2, gated_) REST(3, gated_) REST(4, gated_) REST(5, gated_) REST(6, gated_)   \
        REST(7, gated_) default : break;                                                                  \
    }
#define REST(n_, gated_)                                                                                  \
    case n_:                                                                                              \
        tile(t->x + r * t->k, t->k, panel, b, t->out + r * t->n + col, t->n, cols, (n_) % ROWS, gated_); \
        break;
    if (t->gated) {
        TILES(1)
    } else {
        TILES(0)
    }
#undef REST
#undef TILES
}

/* out [m, n] = x [m, k] @ W^T (+ bias); gated (W [2n, k], no bias): SiLU(x @ gate^T) * (x @ up^T). */
void panel_gemm_f32(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n,
                    int64_t k, int gated, int num_threads, int64_t spin_ns) {
    const int64_t panels = (n + (gated ? HALF : PANEL) - 1) / (gated ? HALF : PANEL);
    const int64_t row_block = m > 2 * ROW_BLOCK ? ROW_BLOCK : m;
    gemm_task task = {x, packed, gated ? NULL : bias, out, m, n, k, panels, row_block, gated};
    spin_pool_run(num_threads, spin_ns, panel_item, &task, (m + row_block - 1) / row_block * panels);
}

/* The pool itself, for the other kernels that share its threads (paged_decode_attention.c takes its address). */
void panel_gemm_pool_run(int num_threads, int64_t spin_ns, spin_pool_item_fn fn, void *context, int64_t items) {
    spin_pool_run(num_threads, spin_ns, fn, context, items);
}
