# JSON objects -> fixed-shape rows and documents, included into _codec.pyx after
# _protobuf.pxi (it shares the element stores, the error codes, ``Out`` and
# the values that wait for the record's end, ``Deferred``).
#
# ``kfeed.jsonformat`` compiles a kfeed Schema into a plan: a tree of object
# levels, each with the keys that lead to a field. ``json_decode`` parses one
# object per message value in one pass, without the GIL and without a Python
# object per record: wanted values are parsed into the field's dtype where
# they lie, everything else is skipped (strings are skipped without decoding).
# ``json_documents`` reads the same plan with one variable-length field (an
# array, or a string as bytes) into one growing buffer, the other fields into
# rows, in the same one pass.
#
# Grammar (RFC 8259), plus what Python's json.loads also reads: NaN,
# Infinity and -Infinity. Numbers without a fraction or exponent are
# integers (json.loads gives an int), the others floats; a float never goes
# into an integer field. A key repeated in one object: the last one wins, and
# a copy before it that the field cannot take is dropped with it (NOTE [ The
# value the parser keeps ] in _protobuf.pxi). A value starting with a zero
# byte carries the Confluent JSON Schema framing (zero byte, 4-byte schema
# id), which is skipped.
#
# Every string, read or skipped, key or value, is checked as json.loads checks
# it, so that a record json.loads refuses is a bad record here too: no raw
# control character (bytes 0x00-0x1F), only RFC 8259's escapes (\uXXXX with
# four hex digits), and valid UTF-8 as json.loads decodes bytes (with
# "surrogatepass": an encoded surrogate, ED A0-BF xx, is taken). A string read
# into a document of bytes must be UTF-8 once its escapes are undone: a lone
# surrogate, raw or as a \uXXXX escape, has no UTF-8, and makes the record bad.

from libc.math cimport INFINITY, NAN
from libc.string cimport memcmp

# The C library's strtod reads "1.5" by the process's locale: one whose
# decimal point is "," (de_DE, set by the application) read 1.5e-30 as 1.0.
# JSON's numbers are read in the "C" locale, whatever the process's.
cdef extern from *:
    """
    #include <locale.h>
    #include <stdlib.h>
    #if defined(__APPLE__)
    #include <xlocale.h>
    #endif
    static locale_t kfeed_c_locale = (locale_t)0;
    static int kfeed_c_locale_init(void) {
        if (!kfeed_c_locale) kfeed_c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0);
        return kfeed_c_locale != (locale_t)0;
    }
    static double kfeed_strtod_c(const char *s) {
        return strtod_l(s, NULL, kfeed_c_locale);
    }
    """
    int kfeed_c_locale_init() nogil
    double kfeed_strtod_c(const char* s) nogil

if not kfeed_c_locale_init():
    raise MemoryError("kfeed: cannot make the C locale that JSON numbers are read in")

cdef enum:
    J_OBJECT = 0       # an object level: its children are keys
    J_FIELD = 1        # a field's value (a scalar, or arrays nested ndim deep)
    # Nesting, objects and arrays: json.loads reads as deep as Python's recursion
    # limit (1000 unless raised; less the caller's frames, 994 from a script's
    # top level), so a record that deep is read, what lies deeper is bad.
    J_MAX_DEPTH = 1000
    J_KIND_WORDS = (J_MAX_DEPTH + 63) // 64  # js_skip's bit per open container
    J_MAX_DIMS = 8
    A_JSON = 200       # not JSON where a value was expected
    A_OBJECT           # a key that leads to fields holds neither an object nor null
    A_CONTROL          # a raw control character in a string (its byte in err_value)
    A_ESCAPE           # a backslash not followed by one of RFC 8259's escapes
    A_UTF8             # a string's bytes are not UTF-8
    A_SURROGATE        # a string read into bytes holds a lone surrogate
    # js_number's integers past int64, which only some fields take (not errors):
    J_UINT64           # up to 2**64 - 1: its bits in ``iv``, its double in ``dv``
    J_WIDE             # any other: its double in ``dv`` (inf past float64)


cdef struct JsNode:
    int kind
    int field
    int code
    Py_ssize_t first      # J_OBJECT: keys[first:first + n]
    Py_ssize_t n


cdef struct JsPlan:
    JsNode* nodes
    Py_ssize_t nnodes
    Py_ssize_t* key_node     # per key: the node it leads to
    Py_ssize_t* key_off      # per key: where its bytes start in ``names``
    Py_ssize_t* key_len
    const uint8_t* names
    Py_ssize_t nfields
    int* codes
    uint64_t* nelem
    int* ndim
    int64_t* dims            # per field, J_MAX_DIMS each
    const uint8_t** default
    Py_ssize_t varfield      # the variable-length field (a document), -1: none
    Py_ssize_t var_default   # its default's elements (when default[varfield])
    uint8_t* below           # per object node, per field: whether the field lies below it


cdef struct JsCur:
    const uint8_t* p
    const uint8_t* end
    const JsPlan* plan
    uint8_t** row
    uint8_t* written
    JtCur* doc               # the document being read (plans with a varfield)
    Deferred* pending        # per field: a value it cannot take, unless its key comes again
    Py_ssize_t npending      # fields with one
    int depth
    Py_ssize_t err_node
    Py_ssize_t err_field
    int64_t err_value


# A record's variable-length field: its elements go to the end of one buffer
# that grows, from ``start`` (where this record's document starts).
cdef struct JtCur:
    int code
    int size
    uint8_t* buf                 # the documents so far, ``len`` elements
    Py_ssize_t cap
    Py_ssize_t len
    Py_ssize_t start
    bint found


