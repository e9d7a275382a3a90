# Protobuf binary -> fixed-shape rows, included into _codec.pyx after _avro.pxi
# (it shares its element stores and error codes, and writes into ``Out``).
#
# ``kfeed.protobuf`` compiles a message class's descriptor and a kfeed Schema
# into a plan: per message type, only the fields that lead to a kfeed field,
# sorted by number. Every other field is skipped by its wire type, so unknown
# fields cost a skip. ``pb_decode`` reads one message per value, without the
# GIL and without a Python object per record.
#
# Wire facts (protobuf's "Encoding" guide): a record is a series of (tag,
# value); the tag is a varint, field number << 3 | wire type; wire type 0 is
# a varint, 1 eight little-endian bytes, 2 a varint length then that many
# bytes (strings, bytes, messages, packed repeated scalars), 5 four bytes.
# A field may appear several times: the last value of a scalar wins, a
# repeated field collects them all, packed or not. A known field in a wire
# type that is not its type's (bar a repeated scalar's packed or unpacked
# form) is parsed by protobuf as an unknown field: skipped here too, so the
# field stays as it was (unset, if nothing else set it). Of the members of a
# oneof, protobuf keeps the last one parsed: each member's entry names the
# fields the others lead to, unset when it is read (a member the schema does
# not read has an entry for that alone). int32 and enum negatives
# are sign-extended to 10-byte varints; sint32/sint64 are zig-zag. Absent
# fields read as zero (proto3). A closed (proto2) enum's value that is none
# of the enum's is kept by protobuf among the unknown fields: skipped here,
# packed or not, the field and its oneof left as they were. The Confluent framing puts a zero byte, a
# 4-byte big-endian schema id and the message-index array (a zig-zag varint
# count, then that many zig-zag varints; a single 0 byte for [0]) first.

cdef enum PbKind:
    P_INT32 = 0
    P_INT64
    P_UINT32
    P_UINT64
    P_SINT32
    P_SINT64
    P_BOOL
    P_ENUM
    P_FIXED32
    P_SFIXED32
    P_FLOAT
    P_FIXED64
    P_SFIXED64
    P_DOUBLE
    P_MESSAGE
    P_BYTES          # bytes, or a string protobuf does not check: only into a document of bytes
    P_STRING         # a string protobuf checks is UTF-8 (proto3's): as P_BYTES, checked
    P_GROUP          # a proto2 group: only a oneof member the schema does not read
    P_KINDS

PB_KINDS = {"int32": P_INT32, "int64": P_INT64, "uint32": P_UINT32, "uint64": P_UINT64,
            "sint32": P_SINT32, "sint64": P_SINT64, "bool": P_BOOL, "enum": P_ENUM,
            "fixed32": P_FIXED32, "sfixed32": P_SFIXED32, "float": P_FLOAT,
            "fixed64": P_FIXED64, "sfixed64": P_SFIXED64, "double": P_DOUBLE,
            "message": P_MESSAGE, "string": P_STRING, "bytes": P_BYTES, "group": P_GROUP}

cdef enum:
    A_TAG = 101      # field number 0, a group's end without its start, wire type 6 or 7
    A_INDEXES        # the Confluent message-index array is malformed
    A_NOT_UTF8       # a string protobuf checks is not UTF-8
    PB_MAX_DEPTH = 100

# A scalar entry whose value goes into its field's one element as it is read
# (``pb_store``): the kinds and codes most events hold, where no range or
# length check can fail. Every other entry goes through ``pb_value``.
cdef enum:
    D_NONE = 0
    D_I64            # int64 into int64
    D_I32            # int32 or an open enum into int32
    D_I32_I64        # int32 or an open enum into int64
    D_BOOL           # bool into bool
    D_F64            # double into float64
    D_F64_F32        # double into float32
    D_F32            # float into float32
    D_F32_F64        # float into float64


cdef struct PbEntry:
    uint32_t number
    int kind
    int field        # the field written; P_MESSAGE: -1; -1 and msg -1: none, skipped
    int code
    uint8_t repeated  # elements go one after another (a repeated scalar)
    uint8_t closed    # a closed (proto2) enum: its values in the plan's enum_values,
                      # [enum_at[i], enum_at[i + 1]) for entry i
    uint8_t wire      # the wire type of one value of ``kind`` (pb_wire)
    uint8_t direct    # D_*: a scalar stored as it is read, no check to make
    Py_ssize_t msg   # P_MESSAGE: the message type's index
    Py_ssize_t clear_first  # a oneof member: the fields its oneof's other members
    Py_ssize_t clear_n      # lead to, clear_fields[clear_first:clear_first + clear_n]


cdef struct PbMsg:
    Py_ssize_t first   # entries[first:first + n], sorted by number
    Py_ssize_t n


cdef struct PbPlan:
    PbEntry* entries
    Py_ssize_t nentries
    PbMsg* msgs
    Py_ssize_t nmsgs
    Py_ssize_t nfields
    int* clear_fields        # the entries' fields to unset when they are read
    int32_t* enum_values     # the closed enums' values, each enum's sorted
    Py_ssize_t* enum_at      # per entry and one more: where its values start
    int* codes
    uint64_t* nelem
    uint64_t* rowbytes       # per field: nelem times the element's size
    uint8_t* repeated        # per field: filled by a repeated entry
    const uint8_t** default  # per field: one row, or NULL (zeros, or bad if repeated)
    int varfield             # the variable-length field (a document), -1: none
    uint64_t var_default     # its default's elements (when default[varfield])


cdef struct Deferred:
    # A value its field cannot take, which a later one may replace (NOTE [ The
    # value the parser keeps ]): 0, or the A_* reason; the plan's entry (node,
    # in JSON) that read it; the value.
    int err
    Py_ssize_t node
    int64_t value


cdef inline void defer(Deferred* d, Py_ssize_t* waiting, int err, Py_ssize_t node,
                       int64_t value, bint first) noexcept nogil:
    """The value waits in ``d`` (``first``: unless one waits already, as a repeated
    field's elements add up)."""
    if d.err and first:
        return
    if not d.err:
        waiting[0] += 1
    d.err, d.node, d.value = err, node, value


cdef inline void settle(Deferred* d, Py_ssize_t* waiting) noexcept nogil:
    """The value waiting in ``d``, if any, is dropped: replaced, or cleared."""
    if d.err:
        d.err = 0
        waiting[0] -= 1


