/* The compiled pickle scan: pickle_limits.py's _Scan, decision for decision, in C.
 *
 * pickle_limits.py is the reference; this file follows it step by step, with the same limits
 * (passed in by the caller) and the same refusals (raised as the exception class passed in, with
 * the same message), so that check_pickle reads both alike. Where the Python scan meets an
 * IndexError or a ValueError of its own (an empty stack at MEMOIZE, PUT or BUILD; a text memo
 * index that is no number), this one raises the same exception with the same message.
 *
 * A record is a struct in one growable array (an object's record is its index there; index 0 is
 * the one record every scalar shares); the stack, the memo and the marks are growable arrays of
 * such indices, and a tuple holds an array of its items'. A record counts the references to it (from
 * the stack, the memo and tuples' items) and dies with the last, as the Python scan's records do:
 * its index is reused, so that the records held never outnumber the objects alive. Nothing per
 * opcode is a Python object, but for a protocol 0 memo index that is not a short run of digits
 * (read with int()).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* What each opcode does to the stack: numbered as pickle_opcodes.py numbers its kinds. */
enum {
    SCALAR, EMPTY, EMPTY_TUPLE, TUPLE_N, MARK, PUT, MEMOIZE, GET, STOP,
    APPEND, REDUCE, PERSID, BUILD, POP, DUP, NOTHING, FRAME,
    TUPLE, FROM_MARK, EXTEND, POP_MARK, KINDS
};
/* How an argument is encoded, as pickle_opcodes.py says: n bytes, a line or two, or SIZED + a length's width. */
enum { LINE = -1, TWO_LINES = -2, NUMBER_LINE = -3, SIZED = 100, SHORT_SIZED = 101, LONG_SIZED = 104, NUMBER = 110 };
#define NO_OPCODE 255 /* the kind byte of a byte that is no opcode */
#define LEAF 0        /* the record of every scalar */

typedef struct {
    signed char kind, arg;
    unsigned char count, hashes;
} Entry;

typedef struct {
    int64_t weight;    /* leaves, counting shared parts each time */
    Py_ssize_t *parts; /* a tuple's items (NULL for anything but a tuple with items), each a reference */
    Py_ssize_t nparts; /* how many */
    Py_ssize_t refs;   /* references from the stack, the memo and tuples' items; once dead, the next dead one */
    int32_t depth;     /* how deeply containers nest in it (at most max_depth) */
    int32_t shared;    /* taken from the memo or duplicated */
} Record;

typedef struct {
    Py_ssize_t *items;
    Py_ssize_t len, cap;
} Refs;

typedef struct {
    const unsigned char *data;
    Py_ssize_t size;
    Entry table[256];
    Record *records;
    Py_ssize_t nrecords, crecords;
    Refs stack, marks, memo;
    Py_ssize_t dead;  /* the last record to die (-1: none), whose refs names the one before: those to reuse */
    int64_t hashed, ops;
    int stale, beyond;        /* beyond: whether the last text memo index was past int64, positive or negative */
    PyObject *refused, *huge; /* huge: such an index, positive, kept for the message */
    PyObject *refusals;       /* why each byte the table refuses is refused: a tuple of 256 str */
    long long max_depth, max_weight, budget_base, budget_per_op, live_base, live_bytes, live_check;
    long long max_int_bytes, max_int_digits;
} Scan;

static int
reserve(Refs *refs, Py_ssize_t more)
{
    if (refs->len + more <= refs->cap) {
        return 0;
    }
    Py_ssize_t cap = refs->cap ? refs->cap : 64;
    while (cap < refs->len + more) {
        cap *= 2;
    }
    Py_ssize_t *items = PyMem_Realloc(refs->items, (size_t)cap * sizeof(Py_ssize_t));
    if (items == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    refs->items = items;
    refs->cap = cap;
    return 0;
}

static inline int
push(Refs *refs, Py_ssize_t value)
{
    if (refs->len == refs->cap && reserve(refs, 1) < 0) {
        return -1;
    }
    refs->items[refs->len++] = value;
    return 0;
}

/* One more reference to record `r`. */
static inline void
hold(Scan *s, Py_ssize_t r)
{
    if (r != LEAF) {
        s->records[r].refs++;
    }
}

/* One reference fewer to record `r`: the last gone, it dies, and so do the references it holds (its items: the
 * recursion is as deep as tuples nest, at most max_depth). */
static void
drop(Scan *s, Py_ssize_t r)
{
    if (r == LEAF || --s->records[r].refs > 0) {
        return;
    }
    Py_ssize_t *parts = s->records[r].parts, nparts = s->records[r].nparts;
    s->records[r].parts = NULL;
    s->records[r].nparts = 0;
    s->records[r].refs = s->dead;
    s->dead = r;
    for (Py_ssize_t i = 0; i < nparts; i++) {
        drop(s, parts[i]);
    }
    PyMem_Free(parts);
}

/* Drop the references of `n` items (popped from the stack, so lying above its top). */
static void
drop_all(Scan *s, const Py_ssize_t *items, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        drop(s, items[i]);
    }
}

