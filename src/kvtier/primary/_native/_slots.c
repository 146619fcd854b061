/* The primary tier's per-chunk loops (kvtier/primary/loops.py), compiled.
 *
 * Every request walks its chain of chunks a few times under the primary
 * tier's lock: found?, pin, unpin, reserve, finish. In Python each step of
 * those walks is a few bytecodes around one dict operation; here it is the
 * dict operation alone. Same functions, same results, same errors as the
 * Python ones, which tests hold them to.
 *
 * The dicts map keys to slot numbers (ready, writing) or reader counts
 * (pins). Keys are hashable objects whose hash and equality may run Python
 * code, so every borrowed reference is held across such calls and sequences
 * are re-measured at each step.
 *
 * copy_rows moves whole chunk rows between the slots and a caller's rows;
 * touch_pages maps the slots' pages ahead of their first use. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* A sequence's items as a new reference to a list or tuple. */
static PyObject *as_fast(PyObject *keys) {
    return PySequence_Fast(keys, "keys must be a sequence");
}

/* ready_count(ready, keys) -> how many leading keys are in ready. */
static PyObject *ready_count(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *ready, *keys;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &ready, &keys)) return NULL;
    PyObject *seq = as_fast(keys);
    if (seq == NULL) return NULL;
    Py_ssize_t i = 0;
    for (; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(key);
        int found = PyDict_Contains(ready, key);
        Py_DECREF(key);
        if (found < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (!found) break;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(i);
}

/* Add one reader to pins[key]. */
static int add_reader(PyObject *pins, PyObject *key) {
    PyObject *count = PyDict_GetItemWithError(pins, key);
    if (count == NULL && PyErr_Occurred()) return -1;
    Py_ssize_t readers = 0;
    if (count != NULL) {
        readers = PyLong_AsSsize_t(count);
        if (readers == -1 && PyErr_Occurred()) return -1;
    }
    PyObject *more = PyLong_FromSsize_t(readers + 1);
    if (more == NULL) return -1;
    int failed = PyDict_SetItem(pins, key, more);
    Py_DECREF(more);
    return failed;
}

/* pin_prefix(ready, pins, keys) -> [slot]: a reader added to each leading
 * ready key, up to the first one that is not ready; their slots. */
static PyObject *pin_prefix(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *ready, *pins, *keys;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyDict_Type, &ready, &PyDict_Type, &pins, &keys))
        return NULL;
    PyObject *seq = as_fast(keys);
    if (seq == NULL) return NULL;
    PyObject *slots = PyList_New(0);
    if (slots == NULL) goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(key);
        PyObject *slot = PyDict_GetItemWithError(ready, key);
        Py_XINCREF(slot);
        int failed = slot == NULL ? (PyErr_Occurred() ? -1 : 1) : add_reader(pins, key);
        if (failed == 0) failed = PyList_Append(slots, slot);
        Py_XDECREF(slot);
        Py_DECREF(key);
        if (failed > 0) break; /* not ready: the prefix ends here */
        if (failed < 0) goto fail;
    }
    Py_DECREF(seq);
    return slots;
fail:
    Py_XDECREF(slots);
    Py_DECREF(seq);
    return NULL;
}

/* unpin(pins, keys) -> -1, or the index of the first key that had no reader
 * left to take; then every reader taken before it is given back. */
