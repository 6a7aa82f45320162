/* The small per-layer kernels of a decoder layer, fused, for x86-64 with AVX2 + FMA: at batch
 * 1 a layer is ~60 tiny torch ops whose dispatch costs more than their arithmetic. Also the
 * paged attention of decode and prefill rows, one routine for both.
 * All float32, row-major; every row (token, or sequence for attention) is computed on its
 * own, so results do not depend on the batch.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "group_max.h"
#include "prefetch.h"
#include "vexp.h"
#include "vnni.h"

#define INLINE_LOAD static inline __attribute__((always_inline))
#define MAX_HEAD_DIM 256 /* the attention keeps 8 keys of up to this many floats on the stack */

/* Rows above which the norms and rotary split over the threads (a row is well under a
 * microsecond of work): at 16 rows, splitting them took a SmolLM2 batch-16 decode step ~2% less
 * time than keeping them on one thread while the other waited (2026-12-03, alternating). */
#define ROWS_PARALLEL 4

/* [sum of v[0], ..., sum of v[7]] */
static inline __m256 hsum8x8(const __m256 *v) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* residual += x (when x is given), out = rms_norm(residual) * weight; d % 8 == 0. */
void add_rms_norm(const float *x, float *residual, const float *weight, float eps, int64_t t, int64_t d,
                  float *out) {
#pragma omp parallel for schedule(static) if (t > ROWS_PARALLEL)
    for (int64_t i = 0; i < t; i++) {
        float *r = residual + i * d;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j += 8) {
            __m256 v = _mm256_loadu_ps(r + j);
            if (x) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(x + i * d + j));
                _mm256_storeu_ps(r + j, v);
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8f(ss) / (float)d + eps));
        for (int64_t j = 0; j < d; j += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(r + j), inv);
            _mm256_storeu_ps(out + i * d + j, _mm256_mul_ps(v, _mm256_loadu_ps(weight + j)));
        }
    }
}

/* 8 weights of a norm from column j: weight, or with plus_one Gemma's 1 + weight (rounded to
 * float32 first, as transformers has it). */
INLINE_LOAD __m256 norm_weight(const float *weight, int64_t j, const int plus_one) {
    __m256 w = _mm256_loadu_ps(weight + j);
    return plus_one ? _mm256_add_ps(w, _mm256_set1_ps(1.0f)) : w;
}

/* 1 / rms of a row of d floats, as add_rms_norm computes it. */
INLINE_LOAD __m256 inverse_rms(const float *r, int64_t d, float eps) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8) {
        __m256 v = _mm256_loadu_ps(r + j);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    return _mm256_set1_ps(1.0f / sqrtf(hsum8f(ss) / (float)d + eps));
}

/* n rows of d floats, in place: x = rms_norm(x) * weight (or * (1 + weight) with plus_one),
 * each row as add_rms_norm does one. */
INLINE_LOAD void rms_norm_rows(float *x, int64_t n, int64_t d, const float *weight, float eps, const int plus_one) {
    for (int64_t h = 0; h < n; h++) {
        float *r = x + h * d;
        __m256 inv = inverse_rms(r, d, eps);
        for (int64_t j = 0; j < d; j += 8)
            _mm256_storeu_ps(r + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(r + j), inv),
                                                  norm_weight(weight, j, plus_one)));
    }
}

/* Gemma's norm, scaled by (1 + weight): out = rms_norm(x) * (1 + weight), plus residual when
 * given (the post-norms' residual add); x [t, d], d % 8 == 0; out may be x. */
void gemma_rms_norm(const float *x, const float *residual, const float *weight, float eps, int64_t t, int64_t d,
                    float *out) {
#pragma omp parallel for schedule(static) if (t > ROWS_PARALLEL)
    for (int64_t i = 0; i < t; i++) {
        const float *r = x + i * d;
        __m256 inv = inverse_rms(r, d, eps);
        for (int64_t j = 0; j < d; j += 8) {
            __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(r + j), inv), norm_weight(weight, j, 1));
            if (residual) v = _mm256_add_ps(_mm256_loadu_ps(residual + i * d + j), v);
            _mm256_storeu_ps(out + i * d + j, v);
        }
    }
}

/* q/k norms inside the fused projection, in place: rows [t] of row stride ld, each holding q
 * heads [heads, d] then k heads [kv_heads, d] (then v, untouched); d % 8 == 0. */
INLINE_LOAD void qk_norm_rows(float *qkv, int64_t t, int64_t ld, int64_t heads, int64_t kv_heads, int64_t d,
                              const float *q_weight, const float *k_weight, float eps, const int plus_one) {
#pragma omp parallel for schedule(static) if (t > ROWS_PARALLEL)
    for (int64_t i = 0; i < t; i++) {
        rms_norm_rows(qkv + i * ld, heads, d, q_weight, eps, plus_one);
        rms_norm_rows(qkv + i * ld + heads * d, kv_heads, d, k_weight, eps, plus_one);
    }
}

/* Qwen3's */
void qk_norm(float *qkv, int64_t t, int64_t ld, int64_t heads, int64_t kv_heads, int64_t d, const float *q_weight,
             const float *k_weight, float eps) {
    qk_norm_rows(qkv, t, ld, heads, kv_heads, d, q_weight, k_weight, eps, 0);
}

/* Gemma 3's, scaled by (1 + weight) */
void gemma_qk_norm(float *qkv, int64_t t, int64_t ld, int64_t heads, int64_t kv_heads, int64_t d,
                   const float *q_weight, const float *k_weight, float eps) {
    qk_norm_rows(qkv, t, ld, heads, kv_heads, d, q_weight, k_weight, eps, 1);
}

/* Activations split over the threads from this many outputs (~5 us of work; a decode step's
 * 16 rows of SmolLM2's 1536 took 10 us on one thread). */
#define ACT_PARALLEL 8192

