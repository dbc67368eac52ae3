/* Native columnar scanner for Kineto JSON traces: bytes → column buffers, no Python object per event.
 *
 * traceana/ingest/kineto.py uses it when it is built (an optional extension: without a C compiler the general
 * msgspec decoder does the same job, slower). It handles the traces torch writes and nothing more: anything it
 * does not accept exactly as that decoder would (a wrong type, bad UTF-8, deep nesting, invalid or truncated
 * JSON) raises ``Unsupported`` and kineto.py decodes the whole file with the general decoder instead, so the two
 * paths cannot disagree on the tables they produce.
 *
 * Two functions, both resumable so a file can be fed in pieces (streaming decompression), and a Scanner object
 * that carries one file's state across ``events`` calls:
 *   top(buf, pos, opening, final) -> (status, pos, [(key, start, end), ...])
 *       the top-level object's keys up to the traceEvents array (status EVENTS, pos just after its '['), or to
 *       the end of the object (status END, pos after '}'); opening: pos is before '{' (else after a value).
 *   events(buf, pos, first, max_bytes, final, scanner) -> (status, pos, first, x, memory, gpu, comm, shapes, odd,
 *                                                          n_events)
 *       events of the array from pos (after '[' or a ','), until about max_bytes were consumed (MORE), the
 *       array closed (END, pos after ']') or the buffer ended inside an event (NEED: pos is where it started).
 *   Scanner(gpu_cats, comm_names, shaped_names, shaped_prefixes).dictionaries() -> (name, cat, pid, tid)
 *       the file's distinct names, categories, pids and tids so far, in code order.
 *   Scanner.take() -> (x, tracks, pos)
 *       the X events' columns (a Batch each), which the Scanner keeps across events() calls (events() returns an X table of no
 *       columns whose len() is the X rows it added), sorted as finishing sorts them ("the time order"); the
 *       file's distinct tracks (see TrackKey) in code order; and where each row of the file went in x.
 * The tables are Batch objects (see "emitting rows"): columns in Arrow's layouts (int32, int64; large_string
 * with int64 offsets), exported without copying through the Arrow PyCapsule protocol (polars reads them directly).
 * An X event's name, cat, pid and tid are codes into the scanner's dictionaries (dictionary encoding: each distinct
 * value is stored once per file, not once per event — kernel names run to hundreds of bytes), and the few columns
 * that only some events have (GPU args, collective args, record_shapes lists) are sparse tables of those events'
 * rows. odd: [(table, column, row, raw JSON)] for args values of another type than their column's (tables T_*;
 * an X row is its row in the file), which Python converts like the general decoder.
 * Times are converted to integer nanoseconds from the decimal digits (exact: no float rounding).
 * The parse runs without the GIL, so threads can scan several files at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <sys/mman.h> /* mremap: declared under _GNU_SOURCE, which Python.h defines */

typedef unsigned char uchar;

enum { ST_OK = 0, ST_NEED = 1, ST_BAD = 2, ST_NOMEM = 3 };
enum { R_MORE = 0, R_END = 1, R_NEED = 2, R_EVENTS = 3 };
#define MAX_DEPTH 200
#define TRY(x) do { int s_ = (x); if (s_) return s_; } while (0)

static PyObject *Unsupported;

typedef struct {
    const uchar *base, *p, *end;
    const char *why; /* set with ST_BAD */
} P;

static int bad(P *ps, const char *why) {
    ps->why = why;
    return ST_BAD;
}

/* --- growable buffers and Arrow columns ------------------------------------------------------------------- */
/* A buffer of MAP_BYTES or more is an anonymous mapping of its own, grown by mremap (its pages move, they are not
 * copied), and unmapped when freed (not in huge pages: the event columns outlive the scan in the table, and a
 * column's last huge page, or a doubled buffer's untouched half, would count in full): a file's event columns grow to tens of MB
 * across calls, which realloc copied while glibc's mmap threshold (raised by the buffers freed before) kept them
 * in its heap, where freed ones then stayed (docs/performance.md "Memory"). */
typedef struct { char *d; Py_ssize_t len, cap; char mapped; } Buf;
#define MAP_BYTES ((Py_ssize_t)1 << 20)

static void buf_free(Buf *b) {
    if (b->mapped) munmap(b->d, (size_t)b->cap);
    else free(b->d);
    b->d = NULL;
    b->len = b->cap = 0;
    b->mapped = 0;
}

static int buf_grow(Buf *b, Py_ssize_t extra) {
    Py_ssize_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) cap *= 2;
    if (cap < MAP_BYTES) {
        char *d = realloc(b->d, (size_t)cap);
        if (!d) return ST_NOMEM;
        b->d = d;
        b->cap = cap;
        return ST_OK;
    }
    void *d;
#ifdef MREMAP_MAYMOVE
    if (b->mapped) {
        d = mremap(b->d, (size_t)b->cap, (size_t)cap, MREMAP_MAYMOVE);
        if (d == MAP_FAILED) return ST_NOMEM;
    } else
#endif
    {
        d = mmap(NULL, (size_t)cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (d == MAP_FAILED) return ST_NOMEM;
        Py_ssize_t len = b->len;
        if (len) memcpy(d, b->d, (size_t)len);
        buf_free(b);
        b->len = len;
    }
    b->d = d;
    b->cap = cap;
    b->mapped = 1;
    return ST_OK;
}

static inline int buf_reserve(Buf *b, Py_ssize_t extra) {
    return b->len + extra <= b->cap ? ST_OK : buf_grow(b, extra);
}

static inline int buf_put(Buf *b, const void *src, Py_ssize_t n) {
    TRY(buf_reserve(b, n));
    if (n) memcpy(b->d + b->len, src, (size_t)n);
    b->len += n;
    return ST_OK;
}

typedef struct { Buf data, offs, valid; Py_ssize_t n, nulls; char fmt; } Col; /* fmt: 'l' int64, 'i' int32, 'U' string */

static inline int col_valid(Col *c, int ok) {
    if ((c->n & 7) == 0) {
        TRY(buf_reserve(&c->valid, 1));
        c->valid.d[c->valid.len++] = 0;
    }
    if (ok) c->valid.d[c->n >> 3] |= (char)(1 << (c->n & 7));
    else c->nulls++;
    c->n++;
    return ST_OK;
}

static inline int put8(Buf *b, int64_t v) {
    TRY(buf_reserve(b, 8));
    memcpy(b->d + b->len, &v, 8);
    b->len += 8;
    return ST_OK;
}

static inline int col_int(Col *c, int64_t v, int ok) {
    TRY(put8(&c->data, ok ? v : 0));
    return col_valid(c, ok);
}

static inline int col_i32(Col *c, int32_t v, int ok) {
    TRY(buf_reserve(&c->data, 4));
    if (!ok) v = 0;
    memcpy(c->data.d + c->data.len, &v, 4);
    c->data.len += 4;
    return col_valid(c, ok);
}

static inline int col_str_end(Col *c, int ok) { /* the string's bytes were appended to c->data already */
    TRY(put8(&c->offs, c->data.len));
    return col_valid(c, ok);
}

static void col_free(Col *c) {
    buf_free(&c->data);
    buf_free(&c->offs);
    buf_free(&c->valid);
    memset(c, 0, sizeof *c);
}

/* --- handing columns to Python: the Arrow C data interface ------------------------------------------------
 * A Batch owns one table's columns; ``__arrow_c_array__`` (the Arrow PyCapsule protocol) exports them as one struct
 * array whose children are the columns — int64 ("l": validity, data) and large_string ("U": validity, int64 offsets,
 * data) — moving the malloc'd buffers into the export without copying them. polars imports that directly
 * (``pl.DataFrame(batch)``), so no Arrow library is needed in between; each child's release callback frees its own
 * buffers (no GIL needed), whenever and on whichever thread the consumer drops them. */
struct ArrowSchema {
    const char *format, *name, *metadata;
    int64_t flags, n_children;
    struct ArrowSchema **children, *dictionary;
    void (*release)(struct ArrowSchema *);
    void *private_data;
};
struct ArrowArray {
    int64_t length, null_count, offset, n_buffers, n_children;
    const void **buffers;
    struct ArrowArray **children, *dictionary;
    void (*release)(struct ArrowArray *);
    void *private_data;
};
#define ARROW_FLAG_NULLABLE 2

typedef struct { Col col; const void *bufs[3]; } ColExport;
typedef struct { struct ArrowArray **kids; const void *bufs[1]; } StructExport;

static void release_col_array(struct ArrowArray *a) {
    ColExport *x = a->private_data;
    col_free(&x->col);
    free(x);
    a->release = NULL;
}

static void release_struct_array(struct ArrowArray *a) {
    StructExport *x = a->private_data;
    for (int64_t i = 0; i < a->n_children; i++) {
        struct ArrowArray *k = x->kids[i];
        if (k->release) k->release(k);
        free(k);
    }
    free(x->kids);
    free(x);
    a->release = NULL;
}

static void release_schema(struct ArrowSchema *s) {
    for (int64_t i = 0; i < s->n_children; i++) free(s->children[i]);
    free(s->children);
    s->release = NULL;
}

static void capsule_schema_free(PyObject *cap) {
    struct ArrowSchema *s = PyCapsule_GetPointer(cap, "arrow_schema");
    if (s && s->release) s->release(s);
    free(s);
}

static void capsule_array_free(PyObject *cap) {
    struct ArrowArray *a = PyCapsule_GetPointer(cap, "arrow_array");
    if (a && a->release) a->release(a);
    free(a);
}

typedef struct {
    PyObject_HEAD
    int n_cols;
    Py_ssize_t rows;
    const char *const *names;
    Col *cols; /* NULL once exported */
} Batch;

static void batch_dealloc(Batch *b) {
    if (b->cols) {
        for (int i = 0; i < b->n_cols; i++) col_free(&b->cols[i]);
        free(b->cols);
    }
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static Py_ssize_t batch_len(Batch *b) { return b->rows; }

static PyObject *batch_names(Batch *b, void *closure) {
    PyObject *t = PyTuple_New(b->n_cols);
    if (!t) return NULL;
    for (int i = 0; i < b->n_cols; i++) {
        PyObject *s = PyUnicode_FromString(b->names[i]);
        if (!s) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, i, s);
    }
    return t;
}

static const char EMPTY_BUF[16] __attribute__((aligned(16))) = {0};

static PyObject *batch_export(Batch *b, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"requested_schema", NULL};
    PyObject *requested = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwlist, &requested)) return NULL;
    if (requested != Py_None) {
        PyErr_SetString(PyExc_NotImplementedError, "a Batch exports its own schema only");
        return NULL;
    }
    if (!b->cols) {
        PyErr_SetString(PyExc_RuntimeError, "a Batch's columns can be exported once");
        return NULL;
    }
    int n = b->n_cols;
    struct ArrowSchema *sch = calloc(1, sizeof *sch);
    struct ArrowArray *arr = calloc(1, sizeof *arr);
    StructExport *sx = calloc(1, sizeof *sx);
    struct ArrowSchema **skids = calloc((size_t)n, sizeof *skids);
    struct ArrowArray **akids = calloc((size_t)n, sizeof *akids);
    int ok = sch && arr && sx && skids && akids;
    for (int i = 0; ok && i < n; i++) {
        skids[i] = calloc(1, sizeof **skids);
        akids[i] = calloc(1, sizeof **akids);
        ok = skids[i] && akids[i];
    }
    ColExport **cx = ok ? calloc((size_t)n, sizeof *cx) : NULL;
    ok = ok && cx;
    for (int i = 0; ok && i < n; i++) ok = (cx[i] = calloc(1, sizeof **cx)) != NULL;
    if (!ok) {
        for (int i = 0; i < n; i++) {
            if (skids) free(skids[i]);
            if (akids) free(akids[i]);
            if (cx) free(cx[i]);
        }
        free(cx); free(skids); free(akids); free(sx); free(arr); free(sch);
        return PyErr_NoMemory();
    }
    /* From here nothing fails: the columns move into the export. */
    for (int i = 0; i < n; i++) {
        Col *c = &b->cols[i];
        ColExport *x = cx[i];
        x->col = *c;
        memset(c, 0, sizeof *c);
        c = &x->col;
        int is_str = c->fmt == 'U';
        *skids[i] = (struct ArrowSchema){is_str ? "U" : c->fmt == 'i' ? "i" : "l", b->names[i], NULL, ARROW_FLAG_NULLABLE, 0, NULL, NULL,
                                         release_schema, NULL};
        const void *valid = c->nulls ? (const void *)c->valid.d : NULL;
        const void *data = c->data.d ? (const void *)c->data.d : (const void *)EMPTY_BUF;
        if (is_str) { x->bufs[0] = valid; x->bufs[1] = c->offs.d; x->bufs[2] = data; }
        else { x->bufs[0] = valid; x->bufs[1] = data; }
        *akids[i] = (struct ArrowArray){(int64_t)c->n, (int64_t)c->nulls, 0, is_str ? 3 : 2, 0, x->bufs, NULL, NULL,
                                        release_col_array, x};
    }
    free(cx);
    free(b->cols);
    b->cols = NULL;
    sx->kids = akids;
    sx->bufs[0] = NULL;
    *sch = (struct ArrowSchema){"+s", "", NULL, 0, n, skids, NULL, release_schema, NULL};
    *arr = (struct ArrowArray){(int64_t)b->rows, 0, 0, 1, n, sx->bufs, akids, NULL, release_struct_array, sx};
    PyObject *cs = PyCapsule_New(sch, "arrow_schema", capsule_schema_free);
    if (!cs) { release_schema(sch); free(sch); arr->release(arr); free(arr); return NULL; }
    PyObject *ca = PyCapsule_New(arr, "arrow_array", capsule_array_free);
    if (!ca) { Py_DECREF(cs); arr->release(arr); free(arr); return NULL; }
    return Py_BuildValue("(NN)", cs, ca);
}

