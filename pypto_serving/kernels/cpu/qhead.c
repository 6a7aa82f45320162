/* int8 panels against int16 activations, for the lm_head (x86-64 with AVX2).
 *
 * The head's error goes straight into the logits, so it does not take the int8 activations of
 * the other linears; float activations (qlinear.c) cost a shuffle, two conversions and an fma
 * per 8 multiply-adds, and at batch 1 that, not memory, bounded the head. Here each row of x is
 * quantized per group of 32 along K to int16 (d = max|x| / 32767: ~15 bits, an error far below
 * the weights' own), the int8 levels are sign-extended to int16, and vpmaddwd sums pairs of
 * products exactly in int32 (32 products of at most 32767 * 127 stay below 2^31):
 *   dot = sum of xq[k] * q[k, n]                 (integers: no order can change it)
 *   acc = fma(dot, d * scale, acc)               (per group, in the same order for every M)
 * so a row's logits are the same alone or in any batch, bit for bit. int8 panels are
 * symmetric (zero = 0), so there is no zero term.
 *
 * Layout (kernels/quant_linear.py): a quad is 4 k of 8 rows, byte 4 r + i = row r at k + i;
 * sign-extending its low 16 bytes gives rows 0..3 as int16 [r][i], and vpmaddwd against the
 * quad's 4 inputs repeated gives [r0 (i 0,1), r0 (i 2,3), r1 ...] per 128-bit lane; a group's
 * four such sums are folded with vphaddd and put back in row order at its end.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "group_max.h"
#include "prefetch.h"
#include "vnni.h"

#define NB 16
#define GROUP 32
#define QUADS (GROUP / 4)
#define MR 4 /* rows of x per tile: 2 sums + 2 accumulators each, beside 2 weight registers */
#define INLINE static inline __attribute__((always_inline))

INLINE __m256 half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* x [k] -> xq [k] int16 and d [k / 32], nearest even, as the int8 kernels round. */
static void quantize_row16(const float *x, int64_t k, int16_t *xq, float *d) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m256 v[4];
        float amax = group_max(x + g * GROUP, v);
        d[g] = amax / 32767.0f;
        __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
        for (int i = 0; i < 4; i += 2) {
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
            __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], inv));
            /* packs interleaves 128-bit lanes: 64-bit blocks 0 2 1 3 back in order */
            __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
            _mm256_storeu_si256((__m256i *)(xq + g * GROUP + i * 8), w);
        }
    }
}

/* The quad's 4 inputs in every 64-bit block. */
INLINE __m256i quad16(const int16_t *xq) {
    int64_t v;
    memcpy(&v, xq, 8);
    return _mm256_set1_epi64x(v);
}

/* 8 rows' int32 dots, [r0 r0 r1 r1 | r2 r2 r3 r3] and the same for rows 4..7, in row order. */
INLINE __m256i fold(__m256i lo, __m256i hi) {
    return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(lo, hi), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

INLINE void store8(float *y, __m256 acc, const float *bias) {
    _mm256_storeu_ps(y, bias ? _mm256_add_ps(acc, _mm256_loadu_ps(bias)) : acc);
}

INLINE __m256 group_step(__m256 acc, __m256i dot, float d, const uint16_t *scale) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_set1_ps(d), half8(scale)), acc);
}

INLINE void widen_quad(const int8_t *q, __m256i *lo, __m256i *hi) {
    __m256i v = _mm256_loadu_si256((const __m256i *)q);
    *lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
    *hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
}

/* ---- M = 1: each panel's quads widened as they stream in ---- */

