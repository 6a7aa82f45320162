/* exp for x <= 0 (softmax after max subtraction, silu of -|x|, the sampler's weights):
 * Cephes-style, ~1 ulp; shared by decoder.c and sampling.c. One body
 * for 8 lanes (exp8) and, where the AVX-512 tiles run, 16 (exp16): P is the intrinsics' prefix,
 * so both compute the same values lane for lane. */
#ifndef PYPTO_VEXP_H
#define PYPTO_VEXP_H
#include <immintrin.h>

#define DEFINE_EXP(NAME, ATTRS, VEC, VECI, P, ROUND, AS_FLOAT)                                        \
    ATTRS VEC NAME(VEC x) {                                                                           \
        x = P##_max_ps(x, P##_set1_ps(-87.0f));                                                       \
        VEC fx = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)),                              \
                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                 \
        x = P##_fnmadd_ps(fx, P##_set1_ps(0.693359375f), x);                                          \
        x = P##_fnmadd_ps(fx, P##_set1_ps(-2.12194440e-4f), x);                                       \
        VEC y = P##_set1_ps(1.9875691500E-4f);                                                        \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.3981999507E-3f));                                        \
        y = P##_fmadd_ps(y, x, P##_set1_ps(8.3334519073E-3f));                                        \
        y = P##_fmadd_ps(y, x, P##_set1_ps(4.1665795894E-2f));                                        \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.6666665459E-1f));                                        \
        y = P##_fmadd_ps(y, x, P##_set1_ps(5.0000001201E-1f));                                        \
        y = P##_fmadd_ps(y, P##_mul_ps(x, x), P##_add_ps(x, P##_set1_ps(1.0f)));                      \
        VECI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(fx), P##_set1_epi32(127)), 23);         \
        return P##_mul_ps(y, AS_FLOAT(e));                                                            \
    }

DEFINE_EXP(exp8, static inline, __m256, __m256i, _mm256, _mm256_round_ps, _mm256_castsi256_ps)

#endif