static PyMethodDef batch_methods[] = {
    {"__arrow_c_array__", (PyCFunction)(void (*)(void))batch_export, METH_VARARGS | METH_KEYWORDS,
     "__arrow_c_array__(requested_schema=None) -> (schema capsule, array capsule): moves the columns out (once)"},
    {NULL, NULL, 0, NULL},
};
static PyGetSetDef batch_getset[] = {{"names", (getter)batch_names, NULL, "column names", NULL}, {NULL}};
static PySequenceMethods batch_seq = {.sq_length = (lenfunc)batch_len};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceana.ingest._scan.Batch",
    .tp_basicsize = sizeof(Batch),
    .tp_dealloc = (destructor)batch_dealloc,
    .tp_as_sequence = &batch_seq,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One table's columns from the scanner, exported through the Arrow PyCapsule protocol.",
    .tp_methods = batch_methods,
    .tp_getset = batch_getset,
};

/* The n columns at cols moved into a new Batch (cols are left empty). */
static PyObject *batch_new(Col *cols, int n, const char *const *names) {
    Batch *b = PyObject_New(Batch, &BatchType);
    if (!b) return NULL;
    b->n_cols = n;
    b->names = names;
    b->rows = n ? cols[0].n : 0;
    b->cols = malloc(sizeof(Col) * (size_t)(n ? n : 1));
    if (!b->cols) { b->n_cols = 0; Py_DECREF(b); return PyErr_NoMemory(); }
    if (n) {
        memcpy(b->cols, cols, sizeof(Col) * (size_t)n);
        memset(cols, 0, sizeof(Col) * (size_t)n);
    }
    return (PyObject *)b;
}

/* --- JSON lexing ------------------------------------------------------------------------------------------ */
static const uchar WS[256] = {[' '] = 1, ['\n'] = 1, ['\r'] = 1, ['\t'] = 1};
static inline int is_ws(uchar c) { return WS[c]; }

static inline void ws(P *ps) {
    const uchar *p = ps->p, *e = ps->end;
    if (p >= e || !is_ws(*p)) return; /* the usual case: no whitespace, */
    p++;
    if (p < e && !is_ws(*p)) { ps->p = p; return; } /* or one space (after ':' and ','), */
#ifdef __SSE2__
    /* or a line break and an indent: 16 bytes a step */
    const __m128i sp = _mm_set1_epi8(' '), nl = _mm_set1_epi8('\n'), cr = _mm_set1_epi8('\r'), tab = _mm_set1_epi8('\t');
    while (e - p >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        __m128i w = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, sp), _mm_cmpeq_epi8(v, nl)),
                                 _mm_or_si128(_mm_cmpeq_epi8(v, cr), _mm_cmpeq_epi8(v, tab)));
        unsigned other = ~(unsigned)_mm_movemask_epi8(w) & 0xFFFFu;
        if (other) { ps->p = p + __builtin_ctz(other); return; }
        p += 16;
    }
#endif
    while (p < e && is_ws(*p)) p++;
    ps->p = p;
}

/* Length of the UTF-8 sequence at q (2-4), 0 when invalid, -1 when the buffer ends inside it. */
static int utf8_len(const uchar *q, const uchar *e) {
    uchar c = q[0];
    int n;
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) n = 3;
    else if (c >= 0xF0 && c <= 0xF4) n = 4;
    else return 0;
    if (e - q < n) return -1;
    for (int i = 1; i < n; i++)
        if ((q[i] & 0xC0) != 0x80) return 0;
    if (n == 3 && ((c == 0xE0 && q[1] < 0xA0) || (c == 0xED && q[1] >= 0xA0))) return 0; /* overlong, surrogate */
    if (n == 4 && ((c == 0xF0 && q[1] < 0x90) || (c == 0xF4 && q[1] >= 0x90))) return 0; /* overlong, > U+10FFFF */
    return n;
}

static int hex4(const uchar *q, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        uchar c = q[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= c - '0';
        else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
        else return 0;
    }
    *out = v;
    return 1;
}

typedef struct { const uchar *s; Py_ssize_t n; char esc; char kind; } Span; /* kind: see K_* */
enum { K_ABSENT = 0, K_STR = 1, K_INT = 2, K_NULL = 3, K_ODD = 4 };

/* The first byte at or after q that ends a plain-ASCII run of a string ('"', '\\', a control byte or a non-ASCII
 * byte), or e. */
static inline const uchar *plain_run(const uchar *q, const uchar *e) {
#ifdef __SSE2__
    const __m128i quote = _mm_set1_epi8('"'), bslash = _mm_set1_epi8('\\'), space = _mm_set1_epi8(0x20);
    while (e - q >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)q);
        /* signed compare: bytes >= 0x80 are negative, so "v < 0x20" also flags them */
        __m128i hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, bslash)),
                                   _mm_cmplt_epi8(v, space));
        int mask = _mm_movemask_epi8(hit);
        if (mask) return q + __builtin_ctz((unsigned)mask);
        q += 16;
    }
#endif
    while (q < e && *q >= 0x20 && *q < 0x80 && *q != '"' && *q != '\\') q++;
    return q;
}

/* A string at ps->p ('"'): validated (escapes, UTF-8, no control characters); its raw contents in *sp. */
static int scan_string(P *ps, Span *sp) {
    const uchar *q = ps->p + 1, *e = ps->end;
    char esc = 0;
    for (;;) {
        q = plain_run(q, e);
        if (q >= e) return ST_NEED;
        uchar c = *q;
        if (c == '"') break;
        if (c == '\\') {
            esc = 1;
            if (e - q < 2) return ST_NEED;
            c = q[1];
            if (c == 'u') {
                unsigned cp, lo;
                if (e - q < 6) return ST_NEED;
                if (!hex4(q + 2, &cp)) return bad(ps, "bad \\u escape");
                q += 6;
                if (cp >= 0xDC00 && cp <= 0xDFFF) return bad(ps, "lone surrogate");
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    if (e - q < 6) return ST_NEED;
                    if (q[0] != '\\' || q[1] != 'u' || !hex4(q + 2, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                        return bad(ps, "lone surrogate");
                    q += 6;
                }
            } else if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't') {
                q += 2;
            } else {
                return bad(ps, "bad escape");
            }
            continue;
        }
        if (c < 0x20) return bad(ps, "control character in a string");
        int n = utf8_len(q, e);
        if (n < 0) return ST_NEED;
        if (n == 0) return bad(ps, "invalid UTF-8");
        q += n;
    }
    sp->s = ps->p + 1;
    sp->n = q - sp->s;
    sp->esc = esc;
    sp->kind = K_STR;
    ps->p = q + 1;
    return ST_OK;
}

