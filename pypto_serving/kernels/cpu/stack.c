/* A whole step's decoder stack in one call: every layer of a Llama-family or Gemma 3 model
 * for the step's t tokens, from the token embeddings to the final norm. The tokens are single-query
 * (decode) rows and prefill chunks, in any mix.
 *
 * It runs exactly the kernels (and in the same order, with the same arithmetic) that the
 * model's per-layer Python path calls one by one, so its output is the same bit for bit; what
 * it removes is ~15 Python and ctypes round trips per layer, and for a prefill chunk the
 * copies of q and of the attention output that the per-layer path makes.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void qlinear(const float *x, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *s,
             const uint16_t *z, int64_t bits, const float *bias, float *y);
int64_t qlinear_q8(const float *x, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *s,
                   const uint16_t *z, int64_t bits, const float *bias, float *y, int64_t planes);
void qgather(const int64_t *ids, int64_t t, int64_t k, const uint8_t *q, const uint16_t *s, const uint16_t *z,
             int64_t bits, float *out);
void add_rms_norm(const float *x, float *residual, const float *weight, float eps, int64_t t, int64_t d,
                  float *out);
void silu_and_mul(const float *gate_up, int64_t t, int64_t n, float *out);
void gelu_tanh_and_mul(const float *gate_up, int64_t t, int64_t n, float *out);
void gemma_rms_norm(const float *x, const float *residual, const float *weight, float eps, int64_t t, int64_t d,
                    float *out);
void gemma_qk_norm(float *qkv, int64_t t, int64_t ld, int64_t heads, int64_t kv_heads, int64_t d,
                   const float *q_weight, const float *k_weight, float eps);
void qk_norm(float *qkv, int64_t t, int64_t ld, int64_t heads, int64_t kv_heads, int64_t d, const float *q_weight,
             const float *k_weight, float eps);
void rope_write_kv(float *qkv, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, const float *cos,
                   const float *sin, int64_t ld_cs, const int64_t *slots, void *k_cache, void *v_cache,
                   int64_t kv_half);
void decode_attention(const float *q, int64_t ldq, int64_t b, int64_t heads, int64_t kv_heads, int64_t d,
                      const void *k_cache, const void *v_cache, const int64_t *slots, int64_t max_len,
                      const int64_t *lens, float scale, float *scores, float *out, int64_t kv_half, int64_t window);
int64_t decode_scores_len(int64_t b, int64_t heads, int64_t max_len);
int64_t prefill_attention(const float *q, int64_t ldq, int64_t n_q, int64_t heads, int64_t kv_heads, int64_t d,
                          const void *k_cache, const void *v_cache, const int64_t *ctx_slots, int64_t n_ctx,
                          float scale, float *out, int64_t kv_half, int64_t window);

/* A packed linear (see qlinear.c); its output width n_blocks * 16 is the layer's exact width. */
typedef struct {
    const uint8_t *q;
    const uint16_t *scale, *zero; /* zero NULL (a symmetric grid: qdot.c computes the zeros) only
                                     where the layer's planes > 0 */
    const float *bias; /* NULL, or n_blocks * 16 floats */
    int64_t k, n_blocks, bits;
} QLinear;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim] each (Qwen3, Gemma 3), or NULL */
    const float *pre_ff_norm, *post_ff_norm; /* [hidden] (Gemma 3), or NULL */
    QLinear qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    int64_t window; /* keys a row sees (a sliding-window layer: its rotary is the step's second
                       cos/sin table, as Gemma 3's), or 0: all */
    int64_t planes; /* what its linears quantize their inputs to: 0 nothing, else qdot.c's planes (1
                       int8, 2 two int8 planes, 3 mixed); layers need not agree (under mixed
                       activations the last layer's take two planes) */
} Layer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, kv_half;
    int64_t gemma; /* Gemma 3's layer: (1 + w) norms, post-norms added to the residual, GeGLU */
    float eps, scale;
    const float *final_norm;
    /* the token embeddings: a packed table (qlinear.c's layout, read by qgather) of `vocab` rows
     * of `hidden`, each row then multiplied by embed_mul (Gemma 3's sqrt(hidden); 0: not) */
    const uint8_t *embed_q;
    const uint16_t *embed_scale, *embed_zero;
    int64_t embed_bits, vocab;
    float embed_mul;
    /* cos and sin per position, [positions, 2, head_dim / 2] (kernels/rotary.py's table); the
     * sliding-window layers' own (Gemma 3), or NULL where no layer has a window */
    const float *rope, *rope_local;
    int64_t positions;
} Shape;

