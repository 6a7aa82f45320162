/* Packed linear layers with int8 activations, for x86-64 with AVX2 (what llama.cpp does on the
 * CPU: its Q4_1 x Q8_1 dot products).
 *
 * The weights are the panels of qlinear.c, read as they are stored (16 output rows per panel,
 * int4 levels 0..15 with scale and zero, or int8 levels with scale). Each row of x is quantized
 * per group of 32 along K: d = max|x| / 127, xq = round(x * 127 / max|x|) in [-127, 127], and
 * the group's plain float sum sx is kept for the zero term. Per group g and output n,
 *   dot = sum of xq[k] * q[k, n]           (integers, exact: the order cannot matter)
 *   acc = fma(dot, d * scale, acc); acc = fma(sx, zero, acc)
 * in the same order for every tiling, so a row's result never depends on the batch (M = 1
 * and M > 1 agree bit for bit), and the int8 x uint8 products (vpmaddubsw) do 32 multiply-adds
 * per instruction where the fp32 kernels do 8.
 *
 * Dot products use "k-quads": a 32-bit lane holds one output row's levels at 4 consecutive k,
 * so vpmaddubsw + vpmaddwd sum them against the same 4 bytes of x broadcast to every lane.
 * The stored panels hold one k per 8 or 16 bytes; `quads4` / `quads8` transpose 4 k of a
 * panel into two registers of quads (rows 0..7 and rows 8..15).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 16
#define GROUP 32
#define QUADS (GROUP / 4)
#define MR 6  /* rows of x per tile, int4 weights: 12 accumulators + 2 weights + x */
#define MR8 4 /* int8 weights need two more registers per quad (|w| and sign-applied x) */
#define INLINE static inline __attribute__((always_inline))

INLINE __m256 half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* Within each 128-bit lane: byte pairs (row j at k, row j at k + 1) from two 8-byte k rows. */
INLINE __m256i pair_rows(__m256i v) {
    const __m256i c = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                       0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    return _mm256_shuffle_epi8(v, c);
}

/* Lane 0 holds pairs (k, k+1) of rows 0..7, lane 1 pairs (k+2, k+3): -> quads of rows 0..7. */
INLINE __m256i pairs_to_quads(__m256i v) {
    const __m256i c = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                       0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    return _mm256_shuffle_epi8(_mm256_permute4x64_epi64(v, 0xD8), c);
}

/* 4-bit panel, k .. k+3 (8 bytes per k: byte j = row j low nibble, row j + 8 high). */
INLINE void quads4(const uint8_t *q, int64_t k, __m256i *a, __m256i *b) {
    __m256i v = pairs_to_quads(pair_rows(_mm256_loadu_si256((const __m256i *)(q + k * 8))));
    const __m256i low = _mm256_set1_epi8(15);
    *a = _mm256_and_si256(v, low);
    *b = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
}

/* 8-bit panel, k .. k+3 (16 bytes per k: byte j = row j). */
INLINE void quads8(const uint8_t *q, int64_t k, __m256i *a, __m256i *b) {
    __m256i c0 = _mm256_loadu_si256((const __m256i *)(q + k * 16));      /* k | k+1 */
    __m256i c1 = _mm256_loadu_si256((const __m256i *)(q + k * 16 + 32)); /* k+2 | k+3 */
    __m256i p0 = _mm256_permute2x128_si256(c0, c1, 0x20), p1 = _mm256_permute2x128_si256(c0, c1, 0x31);
    *a = pairs_to_quads(_mm256_unpacklo_epi8(p0, p1));
    *b = pairs_to_quads(_mm256_unpackhi_epi8(p0, p1));
}

INLINE __m256i quad_of(const int8_t *xq) {
    int32_t v;
    memcpy(&v, xq, 4);
    return _mm256_set1_epi32(v);
}

/* int4: 16-bit partial sums over a group stay below 8 * 2 * 15 * 127 = 30480, so they add up
 * in 16 bits and widen once per group. int8: widen every quad (2 * 127 * 127 fits 16 bits). */
INLINE __m256i dot4(__m256i acc16, __m256i w, __m256i x) { return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, x)); }

INLINE __m256i dot8(__m256i acc32, __m256i w, __m256i x) {
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc32, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

INLINE __m256i widen(__m256i acc, int bits) {
    return bits == 4 ? _mm256_madd_epi16(acc, _mm256_set1_epi16(1)) : acc;
}

INLINE __m256 group_step(__m256 acc, __m256i dot, float d, float sx, const uint16_t *scale, const uint16_t *zero) {
    __m256 ds = _mm256_mul_ps(_mm256_set1_ps(d), half8(scale));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ds, acc);
    return _mm256_fmadd_ps(_mm256_set1_ps(sx), half8(zero), acc);
}

