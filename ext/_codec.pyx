"""The record codec: block and raw message values <-> columns of records.

This is the hot path between Kafka message values and the buffer pool. Decode
validates a whole value before any byte of it reaches the output, then copies
each field with one memcpy (block) or one memcpy per record (raw), without the
GIL and without creating a Python object per record. Knows nothing of Kafka or
torch: the caller hands in message values and raw destination pointers;
``kfeed.schema`` is its front. The format is documented in docs/FORMAT.md.

Schemas with a variable-length field (token documents) have their own layout
class, ``DocLayout``, and their own entry points: ``decode_documents`` turns
message values into one flat array of elements plus one length per document,
ready for the packer (``kfeed._pack``), again with no Python object per record.
"""

import sys

import numpy as np

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t, uintptr_t, UINT64_MAX
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

cdef enum:
    HEADER_SIZE = 32
    COLUMN_ALIGN = 8
    FORMAT_VERSION = 1
    # b"KFDB" read as a little-endian uint32.
    BLOCK_MAGIC = 0x4244464B
    # Header flag bit 0: the block holds a variable-length column.
    FLAG_VARLEN = 1

if sys.byteorder != "little":
    raise ImportError("kfeed's codec assumes a little-endian host")

# Why a value was rejected. The numbers are private; callers see the strings.
cdef enum Reason:
    R_OK = 0
    R_NONE
    R_NOT_BYTES
    R_SHORT
    R_MAGIC
    R_VERSION
    R_FLAGS
    R_HEADER_LEN
    R_FINGERPRINT
    R_COUNT
    R_LENGTH
    R_RAW_SIZE
    R_OFFSETS_START
    R_OFFSETS_ORDER
    R_OFFSETS_END
    R_RAW_ITEMSIZE

REASONS = {
    R_NONE: "empty value (tombstone)",
    R_NOT_BYTES: "value is not bytes-like",
    R_SHORT: "shorter than the block header",
    R_MAGIC: "bad magic",
    R_VERSION: "unsupported block version",
    R_FLAGS: "unsupported block flags",
    R_HEADER_LEN: "bad header length",
    R_FINGERPRINT: "schema fingerprint mismatch",
    R_COUNT: "record count overflows",
    R_LENGTH: "length does not match the record count",
    R_RAW_SIZE: "raw value size is not the record size",
}

# The further reasons that only a schema with a variable-length field gives.
DOC_REASONS = {
    R_OFFSETS_START: "variable-length offsets do not start at 0",
    R_OFFSETS_ORDER: "variable-length offsets decrease",
    R_OFFSETS_END: "last variable-length offset does not match the length",
    R_RAW_ITEMSIZE: "raw value size is not a multiple of the element size",
}

_ALL_REASONS = {**REASONS, **DOC_REASONS}


cdef inline uint64_t align_up(uint64_t n) noexcept nogil:
    return (n + (COLUMN_ALIGN - 1)) & ~(<uint64_t>(COLUMN_ALIGN - 1))


