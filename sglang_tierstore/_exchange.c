/* An index round trip without letting the GIL go: part of the _pageio module (its method
 * table is in _pageio.c), apart from the page I/O because it is the index's wire, not the
 * page files' (sglang_tierstore/index/wire.py calls it).
 *
 * A short index round trip (a probe's HMGET) is sent and, where the reply comes within a
 * bound, read without letting the GIL go, as a stat() of SGLang's file backend all but always
 * is back before anyone takes it. Its send and its wait for the reply would each hand the GIL
 * to a thread spinning in Python and wait for it back (a switch interval, 5 ms), which a
 * request waiting for its prefetch probe pays in full.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>

#if defined(MSG_DONTWAIT) && defined(MSG_NOSIGNAL)
const char pageio_exchange_doc[] =
"exchange(fd, request, wait_ns) -> (sent, reply)\n\n"
"Send request on the connected socket fd, then wait up to wait_ns for its reply and read what\n"
"has come by then, all without releasing the GIL (the thread sleeps in ppoll meanwhile, its\n"
"core free for the server that answers). sent: the bytes sent (fewer than the request's where\n"
"the socket buffer filled: the caller sends the rest, and then reads the whole reply); reply:\n"
"the bytes read (empty if none came in time, or the peer closed). OSError on a failed send,\n"
"poll or recv.";

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

PyObject *pageio_exchange(PyObject *self, PyObject *args) {
    int fd, ready = 0;
    Py_buffer req;
    long long wait_ns, end, left;
    Py_ssize_t sent = 0, got = 0, cap = 4096;
    char *buf;
    PyObject *out;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*L", &fd, &req, &wait_ns))
        return NULL;
    while (sent < req.len) {
        ssize_t n = send(fd, (const char *)req.buf + sent, (size_t)(req.len - sent), MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n >= 0)
            sent += n;
        else if (errno == EAGAIN || errno == EWOULDBLOCK)
            break;
        else if (errno != EINTR) {
            PyBuffer_Release(&req);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    if (sent < req.len) {
        PyBuffer_Release(&req);
        return Py_BuildValue("(ny#)", sent, "", (Py_ssize_t)0);
    }
    PyBuffer_Release(&req);
    struct pollfd p = {fd, POLLIN, 0};
    end = now_ns() + wait_ns;
    while ((left = end - now_ns()) > 0) {
        struct timespec t = {(time_t)(left / 1000000000LL), (long)(left % 1000000000LL)};
        ready = ppoll(&p, 1, &t, NULL);
        if (ready > 0)
            break;
        if (ready < 0 && errno != EINTR)
            return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (ready <= 0)
        return Py_BuildValue("(ny#)", sent, "", (Py_ssize_t)0);
    if (!(buf = PyMem_Malloc((size_t)cap)))
        return PyErr_NoMemory();
    do { /* what has come, read until the deadline at most: the rest is the caller's to read */
        ssize_t n;
        if (got == cap) {
            char *more = PyMem_Realloc(buf, (size_t)cap * 2);
            if (!more) {
                PyMem_Free(buf);
                return PyErr_NoMemory();
            }
            buf = more;
            cap *= 2;
        }
        n = recv(fd, buf + got, (size_t)(cap - got), MSG_DONTWAIT);
        if (n > 0)
            got += n;
        else if (n == 0 || errno == EAGAIN || errno == EWOULDBLOCK)
            break; /* all there is for now (or the peer closed: the caller's next read says so) */
        else if (errno != EINTR) {
            PyMem_Free(buf);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    } while (now_ns() < end);
    out = Py_BuildValue("(ny#)", sent, buf, got);
    PyMem_Free(buf);
    return out;
}
#endif
