/* The decoder of split-zstd frames (hsstore.codec.codecs, `_SplitDecoder`), and the split of
 * values into byte planes that the encoder codes (`split_planes`).
 *
 * A split-zstd chunk stores the low and the high byte of every 2-byte value as two streams.
 * One call reads the frame, has libzstd decode the coded streams into the caller's scratch (with
 * a decoding context the caller keeps per thread, `new_context`), then one pass writes
 * out[2i] = low[i], out[2i + 1] = high[i]. With ``stream`` that
 * pass writes around the caches (non-temporal stores): a loader decodes each chunk once into
 * a batch far larger than the caches, which another thread checks later, and an ordinary
 * store there first reads every destination line from memory only to overwrite it. Without
 * it the values land in the cache, for a destination read again at once.
 *
 * Nothing in the frame is trusted: every length is checked against the buffers before it is
 * used, and a frame of any other shape is left to c-blosc. The GIL is released for the
 * decode; the buffers are held through the buffer protocol, so they outlive it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <zstd.h>

#include "byte_planes.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static void join_scalar(uint8_t *out, const uint8_t *low, const uint8_t *high, size_t from,
                        size_t n) {
    for (size_t i = from; i < n; i++) {
        out[2 * i] = low[i];
        out[2 * i + 1] = high[i];
    }
}

static void join(uint8_t *out, const uint8_t *low, const uint8_t *high, size_t n, int stream) {
    size_t i = 0;
#if defined(__SSE2__)
    if (stream && ((uintptr_t)out & 1) == 0) {
        /* Non-temporal stores need 16-byte aligned destinations: the first values go one by
         * one up to the first aligned pair of stores. */
        while (i < n && ((uintptr_t)(out + 2 * i) & 15) != 0) {
            out[2 * i] = low[i];
            out[2 * i + 1] = high[i];
            i++;
        }
        for (; i + 16 <= n; i += 16) {
            __m128i lo = _mm_loadu_si128((const __m128i *)(low + i));
            __m128i hi = _mm_loadu_si128((const __m128i *)(high + i));
            _mm_stream_si128((__m128i *)(out + 2 * i), _mm_unpacklo_epi8(lo, hi));
            _mm_stream_si128((__m128i *)(out + 2 * i + 16), _mm_unpackhi_epi8(lo, hi));
        }
        /* Orders the streamed stores before whatever hands the buffer to another thread. */
        _mm_sfence();
    } else {
        for (; i + 16 <= n; i += 16) {
            __m128i lo = _mm_loadu_si128((const __m128i *)(low + i));
            __m128i hi = _mm_loadu_si128((const __m128i *)(high + i));
            _mm_storeu_si128((__m128i *)(out + 2 * i), _mm_unpacklo_epi8(lo, hi));
            _mm_storeu_si128((__m128i *)(out + 2 * i + 16), _mm_unpackhi_epi8(lo, hi));
        }
    }
#else
    (void)stream; /* no portable non-temporal store: the compiler vectorizes the loop */
#endif
    join_scalar(out, low, high, i, n);
}

static uint32_t read_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* A split frame as hsstore.codec.codecs writes it: a blosc 1 header (version, versionlz,
 * flags, typesize, then nbytes, blocksize and cbytes as little-endian 32-bit words), the one
 * block's start offset (a 32-bit word, right after the header), then two streams, each a
 * 32-bit length and its bytes: the low bytes of the values, then the high bytes. A stream as
 * long as a plane is stored raw, any other is one zstd frame of exactly a plane. Returns 1
 * once decoded, 0 (nothing written) for a frame of any other shape, -1 for a stream zstd
 * refuses. */
static int decode_split(uint8_t *out, size_t out_len, const uint8_t *body, size_t len,
                        uint8_t *scratch, ZSTD_DCtx *dctx, unsigned flags, size_t min_plane, int stream) {
    const size_t header = 16, first = header + 4;
    if (len < first || body[2] != flags || body[3] != 2)
        return 0;
    size_t nbytes = read_u32(body + 4), half = nbytes / 2;
    if (nbytes != out_len || read_u32(body + 8) != nbytes || nbytes % 2 || half < min_plane ||
        read_u32(body + 16) != first)
        return 0;
    const uint8_t *planes[2];
    size_t at = first;
    for (int b = 0; b < 2; b++) {
        if (at + 4 > len)
            return 0;
        size_t n = read_u32(body + at);
        if (n == 0 || n > len - at - 4)
            return 0;
        planes[b] = body + at + 4;
        if (n != half) {
            if (ZSTD_decompressDCtx(dctx, scratch + b * half, half, body + at + 4, n) != half)
                return -1; /* an error (ZSTD_isError) or a short stream */
            planes[b] = scratch + b * half;
        }
        at += 4 + n;
    }
    if (at != len)
        return 0;
    join(out, planes[0], planes[1], half, stream);
    return 1;
}