static void put_utf8(char *o, Py_ssize_t *k, unsigned cp) {
    if (cp < 0x80) { o[(*k)++] = (char)cp; }
    else if (cp < 0x800) { o[(*k)++] = (char)(0xC0 | (cp >> 6)); o[(*k)++] = (char)(0x80 | (cp & 0x3F)); }
    else if (cp < 0x10000) {
        o[(*k)++] = (char)(0xE0 | (cp >> 12)); o[(*k)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[(*k)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        o[(*k)++] = (char)(0xF0 | (cp >> 18)); o[(*k)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        o[(*k)++] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[(*k)++] = (char)(0x80 | (cp & 0x3F));
    }
}

/* Append a validated string's decoded text to b (escapes resolved; never longer than the raw text). */
static int put_text(Buf *b, const Span *sp) {
    if (!sp->esc) return buf_put(b, sp->s, sp->n);
    TRY(buf_reserve(b, sp->n));
    char *o = b->d + b->len;
    Py_ssize_t k = 0;
    const uchar *q = sp->s, *e = sp->s + sp->n;
    while (q < e) {
        if (*q != '\\') { o[k++] = (char)*q++; continue; }
        uchar c = q[1];
        unsigned cp = 0, lo = 0;
        switch (c) {
        case 'b': o[k++] = '\b'; q += 2; break;
        case 'f': o[k++] = '\f'; q += 2; break;
        case 'n': o[k++] = '\n'; q += 2; break;
        case 'r': o[k++] = '\r'; q += 2; break;
        case 't': o[k++] = '\t'; q += 2; break;
        case 'u':
            hex4(q + 2, &cp);
            q += 6;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                hex4(q + 2, &lo);
                q += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            put_utf8(o, &k, cp);
            break;
        default: o[k++] = (char)c; q += 2; break; /* " \ / */
        }
    }
    b->len += k;
    return ST_OK;
}

/* Decoded text of a span: the raw bytes when it has no escapes, else decoded into scratch. */
static int text_of(const Span *sp, Buf *scratch, const char **s, Py_ssize_t *n) {
    if (!sp->esc) { *s = (const char *)sp->s; *n = sp->n; return ST_OK; }
    scratch->len = 0;
    TRY(put_text(scratch, sp));
    *s = scratch->d;
    *n = scratch->len;
    return ST_OK;
}

typedef struct { const uchar *s, *int_end, *e; char is_int; } Num;

static inline int is_digit(uchar c) { return c >= '0' && c <= '9'; }

static int scan_number(P *ps, Num *nm) {
    const uchar *q = ps->p, *e = ps->end;
    nm->s = q;
    if (*q == '-') q++;
    if (q >= e) return ST_NEED;
    if (*q == '0') q++;
    else if (*q >= '1' && *q <= '9') while (q < e && is_digit(*q)) q++;
    else return bad(ps, "bad number");
    nm->int_end = q;
    nm->is_int = 1;
    if (q >= e) return ST_NEED; /* a number inside an object or array is always followed by something */
    if (*q == '.') {
        nm->is_int = 0;
        if (++q >= e) return ST_NEED;
        if (!is_digit(*q)) return bad(ps, "bad number");
        while (q < e && is_digit(*q)) q++;
        if (q >= e) return ST_NEED;
    }
    if (*q == 'e' || *q == 'E') {
        nm->is_int = 0;
        if (++q >= e) return ST_NEED;
        if (*q == '+' || *q == '-') if (++q >= e) return ST_NEED;
        if (!is_digit(*q)) return bad(ps, "bad number");
        while (q < e && is_digit(*q)) q++;
        if (q >= e) return ST_NEED;
    }
    nm->e = q;
    ps->p = q;
    return ST_OK;
}

/* An integer literal's value; 0 when it does not fit an int64. */
static int int_value(const Num *nm, int64_t *out) {
    const uchar *q = nm->s;
    int neg = *q == '-';
    if (neg) q++;
    uint64_t v = 0;
    for (; q < nm->int_end; q++) {
        if (v > (UINT64_MAX - 9) / 10) return 0;
        v = v * 10 + (uint64_t)(*q - '0');
    }
    if (neg ? v > (uint64_t)INT64_MAX + 1 : v > (uint64_t)INT64_MAX) return 0;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return 1;
}

/* Microseconds (a JSON number) → nanoseconds, as the general decoder computes them (kineto.py _ts_ns, _dur_ns):
 * from the digits when there are at most three decimals (exact; float64 gives the same below 2**43 µs), and for
 * a ts at or above 2**43 µs (its decimals beyond the third are dropped); else from the float64, rounding half to
 * even like polars. Returns 0 (null) when the value does not fit. */
#define FLOAT_EXACT_US 8796093022208.0 /* 2**43 */
static int us_to_ns(const Num *nm, int is_ts, int64_t *out) {
    const uchar *q = nm->s;
    int neg = *q == '-';
    if (neg) q++;
    Py_ssize_t whole_digits = nm->int_end - q;
    const uchar *f = nm->int_end, *exp = nm->int_end;
    while (exp < nm->e && *exp != 'e' && *exp != 'E') exp++;
    Py_ssize_t frac_digits = exp > f ? exp - f - 1 : 0;
    if (exp == nm->e && whole_digits <= 16) {
        int64_t whole = 0, frac = 0;
        for (; q < nm->int_end; q++) whole = whole * 10 + (*q - '0');
        int k = 0;
        for (q = f + 1; q < exp && k < 3; q++, k++) frac = frac * 10 + (*q - '0');
        for (; k < 3; k++) frac *= 10;
        if ((frac_digits <= 3 && whole < (int64_t)FLOAT_EXACT_US) || (is_ts && whole >= (int64_t)FLOAT_EXACT_US)) {
            if (whole >= 9000000000000000LL) return 0;
            *out = neg ? -(whole * 1000 + frac) : whole * 1000 + frac;
            return 1;
        }
    }
    char tmp[64];
    Py_ssize_t n = nm->e - nm->s;
    if (n >= (Py_ssize_t)sizeof tmp) return 0;
    memcpy(tmp, nm->s, (size_t)n);
    tmp[n] = 0;
    double x = strtod(tmp, NULL), y;
    if (is_ts && fabs(x) < FLOAT_EXACT_US) {
        double fl = floor(x);
        *out = (int64_t)fl * 1000 + (int64_t)rint((x - fl) * 1000.0);
        return 1;
    }
    if (!isfinite(x) || fabs(x) >= (is_ts ? 9.0e15 : 9.0e15)) return 0;
    y = rint(x * 1000.0);
    *out = (int64_t)y;
    return 1;
}

static int literal(P *ps, const char *word, Py_ssize_t n) {
    if (ps->end - ps->p < n) {
        if (memcmp(ps->p, word, (size_t)(ps->end - ps->p))) return bad(ps, "bad literal");
        return ST_NEED;
    }
    if (memcmp(ps->p, word, (size_t)n)) return bad(ps, "bad literal");
    ps->p += n;
    return ST_OK;
}

static int skip_value(P *ps, int depth);

static int skip_container(P *ps, int depth) {
    uchar close = *ps->p == '{' ? '}' : ']';
    int obj = close == '}';
    if (depth > MAX_DEPTH) return bad(ps, "nested too deeply");
    ps->p++;
    ws(ps);
    if (ps->p >= ps->end) return ST_NEED;
    if (*ps->p == close) { ps->p++; return ST_OK; }
    for (;;) {
        if (obj) {
            Span k;
            if (*ps->p != '"') return bad(ps, "expected a key");
            TRY(scan_string(ps, &k));
            ws(ps);
            if (ps->p >= ps->end) return ST_NEED;
            if (*ps->p != ':') return bad(ps, "expected ':'");
            ps->p++;
            ws(ps);
            if (ps->p >= ps->end) return ST_NEED;
        }
        TRY(skip_value(ps, depth + 1));
        ws(ps);
        if (ps->p >= ps->end) return ST_NEED;
        if (*ps->p == close) { ps->p++; return ST_OK; }
        if (*ps->p != ',') return bad(ps, "expected ',' or a closing bracket");
        ps->p++;
        ws(ps);
        if (ps->p >= ps->end) return ST_NEED;
    }
}

/* ps->p is at a value (not whitespace, not the end). */
static int skip_value(P *ps, int depth) {
    Span sp;
    Num nm;
    const uchar *p = ps->p;
    switch (*p) {
    case '"':
        if (ps->end - p >= 2 && p[1] == '"') { ps->p = p + 2; return ST_OK; } /* "" (record_shapes lists are full of them) */
        return scan_string(ps, &sp);
    case '[':
        if (depth <= MAX_DEPTH && ps->end - p >= 2 && p[1] == ']') { ps->p = p + 2; return ST_OK; } /* [] */
        return skip_container(ps, depth);
    case '{': return skip_container(ps, depth);
    case 't': return literal(ps, "true", 4);
    case 'f': return literal(ps, "false", 5);
    case 'n': return literal(ps, "null", 4);
    default:
        if (*ps->p == '-' || is_digit(*ps->p)) return scan_number(ps, &nm);
        return bad(ps, "unexpected character");
    }
}

#define PREDICT_SLOTS 1024
#define PREDICT_WAYS 4
#define RECENT_WAYS 4
#define UNREAD_SLOTS 256
#define UNREAD_MAX 32
/* The distinct values of a text column across a file (dictionary encoding: an event holds a code; a kernel's name of
 * hundreds of bytes is stored once, not once per event): an open-addressing table of codes into ``col``, and a flag
 * byte per value (F_*), decided once when the value is first seen. */
enum { D_NAME, D_CAT, D_PID, D_TID, N_D };
enum { F_GPU = 1, F_COMM = 2, F_SHAPED = 4, F_PLAIN = 8, F_INT = 16 };
/* F_PLAIN: a JSON string of it can be its bytes as they are; F_INT: its bytes are a JSON integer literal */
typedef struct { int32_t *slots; uint64_t *hashes; Py_ssize_t cap, n; Col col; Buf flags; int32_t last; } Dict;

/* The X events' columns, kept by the Scanner across events() calls: one buffer per column per file (no batches to
 * concatenate), taken by take(). track: a code into the file's tracks (below). */
enum { X_NAME, X_CAT, X_PID, X_TID, X_TS, X_DUR, X_CORR, X_EXT, X_TRACK, N_X };
static const char X_FMT[N_X] = {'i', 'i', 'i', 'i', 'l', 'l', 'l', 'l', 'i'};
static const char *const X_NAMES[N_X] = {"name", "cat", "pid", "tid", "ts_rel", "dur_ns", "corr_id", "ext_id",
                                         "track"};

/* A track: what an X event's device, stream and track text are a function of (kineto.py ``_finish`` derives them
 * once per track): a GPU-stream category or not, the device and stream args of a GPU event (ok: the arg is an
 * integer), and the pid and tid codes (-1: absent). */
typedef struct { int64_t dev, stream; int32_t pid, tid; int8_t gpu, dev_ok, stream_ok, pad; } TrackKey;
enum { K_GPU, K_DEVICE, K_STREAM, K_PID, K_TID, N_K };
static const char K_FMT[N_K] = {'i', 'l', 'l', 'i', 'i'};
static const char *const K_NAMES[N_K] = {"is_gpu", "arg_device", "arg_stream", "pid", "tid"};
typedef struct { int32_t *slots; TrackKey *keys; Py_ssize_t cap, n; int32_t last; } Tracks;

/* Byte strings given by Python (kineto.py holds the names; they are not repeated here). */
typedef struct { char **s; Py_ssize_t *n; Py_ssize_t count; } Words;

typedef struct {
    PyObject_HEAD
    Dict d[N_D];
    Col x[N_X];
    Tracks tracks;
    int tracks_odd; /* some GPU event's device or stream arg is not an integer: its track is left to Python */
    Words gpu_cats, comm_names, shaped_names, shaped_prefixes;
    int busy;
    /* The names seen, by their first 8 bytes as written (a kernel's name is hundreds of bytes; its first 8 nearly
     * always tell it from the other names seen): a few codes + 1 per bucket (0: none), latest first. A name found
     * there is checked against its text and taken without scanning or hashing it. */
    int32_t names_by_head[PREDICT_SLOTS][PREDICT_WAYS];
    int32_t recent[N_D][RECENT_WAYS]; /* the categories, pids and tids seen last: codes + 1, latest first */
    /* args keys ingest does not read, as written (kernels carry a dozen): one per slot, by their first bytes */
    uchar unread[UNREAD_SLOTS][UNREAD_MAX];
    uint8_t unread_len[UNREAD_SLOTS]; /* 0: empty */
} Scanner;

static inline size_t unread_slot(const uchar *p) { /* p: the key's opening quote, with 3 bytes after it */
    return ((size_t)p[1] * 961 + (size_t)p[2] * 31 + (size_t)p[3]) & (UNREAD_SLOTS - 1);
}

static inline int64_t head_key(const uchar *q, const uchar *e) { /* -1: fewer than 8 bytes left */
    if (e - q < 8) return -1;
    uint64_t w;
    memcpy(&w, q, 8);
    w *= 0x9E3779B97F4A7C15ULL;
    return (int64_t)((w >> 40) & (PREDICT_SLOTS - 1));
}

/* Whether the JSON string starting after its quote at q is exactly value ``c`` of t, written as its plain bytes
 * (a value of F_PLAIN has no quote, backslash or control byte, and is valid UTF-8: so these bytes followed by a
 * quote are a valid JSON string of that value). *n: its length. */
static inline int plain_match(const Dict *t, int32_t c, const uchar *q, const uchar *e, Py_ssize_t *n) {
    if (c < 0 || c >= t->n || !(t->flags.d[c] & F_PLAIN)) return 0;
    const int64_t *offs = (const int64_t *)t->col.offs.d;
    Py_ssize_t len = (Py_ssize_t)(offs[c + 1] - offs[c]);
    if (e - q <= len || q[len] != '"' || memcmp(q, t->col.data.d + offs[c], (size_t)len)) return 0;
    *n = len;
    return 1;
}

/* The name string at ps->p ('"') when it is a name seen before, written plainly: taken without scanning or hashing
 * it. *key: its bucket (head_key), for name_seen. */
static inline int known_name(Scanner *sc, P *ps, Span *sp, int32_t *code, int32_t *key) {
    const Dict *t = &sc->d[D_NAME];
    const uchar *q = ps->p + 1;
    int64_t k = head_key(q, ps->end);
    *key = (int32_t)k;
    if (k < 0) return 0;
    const int32_t *way = sc->names_by_head[k];
    for (int i = 0; i < PREDICT_WAYS && way[i]; i++) {
        Py_ssize_t n;
        if (plain_match(t, way[i] - 1, q, ps->end, &n)) {
            sp->s = q;
            sp->n = n;
            sp->esc = 0;
            sp->kind = K_STR;
            ps->p = q + n + 1;
            *code = way[i] - 1;
            return 1;
        }
    }
    return 0;
}

static inline int same_bytes(const uchar *a, const char *b, Py_ssize_t n) { /* memcmp without a call when short */
    if (n > 16) return !memcmp(a, b, (size_t)n);
    for (Py_ssize_t i = 0; i < n; i++)
        if (a[i] != (uchar)b[i]) return 0;
    return 1;
}

/* The category, pid or tid at ps->p when it is one seen last, written plainly (a string), or as the same integer
 * literal (a number: pid and tid): taken without scanning or interning it. */
static inline int known_value(Scanner *sc, int which, P *ps, Span *sp, int32_t *code) {
    const Dict *t = &sc->d[which];
    const uchar *p = ps->p, *e = ps->end;
    int str = *p == '"';
    if (!str && (which == D_CAT || !(*p == '-' || is_digit(*p)))) return 0;
    const uchar *q = p + str;
    const int64_t *offs = (const int64_t *)t->col.offs.d;
    const int32_t *r = sc->recent[which];
    for (int i = 0; i < RECENT_WAYS && r[i]; i++) {
        int32_t c = r[i] - 1;
        if (!(t->flags.d[c] & (str ? F_PLAIN : F_INT))) continue;
        Py_ssize_t len = (Py_ssize_t)(offs[c + 1] - offs[c]);
        if (e - q <= len) continue;
        uchar next = q[len];
        if (str ? next != '"' : (is_digit(next) || next == '.' || next == 'e' || next == 'E')) continue;
        if (!same_bytes(q, t->col.data.d + offs[c], len)) continue;
        sp->s = q;
        sp->n = len;
        sp->esc = 0;
        sp->kind = str ? K_STR : K_INT;
        ps->p = q + len + str;
        *code = c;
        return 1;
    }
    return 0;
}

/* ``code`` put first among the ``ways`` codes (stored + 1, 0 empty) of a small most-recent-first list. */
static inline void to_front(int32_t *way, int ways, int32_t code) {
    if (way[0] == code + 1) return;
    int i = 0;
    while (i < ways - 1 && way[i] != code + 1) i++;
    for (; i > 0; i--) way[i] = way[i - 1];
    way[0] = code + 1;
}

static inline void value_seen(Scanner *sc, int which, int32_t code) {
    to_front(sc->recent[which], RECENT_WAYS, code);
}

/* An X event's name: its code put first in its bucket. */
static inline void name_seen(Scanner *sc, int32_t key, int32_t code) {
    if (key < 0 || !(sc->d[D_NAME].flags.d[code] & F_PLAIN)) return;
    to_front(sc->names_by_head[key], PREDICT_WAYS, code);
}



/* --- one event ---------------------------------------------------------------------------------------------- */
/* An args value of the expected type, or an "odd" one (a string or float where an int is expected, a number where
 * a string is): its raw JSON is handed to Python, which converts it exactly as the general decoder does. */
typedef struct { int64_t v; char ok; const uchar *odd_s, *odd_e; } IntV;

enum { A_CORR, A_EXT, A_DEVICE, A_STREAM, A_TOTAL, A_BYTES, A_DEVID, A_ADDR, A_NELEMS, A_SRC, A_DST, N_AINT };
enum { S_COLL, S_DTYPE, S_PGN, S_PGD, N_ASTR };
enum { R_CONCRETE, R_DIMS, R_TYPES, N_RAW };

typedef struct {
    Span ph, name, cat, pid, tid;
    IntV ts, dur;
    IntV a[N_AINT];
    Span s[N_ASTR];
    const uchar *raw_s[N_RAW], *raw_e[N_RAW];
    int32_t name_code; /* the name's code when it was known (known_name), else -1 */
    int32_t name_key;  /* its bucket in names_by_head (-1: none) */
    int32_t code[N_D]; /* cat, pid, tid: the code when known (known_value), else -1 */
} Ev;

/* The args keys read, by slot: ints, then strings (ARG_STR + i), then raw values (ARG_RAW + i). */
enum { ARG_STR = 32, ARG_RAW = 64 };
#define ARG(key, slot) {key, sizeof key - 1, slot}
static const struct { const char *key; Py_ssize_t len; int slot; } ARG_KEYS[] = {
    ARG("correlation", A_CORR), ARG("External id", A_EXT), ARG("device", A_DEVICE), ARG("stream", A_STREAM),
    ARG("Total Allocated", A_TOTAL), ARG("Bytes", A_BYTES), ARG("Device Id", A_DEVID), ARG("Addr", A_ADDR),
    ARG("In msg nelems", A_NELEMS), ARG("Src Rank", A_SRC), ARG("Dst Rank", A_DST),
    ARG("Collective name", ARG_STR + S_COLL), ARG("dtype", ARG_STR + S_DTYPE),
    ARG("Process Group Name", ARG_STR + S_PGN), ARG("Process Group Description", ARG_STR + S_PGD),
    ARG("Concrete Inputs", ARG_RAW + R_CONCRETE), ARG("Input Dims", ARG_RAW + R_DIMS),
    ARG("Input type", ARG_RAW + R_TYPES),
};

static uint64_t arg_lengths; /* bit n: some key read is n bytes long (set at module init) */

static int arg_slot(const char *k, Py_ssize_t n) { /* -1: a key ingest does not read */
    if (n >= 64 || !((arg_lengths >> n) & 1)) return -1; /* most args keys (kernels have a dozen) end here */
    for (size_t i = 0; i < sizeof ARG_KEYS / sizeof ARG_KEYS[0]; i++)
        if (ARG_KEYS[i].len == n && k[0] == ARG_KEYS[i].key[0] && !memcmp(k, ARG_KEYS[i].key, (size_t)n))
            return ARG_KEYS[i].slot;
    return -1;
}

/* The ':' after a key and the whitespace around it (ps->p just after the key's closing quote). */
static inline int after_key(P *ps) {
    ws(ps);
    if (ps->p >= ps->end) return ST_NEED;
    if (*ps->p != ':') return bad(ps, "expected ':'");
    ps->p++;
    ws(ps);
    if (ps->p >= ps->end) return ST_NEED;
    return ST_OK;
}

/* A key at ps->p, decoded into scratch; then the ':' and whitespace after it. */
static int scan_key(P *ps, Buf *scratch, const char **s, Py_ssize_t *n) {
    Span k;
    if (*ps->p != '"') return bad(ps, "expected a key");
    TRY(scan_string(ps, &k));
    TRY(text_of(&k, scratch, s, n));
    return after_key(ps);
}

static inline int is_key(const char *s, Py_ssize_t n, const char *key) {
    return (Py_ssize_t)strlen(key) == n && memcmp(s, key, (size_t)n) == 0;
}

/* Then ',' (→ loop again) or the closing brace (→ *done). */
static int next_member(P *ps, int *done) {
    ws(ps);
    if (ps->p >= ps->end) return ST_NEED;
    if (*ps->p == '}') { ps->p++; *done = 1; return ST_OK; }
    if (*ps->p != ',') return bad(ps, "expected ',' or '}'");
    ps->p++;
    ws(ps);
    if (ps->p >= ps->end) return ST_NEED;
    return ST_OK;
}

/* How many of the 8 bytes at q are digits before the first that is not (0-8). A byte is a digit when its high nibble
 * is 3 and adding 6 keeps it so; a carry out of a byte only reaches bytes after the first non-digit. */
static inline uint64_t load_le64(const uchar *q) {
    uint64_t x;
    memcpy(&x, q, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    x = __builtin_bswap64(x);
#endif
    return x;
}

static inline int digits8(const uchar *q) {
    uint64_t x = load_le64(q);
    uint64_t hi = 0xF0F0F0F0F0F0F0F0ULL, three = 0x3030303030303030ULL;
    uint64_t not_digit = ((x & hi) ^ three) | (((x + 0x0606060606060606ULL) & hi) ^ three);
    return not_digit ? __builtin_ctzll(not_digit) >> 3 : 8;
}

/* The value of 8 digits at q (little-endian bytes: the first digit lowest). */
static inline uint64_t parse8(const uchar *q) {
    uint64_t x = load_le64(q);
    x = ((x & 0x0F0F0F0F0F0F0F0FULL) * 2561) >> 8;
    x = ((x & 0x00FF00FF00FF00FFULL) * 6553601) >> 16;
    return ((x & 0x0000FFFF0000FFFFULL) * 42949672960001ULL) >> 32;
}

/* The common number in one pass: an optional '-', an integer part of at most 16 digits without a leading zero
 * (or "0"), then at most ``max_frac`` decimals (none when 0) and no exponent, followed by a byte that is not part of
 * a number. *whole, *frac (the decimals as thousandths) and *end then say what it is; 0 when it is anything else (a
 * longer number, an exponent, the buffer's end): the caller goes the general way (scan_number), from the start. */
static inline int quick_number(const uchar *q, const uchar *e, int max_frac, int *neg, int64_t *whole, int64_t *frac,
                               const uchar **end) {
    if (e - q < 20 + max_frac) return 0; /* every read below stays inside the buffer (at most 19 + max_frac on) */
    *neg = *q == '-';
    q += *neg;
    int64_t w = 0, f = 0;
    if (*q == '0') {
        q++;
    } else { /* 8 digits a step (SWAR) */
        int c = digits8(q);
        if (c == 0) return 0;
        if (c == 8) {
            w = (int64_t)parse8(q);
            q += 8;
            c = digits8(q);
            if (c == 8) {
                w = w * 100000000 + (int64_t)parse8(q);
                q += 8;
                if (is_digit(*q)) return 0; /* a 17th digit */
                c = 0;
            }
        }
        for (int i = 0; i < c; i++) w = w * 10 + (*q++ - '0');
    }
    int k = 0;
    if (*q == '.') {
        if (!max_frac || !is_digit(q[1])) return 0;
        q++;
        while (k <= max_frac && is_digit(*q)) { f = f * 10 + (*q++ - '0'); k++; }
        if (k > max_frac) return 0;
    }
    if (is_digit(*q) || *q == '.' || *q == 'e' || *q == 'E') return 0;
    for (; k < 3; k++) f *= 10;
    *whole = w;
    *frac = f;
    *end = q;
    return 1;
}

static int int_field(P *ps, IntV *out) {
    Num nm;
    Span sp;
    out->ok = 0;
    out->odd_s = NULL;
    if (*ps->p == 'n') return literal(ps, "null", 4);
    if (*ps->p == '"') {
        out->odd_s = ps->p;
        TRY(scan_string(ps, &sp));
        out->odd_e = ps->p;
        return ST_OK;
    }
    int neg;
    int64_t whole, frac;
    const uchar *end;
    if (quick_number(ps->p, ps->end, 0, &neg, &whole, &frac, &end)) { /* an integer of at most 16 digits */
        out->v = neg ? -whole : whole;
        out->ok = 1;
        ps->p = end;
        return ST_OK;
    }
    if (*ps->p != '-' && !is_digit(*ps->p)) return bad(ps, "an args value of another type than number or string");
    TRY(scan_number(ps, &nm));
    if (nm.is_int && int_value(&nm, &out->v)) {
        out->ok = 1;
    } else {
        out->odd_s = nm.s;
        out->odd_e = nm.e;
    }
    return ST_OK;
}

static int str_field(P *ps, Span *out, int null_ok) {
    if (*ps->p == 'n' && null_ok) { TRY(literal(ps, "null", 4)); out->kind = K_NULL; return ST_OK; }
    if (*ps->p != '"') return bad(ps, "a field of another type than string");
    return scan_string(ps, out);
}


static int time_field(P *ps, IntV *out, int is_ts) {
    Num nm;
    int neg;
    int64_t whole, frac;
    const uchar *end;
    /* the exact path of us_to_ns: at most three decimals and a value below 2**43 µs, or a ts below 9e15 µs (Kineto's
     * epoch µs: 16 digits) */
    if (quick_number(ps->p, ps->end, 3, &neg, &whole, &frac, &end) &&
        (whole < (int64_t)FLOAT_EXACT_US || (is_ts && whole < 9000000000000000LL))) {
        out->v = neg ? -(whole * 1000 + frac) : whole * 1000 + frac;
        out->ok = 1;
        ps->p = end;
        return ST_OK;
    }
    if (*ps->p == 'n') { TRY(literal(ps, "null", 4)); out->ok = 0; return ST_OK; }
    if (*ps->p != '-' && !is_digit(*ps->p)) return bad(ps, "ts or dur of another type than number");
    TRY(scan_number(ps, &nm));
    out->ok = (char)us_to_ns(&nm, is_ts, &out->v);
    return ST_OK;
}

/* A string, null, or a number kept as its literal text with kind ``number_kind`` (K_INT: pid and tid, which
 * must be integers; K_ODD: a number where an args string is expected, converted in Python). */
static int text_or_number(P *ps, Span *out, char number_kind) {
    Num nm;
    if (*ps->p == '-' || is_digit(*ps->p)) {
        TRY(scan_number(ps, &nm));
        if (number_kind == K_INT && !nm.is_int) return bad(ps, "pid or tid of another type than int or string");
        out->s = nm.s;
        out->n = nm.e - nm.s;
        out->esc = 0;
        out->kind = number_kind;
        return ST_OK;
    }
    return str_field(ps, out, 1);
}

/* '{' at ps->p and the whitespace after it; *done when '}' closes the object at once. */
static int open_object(P *ps, const char *not_an_object, int *done) {
    if (*ps->p != '{') return bad(ps, not_an_object);
    ps->p++;
    ws(ps);
    if (ps->p >= ps->end) return ST_NEED;
    *done = *ps->p == '}';
    if (*done) ps->p++;
    return ST_OK;
}

/* Whether the key at p is the literal ``quoted`` (the key's text between quotes, written as is): then its raw bytes
 * are the key with nothing to scan or decode. Any other spelling (an escape) goes the general way. */
static inline int key_is(const uchar *p, const uchar *e, const char *quoted, Py_ssize_t n) {
    return e - p > n && !memcmp(p, quoted, (size_t)n);
}

#define ARG_FIRST_MAX 4
static int8_t arg_first[256][ARG_FIRST_MAX]; /* the ARG_KEYS starting with each byte, -1 after the last (module init) */

/* The slot of the args key at ps->p when it is one of ARG_KEYS written plainly (ps->p moved past it), else -2
 * (ps->p unmoved: scan the key the general way). */
static inline int quick_arg_slot(P *ps) {
    const uchar *p = ps->p, *e = ps->end;
    if (e - p < 2) return -2;
    const int8_t *cand = arg_first[p[1]];
    for (int j = 0; j < ARG_FIRST_MAX && cand[j] >= 0; j++) {
        int i = cand[j];
        Py_ssize_t n = ARG_KEYS[i].len;
        if (e - p > n + 2 && p[n + 1] == '"' && !memcmp(p + 1, ARG_KEYS[i].key, (size_t)n)) {
            ps->p = p + n + 2;
            return ARG_KEYS[i].slot;
        }
    }
    return -2;
}

static int parse_args(P *ps, Ev *ev, Buf *scratch, Scanner *sc, int depth) {
    int done;
    TRY(open_object(ps, "args is not an object", &done));
    while (!done) {
        const char *k;
        Py_ssize_t kn;
        const uchar *kp = ps->p;
        int slot = *kp == '"' ? quick_arg_slot(ps) : -2;
        if (slot == -2 && *kp == '"' && ps->end - kp > UNREAD_MAX + 1) { /* a key not read, seen before? */
            size_t u = unread_slot(kp);
            Py_ssize_t n = sc->unread_len[u];
            if (n && kp[n + 1] == '"' && !memcmp(kp + 1, sc->unread[u], (size_t)n)) {
                ps->p = kp + n + 2;
                slot = -1;
            }
        }
        if (slot == -2) {
            TRY(scan_key(ps, scratch, &k, &kn));
            slot = arg_slot(k, kn);
            /* remembered when written plainly (the raw bytes are the key: no escape) */
            if (slot < 0 && kn > 0 && kn < UNREAD_MAX && ps->end - kp > UNREAD_MAX + 1 && kp[kn + 1] == '"' &&
                !memcmp(kp + 1, k, (size_t)kn)) {
                size_t u = unread_slot(kp);
                memcpy(sc->unread[u], k, (size_t)kn);
                sc->unread_len[u] = (uint8_t)kn;
            }
        } else {
            TRY(after_key(ps));
        }
        if (slot < 0) {
            TRY(skip_value(ps, depth + 1));
        } else if (slot < ARG_STR) {
            TRY(int_field(ps, &ev->a[slot]));
        } else if (slot < ARG_RAW) {
            TRY(text_or_number(ps, &ev->s[slot - ARG_STR], K_ODD));
        } else {
            ev->raw_s[slot - ARG_RAW] = ps->p;
            TRY(skip_value(ps, depth + 1));
            ev->raw_e[slot - ARG_RAW] = ps->p;
        }
        TRY(next_member(ps, &done));
    }
    return ST_OK;
}

/* What emit() reads of an event that lacks a field: absent spans, null values, no raw lists (cheaper than zeroing
 * the whole Ev, which was a fifth of the scanner's own time). */
static inline void ev_reset(Ev *ev) {
    ev->ph.kind = ev->name.kind = ev->cat.kind = ev->pid.kind = ev->tid.kind = K_ABSENT;
    ev->ts.ok = ev->dur.ok = 0;
    ev->ts.odd_s = ev->dur.odd_s = NULL;
    for (int i = 0; i < N_AINT; i++) { ev->a[i].ok = 0; ev->a[i].odd_s = NULL; }
    for (int i = 0; i < N_ASTR; i++) ev->s[i].kind = K_ABSENT;
    for (int i = 0; i < N_RAW; i++) ev->raw_s[i] = ev->raw_e[i] = NULL;
    ev->name_code = ev->name_key = -1;
    ev->code[D_CAT] = ev->code[D_PID] = ev->code[D_TID] = -1;
}

static int parse_event(P *ps, Ev *ev, Buf *scratch, Scanner *sc) {
    int done;
    ev_reset(ev);
    TRY(open_object(ps, "an event that is not an object", &done));
    while (!done) {
        const char *k;
        Py_ssize_t kn;
        /* The keys torch writes, as they are written: matched on their raw bytes, closing quote included. */
        const uchar *p = ps->p, *e = ps->end;
        int f = -1;
        switch (e - p > 1 && p[0] == '"' ? p[1] : 0) {
        case 'p':
            if (key_is(p, e, "\"ph\"", 4)) f = 0, ps->p += 4;
            else if (key_is(p, e, "\"pid\"", 5)) f = 1, ps->p += 5;
            break;
        case 't':
            if (key_is(p, e, "\"ts\"", 4)) f = 2, ps->p += 4;
            else if (key_is(p, e, "\"tid\"", 5)) f = 3, ps->p += 5;
            break;
        case 'c': if (key_is(p, e, "\"cat\"", 5)) f = 4, ps->p += 5; break;
        case 'd': if (key_is(p, e, "\"dur\"", 5)) f = 5, ps->p += 5; break;
        case 'n': if (key_is(p, e, "\"name\"", 6)) f = 6, ps->p += 6; break;
        case 'a': if (key_is(p, e, "\"args\"", 6)) f = 7, ps->p += 6; break;
        }
        if (f >= 0) {
            TRY(after_key(ps));
            switch (f) {
            case 0: TRY(str_field(ps, &ev->ph, 0)); break;
            case 1:
                ev->code[D_PID] = -1;
                if (!known_value(sc, D_PID, ps, &ev->pid, &ev->code[D_PID])) TRY(text_or_number(ps, &ev->pid, K_INT));
                break;
            case 2: TRY(time_field(ps, &ev->ts, 1)); break;
            case 3:
                ev->code[D_TID] = -1;
                if (!known_value(sc, D_TID, ps, &ev->tid, &ev->code[D_TID])) TRY(text_or_number(ps, &ev->tid, K_INT));
                break;
            case 4:
                ev->code[D_CAT] = -1;
                if (!known_value(sc, D_CAT, ps, &ev->cat, &ev->code[D_CAT])) TRY(str_field(ps, &ev->cat, 1));
                break;
            case 5: TRY(time_field(ps, &ev->dur, 0)); break;
            case 6:
                ev->name_code = ev->name_key = -1; /* a repeated key: the last one counts */
                if (*ps->p == '"' && known_name(sc, ps, &ev->name, &ev->name_code, &ev->name_key)) break;
                TRY(str_field(ps, &ev->name, 0));
                break;
            default: TRY(parse_args(ps, ev, scratch, sc, 1)); break;
            }
            TRY(next_member(ps, &done));
            continue;
        }
        TRY(scan_key(ps, scratch, &k, &kn));
        switch (kn) {
        case 2:
            if (!memcmp(k, "ph", 2)) { TRY(str_field(ps, &ev->ph, 0)); break; }
            if (!memcmp(k, "ts", 2)) { TRY(time_field(ps, &ev->ts, 1)); break; }
            TRY(skip_value(ps, 1));
            break;
        case 3:
            if (!memcmp(k, "cat", 3)) { ev->code[D_CAT] = -1; TRY(str_field(ps, &ev->cat, 1)); break; }
            if (!memcmp(k, "pid", 3)) { ev->code[D_PID] = -1; TRY(text_or_number(ps, &ev->pid, K_INT)); break; }
            if (!memcmp(k, "tid", 3)) { ev->code[D_TID] = -1; TRY(text_or_number(ps, &ev->tid, K_INT)); break; }
            if (!memcmp(k, "dur", 3)) { TRY(time_field(ps, &ev->dur, 0)); break; }
            TRY(skip_value(ps, 1));
            break;
        case 4:
            if (!memcmp(k, "name", 4)) { ev->name_code = ev->name_key = -1; TRY(str_field(ps, &ev->name, 0)); break; }
            if (!memcmp(k, "args", 4)) { TRY(parse_args(ps, ev, scratch, sc, 1)); break; }
            TRY(skip_value(ps, 1));
            break;
        default:
            TRY(skip_value(ps, 1));
        }
        TRY(next_member(ps, &done));
    }
    return ST_OK;
}

/* --- emitting rows -------------------------------------------------------------------------------------------- */
/* Five tables per call, each a Batch:
 *   X (every complete event): name, cat, pid, tid as int32 codes into the file's dictionaries (below), ts, dur and the
 *     two ids as int64;
 *   M (each [memory] instant): its time and four args (the block's address: traceana.memory pairs a block's
 *     allocation with its free by it);
 *   G (X events whose cat is a GPU stream's): the X row, args device and stream;
 *   C (X events named as a communication op, record_param_comms): the X row and its collective args;
 *   S (X events named as gloo P2P ops): the X row and their record_shapes lists as JSON text.
 * Rows of X are numbered across calls (the file's whole table), so G, C and S point into it. */
enum { M_TS, M_TOTAL, M_BYTES, M_DEVID, M_ADDR, N_M };
static const char M_FMT[N_M] = {'l', 'l', 'l', 'l', 'l'};
static const char *const M_NAMES[N_M] = {"ts_rel", "allocated_bytes", "delta_bytes", "device", "addr"};
enum { G_ROW, G_DEVICE, G_STREAM, N_G };
static const char G_FMT[N_G] = {'l', 'l', 'l'};
static const char *const G_NAMES[N_G] = {"row", "arg_device", "arg_stream"};
enum { C_ROW, C_COLL, C_NELEMS, C_DTYPE, C_SRC, C_DST, C_PGN, C_PGD, N_C };
static const char C_FMT[N_C] = {'l', 'U', 'l', 'U', 'l', 'l', 'U', 'U'};
static const char *const C_NAMES[N_C] = {"row", "coll", "in_nelems", "dtype", "src_rank", "dst_rank", "pg_name",
                                         "pg_desc"};
enum { S_ROW, S_CONCRETE, S_DIMS, S_TYPES, N_S };
static const char S_FMT[N_S] = {'l', 'U', 'U', 'U'};
static const char *const S_NAMES[N_S] = {"row", "concrete_inputs", "input_dims", "input_type"};
enum { T_X, T_M, T_G, T_C, N_T }; /* tables an odd value can be in */
static const char *const DICT_NAMES[1] = {"value"};

typedef struct { int32_t table, col; int64_t row; const uchar *s, *e; } Odd;

typedef struct { Col m[N_M], g[N_G], c[N_C], s[N_S]; Buf scratch, scratch2, odd; } Out; /* one call's tables */

static inline uint64_t hash_bytes(const char *s, Py_ssize_t n) { /* two lanes of 8 bytes a step, then a mix */
    uint64_t a = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n, b = 0xC2B2AE3D27D4EB4FULL, w, v;
    for (; n >= 16; s += 16, n -= 16) {
        memcpy(&w, s, 8);
        memcpy(&v, s + 8, 8);
        a = (a ^ w) * 0xff51afd7ed558ccdULL;
        b = (b ^ v) * 0xc4ceb9fe1a85ec53ULL;
        a ^= a >> 32;
        b ^= b >> 29;
    }
    if (n >= 8) {
        memcpy(&w, s, 8);
        a = (a ^ w) * 0xff51afd7ed558ccdULL;
        a ^= a >> 32;
        s += 8;
        n -= 8;
    }
    if (n) {
        w = 0;
        memcpy(&w, s, (size_t)n);
        b = (b ^ w) * 0xc4ceb9fe1a85ec53ULL;
    }
    uint64_t h = a ^ (b * 0x9E3779B97F4A7C15ULL);
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    return h ^ (h >> 33);
}

static int dict_grow(Dict *t) {
    Py_ssize_t cap = t->cap ? t->cap * 2 : 64;
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)cap);
    uint64_t *hashes = realloc(t->hashes, sizeof(uint64_t) * (size_t)(cap / 2));
    if (!slots || !hashes) { free(slots); if (hashes) t->hashes = hashes; return ST_NOMEM; }
    memset(slots, 0xff, sizeof(int32_t) * (size_t)cap); /* -1: empty */
    for (Py_ssize_t c = 0; c < t->n; c++) {
        size_t i = (size_t)hashes[c] & (size_t)(cap - 1);
        while (slots[i] >= 0) i = (i + 1) & (size_t)(cap - 1);
        slots[i] = (int32_t)c;
    }
    free(t->slots);
    t->slots = slots;
    t->hashes = hashes;
    t->cap = cap;
    return ST_OK;
}

static int in_words(const Words *w, const char *s, Py_ssize_t n, int prefix) {
    for (Py_ssize_t i = 0; i < w->count; i++)
        if ((prefix ? n >= w->n[i] : n == w->n[i]) && !memcmp(s, w->s[i], (size_t)w->n[i])) return 1;
    return 0;
}

static unsigned char flags_of(const Scanner *sc, int which, const char *s, Py_ssize_t n) {
    if (which == D_CAT) return in_words(&sc->gpu_cats, s, n, 0) ? F_GPU : 0;
    if (which != D_NAME) return 0;
    return (unsigned char)((in_words(&sc->comm_names, s, n, 0) ? F_COMM : 0) |
                           (in_words(&sc->shaped_names, s, n, 0) || in_words(&sc->shaped_prefixes, s, n, 1) ? F_SHAPED
                                                                                                              : 0));
}

/* The code of s[0:n] in dictionary ``which``, adding it when new; *flags: its F_* flags. */
static int intern(Scanner *sc, int which, const char *s, Py_ssize_t n, int32_t *code, unsigned char *flags) {
    Dict *t = &sc->d[which];
    const int64_t *offs = (const int64_t *)t->col.offs.d;
    int32_t c = t->last; /* consecutive events mostly share their thread and category: no hash needed */
    if (c < t->n && offs[c + 1] - offs[c] == n && !memcmp(t->col.data.d + offs[c], s, (size_t)n)) {
        *code = c;
        *flags = (unsigned char)t->flags.d[c];
        return ST_OK;
    }
    if ((t->n + 1) * 2 > t->cap) TRY(dict_grow(t));
    uint64_t h = hash_bytes(s, n);
    size_t mask = (size_t)(t->cap - 1), i = (size_t)h & mask;
    for (;; i = (i + 1) & mask) {
        c = t->slots[i];
        if (c < 0) break;
        if (t->hashes[c] == h && offs[c + 1] - offs[c] == n && !memcmp(t->col.data.d + offs[c], s, (size_t)n)) {
            *code = t->last = c;
            *flags = (unsigned char)t->flags.d[c];
            return ST_OK;
        }
    }
    if (t->n >= INT32_MAX) return ST_NOMEM;
    unsigned char f = flags_of(sc, which, s, n);
    Py_ssize_t k = 0;
    while (k < n && (uchar)s[k] >= 0x20 && s[k] != '"' && s[k] != '\\') k++;
    if (k == n) f |= F_PLAIN;
    k = n && s[0] == '-';
    if (k < n && (s[k] == '0' ? k + 1 == n : s[k] >= '1' && s[k] <= '9')) {
        while (k < n && is_digit((uchar)s[k])) k++;
        if (k == n) f |= F_INT;
    }
    TRY(buf_put(&t->col.data, s, n));
    TRY(col_str_end(&t->col, 1));
    TRY(buf_put(&t->flags, &f, 1));
    t->hashes[t->n] = h;
    t->slots[i] = (int32_t)t->n;
    *code = t->last = (int32_t)t->n++;
    *flags = f;
    return ST_OK;
}

static inline int put_int(Out *o, Col *cols, int table, int col, const IntV *v) {
    Col *c = &cols[col];
    if (v->odd_s) {
        Odd d = {table, col, c->n, v->odd_s, v->odd_e};
        TRY(buf_put(&o->odd, &d, sizeof d));
    }
    return col_int(c, v->v, v->ok);
}

static int put_span(Col *c, const Span *sp) {
    if (sp->kind == K_STR || sp->kind == K_INT) {
        TRY(put_text(&c->data, sp));
        return col_str_end(c, 1);
    }
    return col_str_end(c, 0);
}

/* A text field (string, or a number's literal for pid/tid) as its code in dictionary ``which``; null when absent.
 * *out: the code, -1 when absent. */
static int put_code(Scanner *sc, Out *o, int which, Col *c, const Span *sp, int32_t known, unsigned char *flags,
                    int32_t *out) {
    *flags = 0;
    *out = -1;
    if (sp->kind != K_STR && sp->kind != K_INT) return col_i32(c, 0, 0);
    int32_t code = known;
    if (code >= 0) {
        *flags = (unsigned char)sc->d[which].flags.d[code];
    } else {
        const char *s;
        Py_ssize_t n;
        TRY(text_of(sp, &o->scratch2, &s, &n));
        TRY(intern(sc, which, s, n, &code, flags));
    }
    value_seen(sc, which, code);
    *out = code;
    return col_i32(c, code, 1);
}

static inline int same_track(const TrackKey *a, const TrackKey *b) {
    return a->pid == b->pid && a->tid == b->tid && a->gpu == b->gpu && a->dev_ok == b->dev_ok &&
           a->stream_ok == b->stream_ok && a->dev == b->dev && a->stream == b->stream;
}

static int tracks_grow(Tracks *t) {
    Py_ssize_t cap = t->cap ? t->cap * 2 : 64;
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)cap);
    TrackKey *keys = realloc(t->keys, sizeof(TrackKey) * (size_t)(cap / 2));
    if (!slots || !keys) { free(slots); if (keys) t->keys = keys; return ST_NOMEM; }
    memset(slots, 0xff, sizeof(int32_t) * (size_t)cap);
    free(t->slots);
    t->slots = slots;
    t->keys = keys;
    t->cap = cap;
    for (Py_ssize_t c = 0; c < t->n; c++) {
        uint64_t h = hash_bytes((const char *)&keys[c], sizeof *keys);
        size_t i = (size_t)h & (size_t)(cap - 1);
        while (slots[i] >= 0) i = (i + 1) & (size_t)(cap - 1);
        slots[i] = (int32_t)c;
    }
    return ST_OK;
}