/* gate_up [t, 2 * n] -> out [t, n] = silu(gate) * up; n % 8 == 0. */
void silu_and_mul(const float *gate_up, int64_t t, int64_t n, float *out) {
#pragma omp parallel for schedule(static) if (t * n >= ACT_PARALLEL)
    for (int64_t i = 0; i < t; i++) {
        const float *g = gate_up + i * 2 * n, *u = g + n;
        for (int64_t j = 0; j < n; j += 8) {
            __m256 v = _mm256_loadu_ps(g + j);
            __m256 neg_abs = _mm256_or_ps(v, _mm256_set1_ps(-0.0f));
            __m256 e = exp8(neg_abs); /* exp(-|v|): no overflow */
            __m256 one = _mm256_set1_ps(1.0f);
            /* sigmoid(v) = 1 / (1 + exp(-v)) = v >= 0 ? 1 / (1 + e) : e / (1 + e) */
            __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ)),
                                       _mm256_add_ps(one, e));
            _mm256_storeu_ps(out + i * n + j, _mm256_mul_ps(_mm256_mul_ps(v, sig), _mm256_loadu_ps(u + j)));
        }
    }
}

/* gate_up [t, 2 * n] -> out [t, n] = gelu_tanh(gate) * up (Gemma's GeGLU); n % 8 == 0.
 * gelu_tanh(v) = v / 2 * (1 + tanh(u)) = v * sigmoid(2 u), u = sqrt(2 / pi) (v + 0.044715 v^3). */
void gelu_tanh_and_mul(const float *gate_up, int64_t t, int64_t n, float *out) {
#pragma omp parallel for schedule(static) if (t * n >= ACT_PARALLEL)
    for (int64_t i = 0; i < t; i++) {
        const float *g = gate_up + i * 2 * n, *u = g + n;
        for (int64_t j = 0; j < n; j += 8) {
            __m256 v = _mm256_loadu_ps(g + j), one = _mm256_set1_ps(1.0f);
            __m256 cube = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
            __m256 u2 = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f),
                                      _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, v));
            __m256 e = exp8(_mm256_or_ps(u2, _mm256_set1_ps(-0.0f))); /* exp(-|2u|): no overflow */
            __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, _mm256_cmp_ps(u2, _mm256_setzero_ps(), _CMP_LT_OQ)),
                                       _mm256_add_ps(one, e));
            _mm256_storeu_ps(out + i * n + j, _mm256_mul_ps(_mm256_mul_ps(v, sig), _mm256_loadu_ps(u + j)));
        }
    }
}

/* Rotate-half rotary on heads [t, heads, d] (row stride ld), cos/sin [t, d / 2]; in place. */
static void rotate(float *x, int64_t ld, int64_t heads, int64_t d, const float *cos, const float *sin) {
    int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *a = x + h * d, *b = a + half;
        for (int64_t j = 0; j < half; j += 8) {
            __m256 c = _mm256_loadu_ps(cos + j), s = _mm256_loadu_ps(sin + j);
            __m256 va = _mm256_loadu_ps(a + j), vb = _mm256_loadu_ps(b + j);
            _mm256_storeu_ps(a + j, _mm256_fmsub_ps(va, c, _mm256_mul_ps(vb, s)));
            _mm256_storeu_ps(b + j, _mm256_fmadd_ps(vb, c, _mm256_mul_ps(va, s)));
        }
    }
    (void)ld;
}

/* Stores n floats (n % 8 == 0) as float32 or, with half, as float16. */
static void store_kv(void *dst, const float *src, int64_t n, int half) {
    if (!half) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    for (int64_t j = 0; j < n; j += 8)
        _mm_storeu_si128((__m128i *)((uint16_t *)dst + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
}

INLINE_LOAD __m256 load_kv(const void *base, int64_t index, int half) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + index)));
    return _mm256_loadu_ps((const float *)base + index);
}

/* qkv [t, (heads + 2 kv_heads) d]: rotates q and k in place, then stores k and v at their
 * slots of the caches [slots, kv_heads, d] (float32, or float16 with kv_half). */
void rope_write_kv(float *qkv, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, const float *cos,
                   const float *sin, int64_t ld_cs, const int64_t *slots, void *k_cache, void *v_cache,
                   int64_t kv_half) {
    int64_t ld = (heads + 2 * kv_heads) * d, kv = kv_heads * d, esize = kv_half ? 2 : 4;
#pragma omp parallel for schedule(static) if (t > ROWS_PARALLEL)
    for (int64_t i = 0; i < t; i++) {
        float *row = qkv + i * ld;
        rotate(row, ld, heads + kv_heads, d, cos + i * ld_cs, sin + i * ld_cs);
        store_kv((char *)k_cache + slots[i] * kv * esize, row + heads * d, kv, (int)kv_half);
        store_kv((char *)v_cache + slots[i] * kv * esize, row + (heads + kv_heads) * d, kv, (int)kv_half);
    }
}

/* The largest of s [n]. */
static inline float scores_max(const float *s, int64_t n) {
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    int64_t l = 0;
    for (; l + 8 <= n; l += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + l));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    for (; l < n; l++) mx = s[l] > mx ? s[l] : mx;
    return mx;
}

/* s [l .. l + 7] = exp(s - mx) in place; returns vsum + them (the sum's 8 chains). */
static inline __m256 exp_block8(float *s, int64_t l, float mx, __m256 vsum) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(s + l, e);
    return _mm256_add_ps(vsum, e);
}

/* The last keys l .. n - 1 (fewer than 8) one at a time, after the chains' sum. */
static inline float softmax_tail(float *s, int64_t l, int64_t n, float mx, __m256 vsum) {
    float sum = hsum8f(vsum);
    for (; l < n; l++) {
        s[l] = expf(s[l] - mx);
        sum += s[l];
    }
    return sum;
}

/* Softmax of s [n] in place, unnormalized: returns the sum to divide by. */
static inline float softmax_in_place(float *s, int64_t n) {
    const float mx = scores_max(s, n);
    __m256 vsum = _mm256_setzero_ps();
    int64_t l = 0;
    for (; l + 8 <= n; l += 8) vsum = exp_block8(s, l, mx, vsum);
    return softmax_tail(s, l, n, mx, vsum);
}

