/* One mixture-of-experts layer's experts over a step's tokens, in one call (kernels/moe.py has
 * the portable op and the contract).
 *
 * The routes come grouped by expert, so each expert's packed weights stream from memory once
 * per step, over just the rows routed to it: gather those rows, gate_up, silu-and-mul, down
 * (qlinear.c, or qdot.c with quantized activations), then add each row's output, scaled by
 * its routing weight, into its token's row, experts in ascending order. A row's result does
 * not depend on the other rows of the batch (the linears' arithmetic does not), so a request's
 * tokens do not depend on what it is batched with.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void qlinear(const float *x, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *s,
             const uint16_t *z, int64_t bits, const float *bias, float *y);
int64_t qlinear_q8(const float *x, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *s,
                   const uint16_t *z, int64_t bits, const float *bias, float *y, int64_t planes);
void silu_and_mul(const float *gate_up, int64_t t, int64_t n, float *out);

#define NB 16

/* A packed linear without bias (see qlinear.c); its output is n_blocks * 16 wide. */
typedef struct {
    const uint8_t *q;
    const uint16_t *scale, *zero;
    int64_t k, n_blocks, bits;
} MoeLinear;

/* gate_up [2 inter, hidden] (exactly 2 inter wide: inter % 8 == 0), down [hidden, inter]. */
typedef struct {
    MoeLinear gate_up, down;
} Expert;

static int linear(const MoeLinear *w, const float *x, int64_t m, float *y, int64_t planes) {
    if (!planes) {
        qlinear(x, m, w->k, w->n_blocks, w->q, w->scale, w->zero, w->bits, 0, y);
        return 0;
    }
    return (int)qlinear_q8(x, m, w->k, w->n_blocks, w->q, w->scale, w->zero, w->bits, 0, y, planes);
}

/* x [t, hidden]; routes [offsets[n_experts]]: flat route indices (token * top_k + slot),
 * expert 0's first, then expert 1's, ...; weights [t * top_k]; out [t, hidden], zeroed by the
 * caller, gets the weighted sums. Returns 0, or -1 when out of memory. */
int64_t moe_experts(const float *x, int64_t hidden, int64_t top_k, const Expert *experts, int64_t n_experts,
                    const int64_t *routes, const int64_t *offsets, const float *weights, int64_t planes,
                    float *out) {
    int64_t most = 0, widest = 0;
    for (int64_t e = 0; e < n_experts; e++) {
        int64_t n = offsets[e + 1] - offsets[e], w = experts[e].gate_up.n_blocks * NB;
        if (n > most) most = n;
        if (n && w > widest) widest = w;
    }
    if (!most) return 0;
    int64_t ld_down = (hidden + NB - 1) / NB * NB;
    float *rows = malloc((size_t)most * (hidden + widest + widest / 2 + ld_down) * sizeof(float));
    if (!rows) return -1;
    float *gate_up = rows + most * hidden, *act = gate_up + most * widest, *y = act + most * (widest / 2);
    int failed = 0;
    for (int64_t e = 0; e < n_experts && !failed; e++) {
        const int64_t *mine = routes + offsets[e];
        int64_t n = offsets[e + 1] - offsets[e], inter = experts[e].gate_up.n_blocks * NB / 2;
        if (!n) continue;
        for (int64_t i = 0; i < n; i++) memcpy(rows + i * hidden, x + mine[i] / top_k * hidden, hidden * sizeof(float));
        failed |= linear(&experts[e].gate_up, rows, n, gate_up, planes);
        silu_and_mul(gate_up, n, inter, act);
        failed |= linear(&experts[e].down, act, n, y, planes);
        for (int64_t i = 0; i < n; i++) {
            float w = weights[mine[i]], *dst = out + mine[i] / top_k * hidden;
            const float *src = y + i * ld_down;
            for (int64_t j = 0; j < hidden; j++) dst[j] += w * src[j];
        }
    }
    free(rows);
    return failed ? -1 : 0;
}