cdef class JsonPlan:
    """A kfeed Schema's fields as paths of JSON keys: what ``json_decode`` runs.

    Made by ``kfeed.jsonformat``: ``nodes`` rows (kind, field, code, first,
    n), node 0 the top object; ``keys`` rows (node, offset, length) into
    ``names`` (UTF-8 key bytes, each object's keys in any order); per field
    its code, shape and default row. ``notes`` names each node for errors.
    ``varfield``: the variable-length field (its shape ``()``, its default a
    document of any length), or -1.
    """

    cdef JsPlan p
    cdef readonly tuple notes
    cdef readonly Py_ssize_t nfields
    cdef bytes _names
    cdef tuple _defaults

    def __cinit__(self, Layout layout, const int64_t[:, ::1] nodes, const int64_t[:, ::1] keys,
                  bytes names, codes, shapes, defaults, notes, Py_ssize_t varfield=-1):
        cdef Py_ssize_t i, f, nn = nodes.shape[0], nk = keys.shape[0]
        cdef JsNode* nd
        if nodes.shape[1] != 5 or keys.shape[1] != 3 or nn == 0:
            raise ValueError("nodes must have shape (n >= 1, 5) and keys (k, 3)")
        if len(codes) != layout.nfields or len(shapes) != layout.nfields \
                or len(defaults) != layout.nfields or len(notes) != nn:
            raise ValueError("one code, shape and default per field, one note per node")
        self.nfields = layout.nfields
        self.notes = tuple(str(x) for x in notes)
        self._names = names
        self._defaults = tuple(defaults)
        self.p.nnodes, self.p.nfields = nn, layout.nfields
        self.p.names = <const uint8_t*>PyBytes_AS_STRING(names)
        self.p.nodes = <JsNode*>calloc(nn, sizeof(JsNode))
        self.p.key_node = <Py_ssize_t*>calloc(nk if nk else 1, sizeof(Py_ssize_t))
        self.p.key_off = <Py_ssize_t*>calloc(nk if nk else 1, sizeof(Py_ssize_t))
        self.p.key_len = <Py_ssize_t*>calloc(nk if nk else 1, sizeof(Py_ssize_t))
        self.p.codes = <int*>calloc(layout.nfields, sizeof(int))
        self.p.nelem = <uint64_t*>calloc(layout.nfields, sizeof(uint64_t))
        self.p.ndim = <int*>calloc(layout.nfields, sizeof(int))
        self.p.dims = <int64_t*>calloc(layout.nfields * J_MAX_DIMS, sizeof(int64_t))
        self.p.default = <const uint8_t**>calloc(layout.nfields, sizeof(uint8_t*))
        self.p.below = <uint8_t*>calloc(nn * layout.nfields, 1)
        if not (self.p.nodes and self.p.key_node and self.p.key_off and self.p.key_len
                and self.p.codes and self.p.nelem and self.p.ndim and self.p.dims
                and self.p.default and self.p.below):
            raise MemoryError()
        if not -1 <= varfield < layout.nfields:
            raise ValueError(f"field {varfield} is not in the layout")
        self.p.varfield = varfield
        plan_fields(layout, codes, defaults, self.p.codes, self.p.nelem, self.p.default, varfield)
        self.p.var_default = 0
        if varfield >= 0:
            if self.p.nelem[varfield] != 1:
                raise ValueError(f"field {varfield}: a document's row is one element")
            if defaults[varfield] is not None:
                self.p.var_default = len(defaults[varfield]) // code_size(self.p.codes[varfield])
        for f in range(layout.nfields):
            shape = tuple(shapes[f])
            if len(shape) > J_MAX_DIMS:
                raise ValueError(f"field {f}: more than {J_MAX_DIMS} dimensions")
            total = 1
            for i, d in enumerate(shape):
                if d <= 0:
                    raise ValueError(f"field {f}: dimensions must be positive")
                self.p.dims[f * J_MAX_DIMS + i] = d
                total *= d
            self.p.ndim[f] = len(shape)
            if total != self.p.nelem[f]:
                raise ValueError(f"field {f}: its shape is not its row")
        for i in range(nk):
            if not 0 < keys[i, 0] < nn or keys[i, 1] < 0 or keys[i, 2] < 0 \
                    or keys[i, 1] + keys[i, 2] > len(names):
                raise ValueError(f"key {i} is not in the plan")
            self.p.key_node[i], self.p.key_off[i], self.p.key_len[i] = keys[i, 0], keys[i, 1], keys[i, 2]
        for i in range(nn):
            nd = &self.p.nodes[i]
            nd.kind, nd.field, nd.code = nodes[i, 0], nodes[i, 1], nodes[i, 2]
            nd.first, nd.n = nodes[i, 3], nodes[i, 4]
            if nd.kind == J_FIELD:
                if not 0 <= nd.field < layout.nfields or nd.code != self.p.codes[nd.field]:
                    raise ValueError(f"node {i}: its field or code is not the layout's")
            elif nd.kind != J_OBJECT or nd.first < 0 or nd.n < 0 or nd.first + nd.n > nk:
                raise ValueError(f"node {i}: a bad object node")
        # Which fields lie below each object: a repeated key drops what an
        # earlier one gave them, as json.loads keeps only the last.
        parent = np.full(nn, -1, np.int64)
        for i in range(nn):
            nd = &self.p.nodes[i]
            if nd.kind == J_OBJECT:
                for k in range(nd.first, nd.first + nd.n):
                    parent[self.p.key_node[k]] = i
        for i in range(nn):
            if self.p.nodes[i].kind != J_FIELD:
                continue
            f, up = self.p.nodes[i].field, parent[i]
            for _ in range(nn):  # a malformed plan may loop: as deep as there are nodes
                if up < 0:
                    break
                self.p.below[up * layout.nfields + f] = 1
                up = parent[up]

    def __dealloc__(self):
        free(self.p.nodes)
        free(self.p.key_node)
        free(self.p.key_off)
        free(self.p.key_len)
        free(self.p.codes)
        free(self.p.nelem)
        free(self.p.ndim)
        free(self.p.dims)
        free(self.p.default)
        free(self.p.below)


cdef inline void js_ws(JsCur* c) noexcept nogil:
    cdef uint8_t b
    while c.p < c.end:
        b = c.p[0]
        if b == 0x20 or b == 0x0A or b == 0x0D or b == 0x09:
            c.p += 1
        else:
            return


cdef inline bint js_lit(JsCur* c, const char* word, Py_ssize_t n) noexcept nogil:
    """Consume ``word`` if it comes next."""
    if c.end - c.p < n or memcmp(c.p, word, n) != 0:
        return False
    c.p += n
    return True


cdef inline int js_hex(uint8_t b) noexcept nogil:
    if 0x30 <= b <= 0x39:
        return b - 0x30
    if 0x61 <= b <= 0x66:
        return b - 0x61 + 10
    if 0x41 <= b <= 0x46:
        return b - 0x41 + 10
    return -1


# Per byte: 1 for what a string holds as it is (printable ASCII but the quote
# and the backslash), 0 for what needs a look: the quote, an escape, a control
# character, the start of a UTF-8 sequence.
cdef uint8_t JS_PLAIN[256]
for _k in range(256):
    JS_PLAIN[_k] = 0x20 <= _k < 0x80 and _k != 0x22 and _k != 0x5C


