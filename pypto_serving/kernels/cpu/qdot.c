/* Packed linear layers with int8 activations, for x86-64 with AVX2 (what llama.cpp does on the
 * CPU: its Q4_1 x Q8_1 dot products).
 *
 * The weights are the panels of qlinear.c, read as they are stored (16 output rows per panel,
 * int4 levels 0..15 or int5 levels 0..31 with scale and zero, or int8 levels with scale). Each row of x is quantized
 * per group of 32 along K: d = max|x| / 127, xq = round(x * 127 / max|x|) in [-127, 127], and
 * the sum of the group's quantized inputs, sx = d * sum(xq), is kept for the zero term (as
 * llama.cpp's Q8_1 keeps it). Per group g and output n,
 *   dot = sum of xq[k] * q[k, n]           (integers, exact: the order cannot matter)
 *   acc = fma(dot, d * scale, acc); acc = fma(sx, zero, acc)
 * or, on a symmetric grid (zero = -2^(bits - 1) scale: GGUF's Q4_0, Q5_0; int8's zero 0), with
 * the zero term in the integers, acc = fma(dot - 2^(bits - 1) sum(xq), d * scale, acc),
 * in the same order for every tiling, so a row's result never depends on the batch (M = 1
 * and M > 1 agree bit for bit), and the int8 x uint8 products (vpmaddubsw) do 32 multiply-adds
 * per instruction where the fp32 kernels do 8.
 *
 * Dot products use "k-quads": a 32-bit lane holds one output row's levels at 4 consecutive k,
 * so vpmaddubsw + vpmaddwd sum them against the same 4 bytes of x broadcast to every lane. The
 * panels are stored in quads (kernels/quant_linear.py): 4 k of a panel are one register of
 * int8 levels per 8 rows, or one register of nibbles for all 16 (int5: plus, per group, two
 * registers of high bits, bit j for quad j).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "group_max.h"
#include "prefetch.h"
#include "vnni.h"

#define NB 16
#define GROUP 32
#define QUADS (GROUP / 4)
/* Rows of x per tile. int4 weights: 6 group sums + 6 accumulators + 2 weights + x + product
 * fill the 16 registers. int8 weights need more, and 3 still measured faster than 2 or 4. */
#define MR 3
#define INLINE static inline __attribute__((always_inline))

INLINE __m256 half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* The zeros of 8 rows at zero + i; none (0) without stored zeros: a symmetric grid, as GGUF's
 * Q4_0, Q5_0 and Q8_0 pack, whose zero terms the dots take (centred). */
INLINE __m256 zeros8(const uint16_t *zero, int64_t i) { return zero ? half8(zero + i) : _mm256_setzero_ps(); }

/* 4-bit panel, k .. k+3: 32 bytes, byte 4 r + i = row r (low nibble) and row r + 8 (high) at k + i. */
INLINE void quads4(const uint8_t *q, int64_t k, __m256i *a, __m256i *b) {
    __m256i v = _mm256_loadu_si256((const __m256i *)(q + k * 8));
    const __m256i low = _mm256_set1_epi8(15);
    *a = _mm256_and_si256(v, low);
    *b = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
}

/* Bit j of each byte of h as 16 (bit 4): int5's high bits for quad j. */
INLINE __m256i high_bits(__m256i h, const int j) {
    __m256i v = j <= 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

/* 5-bit panel, quad j of a group (g: the group's 320 bytes): its nibbles as int4's, or'd with
 * the high bits ha (rows 0..7) and hb (rows 8..15) loaded once per group. */
INLINE void quads5(const uint8_t *g, const int j, __m256i ha, __m256i hb, __m256i *a, __m256i *b) {
    __m256i v = _mm256_loadu_si256((const __m256i *)(g + 32 * j));
    const __m256i low = _mm256_set1_epi8(15);
    *a = _mm256_or_si256(_mm256_and_si256(v, low), high_bits(ha, j));
    *b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), high_bits(hb, j));
}

INLINE void high5(const uint8_t *g, __m256i *ha, __m256i *hb) {
    *ha = _mm256_loadu_si256((const __m256i *)(g + 8 * 32));
    *hb = _mm256_loadu_si256((const __m256i *)(g + 9 * 32));
}

/* 8-bit panel, k .. k+3: 64 bytes, rows 0..7 then rows 8..15, byte 4 r + i = row r at k + i. */
INLINE void quads8(const uint8_t *q, int64_t k, __m256i *a, __m256i *b) {
    *a = _mm256_loadu_si256((const __m256i *)(q + k * 16));
    *b = _mm256_loadu_si256((const __m256i *)(q + k * 16 + 32));
}

INLINE __m256i quad_of(const int8_t *xq) {
    int32_t v;
    memcpy(&v, xq, 4);
    return _mm256_set1_epi32(v);
}

/* int4: 16-bit partial sums over a group stay below 8 * 2 * 15 * 127 = 30480, so they add up
 * in 16 bits and widen once per group. int8: widen every quad (2 * 127 * 127 fits 16 bits).
 * int5: a group's sums reach 8 * 2 * 31 * 127 = 62992, past 16 bits: widen every quad too
 * (tile5, at M > 1: every four quads).
 * A group's first quad starts its sum (first = 1) rather than adding to zeros. */
INLINE __m256i quad_dot5(__m256i acc, __m256i w, __m256i x, const int first) {
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
    return first ? p : _mm256_add_epi32(acc, p);
}

INLINE __m256i quad_dot(__m256i acc, __m256i w, __m256i x, const int bits, const int first) {
    if (bits == 5) return quad_dot5(acc, w, x, first);
    if (bits == 4) {
        __m256i p = _mm256_maddubs_epi16(w, x);
        return first ? p : _mm256_add_epi16(acc, p);
    }
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    p = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    return first ? p : _mm256_add_epi32(acc, p);
}


INLINE __m256i widen(__m256i acc, int bits) {
    return bits == 4 ? _mm256_madd_epi16(acc, _mm256_set1_epi16(1)) : acc;
}

/* Two planes (int16 activations): the group's dot is LO_STEPS * hi + lo in units of d / LO_STEPS. */
#define LO_STEPS 254
INLINE __m256i planes_dot(__m256i hi, __m256i lo) {
    return _mm256_add_epi32(_mm256_mullo_epi32(hi, _mm256_set1_epi32(LO_STEPS)), lo);
}

/* zeros: the panel has zeros of its own (an asymmetric grid: Q4_1, Q4_K, ...), so each group
 * adds its zero term sx * zero. On a symmetric grid (qlinear_q8's z NULL, and every int8 panel,
 * whose zeros are 0) the term is in the integer dot instead (centred). */
INLINE __m256 group_step(__m256 acc, __m256i dot, float d, float sx, __m256 scale, __m256 zero, const int zeros) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_set1_ps(d), scale), acc);
    return zeros ? _mm256_fmadd_ps(_mm256_set1_ps(sx), zero, acc) : acc;
}

/* A symmetric grid's zero term, -2^(bits - 1) scale * d * sum(xq), taken in the integer dot:
 * dot - 2^(bits - 1) sum(xq), from the group's shift = 128 sum(xq) (exact: a multiple of 128
 * shifted). int8's zeros are 0: nothing to take. One fma fewer per row and group, which is what
 * bounds the tiles at M > 1 (their GEMMs ~10% faster), and the term exact rather than rounded. */
INLINE int32_t centre(const int32_t *shift, const int bits) { return *shift >> (8 - bits); }

INLINE __m256i centred(__m256i dot, const int32_t *shift, const int bits, const int zeros) {
    return zeros || bits == 8 ? dot : _mm256_sub_epi32(dot, _mm256_set1_epi32(centre(shift, bits)));
}

/* CALL(B, Z) with a panel's width B and whether it has zeros of its own Z as constants, so
 * that each kind inlines its own loops (int8 panels never have: their zero is 0). */