/* A prefill chunk: rows start .. start + n - 1 of the step, the last n of its n_ctx context
 * slots ctx_slots [n_ctx] (a cached prefix and earlier chunks come first). */
typedef struct {
    int64_t start, n;
    const int64_t *ctx_slots;
    int64_t n_ctx;
} Chunk;

/* What each of the step's t rows attends to. slots [t]: where each row's k and v go.
 * Single-query rows: decode_rows [n_decode] (NULL: rows 0 .. n_decode - 1, every row of the
 * step), their context slots ctx_slots [n_decode, max_len] (padded) and lengths lens
 * [n_decode]. Then n_chunks prefill chunks. The rows whose final hidden states the caller
 * reads: out_rows [n_out], strictly ascending within 0 .. t - 1 (n_out < 0: every row; n_out 0:
 * none, out_rows then possibly NULL, as an empty tensor's data pointer is). */
typedef struct {
    int64_t t;
    const int64_t *slots;
    int64_t n_decode;
    const int64_t *decode_rows, *ctx_slots, *lens;
    int64_t max_len, n_chunks;
    const Chunk *chunks;
    int64_t n_out;
    const int64_t *out_rows;
} StepRows;

/* The layout of the structs above, which backends/cpu_stack.py mirrors as ctypes structs and
 * checks against this: per struct, in the order QLinear, Layer, Chunk, StepRows, Shape, its
 * sizeof, then each field's offsetof and size in declaration order, then -1. A field added,
 * moved or resized here shows there as a mismatch instead of as wrong pointers at run time.
 * Writes the first cap values to out (NULL when cap is 0) and returns how many there are. */
#define FIELD(S, f) offsetof(S, f), sizeof(((S *)0)->f)
int64_t stack_layout(int64_t *out, int64_t cap) {
    const int64_t layout[] = {
        sizeof(QLinear), FIELD(QLinear, q), FIELD(QLinear, scale), FIELD(QLinear, zero), FIELD(QLinear, bias),
        FIELD(QLinear, k), FIELD(QLinear, n_blocks), FIELD(QLinear, bits), -1,
        sizeof(Layer), FIELD(Layer, input_norm), FIELD(Layer, post_norm), FIELD(Layer, q_norm),
        FIELD(Layer, k_norm), FIELD(Layer, pre_ff_norm), FIELD(Layer, post_ff_norm), FIELD(Layer, qkv),
        FIELD(Layer, o), FIELD(Layer, gate_up), FIELD(Layer, down), FIELD(Layer, k_cache), FIELD(Layer, v_cache),
        FIELD(Layer, window), FIELD(Layer, planes), -1,
        sizeof(Chunk), FIELD(Chunk, start), FIELD(Chunk, n), FIELD(Chunk, ctx_slots), FIELD(Chunk, n_ctx), -1,
        sizeof(StepRows), FIELD(StepRows, t), FIELD(StepRows, slots), FIELD(StepRows, n_decode),
        FIELD(StepRows, decode_rows), FIELD(StepRows, ctx_slots), FIELD(StepRows, lens),
        FIELD(StepRows, max_len), FIELD(StepRows, n_chunks), FIELD(StepRows, chunks), FIELD(StepRows, n_out),
        FIELD(StepRows, out_rows), -1,
        sizeof(Shape), FIELD(Shape, layers), FIELD(Shape, hidden), FIELD(Shape, heads),
        FIELD(Shape, kv_heads), FIELD(Shape, head_dim), FIELD(Shape, intermediate), FIELD(Shape, kv_half),
        FIELD(Shape, gemma), FIELD(Shape, eps), FIELD(Shape, scale), FIELD(Shape, final_norm),
        FIELD(Shape, embed_q), FIELD(Shape, embed_scale), FIELD(Shape, embed_zero), FIELD(Shape, embed_bits),
        FIELD(Shape, vocab), FIELD(Shape, embed_mul), FIELD(Shape, rope), FIELD(Shape, rope_local),
        FIELD(Shape, positions), -1,
    };
    int64_t n = (int64_t)(sizeof layout / sizeof layout[0]);
    for (int64_t i = 0; i < n && i < cap; i++) out[i] = layout[i];
    return n;
}
#undef FIELD