cdef int js_escape(JsCur* c) noexcept nogil:
    """Step over the escape at ``c.p`` (its backslash), if it is one json.loads reads."""
    cdef int k
    if c.end - c.p < 2:
        return A_TRUNCATED
    cdef uint8_t b = c.p[1]
    if b == 0x75:  # \uXXXX (a surrogate pair is two of them)
        for k in range(2, 6):
            if c.end - c.p <= k:
                return A_TRUNCATED
            if js_hex(c.p[k]) < 0:
                return A_ESCAPE
        c.p += 6
        return A_OK
    if b == 0x22 or b == 0x5C or b == 0x2F or b == 0x62 or b == 0x66 or b == 0x6E \
            or b == 0x72 or b == 0x74:
        c.p += 2
        return A_OK
    return A_ESCAPE


cdef int js_utf8(JsCur* c) noexcept nogil:
    """Step over the UTF-8 sequence at ``c.p`` (a byte from 0x80), if json.loads decodes it.

    Shortest forms up to U+10FFFF; json.loads decodes bytes with
    "surrogatepass", so an encoded surrogate (ED A0-BF xx) is one too.
    """
    cdef uint8_t b = c.p[0], lo = 0x80, hi = 0xBF
    cdef int n, k
    if 0xC2 <= b <= 0xDF:
        n = 1
    elif 0xE0 <= b <= 0xEF:
        n = 2
        if b == 0xE0:
            lo = 0xA0  # not an overlong 2-byte form
    elif 0xF0 <= b <= 0xF4:
        n = 3
        if b == 0xF0:
            lo = 0x90  # not an overlong 3-byte form
        elif b == 0xF4:
            hi = 0x8F  # not past U+10FFFF
    else:
        return A_UTF8
    for k in range(1, n + 1):
        if c.end - c.p <= k:
            return A_TRUNCATED
        if not ((lo if k == 1 else 0x80) <= c.p[k] <= (hi if k == 1 else 0xBF)):
            return A_UTF8
    c.p += n + 1
    return A_OK


cdef inline int js_string(JsCur* c, const uint8_t** start, Py_ssize_t* length,
                          bint* escaped) noexcept nogil:
    """Skip a string at ``c.p`` (its opening quote); give the span between the quotes.

    Checked as json.loads checks it: a raw control character, a malformed
    escape or bytes that are not UTF-8 are errors. Plain ASCII, what most
    strings hold, costs one table look-up a byte, as the quote alone did.
    """
    cdef const uint8_t* p = c.p + 1
    cdef const uint8_t* end = c.end
    cdef uint8_t b
    cdef int r
    start[0] = p
    escaped[0] = False
    while True:
        while p < end and JS_PLAIN[p[0]]:
            p += 1
        if p >= end:
            c.p = p
            return A_TRUNCATED
        b = p[0]
        if b == 0x22:
            length[0] = p - start[0]
            c.p = p + 1
            return A_OK
        c.p = p
        if b == 0x5C:
            escaped[0] = True
            r = js_escape(c)
        elif b < 0x20:
            c.err_value = b
            return A_CONTROL
        else:
            r = js_utf8(c)
        if r:
            return r
        p = c.p


cdef int js_char(const uint8_t* s, Py_ssize_t n, Py_ssize_t* at, uint8_t* out) noexcept nogil:
    """The byte or escape at ``s[at]`` (of a string's ``n``) into ``out`` as UTF-8 (1 to 4
    bytes, the count returned), ``at`` stepped over it; -1 if malformed."""
    cdef Py_ssize_t i = at[0]
    cdef uint32_t cp, lo
    cdef int k, h
    if s[i] != 0x5C:
        out[0] = s[i]
        at[0] = i + 1
        return 1
    if i + 1 >= n:
        return -1
    i += 1
    if s[i] == 0x75:  # \uXXXX, maybe a surrogate pair
        cp = 0
        if i + 4 >= n:
            return -1
        for k in range(1, 5):
            h = js_hex(s[i + k])
            if h < 0:
                return -1
            cp = cp * 16 + h
        i += 5
        if 0xD800 <= cp < 0xDC00 and i + 5 < n and s[i] == 0x5C and s[i + 1] == 0x75:
            lo = 0
            for k in range(2, 6):
                h = js_hex(s[i + k])
                if h < 0:
                    return -1
                lo = lo * 16 + h
            if 0xDC00 <= lo < 0xE000:
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
                i += 6
        at[0] = i
        if cp < 0x80:
            out[0] = cp
            return 1
        if cp < 0x800:
            out[0] = 0xC0 | (cp >> 6)
            out[1] = 0x80 | (cp & 0x3F)
            return 2
        if cp < 0x10000:
            out[0] = 0xE0 | (cp >> 12)
            out[1] = 0x80 | ((cp >> 6) & 0x3F)
            out[2] = 0x80 | (cp & 0x3F)
            return 3
        out[0] = 0xF0 | (cp >> 18)
        out[1] = 0x80 | ((cp >> 12) & 0x3F)
        out[2] = 0x80 | ((cp >> 6) & 0x3F)
        out[3] = 0x80 | (cp & 0x3F)
        return 4
    if s[i] == 0x62:
        out[0] = 0x08
    elif s[i] == 0x66:
        out[0] = 0x0C
    elif s[i] == 0x6E:
        out[0] = 0x0A
    elif s[i] == 0x72:
        out[0] = 0x0D
    elif s[i] == 0x74:
        out[0] = 0x09
    elif s[i] == 0x22 or s[i] == 0x5C or s[i] == 0x2F:
        out[0] = s[i]
    else:
        return -1
    at[0] = i + 1
    return 1


cdef Py_ssize_t js_unescape(const uint8_t* s, Py_ssize_t n, uint8_t* out,
                            Py_ssize_t cap) noexcept nogil:
    """A string's escapes undone into ``out`` as UTF-8; -1 if malformed or too long
    (``cap`` needs 4 bytes of room past the last character)."""
    cdef Py_ssize_t i = 0, o = 0
    cdef int k
    while i < n:
        if o + 4 > cap:
            return -1
        k = js_char(s, n, &i, out + o)
        if k < 0:
            return -1
        o += k
    return o