#define PREFETCH_KEYS 16 /* keys ahead whose vectors are fetched by hand */

/* Vectors to fetch a cache line at a time while other work runs (key l's vector lies at base +
 * slots[l] * row; base NULL: nothing to fetch). Decode attention is bound by memory, and its
 * softmax and value passes read nothing new: fetching the next task's keys then, and this
 * task's values while its scores are computed, keeps the reads going the whole time. These
 * go to L2 (T1): a task's hundreds of lines fetched into L1 held its few miss buffers, and
 * a batch-16 step's attention then cost its compute plus its memory time (at SmolLM2's shape
 * 5.2 ms against 3.5 with T1, 2.2 with the caches hot). */
typedef struct {
    const char *base;
    const int64_t *slots;
    int64_t n, row, vec;
    int64_t l, off; /* the next line: key l, byte off of its vector */
} Ahead;

INLINE_LOAD void ahead_step(Ahead *a, int lines) {
    for (int c = 0; c < lines && a->l < a->n; c++) {
        _mm_prefetch(a->base + a->slots[a->l] * a->row + a->off, _MM_HINT_T1);
        a->off += 64;
        if (a->off >= a->vec) a->off = 0, a->l++;
    }
}

/* out[h][j0 .. j0 + 8 w) for c (<= 3) heads, w (<= 4) vectors of 8 (both constants after
 * inlining): the sum over the context of p[h][l] * v[l], one fma chain per element in
 * context order (3 x 4 accumulators, 3 weights and a value fill the 16 registers). With
 * prefetch, the values PREFETCH_KEYS further on are fetched by hand (a sequence's blocks lie
 * anywhere in the cache, so the hardware prefetcher loses the trail at every block); a line
 * of `ahead` per key. */
INLINE_LOAD void weigh_values(const float *p, int64_t ld_p, const int c, const void *v_cache, const int64_t *slots,
                              int64_t n, int64_t kv_stride, int64_t j0, const int w, const float *inv, float *out,
                              int64_t d, const int half, const int prefetch, Ahead *ahead) {
    const char *v_bytes = v_cache;
    int64_t row = kv_stride * (half ? 2 : 4), vec = d * (half ? 2 : 4);
    __m256 acc[3][4];
    for (int h = 0; h < c; h++)
        for (int x = 0; x < w; x++) acc[h][x] = _mm256_setzero_ps();
    for (int64_t l = 0; l < n; l++) {
        if (prefetch && l + PREFETCH_KEYS < n) prefetch_bytes(v_bytes + slots[l + PREFETCH_KEYS] * row, vec);
        if (ahead->base) ahead_step(ahead, 1);
        __m256 ph[3];
        for (int h = 0; h < c; h++) ph[h] = _mm256_set1_ps(p[h * ld_p + l]);
        for (int x = 0; x < w; x++) {
            __m256 v = load_kv(v_cache, slots[l] * kv_stride + j0 + 8 * x, half);
            for (int h = 0; h < c; h++) acc[h][x] = _mm256_fmadd_ps(ph[h], v, acc[h][x]);
        }
    }
    for (int h = 0; h < c; h++) {
        __m256 s = _mm256_set1_ps(inv[h]);
        for (int x = 0; x < w; x++) _mm256_storeu_ps(out + h * d + j0 + 8 * x, _mm256_mul_ps(acc[h][x], s));
    }
}

/* Keys l .. l + 7 as float, kb[u * d + j]; those at n and beyond are zeros (their scores are
 * computed and never read). The keys PREFETCH_KEYS further on are fetched by hand. With pairs
 * (the AVX-512 scores), kb[(p * d / 8 + s) * 16 ..] holds elements 8 s .. 8 s + 7 of key
 * l + 2 p, then of key l + 2 p + 1. */
INLINE_LOAD void load_keys8(float *kb, const void *k_cache, const int64_t *slots, int64_t l, int64_t n,
                            int64_t kv_stride, int64_t d, const int half, const int pairs) {
    const char *k_bytes = k_cache;
    int64_t row = kv_stride * (half ? 2 : 4), vec = d * (half ? 2 : 4);
    for (int64_t u = l + PREFETCH_KEYS; u < l + PREFETCH_KEYS + 8 && u < n; u++)
        prefetch_bytes(k_bytes + slots[u] * row, vec);
    for (int u = 0; u < 8; u++)
        for (int64_t j = 0; j < d; j += 8)
            _mm256_store_ps(kb + (pairs ? ((u / 2) * (d / 8) + j / 8) * 16 + (u % 2) * 8 : u * d + j),
                            l + u < n ? load_kv(k_cache, slots[l + u] * kv_stride + j, half) : _mm256_setzero_ps());
}

/* Scores of heads q[0 .. g) against the 8 keys in kb, into scores[h][l .. l + 7]: 8
 * independent fma chains, then one transposing sum (a single chain per key would wait on the
 * fma latency at every step). A key's score depends only on its own chain. */
INLINE_LOAD void score_keys8(const float *q, int64_t g, const float *kb, int64_t d, float scale, float *scores,
                             int64_t ld_scores, int64_t l) {
    for (int64_t h = 0; h < g; h++) {
        __m256 acc[8];
        for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j += 8) {
            __m256 qj = _mm256_loadu_ps(q + h * d + j);
            for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(qj, _mm256_load_ps(kb + u * d + j), acc[u]);
        }
        _mm256_storeu_ps(scores + h * ld_scores + l, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
    }
}

/* CALL(C, W) for heads c (1 .. 3) and vectors w (1 .. 4) as constants, so that each pairing
 * inlines with its accumulators in registers (the value passes). */