/* ---- activations ---- */

/* Row r of x -> xq [k], d [k / 32], sx [k / 32]. */
static void quantize_row(const float *x, int64_t k, int8_t *xq, float *d, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < k / GROUP; g++) {
        const float *p = x + g * GROUP;
        __m256 v[4], m = _mm256_setzero_ps(), s = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(p + i * 8);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
            s = _mm256_add_ps(s, v[i]);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
        float amax = _mm_cvtss_f32(m4);
        d[g] = amax / 127.0f;
        sx[g] = _mm_cvtss_f32(s4);
        __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i i[4];
        for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)); /* nearest even */
        __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        /* packs interleaves 128-bit lanes: dwords 0 4 1 5 2 6 3 7 back in order */
        w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + g * GROUP), w);
    }
}

typedef struct {
    int8_t *q;
    float *d, *sx;
} Rows;

static __thread void *act_buf;
static __thread size_t act_len;

/* Quantized rows of x in a per-thread buffer (reused across calls), or .q NULL when out of memory. */
static Rows quantize(const float *x, int64_t m, int64_t k) {
    size_t need = (size_t)m * k + 2 * (size_t)m * (k / GROUP) * sizeof(float) + 64;
    if (act_len < need) {
        free(act_buf);
        act_buf = malloc(need);
        act_len = act_buf ? need : 0;
    }
    Rows r = {0, 0, 0};
    if (!act_buf) return r;
    r.d = act_buf;
    r.sx = r.d + m * (k / GROUP);
    r.q = (int8_t *)(r.sx + m * (k / GROUP));
#pragma omp parallel for schedule(static) if (m > 8)
    for (int64_t i = 0; i < m; i++)
        quantize_row(x + i * k, k, r.q + i * k, r.d + i * (k / GROUP), r.sx + i * (k / GROUP));
    return r;
}

/* ---- M = 1: a panel's quads built on the fly ---- */

INLINE void store8(float *y, __m256 acc, const float *bias) {
    _mm256_storeu_ps(y, bias ? _mm256_add_ps(acc, _mm256_loadu_ps(bias)) : acc);
}

INLINE void row_panel(const Rows *x, const uint8_t *q, const uint16_t *scale, const uint16_t *zero, const int bits,
                      int64_t k_len, float *y, const float *bias) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t g = 0; g < k_len / GROUP; g++) {
        __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k += 4) {
            __m256i a, b, xv = quad_of(x->q + k);
            if (bits == 4) {
                quads4(q, k, &a, &b);
                t0 = dot4(t0, a, xv);
                t1 = dot4(t1, b, xv);
            } else {
                quads8(q, k, &a, &b);
                t0 = dot8(t0, a, xv);
                t1 = dot8(t1, b, xv);
            }
        }
        acc0 = group_step(acc0, widen(t0, bits), x->d[g], x->sx[g], scale + g * NB, zero + g * NB);
        acc1 = group_step(acc1, widen(t1, bits), x->d[g], x->sx[g], scale + g * NB + 8, zero + g * NB + 8);
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
        if (bits == 4) row_panel(x, q + nb * qbytes, s + nb * groups * NB, z + nb * groups * NB, 4, k, y + nb * NB, bb);
        else row_panel(x, q + nb * qbytes, s + nb * groups * NB, z + nb * groups * NB, 8, k, y + nb * NB, bb);
    }
}

/* ---- M > 1: a panel's quads built once into scratch [k / 4][2] and reused by every row ---- */

