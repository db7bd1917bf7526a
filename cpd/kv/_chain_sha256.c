/* Optional accelerator for cpd.kv.block_hash (issue 13): the chained per-block SHA-256 loop
 * and the token-list -> u32le conversion, in C over OpenSSL's libcrypto (SHA-NI where the CPU
 * has it). The definition is the module's, unchanged:
 *
 *     h_i = first 8 bytes of SHA-256(u64be(h_{i-1}) + u32le(tokens_i))
 *
 * block_hash.py falls back to its pure-Python loop when this module is not built; the two
 * paths are compared byte for byte in tests/unit/test_block_hash.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* SHA256_Init/Update/Final: deprecated in OpenSSL 3 in favour of EVP, but EVP costs a context
 * reset per call, which is most of the time for a 72-byte message. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>

/* Blocks per GIL release: below this the loop is shorter than the release itself is worth. */
#define NOGIL_MIN_BLOCKS 64

static void chain_blocks(const unsigned char *parent, const unsigned char *data, Py_ssize_t num_blocks,
                         Py_ssize_t step, unsigned char *out) {
    unsigned char digest[SHA256_DIGEST_LENGTH];
    const unsigned char *h = parent;
    SHA256_CTX ctx;
    for (Py_ssize_t i = 0; i < num_blocks; i++) {
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, h, 8);
        SHA256_Update(&ctx, data + i * step, (size_t)step);
        SHA256_Final(digest, &ctx);
        memcpy(out + 8 * i, digest, 8);
        h = out + 8 * i;
    }
}

PyDoc_STRVAR(chain_doc,
"chain(parent, buf, start, stop, step) -> bytes\n\n"
"Concatenated 8-byte digests of the blocks buf[start:stop] (each `step` bytes) chained from\n"
"the 8-byte `parent`: h_i = SHA-256(h_{i-1} + block_i)[:8]. A trailing part shorter than\n"
"`step` is not hashed.");

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer parent, buf;
    Py_ssize_t start, stop, step;
    if (!PyArg_ParseTuple(args, "y*y*nnn", &parent, &buf, &start, &stop, &step))
        return NULL;
    PyObject *result = NULL;
    if (parent.len != 8) {
        PyErr_SetString(PyExc_ValueError, "parent must be 8 bytes");
        goto done;
    }
    if (step <= 0 || start < 0 || stop < start || stop > buf.len) {
        PyErr_SetString(PyExc_ValueError, "need 0 <= start <= stop <= len(buf) and step > 0");
        goto done;
    }
    Py_ssize_t num_blocks = (stop - start) / step;
    result = PyBytes_FromStringAndSize(NULL, 8 * num_blocks);
    if (result == NULL)
        goto done;
    const unsigned char *data = (const unsigned char *)buf.buf + start;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    if (num_blocks >= NOGIL_MIN_BLOCKS) {
        Py_BEGIN_ALLOW_THREADS
        chain_blocks(parent.buf, data, num_blocks, step, out);
        Py_END_ALLOW_THREADS
    } else {
        chain_blocks(parent.buf, data, num_blocks, step, out);
    }
done:
    PyBuffer_Release(&parent);
    PyBuffer_Release(&buf);
    return result;
}

PyDoc_STRVAR(u32le_doc,
"u32le(token_ids) -> bytes | None\n\n"
"Contiguous little-endian u32 bytes of a list or tuple of ints. Raises ValueError for an id\n"
"outside [0, 2**32); returns None for any other input (not a list/tuple, or an item that is\n"
"not an int), which the caller converts another way.");

static PyObject *u32le(PyObject *self, PyObject *seq) {
    if (!PyList_Check(seq) && !PyTuple_Check(seq))
        Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *result = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (result == NULL)
        return NULL;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_Check(item)) {
            Py_DECREF(result);
            Py_RETURN_NONE;
        }
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow != 0 || v < 0 || v > 0xFFFFFFFFLL) {
            Py_DECREF(result);
            PyErr_SetString(PyExc_ValueError, "token ids must be in [0, 2**32)");
            return NULL;
        }
        uint32_t u = (uint32_t)v;
        out[4 * i] = (unsigned char)u;
        out[4 * i + 1] = (unsigned char)(u >> 8);
        out[4 * i + 2] = (unsigned char)(u >> 16);
        out[4 * i + 3] = (unsigned char)(u >> 24);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, chain_doc},
    {"u32le", u32le, METH_O, u32le_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chain_sha256",
    "Chained per-block SHA-256 and u32le packing for cpd.kv.block_hash (C, OpenSSL).", -1, methods,
};

PyMODINIT_FUNC PyInit__chain_sha256(void) { return PyModule_Create(&module); }
