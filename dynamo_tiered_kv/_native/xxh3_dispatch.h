/* XXH3-64 (seed 0) on the widest vector unit this CPU has, chosen once when the library loads.
 *
 * The build targets baseline x86-64 (SSE2), so a plain XXH3_64bits hashes 16 bytes per
 * instruction even on CPUs with AVX2 or AVX-512, and verifying a restored block is hashing every
 * byte of it: the hash is a third of a host-tier restore. xxHash's own x86 dispatch scheme
 * compiles its AVX2 and AVX-512 loops with per-function target attributes; we pick one for inputs
 * long enough to use them (> XXH3_MIDSIZE_MAX; shorter inputs take the same scalar code in every
 * variant). All variants return the same value (tests compare each with the Python package). */
#ifndef DTKV_XXH3_DISPATCH_H
#define DTKV_XXH3_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define XXH_X86DISPATCH
#define XXH_DISPATCH_AVX2 1
#define XXH_DISPATCH_AVX512 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#define XXH_TARGET_AVX512 __attribute__((__target__("avx512f")))
#define DTKV_XXH3_VARIANTS 1
#endif
#define XXH_INLINE_ALL /* every xxHash function static and inlined: nothing exported, no clash */
#include "xxhash.h"

typedef uint64_t (*dtkv_hash_fn)(const void *, size_t);

static uint64_t hash_baseline(const void *p, size_t n) { return XXH3_64bits(p, n); }

#if defined(DTKV_XXH3_VARIANTS)
static __attribute__((noinline)) XXH_TARGET_AVX2 uint64_t hash_avx2(const void *p, size_t n) {
    if (n <= XXH3_MIDSIZE_MAX)
        return XXH3_64bits(p, n);
    return XXH3_hashLong_64b_internal(p, n, XXH3_kSecret, sizeof(XXH3_kSecret), XXH3_accumulate_avx2,
                                      XXH3_scrambleAcc_avx2);
}

static __attribute__((noinline)) XXH_TARGET_AVX512 uint64_t hash_avx512(const void *p, size_t n) {
    if (n <= XXH3_MIDSIZE_MAX)
        return XXH3_64bits(p, n);
    return XXH3_hashLong_64b_internal(p, n, XXH3_kSecret, sizeof(XXH3_kSecret), XXH3_accumulate_avx512,
                                      XXH3_scrambleAcc_avx512);
}
#endif

/* 0: baseline (SSE2 on x86-64), 1: AVX2, 2: AVX-512. */
static dtkv_hash_fn dtkv_hash_variants[3] = {hash_baseline, hash_baseline, hash_baseline};
static int dtkv_hash_best = 0;
static dtkv_hash_fn dtkv_hash = hash_baseline;

/* __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0). */
__attribute__((constructor)) static void dtkv_hash_pick(void) {
#if defined(DTKV_XXH3_VARIANTS)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        dtkv_hash_variants[1] = hash_avx2;
        dtkv_hash_best = 1;
    }
    if (__builtin_cpu_supports("avx512f")) {
        dtkv_hash_variants[2] = hash_avx512;
        dtkv_hash_best = 2;
    }
    dtkv_hash = dtkv_hash_variants[dtkv_hash_best];
#endif
}

#endif
