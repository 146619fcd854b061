/* The fs tier's chunk-file system calls, compiled: store() and load() do what
 * _store_file_python() and _load_file_python() in io.py do, with the GIL
 * released for the whole sequence of calls, so a thread moving one chunk takes
 * the GIL once instead of once per call; load_all() reads a task's files
 * with one release. Same contract, same errors (OSError subclasses carrying
 * errno and the file name).
 *
 * The chunk's checksum (xxh3-128) is taken in the same GIL release, by the
 * XXH3 function of the xxhash extension module already loaded in the
 * process (bind_xxh3()): a worker otherwise gives up and waits for the GIL
 * once more per chunk, between its hash and its system calls, and with
 * dozens of workers on a busy machine each such wait costs more than the
 * hash. io.py binds it at import, checks it against python-xxhash, and
 * hashes in Python before the call where it cannot.
 *
 * Only regular files are chunks: a load opens with O_NOFOLLOW | O_NONBLOCK
 * (a symlink fails with ELOOP, a FIFO cannot block the open) and checks
 * S_ISREG on the descriptor before reading, so nothing else is ever read and
 * the use-stamp only ever touches the chunk file itself. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
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

/* XXH128_hash_t and XXH3_128bits_withSeed() of xxhash.h (ABI-stable since xxhash 0.8). */
typedef struct {
    uint64_t low64, high64;
} xxh128_hash;
typedef xxh128_hash (*xxh3_128_fn)(const void *data, size_t len, uint64_t seed);
static xxh3_128_fn xxh3_128 = NULL;

/* The canonical (big-endian, high half first) form python-xxhash's
 * xxh3_128_digest() returns. */
static void checksum_into(const void *data, size_t len, unsigned char out[16]) {
    xxh128_hash hash = xxh3_128(data, len, 0);
    for (int i = 0; i < 8; i++) {
        out[i] = (unsigned char)(hash.high64 >> (56 - 8 * i));
        out[8 + i] = (unsigned char)(hash.low64 >> (56 - 8 * i));
    }
}

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
    Py_ssize_t digest_at;
    if (!PyArg_ParseTuple(args, "O&O&y*w*ppn", PyUnicode_FSConverter, &temp_obj,
                          PyUnicode_FSConverter, &final_obj, &payload, &trailer, &direct,
                          &do_fsync, &digest_at))
        return NULL;
    if (digest_at >= 0 && (xxh3_128 == NULL || digest_at > trailer.len - 16)) {
        PyErr_SetString(PyExc_ValueError, xxh3_128 == NULL ? "no checksum function bound"
                                                            : "digest_at outside the trailer");
        PyBuffer_Release(&payload);
        PyBuffer_Release(&trailer);
        Py_DECREF(temp_obj);
        Py_DECREF(final_obj);
        return NULL;
    }
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
        if (digest_at >= 0)
            checksum_into(payload.buf, (size_t)payload.len, (unsigned char *)trailer.buf + digest_at);
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

/* Read the file at path into out then trailer, as load() describes; with a
 * digest (not NULL), the checksum of out goes there once both are full.
 * Returns 0 or an errno; *total is the bytes read, or the file's size when
 * it is not exactly what out and trailer hold. Called without the GIL. */
static int read_file(const char *path, Py_buffer *out, Py_buffer *trailer, int direct,
                     double stamp_after, unsigned char *digest, Py_ssize_t *total) {
    int error = 0;
    *total = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | (direct ? O_DIRECT : 0));
    struct stat info;
    if (fd < 0) return errno;
    if (fstat(fd, &info) != 0) {
        error = errno;
    } else if (!S_ISREG(info.st_mode)) {
        error = NOT_REGULAR;
    } else if (info.st_size != (off_t)(out->len + trailer->len)) {
        *total = (Py_ssize_t)info.st_size; /* a chunk file has one size: damage, not read */
    } else {
        struct iovec iov[2] = {{out->buf, (size_t)out->len}, {trailer->buf, (size_t)trailer->len}};
        error = transfer(fd, iov, 2, 0, total);
        struct timespec now;
        if (!error && clock_gettime(CLOCK_REALTIME, &now) == 0 &&
            (double)(now.tv_sec - info.st_mtim.tv_sec) > stamp_after)
            futimens(fd, NULL);
        if (!error && digest != NULL && *total == out->len + trailer->len)
            checksum_into(out->buf, (size_t)out->len, digest);
    }
    close(fd);
    return error;
}