#define WITH_CONSTANTS(c, w, CALL)                                                                     \
    switch ((c) * 4 + (w)) {                                                                           \
    case 5: CALL(1, 1); break;                                                                         \
    case 6: CALL(1, 2); break;                                                                         \
    case 7: CALL(1, 3); break;                                                                         \
    case 8: CALL(1, 4); break;                                                                         \
    case 9: CALL(2, 1); break;                                                                         \
    case 10: CALL(2, 2); break;                                                                        \
    case 11: CALL(2, 3); break;                                                                        \
    case 12: CALL(2, 4); break;                                                                        \
    case 13: CALL(3, 1); break;                                                                        \
    case 14: CALL(3, 2); break;                                                                        \
    case 15: CALL(3, 3); break;                                                                        \
    default: CALL(3, 4);                                                                               \
    }

/* The rest of attention over n keys once their scores are in: softmax, and out[h] = p[h] @ v,
 * 32 elements of 3 heads at a time (12 independent fma chains, all in registers); `ahead`
 * moves a line per key and pass. */
INLINE_LOAD void finish_heads(int64_t g, const void *v_cache, const int64_t *slots, int64_t n, int64_t kv_stride,
                              int64_t d, float *scores, int64_t ld_scores, float *out, const int half,
                              const int prefetch, Ahead *ahead) {
    float inv[g];
    for (int64_t h = 0; h < g; h++) inv[h] = 1.0f / softmax_in_place(scores + h * ld_scores, n);
    for (int64_t h = 0; h < g; h += 3) {
        const float *p = scores + h * ld_scores;
        int c = g - h < 3 ? (int)(g - h) : 3;
        for (int64_t j0 = 0; j0 < d; j0 += 32) {
            int w = d - j0 < 32 ? (int)(d - j0) / 8 : 4, pf = prefetch && j0 == 0;
#define WEIGH(C, W) \
    weigh_values(p, ld_scores, C, v_cache, slots, n, kv_stride, j0, W, inv + h, out + h * d, d, half, pf, ahead)
            WITH_CONSTANTS(c, w, WEIGH);
#undef WEIGH
        }
    }
}

/* score_keys8's arithmetic for keys l .. l + 3 and c (<= 3, a constant after inlining) heads,
 * reading the keys straight from the cache: 12 independent fma chains, and per key the same
 * chain and the same transposing sum, so the scores are score_keys8's bit for bit. Keys at n
 * and beyond read key l's vector; their scores are never read. */
INLINE_LOAD void score_keys4(const float *q, const int c, const void *k_cache, const int64_t *slots, int64_t l,
                             int64_t n, int64_t kv_stride, int64_t d, float scale, float *scores, int64_t ld_scores,
                             const int half) {
    const char *k_bytes = k_cache;
    int64_t row = kv_stride * (half ? 2 : 4), vec = d * (half ? 2 : 4), base[4];
    for (int64_t u = l + PREFETCH_KEYS; u < l + PREFETCH_KEYS + 4 && u < n; u++)
        prefetch_bytes(k_bytes + slots[u] * row, vec);
    for (int u = 0; u < 4; u++) base[u] = slots[l + u < n ? l + u : l] * kv_stride;
    __m256 acc[3][4];
    for (int h = 0; h < c; h++)
        for (int u = 0; u < 4; u++) acc[h][u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8)
        for (int u = 0; u < 4; u++) {
            __m256 k = load_kv(k_cache, base[u] + j, half);
            for (int h = 0; h < c; h++) acc[h][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + j), k, acc[h][u]);
        }
    for (int h = 0; h < c; h++) {
        __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(acc[h][0], acc[h][1]), _mm256_hadd_ps(acc[h][2], acc[h][3]));
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        _mm_storeu_ps(scores + h * ld_scores + l, _mm_mul_ps(s, _mm_set1_ps(scale)));
    }
}

/* Scores of c (1 .. 3) heads q against keys l0 .. l1 - 1 of n, 4 at a time (l0 a multiple of
 * 4): score_keys4 with c a constant in each branch. */
INLINE_LOAD void score_range(const float *q, const int c, const void *k_cache, const int64_t *slots, int64_t l0,
                             int64_t l1, int64_t n, int64_t kv_stride, int64_t d, float scale, float *scores,
                             int64_t ld_scores, const int half) {
    for (int64_t l = l0; l < l1; l += 4) {
        if (c == 3) score_keys4(q, 3, k_cache, slots, l, n, kv_stride, d, scale, scores, ld_scores, half);
        else if (c == 2) score_keys4(q, 2, k_cache, slots, l, n, kv_stride, d, scale, scores, ld_scores, half);
        else score_keys4(q, 1, k_cache, slots, l, n, kv_stride, d, scale, scores, ld_scores, half);
    }
}

/* Query heads q[0 .. g) (d floats apart) of one sequence, sharing one kv head, over a context
 * of n slots: out[h] [d] = softmax(q[h] . k * scale) @ v; scores [g][ld_scores] scratch,
 * ld_scores >= n rounded up to 8. A key vector is read once for up to 3 heads. Per head, the
 * arithmetic and its order depend only on its query and its n keys: neither grouping heads
 * nor `attend_rows`'s tiling changes a result. With `next` (the next task's keys, or base
 * NULL for none) the values are fetched while the scores are computed, and `next` while the
 * values are weighed. */
INLINE_LOAD void attend_heads(const float *q, int64_t g, const void *k_cache, const void *v_cache,
                              const int64_t *slots, int64_t n, int64_t kv_stride, int64_t d, float scale,
                              float *scores, int64_t ld_scores, float *out, const int half, Ahead *next) {
    int64_t vec = d * (half ? 2 : 4), lines = 4 * ((vec + 63) / 64);
    Ahead values = {next->base ? v_cache : NULL, slots, n, kv_stride * (half ? 2 : 4), vec, 0, 0};
    for (int64_t h = 0; h < g; h += 3) {
        const float *qh = q + h * d;
        float *sh = scores + h * ld_scores;
        int c = g - h < 3 ? (int)(g - h) : 3;
        for (int64_t l = 0; l < n; l += 4) {
            if (values.base) ahead_step(&values, (int)lines);
            score_range(qh, c, k_cache, slots, l, l + 4, n, kv_stride, d, scale, sh, ld_scores, half);
        }
    }
    finish_heads(g, v_cache, slots, n, kv_stride, d, scores, ld_scores, out, half, !values.base, next);
}