cdef bint js_key_is(const uint8_t* s, Py_ssize_t n, const uint8_t* name,
                    Py_ssize_t length) noexcept nogil:
    """Whether the escaped key ``s[:n]`` reads as ``name`` (``length`` UTF-8 bytes).

    Undone a character at a time against ``name``, so a key of any length
    compares right, with no buffer to outgrow.
    """
    cdef Py_ssize_t i = 0, o = 0
    cdef uint8_t one[4]
    cdef int k
    if length > n:
        return False  # undoing escapes never lengthens a key
    while i < n:
        k = js_char(s, n, &i, one)
        if k < 0 or o + k > length or memcmp(name + o, one, k) != 0:
            return False
        o += k
    return o == length


cdef extern from "<float.h>":
    int LDBL_MANT_DIG

# 10**k as x87 extended doubles (64-bit mantissa), exact up to 10**27; made once.
cdef long double JS_POW10L[28]
JS_POW10L[0] = 1
for _k in range(1, 28):
    JS_POW10L[_k] = JS_POW10L[_k - 1] * 10
# The extended path needs the x87 format (x86-64 Linux and macOS); elsewhere strtod.
cdef bint JS_EXTENDED = LDBL_MANT_DIG == 64 and sizeof(long double) >= 10


cdef double* JS_POW10 = [1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                          1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22]


cdef int js_strtod(const uint8_t* s, Py_ssize_t n, double* out) noexcept nogil:
    """The C library's ``strtod`` of the ``n`` bytes at ``s`` (a number already checked),
    in the "C" locale."""
    cdef char buf[128]
    cdef char* text = buf
    if n >= 128:
        text = <char*>malloc(n + 1)
        if text == NULL:
            return A_MEMORY
    memcpy(text, s, n)
    text[n] = 0
    out[0] = kfeed_strtod_c(text)
    if text != buf:
        free(text)
    return A_OK


cdef int js_number(JsCur* c, bint* is_float, int64_t* iv, double* dv) noexcept nogil:
    """A number at ``c.p`` (also NaN, Infinity, -Infinity), as json.loads reads it.

    A float is the double nearest its decimal, as json.loads gives it: exact
    arithmetic when the digits fit 2**53 and the power of ten 10**22 (both
    then exact doubles, so one rounding), else the C library's ``strtod``.
    An integer past int64 is ``J_UINT64`` or ``J_WIDE`` (``js_put_number``
    says which fields take it).
    """
    cdef const uint8_t* s = c.p
    cdef bint neg = False, big = False, exact = True, eneg = False
    cdef uint64_t acc = 0, mant = 0
    cdef int digits = 0, scale = 0, e10 = 0, d
    cdef double x
    cdef long double ld
    cdef uint64_t low
    is_float[0] = False
    if c.p < c.end and c.p[0] == 0x2D:
        neg = True
        c.p += 1
    if js_lit(c, "Infinity", 8):
        is_float[0] = True
        dv[0] = -INFINITY if neg else INFINITY
        return A_OK
    if not neg and js_lit(c, "NaN", 3):
        is_float[0] = True
        dv[0] = NAN
        return A_OK
    if c.p >= c.end or not (0x30 <= c.p[0] <= 0x39):
        return A_JSON
    if c.p[0] == 0x30:
        c.p += 1
    else:
        while c.p < c.end and 0x30 <= c.p[0] <= 0x39:
            d = c.p[0] - 0x30
            if big or acc > <uint64_t>1844674407370955161 or \
                    (acc == <uint64_t>1844674407370955161 and d > 5):  # past 2**64 - 1
                big = True
            else:
                acc = acc * 10 + d
            if digits < 19:
                mant = mant * 10 + d
                digits += 1
            else:
                scale += 1
                if d:
                    exact = False
            c.p += 1
    if c.p < c.end and c.p[0] == 0x2E:
        is_float[0] = True
        c.p += 1
        if c.p >= c.end or not (0x30 <= c.p[0] <= 0x39):
            return A_JSON
        while c.p < c.end and 0x30 <= c.p[0] <= 0x39:
            d = c.p[0] - 0x30
            if digits < 19:
                mant = mant * 10 + d
                if mant:
                    digits += 1
                scale -= 1
            elif d:
                exact = False
            c.p += 1
    if c.p < c.end and (c.p[0] == 0x65 or c.p[0] == 0x45):
        is_float[0] = True
        c.p += 1
        if c.p < c.end and (c.p[0] == 0x2B or c.p[0] == 0x2D):
            eneg = c.p[0] == 0x2D
            c.p += 1
        if c.p >= c.end or not (0x30 <= c.p[0] <= 0x39):
            return A_JSON
        while c.p < c.end and 0x30 <= c.p[0] <= 0x39:
            if e10 < 100000:
                e10 = e10 * 10 + (c.p[0] - 0x30)
            else:  # cut short: with the digits' scale it may look small (strtod reads it)
                exact = False
            c.p += 1
        if eneg:
            e10 = -e10
    if not is_float[0]:
        if not big and not neg and acc > <uint64_t>0x7FFFFFFFFFFFFFFF:
            iv[0] = <int64_t>acc
            dv[0] = <double>acc
            return J_UINT64
        if big or (neg and acc > <uint64_t>0x8000000000000000):
            return js_strtod(s, c.p - s, dv) or J_WIDE
        iv[0] = -<int64_t>acc if neg else <int64_t>acc
        dv[0] = <double>iv[0]
        return A_OK
    e10 += scale
    if exact and mant <= (<uint64_t>1 << 53) and -22 <= e10 <= 22:
        x = <double>mant
        x = x * JS_POW10[e10] if e10 >= 0 else x / JS_POW10[-e10]
        dv[0] = -x if neg else x
        return A_OK
    if exact and JS_EXTENDED and mant and -27 <= e10 <= 27:
        # One rounding to the 64-bit mantissa (mant and 10**|e10| are exact),
        # then one to double: right unless the first landed exactly on a tie
        # of the second (the 11 bits dropped are 100 0000 0000), then strtod.
        ld = <long double>mant
        ld = ld * JS_POW10L[e10] if e10 >= 0 else ld / JS_POW10L[-e10]
        memcpy(&low, &ld, 8)
        if (low & 0x7FF) != 0x400:
            x = <double>ld
            dv[0] = -x if neg else x
            return A_OK
    return js_strtod(s, c.p - s, dv)


