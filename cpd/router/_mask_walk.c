/* Optional accelerator for cpd.router.mask_table (issue 13 item 5): the prefix walk of
 * MaskTable.runs in C, one probe per block of the prompt, straight from the Python list of
 * block hashes, stopping at the first block where no worker's run continues (a cold prompt:
 * one probe). mask_table.py falls back to its numpy walk when this module is not built; the
 * two are compared in tests/unit/test_mask_walk.py.
 *
 * The table is MaskTable's array: rows of three uint64 (key, L1 mask, L2 mask), a power of
 * two of them, linear probing from (key * salt mod 2**64) >> shift. A row naming the key
 * resolves it (live: its masks; deleted, L1 mask = 1 << 63 and L2 mask 0: absent); an empty
 * row (both masks 0) resolves it as absent; anything else probes the next row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define TOMB (1ULL << 63)
#define LOW (TOMB - 1)
#define ROW 3
/* Blocks ahead whose home row is prefetched: the rows are random in an array of tens of MiB,
 * so each probe is a cache miss; prefetching overlaps them. */
#define PREFETCH_AHEAD 16

/* keys[i] as a uint64 in *k; 0 (no error set) if it is not an int in [0, 2**64). */
static inline int key_at(PyObject **items, Py_ssize_t i, uint64_t *k) {
    PyObject *item = items[i];
    if (!PyLong_Check(item))
        return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(item);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {  /* negative or >= 2**64 */
        PyErr_Clear();
        return 0;
    }
    *k = (uint64_t)v;
    return 1;
}

static inline void masks_of(const uint64_t *tab, uint64_t cmask, uint64_t salt, int shift, uint64_t k,
                            uint64_t *m1, uint64_t *m2) {
    uint64_t s = (k * salt) >> shift;
    for (;;) {
        const uint64_t *r = tab + ROW * s;
        if (r[0] == k) {
            *m1 = r[1] & LOW;
            *m2 = r[2];
            return;
        }
        if (r[1] == 0 && r[2] == 0) {
            *m1 = *m2 = 0;
            return;
        }
        s = (s + 1) & cmask;
    }
}

PyDoc_STRVAR(walk_doc,
"walk(table, salt, shift, keys, group) -> dict | None\n\n"
"For each local worker bit of `group`: (end of its run of consecutive keys from keys[0] held\n"
"in L1, end of the run continuing it in L2), as {bit: (end1, end2)}. `table`: the MaskTable\n"
"array (a C-contiguous uint64 buffer of rows (key, L1 mask, L2 mask), a power of two of them);\n"
"`salt`, `shift`: its home-slot hash. Returns None, reading nothing further, when `keys` is not\n"
"a list or tuple or one of the keys it reaches is not an int in [0, 2**64): the caller walks\n"
"another way.");

static PyObject *walk(PyObject *self, PyObject *args) {
    Py_buffer tab;
    unsigned long long salt, group;
    int shift;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "y*KiOK", &tab, &salt, &shift, &keys, &group))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t slots = tab.len / (Py_ssize_t)(ROW * sizeof(uint64_t));
    if (tab.len % (Py_ssize_t)(ROW * sizeof(uint64_t)) != 0 || slots < 2 || (slots & (slots - 1)) != 0 ||
        shift < 1 || shift > 63 || ((uint64_t)1 << (64 - shift)) != (uint64_t)slots || (group & TOMB)) {
        PyErr_SetString(PyExc_ValueError, "bad table, shift or group");
        goto done;
    }
    if (!PyList_Check(keys) && !PyTuple_Check(keys)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    const uint64_t *t = (const uint64_t *)tab.buf;
    uint64_t cmask = (uint64_t)slots - 1, cur1 = group, cur2 = 0;
    Py_ssize_t end1[63], end2[63];
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), j = 0;
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < PREFETCH_AHEAD && i < n; i++) {
        uint64_t k;
        if (key_at(items, i, &k))
            __builtin_prefetch(t + ROW * ((k * (uint64_t)salt) >> shift));
    }
    for (; j < n && (cur1 | cur2); j++) {
        uint64_t k, ka;
        if (!key_at(items, j, &k)) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        if (j + PREFETCH_AHEAD < n && key_at(items, j + PREFETCH_AHEAD, &ka))
            __builtin_prefetch(t + ROW * ((ka * (uint64_t)salt) >> shift));
        uint64_t m1, m2;
        masks_of(t, cmask, (uint64_t)salt, shift, k, &m1, &m2);
        uint64_t lost1 = cur1 & ~m1;
        for (uint64_t b = lost1; b; b &= b - 1)
            end1[__builtin_ctzll(b)] = j;
        cur1 &= m1;
        cur2 |= lost1;  /* their L2 run starts at this block */
        for (uint64_t b = cur2 & ~m2; b; b &= b - 1)
            end2[__builtin_ctzll(b)] = j;
        cur2 &= m2;
    }
    for (uint64_t b = cur1; b; b &= b - 1)  /* held to the end of the prompt */
        end1[__builtin_ctzll(b)] = end2[__builtin_ctzll(b)] = j;
    for (uint64_t b = cur2; b; b &= b - 1)
        end2[__builtin_ctzll(b)] = j;
    result = PyDict_New();
    if (result == NULL)
        goto done;
    for (uint64_t b = group; b; b &= b - 1) {
        int i = __builtin_ctzll(b);
        PyObject *key = PyLong_FromUnsignedLongLong(1ULL << i);
        PyObject *val = Py_BuildValue("(nn)", end1[i], end2[i]);
        int bad = key == NULL || val == NULL || PyDict_SetItem(result, key, val) < 0;
        Py_XDECREF(key);
        Py_XDECREF(val);
        if (bad) {
            Py_CLEAR(result);
            goto done;
        }
    }
done:
    PyBuffer_Release(&tab);
    return result;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, walk_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_mask_walk",
    "The prefix walk of cpd.router.mask_table.MaskTable.runs, in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__mask_walk(void) { return PyModule_Create(&module); }
