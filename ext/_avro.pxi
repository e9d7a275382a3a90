# Avro binary -> fixed-shape rows, included into _codec.pyx (it writes into ``Out``).
#
# ``kfeed.avro`` compiles a writer schema and a kfeed Schema into a plan: a
# graph of nodes, one per writer type, each either read into a field or
# skipped. ``avro_decode`` walks the plan over each message value, writing
# straight into the output rows without the GIL and without a Python object
# per record. Every write is bounds-checked against the field's row, so no
# plan, however made, can write outside the output. A record that fails at
# any point is rejected whole: its row is written again by the next record.
#
# Wire facts (Avro 1.11 specification, "Binary Encoding"): int and long are
# zig-zag varints; float and double little-endian IEEE 754; bytes and string
# a long length then the bytes; fixed its size in bytes; enum an int index;
# a union an int branch index then the branch; arrays and maps a series of
# blocks, each a long count (negative: its absolute value, followed by the
# block's size in bytes) and that many items, ended by a count of 0. The
# Confluent framing puts a zero byte and a 4-byte big-endian schema id first.

# Writer type of a node. K_BAD: a type the field cannot take (reason in the
# plan's notes), failing every record that reaches it.
cdef enum AvKind:
    K_NULL = 0
    K_BOOLEAN
    K_INT
    K_LONG
    K_FLOAT
    K_DOUBLE
    K_BYTES
    K_STRING
    K_FIXED
    K_ENUM
    K_ARRAY
    K_MAP
    K_UNION
    K_RECORD
    K_BAD
    K_KINDS

# How a field stores an element.
cdef enum AvCode:
    C_BOOL = 1
    C_I8
    C_I16
    C_I32
    C_I64
    C_U8
    C_U16
    C_U32
    C_U64
    C_F32
    C_F64
    C_CODES

AVRO_CODES = {"bool": C_BOOL, "int8": C_I8, "int16": C_I16, "int32": C_I32, "int64": C_I64,
              "uint8": C_U8, "uint16": C_U16, "uint32": C_U32, "uint64": C_U64,
              "float32": C_F32, "float64": C_F64}
_CODE_DTYPES = {code: dtype for dtype, code in AVRO_CODES.items()}


cdef str field_dtype(Layout layout, int field, int code):
    """`` field 'NAME' (DTYPE)``, as reasons name the field a value went to; "" if none."""
    if field < 0:
        return ""
    return f" field {layout.names[field]!r} ({_CODE_DTYPES.get(code, '?')})"


AVRO_KINDS = {"null": K_NULL, "boolean": K_BOOLEAN, "int": K_INT, "long": K_LONG,
              "float": K_FLOAT, "double": K_DOUBLE, "bytes": K_BYTES, "string": K_STRING,
              "fixed": K_FIXED, "enum": K_ENUM, "array": K_ARRAY, "map": K_MAP,
              "union": K_UNION, "record": K_RECORD, "bad": K_BAD}

cdef enum AvErr:
    A_OK = 0
    A_TRUNCATED
    A_VARINT
    A_NEG_LENGTH
    A_UNION
    A_ENUM
    A_SYMBOL         # an enum symbol not among those the format names (Avro(enums=))
    A_BOOLEAN
    A_RANGE
    A_KIND
    A_NULL
    A_LENGTH
    A_DEPTH          # records nested deeper than AV_MAX_DEPTH
    A_MISSING
    A_TRAILING
    A_FRAME
    A_VALUE          # the value was rejected before decoding (a Reason in ``extra``)
    A_PLAN           # no plan for the value's schema id (a str reason from the caller)
    A_MEMORY         # a document could not grow
    A_RANGE_U64      # A_RANGE of an unsigned 64-bit value past int64 (its bits in the value)
    A_NESTING        # values nested deeper than AV_MAX_NESTING
    A_ITEMS          # more array or map items than a record of its size may hold (AV_FREE_ITEMS)
    A_SCALED         # a timestamp past int64 in the unit Avro(timestamps=) asks
    A_STRING_UTF8    # a string read into a document is not UTF-8

cdef enum:
    # Records nested deeper than this (a recursive type, which only a record
    # can be) fail the record, not the stack; so do values nested deeper than
    # AV_MAX_NESTING in all (arrays, maps and unions between the records).
    AV_MAX_DEPTH = 200
    AV_MAX_NESTING = 4000
    # Items that take no bytes each (nulls, empty records) are bounded by
    # this, a record's worth, so a forged count cannot spin the loop: a
    # record loops over at most its bytes plus this many items, in all its
    # arrays and maps (per block, 3-byte blocks of 65,536 free items each
    # took 70 s a 1 MB message).
    AV_FREE_ITEMS = 65536


cdef struct AvNode:
    int kind
    int field           # the field written, -1: skipped
    int code            # the field's AvCode when field >= 0
    int64_t size        # FIXED: bytes; ENUM: symbols; ARRAY into a field: items (-1: any);
                        # LONG into a field: > 1 multiplies the value (av_rescale)
    int64_t stride      # ARRAY into a field: elements per item; ENUM: 1 + where its
                        # symbols' numbers start in ``symbols`` (0: the writer's index);
                        # LONG into a field: > 1 divides the value, rounding down
    Py_ssize_t first    # children: kids[first:first + n]
    Py_ssize_t n


cdef struct AvPlan:
    AvNode* nodes
    Py_ssize_t nnodes
    Py_ssize_t* kids
    int64_t* symbols         # per writer symbol of a mapped enum: its number, -1: none
    Py_ssize_t nfields
    int* codes               # per field
    uint64_t* nelem          # per field: elements in one row
    const uint8_t** default  # per field: one row of its default, or NULL
    int varfield             # the variable-length field (a document), -1: none
    uint64_t var_default     # its default's elements (when default[varfield])