cdef int js_put_number(JsCur* c, uint8_t* d, uint64_t nelem, int code,
                       int64_t elem) noexcept nogil:
    """The number at ``c.p`` into element ``elem`` of ``d`` (``nelem`` ``code``
    elements), as numpy's same_kind casting takes json.loads' value."""
    cdef bint fl
    cdef int64_t iv
    cdef double dv
    cdef int r = js_number(c, &fl, &iv, &dv)
    if r == J_UINT64 or r == J_WIDE:
        if elem < 0 or <uint64_t>elem >= nelem:
            return A_LENGTH
        if code == C_F32 and r == J_UINT64:  # one rounding, as numpy's uint64 cast
            (<float*>d)[elem] = <float><uint64_t>iv
            return A_OK
        if code == C_F32 or code == C_F64:
            return A_RANGE if dv == INFINITY or dv == -INFINITY else \
                put_float(d, nelem, code, elem, dv)
        if code == C_U64 and r == J_UINT64:
            (<uint64_t*>d)[elem] = <uint64_t>iv
            return A_OK
        return A_KIND if code == C_BOOL else A_RANGE
    if r:
        return r
    if fl:
        return put_float(d, nelem, code, elem, dv)  # A_KIND into ints
    if code == C_BOOL:
        return A_KIND  # numpy: an int is not a bool
    c.err_value = iv
    return put_int(d, nelem, code, elem, iv)


cdef int js_key(JsCur* c) noexcept nogil:
    """Skip a key and its colon, at ``c.p`` (or whitespace before them)."""
    cdef const uint8_t* s
    cdef Py_ssize_t n
    cdef bint esc
    js_ws(c)
    if c.p >= c.end:
        return A_TRUNCATED
    if c.p[0] != 0x22:
        return A_JSON
    cdef int r = js_string(c, &s, &n, &esc)
    if r:
        return r
    js_ws(c)
    if c.p >= c.end:
        return A_TRUNCATED
    if c.p[0] != 0x3A:
        return A_JSON
    c.p += 1
    return A_OK


cdef int js_count_rest(JsCur* c, uint64_t k) noexcept nogil:
    """A_LENGTH with the array's length in ``err_value``: ``k`` items read, the
    rest (from ``c.p``, an item) skipped and counted, to after its ``]``."""
    cdef int r
    while True:
        js_ws(c)
        r = js_skip(c)
        if r:
            return r
        k += 1
        js_ws(c)
        if c.p >= c.end:
            return A_TRUNCATED
        if c.p[0] == 0x2C:
            c.p += 1
            continue
        if c.p[0] != 0x5D:
            return A_JSON
        c.p += 1  # (past the array: the record is read on, NOTE [ The value the parser keeps ])
        c.err_value = k
        return A_LENGTH


cdef int js_skip(JsCur* c) noexcept nogil:
    """Skip one value of any kind at ``c.p``.

    Without recursion, so a value nested as deep as json.loads reads costs
    no C stack: one bit per open container (object or array) says which
    closes it and whether a key comes after its commas.
    """
    cdef const uint8_t* s
    cdef Py_ssize_t n
    cdef bint esc, fl, obj
    cdef int64_t iv
    cdef double dv
    cdef int r, top = 0  # containers open in this value
    cdef uint64_t kinds[J_KIND_WORDS]
    cdef uint8_t b
    while True:
        # A value at c.p.
        js_ws(c)
        if c.p >= c.end:
            return A_TRUNCATED
        b = c.p[0]
        r = A_OK
        if b == 0x7B or b == 0x5B:
            if c.depth + top >= J_MAX_DEPTH:
                return A_DEPTH
            obj = b == 0x7B
            if obj:
                kinds[top >> 6] |= <uint64_t>1 << (top & 63)
            else:
                kinds[top >> 6] &= ~(<uint64_t>1 << (top & 63))
            top += 1
            c.p += 1
            js_ws(c)
            if c.p < c.end and c.p[0] == (0x7D if obj else 0x5D):
                c.p += 1
                top -= 1  # empty: a value read, as below
            elif obj:
                r = js_key(c)
                if r:
                    return r
                continue  # the first member's value
            else:
                continue  # the first element
        elif b == 0x22:
            r = js_string(c, &s, &n, &esc)
        elif js_lit(c, "true", 4) or js_lit(c, "false", 5) or js_lit(c, "null", 4):
            pass
        else:
            r = js_number(c, &fl, &iv, &dv)
            if r == J_UINT64 or r == J_WIDE:
                r = A_OK
        if r:
            return r
        # After a value: the containers it closes, then the next member or element.
        while True:
            if top == 0:
                return A_OK
            js_ws(c)
            if c.p >= c.end:
                return A_TRUNCATED
            obj = (kinds[(top - 1) >> 6] >> ((top - 1) & 63)) & 1
            if c.p[0] == 0x2C:
                c.p += 1
                if obj:
                    r = js_key(c)
                    if r:
                        return r
                break
            if c.p[0] == (0x7D if obj else 0x5D):
                c.p += 1
                top -= 1
                continue
            return A_JSON


cdef int js_field(JsCur* c, Py_ssize_t ni, int f, int level, int64_t elem) noexcept nogil:
    """The value at ``c.p`` into field ``f``: a scalar at ``elem``, or arrays from ``level`` on."""
    cdef const JsNode* nd = &c.plan.nodes[ni]
    cdef int ndim = c.plan.ndim[f], r, held = A_OK
    cdef int64_t k = 0, dim, stride = 1, held_value = 0
    cdef int j
    js_ws(c)
    if c.p >= c.end:
        return A_TRUNCATED
    if c.p[0] == 0x6E and js_lit(c, "null", 4):
        if level == 0:
            c.written[f] = 0  # unwritten (a key again: the last wins): its default, or bad
            return A_OK
        return A_NULL
    if level < ndim:
        if c.p[0] != 0x5B:
            r = js_skip(c)
            return r if r else A_KIND
        dim = c.plan.dims[f * J_MAX_DIMS + level]
        for j in range(level + 1, ndim):
            stride *= c.plan.dims[f * J_MAX_DIMS + j]
        c.p += 1
        js_ws(c)
        if c.p < c.end and c.p[0] == 0x5D:
            c.p += 1
        else:
            while True:
                if k >= dim:  # too long: the rest skipped, to say how long
                    return js_count_rest(c, k)
                r = js_field(c, ni, f, level + 1, elem + k * stride)
                if r and not deferrable(r):
                    return r
                if r and not held:  # read on: the record is bad unless the key comes again
                    held, held_value = r, c.err_value
                k += 1
                js_ws(c)
                if c.p >= c.end:
                    return A_TRUNCATED
                if c.p[0] == 0x2C:
                    c.p += 1
                    continue
                if c.p[0] == 0x5D:
                    c.p += 1
                    break
                return A_JSON
        if k != dim:
            c.err_value = k
            return A_LENGTH
        if held:
            c.err_value = held_value
            return held
        if level == 0:
            c.written[f] = 1
        return A_OK
    # A scalar.
    if js_lit(c, "true", 4):
        r = put_int(c.row[f], c.plan.nelem[f], nd.code, elem, 1)
    elif js_lit(c, "false", 5):
        r = put_int(c.row[f], c.plan.nelem[f], nd.code, elem, 0)
    elif c.p[0] == 0x2D or c.p[0] == 0x4E or c.p[0] == 0x49 or 0x30 <= c.p[0] <= 0x39:
        r = js_put_number(c, c.row[f], c.plan.nelem[f], nd.code, elem)
    else:
        r = js_skip(c)
        return r if r else A_KIND  # a string, object or array
    if r == A_OK and level == 0:
        c.written[f] = 1
    return r


