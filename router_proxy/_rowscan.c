/* SGLang's candidate rows read from the response bytes in one pass: the C scanner of
 * router_proxy/candidate_scan.py (which documents the contract and holds the numpy scanner this one
 * must agree with, bit for bit).
 *
 *     rows(body, start, k) -> (ids: bytearray of int64, logprobs: bytearray of float64, end) | None
 *
 * ``start`` is the offset just after '"output_top_logprobs":'. The value there must be a list
 * of rows of exactly ``k`` compact entries ``[logprob,id,null]`` (orjson's layout: no spaces);
 * ``end`` is the offset just after it. Anything else (a space, a text instead of null, a short
 * row, an id that is not a JSON integer, a number JSON does not allow, a float outside the
 * finite range) gives None, and the caller parses the body the general way.
 *
 * Floats are correctly rounded, so they equal any correct parser's (orjson's) bit for bit:
 *   - m < 2^53 significant digits times 10^x with |x| <= 22: both exact doubles, one rounding;
 *   - otherwise, with the x87 80-bit long double and |x| <= 27: m and 10^x exact, one rounding
 *     to 64 bits, then one to 53, which is correct unless the first landed exactly on a 53-bit
 *     midpoint (low 11 bits 0x400);
 *   - everything else: CPython's correctly rounded PyOS_string_to_double.
 * A JSON integer in the log-prob slot is what orjson gives, an int: read as float(int), so "-0"
 * is +0.0; integers of 2^53 or more give None (the general path decides).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stdint.h>
#include <string.h>

#define MAX_DIGITS 19   /* significant digits kept exactly in a uint64 */
#define MAX_TOKEN 64    /* a longer number goes to the general path */
#define TWO53 9007199254740992ULL

static const double POW10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                                 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

#if LDBL_MANT_DIG == 64
#define X87 1
static long double POW10L[28];
#else
#define X87 0
#endif

typedef struct {
    char *data;
    Py_ssize_t used, size;
} Grow;

static int grow_put(Grow *g, const void *item, Py_ssize_t n) {
    if (g->used + n > g->size) {
        Py_ssize_t size = g->size ? 2 * g->size : 1 << 16;
        while (size < g->used + n)
            size *= 2;
        char *data = PyMem_Realloc(g->data, size);
        if (!data)
            return -1;
        g->data = data;
        g->size = size;
    }
    memcpy(g->data + g->used, item, n);
    g->used += n;
    return 0;
}

static inline int is_digit(char c) { return c >= '0' && c <= '9'; }

/* A JSON number at *pp (ending before ``end``) as orjson reads it, as a double in *out.
 * Returns 1 on success, 0 when the caller must give up (not JSON, out of range, too long). */
static int read_logprob(const char **pp, const char *end, double *out) {
    const char *p = *pp, *tok = p;
    int neg = 0, slow = 0, is_int = 1;
    uint64_t m = 0;
    int sig = 0, x = 0;
    if (p < end && *p == '-') {
        neg = 1;
        p++;
    }
    if (p >= end || !is_digit(*p))
        return 0;
    if (*p == '0') {
        p++;
    } else {
        while (p < end && is_digit(*p)) {
            if (sig < MAX_DIGITS) {
                m = m * 10 + (uint64_t)(*p - '0');
                sig++;
            } else {
                slow = 1;
            }
            p++;
        }
    }
    if (p < end && *p == '.') {
        is_int = 0;
        p++;
        if (p >= end || !is_digit(*p))
            return 0;
        while (p < end && is_digit(*p)) {
            if (m == 0 && *p == '0') {
                x--;  /* a leading zero of the fraction */
            } else if (sig < MAX_DIGITS) {
                m = m * 10 + (uint64_t)(*p - '0');
                sig++;
                x--;
            } else {
                slow = 1;
            }
            p++;
        }
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        is_int = 0;
        p++;
        int eneg = 0, e = 0;
        if (p < end && (*p == '+' || *p == '-')) {
            eneg = *p == '-';
            p++;
        }
        if (p >= end || !is_digit(*p))
            return 0;
        while (p < end && is_digit(*p)) {
            if (e < 100000)
                e = e * 10 + (*p - '0');
            p++;
        }
        x += eneg ? -e : e;
    }
    *pp = p;
    if (is_int) {
        if (slow || m >= TWO53)
            return 0;
        *out = (double)(neg ? -(int64_t)m : (int64_t)m);  /* "-0" is the int 0: +0.0 */
        return 1;
    }
    double v;
    if (m == 0 && !slow) {
        v = 0.0;
    } else if (!slow && m < TWO53 && x >= -22 && x <= 22) {
        v = x < 0 ? (double)m / POW10[-x] : (double)m * POW10[x];
    } else {
#if X87
        if (!slow && x >= -27 && x <= 27) {
            long double l = (long double)m;
            l = x < 0 ? l / POW10L[-x] : l * POW10L[x];
            uint64_t mant;
            memcpy(&mant, &l, sizeof mant);
            if ((mant & 0x7FF) != 0x400) {
                v = (double)l;
                goto done;
            }
        }
#endif
        Py_ssize_t n = p - tok;
        if (n >= MAX_TOKEN)
            return 0;
        char text[MAX_TOKEN];
        memcpy(text, tok, n);
        text[n] = 0;
        v = PyOS_string_to_double(text, NULL, NULL);
        if (v == -1.0 && PyErr_Occurred()) {  /* cannot happen for a JSON number: give up, not raise */
            PyErr_Clear();
            return 0;
        }
        if (!isfinite(v))
            return 0;
        *out = v;  /* signed already */
        return 1;
    }
done:
    *out = neg ? -v : v;
    return 1;
}