#define WITH_GRID(bits, zeros, CALL)                                                                   \
    do {                                                                                               \
        if ((bits) == 4 && (zeros)) CALL(4, 1);                                                        \
        else if ((bits) == 4) CALL(4, 0);                                                              \
        else if ((bits) == 5 && (zeros)) CALL(5, 1);                                                   \
        else if ((bits) == 5) CALL(5, 0);                                                              \
        else CALL(8, 0);                                                                               \
    } while (0)

/* Mixed activations: a wide group's residual plane (d: the int8 step), summed apart from the
 * int8 steps (wide_pass, row_panel). */
INLINE __m256 lo_step(__m256 acc, __m256i lo_dot, float d, __m256 scale) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo_dot), _mm256_mul_ps(_mm256_set1_ps(d / LO_STEPS), scale), acc);
}

/* ---- activations ---- */

INLINE int32_t hsum8(__m256i t) {
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(t4);
}

/* One group of a row (v: its 32 values, amax: their largest |x|) -> xq, its int8 plane; with lo
 * also the second plane, the rounding residual x - d * xq in steps of d / LO_STEPS (d = amax /
 * 127). Returns sum(xq); *lo_sum gets sum(lo). */
INLINE int32_t quantize_group(const __m256 v[4], float amax, int8_t *xq, int8_t *lo, int32_t *lo_sum) {
    __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i i[4];
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)); /* nearest even */
    __m256i t = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i *)xq, pack32(i));
    if (!lo) return hsum8(t);
    /* the residual of each rounding is at most d / 2: LO_STEPS / 2 = 127 steps of d / LO_STEPS */
    __m256 step = _mm256_set1_ps(amax / 127.0f), inv_lo = _mm256_set1_ps(amax > 0.0f ? LO_STEPS * 127.0f / amax : 0.0f);
    __m256i r[4];
    for (int j = 0; j < 4; j++) {
        __m256 res = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(i[j]), step, v[j]);
        r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(res, inv_lo));
    }
    _mm256_storeu_si256((__m256i *)lo, pack32(r));
    *lo_sum = hsum8(_mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3])));
    return hsum8(t);
}

/* Row r of x -> xq [k], d [k / 32], sx [k / 32], shift [k / 32] (128 * sum(xq), for the VNNI
 * tiles' unsigned int8 levels; qhead_greedy's rows too); with lo (int16 activations) also the
 * second plane, its lo_shift, and d becomes its step d / LO_STEPS. */
void quantize_row(const float *x, int64_t k, int8_t *xq, float *d, float *sx, int8_t *lo, int32_t *shift,
                  int32_t *lo_shift) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m256 v[4];
        float amax = group_max(x + g * GROUP, v);
        d[g] = amax / 127.0f;
        int32_t lo_sum = 0, sum = quantize_group(v, amax, xq + g * GROUP, lo ? lo + g * GROUP : 0, &lo_sum);
        shift[g] = 128 * sum;
        if (lo) lo_shift[g] = 128 * lo_sum;
        /* The zero term takes the sum of the quantized inputs, d * sum(xq): the group's result is
         * then exactly the dot product of the quantized row with the dequantized weights, whose
         * errors partly cancel; the float sum would pair an exact correction with a quantized
         * product (about twice the error on real layers). */
        if (!lo) {
            sx[g] = d[g] * (float)sum;
            continue;
        }
        d[g] /= LO_STEPS;
        sx[g] = d[g] * (float)(LO_STEPS * sum + lo_sum);
    }
}

/* Mixed activations (planes 3): int8 groups, except the row's groups whose int8 rounding error
 * is a sizeable part of the row: d^2 > WIDE_ENERGY * sum(x^2), d the group's int8 step (a
 * group's rounding error energy is ~32 d^2 / 12). Those get the residual plane as well (bit g
 * of wide is set); d stays the int8 step (a wide group's residual step is d / LO_STEPS); a
 * narrow group's residual plane is left unwritten. The groups this picks are the ones that hold
 * an outlier channel, whose step rounds the group's other 31 values to a few levels, and in a
 * row without outliers few or none. (The rule before, d^2 above the row's mean d^2, also
 * widened the larger half of a flat row's groups, which cost a pass and bought little: by
 * energy, SmolLM2 has 20% of its groups wide against 23%, with less error on every measure,
 * and Qwen2.5-Coder-0.5B 7% against 23%; docs/performance.md.) */
#define WIDE_ENERGY 1e-6f
#define WIDE_WORDS(groups) (((groups) + 63) / 64) /* a row's wide groups: one bit each */
INLINE int is_wide(const uint64_t *wide, int64_t g) { return (int)((wide[g >> 6] >> (g & 63)) & 1); }
static void quantize_row_mixed(const float *x, int64_t k, int8_t *xq, float *d, float *sx, int8_t *lo,
                               uint64_t *wide, int32_t *shift, int32_t *lo_shift) {
    int64_t groups = k / GROUP;
    memset(wide, 0, WIDE_WORDS(groups) * sizeof(uint64_t));
    /* the energy in four sums: one fma chain through the row held each group on its latency
     * (quantizing hot rows 0.30 -> 0.23 ns a value) */
    __m256 energy[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < groups; g++) {
        __m256 v[4];
        sx[g] = group_max(x + g * GROUP, v); /* the group's max until its sum replaces it below */
        d[g] = sx[g] / 127.0f;
        for (int i = 0; i < 4; i++) energy[i] = _mm256_fmadd_ps(v[i], v[i], energy[i]);
    }
    const float limit =
        WIDE_ENERGY * hsum8f(_mm256_add_ps(_mm256_add_ps(energy[0], energy[1]), _mm256_add_ps(energy[2], energy[3])));
    for (int64_t g = 0; g < groups; g++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + g * GROUP + i * 8);
        const float amax = sx[g];
        const int is_wide = d[g] * d[g] > limit;
        wide[g >> 6] |= (uint64_t)is_wide << (g & 63);
        int32_t lo_sum = 0, sum = quantize_group(v, amax, xq + g * GROUP, is_wide ? lo + g * GROUP : 0, &lo_sum);
        shift[g] = 128 * sum;
        lo_shift[g] = 128 * lo_sum;
        sx[g] = is_wide ? d[g] / LO_STEPS * (float)(LO_STEPS * sum + lo_sum) : d[g] * (float)sum;
    }
}

typedef struct {
    int8_t *q;
    float *d, *sx;
    int32_t *shift, *lo_shift; /* 128 * each group's sum of q (and of lo): tile_vnni's int8 levels */
    int8_t *lo;    /* the second plane of int16 or mixed activations, or NULL */
    uint64_t *wide; /* mixed activations: [m][WIDE_WORDS(k / 32)], a set bit where a group has its
                     * second plane; or NULL */
} Rows;

static __thread void *act_buf;
static __thread size_t act_len;

/* Room for m quantized rows of k in a per-thread buffer (reused across calls), or .q NULL when
 * out of memory. */
static Rows rows_buffer(int64_t m, int64_t k, int planes) {
    size_t need = (size_t)(planes == 1 ? 1 : 2) * m * k + 4 * (size_t)m * (k / GROUP) * sizeof(float) +
                  (size_t)m * WIDE_WORDS(k / GROUP) * sizeof(uint64_t) + 64;
    if (act_len < need) {
        free(act_buf);
        act_buf = malloc(need);
        act_len = act_buf ? need : 0;
    }
    Rows r = {0};
    if (!act_buf) return r;
    r.wide = planes == 3 ? act_buf : 0; /* first: 8-byte aligned */
    r.d = (float *)((uint64_t *)act_buf + (planes == 3 ? m * WIDE_WORDS(k / GROUP) : 0));
    r.sx = r.d + m * (k / GROUP);
    r.shift = (int32_t *)(r.sx + m * (k / GROUP));
    r.lo_shift = r.shift + m * (k / GROUP);
    r.q = (int8_t *)(r.lo_shift + m * (k / GROUP));
    r.lo = planes >= 2 ? r.q + m * k : 0;
    return r;
}