#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define DECL(r) __m256i t##r##0, t##r##1;
#define RESET(r) t##r##0 = t##r##1 = _mm256_setzero_si256();
#define DOT(r)                                                    \
    if (mr > r) {                                                 \
        __m256i xv = quad_of(x->q + (m0 + r) * k_len + k);        \
        if (bits == 4) {                                          \
            t##r##0 = dot4(t##r##0, a, xv);                       \
            t##r##1 = dot4(t##r##1, b, xv);                       \
        } else {                                                  \
            t##r##0 = dot8(t##r##0, a, xv);                       \
            t##r##1 = dot8(t##r##1, b, xv);                       \
        }                                                         \
        __asm__("" : "+x"(t##r##0), "+x"(t##r##1));               \
    }
#define SCALE(r)                                                                                         \
    if (mr > r) {                                                                                        \
        int64_t i = (m0 + r) * groups + g;                                                               \
        acc[r][0] = group_step(acc[r][0], widen(t##r##0, bits), x->d[i], x->sx[i], scale + g * NB, zero + g * NB); \
        acc[r][1] = group_step(acc[r][1], widen(t##r##1, bits), x->d[i], x->sx[i], scale + g * NB + 8,         \
                               zero + g * NB + 8);                                                     \
    }

INLINE void tile(const Rows *x, int64_t m0, const int mr, const __m256i *quads, const uint16_t *scale,
                 const uint16_t *zero, const int bits, int64_t k_len, float *y, int64_t ldy, const float *bias) {
    const int64_t groups = k_len / GROUP;
    __m256 acc[MR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    ROWS(DECL)
    for (int64_t g = 0; g < groups; g++) {
        ROWS(RESET)
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k += 4) {
            __m256i a = _mm256_load_si256(quads + k / 2), b = _mm256_load_si256(quads + k / 2 + 1);
            ROWS(DOT)
        }
        ROWS(SCALE)
    }
    for (int r = 0; r < mr; r++) {
        store8(y + r * ldy, acc[r][0], bias);
        store8(y + r * ldy + 8, acc[r][1], bias ? bias + 8 : 0);
    }
}

static void tile_dispatch(const Rows *x, int64_t m0, int mr, const __m256i *quads, const uint16_t *scale,
                          const uint16_t *zero, int bits, int64_t k, float *y, int64_t ldy, const float *bias) {
#define TILE_CASE(n)                                                            \
    case n:                                                                     \
        if (bits == 4) tile(x, m0, n, quads, scale, zero, 4, k, y, ldy, bias);  \
        else tile(x, m0, n < MR8 ? n : MR8, quads, scale, zero, 8, k, y, ldy, bias); \
        break;
    switch (mr) { TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) default: TILE_CASE(MR) }
#undef TILE_CASE
}

static __thread __m256i *scratch;
static __thread int64_t scratch_len;

static __m256i *panel_quads(const uint8_t *q, int bits, int64_t k) {
    if (scratch_len < k / 2) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)k / 2 * sizeof(__m256i));
        scratch_len = scratch ? k / 2 : 0;
    }
    if (!scratch) return 0;
    for (int64_t i = 0; i < k; i += 4) {
        if (bits == 4) quads4(q, i, scratch + i / 2, scratch + i / 2 + 1);
        else quads8(q, i, scratch + i / 2, scratch + i / 2 + 1);
    }
    return scratch;
}

static int gemm(const Rows *x, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *s,
                const uint16_t *z, int bits, const float *bias, float *y, int64_t ldy) {
    int64_t groups = k / GROUP, qbytes = k * bits * 2;
    int failed = 0;
#pragma omp parallel for schedule(guided) reduction(| : failed)
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        __m256i *quads = panel_quads(q + nb * qbytes, bits, k);
        if (!quads) {
            failed = 1;
            continue;
        }
        const int rows = bits == 4 ? MR : MR8;
        for (int64_t m0 = 0; m0 < m; m0 += rows) {
            int mr = m - m0 < rows ? (int)(m - m0) : rows;
            tile_dispatch(x, m0, mr, quads, s + nb * groups * NB, z + nb * groups * NB, bits, k,
                          y + m0 * ldy + nb * NB, ldy, bias ? bias + nb * NB : 0);
        }
    }
    return failed;
}

/* Rows of x per pass over the panels: their int8 copies stay in L2 while the panels stream. */
#define PASS_BYTES 131072

/* Same contract as qlinear (x [m, k], y [m, n_blocks * 16], bias NULL or padded), int8
 * activations. Returns 0, or -1 when its scratch memory cannot be allocated. */
int64_t qlinear_q8(const float *x, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *s,
                   const uint16_t *z, int64_t bits, const float *bias, float *y) {
    Rows rows = quantize(x, m, k);
    if (!rows.q) return -1;
    int64_t ldy = n_blocks * NB;
    if (m == 1) {
        gemv(&rows, k, n_blocks, q, s, z, (int)bits, bias, y);
        return 0;
    }
    int64_t pass = PASS_BYTES / k / MR * MR;
    if (pass < MR) pass = MR;
    for (int64_t m0 = 0; m0 < m; m0 += pass) {
        int64_t n_rows = m - m0 < pass ? m - m0 : pass;
        Rows part = {rows.q + m0 * k, rows.d + m0 * (k / GROUP), rows.sx + m0 * (k / GROUP)};
        if (gemm(&part, n_rows, k, n_blocks, q, s, z, (int)bits, bias, y + m0 * ldy, ldy)) return -1;
    }
    return 0;
}
