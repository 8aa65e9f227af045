/* Many XXH3-64 digests in one call, without the GIL (hsstore.dataset.sample_checks, `check_samples`).
 *
 * The loader's checker verifies the sample checksums of a batch (docs/FORMAT.md: XXH3-64 of a
 * sample's states, then its token columns). Hashing sample by sample from Python takes and
 * gives back the interpreter's lock several times per sample, and the thread that reads the
 * next batch waits for it each time; here one call hashes the whole batch while that thread
 * runs. The hash itself is xxHash's XXH3-64 from its public header, compiled in (xxHash's
 * header-only mode), whose digests are fixed by its specification from xxHash 0.8 on: the
 * digests of Python's xxhash.xxh3_64.
 *
 * Every buffer is held through the buffer protocol for the length of the call, and every span
 * is checked against its buffer's length before any is hashed: nothing else is trusted.
 *
 * The writer's side (hsstore.segment.writer): `copy_rows` moves a sample's rows into the shard
 * buffer, hashes them into the sample's checksum (an XXH3 state held by a capsule, `new_state`),
 * takes each row's largest magnitude for the statistics (hsstore.segment.stats, `row_absmax`)
 * and widens the rows the statistics sample to float32, in one pass, each row while it is in
 * the cache: separately, the checksum, the copy and the statistics each read the whole sample
 * from memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "../codec/byte_planes.h"

#define STATE_CAPSULE "hsstore.xxh3_state"
#define BLOCK_BYTES (16 << 10)

/* Spans are (buffer, offset, length) triples, int64, ``per`` of them for each digest. */
static PyObject *xxh3_spans(PyObject *self, PyObject *args) {
    PyObject *buffers_arg;
    Py_buffer spans, out;
    Py_ssize_t per;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oy*nw*:xxh3_spans", &buffers_arg, &spans, &per, &out))
        return NULL;
    PyObject *buffers = NULL, *result = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t held = 0, n_buffers = 0;
    const int64_t *span = (const int64_t *)spans.buf;
    Py_ssize_t n_out = out.len / (Py_ssize_t)sizeof(uint64_t);
    if (per < 1 || spans.len != n_out * per * 3 * (Py_ssize_t)sizeof(int64_t) ||
        out.len % (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "xxh3_spans: spans are not per triples per digest");
        goto done;
    }
    buffers = PySequence_Fast(buffers_arg, "xxh3_spans: buffers must be a sequence");
    if (!buffers)
        goto done;
    n_buffers = PySequence_Fast_GET_SIZE(buffers);
    views = PyMem_Calloc((size_t)n_buffers + 1, sizeof(Py_buffer));
    if (!views) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n_buffers; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(buffers, held), &views[held],
                               PyBUF_C_CONTIGUOUS) < 0)
            goto done;
    }
    for (Py_ssize_t i = 0; i < n_out * per; i++) {
        int64_t b = span[3 * i], at = span[3 * i + 1], n = span[3 * i + 2];
        if (b < 0 || b >= n_buffers || at < 0 || n < 0 || at > views[b].len - n) {
            PyErr_Format(PyExc_ValueError, "xxh3_spans: span %zd lies outside its buffer", i);
            goto done;
        }
    }
    int failed = 0;
    uint64_t *digests = (uint64_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    XXH3_state_t *state = XXH3_createState();
    if (!state) {
        failed = 1;
    } else {
        for (Py_ssize_t k = 0; k < n_out && !failed; k++) {
            failed |= XXH3_64bits_reset(state) != XXH_OK;
            for (Py_ssize_t p = 0; p < per; p++) {
                const int64_t *s = span + 3 * (k * per + p);
                failed |= XXH3_64bits_update(state, (const char *)views[s[0]].buf + s[1],
                                             (size_t)s[2]) != XXH_OK;
            }
            digests[k] = XXH3_64bits_digest(state);
        }
        XXH3_freeState(state);
    }
    Py_END_ALLOW_THREADS
    if (failed)
        PyErr_SetString(PyExc_MemoryError, "xxh3_spans: XXH3 failed");
    else
        result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_XDECREF(buffers);
    PyBuffer_Release(&spans);
    PyBuffer_Release(&out);
    return result;
}