/* Returns nonzero when out of memory. */
static int64_t linear(const Layer *L, const QLinear *w, const float *x, int64_t t, float *y) {
    if (L->planes) return qlinear_q8(x, t, w->k, w->n_blocks, w->q, w->scale, w->zero, w->bits, w->bias, y,
                                     L->planes);
    qlinear(x, t, w->k, w->n_blocks, w->q, w->scale, w->zero, w->bits, w->bias, y);
    return 0;
}

/* Scratch for the single-query rows when they are not the whole step: their q rows gathered
 * and their outputs, before these go back to their rows. */
typedef struct {
    float *scores, *q, *out;
} DecodeScratch;

/* Every row's attention over the layer's cache (qkv rows [t, width], rotated and written):
 * out [t, heads * d]. Returns nonzero when out of memory. */
static int64_t attend(const Shape *sh, const Layer *L, const StepRows *r, const float *qkv, int64_t width,
                      const DecodeScratch *ds, float *out) {
    int64_t d = sh->head_dim, aw = sh->heads * d;
    if (r->n_decode && !r->decode_rows) {
        decode_attention(qkv, width, r->n_decode, sh->heads, sh->kv_heads, d, L->k_cache, L->v_cache, r->ctx_slots,
                         r->max_len, r->lens, sh->scale, ds->scores, out, sh->kv_half, L->window);
    } else if (r->n_decode) {
        for (int64_t i = 0; i < r->n_decode; i++) memcpy(ds->q + i * aw, qkv + r->decode_rows[i] * width, aw * 4);
        decode_attention(ds->q, aw, r->n_decode, sh->heads, sh->kv_heads, d, L->k_cache, L->v_cache, r->ctx_slots,
                         r->max_len, r->lens, sh->scale, ds->scores, ds->out, sh->kv_half, L->window);
        for (int64_t i = 0; i < r->n_decode; i++) memcpy(out + r->decode_rows[i] * aw, ds->out + i * aw, aw * 4);
    }
    for (int64_t c = 0; c < r->n_chunks; c++) {
        const Chunk *ch = r->chunks + c;
        if (prefill_attention(qkv + ch->start * width, width, ch->n, sh->heads, sh->kv_heads, d, L->k_cache,
                              L->v_cache, ch->ctx_slots, ch->n_ctx, sh->scale, out + ch->start * aw, sh->kv_half,
                              L->window))
            return -1;
    }
    return 0;
}

/* A step's scratch: qkv and attn are dead by the time gate_up and act are written (they share
 * a region), normed and proj hold a layer's norms and projections. */
typedef struct {
    float *normed, *proj, *qkv, *attn, *gate_up, *act;
    DecodeScratch ds;
} Scratch;

