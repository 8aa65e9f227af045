/* The decoder of split-zstd frames (hsstore.codec.codecs, `_SplitDecoder`).
 *
 * A split-zstd chunk stores the low and the high byte of every 2-byte value as two streams.
 * One call reads the frame, has zstd decode the coded streams into the caller's scratch (the
 * zstd c-blosc links in, its function handed over by address, with a context kept per
 * thread), then one pass writes out[2i] = low[i], out[2i + 1] = high[i]. With ``stream`` that
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

typedef size_t (*zstd_decompress_fn)(void *dctx, void *dst, size_t capacity, const void *src,
                                     size_t size);

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
                        uint8_t *scratch, void *dctx, zstd_decompress_fn decompress,
                        unsigned flags, size_t min_plane, int stream) {
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
            if (decompress(dctx, scratch + b * half, half, body + at + 4, n) != half)
                return -1; /* an error code (a huge size_t) or a short stream */
            planes[b] = scratch + b * half;
        }
        at += 4 + n;
    }
    if (at != len)
        return 0;
    join(out, planes[0], planes[1], half, stream);
    return 1;
}

static PyObject *decode_split_frame(PyObject *self, PyObject *args) {
    Py_buffer out, body, scratch;
    unsigned long long dctx, decompress;
    unsigned int flags;
    Py_ssize_t min_plane;
    int stream;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*w*KKInp:decode_split_frame", &out, &body, &scratch, &dctx,
                          &decompress, &flags, &min_plane, &stream))
        return NULL;
    PyObject *result = NULL;
    if (scratch.len < out.len || !dctx || !decompress) {
        PyErr_SetString(PyExc_ValueError, "decode_split_frame: no scratch or no zstd context");
    } else {
        int got;
        Py_BEGIN_ALLOW_THREADS
        got = decode_split((uint8_t *)out.buf, (size_t)out.len, (const uint8_t *)body.buf,
                           (size_t)body.len, (uint8_t *)scratch.buf, (void *)(uintptr_t)dctx,
                           (zstd_decompress_fn)(uintptr_t)decompress, flags, (size_t)min_plane,
                           stream);
        Py_END_ALLOW_THREADS
        result = PyLong_FromLong(got);
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&body);
    PyBuffer_Release(&scratch);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_split_frame", decode_split_frame, METH_VARARGS,
     "decode_split_frame(out, body, scratch, dctx, decompress, flags, min_plane, stream)\n--\n\n"
     "Decode a split frame's body (no crc) into out with zstd's ZSTD_decompressDCtx at\n"
     "address decompress and the context dctx, its planes in scratch (at least len(out)):\n"
     "1 once decoded, 0 (nothing written) for a frame of another shape (flags, typesize 2,\n"
     "one block, planes of at least min_plane bytes), -1 for a stream zstd refuses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_split_decoder", "The decoder of split-zstd frames.", -1, methods,
};

PyMODINIT_FUNC PyInit__split_decoder(void) { return PyModule_Create(&module); }
