/* _blocksum: CRC-32C (Castagnoli) of every fixed-size block of a buffer, in one call.
 *
 * Why this exists: the checkpoint writer checksums each shard from memory while training runs
 * on the same cores. zlib's CRC-32 costs about 0.2 s of CPU per 512 MiB, which the training
 * threads feel as a stall. CRC-32C has an instruction on x86-64 (SSE4.2 `crc32`), so the same
 * work is a few tens of milliseconds; everything else here is plumbing around that:
 *
 * - The instruction has a latency of 3 cycles and a throughput of one per cycle, so three
 *   blocks are checksummed at once (three independent dependency chains). Blocks are
 *   independent by design, so no CRC combination step is needed.
 * - The CPU is asked at import time (__builtin_cpu_supports); only the functions that use the
 *   instruction are compiled for SSE4.2 (a target attribute), so the module loads on any
 *   x86-64 and the build needs no -msse4.2.
 * - Elsewhere (other CPUs, other architectures, other compilers) a portable slicing-by-8 table
 *   CRC in C gives the same answers, at about 2 GiB/s.
 * - The GIL is released while checksumming, so a checksum thread runs next to training threads.
 *
 * Python API (see _blocksum.pyi):
 *   crc32c(data, crc=0, software=False) -> int
 *       CRC-32C of `data`, continuing from `crc` (the result for the preceding bytes), like zlib.crc32.
 *   crc32c_blocks(data, block_bytes=65536, software=False) -> bytes
 *       the CRC-32C of each `block_bytes` block of `data` (the last one may be short), packed as
 *       little-endian uint32.
 *   blocks_update(data, offset, regs, block_bytes=65536, software=False) -> None
 *   copy_blocks_update(dst, src, offset, regs, block_bytes=65536, software=False) -> None
 *       block checksums of a file assembled piece by piece, in order: `data` (or `src`, copied
 *       into `dst` in the same pass) holds the file's bytes from `offset` on; `regs` is a
 *       writable array of uint32, one CRC register per block of the whole file. A piece that
 *       starts a block starts its register; one that starts inside a block continues it, so the
 *       pieces must come in file order without gaps. A block's CRC-32C is its register ^ 0xFFFFFFFF
 *       once every byte of it has been seen. The fused copy exists because a separate checksum
 *       pass over a staged shard reads every byte a second time (see "fused copy" below).
 *   implementation() -> str
 *       "sse4.2" or "software": what the functions above use when software=False.
 * `software=True` forces the portable path (for tests on machines that have the instruction).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define CRC32C_POLY 0x82F63B78u /* Castagnoli polynomial, bit-reflected */

/* Releasing and re-taking the GIL costs more than checksumming this little. */
#define GIL_RELEASE_BYTES 4096

/* table[k][n]: the CRC register after byte n followed by k zero bytes. */
static uint32_t table[8][256];

static void init_tables(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) {
            c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        }
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = table[0][n];
        for (int k = 1; k < 8; k++) {
            c = table[0][c & 0xFF] ^ (c >> 8);
            table[k][n] = c;
        }
    }
}

/* The CRC register after `n` more bytes (no pre- or post-inversion: callers do that). */
static uint32_t sw_update(uint32_t crc, const unsigned char *p, size_t n) {
    while (n >= 8) {
        /* Assembled byte by byte, so the result does not depend on the machine's byte order. */
        uint32_t lo = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        crc = table[7][lo & 0xFF] ^ table[6][(lo >> 8) & 0xFF] ^ table[5][(lo >> 16) & 0xFF] ^ table[4][lo >> 24] ^
              table[3][p[4]] ^ table[2][p[5]] ^ table[1][p[6]] ^ table[0][p[7]];
        p += 8;
        n -= 8;
    }
    while (n--) {
        crc = table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    }
    return crc;
}

typedef uint32_t (*update_fn)(uint32_t crc, const unsigned char *p, size_t n);
typedef void (*blocks_fn)(const unsigned char *p, size_t len, size_t block, uint32_t *out);
typedef void (*stream_fn)(unsigned char *dst, const unsigned char *src, size_t pos, size_t n, size_t block,
                          uint32_t *regs);

static void sw_blocks(const unsigned char *p, size_t len, size_t block, uint32_t *out) {
    for (size_t off = 0; off < len; off += block) {
        size_t n = len - off < block ? len - off : block;
        *out++ = ~sw_update(0xFFFFFFFFu, p + off, n);
    }
}


