/* Block payload movers for CPU engine layouts: gather + checksum, verify + scatter.
 *
 * Called through ctypes (which releases the GIL for the whole call), once per batch of blocks,
 * so the per-layer Python overhead of the pure-Python codec path disappears. The checksum
 * (XXH3-64, seed 0) comes from the vendored single-header xxHash (xxhash.h, BSD-2), inlined
 * here: no symbol of another package's private library is needed, and the bytes hashed are
 * the ones the Python path hashes with `xxhash.xxh3_64` (tests/test_native_fastcodec.py).
 *
 * Geometry (docs/FORMAT.md): record i at dst + i*record_bytes; layer j of its payload at
 * header_bytes + j*layer_bytes, made of `planes` parts of plane_bytes. Engine layer j: base
 * pointer layer_ptrs[j]; block b, plane p at + b*block_stride + p*plane_stride.
 */
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include "xxh3_dispatch.h"

/* Exported only so tests can compare this build's hash with the Python package's. */
uint64_t dtkv_xxh3_64(const void *p, size_t n) { return dtkv_hash(p, n); }

/* For tests and benchmarks: the widest variant this CPU runs (0 baseline, 1 AVX2, 2 AVX-512),
 * and one named variant (the baseline where the CPU lacks it). */
int dtkv_xxh3_best(void) { return dtkv_hash_best; }
uint64_t dtkv_xxh3_64_variant(int v, const void *p, size_t n) {
    return (v >= 0 && v <= dtkv_hash_best ? dtkv_hash_variants[v] : hash_baseline)(p, n);
}

int dtkv_gather_hash(const uint64_t *layer_ptrs, int64_t num_layers, int64_t planes,
                     int64_t block_stride, int64_t plane_stride, int64_t plane_bytes,
                     const int64_t *block_ids, int64_t n, uint8_t *dst, int64_t record_bytes,
                     int64_t header_bytes, uint64_t *sums /* n * num_layers */) {
    const int64_t layer_bytes = planes * plane_bytes;
    for (int64_t i = 0; i < n; i++) {
        uint8_t *rec = dst + i * record_bytes + header_bytes;
        for (int64_t j = 0; j < num_layers; j++) {
            const uint8_t *src = (const uint8_t *)(uintptr_t)layer_ptrs[j] + block_ids[i] * block_stride;
            uint8_t *out = rec + j * layer_bytes;
            for (int64_t p = 0; p < planes; p++)
                memcpy(out + p * plane_bytes, src + p * plane_stride, (size_t)plane_bytes);
            sums[i * num_layers + j] = dtkv_hash(out, (size_t)layer_bytes); /* still in cache */
        }
    }
    return 0;
}

/* Copy verified bytes into engine memory. The engine will not read these blocks before the
 * load returns, so streaming (non-temporal) stores skip the read-for-ownership of the destination
 * lines: one pass less over memory than memcpy, which is what brings decode near memcpy speed.
 * `ahead` (or NULL): n bytes the caller hashes next (the next layer), pulled into L2 while this
 * copy streams out, so that hash finds them there instead of waiting on DRAM line by line (one
 * thread, data not in cache: verify+scatter 10-13% faster on a Xeon VM with AVX-512). */
static void copy_out(uint8_t *dst, const uint8_t *src, size_t n, const uint8_t *ahead) {
#if defined(__SSE2__)
    size_t head = (size_t)(-(uintptr_t)dst) & 15;
    if (n < 256 || head > n) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        if (ahead)
            _mm_prefetch((const char *)(ahead + head + i), _MM_HINT_T1);
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    (void)ahead;
    memcpy(dst, src, n);
#endif
}

static void copy_done(void) {
#if defined(__SSE2__)
    _mm_sfence(); /* streaming stores are weakly ordered: publish them before we return */
#endif
}

static int64_t verify_scatter(const uint64_t *layer_ptrs, int64_t num_layers, int64_t planes,
                              int64_t block_stride, int64_t plane_stride, int64_t plane_bytes, int64_t block_id,
                              const uint8_t *payload, const uint64_t *sums, const uint8_t *next_payload) {
    const int64_t layer_bytes = planes * plane_bytes;
    for (int64_t j = 0; j < num_layers; j++) {
        const uint8_t *src = payload + j * layer_bytes;
        if (dtkv_hash(src, (size_t)layer_bytes) != sums[j]) /* hashing pulls the layer into cache */
            return j;
        uint8_t *dst = (uint8_t *)(uintptr_t)layer_ptrs[j] + block_id * block_stride;
        const uint8_t *next = j + 1 < num_layers ? src + layer_bytes : next_payload; /* what is hashed next */
        if (plane_stride == plane_bytes)
            copy_out(dst, src, (size_t)layer_bytes, next); /* planes adjacent in the engine: one copy */
        else
            for (int64_t p = 0; p < planes; p++)
                copy_out(dst + p * plane_stride, src + p * plane_bytes, (size_t)plane_bytes,
                         next ? next + p * plane_bytes : NULL);
    }
    return -1;
}