cdef void js_forget(JsCur* c, Py_ssize_t ni) noexcept nogil:
    """Drop what the fields below object node ``ni`` got: its key again, the last one wins."""
    cdef Py_ssize_t f
    cdef const uint8_t* below = c.plan.below + ni * c.plan.nfields
    for f in range(c.plan.nfields):
        if below[f]:
            c.written[f] = 0
            if c.npending:
                settle(&c.pending[f], &c.npending)
            if f == c.plan.varfield:
                c.doc.len, c.doc.found = c.doc.start, False


cdef inline int js_keep(JsCur* c, Py_ssize_t ni, int f, int r) noexcept nogil:
    """After the value of key node ``ni`` went into field ``f`` (``r``): one the field
    cannot take waits for the record's end, a good one (or null) drops one waiting."""
    if r == A_OK:
        if c.npending:
            settle(&c.pending[f], &c.npending)
    elif deferrable(r) or r == A_SURROGATE:  # (the string was read whole)
        defer(&c.pending[f], &c.npending, r, ni, c.err_value, False)
        r = A_OK
    return r


cdef int js_object(JsCur* c, Py_ssize_t ni) noexcept nogil:
    """The object at ``c.p`` (its ``{``), reading the keys of node ``ni``."""
    cdef const JsNode* nd = &c.plan.nodes[ni]
    cdef const uint8_t* key
    cdef const uint8_t* name
    cdef Py_ssize_t n, k, match
    cdef bint esc
    cdef int r, f
    c.depth += 1
    if c.depth > J_MAX_DEPTH:
        return A_DEPTH
    c.p += 1
    js_ws(c)
    if c.p < c.end and c.p[0] == 0x7D:
        c.p += 1
        c.depth -= 1
        return A_OK
    while True:
        js_ws(c)
        if c.p >= c.end:
            return A_TRUNCATED
        if c.p[0] != 0x22:
            return A_JSON
        r = js_string(c, &key, &n, &esc)
        if r:
            return r
        match = -1
        for k in range(nd.first, nd.first + nd.n):
            if esc:
                if js_key_is(key, n, c.plan.names + c.plan.key_off[k], c.plan.key_len[k]):
                    match = c.plan.key_node[k]
                    break
            elif c.plan.key_len[k] == n:
                # Most keys of the same length differ in their first byte: no call.
                name = c.plan.names + c.plan.key_off[k]
                if n == 0 or (name[0] == key[0] and memcmp(name + 1, key + 1, n - 1) == 0):
                    match = c.plan.key_node[k]
                    break
        js_ws(c)
        if c.p >= c.end:
            return A_TRUNCATED
        if c.p[0] != 0x3A:
            return A_JSON
        c.p += 1
        if match < 0:
            r = js_skip(c)
        elif c.plan.nodes[match].kind == J_FIELD and c.plan.nodes[match].field == c.plan.varfield:
            r = js_keep(c, match, c.plan.varfield, jt_array(c, c.doc))
        elif c.plan.nodes[match].kind == J_FIELD:
            f = c.plan.nodes[match].field
            r = js_keep(c, match, f, js_field(c, match, f, 0, 0))
        else:
            js_forget(c, match)
            js_ws(c)
            if c.p < c.end and c.p[0] == 0x7B:
                r = js_object(c, match)
            elif js_lit(c, "null", 4):
                r = A_OK  # the fields below stay unwritten
            else:
                r = js_skip(c)
                if r == A_OK:  # not an object: waits on a field below, as a bad value
                    for f in range(c.plan.nfields):
                        if c.plan.below[match * c.plan.nfields + f]:
                            defer(&c.pending[f], &c.npending, A_OBJECT, match, 0, False)
                            break
        if r:
            if c.err_node < 0:
                c.err_node = match
            return r
        js_ws(c)
        if c.p >= c.end:
            return A_TRUNCATED
        if c.p[0] == 0x2C:
            c.p += 1
            continue
        if c.p[0] == 0x7D:
            c.p += 1
            c.depth -= 1
            return A_OK
        return A_JSON


cdef int js_record(JsCur* c, const JsPlan* plan, const uint8_t* p, const uint8_t* end,
                   uint8_t** dst, uint64_t row) noexcept nogil:
    cdef Py_ssize_t f
    cdef uint64_t nbytes
    c.plan = plan
    c.p = p
    c.end = end
    c.depth = 0
    c.err_node = -1
    c.err_field = -1
    c.err_value = 0
    unwait(c.pending, &c.npending, plan.nfields)
    for f in range(plan.nfields):
        c.written[f] = 0
        if f == plan.varfield:
            c.row[f] = NULL  # its elements go to c.doc
            c.doc.start, c.doc.len, c.doc.found = c.doc.len, c.doc.len, False
            continue
        c.row[f] = dst[f] + row * plan.nelem[f] * code_size(plan.codes[f])
    # A UTF-8 byte order mark, which RFC 8259 lets a reader ignore and
    # json.loads of bytes does (UTF-16 and UTF-32 stay refused).
    if c.end - c.p >= 3 and c.p[0] == 0xEF and c.p[1] == 0xBB and c.p[2] == 0xBF:
        c.p += 3
    js_ws(c)
    if c.p >= c.end:
        return A_TRUNCATED
    if c.p[0] != 0x7B:
        return A_JSON
    cdef int r = js_object(c, 0)
    if r:
        return r
    js_ws(c)
    if c.p != c.end:
        c.err_value = c.end - c.p
        return A_TRAILING
    f = first_waiting(c.pending, c.npending, plan.nfields)
    if f >= 0:  # a value json.loads keeps that its field cannot take
        c.err_node, c.err_value = c.pending[f].node, c.pending[f].value
        return c.pending[f].err
    for f in range(plan.nfields):
        if f == plan.varfield:
            if c.doc.found:
                continue
            if plan.default[f] == NULL:
                c.err_field = f
                return A_MISSING
            if jt_room(c.doc, plan.var_default):
                return A_MEMORY
            memcpy(c.doc.buf + c.doc.len * c.doc.size, plan.default[f],
                   plan.var_default * c.doc.size)
            c.doc.len += plan.var_default
        elif not c.written[f]:
            if plan.default[f] == NULL:
                c.err_field = f
                return A_MISSING
            nbytes = plan.nelem[f] * code_size(plan.codes[f])
            memcpy(c.row[f], plan.default[f], nbytes)
    return A_OK


