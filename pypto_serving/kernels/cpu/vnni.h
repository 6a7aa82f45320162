/* The AVX-512 VNNI tiles' target and switch, shared by qdot.c (which owns the switch,
 * qdot_use_vnni, and checks the CPU for exactly these features) and qhead.c, and their int8
 * levels' unsigned form. */
#ifndef PYPTO_VNNI_H
#define PYPTO_VNNI_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni"
#define VNNI_INLINE static inline __attribute__((always_inline, target(VNNI_TARGET)))
#define MR_VNNI 8 /* rows per tile: a sum or two and an accumulator each among the 32 registers */

extern int use_vnni; /* nonzero: the VNNI tiles run (qdot_use_vnni) */

/* The M > 1 tiles' levels: int8 ones flipped to unsigned (w + 128), so that every width's quad
 * meets a row's 4 inputs as they are, in one vpdpbusd (levels_vnni's negation under a mask
 * costs an instruction per row and quad); a group's int8 sums then hold 128 * sum(x) more,
 * taken off by unshift (the integer dots, and so the results, are the same). */
VNNI_INLINE __m512i tile_levels_vnni(__m512i w, const int bits) {
    return bits == 8 ? _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)) : w;
}

VNNI_INLINE __m512i tile_dot_vnni(__m512i t, __m512i w, const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm512_dpbusd_epi32(t, w, _mm512_set1_epi32(v));
}

VNNI_INLINE __m512i unshift(__m512i t, const int32_t *shift, const int bits) {
    return bits == 8 ? _mm512_sub_epi32(t, _mm512_set1_epi32(*shift)) : t;
}

#endif