# Documents: one variable-length field per record, read into one growing
# buffer (``av_documents``, ``pb_documents``). A record's document starts at
# ``len``; ``reserve`` makes room for it and points the cursor's row there.
cdef struct VarOut:
    uint8_t* buf
    int64_t cap              # elements
    int64_t len              # elements of the documents taken so far
    int size                 # bytes an element


cdef int var_reserve(VarOut* v, int64_t need, uint8_t** row, uint64_t* nelem) noexcept nogil:
    """Room for ``need`` elements of the document at ``v.len``; ``row`` and ``nelem`` follow."""
    cdef int64_t cap = v.cap
    cdef uint8_t* grown
    if need > cap - v.len:
        while need > cap - v.len:
            cap *= 2
        grown = <uint8_t*>realloc(v.buf, cap * v.size)
        if grown == NULL:
            return A_MEMORY
        v.buf, v.cap = grown, cap
    row[0] = v.buf + v.len * v.size
    nelem[0] = v.cap - v.len
    return A_OK


cdef struct AvCur:
    const uint8_t* p
    const uint8_t* end
    const AvPlan* plan
    uint8_t** row            # per field: the record's row in the output
    uint64_t* nelem          # per field: elements the row holds
    uint8_t* written         # per field: set once the record wrote it
    VarOut* var              # documents: where the variable-length field goes
    int64_t vcount           # ... and the elements this record put there
    int depth                # records the value is inside
    int nesting              # values the value is inside: records, arrays, maps, unions
    int64_t items            # array and map items the record has looped over
    int64_t size             # the record's bytes
    Py_ssize_t err_node
    Py_ssize_t err_field
    int64_t err_value


cdef inline int code_size(int code) noexcept nogil:
    if code == C_BOOL or code == C_I8 or code == C_U8:
        return 1
    if code == C_I16 or code == C_U16:
        return 2
    if code == C_I32 or code == C_U32 or code == C_F32:
        return 4
    return 8


cdef int plan_fields(Layout layout, codes, defaults, int* out_codes, uint64_t* nelem,
                     const uint8_t** default, Py_ssize_t varfield) except -1:
    """Each field's element code, elements per row and default row, checked against the layout.

    The default rows point into ``defaults``' bytes: the plan holds that tuple.
    ``varfield``: the variable-length field (its row in the layout is one
    element; its default a document of any length), or -1.
    """
    cdef Py_ssize_t f
    if len(codes) != layout.nfields or len(defaults) != layout.nfields:
        raise ValueError("one code and one default per field are needed")
    for f in range(layout.nfields):
        code = codes[f]
        if not C_BOOL <= code < C_CODES:
            raise ValueError(f"field {f}: unknown code {code}")
        out_codes[f] = code
        if layout.row_bytes[f] % code_size(code):
            raise ValueError(f"field {f}: its row is not a whole number of elements")
        nelem[f] = layout.row_bytes[f] // code_size(code)
        d = defaults[f]
        if d is not None and f == varfield:
            if type(d) is not bytes or len(<bytes>d) % code_size(code):
                raise ValueError(f"field {f}: a document's default must be bytes of whole elements")
            default[f] = <const uint8_t*>PyBytes_AS_STRING(d)
        elif d is not None:
            if type(d) is not bytes or len(<bytes>d) != layout.row_bytes[f]:
                raise ValueError(f"field {f}: a default must be bytes of one row")
            default[f] = <const uint8_t*>PyBytes_AS_STRING(d)
    return 0