cdef int js_one(JsCur* c, const JsPlan* plan, const uint8_t* p, Py_ssize_t size,
                uint8_t** dst, uint64_t row) noexcept nogil:
    """One message value into row ``row``, its Confluent framing (a zero byte first) skipped."""
    c.err_node, c.err_field, c.err_value = -1, -1, 0
    if size < 0:
        c.err_value = -size
        return A_VALUE
    cdef Py_ssize_t skip = 5 if size > 0 and p[0] == 0 else 0
    if size < skip:
        return A_FRAME
    return js_record(c, plan, p + skip, p + size, dst, row)


cdef void js_bad(AvBad* b, Py_ssize_t i, int r, const JsCur* c) noexcept nogil:
    b.index, b.err, b.node, b.field, b.value = i, r, c.err_node, c.err_field, c.err_value


cdef list js_rejected(Layout layout, JsonPlan plan, _Values vals, const AvBad* bad,
                      Py_ssize_t nbad):
    """``(index, reason)`` of each rejected value."""
    return [(bad[k].index, _json_reason(layout, plan, bad[k], vals.size[bad[k].index]))
            for k in range(nbad)]


def json_decode(Layout layout, JsonPlan plan, values, Out out, uint64_t row):
    """Decode JSON message values (one object each) into ``out`` from ``row`` on.

    A value whose first byte is zero has the Confluent JSON Schema framing,
    skipped. Returns ``(rows, consumed, bad)`` as ``avro_decode`` does.
    """
    out.fits(layout)
    if row > out.capacity:
        raise ValueError(f"row {row} is past the end of the output ({out.capacity} rows)")
    if plan.nfields != layout.nfields:
        raise ValueError("the plan was made for another layout")
    if plan.p.varfield >= 0:
        raise ValueError("a plan with a variable-length field reads documents: json_documents")
    cdef _Values vals = _Values(values)
    cdef Py_ssize_t n = vals.n, m = n if n else 1, i = 0, nbad = 0
    cdef AvBad* bad = <AvBad*>calloc(m, sizeof(AvBad))
    cdef uint8_t** rowp = <uint8_t**>calloc(layout.nfields, sizeof(uint8_t*))
    cdef uint8_t* written = <uint8_t*>calloc(layout.nfields, 1)
    cdef Deferred* pending = <Deferred*>calloc(layout.nfields, sizeof(Deferred))
    cdef JsCur c
    cdef uint64_t out_row = row
    cdef int r
    if not (bad and rowp and written and pending):
        free(bad); free(rowp); free(written); free(pending)
        raise MemoryError()
    c.row, c.written, c.doc, c.pending, c.npending = rowp, written, NULL, pending, 0
    try:
        with nogil:
            while i < n and out_row < out.capacity:
                r = js_one(&c, &plan.p, vals.ptr[i], vals.size[i], out.bufs.ptr, out_row)
                if r == A_OK:
                    out_row += 1
                else:
                    js_bad(&bad[nbad], i, r, &c)
                    nbad += 1
                i += 1
        return out_row - row, i, js_rejected(layout, plan, vals, bad, nbad)
    finally:
        free(bad); free(rowp); free(written); free(pending)


cdef str _json_reason(Layout layout, JsonPlan plan, AvBad b, Py_ssize_t size):
    where = f" at {plan.notes[b.node]}" if b.node >= 0 else ""
    missing = (f"field {layout.names[b.field]!r}: missing or null, and no default"
               if b.err == A_MISSING else "")
    return _json_error(b, where, missing, size)


cdef str _json_error(AvBad b, str where, str missing, Py_ssize_t size):
    """The reason a JSON value was rejected; ``missing`` says what was missing."""
    cdef int err = b.err
    if err == A_VALUE:
        return REASONS[b.value]
    if err == A_FRAME:
        return f"{size} bytes: too short for the Confluent framing (5 bytes)"
    if err == A_MISSING:
        return missing
    if err == A_JSON:
        return f"not JSON{where}"
    if err == A_OBJECT:
        return f"not an object{where}"
    if err == A_CONTROL:
        return f"a raw control character (byte 0x{b.value:02x}) in a string{where}"
    if err == A_ESCAPE:
        return f"a malformed escape in a string{where}"
    if err == A_UTF8:
        return f"invalid UTF-8 in a string{where}"
    if err == A_SURROGATE:
        return f"a lone surrogate in a string read as bytes{where} (it has no UTF-8)"
    if err == A_TRUNCATED:
        return f"truncated{where}"
    if err == A_RANGE:
        return f"a number that does not fit the field's dtype{where}"
    if err == A_KIND:
        return f"a value of another kind than the field's{where}"
    if err == A_NULL:
        return f"null element{where}"
    if err == A_LENGTH:
        return f"array of {b.value} items does not match the field's shape{where}"
    if err == A_DEPTH:
        return f"nested deeper than {J_MAX_DEPTH}"
    if err == A_TRAILING:
        return f"{b.value} bytes left after the object"
    return f"error {err}{where}"


# -- documents: one variable-length field per object ------------------------------
#
# ``json_documents`` reads, from each object, the plan's variable-length field
# (an array of numbers, or a string as bytes) into one growing flat buffer,
# and the plan's other fields into rows, as ``json_decode`` reads them. A
# repeated key: the last one wins, a bad copy before it dropped with it. A bad
# object adds nothing.

cdef int jt_room(JtCur* t, Py_ssize_t more) noexcept nogil:
    """Room for ``more`` elements after ``t.len``."""
    cdef uint8_t* grown
    if t.len + more > t.cap:
        grown = <uint8_t*>realloc(t.buf, (t.len + more + t.cap) * t.size)
        if grown == NULL:
            return A_MEMORY
        t.buf, t.cap = grown, t.len + more + t.cap
    return A_OK


