/* The largest |x| of a group of 32 activations and their packing to bytes, shared by the
 * kernels that quantize them (qdot.c to int8, qhead.c to int16 and int8), and the float lane
 * sum they and decoder.c take. */
#ifndef PYPTO_GROUP_MAX_H
#define PYPTO_GROUP_MAX_H
#include <immintrin.h>
#include <stdint.h>

/* v[0] + ... + v[7], as (lo half + hi half), then pairs: the one order every kernel sums in. */
static inline __attribute__((always_inline)) float hsum8f(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Loads p [32] into v [4] and returns max |p|, or 0 for a group below 1e-30 (zeros, so that
 * a reciprocal of it stays finite). */
static inline __attribute__((always_inline)) float group_max(const float *p, __m256 v[4]) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(p + i * 8);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float amax = _mm_cvtss_f32(m4);
    return amax < 1e-30f ? 0.0f : amax;
}

/* 32 int32 (each within int8's range) -> 32 int8 in order. */
static inline __attribute__((always_inline)) __m256i pack32(__m256i i[4]) {
    __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    /* packs interleaves 128-bit lanes: dwords 0 4 1 5 2 6 3 7 back in order */
    return _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Row x [k] -> int8 xq [k], d [k / 32] (max|x| / 127 per group), sx [k / 32] (d * sum(xq)),
 * shift [k / 32] (128 * sum(xq)); with lo also the second plane of int16 activations and its
 * lo_shift (qdot.c). */
void quantize_row(const float *x, int64_t k, int8_t *xq, float *d, float *sx, int8_t *lo, int32_t *shift,
                  int32_t *lo_shift);

#endif
