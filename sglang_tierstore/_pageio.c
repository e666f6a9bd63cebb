/* Page I/O without the GIL: a claim of preadv/pwritev/checksum operations in one release.
 *
 * Moving a run of pages from Python costs a preadv or pwritev and a checksum per page, and
 * each of those lets the GIL go and takes it back: a hand-over that costs a thread spinning
 * in Python beside them (SGLang's scheduler) tens of microseconds each, far more than the
 * Python around them (docs/performance.md, "The GIL"). transfer() runs every operation an
 * I/O thread has claimed in one release of the GIL, checking the caller's stop flags between
 * operations, so a claim costs one hand-over however many pages it moves.
 *
 * exchange(), an index round trip held the same way, is in _exchange.c (the same module).
 *
 * The checksum is xxh3-64 computed by the functions of the xxhash package that
 * pagefile.checksum calls, resolved from its extension module when this one is imported:
 * the two cannot differ. Where they cannot be resolved the import fails (ImportError) and
 * pagefile runs the same operations from Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <sys/socket.h> /* MSG_DONTWAIT and MSG_NOSIGNAL: whether _exchange.c builds exchange() */
#include <sys/uio.h>
#include <unistd.h>

enum { OP_READ = 0, OP_WRITE = 1, OP_HASH = 2, OP_SKIP = 3 };

static uint64_t (*xxh3_64)(const void *, size_t);
static void *(*xxh3_create)(void);
static int (*xxh3_free)(void *);
static int (*xxh3_reset)(void *);
static int (*xxh3_update)(void *, const void *, size_t);
static uint64_t (*xxh3_digest)(const void *);

typedef struct {
    int kind, fd, err, hashed;
    off_t offset, advise_off, advise_len;
    struct iovec *iov;
    int iovcnt;
    size_t nbytes, done;
    Py_ssize_t *spans;
    Py_ssize_t nspans;
    uint64_t *sums;
} op_t;

/* The rest of a partial pwritev (a signal, a nearly full disk), from byte `from` on. */
static void write_rest(op_t *op, size_t from) {
    size_t pos = 0;
    for (int i = 0; i < op->iovcnt; i++) {
        const char *base = op->iov[i].iov_base;
        size_t len = op->iov[i].iov_len, at = from > pos ? from - pos : 0;
        pos += len;
        while (at < len) {
            ssize_t n = pwrite(op->fd, base + at, len - at, op->offset + (off_t)op->done);
            if (n < 0 && errno == EINTR)
                continue;
            if (n < 0)
                op->err = errno;
            if (n <= 0)
                return;
            at += (size_t)n;
            op->done += (size_t)n;
        }
    }
}

/* The checksum of each span, consecutive over the concatenation of the op's buffers. */
static void hash_spans(op_t *op, void *state) {
    int i = 0;
    size_t in = 0; /* offset in iov[i] */
    for (Py_ssize_t k = 0; k < op->nspans; k++) {
        size_t need = (size_t)op->spans[k];
        while (i < op->iovcnt && in == op->iov[i].iov_len) {
            i++;
            in = 0;
        }
        if (op->iov[i].iov_len - in >= need) { /* the usual case: a page within one buffer */
            op->sums[k] = xxh3_64((const char *)op->iov[i].iov_base + in, need);
            in += need;
            continue;
        }
        xxh3_reset(state);
        while (need) {
            while (in == op->iov[i].iov_len) {
                i++;
                in = 0;
            }
            size_t take = op->iov[i].iov_len - in < need ? op->iov[i].iov_len - in : need;
            xxh3_update(state, (const char *)op->iov[i].iov_base + in, take);
            in += take;
            need -= take;
        }
        op->sums[k] = xxh3_digest(state);
    }
}