static void row_panel(const int16_t *xq, const float *d, const int8_t *q, const uint16_t *scale, const float *bias,
                      int64_t k_len,
                      float *y) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < k_len / GROUP; g++) {
        /* as qdot.c's batch-1 rows: the group AHEAD_GROUPS on (an int8 group: a line per quad)
         * and its scales; without it the head took ~10% longer (SmolLM2) to ~14% (Qwen) */
        fetch_ahead(q, scale, 0, g, QUADS);
        __m256i t[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                        _mm256_setzero_si256()};
#pragma GCC unroll 8
        for (int j = 0; j < QUADS; j++) {
            int64_t k = g * GROUP + 4 * j;
            __m256i xv = quad16(xq + k);
            for (int h = 0; h < 2; h++) {
                __m256i lo, hi;
                widen_quad(q + k * 16 + h * 32, &lo, &hi);
                t[2 * h] = _mm256_add_epi32(t[2 * h], _mm256_madd_epi16(lo, xv));
                t[2 * h + 1] = _mm256_add_epi32(t[2 * h + 1], _mm256_madd_epi16(hi, xv));
            }
        }
        for (int h = 0; h < 2; h++) acc[h] = group_step(acc[h], fold(t[2 * h], t[2 * h + 1]), d[g], scale + g * NB + h * 8);
    }
    store8(y, acc[0], bias);
    store8(y + 8, acc[1], bias ? bias + 8 : 0);
}

/* ---- M > 1: tiles of MR rows per half panel, each quad widened as the tile reads it ---- */

/* mr rows of x against rows 8 h .. 8 h + 7 of the int8 panel w (widening the panel once into
 * scratch measured slower: with the rows' int16 copies it overflows L1) */
INLINE void tile(const int16_t *xq, const float *d, const int mr, const int8_t *w, const int h,
                 const uint16_t *scale, const float *bias, int64_t k_len, float *y, int64_t ldy, const char *next) {
    const int64_t groups = k_len / GROUP;
    __m256 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i t[MR][2];
        for (int r = 0; r < mr; r++) t[r][0] = t[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < QUADS; j++) {
            int64_t k = g * GROUP + 4 * j;
            __m256i lo, hi;
            widen_quad(w + k * 16 + h * 32, &lo, &hi);
            for (int r = 0; r < mr; r++) {
                __m256i xv = quad16(xq + r * k_len + k);
                t[r][0] = _mm256_add_epi32(t[r][0], _mm256_madd_epi16(lo, xv));
                t[r][1] = _mm256_add_epi32(t[r][1], _mm256_madd_epi16(hi, xv));
                __asm__("" : "+x"(t[r][0]), "+x"(t[r][1]));
            }
        }
        prefetch_group(next, g, QUADS); /* an int8 group: a line per quad */
        for (int r = 0; r < mr; r++) acc[r] = group_step(acc[r], fold(t[r][0], t[r][1]), d[r * groups + g], scale + g * NB + h * 8);
    }
    for (int r = 0; r < mr; r++) store8(y + r * ldy + h * 8, acc[r], bias ? bias + h * 8 : 0);
}

/* ---- AVX-512 VNNI (qdot.c's use_vnni) ----
 * A quad's 16 rows sign-extended to int16 fill two 512-bit registers, and vpdpwssd adds each
 * 32-bit lane's two products to its sum in one instruction (AVX2: vpmaddwd, then vpaddd, per 8
 * rows). The integer dots and the epilogue are tile's, so the results are its bit for bit. */
/* mr rows of x against all 16 rows of the int8 panel w */
VNNI_INLINE void tile_vnni(const int16_t *xq, const float *d, const int mr, const int8_t *w, const uint16_t *scale,
                           const float *bias, int64_t k_len, float *y, int64_t ldy, const char *next) {
    const int64_t groups = k_len / GROUP;
    /* lanes 2 r and 2 r + 1 of a half's sums are row r's two pairs: gathered into row order */
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m512 acc[MR_VNNI];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i t[MR_VNNI][2];
        for (int r = 0; r < mr; r++) t[r][0] = t[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < QUADS; j++) {
            int64_t k = g * GROUP + 4 * j;
            __m512i lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k * 16)));
            __m512i hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k * 16 + 32)));
            for (int r = 0; r < mr; r++) {
                int64_t v;
                memcpy(&v, xq + r * k_len + k, 8);
                __m512i xv = _mm512_set1_epi64(v);
                t[r][0] = _mm512_dpwssd_epi32(t[r][0], lo, xv);
                t[r][1] = _mm512_dpwssd_epi32(t[r][1], hi, xv);
            }
        }
        prefetch_group(next, g, QUADS);
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + g * NB)));
        for (int r = 0; r < mr; r++) {
            __m512i dot = _mm512_add_epi32(_mm512_permutex2var_epi32(t[r][0], even, t[r][1]),
                                           _mm512_permutex2var_epi32(t[r][0], odd, t[r][1]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_set1_ps(d[r * groups + g]), s), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++)
        _mm512_storeu_ps(y + r * ldy, bias ? _mm512_add_ps(acc[r], _mm512_loadu_ps(bias)) : acc[r]);
}

