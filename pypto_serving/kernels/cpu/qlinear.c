/* Weight-only quantized linear layers for x86-64 CPUs with AVX2, FMA and F16C.
 *
 * y[M, N] = x[M, K] @ W^T (+ bias), W stored as panels of 16 output rows:
 *   q      [N/16][K/4] quads (kernels/quant_linear.py): bits 8, 64 bytes, byte 32 h + 4 r + i
 *          = row 8 h + r at k = 4 j + i (int8); bits 4, 32 bytes, byte 4 r + i = row r in its
 *          low nibble and row r + 8 in its high one at k = 4 j + i (unsigned); bits 5, per group
 *          of 32 (320 bytes): the 8 quads' nibbles as bits 4 has them, then 64 bytes of high
 *          bits, byte 32 h + 4 r + i holding in bit j bit 4 of row 8 h + r at k = 32 g + 4 j + i;
 *   scale  [N/16][K/32][16] fp16 and zero [N/16][K/32][16] fp16 per group of 32 along K:
 *          w = q * scale + zero.
 *
 * Arithmetic (the same for every M and every tiling, so a row's result never depends on the
 * other rows of the batch, and M = 1 and M > 1 agree bit for bit): per group g,
 *   t   = fma chain of x[m, k] * q[k, n] over the group's k, from 0
 *   acc = fma(t, scale, acc); acc = fma(sum of x over the group, zero, acc)
 * Scaling once per group, not per weight, halves the multiply-adds of a decode step.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define NB 16 /* output rows per panel: two 8-lane halves */
#define GROUP 32
#define MR 6      /* rows of x per micro-tile: 12 registers of group partial sums */
#define FUSED 4   /* panels per decode iteration: 8 independent fma chains */
#define INLINE static inline __attribute__((always_inline))

INLINE __m256 half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* Levels of rows 0..7 (a) and 8..15 (b) of a panel at one k, as floats: every 4th byte of
 * the k's quad register(s), from k % 4 on. */
INLINE void levels(const uint8_t *q, int64_t k, const int bits, __m256 *a, __m256 *b) {
    /* in each 128-bit lane, bytes i, 4 + i, 8 + i, 12 + i to the lane's first 4; then the two
     * lanes' first dwords side by side: 8 rows' bytes in the low 64 bits */
    const __m256i pick = _mm256_set1_epi32(0x0C080400 + 0x01010101 * (int)(k & 3));
    const __m256i join = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
    __m256i ia, ib;
    if (bits == 4) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(q + (k >> 2) * 32));
        v = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, pick), join);
        __m256i w = _mm256_cvtepu8_epi32(_mm256_castsi256_si128(v));
        ia = _mm256_and_si256(w, _mm256_set1_epi32(15));
        ib = _mm256_srli_epi32(w, 4);
    } else if (bits == 5) {
        const uint8_t *g = q + (k >> 5) * 320;
        const int j = (int)((k >> 2) & 7);
        const __m256i one = _mm256_set1_epi32(1);
        __m256i v = _mm256_loadu_si256((const __m256i *)(g + 32 * j));
        __m256i ha = _mm256_loadu_si256((const __m256i *)(g + 256));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(g + 288));
        v = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, pick), join);
        ha = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(ha, pick), join);
        hb = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(hb, pick), join);
        __m256i w = _mm256_cvtepu8_epi32(_mm256_castsi256_si128(v));
        ha = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm256_castsi256_si128(ha)), j), one);
        hb = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm256_castsi256_si128(hb)), j), one);
        ia = _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi32(15)), _mm256_slli_epi32(ha, 4));
        ib = _mm256_or_si256(_mm256_srli_epi32(w, 4), _mm256_slli_epi32(hb, 4));
    } else {
        const uint8_t *p = q + (k >> 2) * 64;
        __m256i lo = _mm256_loadu_si256((const __m256i *)p);
        __m256i hi = _mm256_loadu_si256((const __m256i *)(p + 32));
        lo = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(lo, pick), join);
        hi = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(hi, pick), join);
        ia = _mm256_cvtepi8_epi32(_mm256_castsi256_si128(lo));
        ib = _mm256_cvtepi8_epi32(_mm256_castsi256_si128(hi));
    }
    *a = _mm256_cvtepi32_ps(ia);
    *b = _mm256_cvtepi32_ps(ib);
}

/* Sums of x over each group of 32, in a fixed order: [m][k / 32]. */
static void group_sums(const float *x, int64_t m, int64_t k, float *out) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < k / GROUP; g++) {
            float s = 0.0f;
            for (int64_t i = 0; i < GROUP; i++) s += x[r * k + g * GROUP + i];
            out[r * (k / GROUP) + g] = s;
        }
}

INLINE void store8(float *y, __m256 acc, const float *bias) {
    _mm256_storeu_ps(y, bias ? _mm256_add_ps(acc, _mm256_loadu_ps(bias)) : acc);
}

/* ---- M = 1: dequantize on the fly, FUSED panels at a time ----------------------------- */

typedef struct {
    const uint8_t *q;
    const uint16_t *scale, *zero;
} Panel;