/* The portable counterpart of hw_stream: a plain copy, then the registers over the copy. */
static void sw_stream(unsigned char *dst, const unsigned char *src, size_t pos, size_t n, size_t block,
                      uint32_t *regs) {
    if (dst) {
        memcpy(dst, src, n);
        src = dst;
    }
    while (n > 0) {
        size_t k = pos / block, in = pos % block;
        size_t m = n < block - in ? n : block - in;
        regs[k] = sw_update(in ? regs[k] : 0xFFFFFFFFu, src, m);
        src += m;
        pos += m;
        n -= m;
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_SSE42_PATH 1
#include <nmmintrin.h>
#include <smmintrin.h>

__attribute__((target("sse4.2"))) static uint32_t hw_update(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8); /* an unaligned load; x86 is little-endian, as CRC-32C's bit order wants */
        c = _mm_crc32_u64(c, w);
        p += 8;
        n -= 8;
    }
    crc = (uint32_t)c;
    while (n--) {
        crc = _mm_crc32_u8(crc, *p++);
    }
    return crc;
}

/* Three blocks of `n` bytes each, in three independent dependency chains. */
__attribute__((target("sse4.2"))) static void hw_three(const unsigned char *a, const unsigned char *b,
                                                       const unsigned char *c, size_t n, uint32_t *out) {
    uint64_t ca = 0xFFFFFFFFu, cb = 0xFFFFFFFFu, cc = 0xFFFFFFFFu;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t wa, wb, wc;
        memcpy(&wa, a + i, 8);
        memcpy(&wb, b + i, 8);
        memcpy(&wc, c + i, 8);
        ca = _mm_crc32_u64(ca, wa);
        cb = _mm_crc32_u64(cb, wb);
        cc = _mm_crc32_u64(cc, wc);
    }
    out[0] = ~hw_update((uint32_t)ca, a + i, n - i);
    out[1] = ~hw_update((uint32_t)cb, b + i, n - i);
    out[2] = ~hw_update((uint32_t)cc, c + i, n - i);
}

__attribute__((target("sse4.2"))) static void hw_blocks(const unsigned char *p, size_t len, size_t block,
                                                        uint32_t *out) {
    size_t full = len / block;
    size_t i = 0;
    for (; i + 3 <= full; i += 3) {
        hw_three(p + i * block, p + (i + 1) * block, p + (i + 2) * block, block, out + i);
    }
    for (size_t off = i * block; off < len; off += block) {
        size_t n = len - off < block ? len - off : block;
        out[i++] = ~hw_update(0xFFFFFFFFu, p + off, n);
    }
}

/* Fused copy: the staging copy into the shard buffer and the block checksums in one pass.
 *
 * Staging already reads every byte of the state; a checksum pass afterwards reads all of it
 * again, on the same cores as training. Here each 16-byte load feeds both the store and the
 * CRC. Whole blocks go three at a time (three dependency chains, as above) with non-temporal
 * stores: the staged bytes are next read by the disk (O_DIRECT DMA), not by this CPU, so
 * filling the cache with them (and reading each destination line first) would only cost. */
__attribute__((target("sse4.2"))) static uint32_t hw_copy_update(uint32_t crc, unsigned char *dst,
                                                                 const unsigned char *src, size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, src, 8);
        memcpy(dst, &w, 8);
        c = _mm_crc32_u64(c, w);
        src += 8;
        dst += 8;
        n -= 8;
    }
    crc = (uint32_t)c;
    while (n--) {
        *dst++ = *src;
        crc = _mm_crc32_u8(crc, *src++);
    }
    return crc;
}

/* Three whole blocks of `n` bytes (a multiple of 16), fused. The three destinations share
 * their alignment: the few bytes before the first 16-byte boundary, and after the last, take
 * plain stores. */
