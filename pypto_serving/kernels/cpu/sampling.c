/* Greedy sampling's argmax over each row of logits: the first index of the row's largest
 * value, or of its first NaN when it has one (what torch.argmax answers). torch's own argmax
 * does not vectorize on the CPU: ~0.5 ms for 16 rows of a 49152-token vocabulary, 2% of a
 * batch-16 decode step; this takes ~0.05 ms. And random sampling (sample_rows): temperature,
 * min-p, top-k and top-p, then one draw from what is left. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vexp.h"

/* The largest of x [n] (NaNs aside); *nan: whether x holds one. */
static float row_max(const float *x, int64_t n, int *nan) {
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, v);
    }
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
    *nan = _mm256_movemask_ps(unordered);
    for (; i < n; i++) {
        *nan |= isnan(x[i]);
        best = x[i] > best ? x[i] : best;
    }
    return best;
}

static int64_t argmax_row(const float *x, int64_t n) {
    int nan = 0;
    float best = row_max(x, n, &nan);
    int64_t i;
    if (nan) {
        for (i = 0; i < n; i++)
            if (isnan(x[i])) return i;
    }
    const __m256 b = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < n; i++)
        if (x[i] == best) return i;
    return 0;
}

/* x [rows, n] float32 with row stride ld, n >= 1 -> out [rows]. */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * ld, n);
}

/* Grammars' token masks: out = x ([rows_total, n] float32, row strides ld and ld_out), with the
 * tokens of row rows[i] (i < r) whose bit is clear in bitmask [i] (words per row; token j is bit
 * j % 32 of word j / 32, llguidance's layout) at -inf. One pass over the logits (torch's bit
 * unpacking took 2.4-3.4 ms for 16 rows of a 49152-token vocabulary; this ~0.1). */
void mask_tokens(const float *x, int64_t rows_total, int64_t n, int64_t ld, float *out, int64_t ld_out,
                 const int64_t *rows, int64_t r, const int32_t *bitmask, int64_t words) {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t row = 0; row < rows_total; row++) {
        const uint32_t *bits = 0;
        for (int64_t i = 0; i < r; i++)
            if (rows[i] == row) bits = (const uint32_t *)(bitmask + i * words);
        const float *src = x + row * ld;
        float *dst = out + row * ld_out;
        if (!bits) {
            memcpy(dst, src, (size_t)n * sizeof(float));
            continue;
        }
        int64_t j = 0;
        for (; j + 8 <= n && j / 32 < words; j += 8) {
            __m256i byte = _mm256_set1_epi32((int32_t)((bits[j / 32] >> (j % 32)) & 0xFF));
            __m256 allowed = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bit), lane_bit));
            _mm256_storeu_ps(dst + j, _mm256_blendv_ps(ninf, _mm256_loadu_ps(src + j), allowed));
        }
        for (; j < n; j++) /* the last few, and any past the bitmask (left allowed) */
            dst[j] = j / 32 >= words || ((bits[j / 32] >> (j % 32)) & 1) ? src[j] : -INFINITY;
    }
}

/* ---- random sampling ----
 *
 * kernels/sampling.py's draw_portable, row by row, without sorting the vocabulary or drawing
 * noise for every token: torch's sort and its per-row exponential noise took a batch-16
 * SmolLM2 step from 14 to 31 ms at temperature 1 and to 61 ms with top_p (16 x 49152 logits:
 * the noise ~15 ms, the sort ~28 ms). Per row: weights w = exp((x - max) / t), exactly 1 at the
 * max and 0 for -inf (a masked token), min-p zeroing those below min_p; u (uniform in [0, 1))
 * times the kept weights' sum then picks the token whose running sum, in vocabulary order as
 * draw_portable's, first passes it. Top-k sorts only the tokens at least as heavy as the k-th
 * heaviest block maximum (a few more than k), top-p alone only the tokens of the histogram
 * bucket where the kept mass crosses p; both then cut exactly where the sorted vocabulary would. */

#define BLOCK 64 /* weights per block sum: the draw finds its block, then its token */
/* Histogram buckets: a weight's float bits past the sign, from its exponent and 3 mantissa
 * bits, for weights from 2^-24 (of the largest, 1) up. The lighter ones are left out (bucket
 * 0): should the cuts reach them, every token is a candidate. Top-p's mass histogram has four
 * copies, filled in turn, so that neighbouring tokens in one bucket do not wait on each
 * other's update. */