/* The rows' attention where only out_rows [n_out] are read on (the last layer's, when the
 * caller reads fewer rows than the step has): each gathered as a single-query row over its own
 * context, a prefill row's being its chunk's context up to itself, into out [n_out, heads * d].
 * decode_attention gives a prefill row exactly what prefill_attention gives it (the prefill
 * tiles repeat its arithmetic), so the rows' results do not change. Returns nonzero when out of
 * memory, -2 when an out row is no row of the description. */
static int64_t attend_out_rows(const Shape *sh, const Layer *L, const StepRows *r, const float *qkv, int64_t width,
                               float *out) {
    int64_t n = r->n_out, d = sh->head_dim, aw = sh->heads * d, longest = 1;
    const int64_t **ctx = malloc(n * sizeof *ctx);
    int64_t *lens = malloc(n * sizeof *lens);
    if (!ctx || !lens) return free(ctx), free(lens), -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t row = r->out_rows[i];
        ctx[i] = NULL, lens[i] = 0;
        for (int64_t j = 0; j < r->n_decode && !ctx[i]; j++)
            if ((r->decode_rows ? r->decode_rows[j] : j) == row)
                ctx[i] = r->ctx_slots + j * r->max_len, lens[i] = r->lens[j];
        for (int64_t c = 0; c < r->n_chunks && !ctx[i]; c++) {
            const Chunk *ch = r->chunks + c;
            if (row >= ch->start && row < ch->start + ch->n)
                ctx[i] = ch->ctx_slots, lens[i] = ch->n_ctx - ch->n + (row - ch->start) + 1;
        }
        if (!ctx[i]) return free(ctx), free(lens), -2; /* not a row of the step's description */
        if (lens[i] > longest) longest = lens[i];
    }
    int64_t *slots = malloc(n * longest * sizeof *slots);
    float *q = malloc(n * aw * sizeof *q), *scores = malloc(decode_scores_len(n, sh->heads, longest) * sizeof *scores);
    int64_t failed = !slots || !q || !scores;
    if (!failed) {
        for (int64_t i = 0; i < n; i++) {
            memcpy(slots + i * longest, ctx[i], lens[i] * sizeof *slots);
            memcpy(q + i * aw, qkv + r->out_rows[i] * width, aw * sizeof *q);
        }
        decode_attention(q, aw, n, sh->heads, sh->kv_heads, d, L->k_cache, L->v_cache, slots, longest, lens,
                         sh->scale, scores, out, sh->kv_half, L->window);
    }
    free(ctx), free(lens), free(slots), free(q), free(scores);
    return failed ? -1 : 0;
}

/* The Llama layer up to its attention: the residual add fused into the norm (layer 0
 * normalizes the embeddings; later layers add the last MLP output first, left in s->proj),
 * then the projection, q/k norms, rotary and the k/v write, for every row. */
static int64_t llama_front(const Shape *sh, const Layer *L, int64_t l, int64_t t, const StepRows *r,
                           float *residual, const float *cos, const float *sin, int64_t ld_cs, const Scratch *s) {
    int64_t hidden = sh->hidden, d = sh->head_dim, width = (sh->heads + 2 * sh->kv_heads) * d;
    add_rms_norm(l ? s->proj : NULL, residual, L->input_norm, sh->eps, t, hidden, s->normed);
    if (linear(L, &L->qkv, s->normed, t, s->qkv)) return -1;
    if (L->q_norm) qk_norm(s->qkv, t, width, sh->heads, sh->kv_heads, d, L->q_norm, L->k_norm, sh->eps);
    rope_write_kv(s->qkv, t, sh->heads, sh->kv_heads, d, cos, sin, ld_cs, r->slots, L->k_cache, L->v_cache,
                  sh->kv_half);
    return 0;
}

/* The Llama layer after its attention (s->attn, t rows): output projection and MLP, whose
 * output is left in s->proj for the next norm. */