__attribute__((noinline, target(VNNI_TARGET))) static void panel_rows_vnni(const int16_t *xq, const float *d,
                                                                           int64_t m, const int8_t *w,
                                                                           const uint16_t *scale, const float *bias,
                                                                           int64_t k, float *y, int64_t ldy,
                                                                           const char *next) {
    const int64_t groups = k / GROUP;
    int64_t m0 = 0;
    for (; m0 + MR_VNNI <= m; m0 += MR_VNNI, next = 0)
        tile_vnni(xq + m0 * k, d + m0 * groups, MR_VNNI, w, scale, bias, k, y + m0 * ldy, ldy, next);
    if (m - m0 >= 4) {
        tile_vnni(xq + m0 * k, d + m0 * groups, 4, w, scale, bias, k, y + m0 * ldy, ldy, next);
        m0 += 4, next = 0;
    }
    if (m - m0 >= 2) {
        tile_vnni(xq + m0 * k, d + m0 * groups, 2, w, scale, bias, k, y + m0 * ldy, ldy, next);
        m0 += 2, next = 0;
    }
    if (m0 < m) tile_vnni(xq + m0 * k, d + m0 * groups, 1, w, scale, bias, k, y + m0 * ldy, ldy, next);
}

INLINE void panel_rows(const int16_t *xq, const float *d, int64_t m, const int8_t *w, const uint16_t *scale,
                       const float *bias, int64_t k, float *y, int64_t ldy, const char *next) {
    const int64_t groups = k / GROUP;
    if (use_vnni) {
        panel_rows_vnni(xq, d, m, w, scale, bias, k, y, ldy, next);
        return;
    }
    for (int h = 0; h < 2; h++) {
        int64_t m0 = 0;
        for (; m0 + MR <= m; m0 += MR, next = 0)
            tile(xq + m0 * k, d + m0 * groups, MR, w, h, scale, bias, k, y + m0 * ldy, ldy, next);
        const int64_t left = m - m0;
        if (left == 3) tile(xq + m0 * k, d + m0 * groups, 3, w, h, scale, bias, k, y + m0 * ldy, ldy, next);
        else if (left == 2) tile(xq + m0 * k, d + m0 * groups, 2, w, h, scale, bias, k, y + m0 * ldy, ldy, next);
        else if (left == 1) tile(xq + m0 * k, d + m0 * groups, 1, w, h, scale, bias, k, y + m0 * ldy, ldy, next);
        next = 0;
    }
}
_Static_assert(MR == 4, "panel_rows tiles the last 1 to 3 rows");

/* Rows of x per pass over the panels: their int16 copies stay in L2 while the panels stream. */
#define PASS_BYTES 131072

static __thread void *act_buf;
static __thread size_t act_len;

/* The calling thread's scratch (qlinear_a16's and qhead_greedy's, kept across calls) of at
 * least `need` bytes, or NULL. */
static void *scratch(size_t need) {
    if (act_len < need) {
        free(act_buf);
        act_buf = malloc(need);
        act_len = act_buf ? need : 0;
    }
    return act_buf;
}

/* y [m, n_blocks * 16] = x [m, k] against the int8 panels q / scale (bits 8 only), with x
 * quantized to int16 per group of 32, plus bias (NULL, or padded to whole panels). Returns 0,
 * or -1 when scratch memory cannot be had. */