INLINE void row_fused(const float *x, const float *sx, const Panel *p, const int np, const int bits, int64_t k_len,
                      float *y, const float *bias) {
    __m256 acc[FUSED][2];
    for (int j = 0; j < np; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < k_len / GROUP; g++) {
        __m256 t[FUSED][2];
        for (int j = 0; j < np; j++) t[j][0] = t[j][1] = _mm256_setzero_ps();
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {
            __m256 a = _mm256_broadcast_ss(x + k);
            for (int j = 0; j < np; j++) {
                __m256 qa, qb;
                levels(p[j].q, k, bits, &qa, &qb);
                t[j][0] = _mm256_fmadd_ps(a, qa, t[j][0]);
                t[j][1] = _mm256_fmadd_ps(a, qb, t[j][1]);
            }
        }
        __m256 s = _mm256_broadcast_ss(sx + g);
        for (int j = 0; j < np; j++)
            for (int h = 0; h < 2; h++) {
                acc[j][h] = _mm256_fmadd_ps(t[j][h], half8(p[j].scale + g * NB + h * 8), acc[j][h]);
                acc[j][h] = _mm256_fmadd_ps(s, half8(p[j].zero + g * NB + h * 8), acc[j][h]);
            }
    }
    for (int j = 0; j < np; j++)
        for (int h = 0; h < 2; h++) store8(y + j * NB + h * 8, acc[j][h], bias ? bias + j * NB + h * 8 : 0);
}

static void row_dispatch(const float *x, const float *sx, const Panel *p, int np, int bits, int64_t k, float *y,
                         const float *bias) {
#define ROW_CASE(n)                                              \
    case n:                                                      \
        if (bits == 4) row_fused(x, sx, p, n, 4, k, y, bias);    \
        else if (bits == 5) row_fused(x, sx, p, n, 5, k, y, bias); \
        else row_fused(x, sx, p, n, 8, k, y, bias);              \
        break;
    switch (np) { ROW_CASE(1) ROW_CASE(2) ROW_CASE(3) default: ROW_CASE(4) }
#undef ROW_CASE
}

/* ---- M > 1: levels of a panel unpacked once, reused by every row ----------------------- */

/* Group partial sums live in named registers (an array would be spilled every iteration). */
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define DECL(r) __m256 t##r##0 = zero8, t##r##1 = zero8, acc##r##0 = zero8, acc##r##1 = zero8;
#define RESET(r) t##r##0 = t##r##1 = zero8;
#define FMA(r)                                                  \
    if (mr > r) {                                               \
        __m256 a = _mm256_broadcast_ss(x + r * ldx + k);        \
        t##r##0 = _mm256_fmadd_ps(a, w0, t##r##0);              \
        t##r##1 = _mm256_fmadd_ps(a, w1, t##r##1);              \
    }
#define SCALE(r)                                                                  \
    if (mr > r) {                                                                 \
        __m256 s = _mm256_broadcast_ss(sx + r * groups + g);                      \
        acc##r##0 = _mm256_fmadd_ps(s, ze0, _mm256_fmadd_ps(t##r##0, sc0, acc##r##0)); \
        acc##r##1 = _mm256_fmadd_ps(s, ze1, _mm256_fmadd_ps(t##r##1, sc1, acc##r##1)); \
    }
#define STORE(r)                                                         \
    if (mr > r) {                                                        \
        store8(y + r * ldy, acc##r##0, bias);                            \
        store8(y + r * ldy + 8, acc##r##1, bias ? bias + 8 : 0);         \
    }

/* mr (<= MR, a constant after inlining) rows of x against an unpacked panel lv [K][16]. */
INLINE void tile(const float *x, int64_t ldx, const float *sx, const int mr, const float *lv,
                 const uint16_t *scale, const uint16_t *zero, int64_t k_len, float *y, int64_t ldy,
                 const float *bias) {
    const __m256 zero8 = _mm256_setzero_ps();
    const int64_t groups = k_len / GROUP;
    ROWS(DECL)
    for (int64_t g = 0; g < groups; g++) {
        ROWS(RESET)
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {
            __m256 w0 = _mm256_load_ps(lv + k * NB), w1 = _mm256_load_ps(lv + k * NB + 8);
            ROWS(FMA)
        }
        __m256 sc0 = half8(scale + g * NB), sc1 = half8(scale + g * NB + 8);
        __m256 ze0 = half8(zero + g * NB), ze1 = half8(zero + g * NB + 8);
        ROWS(SCALE)
    }
    ROWS(STORE)
}

static void tile_dispatch(const float *x, int64_t ldx, const float *sx, int mr, const float *lv,
                          const uint16_t *scale, const uint16_t *zero, int64_t k, float *y, int64_t ldy,
                          const float *bias) {
#define TILE_CASE(n) \
    case n: tile(x, ldx, sx, n, lv, scale, zero, k, y, ldy, bias); break;
    switch (mr) { TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) default: TILE_CASE(MR) }
#undef TILE_CASE
}

static void unpack_levels(const uint8_t *q, int bits, int64_t k_len, float *out) {
    for (int64_t k = 0; k < k_len; k++) {
        __m256 a, b;
        if (bits == 4) levels(q, k, 4, &a, &b);
        else if (bits == 5) levels(q, k, 5, &a, &b);
        else levels(q, k, 8, &a, &b);
        _mm256_store_ps(out + k * NB, a);
        _mm256_store_ps(out + k * NB + 8, b);
    }
}

static __thread float *scratch;
static __thread int64_t scratch_len;

static float *panel_scratch(int64_t k) {
    if (scratch_len < k * NB) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)k * NB * sizeof(float));
        scratch_len = k * NB;
    }
    return scratch;
}

