/* Fetching ahead by hand, shared by the kernels whose reads the hardware prefetcher does not
 * follow (decoder.c's scattered cache blocks, qdot.c's and qhead.c's next panel). */
#ifndef PYPTO_PREFETCH_H
#define PYPTO_PREFETCH_H
#include <immintrin.h>
#include <stdint.h>

/* Brings the n bytes at p towards the cache, the last line too when they straddle one. */
static inline __attribute__((always_inline)) void prefetch_bytes(const void *p, int64_t n) {
    const char *c = p;
    for (int64_t b = 0; b < n; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
    _mm_prefetch(c + n - 1, _MM_HINT_T0);
}

/* Groups of 32 k a batch-1 row (qdot.c, qhead.c) fetches ahead of the one it computes: a panel
 * streams from memory once, and the hardware prefetcher alone does not keep far enough ahead.
 * The panels of a thread lie one after another, so past a panel's end this fetches the start
 * of its next (prefetches never fault). 8, 16 and 32 measured alike; 4 short of them. */
#define AHEAD_GROUPS 16

/* Group g (lines cache lines) of the panel at `next` (NULL: nothing), while this one computes:
 * a decode step's few rows leave the panels' reads from memory exposed otherwise. Into L2
 * (T1): the next panel is wanted a whole panel later, and fetched into L1 its lines held the
 * miss buffers the tile's own reads wait on (as decode attention's fetching ahead did; a
 * Qwen2.5-Coder-0.5B batch-16 step 44.0 -> 40.1 ms, medians of 6 alternations, 2026-12-05). */
static inline __attribute__((always_inline)) void prefetch_group(const char *next, int64_t g, const int lines) {
    if (next)
        for (int l = 0; l < lines; l++) _mm_prefetch(next + (g * lines + l) * 64, _MM_HINT_T1);
}

/* A batch-1 row's fetching ahead (qdot.c's and qhead.c's): group g + AHEAD_GROUPS of the
 * panel stream at q (lines cache lines a group: a group of a panel's 16 rows holds `bits`
 * lines), with its 16 fp16 scales and, unless NULL, zeros. Into L1: these are read 16 groups
 * later (into L2 measured no better at batch 1). */
static inline __attribute__((always_inline)) void fetch_ahead(const void *q, const uint16_t *scale,
                                                              const uint16_t *zero, int64_t g, const int lines) {
    const int64_t a = g + AHEAD_GROUPS;
    for (int l = 0; l < lines; l++) _mm_prefetch((const char *)q + (a * lines + l) * 64, _MM_HINT_T0);
    _mm_prefetch((const char *)(scale + a * 16), _MM_HINT_T0);
    if (zero) _mm_prefetch((const char *)(zero + a * 16), _MM_HINT_T0);
}

#endif