static void free_state(PyObject *capsule) {
    XXH3_freeState(PyCapsule_GetPointer(capsule, STATE_CAPSULE));
}

static PyObject *new_state(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    XXH3_state_t *state = XXH3_createState();
    if (!state || XXH3_64bits_reset(state) != XXH_OK) {
        XXH3_freeState(state);
        return PyErr_NoMemory();
    }
    PyObject *capsule = PyCapsule_New(state, STATE_CAPSULE, free_state);
    if (!capsule)
        XXH3_freeState(state);
    return capsule;
}

static XXH3_state_t *state_of(PyObject *capsule) {
    return PyCapsule_GetPointer(capsule, STATE_CAPSULE); /* sets TypeError on anything else */
}

static PyObject *state_reset(PyObject *self, PyObject *capsule) {
    (void)self;
    XXH3_state_t *state = state_of(capsule);
    if (!state)
        return NULL;
    XXH3_64bits_reset(state);
    Py_RETURN_NONE;
}

static PyObject *state_update(PyObject *self, PyObject *args) {
    PyObject *capsule;
    Py_buffer data;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oy*:state_update", &capsule, &data))
        return NULL;
    XXH3_state_t *state = state_of(capsule);
    if (state)
        XXH3_64bits_update(state, data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    if (!state)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *state_digest(PyObject *self, PyObject *capsule) {
    (void)self;
    XXH3_state_t *state = state_of(capsule);
    return state ? PyLong_FromUnsignedLongLong(XXH3_64bits_digest(state)) : NULL;
}

/* The largest of (value & 0x7FFF) over n 2-byte values: the magnitude bits of a bf16 or
 * float16, whose order is that of the magnitudes (sign-magnitude floats). */
static uint16_t magnitude_max16(const uint16_t *v, size_t n) {
    size_t i = 0;
    uint16_t best = 0;
#if defined(__SSE2__)
    /* With the sign cleared every value is a non-negative int16: the signed max is right. */
    const __m128i bits = _mm_set1_epi16(0x7FFF);
    __m128i m0 = _mm_setzero_si128(), m1 = _mm_setzero_si128();
    for (; i + 16 <= n; i += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(v + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(v + i + 8));
        m0 = _mm_max_epi16(m0, _mm_and_si128(a, bits));
        m1 = _mm_max_epi16(m1, _mm_and_si128(b, bits));
    }
    m0 = _mm_max_epi16(m0, m1);
    m0 = _mm_max_epi16(m0, _mm_srli_si128(m0, 8));
    m0 = _mm_max_epi16(m0, _mm_srli_si128(m0, 4));
    m0 = _mm_max_epi16(m0, _mm_srli_si128(m0, 2));
    best = (uint16_t)_mm_cvtsi128_si32(m0);
#endif
    for (; i < n; i++) {
        uint16_t x = v[i] & 0x7FFF;
        best = x > best ? x : best;
    }
    return best;
}

static uint32_t magnitude_max32(const uint32_t *v, size_t n) {
    uint32_t best = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t x = v[i] & 0x7FFFFFFFu;
        best = x > best ? x : best;
    }
    return best;
}

static void measure_rows(const char *in, char *rowmax, Py_ssize_t rows, Py_ssize_t width,
                         Py_ssize_t itemsize) {
    for (Py_ssize_t r = 0; r < rows; r++, in += width * itemsize) {
        if (itemsize == 2) {
            uint16_t m = magnitude_max16((const uint16_t *)in, (size_t)width);
            memcpy(rowmax + 2 * r, &m, 2);
        } else {
            uint32_t m = magnitude_max32((const uint32_t *)in, (size_t)width);
            memcpy(rowmax + 4 * r, &m, 4);
        }
    }
}

/* The checks both calls make of their row buffers; 0 with an exception set if one fails. */
static int rows_fit(const Py_buffer *src, const Py_buffer *rowmax, Py_ssize_t width,
                    Py_ssize_t itemsize, const char *what) {
    if ((itemsize != 2 && itemsize != 4) || width < 1) {
        PyErr_Format(PyExc_ValueError, "%s: 2- or 4-byte values, rows of >= 1", what);
        return 0;
    }
    Py_ssize_t row_bytes = width * itemsize;
    if (src->len % row_bytes || rowmax->len != src->len / row_bytes * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: whole rows, and one value of rowmax per row", what);
        return 0;
    }
    return 1;
}

static PyObject *row_magnitudes(PyObject *self, PyObject *args) {
    Py_buffer src, rowmax;
    Py_ssize_t width, itemsize;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*nn:row_magnitudes", &src, &rowmax, &width, &itemsize))
        return NULL;
    PyObject *result = NULL;
    if (rows_fit(&src, &rowmax, width, itemsize, "row_magnitudes")) {
        Py_BEGIN_ALLOW_THREADS
        measure_rows(src.buf, rowmax.buf, src.len / (width * itemsize), width, itemsize);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&rowmax);
    return result;
}

/* A sampled row as float32: a bf16 is the high half of the float32 of the same value; a
 * float32 is itself. */
static void widen_row(uint32_t *out, const char *in, Py_ssize_t n, Py_ssize_t itemsize) {
    if (itemsize == 4) {
        memcpy(out, in, (size_t)n * 4);
        return;
    }
    const uint16_t *v = (const uint16_t *)in;
    Py_ssize_t i = 0;
#if defined(__SSE2__)
    const __m128i zero = _mm_setzero_si128();
    for (; i + 8 <= n; i += 8) {
        __m128i x = _mm_loadu_si128((const __m128i *)(v + i));
        _mm_storeu_si128((__m128i *)(out + i), _mm_unpacklo_epi16(zero, x));
        _mm_storeu_si128((__m128i *)(out + i + 4), _mm_unpackhi_epi16(zero, x));
    }
#endif
    for (; i < n; i++)
        out[i] = (uint32_t)v[i] << 16;
}

/* How many of ``tokens`` token rows are picked: first, first + every, ... (none if every is 0). */
static Py_ssize_t picks(Py_ssize_t tokens, Py_ssize_t first, Py_ssize_t every) {
    return every < 1 || first >= tokens ? 0 : (tokens - first + every - 1) / every;
}

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    PyObject *capsule;
    Py_buffer src, dst, rowmax, sampled;
    Py_ssize_t width, itemsize, layers, first, every, chunk_rows, at;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oy*w*w*nnw*nnnnn:copy_rows", &capsule, &src, &dst, &rowmax,
                          &width, &itemsize, &sampled, &layers, &first, &every, &chunk_rows,
                          &at))
        return NULL;
    PyObject *result = NULL;
    XXH3_state_t *state = state_of(capsule);
    Py_ssize_t row_bytes = width * itemsize, token_bytes = row_bytes * layers;
    Py_ssize_t tokens = layers > 0 && token_bytes > 0 ? src.len / token_bytes : 0;
    if (!state || !rows_fit(&src, &rowmax, width, itemsize, "copy_rows")) {
        /* the exception is set */
    } else if (layers < 1 || src.len % token_bytes || first < 0 || every < 0 ||
               sampled.len != picks(tokens, first, every) * layers * width * 4) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_rows: sampled must hold the picked token rows as float32");
    } else if (chunk_rows == 0 ? dst.len != src.len
                               : (itemsize != 2 || chunk_rows < 0 || at < 0 ||
                                  dst.len % (chunk_rows * token_bytes) ||
                                  at + tokens > dst.len / token_bytes)) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_rows: dst must be src's size, or whole chunks of 2-byte values "
                        "that hold rows at .. at + len(src)");
    } else if ((const char *)dst.buf < (const char *)src.buf + src.len &&
               (const char *)src.buf < (const char *)dst.buf + dst.len) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: src and dst overlap");
    } else {
        Py_ssize_t rows = src.len / row_bytes;
        /* Rows go in blocks of ~16 KiB, which stay in the L1 cache between the copy, the
         * hash, the magnitudes and the sampled rows' floats. Split into planes, one row at a
         * time: each of a chunk's rows has its place in both planes of the chunk. The planes
         * are written around the caches: an ordinary store first reads each destination line
         * from memory, and the encoder reads the shard only once it is full. */
        Py_ssize_t per_block = row_bytes >= BLOCK_BYTES || chunk_rows ? 1 : BLOCK_BYTES / row_bytes;
        Py_ssize_t plane_bytes = chunk_rows * layers * width; /* one plane of a chunk */
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r0 = 0; r0 < rows; r0 += per_block) {
            Py_ssize_t n = rows - r0 < per_block ? rows - r0 : per_block;
            const char *in = (const char *)src.buf + r0 * row_bytes;
            if (chunk_rows) {
                Py_ssize_t row = at + r0 / layers, layer = r0 % layers;
                uint8_t *low = (uint8_t *)dst.buf + row / chunk_rows * 2 * plane_bytes +
                               (row % chunk_rows * layers + layer) * width;
                split_bytes_streamed(low, low + plane_bytes, (const uint8_t *)in, (size_t)width);
            } else {
                memcpy((char *)dst.buf + r0 * row_bytes, in, (size_t)(n * row_bytes));
            }
            XXH3_64bits_update(state, in, (size_t)(n * row_bytes));
            measure_rows(in, (char *)rowmax.buf + r0 * itemsize, n, width, itemsize);
            for (Py_ssize_t r = r0; every > 0 && r < r0 + n; r++) {
                Py_ssize_t t = r / layers - first;
                if (t >= 0 && t % every == 0)
                    widen_row((uint32_t *)sampled.buf + (t / every * layers + r % layers) * width,
                              (const char *)src.buf + r * row_bytes, width, itemsize);
            }
        }