/* The code of track k, adding it when new (consecutive events mostly share their track: no hash needed then). */
static int track_code(Tracks *t, const TrackKey *k, int32_t *code) {
    if (t->last >= 0 && t->last < t->n && same_track(&t->keys[t->last], k)) {
        *code = t->last;
        return ST_OK;
    }
    if ((t->n + 1) * 2 > t->cap) TRY(tracks_grow(t));
    uint64_t h = hash_bytes((const char *)k, sizeof *k);
    size_t mask = (size_t)(t->cap - 1), i = (size_t)h & mask;
    for (;; i = (i + 1) & mask) {
        int32_t c = t->slots[i];
        if (c < 0) break;
        if (same_track(&t->keys[c], k)) {
            *code = t->last = c;
            return ST_OK;
        }
    }
    if (t->n >= INT32_MAX) return ST_NOMEM;
    t->keys[t->n] = *k;
    t->slots[i] = (int32_t)t->n;
    *code = t->last = (int32_t)t->n++;
    return ST_OK;
}

static int put_raw(Col *c, const uchar *s, const uchar *e) {
    if (s) {
        TRY(buf_put(&c->data, s, e - s));
        return col_str_end(c, 1);
    }
    return col_str_end(c, 0);
}

static int emit(Out *o, Scanner *sc, const Ev *ev) {
    const char *ph = "", *name = "";
    Py_ssize_t phn = 0, namen = 0;
    if (ev->ph.kind == K_STR) TRY(text_of(&ev->ph, &o->scratch, &ph, &phn));
    if (phn != 1 || (ph[0] != 'X' && ph[0] != 'i')) return ST_OK;
    if (ev->name.kind == K_STR) TRY(text_of(&ev->name, &o->scratch2, &name, &namen));
    if (ph[0] == 'i') {
        if (!is_key(name, namen, "[memory]")) return ST_OK;
        TRY(col_int(&o->m[M_TS], ev->ts.v, ev->ts.ok));
        TRY(put_int(o, o->m, T_M, M_TOTAL, &ev->a[A_TOTAL]));
        TRY(put_int(o, o->m, T_M, M_BYTES, &ev->a[A_BYTES]));
        TRY(put_int(o, o->m, T_M, M_DEVID, &ev->a[A_DEVID]));
        return put_int(o, o->m, T_M, M_ADDR, &ev->a[A_ADDR]);
    }
    Col *x = sc->x;
    int64_t row = x[X_NAME].n;
    int32_t code;
    unsigned char name_flags, cat_flags, unused;
    TrackKey tk;
    memset(&tk, 0, sizeof tk); /* the padding too: keys are hashed as bytes */
    if (ev->name_code >= 0) {
        code = ev->name_code;
        name_flags = (unsigned char)sc->d[D_NAME].flags.d[code];
    } else {
        TRY(intern(sc, D_NAME, name, namen, &code, &name_flags)); /* name: scratch2 is free again after this */
    }
    name_seen(sc, ev->name_key, code);
    TRY(col_i32(&x[X_NAME], code, 1));
    int32_t cat_code;
    TRY(put_code(sc, o, D_CAT, &x[X_CAT], &ev->cat, ev->code[D_CAT], &cat_flags, &cat_code));
    TRY(put_code(sc, o, D_PID, &x[X_PID], &ev->pid, ev->code[D_PID], &unused, &tk.pid));
    TRY(put_code(sc, o, D_TID, &x[X_TID], &ev->tid, ev->code[D_TID], &unused, &tk.tid));
    TRY(col_int(&x[X_TS], ev->ts.v, ev->ts.ok));
    TRY(col_int(&x[X_DUR], ev->dur.v, ev->dur.ok));
    TRY(put_int(o, x, T_X, X_CORR, &ev->a[A_CORR]));
    TRY(put_int(o, x, T_X, X_EXT, &ev->a[A_EXT]));
    if (cat_flags & F_GPU) {
        const IntV *dev = &ev->a[A_DEVICE], *stream = &ev->a[A_STREAM];
        TRY(col_int(&o->g[G_ROW], row, 1));
        TRY(put_int(o, o->g, T_G, G_DEVICE, dev));
        TRY(put_int(o, o->g, T_G, G_STREAM, stream));
        tk.gpu = 1;
        if (dev->ok) { tk.dev_ok = 1; tk.dev = dev->v; }
        if (stream->ok) { tk.stream_ok = 1; tk.stream = stream->v; }
        if (dev->odd_s || stream->odd_s) sc->tracks_odd = 1;
    }
    int32_t track;
    TRY(track_code(&sc->tracks, &tk, &track));
    TRY(col_i32(&x[X_TRACK], track, 1));
    if (name_flags & F_COMM) {
        Col *c = o->c;
        TRY(col_int(&c[C_ROW], row, 1));
        static const int ints[][2] = {{C_NELEMS, A_NELEMS}, {C_SRC, A_SRC}, {C_DST, A_DST}};
        for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) TRY(put_int(o, c, T_C, ints[i][0], &ev->a[ints[i][1]]));
        static const int strs[][2] = {{C_COLL, S_COLL}, {C_DTYPE, S_DTYPE}, {C_PGN, S_PGN}, {C_PGD, S_PGD}};
        for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++) {
            const Span *sp = &ev->s[strs[i][1]];
            Col *col = &c[strs[i][0]];
            if (sp->kind == K_ODD) {
                Odd d = {T_C, strs[i][0], col->n, sp->s, sp->s + sp->n};
                TRY(buf_put(&o->odd, &d, sizeof d));
                TRY(col_str_end(col, 0));
            } else {
                TRY(put_span(col, sp));
            }
        }
    }
    /* record_shapes lists: kept (as JSON text) only for the gloo P2P events whose peers and sizes ingest reads */
    if (name_flags & F_SHAPED) {
        TRY(col_int(&o->s[S_ROW], row, 1));
        for (int i = 0; i < N_RAW; i++) TRY(put_raw(&o->s[S_CONCRETE + i], ev->raw_s[i], ev->raw_e[i]));
    }
    return ST_OK;
}