int64_t qlinear_a16(const float *x, int64_t m, int64_t k, int64_t n_blocks, const uint8_t *q,
                    const uint16_t *scale, const float *bias, float *y) {
    const int64_t groups = k / GROUP, ldy = n_blocks * NB, qbytes = k * NB;
    float *d = scratch((size_t)m * k * sizeof(int16_t) + (size_t)m * groups * sizeof(float) + 64);
    if (!d) return -1;
    int16_t *xq = (int16_t *)(d + m * groups);
    if (m == 1) {
        quantize_row16(x, k, xq, d);
#pragma omp parallel for schedule(guided)
        for (int64_t nb = 0; nb < n_blocks; nb++)
            row_panel(xq, d, (const int8_t *)q + nb * qbytes, scale + nb * groups * NB, bias ? bias + nb * NB : 0,
                      k, y + nb * NB);
        return 0;
    }
    int64_t pass = PASS_BYTES / (k * (int64_t)sizeof(int16_t)) / MR * MR;
    if (pass < MR) pass = MR;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) quantize_row16(x + i * k, k, xq + i * k, d + i * groups);
        for (int64_t m0 = 0; m0 < m; m0 += pass) {
            int64_t rows = m - m0 < pass ? m - m0 : pass;
#pragma omp for schedule(guided) nowait
            for (int64_t nb = 0; nb < n_blocks; nb++) {
                const char *next = nb + 1 < n_blocks ? (const char *)(q + (nb + 1) * qbytes) : 0;
                panel_rows(xq + m0 * k, d + m0 * groups, rows, (const int8_t *)q + nb * qbytes, scale + nb * groups * NB,
                           bias ? bias + nb * NB : 0, k, y + m0 * ldy + nb * NB, ldy, next);
            }
        }
    }
    return 0;
}

/* ---- Greedy rows: int8 activations find the candidates, the int16 logits decide ----
 *
 * A row that wants only its argmax (greedy, nothing processing its logits) need not have
 * every int16 logit. With int8 activations (d8 = max|x| / 127 per group) vpdpbusd takes the
 * int8 levels as they are, one instruction per quad and row with the row's 4 inputs as its
 * broadcast memory operand (the int16 tiles take two and a widening), once the levels are
 * unsigned: w + 128 (the sign bit flipped), which adds 128 * sum(xq) to a group's sum, taken
 * off again (the dot stays exact). Those logits L8 are off the int16 head's L16 by at most
 *     |L8 - f| + |L16 - f| <= sum over groups g of (d8_g + d16_g) / 2 * sum_{k in g} |w_k|
 *                          <= c * l1max,  c = sum_g max|x_g| * (1/254 + 1/65534)
 * (f the float product; l1max the output's largest group sum of |w|, `qhead_l1max`), a bound
 * widened by 0.1% a group for the float rounding of both. So the int16 argmax is among the
 * outputs whose L8 + c * l1max reaches the row's floor, max(L8 - c * l1max): a few per row
 * (SmolLM2: a median of 11 of 49152 over 700 positions of text, at most 536; Qwen2.5-Coder-0.5B
 * 3 and 122 of 151936). No L8 is stored: each tile's epilogue raises its thread's floor for
 * the row and keeps the outputs that reach it (an output below a floor is below the final
 * one: floors only rise; a list that fills doubles), the rows' lists are merged under the
 * final floor, and the int16 logits of the panels that hold what is left (the batch-1
 * kernel's, the same bit for bit as a batch's) give exactly the argmax, first index on ties,
 * that qlinear_a16's logits give torch.argmax. A row whose logits are flat within the bound
 * (more than a fifth of the outputs left) is left to the caller. */

#define GREEDY_SLACK_PER_GROUP 1e-3f
#define GREEDY_MAX_ABS 1e15f /* larger inputs (or NaN, inf): the caller takes the whole path */
#define GREEDY_KEPT 1024 /* room for a thread's outputs of a row, doubled when those above its floor fill it */
#define GREEDY_MAX_SHARE 5 /* a row with more than n / 5 candidates takes the int16 head (its logits) */

/* One thread's candidates for one row: its floor and the outputs that reached it. */
typedef struct {
    float floor;
    int32_t count, capacity, overflow, owned; /* owned: index and upper were grown (malloc) */
    int32_t *index;
    float *upper;
} Kept;