cdef inline void unwait(Deferred* pending, Py_ssize_t* waiting, Py_ssize_t n) noexcept nogil:
    """A record starts: nothing waits (a record that ended early may have left some)."""
    if waiting[0]:
        memset(pending, 0, n * sizeof(Deferred))
        waiting[0] = 0


cdef inline Py_ssize_t first_waiting(const Deferred* pending, Py_ssize_t waiting,
                                     Py_ssize_t n) noexcept nogil:
    """The record's end: the first of ``n`` fields whose value still waits, or -1."""
    cdef Py_ssize_t f
    if waiting:
        for f in range(n):
            if pending[f].err:
                return f
    return -1


cdef struct PbCur:
    const uint8_t* p
    const PbPlan* plan
    uint8_t** row
    uint64_t* nelem          # per field: elements the row holds
    uint8_t* written
    uint64_t* count          # per field: elements of a repeated field so far
    Deferred* pending        # per field: a value it cannot take, unless replaced
    Py_ssize_t npending      # fields with one
    VarOut* var              # documents: where the variable-length field goes
    int depth
    Py_ssize_t err_entry
    Py_ssize_t err_field
    int64_t err_value


cdef class ProtobufPlan:
    """A compiled message type: how to read its records into a layout's fields.

    Made by ``kfeed.protobuf`` from arrays it checks here: ``entries`` rows
    are (number, kind, field, code, repeated, msg), ``msgs`` rows (first, n)
    with each message's entries sorted by number, message 0 the root;
    ``codes`` and ``defaults`` per field as for ``AvroPlan``; ``notes`` names
    each entry (its dotted path) for error messages. ``clears`` rows (entry,
    field), by entry: a oneof member's entry unsets, when it is read, the
    fields its oneof's other members lead to; an entry of field -1 and msg -1
    (a member the schema does not read) does that alone, its value skipped.
    ``enums`` rows (entry, value), by entry then value: a closed enum's values.
    """

    cdef PbPlan p
    cdef readonly tuple notes
    cdef readonly Py_ssize_t nfields
    cdef tuple _defaults

    def __cinit__(self, Layout layout, const int64_t[:, ::1] entries, const int64_t[:, ::1] msgs,
                  codes, defaults, notes, Py_ssize_t varfield=-1, clears=None, enums=None):
        cdef Py_ssize_t i, k, f, ne = entries.shape[0], nm = msgs.shape[0]
        cdef const int64_t[:, ::1] cl = np.zeros((0, 2), np.int64) if clears is None else clears
        cdef const int64_t[:, ::1] en = np.zeros((0, 2), np.int64) if enums is None else enums
        cdef Py_ssize_t ncl = cl.shape[0], nen = en.shape[0]
        cdef PbEntry* e
        if entries.shape[1] != 6 or msgs.shape[1] != 2 or nm == 0:
            raise ValueError("entries must have shape (n, 6) and msgs (m >= 1, 2)")
        if len(notes) != ne:
            raise ValueError("one note per entry is needed")
        self.nfields = layout.nfields
        self.notes = tuple(str(x) for x in notes)
        self._defaults = tuple(defaults)
        self.p.nentries, self.p.nmsgs, self.p.nfields = ne, nm, layout.nfields
        self.p.entries = <PbEntry*>calloc(ne if ne else 1, sizeof(PbEntry))
        self.p.msgs = <PbMsg*>calloc(nm, sizeof(PbMsg))
        self.p.codes = <int*>calloc(layout.nfields, sizeof(int))
        self.p.nelem = <uint64_t*>calloc(layout.nfields, sizeof(uint64_t))
        self.p.rowbytes = <uint64_t*>calloc(layout.nfields, sizeof(uint64_t))
        self.p.repeated = <uint8_t*>calloc(layout.nfields, 1)
        self.p.default = <const uint8_t**>calloc(layout.nfields, sizeof(uint8_t*))
        self.p.clear_fields = <int*>calloc(ncl if ncl else 1, sizeof(int))
        self.p.enum_values = <int32_t*>calloc(nen if nen else 1, sizeof(int32_t))
        self.p.enum_at = <Py_ssize_t*>calloc(ne + 1, sizeof(Py_ssize_t))
        if not (self.p.entries and self.p.msgs and self.p.codes and self.p.nelem
                and self.p.rowbytes and self.p.repeated and self.p.default and self.p.clear_fields
                and self.p.enum_values and self.p.enum_at):
            raise MemoryError()
        if cl.shape[1] != 2:
            raise ValueError("clears must have shape (k, 2)")
        if en.shape[1] != 2:
            raise ValueError("enums must have shape (k, 2)")
        # A document: ``varfield``, filled by a repeated scalar, or by bytes.
        if not -1 <= varfield < layout.nfields:
            raise ValueError(f"field {varfield} is not in the layout")
        self.p.varfield = varfield
        for i in range(ne):
            if varfield >= 0 and entries[i, 2] == varfield and not (
                    entries[i, 4] or entries[i, 1] == P_BYTES or entries[i, 1] == P_STRING):
                raise ValueError(f"entry {i}: a document is read from a repeated scalar "
                                 f"or bytes")
        plan_fields(layout, codes, defaults, self.p.codes, self.p.nelem, self.p.default,
                    self.p.varfield)
        for f in range(layout.nfields):
            self.p.rowbytes[f] = self.p.nelem[f] * code_size(self.p.codes[f])
        self.p.var_default = 0
        if self.p.varfield >= 0 and defaults[self.p.varfield] is not None:
            self.p.var_default = (len(defaults[self.p.varfield])
                                  // code_size(self.p.codes[self.p.varfield]))
        for i in range(ne):
            e = &self.p.entries[i]
            if not 1 <= entries[i, 0] <= 0x1FFFFFFF:
                raise ValueError(f"entry {i}: field number {entries[i, 0]} is out of range")
            e.number = <uint32_t>entries[i, 0]
            e.kind, e.field, e.code = entries[i, 1], entries[i, 2], entries[i, 3]
            if entries[i, 4] not in (0, 1):
                raise ValueError(f"entry {i}: repeated is 0 or 1")
            e.repeated, e.msg = <uint8_t>entries[i, 4], entries[i, 5]
            if not 0 <= e.kind < P_KINDS:
                raise ValueError(f"entry {i}: unknown kind {e.kind}")
            if e.field == -1 and e.msg == -1:
                if e.repeated:
                    raise ValueError(f"entry {i}: an entry that reads nothing is not repeated")
            elif e.kind == P_MESSAGE:
                if e.field != -1 or e.repeated or not 0 <= e.msg < nm:
                    raise ValueError(f"entry {i}: a message entry names a message, no field")
            elif e.kind == P_GROUP:
                raise ValueError(f"entry {i}: a group is not read")
            else:
                if not 0 <= e.field < layout.nfields or e.code != self.p.codes[e.field]:
                    raise ValueError(f"entry {i}: its field or code is not the layout's")
                if (e.kind == P_BYTES or e.kind == P_STRING) and (
                        e.field != self.p.varfield or e.repeated
                                          or code_size(e.code) != 1):
                    raise ValueError(f"entry {i}: bytes go into a document of 1-byte elements")
                if e.repeated:
                    self.p.repeated[e.field] = 1
            e.wire = <uint8_t>pb_wire(e.kind)
        for k in range(ncl):
            i, f = cl[k, 0], cl[k, 1]
            if not 0 <= i < ne or not 0 <= f < layout.nfields:
                raise ValueError(f"clears row {k}: not an entry and a field")
            e = &self.p.entries[i]
            if e.clear_n == 0:
                if k and i <= cl[k - 1, 0]:
                    raise ValueError("clears must be sorted by entry")
                e.clear_first = k
            e.clear_n += 1
            self.p.clear_fields[k] = <int>f
        for k in range(nen):
            i = en[k, 0]
            if not 0 <= i < ne or self.p.entries[i].kind != P_ENUM:
                raise ValueError(f"enums row {k}: not an enum's entry")
            if not -2**31 <= en[k, 1] < 2**31:
                raise ValueError(f"enums row {k}: {en[k, 1]} is no int32")
            if k and (i < en[k - 1, 0] or (i == en[k - 1, 0] and en[k, 1] <= en[k - 1, 1])):
                raise ValueError("enums must be sorted by entry, then value, once each")
            self.p.entries[i].closed = 1
            self.p.enum_values[k] = <int32_t>en[k, 1]
        k = 0  # each entry's values start where the earlier entries' end
        for i in range(ne + 1):
            while k < nen and en[k, 0] < i:
                k += 1
            self.p.enum_at[i] = k
        for i in range(ne):
            e = &self.p.entries[i]
            if e.field >= 0 and not e.repeated and not e.closed and not e.clear_n \
                    and self.p.nelem[e.field] == 1 and e.field != varfield:
                e.direct = pb_direct(e.kind, e.code)
        for k in range(nm):
            self.p.msgs[k].first, self.p.msgs[k].n = msgs[k, 0], msgs[k, 1]
            if msgs[k, 0] < 0 or msgs[k, 1] < 0 or msgs[k, 0] + msgs[k, 1] > ne:
                raise ValueError(f"message {k}: its entries are not in entries")
            for i in range(msgs[k, 0] + 1, msgs[k, 0] + msgs[k, 1]):
                if self.p.entries[i].number <= self.p.entries[i - 1].number:
                    raise ValueError(f"message {k}: entries must be sorted by number, once each")

    def __dealloc__(self):
        free(self.p.entries)
        free(self.p.msgs)
        free(self.p.codes)
        free(self.p.nelem)
        free(self.p.rowbytes)
        free(self.p.repeated)
        free(self.p.default)
        free(self.p.clear_fields)
        free(self.p.enum_values)
        free(self.p.enum_at)


cdef inline int pb_varint(PbCur* c, const uint8_t* end, uint64_t* out) noexcept nogil:
    cdef uint64_t v = 0, b
    cdef int shift = 0
    if c.p < end and c.p[0] < 0x80:  # one byte: most tags, lengths and small values
        out[0] = c.p[0]
        c.p += 1
        return A_OK
    while True:
        if c.p >= end:
            return A_TRUNCATED
        b = c.p[0]
        c.p += 1
        # (a 10th byte's bits past bit 63 are ignored, as protobuf's parser
        # ignores them)
        v |= (b & 0x7F) << shift
        if not (b & 0x80):
            break
        shift += 7
        if shift > 63:
            return A_VARINT
    out[0] = v
    return A_OK


cdef inline int pb_varint32(PbCur* c, const uint8_t* end, uint64_t* out) noexcept nogil:
    """A tag or a length: a varint of at most 5 bytes and 32 bits, as protobuf's parser
    reads them (it refuses a longer one, which ``pb_varint`` would take)."""
    cdef const uint8_t* start = c.p
    cdef int r = pb_varint(c, end, out)
    if r == A_OK and (c.p - start > 5 or out[0] > <uint64_t>0xFFFFFFFFu):
        return A_VARINT
    return r


cdef int pb_skip(PbCur* c, const uint8_t* end, uint64_t tag) noexcept nogil:
    """Skip the value of an unknown field with ``tag`` at ``c.p``; a group
    (wire type 3, proto2) up to the end tag of the same number."""
    cdef uint64_t v, inner
    cdef int r, wt = tag & 7
    if wt == 0:
        return pb_varint(c, end, &v)
    if wt == 1:
        if end - c.p < 8:
            return A_TRUNCATED
        c.p += 8
        return A_OK
    if wt == 5:
        if end - c.p < 4:
            return A_TRUNCATED
        c.p += 4
        return A_OK
    if wt == 2:
        r = pb_varint32(c, end, &v)
        if r:
            return r
        if v > <uint64_t>(end - c.p):
            return A_TRUNCATED
        c.p += v
        return A_OK
    if wt == 3:
        c.depth += 1
        if c.depth > PB_MAX_DEPTH:
            return A_DEPTH
        while c.p < end:
            r = pb_varint32(c, end, &inner)
            if r:
                return r
            if (inner >> 3) == 0 or (inner >> 3) > 0x1FFFFFFF:
                return A_TAG
            if (inner & 7) == 4:
                if (inner >> 3) != (tag >> 3):
                    return A_TAG
                c.depth -= 1
                return A_OK
            r = pb_skip(c, end, inner)
            if r:
                return r
        return A_TRUNCATED
    return A_TAG  # a group's end without its start, or wire type 6 or 7 (none)


cdef inline int pb_wire(int kind) noexcept nogil:
    """The wire type of a field of ``kind`` (a repeated scalar's packed form aside)."""
    if kind == P_BYTES or kind == P_STRING or kind == P_MESSAGE:
        return 2
    if kind == P_GROUP:
        return 3
    if kind == P_FIXED32 or kind == P_SFIXED32 or kind == P_FLOAT:
        return 5
    if kind == P_FIXED64 or kind == P_SFIXED64 or kind == P_DOUBLE:
        return 1
    return 0


cdef uint8_t pb_direct(int kind, int code) noexcept nogil:
    """The ``D_*`` store of an entry of ``kind`` into a field of ``code``; D_NONE: none."""
    if kind == P_INT64 and code == C_I64:
        return D_I64
    if kind == P_INT32 or kind == P_ENUM:
        return D_I32 if code == C_I32 else D_I32_I64 if code == C_I64 else D_NONE
    if kind == P_BOOL and code == C_BOOL:
        return D_BOOL
    if kind == P_DOUBLE:
        return D_F64 if code == C_F64 else D_F64_F32 if code == C_F32 else D_NONE
    if kind == P_FLOAT:
        return D_F32 if code == C_F32 else D_F32_F64 if code == C_F64 else D_NONE
    return D_NONE


cdef inline int pb_store(PbCur* c, const PbEntry* e, const uint8_t* end) noexcept nogil:
    """One scalar of entry ``e`` (``e.direct``, in its wire type) into its field's element.

    As ``pb_value`` stores it, without the checks no such value can fail.
    """
    cdef uint64_t raw
    cdef uint32_t u32
    cdef float fv
    cdef double dv
    cdef uint8_t* d = c.row[e.field]
    cdef int r
    if e.wire == 0:
        r = pb_varint(c, end, &raw)
        if r:
            return r
        if e.direct == D_I64:
            (<int64_t*>d)[0] = <int64_t>raw
        elif e.direct == D_I32:
            (<int32_t*>d)[0] = <int32_t>raw
        elif e.direct == D_I32_I64:
            (<int64_t*>d)[0] = <int32_t>raw
        else:
            d[0] = raw != 0
    elif e.wire == 1:
        if end - c.p < 8:
            return A_TRUNCATED
        memcpy(&dv, c.p, 8)
        c.p += 8
        if e.direct == D_F64:
            (<double*>d)[0] = dv
        else:
            (<float*>d)[0] = <float>dv
    else:
        if end - c.p < 4:
            return A_TRUNCATED
        if e.direct == D_F32:
            # As read through a double (protobuf's Python float): a signaling
            # NaN comes out quiet. (The compiler drops a float's round trip
            # through a double, so the quiet bit is set here.)
            memcpy(&u32, c.p, 4)
            if (u32 & 0x7F800000u) == 0x7F800000u and (u32 & 0x007FFFFFu):
                u32 |= 0x00400000u
            memcpy(d, &u32, 4)
        else:
            memcpy(&fv, c.p, 4)
            (<double*>d)[0] = fv
        c.p += 4
    c.written[e.field] = 1
    return A_OK


cdef int pb_value(PbCur* c, const PbEntry* e, const uint8_t* end) noexcept nogil:
    """One scalar of entry ``e`` at ``c.p``, into its field."""
    cdef uint64_t raw = 0
    cdef uint32_t u32
    cdef float fv
    cdef double dv
    cdef int64_t v, elem = 0
    cdef int r, kind = e.kind
    cdef bint floating = False
    if kind == P_BYTES or kind == P_STRING:  # the document is these bytes (the last wins)
        r = pb_varint32(c, end, &raw)
        if r:
            return r
        if raw > <uint64_t>(end - c.p):
            return A_TRUNCATED
        if kind == P_STRING and not utf8_valid(c.p, raw):
            return A_NOT_UTF8
        if var_reserve(c.var, raw, &c.row[e.field], &c.nelem[e.field]):
            return A_MEMORY
        memcpy(c.row[e.field], c.p, raw)
        c.p += raw
        c.count[e.field] = raw
        c.written[e.field] = 1
        return A_OK
    if kind == P_FLOAT:
        if end - c.p < 4:
            return A_TRUNCATED
        memcpy(&fv, c.p, 4)
        c.p += 4
        dv = fv
        floating = True
    elif kind == P_DOUBLE:
        if end - c.p < 8:
            return A_TRUNCATED
        memcpy(&dv, c.p, 8)
        c.p += 8
        floating = True
    elif kind == P_FIXED32 or kind == P_SFIXED32:
        if end - c.p < 4:
            return A_TRUNCATED
        memcpy(&u32, c.p, 4)
        c.p += 4
        raw = u32 if kind == P_FIXED32 else <uint64_t><int64_t>(<int32_t>u32)
    elif kind == P_FIXED64 or kind == P_SFIXED64:
        if end - c.p < 8:
            return A_TRUNCATED
        memcpy(&raw, c.p, 8)
        c.p += 8
    else:
        r = pb_varint(c, end, &raw)
        if r:
            return r
    if e.repeated:
        elem = c.count[e.field]
        c.count[e.field] += 1
        if e.field == c.plan.varfield and <uint64_t>elem >= c.nelem[e.field] and \
                var_reserve(c.var, elem + 1, &c.row[e.field], &c.nelem[e.field]):
            return A_MEMORY
        if <uint64_t>elem >= c.nelem[e.field]:  # more than the shape: counted, not kept
            defer(&c.pending[e.field], &c.npending, A_LENGTH, e - c.plan.entries, 0, True)
            return A_OK
    if floating:
        r = put_float(c.row[e.field], c.nelem[e.field], e.code, elem, dv)
    else:
        if kind == P_INT32 or kind == P_ENUM:
            v = <int32_t>raw
        elif kind == P_UINT32:
            v = <uint32_t>raw
        elif kind == P_SINT32:
            # Cut to 32 bits first, as protobuf reads a sint32, then zig-zag.
            u32 = <uint32_t>raw
            v = <int32_t>((u32 >> 1) ^ -(u32 & 1))
        elif kind == P_SINT64:
            v = <int64_t>((raw >> 1) ^ -(raw & 1))
        elif kind == P_BOOL:
            v = raw != 0
        else:
            v = <int64_t>raw
        if (kind == P_UINT64 or kind == P_FIXED64) and v < 0:
            # Past int64: only a uint64 or a float field takes it.
            if e.code == C_U64:
                (<uint64_t*>c.row[e.field])[elem] = raw
                r = A_OK
            elif e.code == C_F32:  # rounded once, as numpy casts a uint64 (not through a double)
                (<float*>c.row[e.field])[elem] = <float>raw
                r = A_OK
            elif e.code == C_F64:
                (<double*>c.row[e.field])[elem] = <double>raw
                r = A_OK
            else:
                c.err_value = v
                r = A_RANGE_U64
        else:
            c.err_value = v
            r = put_int(c.row[e.field], c.nelem[e.field], e.code, elem, v)
    if r == A_OK:
        c.written[e.field] = 1
        if c.npending and not e.repeated:  # the last value wins
            settle(&c.pending[e.field], &c.npending)
    elif deferrable(r):
        defer(&c.pending[e.field], &c.npending, r, e - c.plan.entries, c.err_value,
              e.repeated)
        r = A_OK
    return r


# NOTE [ The value the parser keeps ]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Protobuf keeps the last value of a field given twice, and a oneof member
# read clears the others; json.loads keeps the last value of a key given
# twice. What they drop is no part of the record they parse. So a value its
# field cannot take (out of its dtype's range, of another kind, null in an
# array, or an array of another length than the shape) does not end the
# record where it is read. It waits (``defer``) in the cursor's ``pending``:
# a later value of the field, the key of an object it lies in given again,
# or the clear of a oneof member, drops it (``settle``); at the record's end
# one still waiting makes the record bad, with the reason it had. A repeated
# Protobuf field's elements add up, so only a clear drops its. A value that
# cannot be read at all (truncated, malformed, a string that is not UTF-8)
# ends the record at once, as it ends their parse.

cdef inline bint deferrable(int r) noexcept nogil:
    """Whether ``r`` says a value does not fit its field, not that it cannot be read."""
    return r == A_RANGE or r == A_RANGE_U64 or r == A_KIND or r == A_LENGTH or r == A_NULL


cdef inline int pb_packed_copy(PbCur* c, const PbEntry* e, uint64_t n) noexcept nogil:
    """Packed floats into a float32 field (doubles into float64) as one copy."""
    cdef uint64_t size = 4 if e.kind == P_FLOAT else 8
    cdef uint64_t count = n // size, at = c.count[e.field]
    if n % size:
        return A_TRUNCATED
    if e.field == c.plan.varfield and var_reserve(c.var, at + count, &c.row[e.field],
                                                  &c.nelem[e.field]):
        return A_MEMORY
    if at > c.nelem[e.field] or count > c.nelem[e.field] - at:
        c.count[e.field] = at + count  # more than the shape: counted, not kept
        c.p += n
        defer(&c.pending[e.field], &c.npending, A_LENGTH, e - c.plan.entries, 0, True)
        return A_OK
    copy_out(c.row[e.field] + at * size, c.p, n, e.field == c.plan.varfield)
    c.p += n
    c.count[e.field] = at + count
    if count:
        c.written[e.field] = 1
    return A_OK


cdef inline bint pb_known(const PbPlan* plan, const PbEntry* e, uint64_t raw) noexcept nogil:
    """Whether ``raw``, read as an int32 as protobuf reads an enum, is one of the
    values of ``e``'s closed enum."""
    cdef int32_t v = <int32_t>raw
    cdef Py_ssize_t i = e - plan.entries
    cdef Py_ssize_t lo = plan.enum_at[i], end = plan.enum_at[i + 1], hi = end, mid
    while lo < hi:
        mid = (lo + hi) // 2
        if plan.enum_values[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo < end and plan.enum_values[lo] == v


cdef inline void pb_clear(PbCur* c, const PbEntry* e) noexcept nogil:
    """Unset the fields the other members of ``e``'s oneof lead to: of a oneof,
    protobuf keeps the member parsed last (a message member again merges)."""
    cdef Py_ssize_t j
    cdef int f
    for j in range(e.clear_first, e.clear_first + e.clear_n):
        f = c.plan.clear_fields[j]
        c.written[f] = 0
        c.count[f] = 0
        if c.npending:
            settle(&c.pending[f], &c.npending)


cdef int pb_message(PbCur* c, Py_ssize_t mi, const uint8_t* end) noexcept nogil:
    """Read the fields of message type ``mi`` from ``c.p`` to ``end``."""
    cdef const PbMsg* m = &c.plan.msgs[mi]
    cdef const PbEntry* e
    cdef uint64_t tag, n
    cdef uint32_t number
    cdef int wt, r
    cdef Py_ssize_t lo, hi, mid
    cdef const uint8_t* stop
    cdef const uint8_t* at
    cdef Py_ssize_t nxt = m.first
    c.depth += 1
    if c.depth > PB_MAX_DEPTH:
        return A_DEPTH
    while c.p < end:
        r = pb_varint32(c, end, &tag)
        if r:
            c.err_value = 0  # no field's: a value stored before is not its number
            return r
        wt = tag & 7
        if (tag >> 3) == 0 or (tag >> 3) > 0x1FFFFFFF:
            return A_TAG
        number = <uint32_t>(tag >> 3)
        # The entries of this message, by number: writers send fields in
        # their numbers' order, so the entry after the last one is tried
        # first, then the last one again (an unpacked repeated field's next
        # element: proto2's default).
        e = NULL
        if nxt < m.first + m.n and c.plan.entries[nxt].number == number:
            lo = nxt
        elif nxt > m.first and c.plan.entries[nxt - 1].number == number:
            lo = nxt - 1
        else:
            lo, hi = m.first, m.first + m.n
            while lo < hi:
                mid = (lo + hi) // 2
                if c.plan.entries[mid].number < number:
                    lo = mid + 1
                else:
                    hi = mid
        if lo < m.first + m.n and c.plan.entries[lo].number == number:
            e = &c.plan.entries[lo]
            nxt = lo + 1
            if e.direct and wt == e.wire:
                r = pb_store(c, e, end)
                if r:
                    c.err_entry = lo
                    return r
                continue
        if e == NULL or (wt != e.wire and not (wt == 2 and e.repeated)):
            # Not in the plan; or a known field in another wire type, which
            # protobuf keeps among the unknown fields, leaving the field unset.
            r = pb_skip(c, end, tag)
            if r:
                if e != NULL:  # a field of the plan, in another wire type
                    c.err_entry = lo
                else:  # (no entry: the reason names its number)
                    c.err_value = number
                return r
            continue
        if e.closed and wt == 0:
            # A closed enum's unknown value is an unknown field to protobuf: the
            # field, and its oneof, stay as they were.
            at = c.p
            r = pb_varint(c, end, &n)
            if r:
                c.err_entry = lo
                return r
            if not pb_known(c.plan, e, n):
                continue
            c.p = at
        if e.clear_n:
            pb_clear(c, e)
        if e.field < 0 and e.msg < 0:  # a oneof member read for the line above alone
            r = pb_skip(c, end, tag)
            if r:
                c.err_entry = lo
                return r
            continue
        if e.kind == P_MESSAGE:
            r = pb_varint32(c, end, &n)
            if r == A_OK and n > <uint64_t>(end - c.p):
                r = A_TRUNCATED
            if r:
                c.err_entry = lo
                return r
            stop = c.p + n
            r = pb_message(c, e.msg, stop)
            if r:
                if c.err_entry < 0:
                    c.err_entry = lo
                return r
            continue
        if wt == e.wire:
            r = pb_value(c, e, end)
        else:  # a repeated scalar, packed
            r = pb_varint32(c, end, &n)
            if r == A_OK and n > <uint64_t>(end - c.p):
                r = A_TRUNCATED
            if r:
                c.err_entry = lo
                return r
            stop = c.p + n
            if e.field == c.plan.varfield and var_reserve(
                    c.var, c.count[e.field] + n, &c.row[e.field], &c.nelem[e.field]):
                return A_MEMORY  # room at once: n bytes hold at most n elements
            if (e.kind == P_FLOAT and e.code == C_F32) or (e.kind == P_DOUBLE and e.code == C_F64):
                r = pb_packed_copy(c, e, n)  # the elements as they lie: one memcpy
            while c.p < stop and r == A_OK:
                if e.closed:  # an unknown value is left aside, as unpacked below
                    at = c.p
                    r = pb_varint(c, stop, &n)
                    if r or not pb_known(c.plan, e, n):
                        continue
                    c.p = at
                r = pb_value(c, e, stop)
        if r:
            c.err_entry = lo
            return r
    if c.p != end:
        return A_TRUNCATED
    c.depth -= 1
    return A_OK


cdef int pb_record(PbCur* c, const PbPlan* plan, const uint8_t* p, const uint8_t* end,
                   uint8_t** dst, uint64_t row) noexcept nogil:
    cdef Py_ssize_t f
    cdef uint64_t nbytes
    c.plan = plan
    c.p = p
    c.depth = -1  # the record itself is no nesting: upb takes it and 100 levels in it
    c.err_entry = -1
    c.err_field = -1
    c.err_value = 0
    memset(c.written, 0, plan.nfields)
    memset(c.count, 0, plan.nfields * sizeof(uint64_t))
    unwait(c.pending, &c.npending, plan.nfields)
    for f in range(plan.nfields):
        c.row[f] = dst[f] + row * plan.rowbytes[f]
        c.nelem[f] = plan.nelem[f]
    if plan.varfield >= 0:  # at the documents' end, made room for as it is read
        c.row[plan.varfield] = c.var.buf + c.var.len * c.var.size
        c.nelem[plan.varfield] = c.var.cap - c.var.len
    cdef int r = pb_message(c, 0, end)
    if r:
        return r
    f = first_waiting(c.pending, c.npending, plan.nfields)
    if f >= 0:  # a value protobuf keeps that its field cannot take
        r = c.pending[f].err
        c.err_entry = c.pending[f].node
        c.err_value = c.count[f] if r == A_LENGTH else c.pending[f].value
        return r
    for f in range(plan.nfields):
        nbytes = plan.rowbytes[f]
        if f == plan.varfield:
            # Absent: the default, or empty. (Present and empty is empty, as
            # protobuf reads it; proto3 sends an empty string without presence
            # as nothing at all, which is absent here.)
            if not c.written[f] and plan.default[f] != NULL:
                if var_reserve(c.var, plan.var_default, &c.row[f], &c.nelem[f]):
                    return A_MEMORY
                memcpy(c.row[f], plan.default[f], plan.var_default * c.var.size)
                c.count[f] = plan.var_default
        elif plan.repeated[f]:
            if c.count[f] == 0:
                if plan.default[f] == NULL:
                    c.err_field = f
                    return A_MISSING
                memcpy(c.row[f], plan.default[f], nbytes)
            elif c.count[f] != plan.nelem[f]:
                c.err_field = f
                c.err_value = c.count[f]
                return A_LENGTH
        elif not c.written[f]:
            if plan.default[f] != NULL:
                memcpy(c.row[f], plan.default[f], nbytes)
            else:
                memset(c.row[f], 0, nbytes)  # proto3: an absent scalar is zero
    return A_OK


cdef inline int64_t pb_zigzag_at(const uint8_t** p, const uint8_t* end, bint* ok) noexcept nogil:
    cdef uint64_t v = 0, b
    cdef int shift = 0
    while True:
        if p[0] >= end or shift > 63:
            ok[0] = False
            return 0
        b = p[0][0]
        p[0] += 1
        v |= (b & 0x7F) << shift
        if not (b & 0x80):
            break
        shift += 7
    return <int64_t>(v >> 1) ^ -(<int64_t>(v & 1))


cdef Py_ssize_t pb_frame(const uint8_t* p, Py_ssize_t size) noexcept nogil:
    """Bytes of Confluent framing before the message: -1 if the frame is bad."""
    if size < 6 or p[0] != 0:
        return -1
    cdef const uint8_t* q = p + 5
    cdef const uint8_t* end = p + size
    cdef bint ok = True
    cdef int64_t count = pb_zigzag_at(&q, end, &ok), k
    if not ok or count < 0 or count > 64:
        return -2
    for k in range(count):
        if pb_zigzag_at(&q, end, &ok) < 0 or not ok:
            return -2
    return q - p


cdef tuple pb_plans(plans, _Values vals, bint framed, Py_ssize_t nfields, bint documents,
                    const PbPlan** vp, Py_ssize_t* skip, dict owners, dict reasons):
    """Each value's plan into ``vp`` and its framing's bytes into ``skip``, under the GIL.

    ``plans``: one ``ProtobufPlan`` for every value, or (framed) a dict from
    ``(schema id, message indexes)`` to the plan of that message, or to a str
    saying why its values are rejected. ``skip[i]`` is -1 for a bad frame,
    -2 for a malformed index array. Returns ``(n, need)``: the values looked
    up, and the key of value ``n`` when the dict has no entry for it. A
    value's key is made only when its framing differs from the value before.
    """
    cdef Py_ssize_t i, n = vals.n, last_skip = 0, k
    cdef ProtobufPlan plan
    cdef const PbPlan* last = NULL
    cdef const uint8_t* last_p = NULL
    cdef const uint8_t* q
    cdef bint ok
    single = isinstance(plans, ProtobufPlan)
    if not single and not framed:
        raise TypeError("plans must be a ProtobufPlan for values without framing")
    for entry in ([plans] if single else plans.values()):
        if isinstance(entry, ProtobufPlan):
            plan = <ProtobufPlan>entry
            if plan.nfields != nfields:
                raise ValueError("the plan was made for another layout")
            if (plan.p.varfield >= 0) != documents:
                raise ValueError("documents need a plan with a variable-length field"
                                 if documents else "a plan with a variable-length field reads "
                                 "documents: pb_documents")
            owners[<uintptr_t>&plan.p] = plan
    for i in range(n):
        skip[i] = 0
        vp[i] = NULL
        if vals.size[i] < 0:
            continue
        if framed:
            skip[i] = pb_frame(vals.ptr[i], vals.size[i])
            if skip[i] < 0:
                continue
        if single:
            vp[i] = &(<ProtobufPlan>plans).p
            continue
        if last_p != NULL and skip[i] == last_skip and \
                memcmp(vals.ptr[i] + 1, last_p + 1, skip[i] - 1) == 0:
            vp[i] = last  # the same schema id and message indexes as the value before
            continue
        q = vals.ptr[i] + 5
        ok = True
        count = pb_zigzag_at(&q, vals.ptr[i] + skip[i], &ok)
        indexes = tuple(pb_zigzag_at(&q, vals.ptr[i] + skip[i], &ok) for k in range(count))
        key = (load_u32_be(vals.ptr[i] + 1), indexes or (0,))
        entry = plans.get(key)
        if entry is None:
            return i, key
        last_p, last_skip = vals.ptr[i], skip[i]
        if isinstance(entry, ProtobufPlan):
            vp[i] = &(<ProtobufPlan>entry).p
            last = vp[i]
        else:
            reasons[key] = str(entry)
            last = NULL
    return n, None


cdef int pb_one(PbCur* c, const PbPlan* plan, const uint8_t* p, Py_ssize_t size,
                Py_ssize_t skip, bint framed, uint8_t** dst, uint64_t row) noexcept nogil:
    """One value, its plan and framing looked up (``pb_plans``), into row ``row``."""
    c.err_entry, c.err_field, c.err_value = -1, -1, 0
    if size < 0:
        c.err_value = -size
        return A_VALUE
    if skip == -1:
        c.err_value = p[0] if size > 0 else -1
        return A_FRAME
    if skip == -2:
        return A_INDEXES
    if plan == NULL:
        return A_PLAN
    return pb_record(c, plan, p + skip, p + size, dst, row)


cdef list pb_rejected(Layout layout, _Values vals, AvBad* bad, Py_ssize_t nbad,
                      const PbPlan** vp, Py_ssize_t* skip, dict owners, dict reasons):
    """``(index, reason)`` of each rejected value."""
    rejected = []
    for k in range(nbad):
        idx = bad[k].index
        if bad[k].err == A_PLAN:
            q = vals.ptr[idx] + 5
            ok = True
            count = pb_zigzag_at(&q, vals.ptr[idx] + skip[idx], &ok)
            indexes = tuple(pb_zigzag_at(&q, vals.ptr[idx] + skip[idx], &ok)
                            for _ in range(count))
            key = (load_u32_be(vals.ptr[idx] + 1), indexes or (0,))
            rejected.append((idx, reasons.get(key, "no plan for the value's schema")))
        else:
            rejected.append((idx, _pb_reason(layout, owners.get(<uintptr_t>vp[idx]), bad[k],
                                             vals.size[idx])))
    return rejected


def pb_decode(Layout layout, plans, values, Out out, uint64_t row, bint framed):
    """Decode Protobuf message values into ``out`` from ``row`` on, one record per value.

    ``plans`` as ``pb_plans`` takes them. Returns ``(rows, consumed, bad,
    need)`` as ``avro_decode`` does (a rejected value may have begun the row
    after the last good one; ``need``: the ``(schema id, message indexes)``
    of value ``consumed`` when ``plans`` has no plan for it).
    """
    out.fits(layout)
    if row > out.capacity:
        raise ValueError(f"row {row} is past the end of the output ({out.capacity} rows)")
    cdef _Values vals = _Values(values)
    cdef Py_ssize_t n = vals.n, m = n if n else 1, i = 0, nbad = 0
    cdef const PbPlan** vp = <const PbPlan**>calloc(m, sizeof(PbPlan*))
    cdef Py_ssize_t* skip = <Py_ssize_t*>calloc(m, sizeof(Py_ssize_t))
    cdef AvBad* bad = <AvBad*>calloc(m, sizeof(AvBad))
    cdef uint8_t** rowp = <uint8_t**>calloc(layout.nfields, sizeof(uint8_t*))
    cdef uint64_t* nelem = <uint64_t*>calloc(layout.nfields, sizeof(uint64_t))
    cdef uint8_t* written = <uint8_t*>calloc(layout.nfields, 1)
    cdef uint64_t* count = <uint64_t*>calloc(layout.nfields, sizeof(uint64_t))
    cdef Deferred* pending = <Deferred*>calloc(layout.nfields, sizeof(Deferred))
    cdef PbCur c
    cdef uint64_t out_row = row
    cdef int r
    owners = {}
    reasons = {}
    if not (vp and skip and bad and rowp and nelem and written and count and pending):
        free(vp); free(skip); free(bad); free(rowp); free(nelem); free(written); free(count)
        free(pending)
        raise MemoryError()
    c.row, c.nelem, c.written, c.count, c.var = rowp, nelem, written, count, NULL
    c.pending, c.npending = pending, 0
    try:
        n, need = pb_plans(plans, vals, framed, layout.nfields, False, vp, skip, owners, reasons)
        with nogil:
            while i < n and out_row < out.capacity:
                fetch_value_ahead(vals.ptr, vals.size, n, i)
                r = pb_one(&c, vp[i], vals.ptr[i], vals.size[i], skip[i], framed, out.bufs.ptr,
                           out_row)
                if r == A_OK:
                    out_row += 1
                else:
                    bad[nbad].index, bad[nbad].err = i, r
                    bad[nbad].node, bad[nbad].field = c.err_entry, c.err_field
                    bad[nbad].value = c.err_value
                    nbad += 1
                i += 1
            stream_fence()
        if i < n:
            need = None  # stopped on a full output, before the unknown key
        rejected = pb_rejected(layout, vals, bad, nbad, vp, skip, owners, reasons)
        return out_row - row, i, rejected, need
    finally:
        free(vp); free(skip); free(bad); free(rowp); free(nelem); free(written); free(count)
        free(pending)


def pb_documents(Layout layout, plans, values, bint framed, int code, Out out=None):
    """The variable-length field of each Protobuf value in ``values``, flat; the others in rows.

    Each plan reads ``layout``'s variable-length field (``ProtobufPlan(varfield=)``,
    element code ``code``) as a document: a repeated scalar, or a string or
    bytes field; the other fields go into ``out`` as ``avro_documents`` does.
    Returns ``(tokens, lengths, counts, bad, need)`` as ``avro_documents`` does.
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
    cdef const PbPlan** vp = <const PbPlan**>calloc(m, sizeof(PbPlan*))
    cdef Py_ssize_t* skip = <Py_ssize_t*>calloc(m, sizeof(Py_ssize_t))
    cdef AvBad* bad = <AvBad*>calloc(m, sizeof(AvBad))
    cdef uint8_t** rowp = <uint8_t**>calloc(layout.nfields, sizeof(uint8_t*))
    cdef uint64_t* nelem = <uint64_t*>calloc(layout.nfields, sizeof(uint64_t))
    cdef uint8_t* written = <uint8_t*>calloc(layout.nfields, 1)
    cdef uint64_t* count = <uint64_t*>calloc(layout.nfields, sizeof(uint64_t))
    cdef Deferred* pending = <Deferred*>calloc(layout.nfields, sizeof(Deferred))
    cdef uint8_t** dst = rowp if out is None else out.bufs.ptr
    cdef uint64_t row = 0
    cdef VarOut var
    cdef PbCur c
    cdef int r = A_OK
    cdef int64_t[::1] lens, cnts
    owners = {}
    reasons = {}
    var.size, var.cap, var.len = code_size(code), 1024, 0
    var.buf = <uint8_t*>malloc(var.cap * var.size)
    try:
        if not (vp and skip and bad and var.buf and rowp and nelem and written and count
                and pending):
            raise MemoryError()
        n, need = pb_plans(plans, vals, framed, layout.nfields, True, vp, skip, owners, reasons)
        lengths = np.zeros(n, np.int64)
        counts = np.zeros(n, np.int64)
        lens = lengths
        cnts = counts
        c.row, c.nelem, c.written, c.count, c.var = rowp, nelem, written, count, &var
        c.pending, c.npending = pending, 0
        with nogil:
            for i in range(n):
                fetch_value_ahead(vals.ptr, vals.size, n, i)
                c.err_entry, c.err_field, c.err_value = -1, -1, 0
                if vp[i] != NULL and vp[i].codes[vp[i].varfield] != code:
                    r = A_KIND
                else:
                    r = pb_one(&c, vp[i], vals.ptr[i], vals.size[i], skip[i], framed, dst, row)
                if r == A_MEMORY:
                    break  # not the record's fault: raised below, nothing rejected
                if r == A_OK:
                    lens[i] = count[vp[i].varfield]
                    cnts[i] = 1
                    var.len += count[vp[i].varfield]
                    row += 1
                else:
                    bad[nbad].index, bad[nbad].err = i, r
                    bad[nbad].node, bad[nbad].field = c.err_entry, c.err_field
                    bad[nbad].value = c.err_value
                    nbad += 1
            stream_fence()  # (the fields beside the documents)
        if r == A_MEMORY:
            raise MemoryError("no memory to grow a document")
        rejected = pb_rejected(layout, vals, bad, nbad, vp, skip, owners, reasons)
        tokens = PyBytes_FromStringAndSize(<char*>var.buf, var.len * var.size)
        return tokens, lengths[counts > 0], counts, rejected, need
    finally:
        free(vp); free(skip); free(bad); free(var.buf); free(rowp); free(nelem); free(written)
        free(count); free(pending)


cdef str _pb_reason(Layout layout, ProtobufPlan plan, AvBad b, Py_ssize_t size):
    cdef int err = b.err
    where = f" at {plan.notes[b.node]}" if plan is not None and b.node >= 0 else ""
    if err == A_VALUE:
        return REASONS[b.value]
    if err == A_FRAME:
        if size < 6:
            return f"{size} bytes: too short for the Confluent framing (6 bytes or more)"
        return f"magic byte {b.value}, expected 0 (Confluent framing)"
    if err == A_INDEXES:
        return ("malformed message-index array (Confluent framing; is the topic Protobuf? Avro "
                "and JSON frames have no message indexes)")
    if err == A_MISSING:
        return f"field {layout.names[b.field]!r}: repeated field absent, and no default"
    if err == A_LENGTH:
        name = layout.names[b.field] if b.field >= 0 else "?"
        if b.field < 0 and b.node >= 0 and plan is not None:
            name = layout.names[plan.p.entries[b.node].field]
        return f"field {name!r}: {b.value} values do not match its shape{where}"
    if err == A_TAG:
        return "bad tag (field number 0, a group's end without its start, or wire type 6 or 7)"
    if err == A_NOT_UTF8:
        name = "?"
        if plan is not None and b.node >= 0 and plan.p.entries[b.node].field >= 0:
            name = layout.names[plan.p.entries[b.node].field]
        return f"field {name!r}: a string that is not UTF-8{where} (as protobuf refuses it)"
    if (err == A_TRUNCATED or err == A_VARINT) and not where and b.value > 0:
        where = f" in field number {b.value}, which the schema does not read"
    if err == A_TRUNCATED:
        return f"truncated{where}"
    if err == A_VARINT:
        return f"malformed varint{where}"
    into = "the field's dtype"
    if plan is not None and b.node >= 0 and plan.p.entries[b.node].field >= 0:
        into = field_dtype(layout, plan.p.entries[b.node].field,
                           plan.p.entries[b.node].code).lstrip()
    if err == A_RANGE:
        return f"{b.value} does not fit {into}{where}"
    if err == A_RANGE_U64:
        return f"{b.value & 0xFFFFFFFFFFFFFFFF} does not fit {into}{where}"
    if err == A_KIND:
        return f"a value the field cannot take{where}"
    if err == A_DEPTH:
        return f"nested deeper than {PB_MAX_DEPTH}"
    if err == A_MEMORY:
        return f"out of memory for the document{where}"
    return f"error {err}{where}"