/* ---- M = 1: a panel's quads built on the fly ---- */

/* A batch-1 row streams each panel from memory once, in order: levels, scales and zeros (three
 * streams). Each group fetches the one AHEAD_GROUPS on with its scales and zeros (fetch_ahead,
 * prefetch.h), 4-8 KB of levels ahead; the hardware prefetcher alone left SmolLM2's batch-1
 * stack ~15% slower and Qwen2.5-Coder-0.5B's ~13% (docs/performance.md). int5 groups start with
 * their last line (the high bits), an order the hardware prefetcher does not follow at all. */

INLINE void store8(float *y, __m256 acc, const float *bias) {
    _mm256_storeu_ps(y, bias ? _mm256_add_ps(acc, _mm256_loadu_ps(bias)) : acc);
}

INLINE void row_panel(const Rows *x, const uint8_t *q, const uint16_t *scale, const uint16_t *zero, const int bits,
                      const int zeros, int64_t k_len, float *y, const float *bias) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256 lo0 = acc0, lo1 = acc0; /* mixed activations: the wide groups' residual planes (store_tile) */
    for (int64_t g = 0; g < k_len / GROUP; g++) {
        fetch_ahead(q, scale, zero, g, bits);
        __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();
        __m256i l0 = _mm256_setzero_si256(), l1 = _mm256_setzero_si256();
        const uint8_t *q5 = q + g * 10 * GROUP;
        __m256i ha = _mm256_setzero_si256(), hb = ha;
        if (bits == 5) high5(q5, &ha, &hb);
        const int two = x->lo && (!x->wide || is_wide(x->wide, g)); /* this group's residual plane counts */
#pragma GCC unroll 8
        for (int j = 0; j < QUADS; j++) {
            int64_t k = g * GROUP + 4 * j;
            __m256i a, b, xv = quad_of(x->q + k);
            if (bits == 4) quads4(q, k, &a, &b);
            else if (bits == 5) quads5(q5, j, ha, hb, &a, &b);
            else quads8(q, k, &a, &b);
            t0 = quad_dot(t0, a, xv, bits, 0);
            t1 = quad_dot(t1, b, xv, bits, 0);
            if (two) {
                __m256i xl = quad_of(x->lo + k);
                l0 = quad_dot(l0, a, xl, bits, 0);
                l1 = quad_dot(l1, b, xl, bits, 0);
            }
        }
        __m256i d0 = centred(widen(t0, bits), x->shift + g, bits, zeros);
        __m256i d1 = centred(widen(t1, bits), x->shift + g, bits, zeros);
        if (two) {
            l0 = centred(widen(l0, bits), x->lo_shift + g, bits, zeros);
            l1 = centred(widen(l1, bits), x->lo_shift + g, bits, zeros);
        }
        if (two && !x->wide) {
            d0 = planes_dot(d0, l0);
            d1 = planes_dot(d1, l1);
        }
        __m256 s0 = half8(scale + g * NB), s1 = half8(scale + g * NB + 8);
        acc0 = group_step(acc0, d0, x->d[g], x->sx[g], s0, zeros8(zero, g * NB), zeros);
        acc1 = group_step(acc1, d1, x->d[g], x->sx[g], s1, zeros8(zero, g * NB + 8), zeros);
        if (two && x->wide) {
            lo0 = lo_step(lo0, l0, x->d[g], s0);
            lo1 = lo_step(lo1, l1, x->d[g], s1);
        }
    }
    if (x->wide) {
        acc0 = _mm256_add_ps(acc0, lo0);
        acc1 = _mm256_add_ps(acc1, lo1);
    }
    store8(y, acc0, bias);
    store8(y + 8, acc1, bias ? bias + 8 : 0);
}

static void gemv(const Rows *x, int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *s,
                 const uint16_t *z, int bits, const float *bias, float *y) {
    int64_t groups = k / GROUP, qbytes = k * bits * 2;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        const float *bb = bias ? bias + nb * NB : 0;
        const uint16_t *zb = z ? z + nb * groups * NB : 0, *sb = s + nb * groups * NB;
        const uint8_t *qb = q + nb * qbytes;
#define ROW(B, Z) row_panel(x, qb, sb, zb, B, Z, k, y + nb * NB, bb)
        WITH_GRID(bits, z != 0, ROW);
#undef ROW
    }
}

/* ---- M > 1: scales, zeros (and int4 levels) made once per panel into scratch, reused by every row ---- */

/* A panel's quads [k / 4][2] (int8: the stored panel itself; int4, int5: unpacked into scratch) and
 * per group its 16 scales and 16 zeros as floats (in scratch). */
typedef struct {
    const __m256i *quads;
    const float *sz;
} Panel;

/* The dots of mr rows (xr: a plane of each, from k = off) with one group's quads qg: t [r][2],
 * in 16 bits for int4 (widen them). The empty asm keeps GCC from turning each chain of adds
 * into a tree over the group's products (which needs more registers than there are, and
 * spills). */
INLINE void group_dots(const __m256i *qg, const int8_t **xr, int64_t off, const int mr, const int bits,
                       __m256i t[][2]) {
#pragma GCC unroll 8
    for (int j = 0; j < QUADS; j++) {
        __m256i a = _mm256_loadu_si256(qg + 2 * j), b = _mm256_loadu_si256(qg + 2 * j + 1);
        for (int r = 0; r < mr; r++) {
            __m256i xv = quad_of(xr[r] + off + 4 * j);
            t[r][0] = quad_dot(t[r][0], a, xv, bits, j == 0);
            t[r][1] = quad_dot(t[r][1], b, xv, bits, j == 0);
            __asm__("" : "+x"(t[r][0]), "+x"(t[r][1]));
        }
    }
}

/* As group_dots, for int5 levels in tile5's order (see there). */
INLINE void group_dots5(const __m256i *qg, const int8_t **xr, int64_t off, const int mr, __m256i t[][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i u[2][2];
    for (int half = 0; half < 2; half++) {
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            const int j = 4 * half + q;
            __m256i a = _mm256_loadu_si256(qg + 2 * j), b = _mm256_loadu_si256(qg + 2 * j + 1);
            for (int r = 0; r < mr; r++) {
                __m256i xv = quad_of(xr[r] + off + 4 * j);
                __m256i pa = _mm256_maddubs_epi16(a, xv), pb = _mm256_maddubs_epi16(b, xv);
                u[r][0] = q ? _mm256_add_epi16(u[r][0], pa) : pa;
                u[r][1] = q ? _mm256_add_epi16(u[r][1], pb) : pb;
                __asm__("" : "+x"(u[r][0]), "+x"(u[r][1]));
            }
        }
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < 2; h++) {
                __m256i w = _mm256_madd_epi16(u[r][h], ones);
                t[r][h] = half ? _mm256_add_epi32(t[r][h], w) : w;
            }
    }
}

/* A tile's results: acc [r] (+ bias); with mixed activations (acc + lo [r]) + bias, lo the rows'
 * residual sums (wide_pass). */
INLINE void store_tile(const int mr, float *y, int64_t ldy, const float *bias, __m256 acc[][2], const float *lo) {
    for (int r = 0; r < mr; r++) {
        if (lo) {
            acc[r][0] = _mm256_add_ps(acc[r][0], _mm256_load_ps(lo + r * NB));
            acc[r][1] = _mm256_add_ps(acc[r][1], _mm256_load_ps(lo + r * NB + 8));
        }
        store8(y + r * ldy, acc[r][0], bias);
        store8(y + r * ldy + 8, acc[r][1], bias ? bias + 8 : 0);
    }
}