/* The first of the n keys up to a query that it sees: with a sliding window (window > 0) the
 * last `window` of them, itself included, else all. */
static inline int64_t first_key(int64_t n, int64_t window) { return window && n > window ? n - window : 0; }

/* attend_heads for `rows` consecutive query rows of one sequence (q rows ldq apart, out rows
 * ldo apart) over keys first_key(n0 + r + 1, window) .. n0 + r each (r = 0 .. rows - 1, a causal
 * prefill tile): a block of 8 keys is converted once for the whole tile; scores
 * [rows][g][ld_scores], a key's at its position. A row's softmax and values start at its first
 * key, as decode_attention's do over the same keys, so the two agree bit for bit. The keys and
 * values of a prompt are still in cache when its chunk attends, so values are not prefetched. */
INLINE_LOAD void attend_rows(const float *q, int64_t ldq, int64_t rows, int64_t n0, int64_t g, const void *k_cache,
                             const void *v_cache, const int64_t *slots, int64_t kv_stride, int64_t d, float scale,
                             float *scores, int64_t ld_scores, float *out, int64_t ldo, const int half,
                             int64_t window) {
    float kb[8 * MAX_HEAD_DIM] __attribute__((aligned(32)));
    int64_t n_max = n0 + rows;
    /* Blocks start at multiples of 8, as the score rows' length does. A row that sees none of a
     * block's keys scores them anyway: its scores there are never read. */
    for (int64_t l = first_key(n0 + 1, window) / 8 * 8; l < n_max; l += 8) {
        load_keys8(kb, k_cache, slots, l, n_max, kv_stride, d, half, 0);
        for (int64_t r = l < n0 + 1 ? 0 : l - n0; r < rows; r++) /* rows with a key in l .. l + 7 */
            score_keys8(q + r * ldq, g, kb, d, scale, scores + r * g * ld_scores, ld_scores, l);
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t first = first_key(n0 + r + 1, window);
        finish_heads(g, v_cache, slots + first, n0 + r + 1 - first, kv_stride, d, scores + r * g * ld_scores + first,
                     ld_scores, out + r * ldo, half, 0, &(Ahead){0});
    }
}

/* ---- AVX-512: prefill rows ----
 * Where the VNNI tiles run (use_vnni: the CPU has AVX-512 F, BW and VL besides), a prefill
 * tile takes 512-bit registers with the same arithmetic lane for lane, so its rows still equal
 * decode_attention's bit for bit. Scores: a register holds two keys' 8-lane chains (key 2p in
 * the low half, 2p + 1 in the high), whose halves then meet score_keys8's transposing sum;
 * values: a 16-lane chain per element in context order, as weigh_values' 8-lane ones. A
 * prefill's attention is bound by its fmas and conversions (its keys and values are in
 * cache), and takes ~17% less time so (SmolLM2, 512 rows). Decode attention stays on 256-bit
 * registers: there the same change gained nothing (it waits on memory as much as on its fmas). */

/* 16 elements of a cache row from index (float16 or float32), those outside `m` zero. */
VNNI_INLINE __m512 load_kv16(const void *base, int64_t index, const int half, __mmask16 m) {
    if (half) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)base + index));
    return _mm512_maskz_loadu_ps(m, (const float *)base + index);
}

/* The 8 floats at p in both halves. */
VNNI_INLINE __m512 broadcast8(const float *p) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

/* Per 128-bit lane [a0 + a1, a2 + a3, b0 + b1, b2 + b3]: _mm256_hadd_ps's sums, lane for lane. */
VNNI_INLINE __m512 pair_sums(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Scores of c (<= 3) heads against 8 keys from their 4 pair sums acc[h][p], into scores[h][l
 * .. l + 7]: score_keys8's transposing sum, the same additions of the same operands, on whole
 * registers (hsum8x8 on the halves took a third of a prefill's score time in extracts and
 * hadds). Per key k, x its 8 lanes: ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)). */
VNNI_INLINE void store_scores8(__m512 acc[][4], const int c, float scale, float *scores, int64_t ld_scores,
                               int64_t l) {
    /* lanes 0-3: keys 0, 2, 4, 6; lanes 8-11: keys 1, 3, 5, 7 */
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int h = 0; h < c; h++) {
        /* 128-bit lanes of acc[h][p]: key 2p's x0-3, x4-7, then key 2p + 1's */
        __m512 quads = pair_sums(pair_sums(acc[h][0], acc[h][1]), pair_sums(acc[h][2], acc[h][3]));
        /* lanes: (x0-3 of keys 0, 2, 4, 6), (x4-7 of them), (x0-3 of keys 1, 3, 5, 7), (x4-7) */
        __m512 sums = _mm512_add_ps(quads, _mm512_shuffle_f32x4(quads, quads, _MM_SHUFFLE(2, 3, 0, 1)));
        __m256 keys = _mm512_castps512_ps256(_mm512_permutexvar_ps(order, sums));
        _mm256_storeu_ps(scores + h * ld_scores + l, _mm256_mul_ps(keys, _mm256_set1_ps(scale)));
    }
}

DEFINE_EXP(exp16, VNNI_INLINE, __m512, __m512i, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps)

/* softmax_in_place with 16 exponentials at a time; the sum keeps its 8 chains (a register's
 * halves added in turn), so every value and the sum are softmax_in_place's. */
VNNI_INLINE float softmax_in_place_zmm(float *s, int64_t n) {
    const float mx = scores_max(s, n);
    const __m512 vmx16 = _mm512_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t l = 0;
    for (; l + 16 <= n; l += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l), vmx16));
        _mm512_storeu_ps(s + l, e);
        vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
        vsum = _mm256_add_ps(vsum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    if (l + 8 <= n) vsum = exp_block8(s, l, mx, vsum), l += 8;
    return softmax_tail(s, l, n, mx, vsum);
}

/* weigh_values on 512-bit registers: out[h][j0 .. j0 + 16 w) (the last vector's upper half
 * left out where d ends there), a 16-lane chain per element. */