static int cols_init(Col *cols, int n, const char *fmt) {
    int64_t zero = 0;
    for (int i = 0; i < n; i++) {
        cols[i].fmt = fmt[i];
        if (fmt[i] == 'U') TRY(buf_put(&cols[i].offs, &zero, 8));
    }
    return ST_OK;
}

static int out_init(Out *o) {
    memset(o, 0, sizeof *o);
    TRY(cols_init(o->m, N_M, M_FMT));
    TRY(cols_init(o->g, N_G, G_FMT));
    TRY(cols_init(o->c, N_C, C_FMT));
    return cols_init(o->s, N_S, S_FMT);
}

static void out_free(Out *o) {
    for (int i = 0; i < N_M; i++) col_free(&o->m[i]);
    for (int i = 0; i < N_G; i++) col_free(&o->g[i]);
    for (int i = 0; i < N_C; i++) col_free(&o->c[i]);
    for (int i = 0; i < N_S; i++) col_free(&o->s[i]);
    buf_free(&o->scratch);
    buf_free(&o->scratch2);
    buf_free(&o->odd);
}

static PyObject *odd_result(Out *o) {
    Py_ssize_t n = o->odd.len / (Py_ssize_t)sizeof(Odd);
    PyObject *list = PyList_New(n);
    if (!list) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Odd *d = (Odd *)o->odd.d + i;
        PyObject *t = Py_BuildValue("(iiny#)", d->table, d->col, (Py_ssize_t)d->row, d->s, (Py_ssize_t)(d->e - d->s));
        if (!t) { Py_DECREF(list); return NULL; }
        PyList_SET_ITEM(list, i, t);
    }
    return list;
}