#define CONTEXT_NAME "hsstore.codec._split_decoder.context"

static void free_context(PyObject *capsule) {
    ZSTD_freeDCtx((ZSTD_DCtx *)PyCapsule_GetPointer(capsule, CONTEXT_NAME));
}

static PyObject *new_context(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    ZSTD_DCtx *dctx = ZSTD_createDCtx();
    if (!dctx)
        return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(dctx, CONTEXT_NAME, free_context);
    if (!capsule)
        ZSTD_freeDCtx(dctx);
    return capsule;
}

static PyObject *decode_split_frame(PyObject *self, PyObject *args) {
    Py_buffer out, body, scratch;
    PyObject *context;
    unsigned int flags;
    Py_ssize_t min_plane;
    int stream;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*w*OInp:decode_split_frame", &out, &body, &scratch, &context,
                          &flags, &min_plane, &stream))
        return NULL;
    PyObject *result = NULL;
    /* The call's arguments hold the context, so it outlives the decode without the GIL. */
    ZSTD_DCtx *dctx = (ZSTD_DCtx *)PyCapsule_GetPointer(context, CONTEXT_NAME);
    if (!dctx) {
        /* PyCapsule_GetPointer has set the error: not a context of this module */
    } else if (scratch.len < out.len) {
        PyErr_SetString(PyExc_ValueError, "decode_split_frame: the scratch is too small");
    } else {
        int got;
        Py_BEGIN_ALLOW_THREADS
        got = decode_split((uint8_t *)out.buf, (size_t)out.len, (const uint8_t *)body.buf,
                           (size_t)body.len, (uint8_t *)scratch.buf, dctx, flags,
                           (size_t)min_plane, stream);
        Py_END_ALLOW_THREADS
        result = PyLong_FromLong(got);
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&body);
    PyBuffer_Release(&scratch);
    return result;
}

static int overlaps(const Py_buffer *a, const Py_buffer *b) {
    const char *a0 = a->buf, *b0 = b->buf;
    return a0 < b0 + b->len && b0 < a0 + a->len;
}

static PyObject *split_planes(PyObject *self, PyObject *args) {
    Py_buffer in, low, high;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*w*:split_planes", &in, &low, &high))
        return NULL;
    PyObject *result = NULL;
    if (in.len % 2 || low.len != in.len / 2 || high.len != in.len / 2) {
        PyErr_SetString(PyExc_ValueError, "split_planes: planes must be half the input each");
    } else if (overlaps(&high, &in) || overlaps(&high, &low) ||
               (overlaps(&low, &in) && low.buf != in.buf)) {
        PyErr_SetString(PyExc_ValueError,
                        "split_planes: only the low plane may share memory, at the input's start");
    } else {
        Py_BEGIN_ALLOW_THREADS
        split_bytes(low.buf, high.buf, in.buf, (size_t)low.len);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&in);
    PyBuffer_Release(&low);
    PyBuffer_Release(&high);
    return result;
}

static PyMethodDef methods[] = {
    {"split_planes", split_planes, METH_VARARGS,
     "split_planes(values, low, high)\n--\n\n"
     "Write the low byte of every 2-byte value into low and the high byte into high (each half\n"
     "of values' length); low may be values' own first half, no other memory may be shared."},
    {"new_context", new_context, METH_NOARGS,
     "new_context()\n--\n\n"
     "A zstd decoding context for decode_split_frame, freed with the object; one thread at a\n"
     "time may use it."},
    {"decode_split_frame", decode_split_frame, METH_VARARGS,
     "decode_split_frame(out, body, scratch, context, flags, min_plane, stream)\n--\n\n"
     "Decode a split frame's body (no crc) into out with libzstd and a context from\n"
     "new_context, its planes in scratch (at least len(out)): 1 once decoded, 0 (nothing\n"
     "written) for a frame of another shape (flags, typesize 2, one block, planes of at least\n"
     "min_plane bytes), -1 for a stream zstd refuses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_split_decoder", "The decoder of split-zstd frames.", -1, methods,
};

PyMODINIT_FUNC PyInit__split_decoder(void) { return PyModule_Create(&module); }