/* load(path, out, trailer, direct, stamp_after_s, digest): reads the file into
 * out then trailer; with a 16-byte digest buffer (not None), the checksum of out
 * goes there once the whole file was read. A file whose size is not exactly
 * what out and trailer hold is not read: its size is returned instead. */
static PyObject *load(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *path_obj, *digest_obj;
    Py_buffer out, trailer, digest = {0};
    int direct;
    double stamp_after;
    if (!PyArg_ParseTuple(args, "O&w*w*pdO", PyUnicode_FSConverter, &path_obj, &out, &trailer,
                          &direct, &stamp_after, &digest_obj))
        return NULL;
    int hashing = digest_obj != Py_None;
    if (hashing && PyObject_GetBuffer(digest_obj, &digest, PyBUF_WRITABLE) != 0) {
        hashing = -1;
    } else if (hashing && (xxh3_128 == NULL || digest.len != 16)) {
        PyErr_SetString(PyExc_ValueError, xxh3_128 == NULL ? "no checksum function bound"
                                                           : "digest must be a 16-byte buffer");
        PyBuffer_Release(&digest);
        hashing = -1;
    }
    if (hashing < 0) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&trailer);
        Py_DECREF(path_obj);
        return NULL;
    }
    const char *path = PyBytes_AS_STRING(path_obj);
    int error;
    Py_ssize_t total;
    Py_BEGIN_ALLOW_THREADS
    error = read_file(path, &out, &trailer, direct, stamp_after, hashing ? digest.buf : NULL,
                      &total);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    PyBuffer_Release(&trailer);
    if (hashing) PyBuffer_Release(&digest);
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

/* One file of load_all(): its path, its buffers, what reading it gave. */
typedef struct {
    PyObject *path; /* bytes, from PyUnicode_FSConverter */
    Py_buffer out, trailer, digest;
    Py_ssize_t total;
    int error;
} file_load;

/* The OSError load() raises for error at path, as an object. */
static PyObject *os_error(int error, PyObject *path) {
    PyObject *name = PyUnicode_DecodeFSDefault(PyBytes_AS_STRING(path));
    if (name == NULL) return NULL;
    PyObject *exc = PyObject_CallFunction(PyExc_OSError, "isO", error, strerror(error), name);
    Py_DECREF(name);
    return exc;
}

/* load_all(paths, outs, trailers, direct, stamp_after_s, digests): load() of
 * each file in turn, with the GIL released once for all of them: beside a
 * thread running Python, each release costs a wait for the GIL to come back.
 * Per file, what load() returns, or the OSError it would raise; digests is a
 * 16-byte buffer per file, or None. */