/* mr rows of x against one panel: every group sum and accumulator stays in a register. */
INLINE void tile(const Rows *x, int64_t m0, const int mr, Panel p, const int bits, const int zeros, int64_t k_len,
                 float *y, int64_t ldy, const float *bias, const char *next, const float *lo) {
    const int64_t groups = k_len / GROUP;
    const int8_t *xr[MR];
    __m256 acc[MR][2];
    for (int r = 0; r < mr; r++) {
        xr[r] = x->q + (m0 + r) * k_len;
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        const __m256i *qg = p.quads + g * 2 * QUADS;
        __m256i t[MR][2];
        group_dots(qg, xr, g * GROUP, mr, bits, t);
        prefetch_group(next, g, bits);
        const float *sz = p.sz + g * 2 * NB;
        __m256 s0 = _mm256_load_ps(sz), s1 = _mm256_load_ps(sz + 8);
        __m256 z0 = _mm256_load_ps(sz + NB), z1 = _mm256_load_ps(sz + NB + 8);
        for (int r = 0; r < mr; r++) {
            int64_t i = (m0 + r) * groups + g;
            acc[r][0] = group_step(acc[r][0], centred(widen(t[r][0], bits), x->shift + i, bits, zeros), x->d[i],
                                   x->sx[i], s0, z0, zeros);
            acc[r][1] = group_step(acc[r][1], centred(widen(t[r][1], bits), x->shift + i, bits, zeros), x->d[i],
                                   x->sx[i], s1, z1, zeros);
        }
    }
    store_tile(mr, y, ldy, bias, acc, lo);
}

/* As tile, for int16 activations: two planes per row, so two rows per tile fit the registers. */
INLINE void tile2(const Rows *x, int64_t m0, const int mr, Panel p, const int bits, const int zeros, int64_t k_len,
                  float *y, int64_t ldy, const float *bias, const char *next) {
    const int64_t groups = k_len / GROUP;
    const int8_t *xr[2], *xl[2];
    __m256 acc[2][2];
    for (int r = 0; r < mr; r++) {
        xr[r] = x->q + (m0 + r) * k_len;
        xl[r] = x->lo + (m0 + r) * k_len;
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        const __m256i *qg = p.quads + g * 2 * QUADS;
        __m256i t[2][2], l[2][2];
#pragma GCC unroll 8
        for (int j = 0; j < QUADS; j++) {
            __m256i a = _mm256_loadu_si256(qg + 2 * j), b = _mm256_loadu_si256(qg + 2 * j + 1);
            for (int r = 0; r < mr; r++) {
                __m256i xv = quad_of(xr[r] + g * GROUP + 4 * j), xlv = quad_of(xl[r] + g * GROUP + 4 * j);
                t[r][0] = quad_dot(t[r][0], a, xv, bits, j == 0);
                t[r][1] = quad_dot(t[r][1], b, xv, bits, j == 0);
                l[r][0] = quad_dot(l[r][0], a, xlv, bits, j == 0);
                l[r][1] = quad_dot(l[r][1], b, xlv, bits, j == 0);
                __asm__("" : "+x"(t[r][0]), "+x"(t[r][1]), "+x"(l[r][0]), "+x"(l[r][1]));
            }
        }
        prefetch_group(next, g, bits);
        const float *sz = p.sz + g * 2 * NB;
        __m256 s0 = _mm256_load_ps(sz), s1 = _mm256_load_ps(sz + 8);
        __m256 z0 = _mm256_load_ps(sz + NB), z1 = _mm256_load_ps(sz + NB + 8);
        for (int r = 0; r < mr; r++) {
            int64_t i = (m0 + r) * groups + g;
            for (int h = 0; h < 2; h++) {
                __m256i hi = centred(widen(t[r][h], bits), x->shift + i, bits, zeros);
                __m256i lo = centred(widen(l[r][h], bits), x->lo_shift + i, bits, zeros);
                acc[r][h] = group_step(acc[r][h], planes_dot(hi, lo), x->d[i], x->sx[i], h ? s1 : s0, h ? z1 : z0,
                                       zeros);
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        store8(y + r * ldy, acc[r][0], bias);
        store8(y + r * ldy + 8, acc[r][1], bias ? bias + 8 : 0);
    }
}

/* As tile, for int5 levels with int8 activations: a quad's pair sums reach 2 * 31 * 127 = 7874,
 * so the sums of four quads (31496) still fit 16 bits and each half group widens once
 * (vpmaddwd), not every quad: per group and half panel 8 vpmaddubsw and 2 vpmaddwd instead of
 * 8 of each. The integer sums are the same, so the results are tile's bit for bit. A half sum
 * and a group sum per row and half panel need two rows per tile to stay in registers. */
INLINE void tile5(const Rows *x, int64_t m0, const int mr, Panel p, const int zeros, int64_t k_len, float *y,
                  int64_t ldy, const float *bias, const char *next, const float *lo) {
    const int64_t groups = k_len / GROUP;
    const int8_t *xr[2];
    __m256 acc[2][2];
    for (int r = 0; r < mr; r++) {
        xr[r] = x->q + (m0 + r) * k_len;
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        const __m256i *qg = p.quads + g * 2 * QUADS;
        __m256i t[2][2];
        group_dots5(qg, xr, g * GROUP, mr, t);
        prefetch_group(next, g, 5);
        const float *sz = p.sz + g * 2 * NB;
        __m256 s0 = _mm256_load_ps(sz), s1 = _mm256_load_ps(sz + 8);
        __m256 z0 = _mm256_load_ps(sz + NB), z1 = _mm256_load_ps(sz + NB + 8);
        for (int r = 0; r < mr; r++) {
            int64_t i = (m0 + r) * groups + g;
            acc[r][0] = group_step(acc[r][0], centred(t[r][0], x->shift + i, 5, zeros), x->d[i], x->sx[i], s0, z0,
                                   zeros);
            acc[r][1] = group_step(acc[r][1], centred(t[r][1], x->shift + i, 5, zeros), x->d[i], x->sx[i], s1, z1,
                                   zeros);
        }
    }
    store_tile(mr, y, ldy, bias, acc, lo);
}

/* Mixed activations: the residual sums of rows from m0 on (wide_pass), or NULL without them. */
INLINE const float *sums_at(const float *lo, int64_t m0) { return lo ? lo + m0 * NB : 0; }

/* ---- AVX-512 VNNI ----
 * Where the CPU has it (Zen 4 and 5, Intel since Ice Lake; qdot_use_vnni), panels of every
 * width take tile_vnni instead of tile (and tile2_vnni, wide_pass_vnni and row_panel_vnni
 * instead of theirs): vpdpbusd on 512-bit registers multiplies one quad's 64 levels (all 16
 * rows of the panel) by a row's 4 inputs broadcast and adds each row's four products to its
 * int32 sum, in one instruction where AVX2 takes two vpmaddubsw, their adds and the widening
 * per 16 rows. The integer sums are the same and so is the epilogue, lane by lane (one fma for
 * the scale and, on a grid with zeros of its own, one for the zero, in group order), so the
 * results equal tile's bit for bit. int8
 * levels are signed: at M > 1 they are flipped to unsigned (w + 128) and each group's sums
 * lose 128 * the inputs' sum again (tile_levels_vnni, unshift); at M = 1 their magnitudes
 * meet the inputs negated where a level is negative, as vpsignb does in quad_dot. */
int use_vnni; /* vnni.h; qhead.c's tiles follow it too */

/* Turns the VNNI tiles on (1, where the CPU has them) or off (0), or leaves them (-1); returns
 * whether they are on. The library's loader turns them on; tests turn them off to compare. */
int64_t qdot_use_vnni(int64_t on) {
    if (on < 0) return use_vnni;
    __builtin_cpu_init();
    use_vnni = on && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return use_vnni;
}

/* A quad of all 16 rows' levels as vpdpbusd's unsigned operand: int8 levels as magnitudes, with
 * *negative marking the negative ones (dot_vnni negates their inputs). */
VNNI_INLINE __m512i levels_vnni(__m512i w, const int bits, __mmask64 *negative) {
    *negative = 0;
    if (bits != 8) return w;
    *negative = _mm512_movepi8_mask(w);
    return _mm512_abs_epi8(w); /* -128 becomes 128, unsigned: right */
}

/* t + the dots of the quad's levels w with x's 4 int8 inputs at x */
VNNI_INLINE __m512i dot_vnni(__m512i t, __m512i w, __mmask64 negative, const int8_t *x, const int bits) {
    int32_t v;
    memcpy(&v, x, 4);
    __m512i xv = _mm512_set1_epi32(v);
    if (bits == 8) xv = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
    return _mm512_dpbusd_epi32(t, w, xv);
}

/* As group_step, lo_step and planes_dot, for 16 rows' sums */
VNNI_INLINE __m512 group_step_vnni(__m512 acc, __m512i dot, float d, float sx, __m512 scale, __m512 zero,
                                   const int zeros) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_set1_ps(d), scale), acc);
    return zeros ? _mm512_fmadd_ps(_mm512_set1_ps(sx), zero, acc) : acc;
}