#define BUCKET_SHIFT 20
#define LIGHT 0x1p-24f
#define BUCKET_LIGHT ((127 - 24) << 3) /* the bits >> BUCKET_SHIFT of LIGHT */
#define BUCKETS (((127 + 1) << 3) - BUCKET_LIGHT + 1)
#define COPIES 4

/* A candidate as one sortable word: heavier first, then the lower index (a float's bits order
 * positive floats as integers), or the index alone. */
static inline uint64_t heavier_key(float w, int64_t i) {
    uint32_t bits;
    memcpy(&bits, &w, sizeof bits);
    return (uint64_t)(0x7F800000u - bits) << 32 | (uint64_t)i;
}

static inline float key_weight(uint64_t key) {
    uint32_t bits = 0x7F800000u - (uint32_t)(key >> 32);
    float w;
    memcpy(&w, &bits, sizeof w);
    return w;
}

static inline int64_t key_index(uint64_t key) { return (int64_t)(key & 0xFFFFFFFFu); }

#define DIGIT_BITS 11
#define DIGITS (1 << DIGIT_BITS)
_Static_assert(BUCKETS <= DIGITS, "top_k_floor counts buckets in the digits scratch");

/* a [m] ascending, least significant 11 bits first (a pass whose digit every key shares is
 * skipped); tmp [m] scratch, count [DIGITS]. In linear time: qsort's comparisons made a flat
 * distribution's few thousand top-p candidates cost ~0.5 ms a row. */
static void radix_sort(uint64_t *a, uint64_t *tmp, int64_t m, uint32_t *count) {
    uint64_t *from = a, *to = tmp;
    for (int shift = 0; shift < 64; shift += DIGIT_BITS) {
        memset(count, 0, DIGITS * sizeof *count);
        for (int64_t i = 0; i < m; i++) count[(from[i] >> shift) & (DIGITS - 1)]++;
        if (m == 0 || count[(from[0] >> shift) & (DIGITS - 1)] == (uint32_t)m) continue;
        uint32_t at = 0;
        for (int d = 0; d < DIGITS; d++) {
            uint32_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (int64_t i = 0; i < m; i++) to[count[(from[i] >> shift) & (DIGITS - 1)]++] = from[i];
        uint64_t *swap = from;
        from = to;
        to = swap;
    }
    if (from != a) memcpy(a, from, (size_t)m * sizeof *a);
}

static inline uint32_t bucket_of(float w) {
    uint32_t bits;
    memcpy(&bits, &w, sizeof bits);
    bits >>= BUCKET_SHIFT;
    return bits > BUCKET_LIGHT ? bits - BUCKET_LIGHT : 0;
}

/* The 8 floats of p from i, those at n and beyond `pad`. */
static inline __m256 load_padded(const float *p, int64_t i, int64_t n, float pad) {
    if (i + 8 <= n) return _mm256_loadu_ps(p + i);
    float tail[8];
    for (int j = 0; j < 8; j++) tail[j] = i + j < n ? p[i + j] : pad;
    return _mm256_loadu_ps(tail);
}

/* v's 4 lanes summed in pairs, the one order every sum of weights here takes. */
static inline double hsum4d(__m256d v) {
    double lanes[4];
    _mm256_storeu_pd(lanes, v);
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

/* w [n] = exp((x - mx) * inv_t), 0 where x is -inf or w is below min_p; block [n / BLOCK
 * rounded up] their sums by BLOCK, top [the same] their largest by BLOCK. Returns the sum of
 * them all. */
static double weights(const float *x, int64_t n, float mx, float inv_t, float min_p, float *w, double *block,
                      float *top) {
    const __m256 vm = _mm256_set1_ps(mx), vi = _mm256_set1_ps(inv_t), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 floor = _mm256_set1_ps(min_p);
    double total = 0.0;
    for (int64_t b = 0; b * BLOCK < n; b++) {
        __m256d s0 = _mm256_setzero_pd(), s1 = s0;
        __m256 high = _mm256_setzero_ps();
        for (int64_t i = b * BLOCK; i < n && i < (b + 1) * BLOCK; i += 8) {
            const __m256 v = load_padded(x, i, n, -INFINITY), a = _mm256_mul_ps(_mm256_sub_ps(v, vm), vi);
            __m256 e = exp8(a);
            /* -inf (masked), below min_p, or below exp8's clamp at -87 (which would give every
             * such token the same 1.6e-38 instead of ~0) */
            __m256 drop = _mm256_or_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ), _mm256_cmp_ps(e, floor, _CMP_LT_OQ));
            drop = _mm256_or_ps(drop, _mm256_cmp_ps(a, _mm256_set1_ps(-87.0f), _CMP_LT_OQ));
            e = _mm256_andnot_ps(drop, e);
            if (i + 8 <= n) _mm256_storeu_ps(w + i, e);
            else {
                float tail[8];
                _mm256_storeu_ps(tail, e);
                for (int j = 0; i + j < n; j++) w[i + j] = tail[j];
            }
            s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
            high = _mm256_max_ps(high, e);
        }
        block[b] = hsum4d(_mm256_add_pd(s0, s1));
        total += block[b];
        float highs[8];
        _mm256_storeu_ps(highs, high);
        top[b] = highs[0];
        for (int j = 1; j < 8; j++) top[b] = highs[j] > top[b] ? highs[j] : top[b];
    }
    return total;
}

