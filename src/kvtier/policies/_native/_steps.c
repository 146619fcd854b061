/* The built-in cache policies' per-key steps, compiled: ARC's insert and
 * demotion of victims (kvtier/policies/arc.py), S3-FIFO's walk of its small
 * queue (kvtier/policies/s3fifo.py).
 *
 * Every chunk the primary tier stores is inserted, and every chunk it evicts
 * becomes a ghost. In Python each of those steps is a few membership tests
 * and moves between the policy's containers, interpreted; here they are the
 * same container operations alone. The containers stay the policy's own
 * (OrderedDicts, dicts and deques, oldest first); these functions change
 * them exactly as the Python ones do, which tests hold them to.
 *
 * An OrderedDict is a dict underneath, so a membership test is PyDict_Contains;
 * every change goes through the mapping protocol, which keeps its order. A
 * deque has no C API: its methods are called. Keys' hash and equality may
 * run Python code, so every borrowed reference is held across such calls and
 * sequences are re-measured at each step. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *str_move_to_end, *str_popleft, *str_append;

/* Move key from one list to the end of another (it is in the first). */
static int move(PyObject *from, PyObject *to, PyObject *key) {
    if (PyObject_DelItem(from, key) < 0) return -1;
    return PyObject_SetItem(to, key, Py_None);
}

/* Drop the oldest entry of a non-empty OrderedDict. */
static int drop_oldest(PyObject *entries) {
    PyObject *iterator = PyObject_GetIter(entries);
    if (iterator == NULL) return -1;
    PyObject *oldest = PyIter_Next(iterator);
    Py_DECREF(iterator);
    if (oldest == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "dictionary is empty");
        return -1;
    }
    int failed = PyObject_DelItem(entries, oldest);
    Py_DECREF(oldest);
    return failed;
}

/* ARC's directory bounds: |T1| + |B1| <= c, and all four lists <= 2c; the
 * oldest ghosts go first. */
static int trim_ghosts(PyObject *t1, PyObject *t2, PyObject *b1, PyObject *b2,
                       Py_ssize_t capacity) {
    while (PyDict_GET_SIZE(t1) + PyDict_GET_SIZE(b1) > capacity && PyDict_GET_SIZE(b1) > 0)
        if (drop_oldest(b1) < 0) return -1;
    while (PyDict_GET_SIZE(t1) + PyDict_GET_SIZE(t2) + PyDict_GET_SIZE(b1) + PyDict_GET_SIZE(b2) >
               2 * capacity &&
           PyDict_GET_SIZE(b2) > 0)
        if (drop_oldest(b2) < 0) return -1;
    return 0;
}

/* ARC's insert of one key; *p is the target size of T1. */
static int insert(PyObject *t1, PyObject *t2, PyObject *b1, PyObject *b2, PyObject *key,
                  Py_ssize_t *p, Py_ssize_t capacity) {
    int found = PyDict_Contains(t1, key);
    if (found) return found < 0 ? -1 : move(t1, t2, key); /* seen again */
    found = PyDict_Contains(t2, key);
    if (found) {
        if (found < 0) return -1;
        PyObject *moved = PyObject_CallMethodOneArg(t2, str_move_to_end, key);
        Py_XDECREF(moved);
        return moved == NULL ? -1 : 0;
    }
    found = PyDict_Contains(b1, key);
    if (found) { /* evicted from T1 too early: T1 deserved more room */
        if (found < 0) return -1;
        Py_ssize_t step = PyDict_GET_SIZE(b2) / PyDict_GET_SIZE(b1);
        *p += step > 1 ? step : 1;
        if (*p > capacity) *p = capacity;
        return move(b1, t2, key);
    }
    found = PyDict_Contains(b2, key);
    if (found) { /* evicted from T2 too early: T2 deserved more room */
        if (found < 0) return -1;
        Py_ssize_t step = PyDict_GET_SIZE(b1) / PyDict_GET_SIZE(b2);
        *p -= step > 1 ? step : 1;
        if (*p < 0) *p = 0;
        return move(b2, t2, key);
    }
    if (PyObject_SetItem(t1, key, Py_None) < 0) return -1;
    return trim_ghosts(t1, t2, b1, b2, capacity);
}

/* arc_insert_all(t1, t2, b1, b2, keys, p, capacity) -> p: ARC's insert of each
 * key, in order; returns the new target size of T1. */