cdef inline uint32_t load_u32(const uint8_t* p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef inline uint64_t load_u64(const uint8_t* p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v


cdef class Layout:
    """Byte sizes of a schema's fields, as the codec needs them."""

    cdef readonly Py_ssize_t nfields
    cdef readonly uint64_t record_size
    cdef readonly uint64_t fingerprint
    cdef uint64_t* row_bytes

    def __cinit__(self, row_bytes, uint64_t fingerprint):
        self.nfields = len(row_bytes)
        if self.nfields == 0:
            raise ValueError("a layout needs at least one field")
        self.row_bytes = <uint64_t*>malloc(self.nfields * sizeof(uint64_t))
        if self.row_bytes == NULL:
            raise MemoryError()
        self.record_size = 0
        for i, nbytes in enumerate(row_bytes):
            if nbytes <= 0:
                raise ValueError("every field needs a positive size")
            self.row_bytes[i] = nbytes
            self.record_size += nbytes
        self.fingerprint = fingerprint

    def __dealloc__(self):
        free(self.row_bytes)

    cdef uint64_t block_size(self, uint64_t count) noexcept nogil:
        cdef uint64_t total = HEADER_SIZE
        cdef Py_ssize_t f
        for f in range(self.nfields):
            total += align_up(count * self.row_bytes[f])
        return total

    def block_nbytes(self, uint64_t count):
        """Size of a block message holding ``count`` records."""
        return self.block_size(count)


cdef class _Values:
    """Pointers to a sequence of message values, held for a nogil pass.

    Owns a tuple of the values so no other thread can free them meanwhile;
    non-bytes values are held through the buffer protocol.
    """
    cdef tuple items
    cdef Py_ssize_t n
    cdef const uint8_t** ptr
    cdef Py_ssize_t* size           # < 0 means rejected before decoding (a Reason)
    cdef Py_buffer* views
    cdef uint8_t* has_view

    def __cinit__(self, values):
        self.items = values if type(values) is tuple else tuple(values)
        self.n = len(self.items)
        cdef Py_ssize_t m = self.n if self.n > 0 else 1
        self.ptr = <const uint8_t**>malloc(m * sizeof(uint8_t*))
        self.size = <Py_ssize_t*>malloc(m * sizeof(Py_ssize_t))
        self.views = <Py_buffer*>malloc(m * sizeof(Py_buffer))
        self.has_view = <uint8_t*>calloc(m, 1)
        if not (self.ptr and self.size and self.views and self.has_view):
            raise MemoryError()
        cdef Py_ssize_t i
        cdef object v
        for i in range(self.n):
            v = self.items[i]
            if type(v) is bytes:
                self.ptr[i] = <const uint8_t*>PyBytes_AS_STRING(v)
                self.size[i] = len(<bytes>v)
            elif v is None:
                self.size[i] = -R_NONE
            else:
                try:
                    PyObject_GetBuffer(v, &self.views[i], PyBUF_SIMPLE)
                except (TypeError, BufferError, ValueError):
                    # ValueError: a released memoryview. One bad value must
                    # not fail the whole batch.
                    self.size[i] = -R_NOT_BYTES
                    continue
                self.has_view[i] = 1
                self.ptr[i] = <const uint8_t*>self.views[i].buf
                self.size[i] = self.views[i].len

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.has_view != NULL:
            for i in range(self.n):
                if self.has_view[i]:
                    PyBuffer_Release(&self.views[i])
        free(self.ptr)
        free(self.size)
        free(self.views)
        free(self.has_view)


cdef Reason check_block(Layout layout, const uint8_t* p, Py_ssize_t size,
                        uint64_t* count, uint64_t* start) noexcept nogil:
    """Validate a block value whole; on success give its count and column start."""
    if size < HEADER_SIZE:
        return R_SHORT
    if load_u32(p) != BLOCK_MAGIC:
        return R_MAGIC
    if p[4] != FORMAT_VERSION:
        return R_VERSION
    if p[5] != 0:
        return R_FLAGS
    cdef uint64_t header_len = p[6] | (<uint64_t>p[7] << 8)
    if header_len < HEADER_SIZE or header_len % COLUMN_ALIGN or header_len > <uint64_t>size:
        return R_HEADER_LEN
    if load_u64(p + 16) != layout.fingerprint:
        return R_FINGERPRINT
    cdef uint64_t n = load_u32(p + 8)
    if n > UINT64_MAX // 2 // layout.record_size:
        return R_COUNT
    if load_u64(p + 24) != <uint64_t>size - HEADER_SIZE:
        return R_LENGTH
    if layout.block_size(n) - HEADER_SIZE + header_len != <uint64_t>size:
        return R_LENGTH
    count[0] = n
    start[0] = header_len
    return R_OK


cdef void copy_block(Layout layout, const uint8_t* p, uint64_t col, uint64_t count,
                     uint64_t first, uint64_t take, uint8_t** dst,
                     uint64_t row) noexcept nogil:
    """Copy records [first, first + take) of a validated block to ``row``."""
    cdef Py_ssize_t f
    cdef uint64_t rb
    for f in range(layout.nfields):
        rb = layout.row_bytes[f]
        memcpy(dst[f] + row * rb, p + col + first * rb, take * rb)
        col += align_up(count * rb)


cdef void copy_raw(Layout layout, const uint8_t* p, uint8_t** dst,
                   uint64_t row) noexcept nogil:
    cdef Py_ssize_t f
    cdef uint64_t rb
    for f in range(layout.nfields):
        rb = layout.row_bytes[f]
        memcpy(dst[f] + row * rb, p, rb)
        p += rb


def decode(Layout layout, values, const uint64_t[::1] dst_ptrs, uint64_t capacity,
           uint64_t row, bint block, uint64_t start, bint split):
    """Decode ``values`` into the field buffers at ``dst_ptrs`` from ``row`` on.

    Returns ``(rows, consumed, partial, bad)``: rows written, whole values
    consumed, records already taken from value ``consumed`` when ``split`` let
    a block straddle the end of the buffers, and ``[(index, reason)]``.
    ``start`` records of the first value are skipped (taken earlier).
    """
    if dst_ptrs.shape[0] != layout.nfields:
        raise ValueError("one destination pointer per field is needed")
    if row > capacity:
        raise ValueError("row is past the end of the output")
    cdef _Values vals = _Values(values)
    cdef Py_ssize_t n = vals.n, i = 0, nbad = 0, f
    cdef uint8_t** dst = <uint8_t**>malloc(layout.nfields * sizeof(uint8_t*))
    cdef Py_ssize_t* bad_idx = <Py_ssize_t*>malloc((n if n else 1) * sizeof(Py_ssize_t))
    cdef Reason* bad_why = <Reason*>malloc((n if n else 1) * sizeof(Reason))
    if dst == NULL or bad_idx == NULL or bad_why == NULL:
        free(dst); free(bad_idx); free(bad_why)
        raise MemoryError()
    for f in range(layout.nfields):
        dst[f] = <uint8_t*>dst_ptrs[f]
    cdef uint64_t out_row = row, count = 0, col = 0, first, take, partial = 0
    cdef Reason why
    try:
        with nogil:
            while i < n and out_row < capacity:
                if vals.size[i] < 0:
                    why = <Reason>(-vals.size[i])
                elif block:
                    why = check_block(layout, vals.ptr[i], vals.size[i], &count, &col)
                elif <uint64_t>vals.size[i] != layout.record_size:
                    why = R_RAW_SIZE
                else:
                    why = R_OK
                    count = 1
                if why != R_OK:
                    bad_idx[nbad] = i
                    bad_why[nbad] = why
                    nbad += 1
                    i += 1
                    continue
                first = start if i == 0 else 0
                if first > count:
                    first = count
                take = count - first
                if take > capacity - out_row:
                    if not split:
                        break
                    take = capacity - out_row
                    partial = first + take
                if block:
                    copy_block(layout, vals.ptr[i], col, count, first, take, dst, out_row)
                elif take:
                    copy_raw(layout, vals.ptr[i], dst, out_row)
                out_row += take
                if partial:
                    break
                i += 1
        bad = [(bad_idx[k], REASONS[bad_why[k]]) for k in range(nbad)]
    finally:
        free(dst)
        free(bad_idx)
        free(bad_why)
    return out_row - row, i, partial, bad


cdef const uint8_t** column_pointers(list columns, Py_ssize_t nfields) except NULL:
    cdef const uint8_t** src = <const uint8_t**>malloc(nfields * sizeof(uint8_t*))
    if src == NULL:
        raise MemoryError()
    cdef const uint8_t[::1] view
    for f in range(nfields):
        view = columns[f]
        src[f] = &view[0] if view.shape[0] else NULL
    return src


def encode_blocks(Layout layout, list columns, uint64_t n, uint64_t block_records):
    """Pack ``n`` records into block values of at most ``block_records`` each.

    ``columns``: one C-contiguous uint8 view per field, ``n * row_bytes`` long,
    kept alive by the caller.
    """
    if len(columns) != layout.nfields:
        raise ValueError("one column per field is needed")
    if block_records == 0 or block_records > 0xFFFFFFFF:
        raise ValueError("block_records must be in 1..2**32-1")
    cdef const uint8_t** src = column_pointers(columns, layout.nfields)
    cdef list out = []
    cdef uint64_t s = 0, k, size, off, rb
    cdef Py_ssize_t f
    cdef uint8_t* p
    cdef uint32_t u32
    cdef uint64_t u64
    try:
        while s < n:
            k = min(block_records, n - s)
            size = layout.block_size(k)
            b = PyBytes_FromStringAndSize(NULL, size)
            p = <uint8_t*>PyBytes_AS_STRING(b)
            with nogil:
                memset(p, 0, HEADER_SIZE)
                u32 = BLOCK_MAGIC
                memcpy(p, &u32, 4)
                p[4] = FORMAT_VERSION
                p[5] = 0
                p[6] = HEADER_SIZE
                u32 = <uint32_t>k
                memcpy(p + 8, &u32, 4)
                u64 = layout.fingerprint
                memcpy(p + 16, &u64, 8)
                u64 = size - HEADER_SIZE
                memcpy(p + 24, &u64, 8)
                off = HEADER_SIZE
                for f in range(layout.nfields):
                    rb = layout.row_bytes[f]
                    memcpy(p + off, src[f] + s * rb, k * rb)
                    memset(p + off + k * rb, 0, align_up(k * rb) - k * rb)
                    off += align_up(k * rb)
            out.append(b)
            s += k
    finally:
        free(src)
    return out


def encode_raw(Layout layout, list columns, uint64_t n):
    """One raw value per record: the fields concatenated in schema order."""
    if len(columns) != layout.nfields:
        raise ValueError("one column per field is needed")
    cdef const uint8_t** src = column_pointers(columns, layout.nfields)
    cdef list out = []
    cdef uint64_t r, rb
    cdef Py_ssize_t f
    cdef uint8_t* p
    try:
        for r in range(n):
            b = PyBytes_FromStringAndSize(NULL, layout.record_size)
            p = <uint8_t*>PyBytes_AS_STRING(b)
            for f in range(layout.nfields):
                rb = layout.row_bytes[f]
                memcpy(p, src[f] + r * rb, rb)
                p += rb
            out.append(b)
    finally:
        free(src)
    return out


# -- schemas with a variable-length field (documents) ------------------------


cdef inline uint8_t* array_data(object arr):
    """Address of a numpy array's first byte (valid for empty arrays too)."""
    return <uint8_t*><uintptr_t>arr.__array_interface__["data"][0]


cdef class DocLayout:
    """Byte sizes of a schema with one variable-length field, as the codec needs them.

    ``row_bytes`` holds each fixed field's row size, and 0 at ``varlen``, the
    position of the variable-length field; its elements are ``itemsize`` bytes.
    """

    cdef readonly Py_ssize_t nfields
    cdef readonly Py_ssize_t varlen
    cdef readonly uint64_t itemsize
    cdef readonly uint64_t fixed_size
    cdef readonly uint64_t fingerprint
    cdef uint64_t* row_bytes

    def __cinit__(self, row_bytes, Py_ssize_t varlen, uint64_t itemsize, uint64_t fingerprint):
        self.nfields = len(row_bytes)
        if not 0 <= varlen < self.nfields:
            raise ValueError("varlen must be the index of a field")
        if itemsize not in (1, 2, 4, 8):
            raise ValueError("itemsize must be 1, 2, 4 or 8")
        self.row_bytes = <uint64_t*>malloc(self.nfields * sizeof(uint64_t))
        if self.row_bytes == NULL:
            raise MemoryError()
        self.fixed_size = 0
        for i, nbytes in enumerate(row_bytes):
            if i == varlen:
                if nbytes != 0:
                    raise ValueError("the variable-length field's row size must be 0")
            elif nbytes <= 0:
                raise ValueError("every fixed field needs a positive size")
            self.row_bytes[i] = nbytes
            self.fixed_size += nbytes
        self.varlen = varlen
        self.itemsize = itemsize
        self.fingerprint = fingerprint

    def __dealloc__(self):
        free(self.row_bytes)

    cdef uint64_t table_start(self, uint64_t count) noexcept nogil:
        """Bytes from the first column to the offsets table."""
        cdef uint64_t total = 0
        cdef Py_ssize_t f
        for f in range(self.varlen):
            total += align_up(count * self.row_bytes[f])
        return total

    cdef uint64_t block_size(self, uint64_t count, uint64_t elements) noexcept nogil:
        cdef uint64_t total = HEADER_SIZE
        cdef Py_ssize_t f
        for f in range(self.nfields):
            if f == self.varlen:
                total += align_up(4 * (count + 1)) + align_up(elements * self.itemsize)
            else:
                total += align_up(count * self.row_bytes[f])
        return total

    def block_nbytes(self, uint64_t count, uint64_t elements):
        """Size of a block holding ``count`` documents of ``elements`` elements in all."""
        return self.block_size(count, elements)


cdef Reason check_doc_block(DocLayout layout, const uint8_t* p, Py_ssize_t size,
                            uint64_t* count, uint64_t* start,
                            uint64_t* elements) noexcept nogil:
    """Validate a variable-length block whole, offsets included.

    On success gives its document count, where its first column starts, and
    the total number of elements (the last offset).
    """
    if size < HEADER_SIZE:
        return R_SHORT
    if load_u32(p) != BLOCK_MAGIC:
        return R_MAGIC
    if p[4] != FORMAT_VERSION:
        return R_VERSION
    if p[5] != FLAG_VARLEN:
        return R_FLAGS
    cdef uint64_t header_len = p[6] | (<uint64_t>p[7] << 8)
    if header_len < HEADER_SIZE or header_len % COLUMN_ALIGN or header_len > <uint64_t>size:
        return R_HEADER_LEN
    if load_u64(p + 16) != layout.fingerprint:
        return R_FINGERPRINT
    cdef uint64_t n = load_u32(p + 8)
    if n > UINT64_MAX // 2 // (layout.fixed_size + 4):
        return R_COUNT
    if load_u64(p + 24) != <uint64_t>size - HEADER_SIZE:
        return R_LENGTH
    cdef uint64_t table = header_len + layout.table_start(n)
    if table + 4 * (n + 1) > <uint64_t>size:
        return R_LENGTH
    cdef const uint8_t* q = p + table
    if load_u32(q) != 0:
        return R_OFFSETS_START
    cdef uint64_t i
    cdef uint32_t prev = 0, cur
    for i in range(1, n + 1):
        cur = load_u32(q + 4 * i)
        if cur < prev:
            return R_OFFSETS_ORDER
        prev = cur
    if layout.block_size(n, prev) - HEADER_SIZE + header_len != <uint64_t>size:
        return R_OFFSETS_END
    count[0] = n
    start[0] = header_len
    elements[0] = prev
    return R_OK


def decode_documents(DocLayout layout, values, bint block, uint64_t start):
    """Decode the documents in ``values``: one flat copy of their elements.

    Returns ``(elements, lengths, counts, fixed, bad)``:

    - ``elements``: the variable-length field of every document taken,
      concatenated, as raw bytes (a uint8 array, ``itemsize`` per element);
    - ``lengths``: int64, each document's length in elements;
    - ``counts``: int64, how many documents each value gave (0 when rejected);
    - ``fixed``: per field in schema order, the rows of a fixed field as a
      uint8 array, ``None`` at the variable-length field;
    - ``bad``: ``[(index, reason)]``.

    ``start`` documents of the first value are skipped (taken earlier). A
    first pass validates every value and sizes the outputs; a second copies,
    both without the GIL and with no Python object per document.
    """
    if not block and layout.nfields != 1:
        raise ValueError("a raw value holds only the variable-length field")
    cdef _Values vals = _Values(values)
    cdef Py_ssize_t n = vals.n, m = vals.n if vals.n > 0 else 1
    cdef Py_ssize_t nf = layout.nfields, v = layout.varlen, f, i
    cdef uint64_t isz = layout.itemsize
    cdef uint64_t* cnt = <uint64_t*>malloc(m * sizeof(uint64_t))
    cdef uint64_t* first = <uint64_t*>malloc(m * sizeof(uint64_t))
    cdef uint64_t* hdr = <uint64_t*>malloc(m * sizeof(uint64_t))
    cdef uint64_t* elems = <uint64_t*>malloc(m * sizeof(uint64_t))
    cdef Reason* why = <Reason*>malloc(m * sizeof(Reason))
    cdef uint8_t** dst = <uint8_t**>calloc(nf, sizeof(uint8_t*))
    if not (cnt and first and hdr and elems and why and dst):
        free(cnt); free(first); free(hdr); free(elems); free(why); free(dst)
        raise MemoryError()
    cdef uint64_t ndocs = 0, nelem = 0, k, a, col, j, d, e
    cdef const uint8_t* p
    cdef const uint8_t* q
    cdef uint8_t* out_elems
    cdef int64_t* out_len
    cdef int64_t* out_cnt
    try:
        with nogil:
            for i in range(n):
                cnt[i] = 0
                if vals.size[i] < 0:
                    why[i] = <Reason>(-vals.size[i])
                elif block:
                    why[i] = check_doc_block(layout, vals.ptr[i], vals.size[i],
                                             &cnt[i], &hdr[i], &elems[i])
                elif <uint64_t>vals.size[i] % isz:
                    why[i] = R_RAW_ITEMSIZE
                else:
                    why[i] = R_OK
                    cnt[i] = 1
                    hdr[i] = 0
                    elems[i] = <uint64_t>vals.size[i] // isz
                if why[i] != R_OK:
                    continue
                first[i] = start if i == 0 else 0
                if first[i] > cnt[i]:
                    first[i] = cnt[i]
                ndocs += cnt[i] - first[i]
                if first[i] == 0:
                    nelem += elems[i]
                elif block:
                    q = vals.ptr[i] + hdr[i] + layout.table_start(cnt[i])
                    nelem += elems[i] - load_u32(q + 4 * first[i])
        bad = [(i, _ALL_REASONS[why[i]]) for i in range(n) if why[i] != R_OK]
        elements = np.empty(nelem * isz, np.uint8)
        lengths = np.empty(ndocs, np.int64)
        counts = np.empty(n, np.int64)
        fixed = [None if f == v else np.empty(ndocs * layout.row_bytes[f], np.uint8)
                 for f in range(nf)]
        out_elems = array_data(elements)
        out_len = <int64_t*>array_data(lengths)
        out_cnt = <int64_t*>array_data(counts)
        for f in range(nf):
            if f != v:
                dst[f] = array_data(fixed[f])
        with nogil:
            d = 0
            e = 0
            for i in range(n):
                if why[i] != R_OK:
                    out_cnt[i] = 0
                    continue
                k = cnt[i] - first[i]
                out_cnt[i] = k
                p = vals.ptr[i]
                if not block:
                    if k:
                        out_len[d] = elems[i]
                        memcpy(out_elems + e * isz, p, elems[i] * isz)
                        e += elems[i]
                    d += k
                    continue
                col = hdr[i]
                for f in range(nf):
                    if f != v:
                        memcpy(dst[f] + d * layout.row_bytes[f],
                               p + col + first[i] * layout.row_bytes[f],
                               k * layout.row_bytes[f])
                        col += align_up(cnt[i] * layout.row_bytes[f])
                        continue
                    q = p + col
                    for j in range(first[i], cnt[i]):
                        out_len[d + j - first[i]] = load_u32(q + 4 * (j + 1)) - load_u32(q + 4 * j)
                    a = load_u32(q + 4 * first[i])
                    col += align_up(4 * (cnt[i] + 1))
                    memcpy(out_elems + e * isz, p + col + a * isz, (elems[i] - a) * isz)
                    e += elems[i] - a
                    col += align_up(elems[i] * isz)
                d += k
    finally:
        free(cnt); free(first); free(hdr); free(elems); free(why); free(dst)
    return elements, lengths, counts, fixed, bad


cdef bytes doc_block(DocLayout layout, const uint8_t** src, const int64_t* offsets,
                     uint64_t s, uint64_t k):
    """One block of documents [s, s + k); ``src[varlen]`` holds the elements."""
    cdef uint64_t base = offsets[s] if k else 0
    cdef uint64_t total = offsets[s + k] - base if k else 0
    cdef uint64_t size = layout.block_size(k, total)
    b = PyBytes_FromStringAndSize(NULL, size)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(b)
    cdef uint64_t off, rb, i, isz = layout.itemsize
    cdef uint32_t u32
    cdef uint64_t u64
    cdef Py_ssize_t f
    with nogil:
        memset(p, 0, HEADER_SIZE)
        u32 = BLOCK_MAGIC
        memcpy(p, &u32, 4)
        p[4] = FORMAT_VERSION
        p[5] = FLAG_VARLEN
        p[6] = HEADER_SIZE
        u32 = <uint32_t>k
        memcpy(p + 8, &u32, 4)
        u64 = layout.fingerprint
        memcpy(p + 16, &u64, 8)
        u64 = size - HEADER_SIZE
        memcpy(p + 24, &u64, 8)
        off = HEADER_SIZE
        for f in range(layout.nfields):
            if f == layout.varlen:
                for i in range(k + 1):
                    u32 = <uint32_t>(offsets[s + i] - base) if k else 0
                    memcpy(p + off + 4 * i, &u32, 4)
                memset(p + off + 4 * (k + 1), 0, align_up(4 * (k + 1)) - 4 * (k + 1))
                off += align_up(4 * (k + 1))
                if total:
                    memcpy(p + off, src[f] + base * isz, total * isz)
                memset(p + off + total * isz, 0, align_up(total * isz) - total * isz)
                off += align_up(total * isz)
            else:
                rb = layout.row_bytes[f]
                if k:
                    memcpy(p + off, src[f] + s * rb, k * rb)
                memset(p + off + k * rb, 0, align_up(k * rb) - k * rb)
                off += align_up(k * rb)
    return b


def encode_doc_blocks(DocLayout layout, list columns, const int64_t[::1] offsets,
                      uint64_t n, uint64_t block_records, uint64_t block_bytes):
    """Pack ``n`` documents into blocks of at most ``block_records`` each.

    ``columns``: one C-contiguous uint8 view per field: a fixed field's
    ``n * row_bytes`` bytes, or at the variable-length field every document's
    elements concatenated. ``offsets``: ``n + 1`` element offsets into those,
    from 0, non-decreasing (checked by the caller). A block is also closed
    before it would grow past ``block_bytes`` (0: no limit), unless it holds
    a single document; and before its elements would overflow a uint32 offset.
    ``n == 0`` gives one empty block.
    """
    if len(columns) != layout.nfields:
        raise ValueError("one column per field is needed")
    if <uint64_t>offsets.shape[0] != n + 1:
        raise ValueError("offsets must hold n + 1 entries")
    if block_records == 0 or block_records > 0xFFFFFFFF:
        raise ValueError("block_records must be in 1..2**32-1")
    cdef const uint8_t** src = column_pointers(columns, layout.nfields)
    cdef list out = []
    cdef uint64_t s = 0, k, span
    try:
        if n == 0:
            return [doc_block(layout, src, &offsets[0], 0, 0)]
        while s < n:
            if <uint64_t>(offsets[s + 1] - offsets[s]) > 0xFFFFFFFF:
                raise ValueError("a document holds more than 2**32-1 elements")
            k = 1
            while k < block_records and s + k < n:
                span = offsets[s + k + 1] - offsets[s]
                if span > 0xFFFFFFFF:
                    break
                if block_bytes and layout.block_size(k + 1, span) > block_bytes:
                    break
                k += 1
            out.append(doc_block(layout, src, &offsets[0], s, k))
            s += k
    finally:
        free(src)
    return out


def encode_doc_raw(DocLayout layout, const uint8_t[::1] elements, const int64_t[::1] offsets,
                   uint64_t n):
    """One raw value per document: its elements, nothing else."""
    if layout.nfields != 1:
        raise ValueError("a raw value holds only the variable-length field")
    if <uint64_t>offsets.shape[0] != n + 1:
        raise ValueError("offsets must hold n + 1 entries")
    cdef const uint8_t* base = &elements[0] if elements.shape[0] else NULL
    cdef uint64_t isz = layout.itemsize, i
    cdef list out = []
    for i in range(n):
        if offsets[i + 1] == offsets[i]:
            out.append(b"")
        else:
            out.append(PyBytes_FromStringAndSize(<const char*>(base + offsets[i] * isz),
                                                 (offsets[i + 1] - offsets[i]) * isz))
    return out
