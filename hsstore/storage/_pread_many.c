/* Many file ranges read into one buffer in one call, without the GIL
 * (hsstore.storage.local_store, `LocalStorage.read_many_into`).
 *
 * A loader's batch of small uncompressed samples is a few hundred byte ranges of a few shard
 * files. Read one `preadv` at a time from Python, each range gives the interpreter's lock back
 * and takes it again, and waits behind whichever thread holds it meanwhile (the checker, the
 * training loop); here one call reads them all while the other threads run.
 *
 * The buffer is held through the buffer protocol for the length of the call, and every range
 * is checked against its length before any is read: nothing else is trusted. A range the file
 * does not hold whole (an error, or the end of the file) ends the call: the caller reads it
 * again by the rule that names its problem.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <unistd.h>

/* Ranges are (descriptor, file offset, length, offset in the buffer) quadruples, int64. */
static PyObject *pread_spans(PyObject *self, PyObject *args) {
    Py_buffer spans, into;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*:pread_spans", &spans, &into))
        return NULL;
    PyObject *result = NULL;
    const int64_t *span = (const int64_t *)spans.buf;
    Py_ssize_t n = spans.len / (Py_ssize_t)(4 * sizeof(int64_t));
    if (spans.len != n * (Py_ssize_t)(4 * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "pread_spans: spans are not int64 quadruples");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t fd = span[4 * i], offset = span[4 * i + 1], len = span[4 * i + 2];
        int64_t at = span[4 * i + 3];
        if (fd < 0 || fd > INT32_MAX || offset < 0 || len < 0 || at < 0 || at > into.len - len) {
            PyErr_Format(PyExc_ValueError, "pread_spans: range %zd lies outside the buffer", i);
            goto done;
        }
    }
    Py_ssize_t whole = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; whole < n; whole++) {
        const int64_t *s = span + 4 * whole;
        char *to = (char *)into.buf + s[3];
        int64_t want = s[2], offset = s[1];
        while (want > 0) {
            ssize_t got = pread((int)s[0], to, (size_t)want, (off_t)offset);
            if (got < 0 && errno == EINTR)
                continue;
            if (got <= 0)
                break;
            to += got;
            want -= got;
            offset += got;
        }
        if (want > 0)
            break;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(whole);
done:
    PyBuffer_Release(&spans);
    PyBuffer_Release(&into);
    return result;
}

static PyMethodDef methods[] = {
    {"pread_spans", pread_spans, METH_VARARGS,
     "pread_spans(spans, into)\n--\n\n"
     "Read each range of spans, an int64 quadruple (descriptor, file offset, length, offset in\n"
     "into) that must lie inside the writable buffer into, whole and in order; returns how\n"
     "many were read whole before the first that was not (a read error or the file's end)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pread_many", "Many file ranges read in one call.", -1, methods,
};

PyMODINIT_FUNC PyInit__pread_many(void) { return PyModule_Create(&module); }