/* Twice the room, or overflow set when it cannot be had. */
static void grow(Kept *k) {
    int32_t *index = malloc(2 * (size_t)k->capacity * (sizeof(int32_t) + sizeof(float)));
    if (!index) {
        k->overflow = 1;
        return;
    }
    float *upper = (float *)(index + 2 * (size_t)k->capacity);
    memcpy(index, k->index, (size_t)k->count * sizeof *index);
    memcpy(upper, k->upper, (size_t)k->count * sizeof *upper);
    if (k->owned) free(k->index);
    k->index = index;
    k->upper = upper;
    k->capacity *= 2;
    k->owned = 1;
}

/* Keeps the entries of k at or above its floor. */
static void keep_reaching(Kept *k) {
    int32_t n = 0;
    for (int32_t i = 0; i < k->count; i++)
        if (k->upper[i] >= k->floor) k->index[n] = k->index[i], k->upper[n] = k->upper[i], n++;
    k->count = n;
}

/* A row's 16 int8 logits of the panel at output n0 (`width` of them real): the floor rises to
 * their largest lower bound, and those whose upper bound reaches it are kept. */
VNNI_INLINE void keep_candidates(Kept *k, __m512 l8, float c, const float *l1, int64_t n0, int width) {
    if (k->overflow) return;
    const __mmask16 real = (__mmask16)((1u << width) - 1u);
    const __m512 cv = _mm512_set1_ps(c), bound = _mm512_mul_ps(cv, _mm512_maskz_loadu_ps(real, l1));
    const __m512 lower = _mm512_mask_blend_ps(real, _mm512_set1_ps(-INFINITY), _mm512_sub_ps(l8, bound));
    const float low = _mm512_reduce_max_ps(lower);
    if (low > k->floor) k->floor = low;
    const __m512 upper = _mm512_add_ps(l8, bound);
    __mmask16 reach = _mm512_mask_cmp_ps_mask(real, upper, _mm512_set1_ps(k->floor), _CMP_GE_OQ);
    if (!reach) return;
    float u[16];
    _mm512_storeu_ps(u, upper);
    for (; reach; reach &= reach - 1) {
        int i = __builtin_ctz(reach);
        if (k->count == k->capacity) {
            keep_reaching(k);
            if (k->count > k->capacity / 2) grow(k);
            if (k->overflow) return;
        }
        k->index[k->count] = (int32_t)(n0 + i), k->upper[k->count] = u[i], k->count++;
    }
}

/* mr rows of xq against all 16 rows of the int8 panel w (outputs n0 .. n0 + width - 1); each
 * row's 16 int8 logits go to its candidates. The levels go in unsigned, as qdot.c's tiles take
 * them (vnni.h). */
VNNI_INLINE void tile_i8_vnni(const int8_t *xq, const float *d, const int32_t *shift, const float *c, const int mr,
                              const int8_t *w, const uint16_t *scale, const float *l1, int64_t n0, int width,
                              int64_t k_len, Kept *kept, const char *next) {
    const int64_t groups = k_len / GROUP;
    __m512 acc[MR_VNNI];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i t[MR_VNNI];
        for (int r = 0; r < mr; r++) t[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < QUADS; j++) {
            int64_t k = g * GROUP + 4 * j;
            /* lane r: row r's 4 levels */
            const __m512i wu = tile_levels_vnni(_mm512_loadu_si512((const void *)(w + k * NB)), 8);
            for (int r = 0; r < mr; r++) t[r] = tile_dot_vnni(t[r], wu, xq + r * k_len + k);
        }
        prefetch_group(next, g, QUADS);
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + g * NB)));
        for (int r = 0; r < mr; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(unshift(t[r], shift + r * groups + g, 8)),
                                     _mm512_mul_ps(_mm512_set1_ps(d[r * groups + g]), s), acc[r]);
    }
    for (int r = 0; r < mr; r++) keep_candidates(kept + r, acc[r], c[r], l1, n0, width);
}

