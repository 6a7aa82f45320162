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

/* Group g (lines cache lines) of the panel at `next` (NULL: nothing), while this one computes:
 * a decode step's few rows leave the panels' reads from memory exposed otherwise. */
static inline __attribute__((always_inline)) void prefetch_group(const char *next, int64_t g, const int lines) {
    if (next)
        for (int l = 0; l < lines; l++) _mm_prefetch(next + (g * lines + l) * 64, _MM_HINT_T0);
}

#endif