/* Returns -1 when every layer verified and was copied, else the first layer whose checksum
 * failed (layers before it were verified and copied; nothing unverified is copied). */
int64_t dtkv_verify_scatter(const uint64_t *layer_ptrs, int64_t num_layers, int64_t planes,
                            int64_t block_stride, int64_t plane_stride, int64_t plane_bytes, int64_t block_id,
                            const uint8_t *payload, const uint64_t *sums) {
    int64_t r = verify_scatter(layer_ptrs, num_layers, planes, block_stride, plane_stride, plane_bytes,
                               block_id, payload, sums, NULL);
    copy_done();
    return r;
}

/* Status codes of dtkv_decode_batch and dtkv_verify_batch besides a layer number (>= 0) and DTKV_OK. */
enum { DTKV_OK = -1, DTKV_BAD_MAGIC = -2, DTKV_BAD_VERSION = -3, DTKV_HEADER_CORRUPT = -4,
       DTKV_NAMESPACE = -5, DTKV_KEY = -6, DTKV_LAYOUT = -7, DTKV_UNSUPPORTED = -8, DTKV_SEALED = -9 };
#define DTKV_MAX_FAST_LAYERS 1024
#define DTKV_FLAG_SEALED 0x0001

/* The header and identity checks of one record, in the order the Python reader makes them.
 * `expect_desc` is the 48-byte layout descriptor (record bytes [64, 112)) the engine needs; byte 66
 * (the writer's engine layout) may differ, and bytes [112, 120) (the record's tenant) are not the
 * reader's concern: keys already differ per tenant. A sealed record (its payload encrypted for its
 * tenant) is refused here: its layer checksums are over the plaintext. `scratch` holds
 * 120 + 8 * num_layers bytes. Returns DTKV_OK or a negative status. */
static inline int64_t check_header(const uint8_t *rec, int64_t num_layers, const uint8_t *expect_prefix,
                                   const uint8_t *expect_desc, const uint8_t *namespace_, const uint8_t *key,
                                   uint8_t *scratch) {
    const size_t table_bytes = (size_t)num_layers * 8;
    uint64_t stored;
    uint16_t flags;
    if (memcmp(rec, expect_prefix, 8) != 0) return DTKV_BAD_MAGIC;
    if (memcmp(rec + 8, expect_prefix + 8, 2) != 0) return DTKV_BAD_VERSION;
    memcpy(scratch, rec, 120);
    memcpy(scratch + 120, rec + 128, table_bytes);
    memcpy(&stored, rec + 120, 8);
    if (XXH3_64bits(scratch, 120 + table_bytes) != stored) return DTKV_HEADER_CORRUPT;
    if (memcmp(rec + 12, expect_prefix + 12, 4) != 0) return DTKV_LAYOUT; /* header_bytes */
    if (memcmp(rec + 16, namespace_, 16) != 0) return DTKV_NAMESPACE;
    if (memcmp(rec + 32, key, 16) != 0) return DTKV_KEY;
    if (memcmp(rec + 64, expect_desc, 2) != 0 || memcmp(rec + 67, expect_desc + 3, 45) != 0) return DTKV_LAYOUT;
    memcpy(&flags, rec + 10, 2);
    if (flags & DTKV_FLAG_SEALED) return DTKV_SEALED;
    return DTKV_OK;
}

/* Verify header + identity of each record and, when they hold, verify and scatter its layers.
 * Records are at records + i*record_bytes (dtkv_decode_batch) or at ptrs[i] (dtkv_decode_ptrs: records
 * read in place, e.g. from the host tier's arena). Header checks: check_header.
 * `keys` holds n 16-byte keys. status[i]: DTKV_OK, a negative code above, or the first bad layer. */