static void run_op(op_t *op, void *state) {
    ssize_t n = 0;
    if (op->kind == OP_SKIP || op->err) /* err: refused before it ran (more buffers than IOV_MAX) */
        return;
    if (op->kind == OP_READ) {
        if (op->advise_len > 0) /* what this node's page cache holds of it (best effort) */
            (void)posix_fadvise(op->fd, op->advise_off, op->advise_len, POSIX_FADV_DONTNEED);
        do
            n = preadv(op->fd, op->iov, op->iovcnt, op->offset);
        while (n < 0 && errno == EINTR);
    } else if (op->kind == OP_WRITE) {
        do
            n = pwritev(op->fd, op->iov, op->iovcnt, op->offset);
        while (n < 0 && errno == EINTR);
    }
    if (n < 0) {
        op->err = errno;
        return;
    }
    op->done = (size_t)n;
    if (op->kind == OP_WRITE && n > 0 && op->done < op->nbytes)
        write_rest(op, op->done);
    if (op->err == 0 && (op->kind == OP_HASH || op->done == op->nbytes)) {
        hash_spans(op, state);
        op->hashed = 1;
    }
}

/* Whether a flag is set: Python sets them while this runs (a byte store; no other data rides on it). */
static int stopped(Py_buffer *flags, Py_ssize_t nflags) {
    for (Py_ssize_t f = 0; f < nflags; f++)
        if (__atomic_load_n((const char *)flags[f].buf, __ATOMIC_RELAXED))
            return 1;
    return 0;
}

PyDoc_STRVAR(transfer_doc,
"transfer(ops, stop) -> list of (errno, bytes moved, checksums)\n\n"
"Run ops in order without the GIL: each op is (kind, fd, offset, buffers, spans,\n"
"advise_offset, advise_length), kind 0 a preadv into the buffers, 1 a pwritev from them\n"
"(finished where it stopped short), 2 no I/O, 3 nothing at all. An op that moved every\n"
"byte (or did no I/O) then gets the xxh3-64 of each span, consecutive byte counts over\n"
"the buffers' concatenation. A read first drops advise_length bytes at advise_offset\n"
"from the page cache when that is positive. A read or write of more buffers than\n"
"IOV_MAX fails with EINVAL, as preadv/pwritev would. Returns the outcome of a prefix of\n"
"ops: before each op but the first, it stops once any stop flag (first byte of a\n"
"buffer) is set. The lists are copied first: changing them meanwhile changes nothing.");