/* --- the scanner's state across a file: its dictionaries ------------------------------------------------------ */
static void words_free(Words *w) {
    for (Py_ssize_t i = 0; i < w->count; i++) free(w->s[i]);
    free(w->s);
    free(w->n);
    memset(w, 0, sizeof *w);
}

static int words_from(PyObject *seq, Words *w) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of bytes");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    w->s = calloc((size_t)(n ? n : 1), sizeof *w->s);
    w->n = calloc((size_t)(n ? n : 1), sizeof *w->n);
    if (!w->s || !w->n) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        char *s;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(item, &s, &len) < 0) { Py_DECREF(fast); return -1; }
        w->s[i] = malloc((size_t)(len ? len : 1));
        if (!w->s[i]) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
        memcpy(w->s[i], s, (size_t)len);
        w->n[i] = len;
        w->count = i + 1;
    }
    Py_DECREF(fast);
    return 0;
}

static void scanner_dealloc(Scanner *sc) {
    for (int i = 0; i < N_D; i++) {
        free(sc->d[i].slots);
        free(sc->d[i].hashes);
        col_free(&sc->d[i].col);
        buf_free(&sc->d[i].flags);
    }
    for (int i = 0; i < N_X; i++) col_free(&sc->x[i]);
    free(sc->tracks.slots);
    free(sc->tracks.keys);
    words_free(&sc->gpu_cats);
    words_free(&sc->comm_names);
    words_free(&sc->shaped_names);
    words_free(&sc->shaped_prefixes);
    Py_TYPE(sc)->tp_free((PyObject *)sc);
}