VNNI_INLINE void weigh_values_zmm(const float *p, int64_t ld_p, const int c, const void *v_cache,
                                  const int64_t *slots, int64_t n, int64_t kv_stride, int64_t j0, const int w,
                                  const float *inv, float *out, int64_t d, const int half) {
    const __mmask16 last = d - j0 - 16 * (w - 1) >= 16 ? 0xFFFF : 0x00FF;
    __m512 acc[3][4];
    for (int h = 0; h < c; h++)
        for (int x = 0; x < w; x++) acc[h][x] = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; l++) {
        __m512 ph[3];
        for (int h = 0; h < c; h++) ph[h] = _mm512_set1_ps(p[h * ld_p + l]);
        for (int x = 0; x < w; x++) {
            __m512 v = load_kv16(v_cache, slots[l] * kv_stride + j0 + 16 * x, half, x == w - 1 ? last : 0xFFFF);
            for (int h = 0; h < c; h++) acc[h][x] = _mm512_fmadd_ps(ph[h], v, acc[h][x]);
        }
    }
    for (int h = 0; h < c; h++) {
        __m512 s = _mm512_set1_ps(inv[h]);
        for (int x = 0; x < w; x++)
            _mm512_mask_storeu_ps(out + h * d + j0 + 16 * x, x == w - 1 ? last : 0xFFFF, _mm512_mul_ps(acc[h][x], s));
    }
}

/* finish_heads with weigh_values_zmm, for prefill rows (nothing fetched ahead): 64 elements of
 * 3 heads at a time, so a head of 64 takes one pass over the context. */
VNNI_INLINE void finish_heads_zmm(int64_t g, const void *v_cache, const int64_t *slots, int64_t n,
                                  int64_t kv_stride, int64_t d, float *scores, int64_t ld_scores, float *out,
                                  const int half) {
    float inv[g];
    for (int64_t h = 0; h < g; h++) inv[h] = 1.0f / softmax_in_place_zmm(scores + h * ld_scores, n);
    for (int64_t h = 0; h < g; h += 3) {
        const float *p = scores + h * ld_scores;
        int c = g - h < 3 ? (int)(g - h) : 3;
        for (int64_t j0 = 0; j0 < d; j0 += 64) {
            int w = d - j0 < 64 ? (int)(d - j0 + 15) / 16 : 4;
#define WEIGH(C, W) \
    weigh_values_zmm(p, ld_scores, C, v_cache, slots, n, kv_stride, j0, W, inv + h, out + h * d, d, half)
            WITH_CONSTANTS(c, w, WEIGH);
#undef WEIGH
        }
    }
}

/* score_keys8 on 512-bit registers, c (<= 3) heads, the keys as load_keys8 leaves them in pairs. */
VNNI_INLINE void score_pairs8(const float *q, const int c, const float *kb, int64_t d, float scale, float *scores,
                              int64_t ld_scores, int64_t l) {
    __m512 acc[3][4];
    for (int h = 0; h < c; h++)
        for (int p = 0; p < 4; p++) acc[h][p] = _mm512_setzero_ps();
    for (int64_t s = 0; s < d / 8; s++)
        for (int p = 0; p < 4; p++) {
            __m512 k = _mm512_load_ps(kb + (p * (d / 8) + s) * 16);
            for (int h = 0; h < c; h++)
                acc[h][p] = _mm512_fmadd_ps(broadcast8(q + h * d + 8 * s), k, acc[h][p]);
        }
    store_scores8(acc, c, scale, scores, ld_scores, l);
}

/* attend_rows on 512-bit registers. */
VNNI_INLINE void attend_rows_zmm(const float *q, int64_t ldq, int64_t rows, int64_t n0, int64_t g,
                                 const void *k_cache, const void *v_cache, const int64_t *slots, int64_t kv_stride,
                                 int64_t d, float scale, float *scores, int64_t ld_scores, float *out, int64_t ldo,
                                 const int half, int64_t window) {
    float kb[8 * MAX_HEAD_DIM] __attribute__((aligned(64)));
    int64_t n_max = n0 + rows;
    for (int64_t l = first_key(n0 + 1, window) / 8 * 8; l < n_max; l += 8) {
        load_keys8(kb, k_cache, slots, l, n_max, kv_stride, d, half, 1);
        for (int64_t r = l < n0 + 1 ? 0 : l - n0; r < rows; r++)
            for (int64_t h = 0; h < g; h += 3) {
                const float *qh = q + r * ldq + h * d;
                float *sh = scores + (r * g + h) * ld_scores;
                if (g - h >= 3) score_pairs8(qh, 3, kb, d, scale, sh, ld_scores, l);
                else if (g - h == 2) score_pairs8(qh, 2, kb, d, scale, sh, ld_scores, l);
                else score_pairs8(qh, 1, kb, d, scale, sh, ld_scores, l);
            }
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t first = first_key(n0 + r + 1, window);
        finish_heads_zmm(g, v_cache, slots + first, n0 + r + 1 - first, kv_stride, d,
                         scores + r * g * ld_scores + first, ld_scores, out + r * ldo, half);
    }
}

/* prefill_attention's tile on 512-bit registers. */
__attribute__((noinline, target(VNNI_TARGET))) static void attend_rows_task_zmm(
    const float *q, int64_t ldq, int64_t rows, int64_t n0, int64_t g, const void *k, const void *v,
    const int64_t *slots, int64_t kv_stride, int64_t d, float scale, float *scores, int64_t ld_scores, float *out,
    int64_t ldo, int64_t half, int64_t window) {
    if (half) attend_rows_zmm(q, ldq, rows, n0, g, k, v, slots, kv_stride, d, scale, scores, ld_scores, out, ldo, 1,
                              window);
    else attend_rows_zmm(q, ldq, rows, n0, g, k, v, slots, kv_stride, d, scale, scores, ld_scores, out, ldo, 0,
                         window);
}

/* Score rows are whole blocks of 8 keys long. */
static inline int64_t scores_stride(int64_t n) { return (n + 7) / 8 * 8; }