static int64_t llama_back(const Shape *sh, const Layer *L, int64_t t, float *residual, const Scratch *s) {
    if (linear(L, &L->o, s->attn, t, s->proj)) return -1;
    add_rms_norm(s->proj, residual, L->post_norm, sh->eps, t, sh->hidden, s->normed);
    if (linear(L, &L->gate_up, s->normed, t, s->gate_up)) return -1;
    silu_and_mul(s->gate_up, t, sh->intermediate, s->act);
    return linear(L, &L->down, s->act, t, s->proj);
}

/* Gemma 3's layer up to its attention: each block's output is normed before it joins the
 * residual, and the MLP has a norm before it too; the kernels and their order are
 * Gemma3DecoderLayer's. */
static int64_t gemma_front(const Shape *sh, const Layer *L, int64_t t, const StepRows *r, const float *residual,
                           const float *cos, const float *sin, int64_t ld_cs, const Scratch *s) {
    int64_t d = sh->head_dim, width = (sh->heads + 2 * sh->kv_heads) * d;
    gemma_rms_norm(residual, NULL, L->input_norm, sh->eps, t, sh->hidden, s->normed);
    if (linear(L, &L->qkv, s->normed, t, s->qkv)) return -1;
    gemma_qk_norm(s->qkv, t, width, sh->heads, sh->kv_heads, d, L->q_norm, L->k_norm, sh->eps);
    rope_write_kv(s->qkv, t, sh->heads, sh->kv_heads, d, cos, sin, ld_cs, r->slots, L->k_cache, L->v_cache,
                  sh->kv_half);
    return 0;
}

static int64_t gemma_back(const Shape *sh, const Layer *L, int64_t t, float *residual, const Scratch *s) {
    int64_t hidden = sh->hidden;
    if (linear(L, &L->o, s->attn, t, s->proj)) return -1;
    gemma_rms_norm(s->proj, residual, L->post_norm, sh->eps, t, hidden, residual);
    gemma_rms_norm(residual, NULL, L->pre_ff_norm, sh->eps, t, hidden, s->normed);
    if (linear(L, &L->gate_up, s->normed, t, s->gate_up)) return -1;
    gelu_tanh_and_mul(s->gate_up, t, sh->intermediate, s->act);
    if (linear(L, &L->down, s->act, t, s->proj)) return -1;
    gemma_rms_norm(s->proj, residual, L->post_ff_norm, sh->eps, t, hidden, residual);
    return 0;
}

/* The step's t tokens ids [t] at positions [t]. x [t, hidden]: scratch for their embeddings
 * (they become the residual). out: final-normed hidden, [t, hidden], or with r->n_out >= 0 the
 * out rows' [n_out, hidden] in their order. Then the last layer runs past its k/v write for those
 * rows only (no other row's hidden state is read on: a prefill chunk's rows but its last, or all
 * of a chunk that does not end its prompt): per row the same arithmetic, so the same results.
 * Returns 0, -1 when its scratch memory cannot be allocated, -2 when out_rows is not strictly
 * ascending within 0 .. t - 1 (or names a row the description does not), -3 when an id is not
 * in the vocabulary or a position not in the rotary table. */