static PyObject *unpin(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *pins, *keys;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &pins, &keys)) return NULL;
    PyObject *seq = as_fast(keys);
    if (seq == NULL) return NULL;
    Py_ssize_t done = 0, missing = -1;
    for (; done < PySequence_Fast_GET_SIZE(seq); done++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, done);
        Py_INCREF(key);
        PyObject *count = PyDict_GetItemWithError(pins, key);
        Py_ssize_t readers = 0;
        int failed = 0;
        if (count != NULL) {
            readers = PyLong_AsSsize_t(count);
            failed = readers == -1 && PyErr_Occurred() ? -1 : 0;
        } else if (PyErr_Occurred()) {
            failed = -1;
        }
        if (failed == 0 && readers > 1) {
            PyObject *fewer = PyLong_FromSsize_t(readers - 1);
            failed = fewer == NULL ? -1 : PyDict_SetItem(pins, key, fewer);
            Py_XDECREF(fewer);
        } else if (failed == 0 && readers == 1) {
            failed = PyDict_DelItem(pins, key);
        }
        Py_DECREF(key);
        if (failed < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (readers <= 0) {
            missing = done;
            break;
        }
    }
    for (Py_ssize_t i = 0; missing >= 0 && i < missing && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(key);
        int failed = add_reader(pins, key);
        Py_DECREF(key);
        if (failed < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(missing);
}

/* new_keys(ready, writing, keys) -> {key: -1}: the keys in neither dict, each
 * once, in the order of their first appearance. */
static PyObject *new_keys(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *ready, *writing, *keys;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyDict_Type, &ready, &PyDict_Type, &writing, &keys))
        return NULL;
    PyObject *seq = as_fast(keys);
    if (seq == NULL) return NULL;
    PyObject *minus_one = PyLong_FromLong(-1);
    PyObject *reserved = PyDict_New();
    if (minus_one == NULL || reserved == NULL) goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(key);
        int present = PyDict_Contains(ready, key);
        if (present == 0) present = PyDict_Contains(writing, key);
        int failed = present < 0 ? -1 : (present ? 0 : PyDict_SetItem(reserved, key, minus_one));
        Py_DECREF(key);
        if (failed < 0) goto fail;
    }
    Py_DECREF(minus_one);
    Py_DECREF(seq);
    return reserved;
fail:
    Py_XDECREF(minus_one);
    Py_XDECREF(reserved);
    Py_DECREF(seq);
    return NULL;
}

/* idle_resident(ready, pins, keys) -> [key]: the keys in ready and not in pins. */
static PyObject *idle_resident(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *ready, *pins, *keys;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyDict_Type, &ready, &PyDict_Type, &pins, &keys))
        return NULL;
    PyObject *seq = as_fast(keys);
    if (seq == NULL) return NULL;
    PyObject *idle = PyList_New(0);
    if (idle == NULL) goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(key);
        int wanted = PyDict_Contains(ready, key);
        if (wanted > 0) {
            int pinned = PyDict_Contains(pins, key);
            wanted = pinned < 0 ? -1 : !pinned;
        }
        int failed = wanted < 0 ? -1 : (wanted ? PyList_Append(idle, key) : 0);
        Py_DECREF(key);
        if (failed < 0) goto fail;
    }
    Py_DECREF(seq);
    return idle;
fail:
    Py_XDECREF(idle);
    Py_DECREF(seq);
    return NULL;
}

/* Pop the last item of a list (a new reference), or NULL with IndexError. */
static PyObject *pop_last(PyObject *list) {
    Py_ssize_t size = PyList_GET_SIZE(list);
    if (size == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from empty list");
        return NULL;
    }
    PyObject *item = PyList_GET_ITEM(list, size - 1);
    Py_INCREF(item);
    if (PyList_SetSlice(list, size - 1, size, NULL) < 0) {
        Py_DECREF(item);
        return NULL;
    }
    return item;
}

/* take_slots(reserved, free, writing): each reserved key gets the slot popped
 * from the end of free, in order; then they all join writing. */
static PyObject *take_slots(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *reserved, *free_slots, *writing;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyDict_Type, &reserved, &PyList_Type, &free_slots,
                          &PyDict_Type, &writing))
        return NULL;
    PyObject *key, *value;
    Py_ssize_t position = 0;
    while (PyDict_Next(reserved, &position, &key, &value)) {
        PyObject *slot = pop_last(free_slots);
        if (slot == NULL) return NULL;
        Py_INCREF(key);
        int failed = PyDict_SetItem(reserved, key, slot); /* a value, not a key: iteration holds */
        Py_DECREF(key);
        Py_DECREF(slot);
        if (failed < 0) return NULL;
    }
    if (PyDict_Update(writing, reserved) < 0) return NULL;
    Py_RETURN_NONE;
}