/* Rows of x per pass over the panels: that many rows of x stay in L2 while panels stream. */
static int64_t rows_per_pass(int64_t k) {
    int64_t rows = (65536 / k) / MR * MR;
    return rows < MR ? MR : rows;
}

static void gemm(const float *x, const float *sx, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q,
                 const uint16_t *s, const uint16_t *z, int bits, const float *bias, float *y, int64_t ldy) {
    int64_t groups = k / GROUP, qbytes = k * bits * 2;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        float *lv = panel_scratch(k);
        unpack_levels(q + nb * qbytes, bits, k, lv);
        for (int64_t m0 = 0; m0 < m; m0 += MR) {
            int mr = m - m0 < MR ? (int)(m - m0) : MR;
            tile_dispatch(x + m0 * k, k, sx + m0 * groups, mr, lv, s + nb * groups * NB, z + nb * groups * NB, k,
                          y + m0 * ldy + nb * NB, ldy, bias ? bias + nb * NB : 0);
        }
    }
}

static void gemv(const float *x, const float *sx, int64_t k, int64_t n_blocks, const uint8_t *q,
                 const uint16_t *s, const uint16_t *z, int bits, const float *bias, float *y) {
    int64_t groups = k / GROUP, qbytes = k * bits * 2;
#pragma omp parallel for schedule(static)
    for (int64_t it = 0; it < (n_blocks + FUSED - 1) / FUSED; it++) {
        int64_t nb = it * FUSED;
        int np = n_blocks - nb < FUSED ? (int)(n_blocks - nb) : FUSED;
        Panel p[FUSED];
        for (int j = 0; j < np; j++) {
            p[j].q = q + (nb + j) * qbytes;
            p[j].scale = s + (nb + j) * groups * NB;
            p[j].zero = z + (nb + j) * groups * NB;
        }
        row_dispatch(x, sx, p, np, bits, k, y + nb * NB, bias ? bias + nb * NB : 0);
    }
}

static __thread float *sums;
static __thread int64_t sums_len;

/* x [m, k] fp32 contiguous, y [m, n_blocks * 16] fp32 contiguous; bias [n_blocks * 16] or NULL. */
void qlinear(const float *x, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *s,
             const uint16_t *z, int64_t bits, const float *bias, float *y) {
    int64_t ldy = n_blocks * NB, pass = rows_per_pass(k);
    if (sums_len < m * (k / GROUP)) {
        free(sums);
        sums_len = m * (k / GROUP);
        sums = malloc((size_t)sums_len * sizeof(float));
    }
    float *sx = sums;
    group_sums(x, m, k, sx);
    if (m == 1) {
        gemv(x, sx, k, n_blocks, q, s, z, (int)bits, bias, y);
        return;
    }
    for (int64_t m0 = 0; m0 < m; m0 += pass) {
        int64_t rows = m - m0 < pass ? m - m0 : pass;
        gemm(x + m0 * k, sx + m0 * (k / GROUP), rows, k, n_blocks, q, s, z, (int)bits, bias, y + m0 * ldy, ldy);
    }
}

/* Rows `ids` [t] of the weight (an embedding table stored like a linear's weight): out [t, k],
 * each element q * scale + zero rounded once. */
void qgather(const int64_t *ids, int64_t t, int64_t k, const uint8_t *q, const uint16_t *s, const uint16_t *z,
             int64_t bits, float *out) {
    int64_t groups = k / GROUP, qbytes = k * bits * 2;
    for (int64_t i = 0; i < t; i++) {
        int64_t nb = ids[i] / NB, lane = ids[i] % NB;
        const uint8_t *pq = q + nb * qbytes;
        for (int64_t kk = 0; kk < k; kk++) {
            int64_t g = (nb * groups + kk / GROUP) * NB + lane;
            int64_t quad = kk / 4 * bits * 8, row = lane % 8 * 4 + kk % 4;
            int qv;
            if (bits == 5) {
                const uint8_t *pg = pq + kk / GROUP * 320;
                int j = (int)(kk / 4 % 8), nib = pg[32 * j + row];
                qv = (lane < 8 ? nib & 15 : nib >> 4) | (pg[256 + lane / 8 * 32 + row] >> j & 1) << 4;
            } else {
                qv = bits == 4 ? (lane < 8 ? pq[quad + row] & 15 : pq[quad + row] >> 4)
                               : ((const int8_t *)pq)[quad + lane / 8 * 32 + row];
            }
            out[i * k + kk] = __builtin_fmaf((float)qv, _cvtsh_ss(s[g]), _cvtsh_ss(z[g]));
        }
    }
}