static PyObject *scanner_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"gpu_cats", "comm_names", "shaped_names", "shaped_prefixes", NULL};
    PyObject *a, *b, *c, *d;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO", kwlist, &a, &b, &c, &d)) return NULL;
    Scanner *sc = (Scanner *)type->tp_alloc(type, 0); /* zero-filled */
    if (!sc) return NULL;
    int64_t zero = 0;
    for (int i = 0; i < N_D; i++) {
        sc->d[i].col.fmt = 'U';
        if (buf_put(&sc->d[i].col.offs, &zero, 8)) { Py_DECREF(sc); return PyErr_NoMemory(); }
    }
    sc->tracks.last = -1;
    if (cols_init(sc->x, N_X, X_FMT)) { Py_DECREF(sc); return PyErr_NoMemory(); }
    if (words_from(a, &sc->gpu_cats) || words_from(b, &sc->comm_names) || words_from(c, &sc->shaped_names) ||
        words_from(d, &sc->shaped_prefixes)) {
        Py_DECREF(sc);
        return NULL;
    }
    return (PyObject *)sc;
}

static int col_copy(Col *dst, const Col *src) {
    memset(dst, 0, sizeof *dst);
    dst->fmt = src->fmt;
    dst->n = src->n;
    dst->nulls = src->nulls;
    if (buf_put(&dst->data, src->data.d, src->data.len) || buf_put(&dst->offs, src->offs.d, src->offs.len) ||
        buf_put(&dst->valid, src->valid.d, src->valid.len)) {
        col_free(dst);
        return ST_NOMEM;
    }
    return ST_OK;
}

static PyObject *batch_new(Col *cols, int n, const char *const *names);

/* dictionaries() -> (name, cat, pid, tid): each a Batch of one string column "value", the distinct values so far
 * in code order (copies: the scanner goes on adding to its own). */
static PyObject *scanner_dictionaries(Scanner *sc, PyObject *unused) {
    PyObject *out = PyTuple_New(N_D);
    if (!out) return NULL;
    for (int i = 0; i < N_D; i++) {
        Col c;
        if (col_copy(&c, &sc->d[i].col)) { Py_DECREF(out); return PyErr_NoMemory(); }
        PyObject *b = batch_new(&c, 1, DICT_NAMES);
        col_free(&c);
        if (!b) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, i, b);
    }
    return out;
}

/* --- the time order --------------------------------------------------------------------------------------------
 * take() hands the X events over in the order kineto.py's _finish gives the table: by start, the longer of two that
 * start together first, then in file order (a stable sort). An LSD radix sort of the starts (as offsets from the
 * earliest, 11 bits a pass, only as many passes as the offsets have bits), then each run of equal starts (few, and
 * short) by duration, stably. Events without a start, or without a duration among equal starts, come after the
 * others: finishing drops every event whose start or duration is unusable, and dropping keeps the order of the
 * rest. Each column is then permuted into a spare buffer that the column's old one replaces (no new buffer a
 * column), and pos says where each event of the file went (for the sparse tables' rows and the odd values). */
static inline int has_value(const Col *c, Py_ssize_t i) {
    return c->nulls == 0 || ((unsigned char)c->valid.d[i >> 3] >> (i & 7)) & 1;
}

static inline int64_t dur_key(const Col *dur, uint32_t i) {
    return has_value(dur, i) ? ((const int64_t *)dur->data.d)[i] : INT64_MIN;
}

static void sort_by_dur(uint32_t *x, uint32_t *tmp, Py_ssize_t n, const Col *dur) { /* longest first, stably */
    if (n <= 16) {
        for (Py_ssize_t i = 1; i < n; i++) {
            uint32_t v = x[i];
            int64_t k = dur_key(dur, v);
            Py_ssize_t j = i;
            for (; j > 0 && dur_key(dur, x[j - 1]) < k; j--) x[j] = x[j - 1];
            x[j] = v;
        }
        return;
    }
    Py_ssize_t h = n / 2, i = 0, j = h, k = 0;
    sort_by_dur(x, tmp, h, dur);
    sort_by_dur(x + h, tmp, n - h, dur);
    while (i < h && j < n) tmp[k++] = dur_key(dur, x[i]) >= dur_key(dur, x[j]) ? x[i++] : x[j++];
    while (i < h) tmp[k++] = x[i++];
    while (j < n) tmp[k++] = x[j++];
    memcpy(x, tmp, sizeof *x * (size_t)n);
}

/* *out: the file's rows in time order (malloc'd). */
static int time_order(const Col *ts, const Col *dur, uint32_t **out) {
    Py_ssize_t n = ts->n, m = 0;
    size_t cells = (size_t)(n ? n : 1);
    uint32_t *a = malloc(sizeof *a * cells), *b = malloc(sizeof *b * cells);
    uint64_t *ka = malloc(sizeof *ka * cells), *kb = malloc(sizeof *kb * cells);
    if (!a || !b || !ka || !kb) { free(a); free(b); free(ka); free(kb); return ST_NOMEM; }
    const int64_t *t = (const int64_t *)ts->data.d;
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (Py_ssize_t i = 0; i < n; i++)
        if (has_value(ts, i)) {
            if (t[i] < lo) lo = t[i];
            if (t[i] > hi) hi = t[i];
        }
    for (Py_ssize_t i = 0; i < n; i++)
        if (has_value(ts, i)) {
            a[m] = (uint32_t)i;
            ka[m++] = (uint64_t)t[i] - (uint64_t)lo;
        }
    uint64_t range = m ? (uint64_t)hi - (uint64_t)lo : 0;
    int bits = range ? 64 - __builtin_clzll(range) : 0;
    for (int shift = 0; shift < bits; shift += 11) {
        Py_ssize_t count[2049] = {0};
        for (Py_ssize_t i = 0; i < m; i++) count[((ka[i] >> shift) & 2047) + 1]++;
        for (int d = 0; d < 2048; d++) count[d + 1] += count[d];
        for (Py_ssize_t i = 0; i < m; i++) {
            Py_ssize_t j = count[(ka[i] >> shift) & 2047]++;
            kb[j] = ka[i];
            b[j] = a[i];
        }
        uint32_t *s = a; a = b; b = s;
        uint64_t *sk = ka; ka = kb; kb = sk;
    }
    for (Py_ssize_t i = 0; i < m;) {
        Py_ssize_t j = i + 1;
        while (j < m && ka[j] == ka[i]) j++;
        if (j - i > 1) sort_by_dur(a + i, b, j - i, dur);
        i = j;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!has_value(ts, i)) a[m++] = (uint32_t)i;
    free(b);
    free(ka);
    free(kb);
    *out = a;
    return ST_OK;
}

/* Column c's values in the order ``order``, through *spare (at least as large as its data: it becomes the
 * column's buffer and the old one the spare) and *bits (the validity, likewise). */
static int permute(Col *c, const uint32_t *order, Buf *spare, Buf *bits) {
    Py_ssize_t n = c->n, w = c->fmt == 'l' ? 8 : 4;
    if (spare->cap < w * n) {
        buf_free(spare);
        TRY(buf_reserve(spare, w * n));
    }
    if (w == 8) {
        const int64_t *s = (const int64_t *)c->data.d;
        int64_t *d = (int64_t *)spare->d;
        for (Py_ssize_t i = 0; i < n; i++) d[i] = s[order[i]];
    } else {
        const int32_t *s = (const int32_t *)c->data.d;
        int32_t *d = (int32_t *)spare->d;
        for (Py_ssize_t i = 0; i < n; i++) d[i] = s[order[i]];
    }
    Buf old = c->data;
    c->data = *spare;
    c->data.len = w * n;
    *spare = old;
    spare->len = 0;
    if (c->nulls) {
        Py_ssize_t nb = (n + 7) / 8;
        if (bits->cap < nb) {
            buf_free(bits);
            TRY(buf_reserve(bits, nb));
        }
        memset(bits->d, 0, (size_t)nb);
        for (Py_ssize_t i = 0; i < n; i++)
            if (has_value(c, order[i])) bits->d[i >> 3] |= (char)(1 << (i & 7));
        Buf v = c->valid;
        c->valid = *bits;
        c->valid.len = nb;
        *bits = v;
        bits->len = 0;
    }
    return ST_OK;
}

/* The X columns in time order; *pos: where each row of the file went (an int32 column). */
static int sort_x(Col *x, Col *pos) {
    uint32_t *order;
    TRY(time_order(&x[X_TS], &x[X_DUR], &order));
    Py_ssize_t n = x[X_TS].n;
    int st = buf_reserve(&pos->data, 4 * n);
    for (Py_ssize_t i = 0; !st && i < n; i++) ((int32_t *)pos->data.d)[order[i]] = (int32_t)i;
    if (!st) {
        pos->data.len = 4 * n;
        pos->n = n;
    }
    Buf spare = {0}, bits = {0};
    for (int wide = 1; wide >= 0 && !st; wide--) { /* the int64 columns, then the int32 ones: a spare of each width */
        for (int i = 0; !st && i < N_X; i++)
            if ((X_FMT[i] == 'l') == wide) st = permute(&x[i], order, &spare, &bits);
        buf_free(&spare);
    }
    buf_free(&bits);
    free(order);
    return st;
}

static const char *const POS_NAMES[1] = {"pos"};

/* take() -> (x, tracks, pos): the X events' columns so far in time order (see "the time order"), moved out (the
 * Scanner starts again with none), a Batch each; the file's tracks in code order, or None when some GPU event's device or
 * stream arg is not an integer; and where each X row of the file is in x. */
