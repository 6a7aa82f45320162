/* The AVX-512 VNNI tiles' target and switch, shared by qdot.c (which owns the switch,
 * qdot_use_vnni, and checks the CPU for exactly these features) and qhead.c. */
#ifndef PYPTO_VNNI_H
#define PYPTO_VNNI_H

#define VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni"
#define VNNI_INLINE static inline __attribute__((always_inline, target(VNNI_TARGET)))
#define MR_VNNI 8 /* rows per tile: a sum or two and an accumulator each among the 32 registers */

extern int use_vnni; /* nonzero: the VNNI tiles run (qdot_use_vnni) */

#endif
