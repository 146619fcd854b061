/* The fs tier's chunk-file system calls, compiled: store() and load() do what
 * _store_file_python() and _load_file_python() in io.py do, with the GIL
 * released for the whole sequence of calls, so a thread moving one chunk takes
 * the GIL once instead of once per call. Same contract, same errors
 * (OSError subclasses carrying errno and the file name).
 *
 * Only regular files are chunks: a load opens with O_NOFOLLOW | O_NONBLOCK
 * (a symlink fails with ELOOP, a FIFO cannot block the open) and checks
 * S_ISREG on the descriptor before reading, so nothing else is ever read and
 * the use-stamp only ever touches the chunk file itself. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef O_DIRECT
#define O_DIRECT 0
#endif

/* The errno of "a chunk path holds something other than a regular file"
 * (io.NOT_REGULAR_ERRNO): one no open(2) or read(2) of a chunk file gives. */
#ifdef EFTYPE
#define NOT_REGULAR EFTYPE
#else
#define NOT_REGULAR EMEDIUMTYPE
#endif

static PyObject *raise_errno(int error, PyObject *path) {
    errno = error;
    return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
}

/* Move the bytes of iov from or to the file from offset 0 until all are
 * moved, the file ends (reading) or a call fails. Returns 0 or an errno;
 * *moved counts the bytes moved. A write that makes no progress is ENOSPC. */
static int transfer(int fd, struct iovec *iov, int count, int writing, Py_ssize_t *moved) {
    *moved = 0;
    while (count > 0) {
        ssize_t done = writing ? pwritev(fd, iov, count, *moved) : preadv(fd, iov, count, *moved);
        if (done < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (done == 0) return writing ? ENOSPC : 0;
        *moved += done;
        while (count > 0 && (size_t)done >= iov->iov_len) {
            done -= iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (char *)iov->iov_base + done;
            iov->iov_len -= done;
        }
    }
    return 0;
}

static PyObject *store(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *temp_obj, *final_obj;
    Py_buffer payload, trailer;
    int direct, do_fsync;
    if (!PyArg_ParseTuple(args, "O&O&y*y*pp", PyUnicode_FSConverter, &temp_obj,
                          PyUnicode_FSConverter, &final_obj, &payload, &trailer, &direct,
                          &do_fsync))
        return NULL;
    const char *temp = PyBytes_AS_STRING(temp_obj), *final = PyBytes_AS_STRING(final_obj);
    int error = 0, stage = 0, present = 0;
    Py_BEGIN_ALLOW_THREADS
    struct stat info;
    present = lstat(final, &info) == 0 && S_ISREG(info.st_mode) &&
              info.st_size == (off_t)(payload.len + trailer.len);
    int fd = present ? -1
                     : open(temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | (direct ? O_DIRECT : 0),
                            0644);
    if (present) {
        /* a complete file of this chunk is there (keys name their bytes) */
    } else if (fd < 0) {
        error = errno;
    } else {
        struct iovec iov[2] = {{payload.buf, (size_t)payload.len}, {trailer.buf, (size_t)trailer.len}};
        Py_ssize_t written;
        stage = 1;
        error = transfer(fd, iov, 2, 1, &written);
        if (!error && do_fsync && fsync(fd) != 0) error = errno;
        if (close(fd) != 0 && !error) error = errno;
        if (!error && rename(temp, final) != 0) error = errno;
        if (error) unlink(temp);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&payload);
    PyBuffer_Release(&trailer);
    PyObject *result = NULL;
    if (error) {
        PyObject *name = PyUnicode_DecodeFSDefault(stage ? final : temp);
        raise_errno(error, name);
        Py_XDECREF(name);
    } else {
        result = PyBool_FromLong(!present);
    }
    Py_DECREF(temp_obj);
    Py_DECREF(final_obj);
    return result;
}

static PyObject *load(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *path_obj;
    Py_buffer out, trailer;
    int direct;
    double stamp_after;
    if (!PyArg_ParseTuple(args, "O&w*w*pd", PyUnicode_FSConverter, &path_obj, &out, &trailer,
                          &direct, &stamp_after))
        return NULL;
    const char *path = PyBytes_AS_STRING(path_obj);
    int error = 0;
    Py_ssize_t total = 0;
    Py_BEGIN_ALLOW_THREADS
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | (direct ? O_DIRECT : 0));
    struct stat info;
    if (fd < 0) {
        error = errno;
    } else if (fstat(fd, &info) != 0) {
        error = errno;
        close(fd);
    } else if (!S_ISREG(info.st_mode)) {
        error = NOT_REGULAR;
        close(fd);
    } else {
        struct iovec iov[2] = {{out.buf, (size_t)out.len}, {trailer.buf, (size_t)trailer.len}};
        error = transfer(fd, iov, 2, 0, &total);
        struct timespec now;
        if (!error && clock_gettime(CLOCK_REALTIME, &now) == 0 &&
            (double)(now.tv_sec - info.st_mtim.tv_sec) > stamp_after)
            futimens(fd, NULL);
        close(fd);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    PyBuffer_Release(&trailer);
    PyObject *result = NULL;
    if (error) {
        PyObject *name = PyUnicode_DecodeFSDefault(path);
        raise_errno(error, name);
        Py_XDECREF(name);
    } else {
        result = PyLong_FromSsize_t(total);
    }
    Py_DECREF(path_obj);
    return result;
}

/* complete(paths, size) -> [bool]: which paths hold a regular file of exactly
 * size bytes (lstat: a symlink is not one), all looked at in one GIL release. */
static PyObject *complete(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *paths_obj;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "On", &paths_obj, &size)) return NULL;
    PyObject *paths = PySequence_Fast(paths_obj, "complete() takes a sequence of paths");
    if (paths == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(paths);
    PyObject **encoded = PyMem_Calloc(count ? count : 1, sizeof(PyObject *));
    char *found = PyMem_Calloc(count ? count : 1, 1);
    PyObject *result = NULL;
    Py_ssize_t ready = 0;
    if (encoded == NULL || found == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; ready < count; ready++)
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(paths, ready), &encoded[ready]))
            goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        struct stat info;
        found[i] = lstat(PyBytes_AS_STRING(encoded[i]), &info) == 0 && S_ISREG(info.st_mode) &&
                   info.st_size == (off_t)size;
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++)
        PyList_SET_ITEM(result, i, PyBool_FromLong(found[i]));
done:
    for (Py_ssize_t i = 0; i < ready; i++) Py_DECREF(encoded[i]);
    PyMem_Free(encoded);
    PyMem_Free(found);
    Py_DECREF(paths);
    return result;
}

static PyMethodDef methods[] = {
    {"complete", complete, METH_VARARGS, "complete(paths, size) -> [is a regular file of size]"},
    {"store", store, METH_VARARGS, "store(temp, final, payload, trailer, direct, fsync) -> written"},
    {"load", load, METH_VARARGS, "load(path, out, trailer, direct, stamp_after_s) -> bytes read"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_chunkio", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__chunkio(void) { return PyModule_Create(&module); }