/* The token (a positive weight) where the running sum of w passes target, block sums first;
 * the last positive weight when rounding leaves the sum short of it. */
static int64_t pick(const float *w, const double *block, int64_t n, double target) {
    double sum = 0.0;
    int64_t b = 0, blocks = (n + BLOCK - 1) / BLOCK, last = -1;
    for (; b < blocks - 1 && sum + block[b] <= target; b++) sum += block[b];
    for (int64_t i = b * BLOCK; i < n; i++) {
        if (w[i] <= 0.0f) continue;
        sum += w[i];
        last = i;
        if (sum > target) return i;
    }
    for (int64_t i = n - 1; last < 0 && i >= 0; i--) /* rounding past the last block's every weight */
        if (w[i] > 0.0f) last = i;
    return last;
}

/* Scratch of one thread for rows of n logits. */
typedef struct {
    float *w;
    double *block;
    float *top;        /* the blocks' largest weights */
    uint64_t *c, *tmp; /* candidates, heavier_key's */
    double (*mass)[BUCKETS];
    uint32_t *digits; /* radix_sort's counts, and top_k_floor's */
} SampleScratch;

/* The lightest weight a bucket holds (bucket 0: every weight). */
static inline float bucket_floor(uint32_t b) {
    uint32_t bits = b ? (b + BUCKET_LIGHT) << BUCKET_SHIFT : 0;
    float w;
    memcpy(&w, &bits, sizeof w);
    return w;
}

/* A weight that the k-th heaviest token reaches: the floor of the first bucket, from the
 * heaviest down, that holds the k-th heaviest of the blocks' largest weights (k blocks have a
 * token that heavy). From the n / BLOCK block maxima, not the n weights. */
static float top_k_floor(const float *top, int64_t blocks, int64_t k, uint32_t *count) {
    memset(count, 0, BUCKETS * sizeof *count);
    for (int64_t b = 0; b < blocks; b++) count[bucket_of(top[b])]++;
    int64_t seen = 0;
    for (uint32_t b = BUCKETS - 1; b > 0; b--)
        if ((seen += count[b]) >= k) return bucket_floor(b);
    return 0.0f;
}

/* Top-p alone. A histogram of the weights finds the bucket, from the heaviest down, where the
 * buckets so far first hold more than p of the mass: every token above it is kept, and only
 * that bucket's tokens are sorted (heaviest first, then by index) to find the last kept one. The
 * draw then runs over the vocabulary, in order, taking the kept tokens' weights: where the
 * distribution is flat, tens of thousands of tokens are kept, too many to sort. */