/* The floats of decode_attention's scores scratch for b sequences of up to max_len keys. */
int64_t decode_scores_len(int64_t b, int64_t heads, int64_t max_len) { return b * heads * scores_stride(max_len); }

/* Layers whose keys and values to read add up to less than this are likely still in cache
 * from the last step: decode attention then skips the fetching ahead. */
#define FETCH_AHEAD_BYTES (1 << 20)

/* Keys per piece of decode_attention_few's score pass, and the fewest keys of a step it takes
 * (below, its two extra barriers cost more than it saves: 1.03x the time at 64 keys, 0.84x at
 * 100, on a Zen 1 at batch 1). */
#define FEW_KEYS 64
#define FEW_MIN_KEYS 96

/* decode_attention with too few kv heads to give every thread whole groups (a batch-1 step).
 * attend_heads' three passes run one after another over all of them, each split over the threads
 * into pieces whose arithmetic does not depend on the split: the scores of up to 3 heads of a
 * group for FEW_KEYS keys, a head's softmax, and 32 elements of up to 3 heads' values. Every
 * result is attend_heads' bit for bit, and each key and value is converted from float16 once for
 * up to 3 query heads, where one task per query head converted it once per head and two tasks
 * per kv head left a thread idle. */
static void decode_attention_few(const float *q, int64_t ldq, int64_t b, int64_t heads, int64_t kv_heads, int64_t d,
                                 const void *k_cache, const void *v_cache, const int64_t *slots, int64_t max_len,
                                 const int64_t *lens, float scale, float *scores, float *out, int64_t kv_half,
                                 int64_t window) {
    const int64_t group = heads / kv_heads, triples = (group + 2) / 3, ld = scores_stride(max_len);
    const int64_t esize = kv_half ? 2 : 4, kv_stride = kv_heads * d, blocks = (d + 31) / 32;
    const int64_t pieces = (max_len + FEW_KEYS - 1) / FEW_KEYS;
    float inv[b * heads];
#pragma omp parallel
    {
#pragma omp for schedule(dynamic)
        for (int64_t u = 0; u < b * kv_heads * triples * pieces; u++) {
            int64_t piece = u % pieces, t = u / pieces % triples, kv = u / pieces / triples % kv_heads;
            int64_t i = u / pieces / triples / kv_heads, first = first_key(lens[i], window), n = lens[i] - first;
            int64_t l0 = piece * FEW_KEYS, l1 = l0 + FEW_KEYS < n ? l0 + FEW_KEYS : n, h = kv * group + 3 * t;
            if (l0 >= n) continue;
            const int c = group - 3 * t < 3 ? (int)(group - 3 * t) : 3;
            const char *k = (const char *)k_cache + kv * d * esize;
            const float *qh = q + i * ldq + h * d;
            float *sh = scores + (i * heads + h) * ld;
            const int64_t *ctx = slots + i * max_len + first;
            if (kv_half) score_range(qh, c, k, ctx, l0, l1, n, kv_stride, d, scale, sh, ld, 1);
            else score_range(qh, c, k, ctx, l0, l1, n, kv_stride, d, scale, sh, ld, 0);
        }
#pragma omp for schedule(dynamic)
        for (int64_t r = 0; r < b * heads; r++) {
            int64_t i = r / heads;
            inv[r] = 1.0f / softmax_in_place(scores + r * ld, lens[i] - first_key(lens[i], window));
        }
#pragma omp for schedule(dynamic)
        for (int64_t u = 0; u < b * kv_heads * triples * blocks; u++) {
            int64_t j0 = u % blocks * 32, t = u / blocks % triples, kv = u / blocks / triples % kv_heads;
            int64_t i = u / blocks / triples / kv_heads, first = first_key(lens[i], window), n = lens[i] - first;
            int64_t h = kv * group + 3 * t;
            const int c = group - 3 * t < 3 ? (int)(group - 3 * t) : 3, w = d - j0 < 32 ? (int)(d - j0) / 8 : 4;
            const char *v = (const char *)v_cache + kv * d * esize;
            const float *p = scores + (i * heads + h) * ld;
            const int64_t *ctx = slots + i * max_len + first;
            Ahead none = {0};
#define WEIGH(C, W)                                                                                            \
    if (kv_half) weigh_values(p, ld, C, v, ctx, n, kv_stride, j0, W, inv + i * heads + h, out + i * heads * d + h * d, \
                              d, 1, 1, &none);                                                                 \
    else weigh_values(p, ld, C, v, ctx, n, kv_stride, j0, W, inv + i * heads + h, out + i * heads * d + h * d, d, 0, \
                      1, &none)
            WITH_CONSTANTS(c, w, WEIGH);
#undef WEIGH
        }
    }
}

/* One query per sequence: q rows [b] (row stride ldq, heads * d used), slots [b, max_len]
 * padded, lens [b]; out [b, heads * d]. Caches float32, or float16 with kv_half. With window
 * > 0 a query sees only the last `window` keys of its context (a sliding-window layer).
 * d % 8 == 0 and d <= MAX_HEAD_DIM; scores: decode_scores_len(b, heads, max_len) floats. */