/* As centred */
VNNI_INLINE __m512i centred_vnni(__m512i dot, const int32_t *shift, const int bits, const int zeros) {
    return zeros || bits == 8 ? dot : _mm512_sub_epi32(dot, _mm512_set1_epi32(centre(shift, bits)));
}

/* A group's sums from the M > 1 tiles: int8 levels' flip undone (unshift), a symmetric grid's
 * zero term taken (centred). */
VNNI_INLINE __m512i tile_sums(__m512i t, const int32_t *shift, const int bits, const int zeros) {
    return centred_vnni(unshift(t, shift, bits), shift, bits, zeros);
}

VNNI_INLINE __m512 lo_step_vnni(__m512 acc, __m512i lo_dot, float d, __m512 scale) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo_dot), _mm512_mul_ps(_mm512_set1_ps(d / LO_STEPS), scale), acc);
}

VNNI_INLINE __m512i planes_dot_vnni(__m512i hi, __m512i lo) {
    return _mm512_add_epi32(_mm512_mullo_epi32(hi, _mm512_set1_epi32(LO_STEPS)), lo);
}

/* As group_dots: the dots of mr rows (xr: a plane of each, from k = off) with one group's
 * quads qg, t [r] (16 rows' int32 sums; int8 levels' still to unshift). */
VNNI_INLINE void group_dots_vnni(const __m512i *qg, const int8_t **xr, int64_t off, const int mr, const int bits,
                                 __m512i *t) {
    for (int r = 0; r < mr; r++) t[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < QUADS; j++) {
        const __m512i w = tile_levels_vnni(_mm512_loadu_si512(qg + j), bits);
        for (int r = 0; r < mr; r++) t[r] = tile_dot_vnni(t[r], w, xr[r] + off + 4 * j);
    }
}

VNNI_INLINE void tile_vnni(const Rows *x, int64_t m0, const int mr, Panel p, const int bits, const int zeros,
                           int64_t k_len, float *y, int64_t ldy, const float *bias, const char *next,
                           const float *lo) {
    const int64_t groups = k_len / GROUP;
    const int8_t *xr[MR_VNNI];
    __m512 acc[MR_VNNI];
    for (int r = 0; r < mr; r++) {
        xr[r] = x->q + (m0 + r) * k_len;
        acc[r] = _mm512_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        __m512i t[MR_VNNI];
        group_dots_vnni((const __m512i *)(p.quads + g * 2 * QUADS), xr, g * GROUP, mr, bits, t);
        prefetch_group(next, g, bits);
        const float *sz = p.sz + g * 2 * NB;
        const __m512 scale = _mm512_loadu_ps(sz), zero = _mm512_loadu_ps(sz + NB);
        for (int r = 0; r < mr; r++) {
            int64_t i = (m0 + r) * groups + g;
            acc[r] = group_step_vnni(acc[r], tile_sums(t[r], x->shift + i, bits, zeros), x->d[i], x->sx[i], scale,
                                     zero, zeros);
        }
    }
    for (int r = 0; r < mr; r++) { /* as store_tile: (acc + lo) + bias */
        __m512 v = lo ? _mm512_add_ps(acc[r], _mm512_loadu_ps(lo + r * NB)) : acc[r];
        _mm512_storeu_ps(y + r * ldy, bias ? _mm512_add_ps(v, _mm512_loadu_ps(bias)) : v);
    }
}

VNNI_INLINE void panel_tiles_vnni_bits(const Rows *x, int64_t m, Panel p, const int bits, const int zeros, int64_t k,
                                       float *y, int64_t ldy, const float *bias, const char *next, const float *lo) {
    int64_t m0 = 0;
    for (; m0 + MR_VNNI <= m; m0 += MR_VNNI, next = 0)
        tile_vnni(x, m0, MR_VNNI, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next, sums_at(lo, m0));
    if (m - m0 >= 4) {
        tile_vnni(x, m0, 4, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next, sums_at(lo, m0));
        m0 += 4, next = 0;
    }
    if (m - m0 >= 2) {
        tile_vnni(x, m0, 2, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next, sums_at(lo, m0));
        m0 += 2, next = 0;
    }
    if (m0 < m) tile_vnni(x, m0, 1, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next, sums_at(lo, m0));
}

/* Panels of any width (bits: int5's levels are unpacked into quads of bytes as int4's are) */
__attribute__((noinline, target(VNNI_TARGET))) static void panel_tiles_vnni(const Rows *x, int64_t m, Panel p,
                                                                            int bits, int zeros, int64_t k,
                                                                            float *y, int64_t ldy,
                                                                            const float *bias, const char *next,
                                                                            const float *lo) {
#define TILES(B, Z) panel_tiles_vnni_bits(x, m, p, B, Z, k, y, ldy, bias, next, lo)
    WITH_GRID(bits, zeros, TILES);
#undef TILES
}

/* As tile2 (int16 activations: two planes per row), with VNNI tiles. */
VNNI_INLINE void tile2_vnni(const Rows *x, int64_t m0, const int mr, Panel p, const int bits, const int zeros,
                            int64_t k_len, float *y, int64_t ldy, const float *bias, const char *next) {
    const int64_t groups = k_len / GROUP;
    const int8_t *xr[MR_VNNI], *xl[MR_VNNI];
    __m512 acc[MR_VNNI];
    for (int r = 0; r < mr; r++) {
        xr[r] = x->q + (m0 + r) * k_len;
        xl[r] = x->lo + (m0 + r) * k_len;
        acc[r] = _mm512_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        const __m512i *qg = (const __m512i *)(p.quads + g * 2 * QUADS);
        __m512i t[MR_VNNI], l[MR_VNNI];
        for (int r = 0; r < mr; r++) t[r] = l[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < QUADS; j++) {
            const __m512i w = tile_levels_vnni(_mm512_loadu_si512(qg + j), bits);
            for (int r = 0; r < mr; r++) {
                t[r] = tile_dot_vnni(t[r], w, xr[r] + g * GROUP + 4 * j);
                l[r] = tile_dot_vnni(l[r], w, xl[r] + g * GROUP + 4 * j);
            }
        }
        prefetch_group(next, g, bits);
        const float *sz = p.sz + g * 2 * NB;
        const __m512 scale = _mm512_loadu_ps(sz), zero = _mm512_loadu_ps(sz + NB);
        for (int r = 0; r < mr; r++) {
            int64_t i = (m0 + r) * groups + g;
            __m512i dot = planes_dot_vnni(tile_sums(t[r], x->shift + i, bits, zeros),
                                          tile_sums(l[r], x->lo_shift + i, bits, zeros));
            acc[r] = group_step_vnni(acc[r], dot, x->d[i], x->sx[i], scale, zero, zeros);
        }
    }
    for (int r = 0; r < mr; r++)
        _mm512_storeu_ps(y + r * ldy, bias ? _mm512_add_ps(acc[r], _mm512_loadu_ps(bias)) : acc[r]);
}

