# Arrow IPC streams -> fixed-shape rows, included into _codec.pyx after _json.pxi
# (it shares ``_Values``, ``Layout`` and ``Out``).
#
# ``kfeed.arrowformat`` makes an ``ArrowPlan`` for an Arrow schema it has read
# once with pyarrow: the bytes of the stream's schema message, and per kfeed
# field the record batch buffer that holds its values and the nodes (the
# column, its fixed-size-list children, its struct parents) whose null counts
# must be 0. ``arrow_decode`` then reads each message's framing and its
# RecordBatch flatbuffer in C, without the GIL, checks every length and offset
# against the value's bytes, and copies each field's rows with one memcpy per
# message. A value it does not take (another schema, nulls, a dictionary
# batch, a compressed body, a second record batch, a malformed framing) stops
# the pass at that value's index: ``kfeed.arrowformat`` reads that one through
# pyarrow, which also says what is wrong with it, and the pass goes on after it.
#
# It runs no full flatbuffers verifier: every offset, size and length it reads
# is checked against the metadata or the body, and a message whose metadata a
# verifier would refuse only in parts it does not read (custom metadata, say)
# is still read, where pyarrow refuses it.
#
# Flatbuffers (the IPC metadata): a table starts with an int32 offset back to
# its vtable; the vtable holds its own size, the table's size, then one uint16
# offset per field (0: absent). Offsets to tables and vectors are uint32,
# relative to where they are stored; a vector starts with its uint32 length.
# Message: version (0), header_type (1), header (2), bodyLength (3).
# RecordBatch: length (0), nodes (1: 16-byte FieldNodes, length and
# null_count), buffers (2: 16-byte Buffers, offset and length in the body),
# compression (3).

cdef enum:
    ARROW_CONTINUATION = 0xFFFFFFFF
    ARROW_RECORD_BATCH = 3      # MessageHeader.RecordBatch


cdef struct ArPlan:
    const uint8_t* prefix       # the schema message, framing included
    Py_ssize_t prefix_len
    Py_ssize_t nfields
    const int64_t* data_buf     # per field: the buffer holding its values
    const int64_t* checked      # nodes whose null_count must be 0
    Py_ssize_t nchecked
    const int64_t* sized        # nodes whose length is known: the batch's rows times
    const int64_t* per_row      # per_row (1 for a column; k for a fixed-size list's items)
    Py_ssize_t nsized
    const int64_t* wide         # data buffers of fixed-width values whose size is known:
    const int64_t* wide_bytes   # at least the batch's rows times wide_bytes
    Py_ssize_t nwide
    int64_t nnodes              # the record batch's node and buffer counts
    int64_t nbuffers


cdef class ArrowPlan:
    """What ``arrow_decode`` needs of one Arrow schema (see the comment above)."""

    cdef bytes prefix
    cdef int64_t* data_buf
    cdef int64_t* checked
    cdef int64_t* sized
    cdef int64_t* per_row
    cdef int64_t* wide
    cdef int64_t* wide_bytes
    cdef ArPlan plan

    def __cinit__(self, bytes prefix, data_buf, checked, sized, wide, int64_t nnodes,
                  int64_t nbuffers):
        self.prefix = prefix
        self.data_buf = <int64_t*>malloc((len(data_buf) + 1) * sizeof(int64_t))
        self.checked = <int64_t*>malloc((len(checked) + 1) * sizeof(int64_t))
        self.sized = <int64_t*>malloc((len(sized) + 1) * sizeof(int64_t))
        self.per_row = <int64_t*>malloc((len(sized) + 1) * sizeof(int64_t))
        self.wide = <int64_t*>malloc((len(wide) + 1) * sizeof(int64_t))
        self.wide_bytes = <int64_t*>malloc((len(wide) + 1) * sizeof(int64_t))
        if (self.data_buf == NULL or self.checked == NULL or self.sized == NULL
                or self.per_row == NULL or self.wide == NULL or self.wide_bytes == NULL):
            raise MemoryError()
        for i, (b, nbytes) in enumerate(wide):
            if not 0 <= b < nbuffers or nbytes < 1:
                raise ValueError(f"buffer {b} of {nbuffers}, {nbytes} bytes a row")
            self.wide[i] = b
            self.wide_bytes[i] = nbytes
        for i, (node, k) in enumerate(sized):
            if not 0 <= node < nnodes or k < 1:
                raise ValueError(f"node {node} of {nnodes}, {k} a row")
            self.sized[i] = node
            self.per_row[i] = k
        for i, b in enumerate(data_buf):
            if not 0 <= b < nbuffers:
                raise ValueError(f"buffer {b} of {nbuffers}")
            self.data_buf[i] = b
        for i, node in enumerate(checked):
            if not 0 <= node < nnodes:
                raise ValueError(f"node {node} of {nnodes}")
            self.checked[i] = node
        self.plan.prefix = <const uint8_t*>PyBytes_AS_STRING(prefix)
        self.plan.prefix_len = len(prefix)
        self.plan.nfields = len(data_buf)
        self.plan.data_buf = self.data_buf
        self.plan.checked = self.checked
        self.plan.nchecked = len(checked)
        self.plan.sized = self.sized
        self.plan.per_row = self.per_row
        self.plan.nsized = len(sized)
        self.plan.wide = self.wide
        self.plan.wide_bytes = self.wide_bytes
        self.plan.nwide = len(wide)
        self.plan.nnodes = nnodes
        self.plan.nbuffers = nbuffers

    def __dealloc__(self):
        free(self.data_buf)
        free(self.checked)
        free(self.sized)
        free(self.per_row)
        free(self.wide)
        free(self.wide_bytes)