static int64_t draw_top_p(const float *w, int64_t n, double total, float p, double u, const SampleScratch *s) {
    memset(s->mass, 0, COPIES * sizeof *s->mass);
    const __m256 light = _mm256_set1_ps(LIGHT);
    int c = 0;
    for (int64_t i = 0; i < n; i += 8) {
        int heavy = i + 8 <= n ? _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + i), light, _CMP_GT_OQ))
                               : (1 << (n - i)) - 1;
        for (; heavy; heavy &= heavy - 1, c = (c + 1) % COPIES) {
            float v = w[i + __builtin_ctz(heavy)];
            s->mass[c][bucket_of(v)] += v;
        }
    }
    const double limit = (double)p * total;
    double above = 0.0; /* the mass of the buckets above the crossing one */
    uint32_t cross = BUCKETS - 1;
    for (; cross > 0; cross--) {
        double here = 0.0;
        for (int c = 0; c < COPIES; c++) here += s->mass[c][cross];
        if (above + here > limit) break;
        above += here;
    }
    const float lo = bucket_floor(cross), hi = bucket_floor(cross + 1); /* cross 0: the light ones */
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (w[i] > 0.0f && w[i] >= lo && w[i] < hi) s->c[m++] = heavier_key(w[i], i);
    radix_sort(s->c, s->tmp, m, s->digits);
    double kept = above;
    int64_t r = 0;
    while (r < m && kept <= limit) kept += key_weight(s->c[r++]);
    /* kept: w >= hi, or in the bucket and heavier than the last kept (or as heavy, not after it) */
    const float cut = r ? key_weight(s->c[r - 1]) : INFINITY;
    const int32_t last = r ? (int32_t)key_index(s->c[r - 1]) : -1;
    const __m256 vhi = _mm256_set1_ps(hi), vlo = _mm256_set1_ps(lo), vcut = _mm256_set1_ps(cut);
    const __m256 zero = _mm256_setzero_ps();
    const __m256i vlast = _mm256_set1_epi32(last), lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const double target = u * kept;
    double sum = 0.0;
    int64_t chosen = -1;
    for (int64_t i = 0; i < n; i += 8) {
        __m256 v = load_padded(w, i, n, 0.0f);
        __m256i at = _mm256_add_epi32(_mm256_set1_epi32((int32_t)i), lanes);
        __m256 tie = _mm256_and_ps(_mm256_cmp_ps(v, vcut, _CMP_EQ_OQ),
                                   _mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpgt_epi32(at, vlast),
                                                                        _mm256_set1_epi32(-1))));
        __m256 positive = _mm256_and_ps(_mm256_cmp_ps(v, vlo, _CMP_GE_OQ), _mm256_cmp_ps(v, zero, _CMP_GT_OQ));
        __m256 in_bucket = _mm256_and_ps(positive, _mm256_or_ps(_mm256_cmp_ps(v, vcut, _CMP_GT_OQ), tie));
        __m256 keep = _mm256_or_ps(_mm256_cmp_ps(v, vhi, _CMP_GE_OQ), in_bucket);
        int mask = _mm256_movemask_ps(keep);
        if (!mask) continue;
        __m256 kv = _mm256_and_ps(keep, v);
        double here = hsum4d(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(kv)),
                                           _mm256_cvtps_pd(_mm256_extractf128_ps(kv, 1))));
        if (sum + here <= target) {
            sum += here;
            chosen = i + 31 - __builtin_clz((unsigned)mask); /* the last kept, should rounding fall short */
            continue;
        }
        for (; mask; mask &= mask - 1) {
            int64_t j = i + __builtin_ctz(mask);
            sum += w[j];
            chosen = j;
            if (sum > target) return j;
        }
    }
    return chosen;
}

/* The tokens top-k (k > 0) can keep, heaviest first, into s->c; returns how many: those at
 * least as heavy as top_k_floor. */