VNNI_INLINE void panel_tiles2_vnni_bits(const Rows *x, int64_t m, Panel p, const int bits, const int zeros,
                                        int64_t k, float *y, int64_t ldy, const float *bias, const char *next) {
    int64_t m0 = 0;
    for (; m0 + MR_VNNI <= m; m0 += MR_VNNI, next = 0)
        tile2_vnni(x, m0, MR_VNNI, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next);
    if (m - m0 >= 4) tile2_vnni(x, m0, 4, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next), m0 += 4, next = 0;
    if (m - m0 >= 2) tile2_vnni(x, m0, 2, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next), m0 += 2, next = 0;
    if (m0 < m) tile2_vnni(x, m0, 1, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next);
}

__attribute__((noinline, target(VNNI_TARGET))) static void panel_tiles2_vnni(const Rows *x, int64_t m, Panel p,
                                                                             int bits, int zeros, int64_t k,
                                                                             float *y, int64_t ldy,
                                                                             const float *bias, const char *next) {
#define TILES2(B, Z) panel_tiles2_vnni_bits(x, m, p, B, Z, k, y, ldy, bias, next)
    WITH_GRID(bits, zeros, TILES2);
#undef TILES2
}

/* As row_panel (M = 1), with VNNI: a quad's 16 rows in one 512-bit register, one vpdpbusd per
 * plane. The same integer sums and epilogue per lane: row_panel's results bit for bit. */
VNNI_INLINE __m512i quads_vnni(const uint8_t *q, const uint8_t *q5, int64_t k, const int j, __m256i ha, __m256i hb,
                               const int bits) {
    if (bits == 8) return _mm512_loadu_si512((const void *)(q + k * 16));
    __m256i a, b;
    if (bits == 4) quads4(q, k, &a, &b);
    else quads5(q5, j, ha, hb, &a, &b);
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

/* zeros8 for a panel's 16 rows. */
VNNI_INLINE __m512 zeros16(const uint16_t *zero, int64_t i) {
    return zero ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(zero + i))) : _mm512_setzero_ps();
}

VNNI_INLINE void row_panel_vnni(const Rows *x, const uint8_t *q, const uint16_t *scale, const uint16_t *zero,
                                const int bits, const int zeros, int64_t k_len, float *y, const float *bias) {
    __m512 acc = _mm512_setzero_ps(), lo = acc;
    for (int64_t g = 0; g < k_len / GROUP; g++) {
        fetch_ahead(q, scale, zero, g, bits);
        __m512i t = _mm512_setzero_si512(), l = t;
        const uint8_t *q5 = q + g * 10 * GROUP;
        __m256i ha = _mm256_setzero_si256(), hb = ha;
        if (bits == 5) high5(q5, &ha, &hb);
        const int two = x->lo && (!x->wide || is_wide(x->wide, g));
#pragma GCC unroll 8
        for (int j = 0; j < QUADS; j++) {
            int64_t k = g * GROUP + 4 * j;
            __mmask64 negative;
            const __m512i w = levels_vnni(quads_vnni(q, q5, k, j, ha, hb, bits), bits, &negative);
            t = dot_vnni(t, w, negative, x->q + k, bits);
            if (two) l = dot_vnni(l, w, negative, x->lo + k, bits);
        }
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + g * NB)));
        const __m512 z = zeros16(zero, g * NB);
        t = centred_vnni(t, x->shift + g, bits, zeros);
        if (two) l = centred_vnni(l, x->lo_shift + g, bits, zeros);
        acc = group_step_vnni(acc, two && !x->wide ? planes_dot_vnni(t, l) : t, x->d[g], x->sx[g], s, z, zeros);
        if (two && x->wide) lo = lo_step_vnni(lo, l, x->d[g], s);
    }
    if (x->wide) acc = _mm512_add_ps(acc, lo);
    _mm512_storeu_ps(y, bias ? _mm512_add_ps(acc, _mm512_loadu_ps(bias)) : acc);
}

__attribute__((noinline, target(VNNI_TARGET))) static void gemv_vnni(const Rows *x, int64_t k, int64_t n_blocks,
                                                                     const uint8_t *q, const uint16_t *s,
                                                                     const uint16_t *z, int bits, const float *bias,
                                                                     float *y) {
    int64_t groups = k / GROUP, qbytes = k * bits * 2;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        const float *bb = bias ? bias + nb * NB : 0;
        const uint16_t *sb = s + nb * groups * NB, *zb = z ? z + nb * groups * NB : 0;
        const uint8_t *qb = q + nb * qbytes;
#define ROW(B, Z) row_panel_vnni(x, qb, sb, zb, B, Z, k, y + nb * NB, bb)
        WITH_GRID(bits, z != 0, ROW);
#undef ROW
    }
}

/* Rows 0 .. m - 1 of x against one panel, in tiles of MR rows and a last one of 1 or 2 (each
 * size a constant, so each tile keeps its registers); the first tile prefetches `next` (the
 * following panel's levels, or NULL). */
_Static_assert(MR == 3, "panel_rows tiles the last 1 or 2 rows");
INLINE void panel_tiles(const Rows *x, int64_t m, Panel p, const int bits, const int zeros, int64_t k, float *y,
                        int64_t ldy, const float *bias, const char *next, const float *lo) {
    int64_t m0 = 0;
    if (use_vnni) {
        panel_tiles_vnni(x, m, p, bits, zeros, k, y, ldy, bias, next, lo);
        return;
    }
    if (bits == 5) {
        for (; m0 + 2 <= m; m0 += 2, next = 0)
            tile5(x, m0, 2, p, zeros, k, y + m0 * ldy, ldy, bias, next, sums_at(lo, m0));
        if (m0 < m) tile5(x, m0, 1, p, zeros, k, y + m0 * ldy, ldy, bias, next, sums_at(lo, m0));
        return;
    }
    for (; m0 + MR <= m; m0 += MR, next = 0)
        tile(x, m0, MR, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next, sums_at(lo, m0));
    if (m - m0 == 2) tile(x, m0, 2, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next, sums_at(lo, m0));
    else if (m - m0 == 1) tile(x, m0, 1, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next, sums_at(lo, m0));
}

/* Mixed activations: the lists of rows 0 .. m - 1 that have each group wide, rows in order
 * (group g's are rows [start[g], start[g + 1])), and room for the rows' residual sums against
 * one panel (lo [m][16]). Per thread, reused across calls. */
typedef struct {
    int32_t *start, *rows;
    float *lo;
} WideRows;

static __thread void *wide_buf;
static __thread size_t wide_len;

/* .start NULL when out of memory */
static WideRows wide_rows(const Rows *x, int64_t m, int64_t groups) {
    const int64_t words = WIDE_WORDS(groups);
    const size_t lists = ((size_t)(groups + 1 + m * groups) * sizeof(int32_t) + 31) / 32 * 32,
                 need = lists + (size_t)m * NB * sizeof(float);
    WideRows w = {0, 0, 0};
    if (wide_len < need) {
        free(wide_buf);
        wide_buf = aligned_alloc(32, need);
        wide_len = wide_buf ? need : 0;
    }
    if (!wide_buf) return w;
    w.start = wide_buf;
    w.rows = w.start + groups + 1;
    w.lo = (float *)((char *)wide_buf + lists);
    int32_t n = 0;
    for (int64_t g = 0; g < groups; g++) {
        w.start[g] = n;
        for (int64_t r = 0; r < m; r++)
            if (is_wide(x->wide + r * words, g)) w.rows[n++] = (int32_t)r;
    }
    w.start[groups] = n;
    return w;
}