static PyObject *transfer(PyObject *self, PyObject *args) {
    PyObject *ops_arg, *stop_arg, *ops = NULL, *stop = NULL, **lists = NULL, *result = NULL;
    Py_buffer *views = NULL, *flags = NULL;
    struct iovec *iovs = NULL;
    Py_ssize_t *spans = NULL, nviews = 0, nflags = 0, nops = 0, nlists = 0, nbufs = 0, nspans = 0, done_ops = 0;
    uint64_t *sums = NULL;
    op_t *op = NULL;
    void *state = NULL;

    (void)self;
    if (!PyArg_ParseTuple(args, "OO:transfer", &ops_arg, &stop_arg))
        return NULL;
    /* tuples of everything, so that no Python run while parsing (an __index__) can change a size */
    if (!(ops = PySequence_Tuple(ops_arg)) || !(stop = PySequence_Tuple(stop_arg)))
        goto out;
    nops = PyTuple_GET_SIZE(ops);
    if (!(lists = PyMem_Calloc(2 * nops + 1, sizeof *lists))) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < nops; i++) { /* sizes first, to allocate once */
        PyObject *t = PyTuple_GET_ITEM(ops, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 7) {
            PyErr_Format(PyExc_TypeError, "op %zd: expected a 7-tuple", i);
            goto out;
        }
        for (int k = 0; k < 2; k++) {
            if (!(lists[nlists] = PySequence_Tuple(PyTuple_GET_ITEM(t, 3 + k))))
                goto out;
            nlists++;
        }
        nbufs += PyTuple_GET_SIZE(lists[2 * i]);
        nspans += PyTuple_GET_SIZE(lists[2 * i + 1]);
    }
    op = PyMem_Calloc(nops ? nops : 1, sizeof *op);
    views = PyMem_Calloc(nbufs ? nbufs : 1, sizeof *views);
    iovs = PyMem_Calloc(nbufs ? nbufs : 1, sizeof *iovs);
    spans = PyMem_Calloc(nspans ? nspans : 1, sizeof *spans);
    sums = PyMem_Calloc(nspans ? nspans : 1, sizeof *sums);
    flags = PyMem_Calloc(PyTuple_GET_SIZE(stop) + 1, sizeof *flags);
    if (!op || !views || !iovs || !spans || !sums || !flags) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t f = 0; f < PyTuple_GET_SIZE(stop); f++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(stop, f), &flags[nflags], PyBUF_SIMPLE) < 0)
            goto out;
        if (flags[nflags++].len < 1) {
            PyErr_SetString(PyExc_ValueError, "a stop flag must be at least one byte");
            goto out;
        }
    }
    nbufs = nspans = 0;
    for (Py_ssize_t i = 0; i < nops; i++) {
        PyObject *t = PyTuple_GET_ITEM(ops, i), *b = lists[2 * i], *s = lists[2 * i + 1], *unused;
        long long offset, advise_off, advise_len;
        Py_ssize_t nb = PyTuple_GET_SIZE(b);
        size_t hashed = 0;
        op_t *o = &op[i];
        if (!PyArg_ParseTuple(t, "iiLOOLL", &o->kind, &o->fd, &offset, &unused, &unused, &advise_off, &advise_len))
            goto out;
        if (o->kind < OP_READ || o->kind > OP_SKIP) {
            PyErr_Format(PyExc_ValueError, "op %zd: unknown kind %d", i, o->kind);
            goto out;
        }
        o->offset = (off_t)offset;
        o->advise_off = (off_t)advise_off;
        o->advise_len = (off_t)advise_len;
        o->iov = &iovs[nbufs];
        if ((o->kind == OP_READ || o->kind == OP_WRITE) && nb > IOV_MAX)
            o->err = EINVAL; /* as preadv/pwritev would answer; the op is not run */
        for (Py_ssize_t k = 0; k < nb; k++) {
            Py_buffer *v = &views[nviews];
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(b, k), v, o->kind == OP_READ ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
                goto out;
            nviews++;
            o->iov[k].iov_base = v->buf;
            o->iov[k].iov_len = (size_t)v->len;
            o->nbytes += (size_t)v->len;
        }
        o->iovcnt = (int)(nb > INT_MAX ? INT_MAX : nb);
        nbufs += nb;
        o->spans = &spans[nspans];
        o->sums = &sums[nspans];
        o->nspans = PyTuple_GET_SIZE(s);
        for (Py_ssize_t k = 0; k < o->nspans; k++) {
            Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(s, k));
            if (n == -1 && PyErr_Occurred())
                goto out;
            if (n <= 0 || (size_t)n > o->nbytes - hashed) {
                PyErr_Format(PyExc_ValueError, "op %zd: span %zd of %zd bytes is not within the op's %zu bytes", i, k, n,
                             o->nbytes);
                goto out;
            }
            o->spans[k] = n;
            hashed += (size_t)n;
        }
        nspans += o->nspans;
    }
    if (nspans && !(state = xxh3_create())) {
        PyErr_NoMemory();
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS
    for (; done_ops < nops; done_ops++) {
        if (done_ops && stopped(flags, nflags))
            break;
        run_op(&op[done_ops], state);
    }
    Py_END_ALLOW_THREADS
    if (!(result = PyList_New(done_ops)))
        goto out;
    for (Py_ssize_t i = 0; i < done_ops; i++) {
        op_t *o = &op[i];
        PyObject *s = PyTuple_New(o->hashed ? o->nspans : 0), *r;
        if (!s) {
            Py_CLEAR(result);
            goto out;
        }
        for (Py_ssize_t k = 0; o->hashed && k < o->nspans; k++) {
            PyObject *v = PyLong_FromUnsignedLongLong(o->sums[k]);
            if (!v) {
                Py_DECREF(s);
                Py_CLEAR(result);
                goto out;
            }
            PyTuple_SET_ITEM(s, k, v);
        }
        if (!(r = Py_BuildValue("(inN)", o->err, (Py_ssize_t)o->done, s))) {
            Py_CLEAR(result);
            goto out;
        }
        PyList_SET_ITEM(result, i, r);
    }
out:
    if (state)
        xxh3_free(state);
    for (Py_ssize_t k = 0; k < nviews; k++)
        PyBuffer_Release(&views[k]);
    for (Py_ssize_t f = 0; f < nflags; f++)
        PyBuffer_Release(&flags[f]);
    for (Py_ssize_t k = 0; k < nlists; k++)
        Py_DECREF(lists[k]);
    PyMem_Free(lists);
    PyMem_Free(op);
    PyMem_Free(views);
    PyMem_Free(iovs);
    PyMem_Free(spans);
    PyMem_Free(sums);
    PyMem_Free(flags);
    Py_XDECREF(ops);
    Py_XDECREF(stop);
    return result;
}