#if defined(__SSE2__)
        _mm_sfence();
#endif
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&rowmax);
    PyBuffer_Release(&sampled);
    return result;
}

static PyMethodDef methods[] = {
    {"xxh3_spans", xxh3_spans, METH_VARARGS,
     "xxh3_spans(buffers, spans, per, out)\n--\n\n"
     "Write into out (uint64 each) the XXH3-64 digest of each run of per spans, a span being\n"
     "an int64 triple (index into buffers, byte offset, byte length) that must lie inside its\n"
     "buffer."},
    {"new_state", new_state, METH_NOARGS,
     "new_state()\n--\n\nA fresh XXH3-64 state (a capsule), for one thread at a time."},
    {"state_reset", state_reset, METH_O, "state_reset(state)\n--\n\nStart the state afresh."},
    {"state_update", state_update, METH_VARARGS,
     "state_update(state, data)\n--\n\nHash data's bytes into the state."},
    {"state_digest", state_digest, METH_O,
     "state_digest(state)\n--\n\nThe XXH3-64 digest of what the state has hashed."},
    {"row_magnitudes", row_magnitudes, METH_VARARGS,
     "row_magnitudes(src, rowmax, width, itemsize)\n--\n\n"
     "Write into rowmax the largest magnitude bits of each row of width values of src (as\n"
     "copy_rows does, without the copy and the hash)."},
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(state, src, dst, rowmax, width, itemsize, sampled, layers, first, every,\n"
     "          chunk_rows, at)\n--\n\n"
     "Copy src into dst (same size, no overlap) and hash it into state; write into rowmax the\n"
     "largest magnitude bits (value with the sign bit cleared, little-endian, itemsize 2 or 4)\n"
     "of each row of width values; and into sampled, as float32 (itemsize 2: bf16), the token\n"
     "rows (layers rows each) first, first + every, ... (none with every 0). With chunk_rows\n"
     "> 0, dst holds chunks of chunk_rows token rows of 2-byte values each stored as its two\n"
     "byte planes (the low bytes of all its values, then the high bytes), and src's rows go\n"
     "to rows at, at + 1, ... of it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_xxh3_many", "Many XXH3-64 digests in one call; rows copied, hashed and measured in one pass.", -1, methods,
};

PyMODINIT_FUNC PyInit__xxh3_many(void) { return PyModule_Create(&module); }
