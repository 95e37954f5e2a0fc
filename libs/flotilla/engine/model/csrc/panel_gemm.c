/* out[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the few rows of a decode step, on the threads of spin_pool.h.
 *
 * oneDNN does the same matmuls as fast per core, but each call opens an OpenMP region, and under
 * OMP_WAIT_POLICY=PASSIVE waking its second thread costs ~70 us a call on the project's VM, as much as the
 * matmul itself at a tiny model's shapes (docs/performance.md, "Where a decode step waits"). Here the workers
 * of spin_pool.h are still spinning from the previous matmul of the step.
 *
 * W is packed once into panels of PANEL columns: panel p holds W[p*PANEL + j][k] at [p][k][j], columns past N
 * zero. One item of work is one panel for all M rows: ROWS rows at a time, each a register tile of ROWS x PANEL
 * accumulators, the panel's K x PANEL floats read from cache once per tile and each x element broadcast once. */
#include <stdint.h>
#include <string.h>

#include "spin_pool.h"

#define PANEL 32
/* A tile's accumulators: ROWS x PANEL / 16 vectors of 16 floats. AVX-512 has 32 registers (16 accumulators,
 * two panel vectors, a broadcast); with AVX2 a 16-float vector takes two of its 16 registers. */
#if defined(__AVX512F__)
#define ROWS 8
#else
#define ROWS 3
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));

int64_t panel_gemm_packed_floats(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * PANEL * k; }

void panel_gemm_pack_f32(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    memset(packed, 0, sizeof(float) * panels * PANEL * k);
    for (int64_t col = 0; col < n; col++) {
        float *panel = packed + col / PANEL * PANEL * k + col % PANEL;
        for (int64_t i = 0; i < k; i++) panel[i * PANEL] = w[col * k + i];
    }
}

/* rows (1..ROWS) x PANEL of out, from x's rows and one panel; `cols` of the panel's columns are real. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t k, const float *panel, const float *bias,
                                                       float *out, int64_t ldo, int cols, const int rows) {
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
        if (cols == PANEL) {
            *(v16 *)(out + r * ldo) = acc[r][0];
            *(v16 *)(out + r * ldo + 16) = acc[r][1];
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
    int64_t m, n, k, panels, row_block;
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
    const int64_t col = p * PANEL;
    const int cols = t->n - col < PANEL ? (int)(t->n - col) : PANEL;
    float bias[PANEL] = {0};
    if (t->bias != NULL) memcpy(bias, t->bias + col, sizeof(float) * cols);
    const float *b = t->bias != NULL ? bias : NULL;
    int64_t r = 0;
    for (; r + ROWS <= t->m; r += ROWS) tile(t->x + r * t->k, t->k, panel, b, t->out + r * t->n + col, t->n, cols, ROWS);
    switch (t->m - r) { /* the rows left over, each count compiled apart */
#define REST(n_)                                                                                  \
    case n_:                                                                                      \
        tile(t->x + r * t->k, t->k, panel, b, t->out + r * t->n + col, t->n, cols, (n_) % ROWS); \
        break;
        REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7)
#undef REST
    default:
        break;
    }
}

void panel_gemm_f32(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n,
                    int64_t k, int num_threads, int64_t spin_ns) {
    const int64_t panels = (n + PANEL - 1) / PANEL, row_block = m > 2 * ROW_BLOCK ? ROW_BLOCK : m;
    gemm_task task = {x, packed, bias, out, m, n, k, panels, row_block};
    spin_pool_run(num_threads, spin_ns, panel_item, &task, (m + row_block - 1) / row_block * panels);
}
