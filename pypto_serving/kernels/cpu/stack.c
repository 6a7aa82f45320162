/* A whole decode step's decoder stack in one call: every layer of a Llama-family model for
 * t single-query sequences, from the token embeddings to the final norm.
 *
 * It runs exactly the kernels (and in the same order, with the same arithmetic) that the
 * model's per-layer Python path calls one by one for a decode step, so its output is the same
 * bit for bit; what it removes is ~15 Python and ctypes round trips per layer.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void qlinear(const float *x, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *s,
             const uint16_t *z, int64_t bits, const float *bias, float *y);
int64_t qlinear_q8(const float *x, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *s,
                   const uint16_t *z, int64_t bits, const float *bias, float *y);
void add_rms_norm(const float *x, float *residual, const float *weight, float eps, int64_t t, int64_t d,
                  float *out);
void silu_and_mul(const float *gate_up, int64_t t, int64_t n, float *out);
void rope_write_kv(float *qkv, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, const float *cos,
                   const float *sin, int64_t ld_cs, const int64_t *slots, void *k_cache, void *v_cache,
                   int64_t kv_half);
void decode_attention(const float *q, int64_t ldq, int64_t b, int64_t heads, int64_t kv_heads, int64_t d,
                      const void *k_cache, const void *v_cache, const int64_t *slots, int64_t max_len,
                      const int64_t *lens, float scale, float *scores, float *out, int64_t kv_half);
int64_t decode_scores_len(int64_t b, int64_t heads, int64_t max_len);

/* A packed linear (see qlinear.c); its output width n_blocks * 16 is the layer's exact width. */
typedef struct {
    const uint8_t *q;
    const uint16_t *scale, *zero;
    const float *bias; /* NULL, or n_blocks * 16 floats */
    int64_t k, n_blocks, bits;
} QLinear;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    QLinear qkv, o, gate_up, down;
    void *k_cache, *v_cache;
} Layer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, kv_half;
    int64_t int8_act; /* the linears quantize their inputs to int8 (qdot.c) */
    float eps, scale;
    const float *final_norm;
} Shape;

/* Returns nonzero when out of memory. */
static int64_t linear(const Shape *sh, const QLinear *w, const float *x, int64_t t, float *y) {
    if (sh->int8_act) return qlinear_q8(x, t, w->k, w->n_blocks, w->q, w->scale, w->zero, w->bits, w->bias, y);
    qlinear(x, t, w->k, w->n_blocks, w->q, w->scale, w->zero, w->bits, w->bias, y);
    return 0;
}

/* x [t, hidden]: the embeddings of the step's tokens (overwritten: it becomes the residual).
 * cos/sin rows [t] with row stride ld_cs; slots [t] where each token's k/v goes; ctx_slots
 * [t, max_len] and lens [t] each sequence's context. out [t, hidden]: final-normed hidden.
 * Returns 0, or -1 when its scratch memory cannot be allocated. */
int64_t decode_stack(const Shape *sh, const Layer *layers, int64_t t, float *x, const float *cos, const float *sin,
                  int64_t ld_cs, const int64_t *slots, const int64_t *ctx_slots, int64_t max_len,
                  const int64_t *lens, float *out) {
    int64_t hidden = sh->hidden, d = sh->head_dim, width = (sh->heads + 2 * sh->kv_heads) * d;
    int64_t attn_width = sh->heads * d;
    size_t floats = (size_t)t * (hidden * 2 + width + attn_width + 3 * sh->intermediate) +
                    (size_t)decode_scores_len(t, sh->heads, max_len);
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return -1;
    float *normed = buf, *qkv = normed + t * hidden, *attn = qkv + t * width, *proj = attn + t * attn_width;
    float *gate_up = proj + t * hidden, *act = gate_up + t * 2 * sh->intermediate;
    float *scores = act + t * sh->intermediate;
    float *residual = x;
    int64_t failed = 0;
    for (int64_t l = 0; l < sh->layers; l++) {
        const Layer *L = layers + l;
        /* layer 0 normalizes the embeddings; later layers add the last MLP output first */
        add_rms_norm(l ? proj : NULL, residual, L->input_norm, sh->eps, t, hidden, normed);
        if ((failed = linear(sh, &L->qkv, normed, t, qkv))) break;
        rope_write_kv(qkv, t, sh->heads, sh->kv_heads, d, cos, sin, ld_cs, slots, L->k_cache, L->v_cache,
                      sh->kv_half);
        decode_attention(qkv, width, t, sh->heads, sh->kv_heads, d, L->k_cache, L->v_cache, ctx_slots, max_len,
                         lens, sh->scale, scores, attn, sh->kv_half);
        if ((failed = linear(sh, &L->o, attn, t, proj))) break;
        add_rms_norm(proj, residual, L->post_norm, sh->eps, t, hidden, normed);
        if ((failed = linear(sh, &L->gate_up, normed, t, gate_up))) break;
        silu_and_mul(gate_up, t, sh->intermediate, act);
        if ((failed = linear(sh, &L->down, act, t, proj))) break;
    }
    if (!failed) add_rms_norm(proj, residual, sh->final_norm, sh->eps, t, hidden, out);
    free(buf);
    return failed ? -1 : 0;
}