static PyObject *load_all(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *paths_obj, *outs_obj, *trailers_obj, *digests_obj;
    int direct;
    double stamp_after;
    if (!PyArg_ParseTuple(args, "OOOpdO", &paths_obj, &outs_obj, &trailers_obj, &direct,
                          &stamp_after, &digests_obj))
        return NULL;
    int hashing = digests_obj != Py_None;
    if (hashing && xxh3_128 == NULL) {
        PyErr_SetString(PyExc_ValueError, "no checksum function bound");
        return NULL;
    }
    PyObject *seqs[4] = {NULL, NULL, NULL, NULL}, *result = NULL;
    PyObject *given[4] = {paths_obj, outs_obj, trailers_obj, digests_obj};
    file_load *files = NULL;
    Py_ssize_t n = 0, ready = 0;
    for (int k = 0; k < 3 + hashing; k++) {
        seqs[k] = PySequence_Fast(given[k], "load_all takes sequences");
        if (seqs[k] == NULL) goto done;
        if (k > 0 && PySequence_Fast_GET_SIZE(seqs[k]) != n) {
            PyErr_SetString(PyExc_ValueError, "load_all: sequences of different lengths");
            goto done;
        }
        n = PySequence_Fast_GET_SIZE(seqs[k]);
    }
    files = PyMem_Calloc(n ? (size_t)n : 1, sizeof(file_load));
    if (files == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; ready < n; ready++) {
        file_load *file = &files[ready];
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seqs[0], ready), &file->path))
            goto done;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seqs[1], ready), &file->out,
                               PyBUF_WRITABLE) != 0)
            goto done;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seqs[2], ready), &file->trailer,
                               PyBUF_WRITABLE) != 0)
            goto done;
        if (hashing && (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seqs[3], ready),
                                           &file->digest, PyBUF_WRITABLE) != 0 ||
                        file->digest.len != 16)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "digest must be a 16-byte buffer");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        file_load *file = &files[i];
        file->error = read_file(PyBytes_AS_STRING(file->path), &file->out, &file->trailer,
                                direct, stamp_after, hashing ? file->digest.buf : NULL,
                                &file->total);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *item = files[i].error ? os_error(files[i].error, files[i].path)
                                        : PyLong_FromSsize_t(files[i].total);
        if (item == NULL) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, item);
    }
done:
    /* Every file up to the one that failed (partly set up: zeroed fields). */
    for (Py_ssize_t i = 0; files != NULL && i < n && i <= ready; i++) {
        Py_XDECREF(files[i].path);
        if (files[i].out.obj != NULL) PyBuffer_Release(&files[i].out);
        if (files[i].trailer.obj != NULL) PyBuffer_Release(&files[i].trailer);
        if (files[i].digest.obj != NULL) PyBuffer_Release(&files[i].digest);
    }
    PyMem_Free(files);
    for (int k = 0; k < 4; k++) Py_XDECREF(seqs[k]);
    return result;
}

/* bind_xxh3(module_path) -> bool: finds XXH3_128bits_withSeed in the shared
 * object at module_path (python-xxhash's extension, already loaded: its
 * CPU-dispatching variant first) and hashes with it from now on. */
static PyObject *bind_xxh3(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *path_obj;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &path_obj)) return NULL;
    void *handle = dlopen(PyBytes_AS_STRING(path_obj), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    Py_DECREF(path_obj);
    void *found = NULL;
    if (handle != NULL) {
        /* the handle stays open: the function must outlive this call */
        found = dlsym(handle, "XXH3_128bits_withSeed_dispatch");
        if (found == NULL) found = dlsym(handle, "XXH3_128bits_withSeed");
    }
    if (found != NULL) xxh3_128 = (xxh3_128_fn)found;
    return PyBool_FromLong(found != NULL);
}

/* checksum(data) -> bytes: the bound function's digest (for the check at binding). */
static PyObject *checksum(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    if (xxh3_128 == NULL) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "no checksum function bound");
        return NULL;
    }
    unsigned char digest[16];
    Py_BEGIN_ALLOW_THREADS
    checksum_into(data.buf, (size_t)data.len, digest);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)digest, 16);
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
    {"store", store, METH_VARARGS,
     "store(temp, final, payload, trailer, direct, fsync, digest_at) -> written"},
    {"load", load, METH_VARARGS,
     "load(path, out, trailer, direct, stamp_after_s, digest) -> bytes read"},
    {"load_all", load_all, METH_VARARGS,
     "load_all(paths, outs, trailers, direct, stamp_after_s, digests) -> [bytes read or OSError]"},
    {"bind_xxh3", bind_xxh3, METH_VARARGS, "bind_xxh3(module_path) -> found"},
    {"checksum", checksum, METH_VARARGS, "checksum(data) -> xxh3-128 digest"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_chunkio", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__chunkio(void) { return PyModule_Create(&module); }