static void decode_records(const uint64_t *layer_ptrs, int64_t num_layers, int64_t planes,
                           int64_t block_stride, int64_t plane_stride, int64_t plane_bytes,
                           const uint8_t *records, int64_t record_bytes, const uint64_t *ptrs, int64_t header_bytes,
                           const uint8_t *expect_prefix, const uint8_t *expect_desc, const uint8_t *namespace_,
                           const uint8_t *keys, const int64_t *block_ids, int64_t n, int64_t *status) {
    const size_t table_bytes = (size_t)num_layers * 8;
    if (num_layers <= 0 || num_layers > DTKV_MAX_FAST_LAYERS) { /* the caller uses the Python path */
        for (int64_t i = 0; i < n; i++) status[i] = DTKV_UNSUPPORTED;
        return;
    }
    uint8_t scratch[120 + 8 * DTKV_MAX_FAST_LAYERS];
    uint64_t sums[DTKV_MAX_FAST_LAYERS];
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *rec = ptrs ? (const uint8_t *)(uintptr_t)ptrs[i] : records + i * record_bytes;
        status[i] = check_header(rec, num_layers, expect_prefix, expect_desc, namespace_, keys + 16 * i, scratch);
        if (status[i] != DTKV_OK) continue;
        memcpy(sums, rec + 128, table_bytes);
        const uint8_t *next = i + 1 < n ? (ptrs ? (const uint8_t *)(uintptr_t)ptrs[i + 1] : rec + record_bytes) : NULL;
        status[i] = verify_scatter(layer_ptrs, num_layers, planes, block_stride, plane_stride,
                                   plane_bytes, block_ids[i], rec + header_bytes, sums,
                                   next ? next + header_bytes : NULL);
    }
    copy_done();
}

/* decode_records without the scatter: the header checks and every layer's checksum of the records
 * at ptrs[i] (each at least header_bytes + num_layers * layer_bytes long), for bytes that go on to a
 * device copy. status[i]: DTKV_OK, a negative code above, or the first layer whose checksum failed. */
void dtkv_verify_batch(const uint64_t *ptrs, int64_t num_layers, int64_t layer_bytes, int64_t header_bytes,
                       const uint8_t *expect_prefix, const uint8_t *expect_desc, const uint8_t *namespace_,
                       const uint8_t *keys, int64_t n, int64_t *status) {
    if (num_layers <= 0 || num_layers > DTKV_MAX_FAST_LAYERS) {
        for (int64_t i = 0; i < n; i++) status[i] = DTKV_UNSUPPORTED;
        return;
    }
    uint8_t scratch[120 + 8 * DTKV_MAX_FAST_LAYERS];
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *rec = (const uint8_t *)(uintptr_t)ptrs[i];
        status[i] = check_header(rec, num_layers, expect_prefix, expect_desc, namespace_, keys + 16 * i, scratch);
        for (int64_t j = 0; status[i] == DTKV_OK && j < num_layers; j++) {
            uint64_t want;
            memcpy(&want, rec + 128 + 8 * j, 8);
            if (dtkv_hash(rec + header_bytes + j * layer_bytes, (size_t)layer_bytes) != want) status[i] = j;
        }
    }
}

void dtkv_decode_batch(const uint64_t *layer_ptrs, int64_t num_layers, int64_t planes,
                       int64_t block_stride, int64_t plane_stride, int64_t plane_bytes,
                       const uint8_t *records, int64_t record_bytes, int64_t header_bytes,
                       const uint8_t *expect_prefix /* 16 bytes: magic, version, flags, header_bytes */,
                       const uint8_t *expect_desc, const uint8_t *namespace_, const uint8_t *keys,
                       const int64_t *block_ids, int64_t n, int64_t *status) {
    decode_records(layer_ptrs, num_layers, planes, block_stride, plane_stride, plane_bytes, records,
                   record_bytes, NULL, header_bytes, expect_prefix, expect_desc, namespace_, keys, block_ids, n,
                   status);
}

void dtkv_decode_ptrs(const uint64_t *layer_ptrs, int64_t num_layers, int64_t planes,
                      int64_t block_stride, int64_t plane_stride, int64_t plane_bytes, const uint64_t *ptrs,
                      int64_t header_bytes, const uint8_t *expect_prefix, const uint8_t *expect_desc,
                      const uint8_t *namespace_, const uint8_t *keys, const int64_t *block_ids, int64_t n,
                      int64_t *status) {
    decode_records(layer_ptrs, num_layers, planes, block_stride, plane_stride, plane_bytes, NULL, 0, ptrs,
                   header_bytes, expect_prefix, expect_desc, namespace_, keys, block_ids, n, status);
}

/* A real (empty) extension module so setuptools builds and installs this file; the functions
 * above are reached with ctypes.CDLL(<this module's file>). */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastcodec", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__fastcodec(void) { return PyModule_Create(&module); }