__attribute__((target("sse4.2"))) static void hw_fused_three(unsigned char *dst, const unsigned char *src, size_t n,
                                                             uint32_t *regs) {
    const unsigned char *a = src, *b = src + n, *c = src + 2 * n;
    unsigned char *da = dst, *db = dst + n, *dc = dst + 2 * n;
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    size_t end = head + ((n - head) & ~(size_t)15);
    uint64_t ca = hw_copy_update(0xFFFFFFFFu, da, a, head);
    uint64_t cb = hw_copy_update(0xFFFFFFFFu, db, b, head);
    uint64_t cc = hw_copy_update(0xFFFFFFFFu, dc, c, head);
    for (size_t i = head; i < end; i += 16) {
        __m128i va = _mm_loadu_si128((const __m128i *)(a + i));
        __m128i vb = _mm_loadu_si128((const __m128i *)(b + i));
        __m128i vc = _mm_loadu_si128((const __m128i *)(c + i));
        ca = _mm_crc32_u64(ca, (uint64_t)_mm_cvtsi128_si64(va));
        cb = _mm_crc32_u64(cb, (uint64_t)_mm_cvtsi128_si64(vb));
        cc = _mm_crc32_u64(cc, (uint64_t)_mm_cvtsi128_si64(vc));
        ca = _mm_crc32_u64(ca, (uint64_t)_mm_extract_epi64(va, 1));
        cb = _mm_crc32_u64(cb, (uint64_t)_mm_extract_epi64(vb, 1));
        cc = _mm_crc32_u64(cc, (uint64_t)_mm_extract_epi64(vc, 1));
        _mm_stream_si128((__m128i *)(da + i), va);
        _mm_stream_si128((__m128i *)(db + i), vb);
        _mm_stream_si128((__m128i *)(dc + i), vc);
    }
    regs[0] = hw_copy_update((uint32_t)ca, da + end, a + end, n - end);
    regs[1] = hw_copy_update((uint32_t)cb, db + end, b + end, n - end);
    regs[2] = hw_copy_update((uint32_t)cc, dc + end, c + end, n - end);
}

/* `len` bytes from src to dst, back to front, with non-temporal stores (plain ones for the
 * unaligned ends). */
__attribute__((target("sse4.2"))) static void nt_copy_backward(unsigned char *dst, const unsigned char *src,
                                                               size_t len) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > len) head = len;
    size_t tail = (len - head) & 15;
    memcpy(dst + len - tail, src + len - tail, tail);
    unsigned char *d = dst + head;
    const unsigned char *s = src + head;
    for (size_t i = len - head - tail; i >= 16; i -= 16) {
        _mm_stream_si128((__m128i *)(d + i - 16), _mm_loadu_si128((const __m128i *)(s + i - 16)));
    }
    memcpy(dst, src, head);
}

/* Store-to-load aliasing. A load whose address matches a store still in flight in its low 12
 * bits (the page offset) is held back until that store is done, even though the addresses
 * differ. In a forward copy whose source lies a little *behind* its destination modulo 4096,
 * every load meets such a store. Measured here, the fused copy ran 4 to 17 times slower with
 * the source 16 to 112 bytes behind; 2 times at 128 bytes; 1.2 to 1.4 times from 144 to 208
 * bytes (no worse than the two-pass route below, so those stay fused).
 * Which chunks of a shard hit this is chance (the tensors' addresses against their offsets in
 * the file): two ranks copying 96 chunks of 5.3 MiB each took 57 ms with it, 43 ms without. */
#define ALIAS_WINDOW 128

static int aliased(const unsigned char *dst, const unsigned char *src) {
    return (((uintptr_t)src - (uintptr_t)dst) & 4095) >= 4096 - ALIAS_WINDOW;
}

/* Three whole blocks of `n` bytes (a multiple of 16): fused in one pass unless the source
 * trails the destination. Then in two passes, the checksums first (loads only; they leave
 * the three blocks in cache) and the copy second, back to front, so that the loads meet only
 * stores made long before. The second pass reads from cache: the memory traffic is the same
 * as fused, and it takes about 1.4 times as long (against 2 to 17 times, fused). */
__attribute__((target("sse4.2"))) static void hw_copy_three(unsigned char *dst, const unsigned char *src, size_t n,
                                                            uint32_t *regs) {
    if (!aliased(dst, src)) {
        hw_fused_three(dst, src, n, regs);
        return;
    }
    uint32_t out[3];
    hw_three(src, src + n, src + 2 * n, n, out);
    regs[0] = ~out[0];
    regs[1] = ~out[1];
    regs[2] = ~out[2];
    nt_copy_backward(dst, src, 3 * n);
}

