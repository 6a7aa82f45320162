/* The integer dot-product roof of an AVX2 core: how many vpmaddubsw (32 int8 x uint8
 * multiply-adds each) it retires per second, alone and with the vpaddw that accumulates each
 * result (the inner loop of kernels/cpu/qdot.c's AVX2 tiles). Eight independent destinations,
 * register operands only, so neither latency nor loads limit the count. x86-64 with AVX2 only;
 * vnni_roof_gmacs (AVX-512 VNNI only): the same for vpdpbusd on 512-bit registers (64
 * multiply-adds each, accumulated in place: the VNNI tiles' inner loop), twelve destinations.
 */
#include <omp.h>
#include <stdint.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* iters rounds of 8 vpmaddubsw, each followed by the vpaddw that accumulates it when asked. */
static void maddubs_loop(int64_t iters, int64_t accumulate) {
    for (int64_t i = 0; i < iters; i++) {
        if (accumulate)
            __asm__ volatile("vpmaddubsw %%ymm12, %%ymm13, %%ymm0\n\t vpaddw %%ymm0, %%ymm8, %%ymm8\n\t"
                             "vpmaddubsw %%ymm12, %%ymm13, %%ymm1\n\t vpaddw %%ymm1, %%ymm9, %%ymm9\n\t"
                             "vpmaddubsw %%ymm12, %%ymm13, %%ymm2\n\t vpaddw %%ymm2, %%ymm10, %%ymm10\n\t"
                             "vpmaddubsw %%ymm12, %%ymm13, %%ymm3\n\t vpaddw %%ymm3, %%ymm11, %%ymm11\n\t"
                             "vpmaddubsw %%ymm12, %%ymm13, %%ymm4\n\t vpaddw %%ymm4, %%ymm8, %%ymm8\n\t"
                             "vpmaddubsw %%ymm12, %%ymm13, %%ymm5\n\t vpaddw %%ymm5, %%ymm9, %%ymm9\n\t"
                             "vpmaddubsw %%ymm12, %%ymm13, %%ymm6\n\t vpaddw %%ymm6, %%ymm10, %%ymm10\n\t"
                             "vpmaddubsw %%ymm12, %%ymm13, %%ymm7\n\t vpaddw %%ymm7, %%ymm11, %%ymm11\n\t" ::
                                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
                                   "xmm9", "xmm10", "xmm11");
        else
            __asm__ volatile("vpmaddubsw %%ymm12, %%ymm13, %%ymm0\n\t vpmaddubsw %%ymm12, %%ymm13, %%ymm1\n\t"
                             "vpmaddubsw %%ymm12, %%ymm13, %%ymm2\n\t vpmaddubsw %%ymm12, %%ymm13, %%ymm3\n\t"
                             "vpmaddubsw %%ymm12, %%ymm13, %%ymm4\n\t vpmaddubsw %%ymm12, %%ymm13, %%ymm5\n\t"
                             "vpmaddubsw %%ymm12, %%ymm13, %%ymm6\n\t vpmaddubsw %%ymm12, %%ymm13, %%ymm7\n\t" ::
                                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");
    }
}

/* iters rounds of 12 vpdpbusd on 512-bit registers */
static void dpbusd_loop(int64_t iters, int64_t unused) {
    (void)unused;
    for (int64_t i = 0; i < iters; i++)
        __asm__ volatile("vpdpbusd %%zmm12, %%zmm13, %%zmm0\n\t vpdpbusd %%zmm12, %%zmm13, %%zmm1\n\t"
                         "vpdpbusd %%zmm12, %%zmm13, %%zmm2\n\t vpdpbusd %%zmm12, %%zmm13, %%zmm3\n\t"
                         "vpdpbusd %%zmm12, %%zmm13, %%zmm4\n\t vpdpbusd %%zmm12, %%zmm13, %%zmm5\n\t"
                         "vpdpbusd %%zmm12, %%zmm13, %%zmm6\n\t vpdpbusd %%zmm12, %%zmm13, %%zmm7\n\t"
                         "vpdpbusd %%zmm12, %%zmm13, %%zmm8\n\t vpdpbusd %%zmm12, %%zmm13, %%zmm9\n\t"
                         "vpdpbusd %%zmm12, %%zmm13, %%zmm10\n\t vpdpbusd %%zmm12, %%zmm13, %%zmm11\n\t" ::
                             : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                               "xmm10", "xmm11");
}

/* Seconds for `threads` threads running loop(iters, arg) at once. */
static double timed(void (*loop)(int64_t, int64_t), int64_t iters, int64_t arg, int64_t threads) {
    double start = 0.0, end = 0.0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp barrier
#pragma omp master
        start = now();
        loop(iters, arg);
#pragma omp barrier
#pragma omp master
        end = now();
    }
    return end - start;
}

/* Multiply-adds per second (1e9) over `threads` threads running the loop at once; accumulate
 * selects the loop with vpaddw. */
double int8_roof_gmacs(int64_t iters, int64_t threads, int64_t accumulate) {
    return (double)iters * 8 * 32 * threads / timed(maddubs_loop, iters, accumulate, threads) / 1e9;
}

double vnni_roof_gmacs(int64_t iters, int64_t threads) {
    return (double)iters * 12 * 64 * threads / timed(dpbusd_loop, iters, 0, threads) / 1e9;
}