static int64_t candidates(const float *w, int64_t n, int64_t k, const SampleScratch *s) {
    const float floor = top_k_floor(s->top, (n + BLOCK - 1) / BLOCK, k, s->digits);
    const __m256 vf = _mm256_set1_ps(floor), zero = _mm256_setzero_ps();
    int64_t m = 0;
    for (int64_t i = 0; i < n; i += 8) {
        int keep = (1 << (n - i < 8 ? n - i : 8)) - 1; /* the last few: each checked below */
        if (i + 8 <= n) {
            __m256 v = _mm256_loadu_ps(w + i);
            keep = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, vf, _CMP_GE_OQ),
                                                    _mm256_cmp_ps(v, zero, _CMP_GT_OQ)));
        }
        for (; keep; keep &= keep - 1) {
            int64_t j = i + __builtin_ctz(keep);
            if (w[j] > 0.0f && w[j] >= floor) s->c[m++] = heavier_key(w[j], j);
        }
    }
    radix_sort(s->c, s->tmp, m, s->digits);
    return m;
}

static int64_t sample_row(const float *x, int64_t n, float t, int64_t k, float p, float min_p, double u,
                          const SampleScratch *s) {
    if (!(t > 0.0f)) return argmax_row(x, n);
    int nan = 0;
    float mx = row_max(x, n, &nan);
    if (nan || isinf(mx)) return argmax_row(x, n); /* as draw_portable: nothing to weigh */
    double total = weights(x, n, mx, 1.0f / t, min_p > 0.0f ? min_p : 0.0f, s->w, s->block, s->top);
    if (k <= 0 && p >= 1.0f) return pick(s->w, s->block, n, u * total);
    if (k <= 0) return draw_top_p(s->w, n, total, p, u, s);
    int64_t m = candidates(s->w, n, k, s);
    if (k < m) m = k;
    if (p < 1.0f) { /* the heaviest first while the mass before each is at most p of the top-k's */
        double kept = 0.0, before = 0.0;
        for (int64_t j = 0; j < m; j++) kept += key_weight(s->c[j]);
        int64_t j = 0;
        while (j < m && before <= (double)p * kept) before += key_weight(s->c[j++]);
        m = j;
    }
    double kept = 0.0, sum = 0.0;
    for (int64_t j = 0; j < m; j++) { /* the draw runs in vocabulary order */
        kept += key_weight(s->c[j]);
        s->c[j] = (uint64_t)key_index(s->c[j]) << 32 | (s->c[j] >> 32);
    }
    radix_sort(s->c, s->tmp, m, s->digits);
    for (int64_t j = 0; j < m; j++) {
        sum += key_weight(s->c[j] << 32);
        if (sum > u * kept) return (int64_t)(s->c[j] >> 32);
    }
    return (int64_t)(s->c[m - 1] >> 32);
}

/* x [rows, n] float32 (row stride ld), per row its temperature (<= 0: the argmax), top_k (0:
 * none), top_p (1: none), min_p (0: none) and a uniform draw u in [0, 1) -> out [rows]. Returns
 * 0, or -1 when a thread's scratch cannot be allocated. */
int64_t sample_rows(const float *x, int64_t rows, int64_t n, int64_t ld, const float *temperature,
                    const int64_t *top_k, const float *top_p, const float *min_p, const double *u, int64_t *out) {
    int failed = 0;
#pragma omp parallel reduction(| : failed) if (rows > 1)
    {
        const size_t blocks = (size_t)(n / BLOCK + 1);
        SampleScratch s = {malloc((size_t)n * sizeof(float)), malloc(blocks * sizeof(double)),
                           malloc(blocks * sizeof(float)), malloc((size_t)n * sizeof(uint64_t)),
                           malloc((size_t)n * sizeof(uint64_t)), malloc(COPIES * sizeof *s.mass),
                           malloc(DIGITS * sizeof(uint32_t))};
        failed = !s.w || !s.block || !s.top || !s.c || !s.tmp || !s.mass || !s.digits;
#pragma omp for schedule(dynamic)
        for (int64_t r = 0; r < rows; r++)
            if (!failed) {
                out[r] = sample_row(x + r * ld, n, temperature[r], top_k[r], top_p[r], min_p[r], u[r], &s);
                if (out[r] < 0) out[r] = argmax_row(x + r * ld, n); /* no weight left (the max weighs 1) */
            }
        free(s.w);
        free(s.block);
        free(s.top);
        free(s.c);
        free(s.tmp);
        free(s.digits);
        free(s.mass);
    }
    return failed ? -1 : 0;
}