/* Bytes [pos, pos + n) of the file: copied from src to dst (dst == NULL: checksummed only). */
__attribute__((target("sse4.2"))) static void hw_stream(unsigned char *dst, const unsigned char *src, size_t pos,
                                                        size_t n, size_t block, uint32_t *regs) {
    size_t k = pos / block, in = pos % block;
    if (in != 0 && n > 0) { /* finish the block an earlier piece started */
        size_t m = n < block - in ? n : block - in;
        regs[k] = dst ? hw_copy_update(regs[k], dst, src, m) : hw_update(regs[k], src, m);
        src += m;
        if (dst) dst += m;
        n -= m;
        k++;
    }
    if (dst && block % 16 == 0) {
        for (; n >= 3 * block; n -= 3 * block, k += 3, src += 3 * block, dst += 3 * block) {
            hw_copy_three(dst, src, block, regs + k);
        }
        _mm_sfence(); /* non-temporal stores are weakly ordered: publish them before returning */
    } else if (!dst) {
        for (; n >= 3 * block; n -= 3 * block, k += 3, src += 3 * block) {
            uint32_t out[3];
            hw_three(src, src + block, src + 2 * block, block, out);
            regs[k] = ~out[0];
            regs[k + 1] = ~out[1];
            regs[k + 2] = ~out[2];
        }
    }
    for (; n > 0; k++) { /* the rest, one block at a time; the last may stay open */
        size_t m = n < block ? n : block;
        regs[k] = dst ? hw_copy_update(0xFFFFFFFFu, dst, src, m) : hw_update(0xFFFFFFFFu, src, m);
        src += m;
        if (dst) dst += m;
        n -= m;
    }
}
#endif

static update_fn best_update = sw_update;
static blocks_fn best_blocks = sw_blocks;
static stream_fn best_stream = sw_stream;
static const char *best_name = "software";

static void choose_implementation(void) {
#ifdef HAVE_SSE42_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        best_update = hw_update;
        best_blocks = hw_blocks;
        best_stream = hw_stream;
        best_name = "sse4.2";
    }
#endif
}

static PyObject *py_crc32c(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "crc", "software", NULL};
    Py_buffer view;
    PyObject *crc_obj = NULL;
    int software = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|O!p:crc32c", kwlist, &view, &PyLong_Type, &crc_obj,
                                     &software)) {
        return NULL;
    }
    unsigned long long crc = 0;
    if (crc_obj != NULL) {
        crc = PyLong_AsUnsignedLongLong(crc_obj); /* OverflowError for negative values */
        if ((crc == (unsigned long long)-1 && PyErr_Occurred()) || crc > 0xFFFFFFFFull) {
            PyBuffer_Release(&view);
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "crc must be an unsigned 32-bit value (0 <= crc < 2**32)");
            return NULL;
        }
    }
    update_fn update = software ? sw_update : best_update;
    uint32_t reg = ~(uint32_t)crc;
    if (view.len >= GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        reg = update(reg, (const unsigned char *)view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        reg = update(reg, (const unsigned char *)view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong((unsigned long)~reg);
}

static PyObject *py_crc32c_blocks(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "block_bytes", "software", NULL};
    Py_buffer view;
    Py_ssize_t block = 65536;
    int software = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|np:crc32c_blocks", kwlist, &view, &block, &software)) {
        return NULL;
    }
    if (block <= 0) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "block_bytes must be positive, got %zd", block);
        return NULL;
    }
    size_t len = (size_t)view.len;
    size_t count = len / (size_t)block + (len % (size_t)block != 0);
    uint32_t *sums = PyMem_RawMalloc(count ? count * sizeof(uint32_t) : 1);
    if (sums == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    blocks_fn blocks = software ? sw_blocks : best_blocks;
    if (len >= GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        blocks((const unsigned char *)view.buf, len, (size_t)block, sums);
        Py_END_ALLOW_THREADS
    } else {
        blocks((const unsigned char *)view.buf, len, (size_t)block, sums);
    }
    PyBuffer_Release(&view);
    PyObject *result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(count * 4));
    if (result != NULL) {
        unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(result);
        for (size_t i = 0; i < count; i++) {
            dst[4 * i] = (unsigned char)(sums[i] & 0xFF);
            dst[4 * i + 1] = (unsigned char)((sums[i] >> 8) & 0xFF);
            dst[4 * i + 2] = (unsigned char)((sums[i] >> 16) & 0xFF);
            dst[4 * i + 3] = (unsigned char)(sums[i] >> 24);
        }
    }
    PyMem_RawFree(sums);
    return result;
}