__attribute__((noinline, target(VNNI_TARGET))) static void panel_i8_vnni(const int8_t *xq, const float *d,
                                                                         const int32_t *shift, const float *c,
                                                                         int64_t m, const int8_t *w,
                                                                         const uint16_t *scale, const float *l1,
                                                                         int64_t n0, int width, int64_t k, Kept *kept,
                                                                         const char *next) {
    const int64_t groups = k / GROUP;
    int64_t m0 = 0;
#define TILE(mr)                                                                                                     \
    tile_i8_vnni(xq + m0 * k, d + m0 * groups, shift + m0 * groups, c + m0, mr, w, scale, l1, n0, width, k, kept + m0, \
                 next)
    for (; m0 + MR_VNNI <= m; m0 += MR_VNNI, next = 0) TILE(MR_VNNI);
    if (m - m0 >= 4) {
        TILE(4);
        m0 += 4, next = 0;
    }
    if (m - m0 >= 2) {
        TILE(2);
        m0 += 2, next = 0;
    }
    if (m0 < m) TILE(1);
#undef TILE
}

static int compare_index(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Row r's argmax: the int16 logits of each panel that holds one of its candidates (kept by
 * the threads, lists m apart). Returns -1 when a list could not grow, or for more than
 * n / GREEDY_MAX_SHARE candidates: logits that flat cost less from the int16 head. */
static int64_t greedy_row(const Kept *kept, int threads, int64_t m, int64_t n, const int16_t *xq, const float *d16,
                          const uint8_t *q, const uint16_t *scale, int64_t k, int32_t *panels) {
    const int64_t groups = k / GROUP, qbytes = k * NB;
    float floor = -INFINITY;
    for (int t = 0; t < threads; t++) {
        if (kept[t * m].overflow) return -1;
        floor = kept[t * m].floor > floor ? kept[t * m].floor : floor;
    }
    int64_t count = 0;
    for (int t = 0; t < threads; t++)
        for (int32_t i = 0; i < kept[t * m].count; i++)
            if (kept[t * m].upper[i] >= floor) {
                if (count == n / GREEDY_MAX_SHARE) return -1; /* flat: the int16 head is cheaper */
                panels[count++] = kept[t * m].index[i] / NB;
            }
    qsort(panels, (size_t)count, sizeof *panels, compare_index);
    int64_t best = -1;
    float best_v = -INFINITY;
    for (int64_t i = 0; i < count; i++) {
        if (i && panels[i] == panels[i - 1]) continue;
        const int64_t nb = panels[i];
        const int64_t width = n - nb * NB < NB ? n - nb * NB : NB;
        float y[NB];
        row_panel(xq, d16, (const int8_t *)q + nb * qbytes, scale + nb * groups * NB, 0, k, y);
        for (int64_t j = 0; j < width; j++) /* strictly greater: the first index of a tie stays */
            if (y[j] > best_v || best < 0) best_v = y[j], best = nb * NB + j;
    }
    return best;
}

/* out [m] = the argmax over the first n outputs of qlinear_a16(x [m, k], q, scale) per row, the
 * int8 levels' panels (bits 8; l1max [n_blocks * 16]: qhead_l1max), or -1 for a row with too
 * many candidates (its logits are flat within the bound: the caller computes them). Returns
 * the number of such rows, -1 when scratch memory cannot be had, -2 when the CPU has no VNNI
 * tiles or a row holds a value that is not finite or beyond GREEDY_MAX_ABS (the caller then
 * takes qlinear_a16 and its argmax). */