/* free_victims(ready, free, victims): each victim leaves ready, its slot is
 * appended to free; a victim not in ready raises KeyError. */
static PyObject *free_victims(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *ready, *free_slots, *victims;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyDict_Type, &ready, &PyList_Type, &free_slots,
                          &victims))
        return NULL;
    PyObject *seq = as_fast(victims);
    if (seq == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(key);
        PyObject *slot = PyDict_GetItemWithError(ready, key);
        Py_XINCREF(slot);
        int failed = -1;
        if (slot != NULL) {
            failed = PyDict_DelItem(ready, key);
            if (failed == 0) failed = PyList_Append(free_slots, slot);
        } else if (!PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, key);
        }
        Py_XDECREF(slot);
        Py_DECREF(key);
        if (failed < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* finish_writes(writing, keys) -> {key: slot}: the keys being written leave
 * writing, each once, in order; other keys are skipped. */
static PyObject *finish_writes(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *writing, *keys;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &writing, &keys)) return NULL;
    PyObject *seq = as_fast(keys);
    if (seq == NULL) return NULL;
    PyObject *written = PyDict_New();
    if (written == NULL) goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(key);
        PyObject *slot = PyDict_GetItemWithError(writing, key);
        Py_XINCREF(slot);
        int failed = slot == NULL ? (PyErr_Occurred() ? -1 : 0) : PyDict_DelItem(writing, key);
        if (slot != NULL && failed == 0) failed = PyDict_SetItem(written, key, slot);
        Py_XDECREF(slot);
        Py_DECREF(key);
        if (failed < 0) goto fail;
    }
    Py_DECREF(seq);
    return written;
fail:
    Py_XDECREF(written);
    Py_DECREF(seq);
    return NULL;
}

/* A call that copies more than this streams its rows past the caches: a
 * prefix that large would only evict the cache's other lines, and writing
 * without reading each target line first (a plain copy reads it, to own it)
 * moves 1.6-1.9x the bytes a second on the machines measured. Below it the
 * rows and their source may stay in cache, where a plain copy is faster.
 * glibc's memcpy streams only past a threshold it derives from the cache
 * size the CPU reports, which a virtual machine may report as its host's. */
#define STREAM_ABOVE ((size_t)4 << 20)

/* Copy n bytes to dst with non-temporal stores (where the CPU has them). */
static void stream_bytes(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* to an aligned store */
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t at = 0;
    for (; at + 64 <= n; at += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + at));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + at + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + at + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + at + 48));
        _mm_stream_si128((__m128i *)(dst + at), a);
        _mm_stream_si128((__m128i *)(dst + at + 16), b);
        _mm_stream_si128((__m128i *)(dst + at + 32), c);
        _mm_stream_si128((__m128i *)(dst + at + 48), d);
    }
    memcpy(dst + at, src + at, n - at);
#else
    memcpy(dst, src, n);
#endif
}

/* The first n items of rows as row numbers of a buffer of count rows, into
 * out; -1 with IndexError, TypeError or RuntimeError. An item's __index__
 * may run Python code, which may change rows: held, and its size re-read. */
static int row_numbers(PyObject *rows, Py_ssize_t n, Py_ssize_t count, Py_ssize_t *out,
                       const char *which) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PySequence_Fast_GET_SIZE(rows)) {
            PyErr_Format(PyExc_RuntimeError, "%s rows changed size during the copy", which);
            return -1;
        }
        PyObject *item = PySequence_Fast_GET_ITEM(rows, i);
        Py_INCREF(item);
        Py_ssize_t row = PyNumber_AsSsize_t(item, NULL); /* clipped: then out of range */
        Py_DECREF(item);
        if (row == -1 && PyErr_Occurred()) return -1;
        if (row < 0 || row >= count) {
            PyErr_Format(PyExc_IndexError, "%s row %zd out of range for %zd rows", which, row,
                         count);
            return -1;
        }
        out[i] = row;
    }
    return 0;
}