/* n (1 .. 3) rows' residual planes of group g against one panel, added to their sums lo [r][16]. */
INLINE void wide_group(const Rows *x, const int32_t *rows, const int n, const __m256i *qg, int64_t g, __m256 s0,
                       __m256 s1, const int bits, const int zeros, int64_t k, float *lo) {
    const int8_t *xl[MR];
    __m256i t[MR][2];
    for (int i = 0; i < n; i++) xl[i] = x->lo + rows[i] * k;
    if (bits == 5) group_dots5(qg, xl, g * GROUP, n, t);
    else group_dots(qg, xl, g * GROUP, n, bits, t);
    for (int i = 0; i < n; i++) {
        const int64_t at = rows[i] * (k / GROUP) + g;
        float d = x->d[at], *l = lo + rows[i] * NB;
        _mm256_store_ps(l, lo_step(_mm256_load_ps(l), centred(widen(t[i][0], bits), x->lo_shift + at, bits, zeros),
                                   d, s0));
        _mm256_store_ps(l + 8, lo_step(_mm256_load_ps(l + 8),
                                       centred(widen(t[i][1], bits), x->lo_shift + at, bits, zeros), d, s1));
    }
}

/* Mixed activations, before a panel's int8 tiles: the residual planes of the rows' wide
 * groups, group by group, the rows wide at a group three at a time whichever tile they are in
 * (a tile's pass over every group one of its rows had wide cost as much per group as a wide
 * one: ~34% of a SmolLM2 tile's groups against ~20% of a row's), summed into w->lo [m][16] in
 * each row's group order, as row_panel sums them; the tiles then store (acc + lo) + bias.
 * (Done after the tiles it had to read their sums back, and y's rows, a multiple of 4 KiB
 * apart, share a few cache sets: that alone cost ~15% of a GEMM with no wide group.) */
INLINE void wide_pass(const Rows *x, const WideRows *w, int64_t m, Panel p, const int bits, const int zeros,
                      int64_t k) {
    const int64_t groups = k / GROUP;
    float *lo = w->lo;
    memset(lo, 0, (size_t)m * NB * sizeof(float));
    for (int64_t g = 0; g < groups; g++) {
        const int32_t *rows = w->rows + w->start[g];
        const int64_t n = w->start[g + 1] - w->start[g];
        if (!n) continue;
        const __m256i *qg = p.quads + g * 2 * QUADS;
        __m256 s0 = _mm256_load_ps(p.sz + g * 2 * NB), s1 = _mm256_load_ps(p.sz + g * 2 * NB + 8);
        int64_t i = 0;
        if (bits == 5) /* group_dots5 takes two rows at most (tile5) */
            for (; i + 2 <= n; i += 2) wide_group(x, rows + i, 2, qg, g, s0, s1, 5, zeros, k, lo);
        else {
            for (; i + MR <= n; i += MR) wide_group(x, rows + i, MR, qg, g, s0, s1, bits, zeros, k, lo);
            if (n - i == 2) wide_group(x, rows + i, 2, qg, g, s0, s1, bits, zeros, k, lo);
        }
        if (n - i == 1) wide_group(x, rows + i, 1, qg, g, s0, s1, bits, zeros, k, lo);
    }
}

/* As wide_group, with VNNI tiles (n rows: 1 .. MR_VNNI). */
VNNI_INLINE void wide_group_vnni(const Rows *x, const int32_t *rows, const int n, const __m512i *qg, int64_t g,
                                 __m512 scale, const int bits, const int zeros, int64_t k, float *lo) {
    const int8_t *xl[MR_VNNI];
    __m512i t[MR_VNNI];
    for (int i = 0; i < n; i++) xl[i] = x->lo + rows[i] * k;
    group_dots_vnni(qg, xl, g * GROUP, n, bits, t);
    for (int i = 0; i < n; i++) {
        float *l = lo + rows[i] * NB;
        const int64_t at = rows[i] * (k / GROUP) + g;
        _mm512_storeu_ps(l, lo_step_vnni(_mm512_loadu_ps(l), tile_sums(t[i], x->lo_shift + at, bits, zeros), x->d[at],
                                         scale));
    }
}

VNNI_INLINE void wide_pass_vnni_bits(const Rows *x, const WideRows *w, int64_t m, Panel p, const int bits,
                                     const int zeros, int64_t k) {
    const int64_t groups = k / GROUP;
    float *lo = w->lo;
    memset(lo, 0, (size_t)m * NB * sizeof(float));
    for (int64_t g = 0; g < groups; g++) {
        const int32_t *rows = w->rows + w->start[g];
        const int64_t n = w->start[g + 1] - w->start[g];
        const __m512i *qg = (const __m512i *)(p.quads + g * 2 * QUADS);
        const __m512 scale = _mm512_loadu_ps(p.sz + g * 2 * NB);
        int64_t i = 0;
        for (; i + MR_VNNI <= n; i += MR_VNNI) wide_group_vnni(x, rows + i, MR_VNNI, qg, g, scale, bits, zeros, k, lo);
        if (n - i >= 4) wide_group_vnni(x, rows + i, 4, qg, g, scale, bits, zeros, k, lo), i += 4;
        if (n - i >= 2) wide_group_vnni(x, rows + i, 2, qg, g, scale, bits, zeros, k, lo), i += 2;
        if (n - i == 1) wide_group_vnni(x, rows + i, 1, qg, g, scale, bits, zeros, k, lo);
    }
}

/* As wide_pass, with VNNI tiles. */
__attribute__((noinline, target(VNNI_TARGET))) static void wide_pass_vnni(const Rows *x, const WideRows *w,
                                                                          int64_t m, Panel p, int bits, int zeros,
                                                                          int64_t k) {
#define WIDE(B, Z) wide_pass_vnni_bits(x, w, m, p, B, Z, k)
    WITH_GRID(bits, zeros, WIDE);
#undef WIDE
}

/* Rows 0 .. m - 1 of x against one panel; with mixed activations (wide: their lists) also the
 * wide groups' residual planes. */
INLINE void panel_rows(const Rows *x, const WideRows *wide, int64_t m, Panel p, const int bits, const int zeros,
                       int64_t k, float *y, int64_t ldy, const float *bias, const char *next) {
    if (wide) {
        if (use_vnni) wide_pass_vnni(x, wide, m, p, bits, zeros, k);
        else wide_pass(x, wide, m, p, bits, zeros, k);
        panel_tiles(x, m, p, bits, zeros, k, y, ldy, bias, next, wide->lo);
        return;
    }
    if (x->lo && use_vnni) {
        panel_tiles2_vnni(x, m, p, bits, zeros, k, y, ldy, bias, next);
        return;
    }
    if (x->lo) {
        int64_t m0 = 0;
        for (; m0 + 2 <= m; m0 += 2, next = 0) tile2(x, m0, 2, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next);
        if (m0 < m) tile2(x, m0, 1, p, bits, zeros, k, y + m0 * ldy, ldy, bias, next);
        return;
    }
    panel_tiles(x, m, p, bits, zeros, k, y, ldy, bias, next, 0);
}

static __thread __m256i *scratch;
static __thread int64_t scratch_len;

/* The panel's quads (int4, int5: unpacked into this thread's scratch) and its scales and, where
 * it has zeros of its own, its zeros as floats in that scratch (a symmetric grid's zero terms
 * are in the dots: no tile reads its zeros); .quads NULL when out of memory. */
