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
 *   implementation() -> str
 *       "sse4.2" or "software": what the two functions above use when software=False.
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

static void sw_blocks(const unsigned char *p, size_t len, size_t block, uint32_t *out) {
    for (size_t off = 0; off < len; off += block) {
        size_t n = len - off < block ? len - off : block;
        *out++ = ~sw_update(0xFFFFFFFFu, p + off, n);
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_SSE42_PATH 1
#include <nmmintrin.h>

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
#endif

static update_fn best_update = sw_update;
static blocks_fn best_blocks = sw_blocks;
static const char *best_name = "software";

static void choose_implementation(void) {
#ifdef HAVE_SSE42_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        best_update = hw_update;
        best_blocks = hw_blocks;
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

static PyObject *py_implementation(PyObject *self, PyObject *unused) { return PyUnicode_FromString(best_name); }

static PyMethodDef methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(data, crc=0, software=False) -> int\n\nCRC-32C of data, continuing from crc (like zlib.crc32)."},
    {"crc32c_blocks", (PyCFunction)(void (*)(void))py_crc32c_blocks, METH_VARARGS | METH_KEYWORDS,
     "crc32c_blocks(data, block_bytes=65536, software=False) -> bytes\n\n"
     "CRC-32C of each block of data (the last may be short), as little-endian uint32."},
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