/* The byte length of a row of a two-dimensional buffer; -1 with ValueError. */
static Py_ssize_t row_bytes(const Py_buffer *view, const char *which) {
    if (view->ndim != 2) {
        PyErr_Format(PyExc_ValueError, "%s must have two dimensions, not %d", which, view->ndim);
        return -1;
    }
    return view->shape[1] * view->itemsize;
}

/* copy_rows(target, target_rows, source, source_rows): row target_rows[i]
 * of target becomes row source_rows[i] of source, for every i, with the GIL
 * released once. Both are C-contiguous two-dimensional buffers with rows of
 * the same byte length that do not overlap; rows are sequences of ints. */
static PyObject *copy_rows(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *target_object, *target_rows, *source_object, *source_rows;
    if (!PyArg_ParseTuple(args, "OOOO", &target_object, &target_rows, &source_object,
                          &source_rows))
        return NULL;
    Py_buffer target = {0}, source = {0};
    PyObject *to = NULL, *from = NULL, *result = NULL;
    Py_ssize_t *rows = NULL;
    if (PyObject_GetBuffer(target_object, &target, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(source_object, &source, PyBUF_C_CONTIGUOUS) < 0) goto done;
    Py_ssize_t length = row_bytes(&target, "target");
    Py_ssize_t source_length = length < 0 ? -1 : row_bytes(&source, "source");
    if (source_length < 0) goto done;
    if (source_length != length) {
        PyErr_Format(PyExc_ValueError, "rows of %zd bytes cannot be copied into rows of %zd",
                     source_length, length);
        goto done;
    }
    const char *t = target.buf, *s = source.buf;
    if (t < s + source.len && s < t + target.len) {
        PyErr_SetString(PyExc_ValueError, "the target and the source overlap");
        goto done;
    }
    to = PySequence_Fast(target_rows, "target_rows must be a sequence");
    from = to == NULL ? NULL : PySequence_Fast(source_rows, "source_rows must be a sequence");
    if (from == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(to);
    if (PySequence_Fast_GET_SIZE(from) != n) {
        PyErr_Format(PyExc_ValueError, "%zd target rows but %zd source rows", n,
                     PySequence_Fast_GET_SIZE(from));
        goto done;
    }
    rows = PyMem_New(Py_ssize_t, 2 * n + 1);
    if (rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (row_numbers(to, n, target.shape[0], rows, "target") < 0 ||
        row_numbers(from, n, source.shape[0], rows + n, "source") < 0)
        goto done;
    size_t bytes = (size_t)length;
    int stream = (size_t)n * bytes > STREAM_ABOVE;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        char *into = (char *)target.buf + rows[i] * length;
        const char *out_of = (const char *)source.buf + rows[n + i] * length;
        if (stream)
            stream_bytes(into, out_of, bytes);
        else
            memcpy(into, out_of, bytes);
    }
#if defined(__SSE2__)
    if (stream) _mm_sfence(); /* the streamed stores seen before the call returns */
#endif
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(rows);
    Py_XDECREF(to);
    Py_XDECREF(from);
    if (source.obj != NULL) PyBuffer_Release(&source);
    PyBuffer_Release(&target);
    return result;
}

/* touch_pages(buffer, piece, stop=None, fd=-1): fault every page of a writable
 * buffer in, writable, with the GIL released throughout. Each page takes an
 * atomic add of zero: a write that keeps what the page holds, even while
 * another thread or process writes it. A fault maps one page under a lock of
 * that mapping alone, where madvise(MADV_POPULATE_WRITE) holds the whole
 * process's memory-map lock, which every other thread's mmap (a new thread's
 * stack) then waits for, the longer when the caller runs at a low priority.
 * One call for the whole buffer: a low-priority caller taking the GIL back
 * between pieces would keep the threads waiting for it as long as the
 * scheduler keeps the caller waiting. stop, a one-byte writable buffer, ends
 * the call within piece bytes of being set nonzero. fd, the file the buffer
 * maps from its start (a /dev/shm file), has each piece allocated before it is
 * touched: where the file system runs out of room that is an OSError (ENOSPC),
 * where a write into the mapping would kill the process with SIGBUS. */
static PyObject *touch_pages(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *object, *stop_object = Py_None;
    Py_ssize_t piece_bytes;
    int fd = -1;
    if (!PyArg_ParseTuple(args, "On|Oi", &object, &piece_bytes, &stop_object, &fd)) return NULL;
    if (piece_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "piece must be a positive number of bytes");
        return NULL;
    }
    uintptr_t piece_size = (uintptr_t)piece_bytes;
    Py_buffer view = {0}, stop = {0};
    if (PyObject_GetBuffer(object, &view, PyBUF_SIMPLE | PyBUF_WRITABLE) < 0) return NULL;
    if (stop_object != Py_None) {
        if (PyObject_GetBuffer(stop_object, &stop, PyBUF_SIMPLE | PyBUF_WRITABLE) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
        if (stop.len != 1) {
            PyBuffer_Release(&stop);
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "stop must be a one-byte writable buffer");
            return NULL;
        }
    }
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t step = page > 0 ? (uintptr_t)page : 4096;
    volatile uint8_t *stopped = stop.buf;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    if (view.len > 0) {
        /* The first byte of every page the buffer overlaps, its last one included. */
        uintptr_t first = (uintptr_t)view.buf, last = first + (uintptr_t)view.len - 1;
        uintptr_t look = first;
        for (uintptr_t at = first; at <= last; at = (at | (step - 1)) + 1) {
            if (at >= look) {
                if (stopped != NULL && __atomic_load_n(stopped, __ATOMIC_RELAXED)) break;
                uintptr_t piece = last + 1 - at < piece_size ? last + 1 - at : piece_size;
                if (fd >= 0 && (failed = posix_fallocate(fd, (off_t)(at - first), (off_t)piece)))
                    break;
                look = at + piece_size;
            }
            __atomic_fetch_add((volatile uint8_t *)at, 0, __ATOMIC_RELAXED);
        }
    }
    Py_END_ALLOW_THREADS
    if (stop.buf != NULL) PyBuffer_Release(&stop);
    PyBuffer_Release(&view);
    if (failed) {
        errno = failed;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"ready_count", ready_count, METH_VARARGS, "ready_count(ready, keys) -> leading keys ready"},
    {"pin_prefix", pin_prefix, METH_VARARGS, "pin_prefix(ready, pins, keys) -> [slot]"},
    {"unpin", unpin, METH_VARARGS, "unpin(pins, keys) -> -1, or the first key not pinned"},
    {"new_keys", new_keys, METH_VARARGS, "new_keys(ready, writing, keys) -> {key: -1}"},
    {"idle_resident", idle_resident, METH_VARARGS, "idle_resident(ready, pins, keys) -> [key]"},
    {"take_slots", take_slots, METH_VARARGS, "take_slots(reserved, free, writing)"},
    {"free_victims", free_victims, METH_VARARGS, "free_victims(ready, free, victims)"},
    {"finish_writes", finish_writes, METH_VARARGS, "finish_writes(writing, keys) -> {key: slot}"},
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(target, target_rows, source, source_rows): whole rows, GIL released once"},
    {"touch_pages", touch_pages, METH_VARARGS,
     "touch_pages(buffer, piece, stop=None, fd=-1): every page mapped writable, contents kept"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_slots", "The primary tier's per-chunk loops, row copies and page mapping, compiled.", -1, methods,
};

PyMODINIT_FUNC PyInit__slots(void) { return PyModule_Create(&module); }