static PyObject *arc_insert_all(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *t1, *t2, *b1, *b2, *keys;
    Py_ssize_t p, capacity;
    if (!PyArg_ParseTuple(args, "O!O!O!O!Onn", &PyDict_Type, &t1, &PyDict_Type, &t2, &PyDict_Type,
                          &b1, &PyDict_Type, &b2, &keys, &p, &capacity))
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(key);
        int failed = insert(t1, t2, b1, b2, key, &p, capacity);
        Py_DECREF(key);
        if (failed < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(p);
}

/* Each key of a sequence moves from one list to the end of another. */
static int move_all(PyObject *from, PyObject *to, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "victims must be a sequence");
    if (seq == NULL) return -1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(key);
        int failed = move(from, to, key);
        Py_DECREF(key);
        if (failed < 0) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

/* arc_demote(t1, t2, b1, b2, from_t1, from_t2, capacity): victims become the
 * newest ghosts, in order (of B1 from T1, of B2 from T2), then the directory
 * is trimmed; KeyError for a victim not in its list. */
static PyObject *arc_demote(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *t1, *t2, *b1, *b2, *from_t1, *from_t2;
    Py_ssize_t capacity;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OOn", &PyDict_Type, &t1, &PyDict_Type, &t2, &PyDict_Type,
                          &b1, &PyDict_Type, &b2, &from_t1, &from_t2, &capacity))
        return NULL;
    if (move_all(t1, b1, from_t1) < 0 || move_all(t2, b2, from_t2) < 0 ||
        trim_ghosts(t1, t2, b1, b2, capacity) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* S3-FIFO's one step of its small queue, on the key taken from its head:
 * 1 a victim (now a ghost), 0 set aside or promoted, -1 an error. */
static int small_step(PyObject *key, PyObject *promote, PyObject *ghost, PyObject *counts,
                      PyObject *protected, PyObject *held, Py_ssize_t capacity, long main) {
    int found = PySequence_Contains(protected, key);
    if (found) return found < 0 ? -1 : (PyList_Append(held, key) < 0 ? -1 : 0);
    PyObject *value = PyDict_GetItemWithError(counts, key);
    if (value == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    long count = PyLong_AsLong(value);
    if (count == -1 && PyErr_Occurred()) return -1;
    if (count) { /* accessed: into main, with its frequency */
        PyObject *promoted = PyObject_CallOneArg(promote, key);
        if (promoted == NULL) return -1;
        Py_DECREF(promoted);
        PyObject *hotter = PyLong_FromLong(count + main);
        if (hotter == NULL) return -1;
        int failed = PyDict_SetItem(counts, key, hotter);
        Py_DECREF(hotter);
        return failed < 0 ? -1 : 0;
    }
    if (PyDict_DelItem(counts, key) < 0 || PyObject_SetItem(ghost, key, Py_None) < 0) return -1;
    /* The ghost remembers about as many keys as the cache holds. */
    if (PyDict_GET_SIZE(ghost) > capacity && drop_oldest(ghost) < 0) return -1;
    return 1;
}

/* s3fifo_evict_small(small, main, ghost, counts, protected, held, victims,
 * wanted, small_capacity, capacity, MAIN) -> bool: S3-FIFO's victims from its
 * small queue, until there are `wanted` or the queue falls below its share
 * (True), or it runs out first (False). Keys protected are set aside in
 * `held`; accessed ones are promoted to main with their count plus MAIN. */
static PyObject *s3fifo_evict_small(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *small, *main_queue, *ghost, *counts, *protected, *held, *victims;
    Py_ssize_t wanted, small_capacity, capacity;
    long main;
    if (!PyArg_ParseTuple(args, "OOO!O!OO!O!nnnl", &small, &main_queue, &PyDict_Type, &ghost,
                          &PyDict_Type, &counts, &protected, &PyList_Type, &held, &PyList_Type,
                          &victims, &wanted, &small_capacity, &capacity, &main))
        return NULL;
    PyObject *take = PyObject_GetAttr(small, str_popleft);
    PyObject *promote = take == NULL ? NULL : PyObject_GetAttr(main_queue, str_append);
    PyObject *result = NULL;
    if (promote == NULL) goto done;
    for (;;) {
        Py_ssize_t left = PyObject_Size(small);
        if (left < 0) goto done;
        if (left == 0) {
            result = Py_False;
            break;
        }
        PyObject *key = PyObject_CallNoArgs(take);
        if (key == NULL) goto done;
        int step = small_step(key, promote, ghost, counts, protected, held, capacity, main);
        if (step > 0) step = PyList_Append(victims, key) < 0 ? -1 : 1;
        Py_DECREF(key);
        if (step < 0) goto done;
        if (step > 0) {
            left = PyObject_Size(small);
            if (left < 0) goto done;
            if (PyList_GET_SIZE(victims) == wanted || left + PyList_GET_SIZE(held) < small_capacity) {
                result = Py_True;
                break;
            }
        }
    }
    Py_INCREF(result);
done:
    Py_XDECREF(take);
    Py_XDECREF(promote);
    return result;
}

static PyMethodDef methods[] = {
    {"arc_insert_all", arc_insert_all, METH_VARARGS,
     "arc_insert_all(t1, t2, b1, b2, keys, p, capacity) -> p"},
    {"arc_demote", arc_demote, METH_VARARGS, "arc_demote(t1, t2, b1, b2, from_t1, from_t2, capacity)"},
    {"s3fifo_evict_small", s3fifo_evict_small, METH_VARARGS,
     "s3fifo_evict_small(small, main, ghost, counts, protected, held, victims, wanted, "
     "small_capacity, capacity, MAIN) -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_steps", "The built-in cache policies' per-key steps, compiled.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__steps(void) {
    str_move_to_end = PyUnicode_InternFromString("move_to_end");
    str_popleft = PyUnicode_InternFromString("popleft");
    str_append = PyUnicode_InternFromString("append");
    if (str_move_to_end == NULL || str_popleft == NULL || str_append == NULL) return NULL;
    return PyModule_Create(&module);
}