/* Push record `r` onto the stack or the memo, as a reference. */
static inline int
push_held(Scan *s, Refs *refs, Py_ssize_t r)
{
    if (push(refs, r) < 0) {
        return -1;
    }
    hold(s, r);
    return 0;
}

/* A new record (index, or -1), not yet referenced; its weight and depth, and the items (from `items`) of a tuple,
 * whose references it takes over. */
static Py_ssize_t
new_record(Scan *s, int64_t weight, int32_t depth, const Py_ssize_t *items, Py_ssize_t nitems)
{
    Py_ssize_t *parts = NULL;
    if (nitems) {
        parts = PyMem_Malloc((size_t)nitems * sizeof(Py_ssize_t));
        if (parts == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(parts, items, (size_t)nitems * sizeof(Py_ssize_t));
    }
    Py_ssize_t index;
    if (s->dead >= 0) {
        index = s->dead;
        s->dead = s->records[index].refs;
    }
    else {
        if (s->nrecords == s->crecords) {
            Py_ssize_t cap = s->crecords ? s->crecords * 2 : 256;
            Record *records = PyMem_Realloc(s->records, (size_t)cap * sizeof(Record));
            if (records == NULL) {
                PyMem_Free(parts);
                PyErr_NoMemory();
                return -1;
            }
            s->records = records;
            s->crecords = cap;
        }
        index = s->nrecords++;
    }
    Record *record = &s->records[index];
    record->weight = weight;
    record->depth = depth;
    record->parts = parts;
    record->nparts = nitems;
    record->refs = 0;
    record->shared = 0;
    return index;
}

static int
refuse(Scan *s, const char *message)
{
    PyErr_SetString(s->refused, message);
    return -1;
}

static int
underflow(Scan *s)
{
    return refuse(s, "its stack underflows");
}

static int
too_deep(Scan *s)
{
    PyErr_Format(s->refused, "it nests containers more than %lld deep", s->max_depth);
    return -1;
}

static int
index_error(const char *message)
{
    PyErr_SetString(PyExc_IndexError, message);
    return -1;
}

/* Add `weight` to the hashing asked for; refuse it past the budget. */
static inline int
hash(Scan *s, int64_t weight)
{
    s->hashed += weight;
    if (s->hashed > s->budget_base + s->budget_per_op * s->ops) {
        return refuse(s, "it asks for more hashing than its size justifies (a billion-laughs structure)");
    }
    return 0;
}

/* _new_tuple: push a tuple of `items` (which may lie in the stack above its top). */
static int
new_tuple(Scan *s, const Py_ssize_t *items, Py_ssize_t nitems)
{
    int64_t weight = 1, depth = 0;
    for (Py_ssize_t i = 0; i < nitems; i++) {
        const Record *item = &s->records[items[i]];
        weight += item->weight;
        if (item->depth > depth) {
            depth = item->depth;
        }
    }
    if (depth >= s->max_depth) {
        return too_deep(s);
    }
    if (weight > s->max_weight) {
        PyErr_Format(s->refused, "a tuple expands to more than %lld items (a billion-laughs structure)",
                     s->max_weight);
        return -1;
    }
    Py_ssize_t record = new_record(s, weight, (int32_t)depth + 1, items, nitems);
    return record < 0 ? -1 : push_held(s, &s->stack, record);
}

/* _grow: add `items` to a container's record; 1 where it was shared and is now deeper, else 0 (-1: refused). */
static int
grow(Scan *s, Py_ssize_t container, const Py_ssize_t *items, Py_ssize_t nitems)
{
    int64_t weight = s->records[container].weight, depth = s->records[container].depth;
    for (Py_ssize_t i = 0; i < nitems; i++) {
        const Record *item = &s->records[items[i]];
        weight += item->weight;
        if (item->depth >= depth) {
            depth = item->depth + 1;
        }
    }
    if (depth > s->max_depth) {
        return too_deep(s);
    }
    Record *record = &s->records[container];
    int deeper = depth > record->depth;
    record->weight = weight < s->max_weight + 1 ? weight : s->max_weight + 1;
    record->depth = (int32_t)depth;
    return record->shared && deeper;
}

static inline uint32_t
u4(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t
u8(const unsigned char *p)
{
    return (uint64_t)u4(p) | (uint64_t)u4(p + 4) << 32;
}

/* pos + n, or PY_SSIZE_T_MAX where that is larger (either is past the data's end). */
static inline Py_ssize_t
advance(Py_ssize_t pos, uint64_t n)
{
    return n > (uint64_t)(PY_SSIZE_T_MAX - pos) ? PY_SSIZE_T_MAX : pos + (Py_ssize_t)n;
}

/* int() of a protocol 0 memo index (the line from `start` to `end`): a short run of digits here, anything
 * else by int() itself; past int64, the number is kept in s->huge (and *index is INT64_MAX or INT64_MIN). */
static int
text_index(Scan *s, Py_ssize_t start, Py_ssize_t end, int64_t *index)
{
    Py_ssize_t i = start;
    int64_t value = 0;
    if (end - start <= 18) {
        while (i < end && s->data[i] >= '0' && s->data[i] <= '9') {
            value = value * 10 + (s->data[i++] - '0');
        }
    }
    if (i == end && end > start) {
        *index = value;
        s->beyond = 0;
        return 0;
    }
    PyObject *line = PyBytes_FromStringAndSize((const char *)s->data + start, end - start);
    if (line == NULL) {
        return -1;
    }
    PyObject *number = PyNumber_Long(line);
    Py_DECREF(line);
    if (number == NULL) {
        return -1;
    }
    int overflow;
    long long found = PyLong_AsLongLongAndOverflow(number, &overflow);
    if (found == -1 && PyErr_Occurred()) {
        Py_DECREF(number);
        return -1;
    }
    *index = overflow > 0 ? INT64_MAX : overflow < 0 ? INT64_MIN : found;
    s->beyond = overflow;
    Py_XSETREF(s->huge, overflow > 0 ? number : NULL);
    if (overflow <= 0) {
        Py_DECREF(number);
    }
    return 0;
}

/* _argument: skip an argument the loop does not read itself; *index: a memo index for PUT and GET (a
 * frame's length for FRAME), else 0. */
static int
argument(Scan *s, Py_ssize_t *at, int kind, int arg, int64_t *index)
{
    Py_ssize_t pos = *at, size = s->size;
    const unsigned char *data = s->data;
    *index = 0;
    if (arg > NUMBER) {
        int width = arg - NUMBER;
        if (size - pos < width) {
            return refuse(s, "it ends inside an opcode");
        }
        uint64_t length = width == 1 ? data[pos] : u4(data + pos);
        if (length > (uint64_t)s->max_int_bytes) {
            PyErr_Format(s->refused, "it holds an integer of %llu bytes, more than %lld", (unsigned long long)length,
                         s->max_int_bytes);
            return -1;
        }
        *at = advance(pos + width, length);
        return 0;
    }
    if (arg > SIZED) {
        int width = arg - SIZED;
        if (size - pos < width) {
            return refuse(s, "it ends inside an opcode");
        }
        uint64_t length = width == 1 ? data[pos] : width == 4 ? u4(data + pos) : u8(data + pos);
        *at = advance(pos + width, length);
        return 0;
    }
    if (arg > 0) {
        if (size - pos < arg) {
            return refuse(s, "it ends inside an opcode");
        }
        if (kind == FRAME) { /* the unpickler reads a frame's declared length in one go: it must be there */
            uint64_t length = u8(data + pos);
            if (length > (uint64_t)(size - pos - arg)) {
                PyErr_Format(s->refused, "it declares a frame of %llu bytes, more than it holds",
                             (unsigned long long)length);
                return -1;
            }
            *index = (int64_t)length;
        }
        *at = pos + arg;
        return 0;
    }
    const unsigned char *end = memchr(data + pos, '\n', (size_t)(size - pos));
    if (end == NULL) {
        return refuse(s, "it ends inside an opcode");
    }
    if (arg == NUMBER_LINE && end - (data + pos) > s->max_int_digits) {
        PyErr_Format(s->refused, "it holds an integer of %zd characters, more than %lld", (Py_ssize_t)(end - (data + pos)),
                     s->max_int_digits);
        return -1;
    }
    if ((kind == PUT || kind == GET) && text_index(s, pos, end - data, index) < 0) {
        return -1;
    }
    if (arg == TWO_LINES) {
        Py_ssize_t next = end + 1 - data;
        end = memchr(data + next, '\n', (size_t)(size - next));
        if (end == NULL) {
            return refuse(s, "it ends inside an opcode");
        }
    }
    *at = end + 1 - data;
    return 0;
}

/* The record `n` down the stack from its top (1: the topmost), where the stack holds at least `n`. */
#define TOP(s, n) ((s)->stack.items[(s)->stack.len - (n)])

/* The kinds of 9 to 16: _append, _reduce, _persid, _build, _pop, _dup (and nothing). */
static int
handle(Scan *s, int kind, int count, int hashes)
{
    Refs *stack = &s->stack;
    Py_ssize_t floor = s->marks.items[s->marks.len - 1];
    switch (kind) {
    case APPEND: {
        Py_ssize_t taken = count - 1; /* the container stays */
        if (stack->len - taken <= floor) {
            return underflow(s);
        }
        stack->len -= taken;
        const Py_ssize_t *items = stack->items + stack->len;
        if (hashes && hash(s, s->records[items[0]].weight) < 0) { /* SETITEM hashes its key */
            return -1;
        }
        if (TOP(s, 1) != LEAF) {
            int shared = grow(s, TOP(s, 1), items, taken);
            if (shared < 0) {
                return -1;
            }
            s->stale = shared || s->stale;
        }
        drop_all(s, items, taken);
        return 0;
    }
    case REDUCE: {
        if (stack->len - count < floor) {
            return underflow(s);
        }
        const Record *args = &s->records[TOP(s, count - 1)];
        if (args->nparts) {
            int64_t weight = 1;
            for (Py_ssize_t i = 0; i < args->nparts; i++) {
                weight += s->records[args->parts[i]].weight;
            }
            s->hashed += weight;
        }
        else {
            s->hashed += args->weight;
        }
        if (hash(s, count == 3 ? s->records[TOP(s, 1)].weight : 0) < 0) {
            return -1;
        }
        if (args->depth >= s->max_depth) {
            return too_deep(s);
        }
        int32_t depth = args->depth + 1;
        stack->len -= count;
        drop_all(s, stack->items + stack->len, count);
        Py_ssize_t record = new_record(s, 1, depth, NULL, 0);
        return record < 0 ? -1 : push_held(s, stack, record);
    }
    case PERSID:
        if (stack->len - count < floor) {
            return underflow(s);
        }
        stack->len -= count;
        drop_all(s, stack->items + stack->len, count);
        return push(stack, LEAF);
    case BUILD: {
        if (stack->len == 0) {
            return index_error("pop from empty list");
        }
        const Record state = s->records[stack->items[--stack->len]];
        drop(s, stack->items[stack->len]);
        if (hash(s, state.weight) < 0) {
            return -1;
        }
        if (stack->len == 0) {
            return index_error("list index out of range");
        }
        if (TOP(s, 1) != LEAF) {
            Record *container = &s->records[TOP(s, 1)];
            if (state.depth >= container->depth) {
                if (state.depth >= s->max_depth) {
                    return too_deep(s);
                }
                container->depth = state.depth + 1;
                s->stale = s->stale || container->shared;
            }
            int64_t weight = container->weight + state.weight;
            container->weight = weight < s->max_weight + 1 ? weight : s->max_weight + 1;
        }
        return 0;
    }
    case POP:
        if (s->marks.len > 1 && floor == stack->len) {
            s->marks.len--;
        }
        else if (stack->len > floor) {
            drop(s, stack->items[--stack->len]);
        }
        else {
            return underflow(s);
        }
        return 0;
    case DUP:
        if (stack->len <= floor) {
            return underflow(s);
        }
        if (TOP(s, 1) != LEAF) {
            s->records[TOP(s, 1)].shared = 1;
        }
        return push_held(s, stack, TOP(s, 1));
    default: /* PROTO, READONLY_BUFFER, FRAME (read with its argument) */
        return 0;
    }
}

/* The kinds of 17 to 20, given the items above the topmost mark (just popped: they lie above the stack's top). */
static int
handle_marked(Scan *s, int kind, int hashes, const Py_ssize_t *items, Py_ssize_t nitems)
{
    if ((kind == FROM_MARK || kind == EXTEND) && hashes) {
        int64_t weight = 0;
        for (Py_ssize_t i = 0; i < nitems; i += hashes) {
            weight += s->records[items[i]].weight;
        }
        if (hash(s, weight) < 0) {
            return -1;
        }
    }
    if (kind == TUPLE) {
        return new_tuple(s, items, nitems); /* which takes over the items' references */
    }
    if (kind == FROM_MARK) {
        Py_ssize_t record = new_record(s, 1, 1, NULL, 0);
        if (record < 0 || grow(s, record, items, nitems) < 0) {
            return -1;
        }
        drop_all(s, items, nitems);
        return push_held(s, &s->stack, record);
    }
    if (kind == EXTEND) {
        if (s->stack.len <= s->marks.items[s->marks.len - 1]) {
            return underflow(s);
        }
        if (TOP(s, 1) != LEAF) {
            int shared = grow(s, TOP(s, 1), items, nitems);
            if (shared < 0) {
                return -1;
            }
            s->stale = shared || s->stale;
        }
    }
    drop_all(s, items, nitems); /* POP_MARK: the items, dropped */
    return 0;
}

/* _Scan.run: the opcodes from `pos` to STOP; returns (where the pickle ends, whether depths may be stale). */
static PyObject *
run(Scan *s, Py_ssize_t pos)
{
    const unsigned char *data = s->data;
    Py_ssize_t size = s->size, frame_end = size; /* where the frame being read ends; the data's end outside one */
    int64_t index = 0;
    Refs *stack = &s->stack, *memo = &s->memo, *marks = &s->marks;
    long long live = s->live_base + (size > pos ? size - pos : 0) / s->live_bytes;
    for (;;) {
        if (pos >= size) {
            refuse(s, "it ends without a STOP opcode");
            return NULL;
        }
        Py_ssize_t op_start = pos;
        const Entry entry = s->table[data[pos]];
        if ((unsigned char)entry.kind == NO_OPCODE) {
            PyErr_SetObject(s->refused, PyTuple_GET_ITEM(s->refusals, data[pos]));
            return NULL;
        }
        int kind = entry.kind, arg = entry.arg;
        s->ops++;
        if (s->ops % s->live_check == 0 && stack->len + marks->len + memo->len > live) {
            PyErr_Format(s->refused,
                         "it holds more than %lld objects at once on its stack and in its memo (at most %lld and one "
                         "per %lld bytes of it)",
                         live, s->live_base, s->live_bytes);
            return NULL;
        }
        pos++;
        if (arg) {
            if (arg == 1) { /* BINPUT, BINGET, BININT1, PROTO */
                index = pos < size ? data[pos] : 0;
                pos += 1;
            }
            else if (arg == 4) { /* LONG_BINPUT, LONG_BINGET, BININT */
                index = size - pos >= 4 ? u4(data + pos) : 0;
                pos += 4;
            }
            else if (arg == SHORT_SIZED) {
                pos += 1 + (pos < size ? data[pos] : 0);
            }
            else if (arg == LONG_SIZED) {
                pos = advance(pos + 4, size - pos >= 4 ? u4(data + pos) : 0);
            }
            else {
                if (argument(s, &pos, kind, arg, &index) < 0) {
                    return NULL;
                }
                if (kind == FRAME) { /* _begin_frame */
                    if (op_start < frame_end) {
                        if (pos > frame_end) {
                            refuse(s, "an opcode crosses the end of its frame");
                            return NULL;
                        }
                        if (frame_end < size) {
                            refuse(s, "it begins a frame inside another");
                            return NULL;
                        }
                    }
                    frame_end = pos + (Py_ssize_t)index;
                }
            }
            if (pos > frame_end) { /* _past_frame */
                if (pos > size) {
                    refuse(s, "it declares more bytes than it holds");
                    return NULL;
                }
                if (op_start < frame_end) { /* the C unpickler would read the rest past the frame, and misread it */
                    refuse(s, "an opcode crosses the end of its frame");
                    return NULL;
                }
                frame_end = size;
            }
        }
        switch (kind) {
        case SCALAR:
            if (push(stack, LEAF) < 0) {
                return NULL;
            }
            break;
        case MEMOIZE:
            if (stack->len == 0) {
                index_error("list index out of range");
                return NULL;
            }
            if (push_held(s, memo, TOP(s, 1)) < 0) {
                return NULL;
            }
            break;
        case GET: {
            if (index >= memo->len) {
                if (s->huge != NULL) {
                    PyErr_Format(s->refused, "it refers to memo entry %S, which it never stored", s->huge);
                }
                else {
                    PyErr_Format(s->refused, "it refers to memo entry %lld, which it never stored",
                                 (long long)index);
                }
                return NULL;
            }
            if (index < -memo->len) { /* a protocol 0 index may be negative: a list's negative index */
                index_error(s->beyond ? "cannot fit 'int' into an index-sized integer" : "list index out of range");
                return NULL;
            }
            Py_ssize_t record = memo->items[index < 0 ? memo->len + index : index];
            if (record != LEAF) {
                s->records[record].shared = 1;
            }
            if (push_held(s, stack, record) < 0) {
                return NULL;
            }
            break;
        }
        case PUT:
            if (index > memo->len) { /* what would make the unpickler allocate a memo of index entries */
                if (s->huge != NULL) {
                    PyErr_Format(s->refused, "it stores memo entry %S when it holds %zd", s->huge, memo->len);
                }
                else {
                    PyErr_Format(s->refused, "it stores memo entry %lld when it holds %zd", (long long)index,
                                 memo->len);
                }
                return NULL;
            }
            if (stack->len == 0) {
                index_error("list index out of range");
                return NULL;
            }
            if (index == memo->len) {
                if (push_held(s, memo, TOP(s, 1)) < 0) {
                    return NULL;
                }
            }
            else if (index < -memo->len) {
                index_error(s->beyond ? "cannot fit 'int' into an index-sized integer"
                                      : "list assignment index out of range");
                return NULL;
            }
            else {
                Py_ssize_t *slot = &memo->items[index < 0 ? memo->len + index : index];
                Py_ssize_t old = *slot;
                hold(s, TOP(s, 1));
                *slot = TOP(s, 1);
                drop(s, old);
            }
            break;
        case MARK:
            if (push(marks, stack->len) < 0) {
                return NULL;
            }
            break;
        case TUPLE_N: {
            Py_ssize_t start = stack->len - entry.count;
            if (start < marks->items[marks->len - 1]) {
                underflow(s);
                return NULL;
            }
            stack->len = start;
            if (new_tuple(s, stack->items + start, entry.count) < 0) {
                return NULL;
            }
            break;
        }
        case EMPTY:
        case EMPTY_TUPLE: {
            Py_ssize_t record = new_record(s, 1, 1, NULL, 0);
            if (record < 0 || push_held(s, stack, record) < 0) {
                return NULL;
            }
            break;
        }
        case STOP:
            if (stack->len != 1 || marks->len != 1) {
                refuse(s, "it stops with other than one object on its stack");
                return NULL;
            }
            return Py_BuildValue("(nO)", pos, s->stale ? Py_True : Py_False);
        default:
            if (kind < TUPLE) {
                if (handle(s, kind, entry.count, entry.hashes) < 0) {
                    return NULL;
                }
            }
            else if (marks->len == 1) {
                refuse(s, "it pops a mark it never set");
                return NULL;
            }
            else {
                Py_ssize_t start = marks->items[--marks->len], end = stack->len;
                if (start > end) { /* BUILD took an item below the mark */
                    start = end;
                }
                stack->len = start;
                if (handle_marked(s, kind, entry.hashes, stack->items + start, end - start) < 0) {
                    return NULL;
                }
            }
        }
    }
}

PyDoc_STRVAR(scan_doc,
             "scan(data, pos, table, refusals, refused, max_depth, max_weight, budget_base, budget_per_op,\n"
             "     live_base, live_bytes, live_check, max_int_bytes, max_int_digits)\n--\n\n"
             "pickle_limits.scan, compiled: check the pickle at pos in data (any buffer); return where it\n"
             "ends and whether its depths may be stale. table and refusals: an OpcodeSet's packed and\n"
             "refusals; refused: the class of refusals; then the limits, as pickle_limits names them\n"
             "(MAX_LIVE, LIVE_BYTES, LIVE_CHECK_OPS, MAX_INT_BYTES, MAX_INT_DIGITS).");

static PyObject *
scan(PyObject *module, PyObject *args)
{
    Py_buffer view, packed;
    Py_ssize_t pos;
    Scan s;
    memset(&s, 0, sizeof(s));
    s.dead = -1;
    if (!PyArg_ParseTuple(args, "y*ny*O!OLLLLLLLLL", &view, &pos, &packed, &PyTuple_Type, &s.refusals, &s.refused,
                          &s.max_depth, &s.max_weight, &s.budget_base, &s.budget_per_op, &s.live_base, &s.live_bytes,
                          &s.live_check, &s.max_int_bytes, &s.max_int_digits)) {
        return NULL;
    }
    PyObject *result = NULL;
    const long long most = 1LL << 40; /* sums of weights stay far inside int64 */
    int refusals_ok = PyTuple_GET_SIZE(s.refusals) == 256;
    for (Py_ssize_t code = 0; refusals_ok && code < 256; code++) {
        refusals_ok = PyUnicode_Check(PyTuple_GET_ITEM(s.refusals, code));
    }
    if (packed.len != 4 * 256) {
        PyErr_SetString(PyExc_ValueError, "table must hold 4 bytes for each of 256 opcodes");
    }
    else if (!refusals_ok) {
        PyErr_SetString(PyExc_ValueError, "refusals must hold a str for each of 256 opcodes");
    }
    else if (pos < 0) {
        PyErr_SetString(PyExc_ValueError, "pos must not be negative");
    }
    else if (s.max_depth < 0 || s.max_depth > 10000 || s.max_weight < 0 || s.max_weight > most ||
             s.budget_base < 0 || s.budget_base > most || s.budget_per_op < 0 || s.budget_per_op > most ||
             s.live_base < 0 || s.live_base > most || s.live_bytes < 1 || s.live_bytes > most || s.live_check < 1 ||
             s.live_check > most || s.max_int_bytes < 0 || s.max_int_bytes > most || s.max_int_digits < 0 ||
             s.max_int_digits > most) {
        PyErr_SetString(PyExc_ValueError,
                        "limits must lie between 0 (1 for live_bytes and live_check) and 2**40 (10000 for max_depth)");
    }
    else {
        const unsigned char *table = packed.buf;
        for (int code = 0; code < 256; code++) {
            s.table[code].kind = (signed char)table[4 * code];
            s.table[code].arg = (signed char)table[4 * code + 1];
            s.table[code].count = table[4 * code + 2];
            s.table[code].hashes = table[4 * code + 3];
        }
        s.data = view.buf;
        s.size = view.len;
        if (new_record(&s, 1, 0, NULL, 0) == LEAF && push(&s.marks, 0) == 0) { /* the stack's floor */
            result = run(&s, pos);
        }
    }
    Py_XDECREF(s.huge);
    for (Py_ssize_t r = 0; r < s.nrecords; r++) {
        PyMem_Free(s.records[r].parts);
    }
    PyMem_Free(s.records);
    PyMem_Free(s.stack.items);
    PyMem_Free(s.marks.items);
    PyMem_Free(s.memo.items);

    PyBuffer_Release(&packed);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, scan_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "optim_repair.formats._scan",
    "pickle_limits' scan, compiled (see _scan.c).",
    0,
    methods,
};

PyMODINIT_FUNC
PyInit__scan(void)
{
    return PyModule_Create(&module);
}