/* xxhash's own xxh3 functions, from the library its Python module was loaded from. */
static int bind_xxhash(void) {
    PyObject *mod = PyImport_ImportModule("xxhash._xxhash"), *file;
    const char *path;
    void *lib;
    if (!mod)
        return -1;
    file = PyObject_GetAttrString(mod, "__file__");
    Py_DECREF(mod);
    if (!file)
        return -1;
    if (!(path = PyUnicode_AsUTF8(file))) {
        Py_DECREF(file);
        return -1;
    }
    lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(file);
    if (!lib) {
        PyErr_Format(PyExc_ImportError, "xxhash's extension is not loaded: %s", dlerror());
        return -1;
    }
    *(void **)&xxh3_64 = dlsym(lib, "XXH3_64bits");
    *(void **)&xxh3_create = dlsym(lib, "XXH3_createState");
    *(void **)&xxh3_free = dlsym(lib, "XXH3_freeState");
    *(void **)&xxh3_reset = dlsym(lib, "XXH3_64bits_reset");
    *(void **)&xxh3_update = dlsym(lib, "XXH3_64bits_update");
    *(void **)&xxh3_digest = dlsym(lib, "XXH3_64bits_digest");
    if (!xxh3_64 || !xxh3_create || !xxh3_free || !xxh3_reset || !xxh3_update || !xxh3_digest) {
        PyErr_SetString(PyExc_ImportError, "xxhash's extension does not export the xxh3-64 functions");
        return -1;
    }
    return 0;
}


#if defined(MSG_DONTWAIT) && defined(MSG_NOSIGNAL)
PyObject *pageio_exchange(PyObject *self, PyObject *args); /* _exchange.c */
extern const char pageio_exchange_doc[];
#endif

static PyMethodDef methods[] = {
    {"transfer", transfer, METH_VARARGS, transfer_doc},
#if defined(MSG_DONTWAIT) && defined(MSG_NOSIGNAL)
    {"exchange", pageio_exchange, METH_VARARGS, pageio_exchange_doc},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pageio", "Page I/O and checksums without the GIL (see pagefile); short index round trips with it (see index).", -1, methods,
};

PyMODINIT_FUNC PyInit__pageio(void) {
    PyObject *m;
    if (bind_xxhash() < 0) { /* whatever went wrong, the module is not there: ImportError, which pagefile expects */
        if (!PyErr_ExceptionMatches(PyExc_ImportError)) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyErr_Format(PyExc_ImportError, "cannot find xxhash's xxh3 functions: %R", value);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        return NULL;
    }
    if (!(m = PyModule_Create(&module)))
        return NULL;
    if (PyModule_AddIntConstant(m, "READ", OP_READ) < 0 || PyModule_AddIntConstant(m, "WRITE", OP_WRITE) < 0 ||
        PyModule_AddIntConstant(m, "HASH", OP_HASH) < 0 || PyModule_AddIntConstant(m, "SKIP", OP_SKIP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