/* A JSON integer of at most 18 digits. */
static int read_id(const char **pp, const char *end, int64_t *out) {
    const char *p = *pp;
    int neg = 0, n = 0;
    int64_t v = 0;
    if (p < end && *p == '-') {
        neg = 1;
        p++;
    }
    if (p >= end || !is_digit(*p))
        return 0;
    if (*p == '0') {
        p++;
        n = 1;
    } else {
        while (p < end && is_digit(*p)) {
            if (++n > 18)
                return 0;
            v = v * 10 + (*p - '0');
            p++;
        }
    }
    if (p < end && (*p == '.' || *p == 'e' || *p == 'E'))
        return 0;
    *pp = p;
    *out = neg ? -v : v;
    return 1;
}

#define EXPECT(c)                     \
    do {                              \
        if (p >= end || *p != (c))    \
            goto give_up;             \
        p++;                          \
    } while (0)

static PyObject *rows(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t start, k;
    if (!PyArg_ParseTuple(args, "y*nn", &view, &start, &k))
        return NULL;
    Grow ids = {0}, lps = {0};
    PyObject *result = NULL;
    const char *base = view.buf, *end = base + view.len, *p = base + start;
    if (start < 0 || start > view.len || k < 1)
        goto give_up;
    EXPECT('[');
    for (;;) {
        EXPECT('[');
        for (Py_ssize_t j = 0; j < k; j++) {
            double lp;
            int64_t id;
            if (j)
                EXPECT(',');
            EXPECT('[');
            if (!read_logprob(&p, end, &lp))
                goto give_up;
            EXPECT(',');
            if (!read_id(&p, end, &id))
                goto give_up;
            if (end - p < 6 || memcmp(p, ",null]", 6) != 0)
                goto give_up;
            p += 6;
            if (grow_put(&lps, &lp, sizeof lp) < 0 || grow_put(&ids, &id, sizeof id) < 0) {
                PyErr_NoMemory();
                goto error;
            }
        }
        EXPECT(']');
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        EXPECT(']');
        break;
    }
    PyObject *id_bytes = PyByteArray_FromStringAndSize(ids.data, ids.used);
    PyObject *lp_bytes = id_bytes ? PyByteArray_FromStringAndSize(lps.data, lps.used) : NULL;
    if (lp_bytes)
        result = Py_BuildValue("(NNn)", id_bytes, lp_bytes, (Py_ssize_t)(p - base));
    else
        Py_XDECREF(id_bytes);
    goto out;  /* the tuple, or NULL with the error set */
give_up:
    result = Py_NewRef(Py_None);
    goto out;
error:
    result = NULL;
out:
    PyMem_Free(ids.data);
    PyMem_Free(lps.data);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"rows", rows, METH_VARARGS,
     "rows(body, start, k) -> (ids int64 bytes, logprobs float64 bytes, end) or None: the compact "
     "K-wide candidate rows of the JSON value at body[start:]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowscan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowscan(void) {
#if X87
    POW10L[0] = 1.0L;
    for (int i = 1; i < 28; i++)
        POW10L[i] = POW10L[i - 1] * 10.0L;  /* exact: 5^27 < 2^64 */
#endif
    PyObject *mod = PyModule_Create(&module);
    if (mod && PyModule_AddIntConstant(mod, "X87", X87) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