static PyObject *scanner_take(Scanner *sc, PyObject *unused) {
    if (sc->busy) {
        PyErr_SetString(PyExc_RuntimeError, "a Scanner is used by one thread at a time");
        return NULL;
    }
    Col pos;
    memset(&pos, 0, sizeof pos);
    pos.fmt = 'i';
    int sorted;
    sc->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    sorted = sort_x(sc->x, &pos);
    Py_END_ALLOW_THREADS
    sc->busy = 0;
    PyObject *where = sorted ? NULL : batch_new(&pos, 1, POS_NAMES);
    col_free(&pos);
    if (!where) return sorted ? PyErr_NoMemory() : NULL;
    PyObject *tracks = Py_None;
    Py_INCREF(tracks);
    if (!sc->tracks_odd) {
        Col k[N_K];
        memset(k, 0, sizeof k);
        int st = cols_init(k, N_K, K_FMT);
        for (Py_ssize_t i = 0; !st && i < sc->tracks.n; i++) {
            const TrackKey *t = &sc->tracks.keys[i];
            if ((st = col_i32(&k[K_GPU], t->gpu, 1)) || (st = col_int(&k[K_DEVICE], t->dev, t->dev_ok)) ||
                (st = col_int(&k[K_STREAM], t->stream, t->stream_ok)) || (st = col_i32(&k[K_PID], t->pid, t->pid >= 0)))
                break;
            st = col_i32(&k[K_TID], t->tid, t->tid >= 0);
        }
        Py_DECREF(tracks);
        tracks = st ? NULL : batch_new(k, N_K, K_NAMES);
        for (int i = 0; i < N_K; i++) col_free(&k[i]);
        if (!tracks) { Py_DECREF(where); return st ? PyErr_NoMemory() : NULL; }
    }
    /* One Batch a column: polars keeps an imported array's buffers until all of its columns are dropped, and the
     * table keeps some (times, ids) but not the codes it gathers text from. */
    PyObject *x = PyTuple_New(N_X);
    for (int i = 0; x && i < N_X; i++) {
        PyObject *b = batch_new(&sc->x[i], 1, &X_NAMES[i]);
        if (!b) Py_CLEAR(x);
        else PyTuple_SET_ITEM(x, i, b);
    }
    if (!x || cols_init(sc->x, N_X, X_FMT)) {
        Py_XDECREF(x);
        Py_DECREF(tracks);
        Py_DECREF(where);
        return x ? PyErr_NoMemory() : NULL;
    }
    return Py_BuildValue("(NNN)", x, tracks, where);
}

static PyMethodDef scanner_methods[] = {
    {"dictionaries", (PyCFunction)scanner_dictionaries, METH_NOARGS,
     "dictionaries() -> (name, cat, pid, tid) Batches: each dictionary's distinct values in code order"},
    {"take", (PyCFunction)scanner_take, METH_NOARGS,
     "take() -> (x, tracks, pos): the X events' columns so far in time order (moved out; a Batch each), the file's "
     "tracks in code "
     "order (None when some GPU event's device or stream is not an integer), and each file row's row in x"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceana.ingest._scan.Scanner",
    .tp_basicsize = sizeof(Scanner),
    .tp_dealloc = (destructor)scanner_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Scanner(gpu_cats, comm_names, shaped_names, shaped_prefixes): one file's dictionaries and row count "
              "across events() calls; the byte strings say which cats are a GPU stream's and which names get the "
              "communication (C) and record_shapes (S) tables.",
    .tp_methods = scanner_methods,
    .tp_new = scanner_new,
};

/* --- the two entry points ------------------------------------------------------------------------------------- */
static PyObject *fail(int st, P *ps) {
    if (st == ST_NOMEM) return PyErr_NoMemory();
    if (st == ST_NEED) /* only reported when final: the buffer ends inside a value */
        PyErr_Format(Unsupported, "truncated at byte %zd", (Py_ssize_t)(ps->p - ps->base));
    else
        PyErr_Format(Unsupported, "%s at byte %zd", ps->why ? ps->why : "invalid JSON", (Py_ssize_t)(ps->p - ps->base));
    return NULL;
}

static int check_pos(Py_buffer *view, Py_ssize_t pos) {
    if (pos < 0 || pos > view->len) {
        PyErr_SetString(PyExc_ValueError, "pos outside the buffer");
        return 0;
    }
    return 1;
}

static PyObject *scan_top(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos;
    int opening, final;
    if (!PyArg_ParseTuple(args, "y*npp", &view, &pos, &opening, &final)) return NULL;
    PyObject *keys = NULL, *result = NULL;
    Buf scratch = {0};
    if (!check_pos(&view, pos)) goto done;
    keys = PyList_New(0);
    if (!keys) goto done;
    P ps = {view.buf, (const uchar *)view.buf + pos, (const uchar *)view.buf + view.len, NULL};
    int st = ST_OK, status = R_END;
    ws(&ps);
    if (ps.p >= ps.end) { st = ST_NEED; goto check; }
    int done = 0;
    if ((st = opening ? open_object(&ps, "not a JSON object", &done) : next_member(&ps, &done)) || done) goto check;
    for (;;) {
        const char *k;
        Py_ssize_t kn;
        if ((st = scan_key(&ps, &scratch, &k, &kn))) goto check;
        if (is_key(k, kn, "traceEvents") && *ps.p == '[') {
            ps.p++;
            status = R_EVENTS;
            goto check;
        }
        const uchar *vs = ps.p;
        if ((st = skip_value(&ps, 1))) goto check;
        PyObject *item = Py_BuildValue("(s#nn)", k, kn, (Py_ssize_t)(vs - ps.base), (Py_ssize_t)(ps.p - ps.base));
        if (!item) goto done;
        int rc = PyList_Append(keys, item);
        Py_DECREF(item);
        if (rc) goto done;
        if ((st = next_member(&ps, &done))) goto check;
        if (done) break;
    }
check:
    if (st == ST_NEED && !final) {
        result = Py_BuildValue("(inO)", R_NEED, pos, keys);
    } else if (st) {
        fail(st, &ps);
    } else {
        result = Py_BuildValue("(inO)", status, (Py_ssize_t)(ps.p - ps.base), keys);
    }
done:
    Py_XDECREF(keys);
    buf_free(&scratch);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *scan_events(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos, max_bytes;
    int first, final;
    PyObject *scanner;
    if (!PyArg_ParseTuple(args, "y*npnpO!", &view, &pos, &first, &max_bytes, &final, &ScannerType, &scanner))
        return NULL;
    Scanner *sc = (Scanner *)scanner;
    if (!check_pos(&view, pos)) { PyBuffer_Release(&view); return NULL; }
    if (sc->busy) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_RuntimeError, "a Scanner is used by one thread at a time");
        return NULL;
    }
    sc->busy = 1;
    Out o;
    PyObject *result = NULL;
    P ps = {view.buf, (const uchar *)view.buf + pos, (const uchar *)view.buf + view.len, NULL};
    const uchar *start = ps.p, *elem = ps.p;
    int st = out_init(&o), status = R_MORE;
    Py_ssize_t n_events = 0;
    const int64_t rows_before = sc->x[X_NAME].n;
    Ev ev;
    Py_BEGIN_ALLOW_THREADS
    while (!st) {
        elem = ps.p;
        ws(&ps);
        if (ps.p >= ps.end) { st = ST_NEED; break; }
        if (*ps.p == ']') {
            if (!first) { st = bad(&ps, "a trailing ',' in traceEvents"); break; }
            ps.p++;
            status = R_END;
            break;
        }
        if ((st = parse_event(&ps, &ev, &o.scratch, sc))) break;
        ws(&ps);
        if (ps.p >= ps.end) { st = ST_NEED; break; }
        int last = *ps.p == ']';
        if (!last && *ps.p != ',') { st = bad(&ps, "expected ',' or ']' after an event"); break; }
        ps.p++;
        if ((st = emit(&o, sc, &ev))) break;
        n_events++;
        first = 0;
        if (last) { status = R_END; break; }
        if (ps.p - start >= max_bytes) break;
    }
    Py_END_ALLOW_THREADS
    sc->busy = 0;
    if (st == ST_NEED && !final) {
        st = ST_OK;
        status = R_NEED;
        ps.p = elem;
    }
    if (st) {
        fail(st, &ps);
    } else {
        PyObject *x = batch_new(NULL, 0, X_NAMES), *m = x ? batch_new(o.m, N_M, M_NAMES) : NULL;
        if (x) ((Batch *)x)->rows = (Py_ssize_t)(sc->x[X_NAME].n - rows_before);
        PyObject *g = m ? batch_new(o.g, N_G, G_NAMES) : NULL, *c = g ? batch_new(o.c, N_C, C_NAMES) : NULL;
        PyObject *s = c ? batch_new(o.s, N_S, S_NAMES) : NULL;
        PyObject *odd = s ? odd_result(&o) : NULL;
        if (odd)
            result = Py_BuildValue("(inONNNNNNn)", status, (Py_ssize_t)(ps.p - ps.base), first ? Py_True : Py_False, x,
                                   m, g, c, s, odd, n_events);
        else {
            Py_XDECREF(x);
            Py_XDECREF(m);
            Py_XDECREF(g);
            Py_XDECREF(c);
            Py_XDECREF(s);
        }
    }
    out_free(&o);
    PyBuffer_Release(&view);
    return result;
}

/* The scanner's column buffers and the reading window come from the C library's malloc, whose freed memory glibc
 * keeps in its heaps once a large block has raised its mmap threshold (a 16 MB window does): after a rank is read,
 * that was ~50 MB per reading thread still counted in RSS. malloc_trim hands it back to the OS. */
static PyObject *release_memory(PyObject *self, PyObject *unused) {
#ifdef __GLIBC__
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = malloc_trim(0);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(r);
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"release_memory", release_memory, METH_NOARGS,
     "release_memory() -> bool: the C library's freed heap memory handed back to the OS (glibc), where it can"},
    {"top", scan_top, METH_VARARGS, "top(buf, pos, opening, final) -> (status, pos, [(key, start, end), ...])"},
    {"events", scan_events, METH_VARARGS,
     "events(buf, pos, first, max_bytes, final, scanner) -> (status, pos, first, x, memory, gpu, comm, shapes, odd, "
     "n_events)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan", "Native columnar scanner for Kineto traces.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__scan(void) {
    for (size_t i = 0; i < sizeof ARG_KEYS / sizeof ARG_KEYS[0]; i++) {
        if (ARG_KEYS[i].len < 64) arg_lengths |= (uint64_t)1 << ARG_KEYS[i].len;
    }
    memset(arg_first, 0xff, sizeof arg_first);
    for (size_t i = 0; i < sizeof ARG_KEYS / sizeof ARG_KEYS[0]; i++) {
        int8_t *cand = arg_first[(uchar)ARG_KEYS[i].key[0]];
        int j = 0;
        while (j < ARG_FIRST_MAX && cand[j] >= 0) j++;
        if (j == ARG_FIRST_MAX) { PyErr_SetString(PyExc_SystemError, "ARG_FIRST_MAX too small"); return NULL; }
        cand[j] = (int8_t)i;
    }
    if (PyType_Ready(&BatchType) < 0 || PyType_Ready(&ScannerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Batch", (PyObject *)&BatchType) < 0) return NULL;
    if (PyModule_AddObjectRef(m, "Scanner", (PyObject *)&ScannerType) < 0) return NULL;
    Unsupported = PyErr_NewException("traceana.ingest._scan.Unsupported", PyExc_ValueError, NULL);
    if (!Unsupported || PyModule_AddObjectRef(m, "Unsupported", Unsupported) < 0) return NULL;
#ifdef TRACEANA_SCAN_SOURCE_CRC  /* setup.py: the CRC-32 of this file, so a stale build is told apart */
    PyObject *crc = PyLong_FromUnsignedLong(TRACEANA_SCAN_SOURCE_CRC);
    if (!crc || PyModule_AddObjectRef(m, "SOURCE_CRC", crc) < 0) { Py_XDECREF(crc); return NULL; }
    Py_DECREF(crc);
#endif
    static const struct { const char *name; int v; } consts[] = {
        {"MORE", R_MORE}, {"END", R_END}, {"NEED", R_NEED}, {"EVENTS", R_EVENTS}};
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++)
        if (PyModule_AddIntConstant(m, consts[i].name, consts[i].v) < 0) return NULL;
    return m;
}