static Panel panel_prepare(const uint8_t *q, const uint16_t *scale, const uint16_t *zero, int bits, int64_t k) {
    int64_t groups = k / GROUP, levels = bits == 8 ? 0 : k / 2;
    int64_t need = levels + groups * 4; /* 4 registers' worth of floats per group */
    if (scratch_len < need) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)need * sizeof(__m256i));
        scratch_len = scratch ? need : 0;
    }
    Panel p = {bits == 8 ? (const __m256i *)q : scratch, (const float *)(scratch + levels)};
    if (!scratch) {
        p.quads = 0;
        return p;
    }
    if (bits == 4)
        for (int64_t i = 0; i < k; i += 4) quads4(q, i, scratch + i / 2, scratch + i / 2 + 1);
    if (bits == 5)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *q5 = q + g * 10 * GROUP;
            __m256i ha, hb, *out = scratch + g * 2 * QUADS;
            high5(q5, &ha, &hb);
            for (int j = 0; j < QUADS; j++) quads5(q5, j, ha, hb, out + 2 * j, out + 2 * j + 1);
        }
    float *sz = (float *)(scratch + levels);
    for (int64_t g = 0; g < groups; g++)
        for (int h = 0; h < NB; h += 8) {
            __m256 s8 = half8(scale + g * NB + h);
            _mm256_store_ps(sz + g * 2 * NB + h, s8);
            if (zero) _mm256_store_ps(sz + g * 2 * NB + NB + h, half8(zero + g * NB + h));
        }
    return p;
}

/* This thread's share of the panels against m rows of x, inside a parallel region: threads
 * go on to their next call without waiting for each other. Every thread of the team calls it
 * (x->q NULL: this thread got no buffer for its rows, takes its panels and computes none of
 * them). Returns nonzero when its scratch cannot be allocated, or x->q is NULL. */
static int gemm(const Rows *x, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *s,
                const uint16_t *z, int bits, const float *bias, float *y, int64_t ldy) {
    int64_t groups = k / GROUP, qbytes = k * bits * 2;
    int failed = !x->q;
    WideRows lists = {0, 0, 0}, *wide = 0; /* mixed activations: this thread's copy */
    if (x->wide && !failed) {
        lists = wide_rows(x, m, groups);
        wide = &lists;
        failed = !lists.start;
    }
#pragma omp for schedule(guided) nowait
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        if (failed) continue;
        Panel p = panel_prepare(q + nb * qbytes, s + nb * groups * NB, z ? z + nb * groups * NB : 0, bits, k);
        if (!p.quads) {
            failed = 1;
            continue;
        }
        const float *b = bias ? bias + nb * NB : 0;
        /* the panel the first tile fetches as it computes: at up to 8 rows (one VNNI tile) a
         * panel computes too fast for the next one to arrive in time, so the one after it
         * (batch 2-8 decode steps 2-4% faster; at 16 rows no difference, 2026-12-03) */
        const int64_t ahead = m <= MR_VNNI ? 2 : 1;
        const char *next = nb + ahead < n_blocks ? (const char *)(q + (nb + ahead) * qbytes) : 0;
        if (nb + 1 < n_blocks) { /* the next panel's scales and zeros, which panel_prepare reads first */
            prefetch_bytes(s + (nb + 1) * groups * NB, groups * NB * 2);
            if (z) prefetch_bytes(z + (nb + 1) * groups * NB, groups * NB * 2);
        }
#define ROWS(B, Z) panel_rows(x, wide, m, p, B, Z, k, y + nb * NB, ldy, b, next)
        WITH_GRID(bits, z != 0, ROWS);
#undef ROWS
    }
    return failed;
}

/* Row i of rows from x [k], as the rows' kind of activations takes it. */
static void quantize(const Rows *rows, const float *x, int64_t k, int64_t i) {
    int64_t groups = k / GROUP;
    int8_t *lo = rows->lo ? rows->lo + i * k : 0;
    int32_t *shift = rows->shift + i * groups, *lo_shift = rows->lo_shift + i * groups;
    if (rows->wide)
        quantize_row_mixed(x, k, rows->q + i * k, rows->d + i * groups, rows->sx + i * groups, lo,
                           rows->wide + i * WIDE_WORDS(groups), shift, lo_shift);
    else quantize_row(x, k, rows->q + i * k, rows->d + i * groups, rows->sx + i * groups, lo, shift, lo_shift);
}

/* Rows of x per pass over the panels: their int8 copies stay in L2 while the panels stream. */
#define PASS_BYTES 131072

/* Up to this many inputs (m * k), as a decode step's rows have, every thread quantizes all of
 * them into a buffer of its own and goes on to the panels without waiting for the others:
 * quantizing 16 rows of 576 takes ~2.5 us on one thread, less than the barrier after splitting
 * them cost (SmolLM2's batch-8 and batch-16 decode steps 2.4-3.5% faster alone, within the
 * noise through the server; twice this limit gained nothing more). The same bytes either way. */
#define OWN_ROWS 16384

/* Same contract as qlinear (x [m, k], y [m, n_blocks * 16], bias NULL or padded), with the
 * activations quantized to int8 (planes 1), to two int8 planes, about 15 bits (planes 2), or to
 * int8 with a second plane for each row's outlier groups (planes 3, quantize_row_mixed). Unlike
 * qlinear's, z may be NULL: a symmetric grid, whose zero terms it takes in the integer dots (centred).
 * Returns 0, or -1 when its scratch memory cannot be allocated. */
int64_t qlinear_q8(const float *x, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *s,
                   const uint16_t *z, int64_t bits, const float *bias, float *y, int64_t planes) {
    int64_t ldy = n_blocks * NB, groups = k / GROUP;
    int failed = 0;
    if (m > 1 && m * k <= OWN_ROWS) {
#pragma omp parallel reduction(| : failed)
        {
            Rows own = rows_buffer(m, k, (int)planes);
            for (int64_t i = 0; own.q && i < m; i++) quantize(&own, x + i * k, k, i);
            failed |= gemm(&own, m, k, n_blocks, q, s, z, (int)bits, bias, y, ldy);
        }
        return failed ? -1 : 0;
    }
    Rows rows = rows_buffer(m, k, (int)planes);
    if (!rows.q) return -1;
    if (m == 1) {
        quantize(&rows, x, k, 0);
        if (use_vnni) gemv_vnni(&rows, k, n_blocks, q, s, z, (int)bits, bias, y);
        else gemv(&rows, k, n_blocks, q, s, z, (int)bits, bias, y);
        return 0;
    }
    const int64_t tile_rows = planes == 2 ? 6 : MR; /* whole tiles of either kind per pass */
    /* mixed rows count their int8 plane only: their second plane is read for wide groups alone,
     * and halving the rows per pass (as for int16) streamed and unpacked the panels twice as
     * often, which cost a 2048-row prefill a third more even with few wide groups */
    int64_t pass = PASS_BYTES / (k * (planes == 2 ? 2 : 1)) / tile_rows * tile_rows;
    if (pass < tile_rows) pass = tile_rows;
    /* one parallel region: quantize every row, then the passes with no barrier between them */
#pragma omp parallel reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) quantize(&rows, x + i * k, k, i);
        for (int64_t m0 = 0; m0 < m; m0 += pass) {
            int64_t n_rows = m - m0 < pass ? m - m0 : pass;
            Rows part = {.q = rows.q + m0 * k, .d = rows.d + m0 * groups, .sx = rows.sx + m0 * groups,
                         .shift = rows.shift + m0 * groups, .lo_shift = rows.lo_shift + m0 * groups,
                         .lo = rows.lo ? rows.lo + m0 * k : 0,
                         .wide = rows.wide ? rows.wide + m0 * WIDE_WORDS(groups) : 0};
            failed |= gemm(&part, n_rows, k, n_blocks, q, s, z, (int)bits, bias, y + m0 * ldy, ldy);
        }
    }
    return failed ? -1 : 0;
}