/* ---- logprobs ----
 *
 * What is asked of log_softmax over a row of raw logits: the chosen token's log-probability, its
 * rank (1 + the tokens with a larger logit) and the k largest. torch's log_softmax, the
 * comparison for the rank and topk each pass over the whole [B, V] (2.2 ms for 16 rows of a
 * 49,152-token vocabulary, ~60 ms for a 256-row piece of prompt logprobs); this reads each row
 * twice (row_max, then everything else) and writes nothing but the answers. */

/* Keeps (v, i) among the k largest so far, ids/values [k] holding *kept of them in descending
 * order; i ascends from call to call, so among equal values the lower index stays first. */
static inline void keep_top(float v, int64_t i, int64_t k, int64_t *kept, int64_t *ids, float *values) {
    int64_t j;
    if (*kept == k) {
        if (!(v > values[k - 1])) return;
        j = k - 1;
    } else {
        j = (*kept)++;
    }
    for (; j > 0 && values[j - 1] < v; j--) {
        values[j] = values[j - 1];
        ids[j] = ids[j - 1];
    }
    values[j] = v;
    ids[j] = i;
}

/* Row x [n]: the chosen token's log-probability, its rank, and the k largest (their ids and
 * log-probabilities, descending; -inf logits last, by index). Returns -1, computing nothing, for
 * a row with a NaN or without a finite largest logit (log_softmax's answer there is NaN). */
static int logprob_row(const float *x, int64_t n, int64_t chosen, int64_t k, float *value, int64_t *rank,
                       int64_t *top_ids, float *top_values) {
    int nan = 0;
    const float mx = row_max(x, n, &nan);
    if (nan || !isfinite(mx)) return -1;
    /* one pass: exp(x - max) summed in double (-inf gives 0: exp8 alone clamps it to 1.6e-38),
     * the logits above the chosen one's counted, the k largest kept */
    const __m256 vm = _mm256_set1_ps(mx), c = _mm256_set1_ps(x[chosen]), ninf = _mm256_set1_ps(-INFINITY);
    __m256d lo = _mm256_setzero_pd(), hi = lo;
    __m256i above = _mm256_setzero_si256();
    __m256 floor = ninf; /* the k-th largest once k are kept: only larger values get in */
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 v = load_padded(x, i, n, -INFINITY);
        const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(v, vm)));
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        above = _mm256_sub_epi32(above, _mm256_castps_si256(_mm256_cmp_ps(v, c, _CMP_GT_OQ)));
        for (int hits = k ? _mm256_movemask_ps(_mm256_cmp_ps(v, floor, _CMP_GT_OQ)) : 0; hits; hits &= hits - 1) {
            const int j = __builtin_ctz(hits);
            keep_top(x[i + j], i + j, k, &kept, top_ids, top_values);
        }
        if (kept == k && k) floor = _mm256_set1_ps(top_values[k - 1]);
    }
    const double lse = (double)mx + log(hsum4d(_mm256_add_pd(lo, hi)));
    for (int64_t i = 0; kept < k && i < n; i++) /* fewer than k finite logits: -inf ones, by index */
        if (x[i] == -INFINITY) keep_top(x[i], i, k, &kept, top_ids, top_values);
    for (int64_t j = 0; j < k; j++) top_values[j] = (float)((double)top_values[j] - lse);
    int32_t counts[8];
    _mm256_storeu_si256((__m256i *)counts, above);
    int64_t larger = 0;
    for (int j = 0; j < 8; j++) larger += counts[j];
    *value = (float)((double)x[chosen] - lse);
    *rank = larger + 1;
    return 0;
}

/* x [rows, n] float32 (row stride ld), chosen [rows] within 0 .. n - 1, k <= n -> value [rows],
 * rank [rows], top_ids and top_values [rows, k]. Returns 0, or -1 when a row has a NaN or no
 * finite largest logit (then the outputs are not all written). */
int64_t logprob_rows(const float *x, int64_t rows, int64_t n, int64_t ld, const int64_t *chosen, int64_t k,
                     float *value, int64_t *rank, int64_t *top_ids, float *top_values) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic) reduction(| : failed) if (rows > 1 && rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++)
        failed |= logprob_row(x + r * ld, n, chosen[r], k, value + r, rank + r, top_ids + r * k, top_values + r * k);
    return failed ? -1 : 0;
}
