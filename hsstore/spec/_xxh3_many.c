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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

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

static PyMethodDef methods[] = {
    {"xxh3_spans", xxh3_spans, METH_VARARGS,
     "xxh3_spans(buffers, spans, per, out)\n--\n\n"
     "Write into out (uint64 each) the XXH3-64 digest of each run of per spans, a span being\n"
     "an int64 triple (index into buffers, byte offset, byte length) that must lie inside its\n"
     "buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_xxh3_many", "Many XXH3-64 digests in one call.", -1, methods,
};

PyMODINIT_FUNC PyInit__xxh3_many(void) { return PyModule_Create(&module); }