int64_t step_stack(const Shape *sh, const Layer *layers, const StepRows *r, const int64_t *ids,
                   const int64_t *positions, float *x, float *out) {
    int64_t t = r->t, hidden = sh->hidden, d = sh->head_dim, width = (sh->heads + 2 * sh->kv_heads) * d;
    int64_t n_out = r->n_out < 0 ? -1 : r->n_out; /* -1: every row, in place */
    if (n_out > t) return -2;
    for (int64_t i = 0; i < n_out; i++)
        if (r->out_rows[i] < (i ? r->out_rows[i - 1] + 1 : 0) || r->out_rows[i] >= t) return -2;
    if (n_out == t) n_out = -1; /* ascending and t of them: every row */
    for (int64_t i = 0; i < t; i++)
        if (ids[i] < 0 || ids[i] >= sh->vocab || positions[i] < 0 || positions[i] >= sh->positions)
            return -3;
    int64_t attn_width = sh->heads * d, gathered = r->decode_rows ? r->n_decode * attn_width : 0;
    int64_t shared = width + attn_width > 3 * sh->intermediate ? width + attn_width : 3 * sh->intermediate;
    int64_t tables = sh->rope_local ? 2 : 1; /* each row's cos and sin, per rotary table */
    size_t floats = (size_t)t * (hidden * 2 + shared + tables * d) + 2 * gathered +
                    (size_t)decode_scores_len(r->n_decode, sh->heads, r->max_len);
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return -1;
    Scratch s = {buf, buf + t * hidden, buf + 2 * t * hidden, 0, 0, 0, {0, 0, 0}};
    s.attn = s.qkv + t * width;
    s.gate_up = s.qkv;
    s.act = s.gate_up + t * 2 * sh->intermediate;
    s.ds.scores = s.qkv + t * shared;
    s.ds.q = s.ds.scores + decode_scores_len(r->n_decode, sh->heads, r->max_len);
    s.ds.out = s.ds.q + gathered;
    /* the rows' cos | sin, [t, d] a table, after everything else: one row each from the
     * table at the row's position (as rotary_cos_sin gathers them for the per-layer path) */
    float *cos = s.ds.out + gathered, *cos2 = sh->rope_local ? cos + t * d : NULL;
    for (int64_t i = 0; i < t; i++) {
        memcpy(cos + i * d, sh->rope + positions[i] * d, d * sizeof(float));
        if (cos2) memcpy(cos2 + i * d, sh->rope_local + positions[i] * d, d * sizeof(float));
    }
    const float *sin = cos + d / 2, *sin2 = cos2 ? cos2 + d / 2 : NULL;
    const int64_t ld_cs = d;
    qgather(ids, t, hidden, sh->embed_q, sh->embed_scale, sh->embed_zero, sh->embed_bits, x);
    if (sh->embed_mul != 0.0f)
        for (int64_t i = 0; i < t * hidden; i++) x[i] *= sh->embed_mul;
    float *residual = x;
    int64_t failed = 0, rows = n_out >= 0 ? n_out : t;
    for (int64_t l = 0; l < sh->layers && !failed; l++) {
        const Layer *L = layers + l;
        const float *c = L->window ? cos2 : cos, *sn = L->window ? sin2 : sin;
        failed = sh->gemma ? gemma_front(sh, L, t, r, residual, c, sn, ld_cs, &s)
                           : llama_front(sh, L, l, t, r, residual, c, sn, ld_cs, &s);
        if (failed) break;
        if (l == sh->layers - 1 && n_out >= 0) {
            if (n_out == 0) break; /* only the k/v write was wanted */
            failed = attend_out_rows(sh, L, r, s.qkv, width, s.attn);
            /* the out rows' residuals to rows 0 .. n_out - 1: ascending, so none is overwritten
             * before it is read */
            for (int64_t i = 0; i < n_out && !failed; i++)
                if (r->out_rows[i] != i) memcpy(residual + i * hidden, residual + r->out_rows[i] * hidden,
                                                hidden * sizeof(float));
        } else {
            failed = attend(sh, L, r, s.qkv, width, &s.ds, s.attn);
        }
        int64_t n = l == sh->layers - 1 ? rows : t;
        if (!failed) failed = sh->gemma ? gemma_back(sh, L, n, residual, &s) : llama_back(sh, L, n, residual, &s);
    }
    if (!failed && rows && sh->gemma) gemma_rms_norm(residual, NULL, sh->final_norm, sh->eps, rows, hidden, out);
    else if (!failed && rows) add_rms_norm(s.proj, residual, sh->final_norm, sh->eps, rows, hidden, out);
    free(buf);
    return failed == -2 ? -2 : failed ? -1 : 0;
}