int64_t qhead_greedy(const float *x, int64_t m, int64_t k, int64_t n_blocks, int64_t n, const uint8_t *q,
                     const uint16_t *scale, const float *l1max, int64_t *out) {
    if (!use_vnni) return -2;
    for (int64_t i = 0; i < m * k; i++)
        if (!(fabsf(x[i]) <= GREEDY_MAX_ABS)) return -2;
    const int64_t groups = k / GROUP, qbytes = k * NB;
    const int threads = omp_get_max_threads();
    const int64_t capacity = GREEDY_KEPT, lists = (int64_t)threads * m, most = n / GREEDY_MAX_SHARE + 1;
    Kept *kept = scratch(lists * (sizeof(Kept) + capacity * (sizeof(int32_t) + sizeof(float))) +
                         (size_t)m * groups * 4 * sizeof(float) + (size_t)m * sizeof(float) +
                         (size_t)m * k * (sizeof(int16_t) + 1) + (size_t)most * sizeof(int32_t) + 256);
    if (!kept) return -1; /* [thread][row] */
    int32_t *index = (int32_t *)(kept + lists);
    float *upper = (float *)(index + lists * capacity);
    float *d8 = upper + lists * capacity, *sx8 = d8 + m * groups, *d16 = sx8 + m * groups, *c = d16 + m * groups;
    int32_t *shift = (int32_t *)(c + m), *panels = shift + m * groups; /* [most] */
    int16_t *xq = (int16_t *)(panels + most);
    int8_t *x8 = (int8_t *)(xq + m * k);
    for (int64_t i = 0; i < lists; i++)
        kept[i] = (Kept){-INFINITY, 0, (int32_t)capacity, 0, 0, index + i * capacity, upper + i * capacity};
    /* c = sum of the groups' max|x| (127 d8) * (1/254 + 1/65534), widened */
    const float widen = 127.0f * (1.0f / 254.0f + 1.0f / 65534.0f) * (1.0f + GREEDY_SLACK_PER_GROUP * (float)groups);
    /* One parallel region with one barrier, as qlinear_a16's at M = 1: in a server the API
     * process takes a core now and then, and each barrier waits for the thread it preempted.
     * A few rows quantize in microseconds, and a row's candidates are a few panels. */
    for (int64_t i = 0; i < m; i++) {
        quantize_row(x + i * k, k, x8 + i * k, d8 + i * groups, sx8 + i * groups, 0, shift + i * groups, 0);
        quantize_row16(x + i * k, k, xq + i * k, d16 + i * groups);
        float steps = 0.0f;
        for (int64_t g = 0; g < groups; g++) steps += d8[i * groups + g];
        c[i] = steps * widen;
    }
#pragma omp parallel for num_threads(threads) schedule(guided)
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        const char *next = nb + 1 < n_blocks ? (const char *)(q + (nb + 1) * qbytes) : 0;
        const int width = n - nb * NB < NB ? (int)(n - nb * NB) : NB;
        if (width > 0)
            panel_i8_vnni(x8, d8, shift, c, m, (const int8_t *)q + nb * qbytes, scale + nb * groups * NB,
                          l1max + nb * NB, nb * NB, width, k, kept + (int64_t)omp_get_thread_num() * m, next);
    }
    int64_t flat = 0;
    for (int64_t i = 0; i < m; i++) {
        out[i] = greedy_row(kept + i, threads, m, n, xq + i * k, d16 + i * groups, q, scale, k, panels);
        flat += out[i] < 0;
    }
    for (int64_t i = 0; i < lists; i++)
        if (kept[i].owned) free(kept[i].index);
    return flat;
}

/* l1max [n_blocks * 16]: each output's largest sum of |w| over a group of 32 (int8 panels). */
void qhead_l1max(int64_t k, int64_t n_blocks, const uint8_t *q, const uint16_t *scale, float *l1max) {
    const int64_t groups = k / GROUP, qbytes = k * NB;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        const int8_t *w = (const int8_t *)q + nb * qbytes;
        float best[NB] = {0};
        for (int64_t g = 0; g < groups; g++) {
            int32_t sum[NB] = {0};
            for (int j = 0; j < QUADS; j++)
                for (int r = 0; r < NB; r++)
                    for (int i = 0; i < 4; i++) sum[r] += abs(w[(g * GROUP + 4 * j) * NB + 4 * r + i]);
            float s[NB];
            _mm256_storeu_ps(s, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + nb * groups * NB + g * NB))));
            _mm256_storeu_ps(s + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + nb * groups * NB + g * NB + 8))));
            for (int r = 0; r < NB; r++) {
                float v = (float)sum[r] * s[r];
                best[r] = v > best[r] ? v : best[r];
            }
        }
        memcpy(l1max + nb * NB, best, sizeof best);
    }
}