void decode_attention(const float *q, int64_t ldq, int64_t b, int64_t heads, int64_t kv_heads, int64_t d,
                      const void *k_cache, const void *v_cache, const int64_t *slots, int64_t max_len,
                      const int64_t *lens, float scale, float *scores, float *out, int64_t kv_half, int64_t window) {
    int64_t group = heads / kv_heads, esize = kv_half ? 2 : 4, ld = scores_stride(max_len), total = 0;
    for (int64_t i = 0; i < b; i++) total += lens[i] - first_key(lens[i], window);
    int fetch_ahead = 2 * total * kv_heads * d * esize >= FETCH_AHEAD_BYTES;
    /* A task: a kv head's whole group of query heads once there are enough groups to share
     * out (its keys and values are read once for all of them), else a single head. A thread
     * takes its next task before it starts this one, so that it can fetch the next keys. With
     * too few groups and keys enough, the passes split instead (decode_attention_few). */
    int few = b * kv_heads < 4 * omp_get_max_threads();
    if (few && total >= FEW_MIN_KEYS) {
        decode_attention_few(q, ldq, b, heads, kv_heads, d, k_cache, v_cache, slots, max_len, lens, scale, scores,
                             out, kv_half, window);
        return;
    }
    int64_t per_task = few ? 1 : group;
    int64_t tasks_per_seq = heads / per_task, n_tasks = b * tasks_per_seq, taken = 0;
    /* Tasks are handed out a sequence at a time where there are sequences enough to share out:
     * a thread then reads each of its sequences' cache blocks whole (every kv head's lines) on
     * one core, whose prefetchers and L2 serve the next head's keys. One task at a time, the
     * two threads took neighbouring kv heads of a sequence and read its blocks at once; a
     * batch of 16 at SmolLM2's shape spent 10-14% more time so (Qwen2.5-Coder-0.5B's, two kv
     * heads: the same). */
    int64_t per_grab = b >= 2 * omp_get_max_threads() ? tasks_per_seq : 1;
#pragma omp parallel
    {
        int64_t grab, next_grab;
#pragma omp atomic capture
        next_grab = taken++;
        while ((grab = next_grab) * per_grab < n_tasks) {
#pragma omp atomic capture
            next_grab = taken++;
            for (int64_t task = grab * per_grab; task < (grab + 1) * per_grab; task++) {
                int64_t next = task + 1 < (grab + 1) * per_grab ? task + 1 : next_grab * per_grab;
                Ahead ahead = {0};
                if (fetch_ahead && next < n_tasks) {
                    int64_t next_seq = next / tasks_per_seq, next_kv = next % tasks_per_seq * per_task / group;
                    int64_t next_first = first_key(lens[next_seq], window);
                    ahead = (Ahead){(const char *)k_cache + next_kv * d * esize,
                                    slots + next_seq * max_len + next_first, lens[next_seq] - next_first,
                                    kv_heads * d * esize, d * esize, 0, 0};
                }
                int64_t i = task / tasks_per_seq, h = task % tasks_per_seq * per_task;
                int64_t first = first_key(lens[i], window), n = lens[i] - first;
                const char *k = (const char *)k_cache + (h / group) * d * esize;
                const char *v = (const char *)v_cache + (h / group) * d * esize;
                const float *qh = q + i * ldq + h * d;
                float *sc = scores + (i * heads + h) * ld, *o = out + i * heads * d + h * d;
                const int64_t *ctx = slots + i * max_len + first;
                if (kv_half) attend_heads(qh, per_task, k, v, ctx, n, kv_heads * d, d, scale, sc, ld, o, 1, &ahead);
                else attend_heads(qh, per_task, k, v, ctx, n, kv_heads * d, d, scale, sc, ld, o, 0, &ahead);
            }
        }
    }
}

/* Prefill rows that share each conversion of 8 keys: as many as keep a tile's scores within
 * SCORES_BYTES (a core's L2 holds them between the scores and the values), 8 to 32. SmolLM2's
 * 512-row chunks (three heads a key) take 32: their attention 8-12% faster than at 8 rows
 * (2026-12-03; 64 rows gained another 3% at 512 rows, nothing at 128). */
#define ROW_TILE_MIN 8
#define ROW_TILE_MAX 32
#define SCORES_BYTES (512 << 10)

static int64_t row_tile(int64_t group, int64_t ld) {
    int64_t rows = SCORES_BYTES / (group * ld * (int64_t)sizeof(float));
    return rows < ROW_TILE_MIN ? ROW_TILE_MIN : rows > ROW_TILE_MAX ? ROW_TILE_MAX : rows;
}

/* A prefill chunk of one sequence: q rows [n_q] (row stride ldq) at positions start .. start +
 * n_q - 1, where start = n_ctx - n_q; ctx_slots [n_ctx]; row i attends to keys 0 .. start + i.
 * (only the last `window` of them with window > 0). Each row is decode_attention's arithmetic
 * over its own context, so a token's attention never depends on how its prompt was cut into
 * chunks or what it was batched with. out [n_q, heads, d].
 * Returns 0, or -1 when a thread's scores buffer cannot be allocated. */
int64_t prefill_attention(const float *q, int64_t ldq, int64_t n_q, int64_t heads, int64_t kv_heads, int64_t d,
                          const void *k_cache, const void *v_cache, const int64_t *ctx_slots, int64_t n_ctx,
                          float scale, float *out, int64_t kv_half, int64_t window) {
    int64_t group = heads / kv_heads, esize = kv_half ? 2 : 4, start = n_ctx - n_q, ld = scores_stride(n_ctx);
    const int64_t tile = row_tile(group, ld), tiles = (n_q + tile - 1) / tile;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc((size_t)tile * group * ld * sizeof(float));
        if (!scores) failed = 1;
        /* longest rows first: dynamic scheduling then ends with the short ones */
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tiles * kv_heads; task++) {
            int64_t i = (tiles - 1 - task / kv_heads) * tile, h = task % kv_heads * group;
            int64_t rows = n_q - i < tile ? n_q - i : tile;
            if (!scores) continue;
            const char *k = (const char *)k_cache + (h / group) * d * esize;
            const char *v = (const char *)v_cache + (h / group) * d * esize;
            const float *qh = q + i * ldq + h * d;
            float *o = out + (i * heads + h) * d;
            if (use_vnni)
                attend_rows_task_zmm(qh, ldq, rows, start + i, group, k, v, ctx_slots, kv_heads * d, d, scale,
                                     scores, ld, o, heads * d, kv_half, window);
            else if (kv_half)
                attend_rows(qh, ldq, rows, start + i, group, k, v, ctx_slots, kv_heads * d, d, scale, scores, ld, o,
                            heads * d, 1, window);
            else
                attend_rows(qh, ldq, rows, start + i, group, k, v, ctx_slots, kv_heads * d, d, scale, scores, ld, o,
                            heads * d, 0, window);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