cdef inline uint32_t _ar_u32(const uint8_t* p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef inline int64_t _ar_i64(const uint8_t* p) noexcept nogil:
    cdef int64_t v
    memcpy(&v, p, 8)
    return v


cdef Py_ssize_t _fb_field(const uint8_t* meta, Py_ssize_t n, Py_ssize_t table,
                          int field) noexcept nogil:
    """Where ``field`` of the table at ``table`` lies; 0 if absent, -1 if malformed.

    The vtable and the table must lie inside the metadata, with sizes a
    flatbuffers verifier accepts, and the field inside its table.
    """
    cdef int32_t back
    cdef uint16_t vt_size, t_size, off
    cdef Py_ssize_t vt
    if table < 0 or table > n - 4 or table % 4:
        return -1
    memcpy(&back, meta + table, 4)
    vt = table - <Py_ssize_t>back
    if vt < 0 or vt > n - 4 or vt % 2:
        return -1
    memcpy(&vt_size, meta + vt, 2)
    memcpy(&t_size, meta + vt + 2, 2)
    if vt_size < 4 or vt_size % 2 or vt + vt_size > n or t_size < 4 or table + t_size > n:
        return -1
    if 4 + 2 * field + 2 > <Py_ssize_t>vt_size:
        return 0
    memcpy(&off, meta + vt + 4 + 2 * field, 2)
    if off == 0:
        return 0
    return table + off if off < t_size else -1


cdef Py_ssize_t _fb_ref(const uint8_t* meta, Py_ssize_t n, Py_ssize_t at) noexcept nogil:
    """The table or vector that an offset stored at ``at`` points to; -1 if malformed."""
    if at <= 0 or at > n - 4:
        return -1
    cdef Py_ssize_t to = at + <Py_ssize_t>_ar_u32(meta + at)
    return to if to <= n - 4 else -1


cdef int64_t _arrow_batch(const ArPlan* plan, const uint8_t* v, Py_ssize_t size,
                          Py_ssize_t* body, int64_t* bufs) noexcept nogil:
    """The row count of ``v``'s record batch if the plan takes it, with where its body
    starts in ``v`` and the (offset, length) in the body of each field's buffer; -1 if not."""
    cdef Py_ssize_t head = plan.prefix_len, n, msg, hdr, at, nodes, buffers, end
    cdef const uint8_t* meta
    cdef int64_t rows, body_len, k, off, length, tail
    if size < head + 8 or memcmp(v, plan.prefix, head) != 0:
        return -1
    if _ar_u32(v + head) != ARROW_CONTINUATION:
        return -1
    n = <Py_ssize_t>_ar_u32(v + head + 4)
    if n < 8 or n > size - head - 8:
        return -1
    meta = v + head + 8
    msg = <Py_ssize_t>_ar_u32(meta)           # the root table: the Message
    if msg > n - 4:
        return -1
    at = _fb_field(meta, n, msg, 0)         # the metadata version: V4 or V5, as pyarrow reads
    if at <= 0 or at > n - 2 or not (meta[at] in (3, 4) and meta[at + 1] == 0):
        return -1
    at = _fb_field(meta, n, msg, 1)
    if at <= 0 or meta[at] != ARROW_RECORD_BATCH:
        return -1
    hdr = _fb_ref(meta, n, _fb_field(meta, n, msg, 2))
    at = _fb_field(meta, n, msg, 3)
    if hdr < 0 or at <= 0 or at > n - 8:
        return -1
    body_len = _ar_i64(meta + at)
    end = head + 8 + n
    if body_len < 0 or body_len > size - end:
        return -1
    # Nothing after the body but the end-of-stream marker, or nothing.
    tail = size - end - body_len
    if tail != 0 and (tail != 8 or _ar_u32(v + end + body_len) != ARROW_CONTINUATION
                      or _ar_u32(v + end + body_len + 4) != 0):
        return -1
    if _fb_field(meta, n, hdr, 3) != 0:      # a compressed body, or malformed
        return -1
    at = _fb_field(meta, n, hdr, 0)
    if at <= 0 or at > n - 8:
        return -1
    rows = _ar_i64(meta + at)
    nodes = _fb_ref(meta, n, _fb_field(meta, n, hdr, 1))
    buffers = _fb_ref(meta, n, _fb_field(meta, n, hdr, 2))
    if rows < 0 or nodes < 0 or buffers < 0:
        return -1
    if (<int64_t>_ar_u32(meta + nodes) != plan.nnodes
            or <int64_t>_ar_u32(meta + buffers) != plan.nbuffers
            or plan.nnodes > (n - nodes - 4) // 16 or plan.nbuffers > (n - buffers - 4) // 16):
        return -1
    for k in range(plan.nchecked):
        if _ar_i64(meta + nodes + 4 + 16 * plan.checked[k] + 8) != 0:   # null_count
            return -1
    for k in range(plan.nsized):          # each column as long as the batch, as pyarrow checks
        if rows > INT64_MAX // plan.per_row[k] or \
                _ar_i64(meta + nodes + 4 + 16 * plan.sized[k]) != rows * plan.per_row[k]:
            return -1
    # Every buffer inside the body and 8-byte aligned, as pyarrow insists.
    for k in range(plan.nbuffers):
        off = _ar_i64(meta + buffers + 4 + 16 * k)
        length = _ar_i64(meta + buffers + 4 + 16 * k + 8)
        if off < 0 or length < 0 or off % 8 or off > body_len or length > body_len - off:
            return -1
    for k in range(plan.nwide):     # columns read or not, as pyarrow's validate() checks
        length = _ar_i64(meta + buffers + 4 + 16 * plan.wide[k] + 8)
        if rows > INT64_MAX // plan.wide_bytes[k] or length < rows * plan.wide_bytes[k]:
            return -1
    body[0] = end
    for k in range(plan.nfields):
        at = buffers + 4 + 16 * plan.data_buf[k]
        off = _ar_i64(meta + at)
        length = _ar_i64(meta + at + 8)
        if off < 0 or length < 0 or off > body_len or length > body_len - off:
            return -1
        bufs[2 * k] = off
        bufs[2 * k + 1] = length
    return rows


def arrow_decode(ArrowPlan plan, Layout layout, values, Out out, uint64_t row,
                 uint64_t start, bint split):
    """Arrow messages into ``out`` from ``row`` on, as ``decode`` decodes blocks.

    Returns ``(rows, consumed, partial, stopped)``: ``stopped`` says that
    ``values[consumed]`` is one the plan does not take (read it through
    pyarrow); ``partial``, records taken from it when ``split`` let it
    straddle the end of ``out``. ``start`` records of the first value were
    taken before.
    """
    cdef const ArPlan* p = &plan.plan
    if layout.nfields != p.nfields or out.nfields != p.nfields:
        raise ValueError(f"the plan reads {p.nfields} fields, the layout has "
                         f"{layout.nfields} and out {out.nfields}")
    out.fits(layout)
    if row > out.capacity:
        raise ValueError(f"row {row} is past the {out.capacity} rows of out")
    cdef _Values vals = _Values(values)
    cdef int64_t* bufs = <int64_t*>malloc((2 * p.nfields + 1) * sizeof(int64_t))
    if bufs == NULL:
        raise MemoryError()
    cdef uint64_t room = out.capacity - row, written = 0, partial = 0, first, take, rb
    cdef Py_ssize_t i, consumed = 0, body, f
    cdef int64_t nrows
    cdef bint stopped = False, fits
    try:
        with nogil:
            for i in range(vals.n):
                if written == room:
                    break
                if vals.size[i] < 0:
                    stopped = True
                    break
                nrows = _arrow_batch(p, vals.ptr[i], vals.size[i], &body, bufs)
                if nrows < 0:
                    stopped = True
                    break
                first = start if i == 0 else 0
                if first > <uint64_t>nrows:
                    first = <uint64_t>nrows
                take = <uint64_t>nrows - first
                if take > room - written:
                    if not split:
                        break
                    take = room - written
                fits = True
                for f in range(p.nfields):      # every row of it, not only those taken
                    rb = layout.row_bytes[f]
                    if <uint64_t>bufs[2 * f + 1] // rb < <uint64_t>nrows:
                        fits = False
                if not fits:        # a buffer shorter than its rows: pyarrow says why
                    stopped = True
                    break
                for f in range(p.nfields):
                    rb = layout.row_bytes[f]
                    memcpy(out.bufs.ptr[f] + (row + written) * rb,
                           vals.ptr[i] + body + bufs[2 * f] + first * rb, take * rb)
                written += take
                if first + take < <uint64_t>nrows:
                    partial = first + take
                    break
                consumed += 1
    finally:
        free(bufs)
    return written, consumed, partial, stopped