cdef int jt_array(JsCur* c, JtCur* t) noexcept nogil:
    """The array at ``c.p`` into ``t.buf`` as this object's document (any earlier one dropped)."""
    cdef int r, held = A_OK
    cdef int64_t held_value = 0
    cdef bint esc
    cdef uint8_t* grown
    cdef const uint8_t* s
    cdef Py_ssize_t n, m
    t.len = t.start
    js_ws(c)
    if c.p >= c.end:
        return A_TRUNCATED
    if js_lit(c, "null", 4):
        t.found = False  # missing: the default, or a bad object
        return A_OK
    if c.p[0] == 0x22 and (t.code == C_U8 or t.code == C_I8):
        # A string into bytes: its UTF-8, escapes undone (never longer than
        # the escaped text; 4 bytes of room more, as js_unescape asks).
        r = js_string(c, &s, &n, &esc)
        if r:
            return r
        if jt_room(t, n + 4):
            return A_MEMORY
        if esc:
            m = js_unescape(s, n, t.buf + t.len, t.cap - t.len)
            if m < 0:
                return A_JSON
        else:
            memcpy(t.buf + t.len, s, n)
            m = n
        if not utf8_valid(t.buf + t.len, m):
            return A_SURROGATE
        t.len += m
        t.found = True
        return A_OK
    if c.p[0] != 0x5B:
        r = js_skip(c)
        return r if r else A_KIND
    c.p += 1
    js_ws(c)
    if c.p < c.end and c.p[0] == 0x5D:
        c.p += 1
        t.found = True
        return A_OK
    while True:
        js_ws(c)
        if c.p >= c.end:
            return A_TRUNCATED
        if t.len == t.cap:
            grown = <uint8_t*>realloc(t.buf, 2 * t.cap * t.size)
            if grown == NULL:
                return A_MEMORY  # not the value's fault: json_documents raises MemoryError
            t.buf, t.cap = grown, 2 * t.cap
        if c.p[0] == 0x6E and js_lit(c, "null", 4):
            r = A_NULL
        elif js_lit(c, "true", 4):
            r = put_int(t.buf + t.len * t.size, 1, t.code, 0, 1)
        elif js_lit(c, "false", 5):
            r = put_int(t.buf + t.len * t.size, 1, t.code, 0, 0)
        elif c.p[0] == 0x2D or c.p[0] == 0x4E or c.p[0] == 0x49 or 0x30 <= c.p[0] <= 0x39:
            r = js_put_number(c, t.buf + t.len * t.size, 1, t.code, 0)
        else:
            r = js_skip(c)
            r = r if r else A_KIND
        if r and not deferrable(r):
            return r
        if r:  # read on: the record is bad unless the key comes again
            if not held:
                held, held_value = r, c.err_value
        else:
            t.len += 1
        js_ws(c)
        if c.p >= c.end:
            return A_TRUNCATED
        if c.p[0] == 0x2C:
            c.p += 1
            continue
        if c.p[0] == 0x5D:
            c.p += 1
            t.found = True
            c.err_value = held_value
            return held
        return A_JSON


def json_documents(Layout layout, JsonPlan plan, values, Out out=None):
    """The variable-length field of each JSON object in ``values``, flat; the others in rows.

    ``plan`` has a variable-length field (``JsonPlan(varfield=)``); the other
    fields of each good value go into ``out``, one row per good value from
    row 0 (needed when there are other fields; ``len(values)`` rows). A
    value starting with a zero byte has the Confluent framing, skipped.
    Returns ``(tokens, lengths, counts, bad)``: the documents' elements as
    bytes, one length per good value, one count per value (1, or 0 for a bad
    one) and ``(index, reason)`` per bad value.
    """
    if plan.nfields != layout.nfields or plan.p.varfield < 0:
        raise ValueError("the plan was made for another layout, or reads no document")
    cdef _Values vals = _Values(values)
    if out is not None:
        out.fits(layout)
        if out.capacity < vals.n:
            raise ValueError(f"out holds {out.capacity} rows, {vals.n} values were given")
    elif layout.nfields != 1:
        raise ValueError("the fields beside the document need out=")
    cdef Py_ssize_t n = vals.n, m = n if n else 1, i, nbad = 0
    cdef AvBad* bad = <AvBad*>calloc(m, sizeof(AvBad))
    cdef uint8_t** rowp = <uint8_t**>calloc(layout.nfields, sizeof(uint8_t*))
    cdef uint8_t* written = <uint8_t*>calloc(layout.nfields, 1)
    cdef Deferred* pending = <Deferred*>calloc(layout.nfields, sizeof(Deferred))
    cdef uint8_t** dst = rowp if out is None else out.bufs.ptr
    lengths = np.zeros(n, np.int64)
    counts = np.zeros(n, np.int64)
    cdef int64_t[::1] lens = lengths, cnts = counts
    cdef uint64_t row = 0
    cdef int r = A_OK
    cdef JsCur c
    cdef JtCur t
    t.buf = NULL
    try:
        if not (bad and rowp and written and pending):
            raise MemoryError()
        t.code = plan.p.codes[plan.p.varfield]
        t.size = code_size(t.code)
        t.cap, t.len = 1024, 0
        t.buf = <uint8_t*>malloc(t.cap * t.size)
        if t.buf == NULL:
            raise MemoryError()
        c.row, c.written, c.doc, c.pending, c.npending = rowp, written, &t, pending, 0
        with nogil:
            for i in range(n):
                t.start = t.len  # (a value rejected before its record starts keeps it)
                r = js_one(&c, &plan.p, vals.ptr[i], vals.size[i], dst, row)
                if r == A_MEMORY:
                    break  # not the value's fault: raised below, nothing rejected
                if r == A_OK:
                    lens[i] = t.len - t.start
                    cnts[i] = 1
                    row += 1
                else:
                    t.len = t.start
                    js_bad(&bad[nbad], i, r, &c)
                    nbad += 1
        if r == A_MEMORY:
            raise MemoryError("no memory to grow a document")
        rejected = js_rejected(layout, plan, vals, bad, nbad)
        tokens = PyBytes_FromStringAndSize(<char*>t.buf, t.len * t.size)
        return tokens, lengths[counts > 0], counts, rejected
    finally:
        free(bad); free(rowp); free(written); free(pending); free(t.buf)