/* Shared by blocks_update and copy_blocks_update: dst is NULL for a checksum-only piece. */
static PyObject *stream_common(Py_buffer *dst, Py_buffer *src, Py_ssize_t offset, Py_buffer *regs, Py_ssize_t block,
                               int software) {
    if (block <= 0) {
        PyErr_Format(PyExc_ValueError, "block_bytes must be positive, got %zd", block);
        return NULL;
    }
    if (offset < 0) {
        PyErr_Format(PyExc_ValueError, "offset must be >= 0, got %zd", offset);
        return NULL;
    }
    if (dst != NULL && dst->len != src->len) {
        PyErr_Format(PyExc_ValueError, "dst holds %zd bytes but src %zd: they must be the same size", dst->len,
                     src->len);
        return NULL;
    }
    size_t n = (size_t)src->len, pos = (size_t)offset, b = (size_t)block;
    size_t need = n ? (pos + n + b - 1) / b : 0;
    if ((size_t)regs->len < need * sizeof(uint32_t) || ((uintptr_t)regs->buf % sizeof(uint32_t)) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "regs must be an aligned array of at least %zu uint32 (one per block up to byte %zu), got %zd bytes",
                     need, pos + n, regs->len);
        return NULL;
    }
    stream_fn stream = software ? sw_stream : best_stream;
    unsigned char *d = dst ? (unsigned char *)dst->buf : NULL;
    if (n >= GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        stream(d, (const unsigned char *)src->buf, pos, n, b, (uint32_t *)regs->buf);
        Py_END_ALLOW_THREADS
    } else {
        stream(d, (const unsigned char *)src->buf, pos, n, b, (uint32_t *)regs->buf);
    }
    Py_RETURN_NONE;
}

static PyObject *py_blocks_update(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "offset", "regs", "block_bytes", "software", NULL};
    Py_buffer data, regs;
    Py_ssize_t offset, block = 65536;
    int software = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*nw*|np:blocks_update", kwlist, &data, &offset, &regs, &block,
                                     &software)) {
        return NULL;
    }
    PyObject *result = stream_common(NULL, &data, offset, &regs, block, software);
    PyBuffer_Release(&data);
    PyBuffer_Release(&regs);
    return result;
}

static PyObject *py_copy_blocks_update(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dst", "src", "offset", "regs", "block_bytes", "software", NULL};
    Py_buffer dst, src, regs;
    Py_ssize_t offset, block = 65536;
    int software = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "w*y*nw*|np:copy_blocks_update", kwlist, &dst, &src, &offset,
                                     &regs, &block, &software)) {
        return NULL;
    }
    PyObject *result = stream_common(&dst, &src, offset, &regs, block, software);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&regs);
    return result;
}

static PyObject *py_implementation(PyObject *self, PyObject *unused) { return PyUnicode_FromString(best_name); }

static PyMethodDef methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(data, crc=0, software=False) -> int\n\nCRC-32C of data, continuing from crc (like zlib.crc32)."},
    {"crc32c_blocks", (PyCFunction)(void (*)(void))py_crc32c_blocks, METH_VARARGS | METH_KEYWORDS,
     "crc32c_blocks(data, block_bytes=65536, software=False) -> bytes\n\n"
     "CRC-32C of each block of data (the last may be short), as little-endian uint32."},
    {"blocks_update", (PyCFunction)(void (*)(void))py_blocks_update, METH_VARARGS | METH_KEYWORDS,
     "blocks_update(data, offset, regs, block_bytes=65536, software=False) -> None\n\n"
     "Continue the per-block CRC registers `regs` over `data`, the file's bytes from `offset` on."},
    {"copy_blocks_update", (PyCFunction)(void (*)(void))py_copy_blocks_update, METH_VARARGS | METH_KEYWORDS,
     "copy_blocks_update(dst, src, offset, regs, block_bytes=65536, software=False) -> None\n\n"
     "Copy src into dst and continue the per-block CRC registers over it, in one pass."},
    {"implementation", py_implementation, METH_NOARGS,
     "implementation() -> str\n\n\"sse4.2\" (hardware CRC-32C) or \"software\" (slicing-by-8 in C)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "_blocksum",
    "CRC-32C of every block of a buffer, in one call, without the GIL.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__blocksum(void) {
    init_tables();
    choose_implementation();
    return PyModule_Create(&module);
}