cdef class AvroPlan:
    """A compiled writer schema: how to read its records into a layout's fields.

    Made by ``kfeed.avro``, from arrays it checks here: ``nodes`` rows are
    (kind, field, code, size, stride, first, n), ``kids`` the children's node
    indices, ``codes`` each field's AvCode, ``defaults`` one row of bytes per
    field or None. ``notes`` names each node for error messages (its path, or
    why a K_BAD node cannot be read). ``symbols``: the numbers an enum node
    with ``stride > 0`` gives its writer's symbols (-1: a bad record);
    ``symbol_names``: such a node's writer's symbols, by node, for reasons.
    """

    cdef AvPlan p
    cdef readonly tuple notes
    cdef readonly dict symbol_names
    cdef readonly Py_ssize_t nfields
    cdef tuple _defaults

    def __cinit__(self, Layout layout, const int64_t[:, ::1] nodes, const int64_t[::1] kids,
                  codes, defaults, notes, Py_ssize_t varfield=-1, symbols=None,
                  symbol_names=None):
        cdef Py_ssize_t i, f, nn = nodes.shape[0], nk = kids.shape[0]
        cdef const int64_t[::1] syms = np.asarray(
            symbols if symbols is not None else (), np.int64).reshape(-1)
        cdef Py_ssize_t ns = syms.shape[0]
        cdef AvNode* nd
        self.nfields = layout.nfields
        if nodes.shape[1] != 7 or nn == 0:
            raise ValueError("nodes must have shape (n >= 1, 7)")
        if len(notes) != nn:
            raise ValueError("one note per node is needed")
        self.notes = tuple(str(x) for x in notes)
        self.symbol_names = dict(symbol_names or {})
        self._defaults = tuple(defaults)
        self.p.nnodes = nn
        self.p.nfields = layout.nfields
        self.p.nodes = <AvNode*>calloc(nn, sizeof(AvNode))
        self.p.kids = <Py_ssize_t*>calloc(nk if nk else 1, sizeof(Py_ssize_t))
        self.p.symbols = <int64_t*>calloc(ns if ns else 1, sizeof(int64_t))
        self.p.codes = <int*>calloc(layout.nfields, sizeof(int))
        self.p.nelem = <uint64_t*>calloc(layout.nfields, sizeof(uint64_t))
        self.p.default = <const uint8_t**>calloc(layout.nfields, sizeof(uint8_t*))
        if not (self.p.nodes and self.p.kids and self.p.codes and self.p.nelem
                and self.p.default and self.p.symbols):
            raise MemoryError()
        for i in range(ns):
            self.p.symbols[i] = syms[i]
        # A document: ``varfield``, read by nodes of no fixed size (arrays, bytes, strings).
        if not -1 <= varfield < layout.nfields:
            raise ValueError(f"field {varfield} is not in the layout")
        self.p.varfield = varfield
        for i in range(nn):
            if nodes[i, 3] == -1 and (nodes[i, 1] != varfield or varfield < 0 or
                                      nodes[i, 0] not in (K_ARRAY, K_BYTES, K_STRING)):
                raise ValueError(f"node {i}: only arrays, bytes and strings into the "
                                 f"variable-length field have no fixed size")
        plan_fields(layout, codes, defaults, self.p.codes, self.p.nelem, self.p.default,
                    self.p.varfield)
        self.p.var_default = 0
        if self.p.varfield >= 0 and defaults[self.p.varfield] is not None:
            self.p.var_default = (len(defaults[self.p.varfield])
                                  // code_size(self.p.codes[self.p.varfield]))
        for i in range(nk):
            if not 0 <= kids[i] < nn:
                raise ValueError(f"kid {i} is not a node")
            self.p.kids[i] = kids[i]
        for i in range(nn):
            nd = &self.p.nodes[i]
            nd.kind, nd.field, nd.code = nodes[i, 0], nodes[i, 1], nodes[i, 2]
            nd.size, nd.stride, nd.first, nd.n = nodes[i, 3], nodes[i, 4], nodes[i, 5], nodes[i, 6]
            if not 0 <= nd.kind < K_KINDS:
                raise ValueError(f"node {i}: unknown kind {nd.kind}")
            if not -1 <= nd.field < layout.nfields:
                raise ValueError(f"node {i}: field {nd.field} is not in the layout")
            if nd.field >= 0 and nd.code != self.p.codes[nd.field]:
                raise ValueError(f"node {i}: its code is not its field's")
            if nd.first < 0 or nd.n < 0 or nd.first > nk or nd.n > nk - nd.first:
                raise ValueError(f"node {i}: its children are not in kids")
            if (nd.kind == K_ARRAY or nd.kind == K_MAP) and nd.n != 1:
                raise ValueError(f"node {i}: an array or map has one child")
            if (nd.size < 0 and not (nd.size == -1 and nd.field == self.p.varfield >= 0)) \
                    or nd.stride < 0:
                raise ValueError(f"node {i}: negative size")
            if nd.kind == K_ENUM and nd.stride > 0 and nd.size > ns - (nd.stride - 1):
                raise ValueError(f"node {i}: its symbols are not in symbols")
            if nd.kind == K_LONG and nd.size > 1 and nd.stride > 1:
                raise ValueError(f"node {i}: a long is multiplied or divided, not both")

    def __dealloc__(self):
        free(self.p.nodes)
        free(self.p.kids)
        free(self.p.symbols)
        free(self.p.codes)
        free(self.p.nelem)
        free(self.p.default)


cdef inline int av_long(AvCur* c, int64_t* out) noexcept nogil:
    cdef uint64_t v = 0, b
    cdef int shift = 0
    while True:
        if c.p >= c.end:
            return A_TRUNCATED
        b = c.p[0]
        c.p += 1
        if shift == 63 and (b & 0xFE):
            return A_VARINT
        v |= (b & 0x7F) << shift
        if not (b & 0x80):
            break
        shift += 7
        if shift > 63:
            return A_VARINT
    out[0] = <int64_t>(v >> 1) ^ -(<int64_t>(v & 1))
    return A_OK


cdef inline int put_int(uint8_t* d, uint64_t nelem, int code, int64_t elem,
                        int64_t v) noexcept nogil:
    """Store integer ``v`` as element ``elem`` of a row of ``nelem`` ``code`` elements, if it fits."""
    if elem < 0 or <uint64_t>elem >= nelem:
        return A_LENGTH
    if code == C_I64:
        (<int64_t*>d)[elem] = v
    elif code == C_F32:
        (<float*>d)[elem] = <float>v
    elif code == C_F64:
        (<double*>d)[elem] = <double>v
    elif code == C_I32:
        if v < -<int64_t>0x80000000 or v > <int64_t>0x7FFFFFFF:
            return A_RANGE
        (<int32_t*>d)[elem] = <int32_t>v
    elif code == C_I16:
        if v < -32768 or v > 32767:
            return A_RANGE
        (<int16_t*>d)[elem] = <int16_t>v
    elif code == C_I8:
        if v < -128 or v > 127:
            return A_RANGE
        (<int8_t*>d)[elem] = <int8_t>v
    elif code == C_U8:
        if v < 0 or v > 255:
            return A_RANGE
        d[elem] = <uint8_t>v
    elif code == C_U16:
        if v < 0 or v > 65535:
            return A_RANGE
        (<uint16_t*>d)[elem] = <uint16_t>v
    elif code == C_U32:
        if v < 0 or v > <int64_t>0xFFFFFFFF:
            return A_RANGE
        (<uint32_t*>d)[elem] = <uint32_t>v
    elif code == C_U64:
        if v < 0:
            return A_RANGE
        (<uint64_t*>d)[elem] = <uint64_t>v
    elif code == C_BOOL:
        if v != 0 and v != 1:
            return A_KIND
        d[elem] = <uint8_t>v
    else:
        return A_KIND
    return A_OK


cdef inline int put_float(uint8_t* d, uint64_t nelem, int code, int64_t elem,
                          double v) noexcept nogil:
    if elem < 0 or <uint64_t>elem >= nelem:
        return A_LENGTH
    if code == C_F32:
        # (past float32's range: inf, as numpy's same_kind cast gives it)
        (<float*>d)[elem] = <float>v
    elif code == C_F64:
        (<double*>d)[elem] = v
    else:
        return A_KIND
    return A_OK


cdef inline int av_rescale(AvCur* c, const AvNode* nd, int64_t* v) noexcept nogil:
    """A timestamp in the unit ``Avro(timestamps=)`` asks: the writer's times
    ``nd.size``, or divided by ``nd.stride`` rounding down (as numpy's
    ``datetime64`` casts do, before 1970 too)."""
    cdef int64_t x = v[0], q
    if nd.size > 1:
        if x > INT64_MAX // nd.size or x < INT64_MIN // nd.size:
            c.err_value = x
            return A_SCALED
        v[0] = x * nd.size
    else:
        q = x // nd.stride  # (cdivision: toward zero)
        if x % nd.stride < 0:
            q -= 1
        v[0] = q
    return A_OK


cdef inline int av_store_int(AvCur* c, const AvNode* nd, int64_t elem, int64_t v) noexcept nogil:
    c.err_value = v
    cdef int r = put_int(c.row[nd.field], c.nelem[nd.field], nd.code, elem, v)
    if r == A_OK:
        c.written[nd.field] = 1
    return r


cdef inline int av_store_float(AvCur* c, const AvNode* nd, int64_t elem, double v) noexcept nogil:
    cdef int r = put_float(c.row[nd.field], c.nelem[nd.field], nd.code, elem, v)
    if r == A_OK:
        c.written[nd.field] = 1
    return r


cdef int av_items(AvCur* c, Py_ssize_t i, const AvNode* nd, int64_t elem) noexcept nogil:
    """An array's or map's blocks; into the field when the node has one."""
    cdef Py_ssize_t kid = c.plan.kids[nd.first]
    cdef const AvNode* item = &c.plan.nodes[kid]
    cdef int64_t count, nbytes, k = 0, j, left
    cdef int r
    cdef bint into = nd.field >= 0 and nd.kind == K_ARRAY
    cdef bint var = into and nd.size < 0  # a document: any number of items
    while True:
        r = av_long(c, &count)
        if r:
            return r
        if count == 0:
            break
        if count < 0:
            if count == INT64_MIN:
                return A_VARINT
            count = -count
            r = av_long(c, &nbytes)
            if r:
                return r
            if nbytes < 0:
                return A_NEG_LENGTH
            if not into and item.field < 0 and nd.kind == K_ARRAY:
                # Skipped whole: the block says how long it is.
                if nbytes > c.end - c.p:
                    return A_TRUNCATED
                c.p += nbytes
                continue
        if count > c.size + AV_FREE_ITEMS - c.items:
            c.err_value = count
            return A_ITEMS
        c.items += count
        if var:
            if var_reserve(c.var, elem + (k + count) * nd.stride, &c.row[nd.field],
                           &c.nelem[nd.field]):
                return A_MEMORY
        elif into and count > nd.size - k:
            c.err_node = i
            c.err_value = k + count
            return A_LENGTH
        if into:
            left = c.end - c.p
            if item.kind == K_FLOAT and nd.code == C_F32 and nd.stride == 1:
                if count * 4 > left:
                    return A_TRUNCATED
                if <uint64_t>(elem + k + count) > c.nelem[nd.field]:
                    return A_LENGTH
                copy_out(c.row[nd.field] + (elem + k) * 4, c.p, count * 4, var)
                c.p += count * 4
                k += count
                continue
            if item.kind == K_DOUBLE and nd.code == C_F64 and nd.stride == 1:
                if count * 8 > left:
                    return A_TRUNCATED
                if <uint64_t>(elem + k + count) > c.nelem[nd.field]:
                    return A_LENGTH
                copy_out(c.row[nd.field] + (elem + k) * 8, c.p, count * 8, var)
                c.p += count * 8
                k += count
                continue
        for j in range(count):
            if nd.kind == K_MAP:
                r = av_long(c, &nbytes)  # the key, a string
                if r:
                    return r
                if nbytes < 0:
                    return A_NEG_LENGTH
                if nbytes > c.end - c.p:
                    return A_TRUNCATED
                c.p += nbytes
            r = av_read(c, kid, elem + (k + j) * nd.stride)
            if r:
                return r
        k += count
    if var:
        c.vcount = k
    elif into and k != nd.size:
        c.err_node = i
        c.err_value = k
        return A_LENGTH
    if into:
        c.written[nd.field] = 1
    return A_OK


cdef int av_read(AvCur* c, Py_ssize_t i, int64_t elem) noexcept nogil:
    """Read one value of node ``i``; into element ``elem`` of its field, if it has one.

    An error names the innermost node it came from (``err_node``), for the
    reason's "at <path>", a field skipped whole included.
    """
    cdef int r = av_value(c, i, elem)
    if r and c.err_node < 0:
        c.err_node = i
    return r


cdef inline int av_value(AvCur* c, Py_ssize_t i, int64_t elem) noexcept nogil:
    cdef const AvNode* nd = &c.plan.nodes[i]
    cdef int64_t v
    cdef int r = A_OK
    cdef Py_ssize_t k
    cdef float fv
    cdef double dv
    cdef int kind = nd.kind
    if kind == K_NULL:
        if nd.field >= 0:  # an element cannot be null
            r = A_NULL
    elif kind == K_BOOLEAN:
        if c.p >= c.end:
            return A_TRUNCATED
        v = c.p[0]
        c.p += 1
        if v > 1:
            c.err_value = v
            r = A_BOOLEAN
        elif nd.field >= 0:
            r = av_store_int(c, nd, elem, v)
    elif kind == K_INT or kind == K_LONG or kind == K_ENUM:
        r = av_long(c, &v)
        if r == A_OK and kind == K_ENUM and (v < 0 or v >= nd.size):
            c.err_value = v
            r = A_ENUM
        elif r == A_OK and kind == K_ENUM and nd.stride > 0:
            c.err_value = v
            v = c.plan.symbols[nd.stride - 1 + v]
            if v < 0:
                r = A_SYMBOL
        elif r == A_OK and kind == K_LONG and (nd.size > 1 or nd.stride > 1):
            r = av_rescale(c, nd, &v)
        if r == A_OK and nd.field >= 0:
            r = av_store_int(c, nd, elem, v)
    elif kind == K_FLOAT:
        if c.end - c.p < 4:
            return A_TRUNCATED
        if nd.field >= 0:
            memcpy(&fv, c.p, 4)
            r = av_store_float(c, nd, elem, fv)
        c.p += 4
    elif kind == K_DOUBLE:
        if c.end - c.p < 8:
            return A_TRUNCATED
        if nd.field >= 0:
            memcpy(&dv, c.p, 8)
            r = av_store_float(c, nd, elem, dv)
        c.p += 8
    elif kind == K_BYTES or kind == K_STRING:
        r = av_long(c, &v)
        if r:
            return r
        if v < 0:
            return A_NEG_LENGTH
        if v > c.end - c.p:
            return A_TRUNCATED
        if nd.field >= 0:  # a document of bytes
            if nd.field == c.plan.varfield and var_reserve(c.var, v, &c.row[nd.field],
                                                           &c.nelem[nd.field]):
                return A_MEMORY
            if elem != 0 or <uint64_t>v > c.nelem[nd.field]:
                return A_LENGTH
            if kind == K_STRING and not utf8_valid(c.p, v):
                return A_STRING_UTF8
            memcpy(c.row[nd.field], c.p, v)
            c.vcount = v
            c.written[nd.field] = 1
        c.p += v
    elif kind == K_FIXED:
        if c.end - c.p < nd.size:
            return A_TRUNCATED
        if nd.field >= 0:
            if elem < 0 or <uint64_t>(elem + nd.size) > c.nelem[nd.field]:
                r = A_LENGTH
            else:
                memcpy(c.row[nd.field] + elem, c.p, nd.size)
                c.written[nd.field] = 1
        c.p += nd.size
    elif kind == K_UNION:
        r = av_long(c, &v)
        if r:
            return r
        if v < 0 or v >= nd.n:
            c.err_value = v
            r = A_UNION
        else:
            c.nesting += 1
            if c.nesting > AV_MAX_NESTING:
                return A_NESTING
            r = av_read(c, c.plan.kids[nd.first + v], elem)
            c.nesting -= 1
            return r
    elif kind == K_RECORD:
        c.depth += 1
        c.nesting += 1
        if c.depth > AV_MAX_DEPTH:
            return A_DEPTH
        if c.nesting > AV_MAX_NESTING:
            return A_NESTING
        for k in range(nd.n):
            r = av_read(c, c.plan.kids[nd.first + k], elem)
            if r:
                return r
        c.depth -= 1
        c.nesting -= 1
    elif kind == K_ARRAY or kind == K_MAP:
        c.nesting += 1
        if c.nesting > AV_MAX_NESTING:
            return A_NESTING
        r = av_items(c, i, nd, elem)
        c.nesting -= 1
    else:  # K_BAD
        r = A_KIND
    return r


cdef int av_record(AvCur* c, const AvPlan* plan, const uint8_t* p, const uint8_t* end,
                   uint8_t** dst, uint64_t row) noexcept nogil:
    """One record into row ``row`` of ``dst``; then defaults for the fields it left out."""
    cdef Py_ssize_t f
    c.plan = plan
    c.p = p
    c.end = end
    c.size = end - p
    c.items = 0
    c.depth = 0
    c.nesting = 0
    c.err_node = -1
    c.err_field = -1
    c.err_value = 0
    c.vcount = 0
    for f in range(plan.nfields):
        c.written[f] = 0
        if f == plan.varfield:  # at the documents' end, made room for as it is read
            c.row[f] = c.var.buf + c.var.len * c.var.size
            c.nelem[f] = c.var.cap - c.var.len
            continue
        c.row[f] = dst[f] + row * plan.nelem[f] * code_size(plan.codes[f])
        c.nelem[f] = plan.nelem[f]
    cdef int r = av_read(c, 0, 0)
    if r:
        return r
    if c.p != c.end:
        c.err_value = c.end - c.p
        return A_TRAILING
    for f in range(plan.nfields):
        if not c.written[f]:
            if plan.default[f] == NULL:
                c.err_field = f
                return A_MISSING
            if f == plan.varfield:
                if var_reserve(c.var, plan.var_default, &c.row[f], &c.nelem[f]):
                    return A_MEMORY
                memcpy(c.row[f], plan.default[f], plan.var_default * c.var.size)
                c.vcount = plan.var_default
                continue
            memcpy(c.row[f], plan.default[f], plan.nelem[f] * code_size(plan.codes[f]))
    return A_OK


cdef struct AvBad:
    Py_ssize_t index
    int err
    Py_ssize_t node
    Py_ssize_t field
    int64_t value
    Py_ssize_t skip     # bytes of framing before the record


def avro_decode(Layout layout, plans, values, Out out, uint64_t row, bint framed):
    """Decode Avro message values into ``out`` from ``row`` on, one record per value.

    ``plans``: the ``AvroPlan`` of every value (not framed), or a dict from
    Confluent schema id to its ``AvroPlan``, or to a str saying why its values
    are rejected (framed). Returns ``(rows, consumed, bad, need)``: rows
    written, values used, ``[(index, reason)]``, and the schema id of value
    ``consumed`` when ``plans`` has no entry for it (None otherwise): the
    caller compiles it and calls again from there.
    """
    out.fits(layout)
    if row > out.capacity:
        raise ValueError(f"row {row} is past the end of the output ({out.capacity} rows)")
    cdef _Values vals = _Values(values)
    cdef Py_ssize_t n = vals.n, m = n if n else 1, i, nbad = 0, f
    cdef const AvPlan** vp = <const AvPlan**>calloc(m, sizeof(AvPlan*))
    cdef Py_ssize_t* skip = <Py_ssize_t*>calloc(m, sizeof(Py_ssize_t))
    cdef AvBad* bad = <AvBad*>calloc(m, sizeof(AvBad))
    cdef uint8_t** rowp = <uint8_t**>calloc(layout.nfields, sizeof(uint8_t*))
    cdef uint64_t* nelem = <uint64_t*>calloc(layout.nfields, sizeof(uint64_t))
    cdef uint8_t* written = <uint8_t*>calloc(layout.nfields, 1)
    cdef AvCur c
    cdef uint64_t out_row = row
    cdef int r
    owners = {}  # AvPlan address -> its AvroPlan, for the reasons
    reasons = {}
    if not (vp and skip and bad and rowp and nelem and written):
        free(vp); free(skip); free(bad); free(rowp); free(nelem); free(written)
        raise MemoryError()
    try:
        n, need = av_plans(plans, vals, framed, layout.nfields, False, vp, skip, owners, reasons)
        c.row, c.nelem, c.written, c.var = rowp, nelem, written, NULL
        with nogil:
            i = 0
            while i < n and out_row < out.capacity:
                if vals.size[i] < 0:
                    r = A_VALUE
                    c.err_value = -vals.size[i]
                elif framed and (vals.size[i] < 5 or vals.ptr[i][0] != 0):
                    r = A_FRAME
                    c.err_value = vals.ptr[i][0] if vals.size[i] > 0 else -1
                elif vp[i] == NULL:
                    r = A_PLAN
                else:
                    r = av_record(&c, vp[i], vals.ptr[i] + skip[i], vals.ptr[i] + vals.size[i],
                                  out.bufs.ptr, out_row)
                if r == A_OK:
                    out_row += 1
                else:
                    bad[nbad].index = i
                    bad[nbad].err = r
                    bad[nbad].node = c.err_node if r != A_VALUE else -1
                    bad[nbad].field = c.err_field
                    bad[nbad].value = c.err_value
                    bad[nbad].skip = skip[i]
                    c.err_node = -1
                    c.err_field = -1
                    nbad += 1
                i += 1
            stream_fence()
        if i < n:
            need = None  # stopped on a full output, before the unknown id
        rejected = []
        for k in range(nbad):
            idx = bad[k].index
            if bad[k].err == A_PLAN:
                rejected.append((idx, reasons.get(idx, "no plan for the value's schema")))
            elif bad[k].err == A_VALUE:
                rejected.append((idx, REASONS[bad[k].value]))
            else:
                owner = owners.get(<uintptr_t>vp[idx])
                rejected.append((idx, _avro_reason(layout, owner, bad[k], vals.size[idx])))
        return out_row - row, i, rejected, need
    finally:
        free(vp); free(skip); free(bad); free(rowp); free(nelem); free(written)


cdef tuple av_plans(plans, _Values vals, bint framed, Py_ssize_t nfields, bint documents,
                    const AvPlan** vp, Py_ssize_t* skip, dict owners, dict reasons):
    """Each value's plan into ``vp`` (and its framing's bytes into ``skip``), under the GIL.

    Returns ``(n, need)``: the values looked up, and the schema id of value
    ``n`` when ``plans`` has no entry for it (None when all were found).
    Framed values look their id up only when it changes.
    """
    cdef Py_ssize_t i, n = vals.n
    cdef AvroPlan plan
    cdef uint32_t sid, last_sid = 0
    cdef const AvPlan* last = NULL
    if not framed:
        if not isinstance(plans, AvroPlan):
            raise TypeError("plans must be an AvroPlan for values without framing")
        entries = [plans]
    else:
        entries = [e for e in plans.values() if isinstance(e, AvroPlan)]
    for entry in entries:
        plan = <AvroPlan>entry
        if plan.nfields != nfields:
            raise ValueError("the plan was made for another layout")
        if (plan.p.varfield >= 0) != documents:
            raise ValueError("documents need a plan with a variable-length field"
                             if documents else "a plan with a variable-length field reads "
                             "documents: avro_documents")
    if not framed:
        plan = <AvroPlan>plans
        owners[<uintptr_t>&plan.p] = plan
        for i in range(n):
            vp[i] = &plan.p
        return n, None
    for i in range(n):
        if vals.size[i] < 5 or vals.ptr[i][0] != 0:
            continue  # rejected as a bad frame
        sid = load_u32_be(vals.ptr[i] + 1)
        skip[i] = 5
        if last != NULL and sid == last_sid:
            vp[i] = last
            continue
        entry = plans.get(sid)
        if entry is None:
            return i, sid
        if isinstance(entry, AvroPlan):
            plan = <AvroPlan>entry
            owners[<uintptr_t>&plan.p] = plan
            vp[i] = &plan.p
            last, last_sid = vp[i], sid
        else:
            reasons[i] = str(entry)
            last = NULL
    return n, None


def avro_documents(Layout layout, plans, values, bint framed, int code, Out out=None):
    """The variable-length field of each Avro value in ``values``, flat; the others in rows.

    ``layout``'s variable-length field is the plans' (``AvroPlan(varfield=)``),
    of element code ``code``; ``plans`` as for ``avro_decode``. The other
    fields of each good value go into ``out``, one row per good value from
    row 0 (needed when there are other fields; ``len(values)`` rows). Returns ``(tokens,
    lengths, counts, bad, need)``: the documents' elements as bytes, one
    length per good value, one count per value (1, or 0 for a bad one),
    ``(index, reason)`` per bad value, and ``need`` as ``avro_decode`` gives
    it (the values from ``len(counts)`` on were not read).
    """
    if not C_BOOL <= code < C_CODES:
        raise ValueError(f"unknown element code {code}")
    cdef _Values vals = _Values(values)
    if out is not None:
        out.fits(layout)
        if out.capacity < vals.n:
            raise ValueError(f"out holds {out.capacity} rows, {vals.n} values were given")
    elif layout.nfields != 1:
        raise ValueError("the fields beside the document need out=")
    cdef Py_ssize_t n = vals.n, m = n if n else 1, i, nbad = 0
    cdef const AvPlan** vp = <const AvPlan**>calloc(m, sizeof(AvPlan*))
    cdef Py_ssize_t* skip = <Py_ssize_t*>calloc(m, sizeof(Py_ssize_t))
    cdef AvBad* bad = <AvBad*>calloc(m, sizeof(AvBad))
    cdef uint8_t** rowp = <uint8_t**>calloc(layout.nfields, sizeof(uint8_t*))
    cdef uint64_t* nelem = <uint64_t*>calloc(layout.nfields, sizeof(uint64_t))
    cdef uint8_t* written = <uint8_t*>calloc(layout.nfields, 1)
    cdef uint8_t** dst = rowp if out is None else out.bufs.ptr
    cdef uint64_t row = 0
    cdef VarOut var
    cdef AvCur c
    cdef int r = A_OK
    cdef int64_t[::1] lens, cnts
    owners = {}
    reasons = {}
    var.buf = NULL
    try:
        if not (vp and skip and bad and rowp and nelem and written):
            raise MemoryError()
        n, need = av_plans(plans, vals, framed, layout.nfields, True, vp, skip, owners, reasons)
        var.size, var.cap, var.len = code_size(code), 1024, 0
        var.buf = <uint8_t*>malloc(var.cap * var.size)
        if var.buf == NULL:
            raise MemoryError()
        lengths = np.zeros(n, np.int64)
        counts = np.zeros(n, np.int64)
        lens = lengths
        cnts = counts
        c.row, c.nelem, c.written, c.var = rowp, nelem, written, &var
        with nogil:
            for i in range(n):
                c.err_node, c.err_field, c.err_value = -1, -1, 0
                if vals.size[i] < 0:
                    r = A_VALUE
                    c.err_value = -vals.size[i]
                elif framed and (vals.size[i] < 5 or vals.ptr[i][0] != 0):
                    r = A_FRAME
                    c.err_value = vals.ptr[i][0] if vals.size[i] > 0 else -1
                elif vp[i] == NULL:
                    r = A_PLAN
                elif vp[i].codes[vp[i].varfield] != code:
                    r = A_KIND
                else:
                    r = av_record(&c, vp[i], vals.ptr[i] + skip[i], vals.ptr[i] + vals.size[i],
                                  dst, row)
                if r == A_MEMORY:
                    break  # not the record's fault: raised below, nothing rejected
                if r == A_OK:
                    lens[i] = c.vcount
                    cnts[i] = 1
                    var.len += c.vcount
                    row += 1
                else:
                    bad[nbad].index, bad[nbad].err = i, r
                    bad[nbad].node = c.err_node if r != A_VALUE else -1
                    bad[nbad].field, bad[nbad].value = c.err_field, c.err_value
                    bad[nbad].skip = skip[i]
                    nbad += 1
            stream_fence()  # (the fields beside the documents)
        if r == A_MEMORY:
            raise MemoryError("no memory to grow a document")
        rejected = []
        for k in range(nbad):
            idx = bad[k].index
            if bad[k].err == A_PLAN:
                rejected.append((idx, reasons.get(idx, "no plan for the value's schema")))
            elif bad[k].err == A_VALUE:
                rejected.append((idx, REASONS[bad[k].value]))
            else:
                owner = owners.get(<uintptr_t>vp[idx])
                rejected.append((idx, _avro_reason(layout, owner, bad[k], vals.size[idx])))
        tokens = PyBytes_FromStringAndSize(<char*>var.buf, var.len * var.size)
        return tokens, lengths[counts > 0], counts, rejected, need
    finally:
        free(vp); free(skip); free(bad); free(var.buf); free(rowp); free(nelem); free(written)


cdef inline uint32_t load_u32_be(const uint8_t* p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef str _avro_reason(Layout layout, AvroPlan plan, AvBad b, Py_ssize_t size):
    cdef int err = b.err
    if err == A_FRAME:
        if size < 5:
            return f"{size} bytes: too short for the Confluent framing (5 bytes)"
        return f"magic byte {b.value}, expected 0 (Confluent framing)"
    where = f" at {plan.notes[b.node]}" if plan is not None and b.node >= 0 else ""
    if err == A_MISSING:
        return f"field {layout.names[b.field]!r}: missing or null, and no default"
    if err == A_TRUNCATED:
        return f"truncated{where}"
    if err == A_VARINT:
        return f"malformed varint{where}"
    if err == A_NEG_LENGTH:
        return f"negative length{where}"
    if err == A_UNION:
        return f"union branch {b.value} does not exist{where}"
    if err == A_ENUM:
        return f"enum index {b.value} out of range{where}"
    if err == A_SYMBOL:
        names = plan.symbol_names.get(b.node, ()) if plan is not None else ()
        symbol = repr(names[b.value]) if 0 <= b.value < len(names) else f"number {b.value}"
        return f"the writer's enum symbol {symbol} is not among those enums= names{where}"
    if err == A_BOOLEAN:
        return f"boolean byte {b.value}{where}"
    if err == A_RANGE:
        into = "the field's dtype"
        if plan is not None and b.node >= 0 and plan.p.nodes[b.node].field >= 0:
            into = field_dtype(layout, plan.p.nodes[b.node].field,
                               plan.p.nodes[b.node].code).lstrip()
        return f"{b.value} does not fit {into}{where}"
    if err == A_SCALED:
        return f"timestamp {b.value} does not fit int64 in the unit timestamps= asks{where}"
    if err == A_STRING_UTF8:
        return f"a string that is not UTF-8{where}"
    if err == A_KIND:
        return f"cannot be read{where}"
    if err == A_NULL:
        return f"null element{where}"
    if err == A_LENGTH:
        return f"array of {b.value} items does not match the field's shape{where}"
    if err == A_DEPTH:
        return f"records nested deeper than {AV_MAX_DEPTH}{where}"
    if err == A_ITEMS:
        return (f"a block of {b.value:,} items: past the record's bytes plus {AV_FREE_ITEMS:,}, "
                f"the bound on items that take no bytes (nulls, empty records){where}")
    if err == A_NESTING:
        return f"nested deeper than {AV_MAX_NESTING} arrays, maps, unions and records{where}"
    if err == A_TRAILING:
        return f"{b.value} bytes left after the record"
    if err == A_MEMORY:
        return f"out of memory for the document{where}"
    return f"error {err}{where}"


# -- writing: fixed-shape rows -> Avro binary --------------------------------
#
# ``kfeed.avro.writer_schema`` derives the writer schema from a kfeed Schema:
# one Avro field per kfeed field, nested records for dotted sources, nested
# arrays for shapes, ``boolean``/``int``/``long``/``float``/``double`` for the
# dtypes. ``avro_encode`` writes each row in that schema's order: ``order``
# lists the fields as the schema meets them.

cdef inline uint8_t* av_put_long(uint8_t* d, int64_t v) noexcept nogil:
    cdef uint64_t z = (<uint64_t>v << 1) ^ <uint64_t>(v >> 63)
    while z >= 0x80:
        d[0] = <uint8_t>(z | 0x80)
        d += 1
        z >>= 7
    d[0] = <uint8_t>z
    return d + 1


cdef inline uint8_t* av_put_elem(uint8_t* d, const uint8_t* s, int code) noexcept nogil:
    """One element of ``code`` at ``s`` as its Avro type."""
    cdef int8_t i8
    cdef int16_t i16
    cdef int32_t i32
    cdef int64_t i64
    cdef uint16_t u16
    cdef uint32_t u32
    if code == C_BOOL:
        d[0] = 1 if s[0] else 0
        return d + 1
    if code == C_F32:
        memcpy(d, s, 4)
        return d + 4
    if code == C_F64:
        memcpy(d, s, 8)
        return d + 8
    if code == C_I8:
        memcpy(&i8, s, 1)
        i64 = i8
    elif code == C_U8:
        i64 = s[0]
    elif code == C_I16:
        memcpy(&i16, s, 2)
        i64 = i16
    elif code == C_U16:
        memcpy(&u16, s, 2)
        i64 = u16
    elif code == C_I32:
        memcpy(&i32, s, 4)
        i64 = i32
    elif code == C_U32:
        memcpy(&u32, s, 4)
        i64 = u32
    else:  # C_I64 (C_U64 has no Avro type: refused before)
        memcpy(&i64, s, 8)
    return av_put_long(d, i64)


cdef uint8_t* av_put_items(uint8_t* d, const uint8_t* s, int code, int size,
                           const int64_t* dims, int ndim, int64_t* elem) noexcept nogil:
    """A value of shape ``dims`` as nested Avro arrays (a scalar when ``ndim`` is 0)."""
    cdef int64_t i
    if ndim == 0:
        d = av_put_elem(d, s + elem[0] * size, code)
        elem[0] += 1
        return d
    if dims[0] > 0:
        d = av_put_long(d, dims[0])
        for i in range(dims[0]):
            d = av_put_items(d, s, code, size, dims + 1, ndim - 1, elem)
    d[0] = 0  # the end of the array
    return d + 1


def avro_encode(Layout layout, list columns, uint64_t n, list order, list field_codes,
                list shapes, bytes prefix):
    """``n`` rows of ``columns`` as Avro binary values, each after ``prefix``.

    ``order``: the field indices in the writer schema's order;
    ``field_codes``: each field's element code (``AVRO_CODES``; uint64 has no
    Avro type and is refused before); ``shapes``: each field's shape, written
    as nested arrays. A shape that does not match the field's row bytes is a
    ValueError: no row is read past its end.
    """
    cdef _Buffers src = fixed_columns(layout, columns, n)
    cdef Py_ssize_t nf = len(order), k, f, j
    cdef int* codes = <int*>calloc(nf + 1, sizeof(int))
    cdef int* sizes = <int*>calloc(nf + 1, sizeof(int))
    cdef int* nd = <int*>calloc(nf + 1, sizeof(int))
    cdef int* fidx = <int*>calloc(nf + 1, sizeof(int))
    cdef int64_t* dims = <int64_t*>calloc(nf * 8 + 1, sizeof(int64_t))
    cdef uint8_t* buf = NULL
    cdef uint64_t bound = len(prefix), levels, nelem, r
    cdef int64_t elem
    cdef uint8_t* d
    cdef list out = []
    try:
        if not (codes and sizes and nd and fidx and dims):
            raise MemoryError()
        for k in range(nf):
            f = order[k]
            shape = shapes[f]
            if len(shape) > 8:
                raise ValueError("at most 8 dimensions")
            if not 0 <= f < layout.nfields:
                raise ValueError(f"field {f} is not in the layout")
            fidx[k] = f
            codes[k] = field_codes[f]
            if not C_BOOL <= codes[k] < C_CODES or codes[k] == C_U64:
                raise ValueError(f"element code {codes[k]} has no Avro type")
            sizes[k] = code_size(codes[k])
            nd[k] = len(shape)
            nelem = 1
            levels = 0
            for j in range(nd[k]):
                dims[k * 8 + j] = shape[j]
                if shape[j] < 0:
                    raise ValueError("a negative dimension")
                levels += nelem  # one count and one end per array met
                nelem *= shape[j]
            if nelem * sizes[k] != layout.row_bytes[f]:
                raise ValueError(f"field {f}: shape {shape} is not its {layout.row_bytes[f]} "
                                 f"bytes a row")
            bound += nelem * 10 + levels * 11
        buf = <uint8_t*>malloc(bound + 1)
        if buf == NULL:
            raise MemoryError()
        memcpy(buf, PyBytes_AS_STRING(prefix), len(prefix))
        for r in range(n):
            d = buf + len(prefix)
            for k in range(nf):
                f = fidx[k]
                elem = 0
                d = av_put_items(d, src.ptr[f] + r * layout.row_bytes[f], codes[k], sizes[k],
                                 dims + k * 8, nd[k], &elem)
            out.append(PyBytes_FromStringAndSize(<char*>buf, d - buf))
    finally:
        free(codes)
        free(sizes)
        free(nd)
        free(fidx)
        free(dims)
        free(buf)
    return out
