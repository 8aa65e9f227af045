/* Joining the two byte planes of a split-zstd chunk into its 2-byte values.
 *
 * A split-zstd chunk stores the low and the high byte of every value as two streams
 * (hsstore.format.codecs). After zstd has decoded them into scratch, one pass writes
 * out[2i] = low[i], out[2i + 1] = high[i]. With ``stream`` the pass writes around the caches
 * (non-temporal stores): a loader decodes each chunk once into a batch far larger than the
 * caches, which another thread checks later, and an ordinary store there first reads every
 * destination line from memory only to overwrite it.
 * Without ``stream`` the values land in the cache, for a destination read again at once.
 *
 * The GIL is released for the pass; the buffers are held through the buffer protocol, so
 * they outlive it.
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

static PyObject *join_planes(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"out", "low", "high", "stream", NULL};
    Py_buffer out, low, high;
    int stream = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "w*y*y*|p:join_planes", keywords, &out, &low,
                                     &high, &stream))
        return NULL;
    PyObject *result = NULL;
    if (low.len != high.len || out.len != 2 * low.len) {
        PyErr_Format(PyExc_ValueError,
                     "join_planes: planes of %zd and %zd bytes do not fill %zd bytes", low.len,
                     high.len, out.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        join((uint8_t *)out.buf, (const uint8_t *)low.buf, (const uint8_t *)high.buf,
             (size_t)low.len, stream);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&low);
    PyBuffer_Release(&high);
    return result;
}

static PyMethodDef methods[] = {
    {"join_planes", (PyCFunction)(void (*)(void))join_planes, METH_VARARGS | METH_KEYWORDS,
     "join_planes(out, low, high, stream=False)\n--\n\n"
     "Write out[2i] = low[i] and out[2i + 1] = high[i] (out: writable, contiguous, twice\n"
     "the planes' length). With stream, write around the caches where the CPU allows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_planes", "The byte-plane join of split-zstd chunks.", -1, methods,
};

PyMODINIT_FUNC PyInit__planes(void) { return PyModule_Create(&module); }
