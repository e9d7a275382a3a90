"""The record codec: block and raw message values <-> columns of records.

This is the hot path between Kafka message values and the buffer pool. Decode
validates a whole value before any byte of it reaches the output, then copies
each field with one memcpy (block) or one memcpy per record (raw), without the
GIL and without creating a Python object per record. Knows nothing of Kafka or
torch; ``kfeed.schema`` is its front. The format is documented in
docs/FORMAT.md.

Every entry point is a thin ``def`` that checks its arguments and holds its
buffers, around a ``nogil`` core that works on pointers derived here from
those buffers: the caller hands in objects with the buffer protocol (message
values, numpy arrays), never addresses, and each output buffer is checked to
hold every row a core may write. One helper writes the 32-byte block header
and one checks it, for both kinds of block.

Schemas with a variable-length field (token documents) have their own layout
class, ``DocLayout``, and their own entry points: ``decode_documents`` turns
message values into one flat array of elements plus one length per document,
ready for the packer (``kfeed._pack``), again with no Python object per record.

Avro message values (one record each, as other services write them) are read
by compiled plans into the same ``Out`` buffers: ``_avro.pxi``, and Protobuf
messages likewise by ``_protobuf.pxi``, JSON objects by ``_json.pxi``, and
Arrow IPC record batches by ``_arrow.pxi``, all included at the end of this
module.
"""

import sys

import numpy as np

from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_SIMPLE, PyBUF_WRITABLE,
                             PyBuffer_Release, PyObject_GetBuffer)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport (INT64_MAX, INT64_MIN, UINT64_MAX, int8_t, int16_t, int32_t, int64_t, uint8_t,
                          uint16_t, uint32_t, uint64_t, uintptr_t)
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset

cdef extern from *:
    void __builtin_prefetch(const void* addr) nogil

# NOTE [ Streaming stores ]
# A long run of bytes copied into the output (a block's column of 64 records,
# a raw record's 3 KB field, an Avro array of 768 floats) goes around the cache: the output is a pool slot that this thread
# never reads again, and that the device copy or the consumer reads later,
# by which time the batches in between have pushed it out anyway. Written
# through the cache, each of its lines is first read from memory, only to be
# overwritten; streamed, it is written once. Copying 3 KB records from their
# messages into rows of a cold output (AMD EPYC, 2 vCPUs): 10.7 GB/s with
# memcpy, 17.8 GB/s streamed, against 20.6 GB/s for one contiguous memcpy of
# the same bytes. Runs shorter than STREAM_MIN, and hosts without SSE2, take
# memcpy. The stores are ordered by stream_fence() before the output is
# handed on (the GIL's own lock would order them too, on x86).
cdef extern from *:
    """
    #include <string.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    static inline void kfeed_stream_copy(void *dst, const void *src, size_t n) {
        unsigned char *d = (unsigned char *)dst;
        const unsigned char *s = (const unsigned char *)src;
        size_t head = (16 - ((size_t)d & 15)) & 15;
        if (head > n) head = n;
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        for (; n >= 64; n -= 64, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        for (; n >= 16; n -= 16, d += 16, s += 16)
            _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
        memcpy(d, s, n);
    }
    static inline void kfeed_stream_fence(void) { _mm_sfence(); }
    #else
    static inline void kfeed_stream_copy(void *dst, const void *src, size_t n) {
        memcpy(dst, src, n);
    }
    static inline void kfeed_stream_fence(void) {}
    #endif
    """
    void stream_copy "kfeed_stream_copy"(void* dst, const void* src, size_t n) nogil
    void stream_fence "kfeed_stream_fence"() nogil

cdef enum:
    STREAM_MIN = 1024


cdef inline void copy_out(void* dst, const void* src, size_t n, bint reread) noexcept nogil:
    """``n`` bytes into the output: streamed when the run is long (NOTE [ Streaming
    stores ]), unless the caller reads them back at once (``reread``: a buffer of
    documents, made bytes when the call ends)."""
    if n >= STREAM_MIN and not reread:
        stream_copy(dst, src, n)
    else:
        memcpy(dst, src, n)

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


cdef inline bint holds(uint64_t nbytes, uint64_t n, uint64_t size) noexcept nogil:
    """Whether ``n`` items of ``size`` bytes are exactly ``nbytes`` (no wrap-around)."""
    if size == 0:
        return nbytes == 0
    return nbytes % size == 0 and nbytes // size == n


cdef bint utf8_valid(const uint8_t* p, uint64_t n) noexcept nogil:
    """Whether the ``n`` bytes at ``p`` are UTF-8 as protobuf and Python check a string:
    shortest forms, no surrogates, up to U+10FFFF."""
    cdef uint64_t i = 0, word
    cdef uint8_t b, lo, hi
    cdef int k, more
    while i < n:
        if n - i >= 8:  # ASCII, 8 bytes at a time
            memcpy(&word, p + i, 8)
            if not (word & 0x8080808080808080ULL):
                i += 8
                continue
        b = p[i]
        if b < 0x80:
            i += 1
            continue
        lo, hi = 0x80, 0xBF
        if 0xC2 <= b <= 0xDF:
            more = 1
        elif 0xE0 <= b <= 0xEF:
            more = 2
            if b == 0xE0:
                lo = 0xA0  # not an overlong form
            elif b == 0xED:
                hi = 0x9F  # not a surrogate
        elif 0xF0 <= b <= 0xF4:
            more = 3
            if b == 0xF0:
                lo = 0x90  # not an overlong form
            elif b == 0xF4:
                hi = 0x8F  # not past U+10FFFF
        else:
            return False
        if n - i <= <uint64_t>more:
            return False
        for k in range(1, more + 1):
            if not ((lo if k == 1 else 0x80) <= p[i + k] <= (hi if k == 1 else 0xBF)):
                return False
        i += more + 1
    return True


# -- the block header: written by one helper, checked by one ------------------


cdef void write_header(uint8_t* p, uint8_t flags, uint64_t count, uint64_t fingerprint,
                       uint64_t size) noexcept nogil:
    """The 32-byte header of a block value of ``size`` bytes (docs/FORMAT.md, Header)."""
    cdef uint32_t u32 = BLOCK_MAGIC
    cdef uint64_t body = size - HEADER_SIZE
    memset(p, 0, HEADER_SIZE)  # the reserved word and header_len's high byte
    memcpy(p, &u32, 4)
    p[4] = FORMAT_VERSION
    p[5] = flags
    p[6] = HEADER_SIZE  # header_len: writers put the first column right after the header
    u32 = <uint32_t>count
    memcpy(p + 8, &u32, 4)
    memcpy(p + 16, &fingerprint, 8)
    memcpy(p + 24, &body, 8)


cdef Reason check_header(const uint8_t* p, Py_ssize_t size, uint8_t flags,
                         uint64_t fingerprint, uint64_t max_count, uint64_t* count,
                         uint64_t* header_len) noexcept nogil:
    """Check what every block's header must say; on success give its count and header_len.

    The order of the checks picks the reason a value is rejected with, and
    the count is bounded before any size is computed from it, so no sum the
    caller makes of ``count`` records can wrap around.
    """
    if size < HEADER_SIZE:
        return R_SHORT
    if load_u32(p) != BLOCK_MAGIC:
        return R_MAGIC
    if p[4] != FORMAT_VERSION:
        return R_VERSION
    if p[5] != flags:
        return R_FLAGS
    cdef uint64_t hl = p[6] | (<uint64_t>p[7] << 8)
    if hl < HEADER_SIZE or hl % COLUMN_ALIGN or hl > <uint64_t>size:
        return R_HEADER_LEN
    if load_u64(p + 16) != fingerprint:
        return R_FINGERPRINT
    cdef uint64_t n = load_u32(p + 8)
    if n > max_count:
        return R_COUNT
    if load_u64(p + 24) != <uint64_t>size - HEADER_SIZE:
        return R_LENGTH
    count[0] = n
    header_len[0] = hl
    return R_OK


# -- buffers held for a nogil pass ----------------------------------------------

# NOTE [ Fetching values ahead ]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each message value is its own bytes object, read once. The Protobuf
# decoder stores what it reads as it reads it (``pb_store``), and spent a
# third of a 200 B event's time waiting on the loads of the value's first
# lines, whether the values lie one after another, as a consumer makes them,
# or scattered. It asks for the first two lines of the value VALUE_AHEAD on
# before it reads one (``fetch_value_ahead``): decoding 200 B events went
# from 6.9M to 8.6M records/s (AMD EPYC, 2 vCPUs, values in turn), 7.0M to
# 8.6M scattered. Values of 3 KB (768 packed floats, copied with streaming
# stores) lost 10% to the same requests, and the hardware's prefetcher
# follows a long value once its copy begins: values past VALUE_AHEAD_MOST
# bytes are not asked for. The Avro and JSON decoders, asking the same, read
# their 200 B events no faster (7.1M to 7.3M and 1.9M to 2.0M records/s
# either way): their work a byte hides the loads.
cdef enum:
    VALUE_AHEAD = 4
    VALUE_AHEAD_MOST = 512


cdef inline void fetch_value_ahead(const uint8_t** ptr, const Py_ssize_t* size, Py_ssize_t n,
                                   Py_ssize_t i) noexcept nogil:
    """Ask for the first lines of value ``i + VALUE_AHEAD`` (NOTE [ Fetching values ahead ])."""
    i += VALUE_AHEAD
    if i < n and 0 < size[i] <= VALUE_AHEAD_MOST:
        __builtin_prefetch(ptr[i])
        __builtin_prefetch(ptr[i] + 64)


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


cdef class _Buffers:
    """One C-contiguous buffer per field, held while the object lives.

    Pointers and byte lengths come from the buffer protocol; ``writable``
    asks the exporters for writable memory (a read-only numpy array is
    refused). ``None`` stands for a field with no buffer (pointer NULL).
    """
    cdef Py_ssize_t n
    cdef uint8_t** ptr
    cdef uint64_t* nbytes
    cdef Py_buffer* views
    cdef uint8_t* held

    def __cinit__(self, objs, bint writable, tuple names, str what):
        cdef list items = list(objs)
        self.n = len(items)
        cdef Py_ssize_t m = self.n if self.n > 0 else 1
        self.ptr = <uint8_t**>calloc(m, sizeof(uint8_t*))
        self.nbytes = <uint64_t*>calloc(m, sizeof(uint64_t))
        self.views = <Py_buffer*>malloc(m * sizeof(Py_buffer))
        self.held = <uint8_t*>calloc(m, 1)
        if not (self.ptr and self.nbytes and self.views and self.held):
            raise MemoryError()
        cdef int flags = PyBUF_C_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0)
        cdef Py_ssize_t i
        for i in range(self.n):
            if items[i] is None:
                continue
            try:
                PyObject_GetBuffer(items[i], &self.views[i], flags)
            except (TypeError, BufferError, ValueError) as e:
                kind = "writable C-contiguous" if writable else "C-contiguous"
                raise ValueError(
                    f"{what} {names[i]!r} must be a {kind} buffer, got "
                    f"{type(items[i]).__name__}: {e}") from None
            self.held[i] = 1
            self.ptr[i] = <uint8_t*>self.views[i].buf
            self.nbytes[i] = self.views[i].len

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.held != NULL:
            for i in range(self.n):
                if self.held[i]:
                    PyBuffer_Release(&self.views[i])
        free(self.ptr)
        free(self.nbytes)
        free(self.views)
        free(self.held)


cdef tuple _names(object names, Py_ssize_t nfields):
    if names is None:
        return tuple(f"field {i}" for i in range(nfields))
    names = tuple(str(x) for x in names)
    if len(names) != nfields:
        raise ValueError("one name per field is needed")
    return names


# -- fixed-shape schemas -----------------------------------------------------------


cdef class Layout:
    """Byte sizes of a schema's fields, as the codec needs them."""

    cdef readonly Py_ssize_t nfields
    cdef readonly uint64_t record_size
    cdef readonly uint64_t fingerprint
    cdef readonly tuple names
    cdef uint64_t max_count          # records a block may claim before sizes could wrap
    cdef uint64_t* row_bytes

    def __cinit__(self, row_bytes, uint64_t fingerprint, names=None):
        self.nfields = len(row_bytes)
        if self.nfields == 0:
            raise ValueError("a layout needs at least one field")
        self.names = _names(names, self.nfields)
        self.row_bytes = <uint64_t*>malloc(self.nfields * sizeof(uint64_t))
        if self.row_bytes == NULL:
            raise MemoryError()
        self.record_size = 0
        for i, nbytes in enumerate(row_bytes):
            if nbytes <= 0:
                raise ValueError("every field needs a positive size")
            if nbytes > UINT64_MAX // 4 - self.record_size:
                raise ValueError("the record size overflows")
            self.row_bytes[i] = nbytes
            self.record_size += nbytes
        self.fingerprint = fingerprint
        self.max_count = UINT64_MAX // 2 // self.record_size

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


cdef class Out:
    """The output buffers of a fixed-shape decode: one per field, ``capacity`` rows each.

    Built from objects with the buffer protocol (numpy arrays, a CPU
    tensor's ``.numpy()``), never from addresses: each must be writable and
    C-contiguous and hold a whole number of its field's rows, the same number
    for every field. The buffers stay held (a numpy array cannot be resized)
    while this object lives.
    """

    cdef readonly uint64_t capacity
    cdef readonly Py_ssize_t nfields
    cdef _Buffers bufs

    def __cinit__(self, Layout layout, buffers):
        buffers = list(buffers)
        if len(buffers) != layout.nfields:
            raise ValueError(f"one buffer per field is needed: {len(layout.names)} fields, "
                             f"{len(buffers)} buffers")
        self.nfields = layout.nfields
        self.bufs = _Buffers(buffers, True, layout.names, "out")
        cdef Py_ssize_t f
        cdef uint64_t rb, rows
        for f in range(self.nfields):
            if buffers[f] is None:
                raise ValueError(f"out {layout.names[f]!r} needs a buffer")
            rb = layout.row_bytes[f]
            if self.bufs.nbytes[f] % rb:
                raise ValueError(f"out {layout.names[f]!r} holds {self.bufs.nbytes[f]} bytes, "
                                 f"not a whole number of {rb}-byte rows")
            rows = self.bufs.nbytes[f] // rb
            if f == 0:
                self.capacity = rows
            elif rows != self.capacity:
                raise ValueError(f"out {layout.names[f]!r} has {rows} rows, "
                                 f"out {layout.names[0]!r} has {self.capacity}")

    @property
    def addresses(self):
        """Where each buffer starts, for inspection: nothing takes addresses back."""
        return tuple(<uintptr_t>self.bufs.ptr[f] for f in range(self.nfields))

    cdef int fits(self, Layout layout) except -1:
        """Refuse a layout whose rows would not fit: decode writes ``capacity`` rows at most."""
        cdef Py_ssize_t f
        if layout.nfields != self.nfields:
            raise ValueError(f"out has {self.nfields} buffers, the layout {layout.nfields} fields")
        for f in range(self.nfields):
            if self.capacity > self.bufs.nbytes[f] // layout.row_bytes[f]:
                raise ValueError(f"out {layout.names[f]!r} holds {self.bufs.nbytes[f]} bytes, "
                                 f"less than {self.capacity} rows of this layout")
        return 0


cdef Reason check_block(Layout layout, const uint8_t* p, Py_ssize_t size,
                        uint64_t* count, uint64_t* start) noexcept nogil:
    """Validate a block value whole; on success give its count and column start."""
    cdef Reason why = check_header(p, size, 0, layout.fingerprint, layout.max_count,
                                   count, start)
    if why != R_OK:
        return why
    if layout.block_size(count[0]) - HEADER_SIZE + start[0] != <uint64_t>size:
        return R_LENGTH
    return R_OK


cdef void copy_block(Layout layout, const uint8_t* p, uint64_t col, uint64_t count,
                     uint64_t first, uint64_t take, uint8_t** dst,
                     uint64_t row) noexcept nogil:
    """Copy records [first, first + take) of a validated block to ``row``."""
    cdef Py_ssize_t f
    cdef uint64_t rb
    for f in range(layout.nfields):
        rb = layout.row_bytes[f]
        copy_out(dst[f] + row * rb, p + col + first * rb, take * rb, False)
        col += align_up(count * rb)


cdef void copy_raw(Layout layout, const uint8_t* p, uint8_t** dst,
                   uint64_t row) noexcept nogil:
    cdef Py_ssize_t f
    cdef uint64_t rb
    for f in range(layout.nfields):
        rb = layout.row_bytes[f]
        copy_out(dst[f] + row * rb, p, rb, False)
        p += rb


cdef struct Decoded:
    uint64_t rows           # rows written
    Py_ssize_t consumed     # whole values used
    uint64_t partial        # records taken from value ``consumed`` (split)
    Py_ssize_t nbad         # entries of bad_idx / bad_why


cdef void decode_values(Layout layout, const uint8_t** ptr, const Py_ssize_t* size,
                        Py_ssize_t n, uint8_t** dst, uint64_t capacity, uint64_t row,
                        bint block, uint64_t start, bint split, int64_t* counts,
                        Py_ssize_t* bad_idx, Reason* bad_why, Decoded* res) noexcept nogil:
    """The decode loop: values -> rows ``row``.. of ``dst``, ``capacity`` rows at most.

    A negative ``size`` is a value rejected before (a Reason). ``counts``,
    when not NULL, gets the records taken from each value looked at (0 for a
    rejected one).
    """
    cdef Py_ssize_t i = 0, nbad = 0
    cdef uint64_t out_row = row, count = 0, col = 0, first, take, partial = 0
    cdef Reason why
    while i < n and out_row < capacity:
        if size[i] < 0:
            why = <Reason>(-size[i])
        elif block:
            why = check_block(layout, ptr[i], size[i], &count, &col)
        elif <uint64_t>size[i] != layout.record_size:
            why = R_RAW_SIZE
        else:
            why = R_OK
            count = 1
        if why != R_OK:
            bad_idx[nbad] = i
            bad_why[nbad] = why
            nbad += 1
            if counts != NULL:
                counts[i] = 0
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
            copy_block(layout, ptr[i], col, count, first, take, dst, out_row)
        elif take:
            copy_raw(layout, ptr[i], dst, out_row)
        if counts != NULL:
            counts[i] = take
        out_row += take
        if partial:
            break
        i += 1
    stream_fence()
    res.rows = out_row - row
    res.consumed = i
    res.partial = partial
    res.nbad = nbad


cdef tuple _decode(Layout layout, values, Out out, uint64_t row, bint block, uint64_t start,
                   bint split, int64_t* counts, Py_ssize_t ncounts):
    out.fits(layout)
    if row > out.capacity:
        raise ValueError(f"row {row} is past the end of the output ({out.capacity} rows)")
    cdef _Values vals = _Values(values)
    if counts != NULL and ncounts < vals.n:
        raise ValueError("counts needs one entry per value")
    cdef Py_ssize_t m = vals.n if vals.n else 1
    cdef Py_ssize_t* bad_idx = <Py_ssize_t*>malloc(m * sizeof(Py_ssize_t))
    cdef Reason* bad_why = <Reason*>malloc(m * sizeof(Reason))
    cdef Decoded res
    if bad_idx == NULL or bad_why == NULL:
        free(bad_idx)
        free(bad_why)
        raise MemoryError()
    try:
        with nogil:
            decode_values(layout, vals.ptr, vals.size, vals.n, out.bufs.ptr, out.capacity, row,
                          block, start, split, counts, bad_idx, bad_why, &res)
        bad = [(bad_idx[k], REASONS[bad_why[k]]) for k in range(res.nbad)]
    finally:
        free(bad_idx)
        free(bad_why)
    return res.rows, res.consumed, res.partial, bad


def decode(Layout layout, values, Out out, uint64_t row, bint block, uint64_t start,
           bint split):
    """Decode ``values`` into ``out`` from ``row`` on.

    Returns ``(rows, consumed, partial, bad)``: rows written, whole values
    consumed, records already taken from value ``consumed`` when ``split`` let
    a block straddle the end of the buffers, and ``[(index, reason)]``.
    ``start`` records of the first value are skipped (taken earlier).
    """
    return _decode(layout, values, out, row, block, start, split, NULL, 0)


def decode_counted(Layout layout, values, Out out, uint64_t row, bint block, uint64_t start,
                   bint split, int64_t[::1] counts):
    """``decode``, and the records taken from each value into ``counts``.

    ``counts[i]`` for ``i < consumed`` (and ``i == consumed`` when
    ``partial``) is the number of rows value ``i`` wrote, 0 for a rejected
    one; later entries are left as they were. With it a caller that decodes
    many values into a staging area knows which rows came from which value.
    """
    if counts.shape[0] == 0:
        return _decode(layout, values, out, row, block, start, split, NULL, 0)
    return _decode(layout, values, out, row, block, start, split, &counts[0], counts.shape[0])


def gather(Layout layout, Out src, const int64_t[::1] rows, Out dst, uint64_t row):
    """Copy rows ``rows[k]`` of ``src`` to rows ``row + k`` of ``dst``, every field.

    One call, without the GIL, for a batch of records picked by index (a
    shuffle's choice) out of a staging area. IndexError if an index is
    outside ``src`` or the rows would overflow ``dst``.
    """
    src.fits(layout)
    dst.fits(layout)
    cdef Py_ssize_t n = rows.shape[0], k, f
    if row > dst.capacity or <uint64_t>n > dst.capacity - row:
        raise IndexError(f"{n} rows from row {row} overflow the output ({dst.capacity} rows)")
    for k in range(n):
        if rows[k] < 0 or <uint64_t>rows[k] >= src.capacity:
            raise IndexError(f"row {rows[k]} is outside the source ({src.capacity} rows)")
    cdef uint8_t** s = src.bufs.ptr
    cdef uint8_t** d = dst.bufs.ptr
    cdef uint64_t rb
    with nogil:
        for f in range(layout.nfields):
            rb = layout.row_bytes[f]
            for k in range(n):
                memcpy(d[f] + (row + k) * rb, s[f] + rows[k] * rb, rb)


# -- records held in their message values (a shuffle's buffer) -------------------


# An item's low 32 bits: the record's index in its value (a block counts in uint32).
cdef int64_t ITEM_RECORD = 0xFFFFFFFF
# Held.gather asks for the first cache line of record k + GATHER_AHEAD's
# field while it copies record k's: the miss on a record's first line (and
# its page) then overlaps the copies before it, and the hardware's
# prefetcher follows the rest of the record once it is read. On 3 KB
# records (AMD EPYC, 2 vCPUs), against copying with no prefetch: picked at
# random from 10,000, 1.15x; in offset order (a mixture's records, taken in
# turn from each source), 1.05x to 1.1x. Asking for a whole record 4 ahead (48
# lines, what an earlier machine favoured) was 1.08x at random but 0.83x in
# order: the prefetches of lines the hardware fetches anyway cost more.
cdef enum:
    GATHER_AHEAD = 16


cdef struct HeldValue:
    const uint8_t* ptr      # the value's bytes, or its kept rows once compacted; NULL: free
    uint64_t count          # records in the value
    uint64_t col            # where its first column starts (a block, in place)
    uint64_t live           # records not gathered nor dropped yet
    uint64_t nbytes         # bytes held for it
    uint8_t* gone           # per record (compacted: per kept record): gathered or dropped
    uint32_t* kept          # compacted: the indices of the records kept, ascending
    uint64_t nkept          # compacted: how many
    bint view               # views[slot] holds the value


cdef inline int64_t held_row(const HeldValue* v, int64_t r) noexcept nogil:
    """Where record ``r`` of a held value is: its index in place, its kept row, or -1."""
    cdef int64_t lo = 0, hi, mid
    if r < 0 or <uint64_t>r >= v.count:
        return -1
    if v.kept == NULL:
        return r
    hi = <int64_t>v.nkept
    while lo < hi:
        mid = (lo + hi) >> 1
        if v.kept[mid] < r:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < <int64_t>v.nkept and v.kept[lo] == r else -1


cdef class Held:
    """Message values whose records a shuffle holds, read back record by record.

    ``add`` checks fetched values whole, as ``decode`` does, and holds each
    good one in a *slot* until every record taken from it has been gathered
    into a batch (``gather``) or let go (``drop``). A record is named by an
    *item*, ``slot << 32 | its index in the value``, which is all the
    shuffle's order moves. So a shuffled record is copied once, from its
    message straight into the batch, as a record in offset order is.

    A value is held whole while any of its records is, so a few records
    left of many values could hold much more than they weigh: once the
    values held pass ``limit`` bytes (0: no limit), each value whose records
    left weigh a quarter of it or less is *compacted*: those records are
    copied out, their items unchanged, and the value is let go.

    Items are checked against what is held before any byte moves: an item
    of no held value, past its value's records, or of a record gathered or
    dropped already, is an IndexError that changes nothing, never a read
    outside a value. ``block``: the values are blocks, else raw records.
    """

    cdef Layout layout
    cdef bint block
    cdef readonly uint64_t limit
    cdef Py_ssize_t cap
    cdef Py_buffer* views
    cdef HeldValue* v
    cdef int64_t* free_slots
    cdef Py_ssize_t nfree
    cdef readonly Py_ssize_t values     # values held (compacted ones included)
    cdef readonly uint64_t records      # records held
    cdef readonly uint64_t nbytes       # bytes held: values, kept rows, flags
    cdef readonly uint64_t compacted    # values compacted so far

    def __cinit__(self, Layout layout, bint block, uint64_t limit=0):
        self.layout = layout
        self.block = block
        self.limit = limit
        self._grow(64)

    cdef int _grow(self, Py_ssize_t cap) except -1:
        cdef Py_ssize_t s, old = self.cap
        cdef void* p
        p = realloc(self.views, cap * sizeof(Py_buffer))
        if p == NULL:
            raise MemoryError()
        self.views = <Py_buffer*>p
        p = realloc(self.v, cap * sizeof(HeldValue))
        if p == NULL:
            raise MemoryError()
        self.v = <HeldValue*>p
        p = realloc(self.free_slots, cap * sizeof(int64_t))
        if p == NULL:
            raise MemoryError()
        self.free_slots = <int64_t*>p
        # New slots are free; the lowest is handed out first.
        for s in range(cap - 1, old - 1, -1):
            memset(&self.v[s], 0, sizeof(HeldValue))
            self.free_slots[self.nfree] = s
            self.nfree += 1
        self.cap = cap
        return 0

    cdef void _release(self, Py_ssize_t s):
        cdef HeldValue* v = &self.v[s]
        if v.view:
            PyBuffer_Release(&self.views[s])
        if v.kept != NULL:
            free(<void*>v.ptr)
        free(v.gone)
        free(v.kept)
        self.nbytes -= v.nbytes
        self.records -= v.live
        memset(v, 0, sizeof(HeldValue))
        self.free_slots[self.nfree] = s
        self.nfree += 1
        self.values -= 1

    def add(self, values, const int64_t[::1] pids, const int64_t[::1] offsets):
        """Hold the good ones of ``values``: ``(records, counts, bad)``.

        ``records``: int64 rows ``[pids[i], offsets[i], index in value i,
        item]``, one per record of every good value, in order (the rows a
        ``kfeed.tokens.ShuffleBuffer`` takes); ``counts``: int64, the
        records of each value (0 for a rejected one); ``bad``: ``[(index,
        reason)]`` for each value rejected whole.
        """
        cdef list vals = values if type(values) is list else list(values)
        cdef Py_ssize_t n = len(vals), i, s, j = 0
        if pids.shape[0] != n or offsets.shape[0] != n:
            raise ValueError("one pid and one offset per value are needed")
        counts = np.zeros(n, np.int64)
        cdef int64_t[::1] cnt = counts
        cdef list bad = []
        cdef int64_t[::1] slot_of = np.empty(n, np.int64)
        cdef uint64_t c = 0, start = 0, total = 0, k
        cdef Reason why
        cdef object val
        cdef const uint8_t* p
        cdef HeldValue* v
        for i in range(n):
            val = vals[i]
            slot_of[i] = -1
            if val is None:
                bad.append((i, REASONS[R_NONE]))
                continue
            if self.nfree == 0:
                self._grow(2 * self.cap)
            s = self.free_slots[self.nfree - 1]
            try:
                PyObject_GetBuffer(val, &self.views[s], PyBUF_SIMPLE)
            except (TypeError, BufferError, ValueError):
                bad.append((i, REASONS[R_NOT_BYTES]))
                continue
            p = <const uint8_t*>self.views[s].buf
            if self.block:
                why = check_block(self.layout, p, self.views[s].len, &c, &start)
            elif <uint64_t>self.views[s].len != self.layout.record_size:
                why = R_RAW_SIZE
            else:
                why, c, start = R_OK, 1, 0
            if why != R_OK or c == 0:
                PyBuffer_Release(&self.views[s])
                if why != R_OK:
                    bad.append((i, REASONS[why]))
                continue
            v = &self.v[s]
            v.gone = <uint8_t*>calloc(c, 1)
            if v.gone == NULL:
                PyBuffer_Release(&self.views[s])
                raise MemoryError()
            self.nfree -= 1
            v.ptr = p
            v.view = True
            v.count = c
            v.col = start
            v.live = c
            v.nbytes = self.views[s].len + c
            self.values += 1
            self.records += c
            self.nbytes += v.nbytes
            cnt[i] = <int64_t>c
            slot_of[i] = s
            total += c
        records = np.empty((total, 4), np.int64)
        cdef int64_t[:, ::1] r = records
        for i in range(n):
            if slot_of[i] < 0:
                continue
            for k in range(<uint64_t>cnt[i]):
                r[j, 0] = pids[i]
                r[j, 1] = offsets[i]
                r[j, 2] = <int64_t>k
                r[j, 3] = (slot_of[i] << 32) | <int64_t>k
                j += 1
        if self.limit and self.nbytes > self.limit:
            self._shrink()
        return records, counts, bad

    cdef int _shrink(self) except -1:
        """Compact every value whose records left weigh a quarter of it or less."""
        cdef Py_ssize_t s
        cdef HeldValue* v
        for s in range(self.cap):
            v = &self.v[s]
            if v.ptr != NULL and v.kept == NULL \
                    and 4 * v.live * (self.layout.record_size + 5) <= v.nbytes:
                self._compact(s)
        return 0

    cdef int _compact(self, Py_ssize_t s) except -1:
        """Copy the records left of value ``s`` out, fields side by side, and let it go."""
        cdef HeldValue* v = &self.v[s]
        cdef uint64_t n = v.live, rs = self.layout.record_size, r, j = 0, at, rb
        cdef Py_ssize_t f
        cdef uint8_t* rows = <uint8_t*>malloc(n * rs if n else 1)
        cdef uint32_t* kept = <uint32_t*>malloc(n * sizeof(uint32_t) if n else 1)
        cdef uint8_t* gone = <uint8_t*>calloc(n if n else 1, 1)
        if rows == NULL or kept == NULL or gone == NULL:
            free(rows)
            free(kept)
            free(gone)
            raise MemoryError()
        cdef uint8_t* dst = rows
        with nogil:
            for r in range(v.count):
                if v.gone[r]:
                    continue
                kept[j] = <uint32_t>r
                j += 1
                at = v.col
                for f in range(self.layout.nfields):
                    rb = self.layout.row_bytes[f]
                    if self.block:
                        memcpy(dst, v.ptr + at + r * rb, rb)
                        at += align_up(v.count * rb)
                    else:
                        memcpy(dst, v.ptr + at, rb)
                        at += rb
                    dst += rb
        PyBuffer_Release(&self.views[s])
        free(v.gone)
        self.nbytes -= v.nbytes
        v.view = False
        v.ptr = rows
        v.kept = kept
        v.nkept = n
        v.gone = gone
        v.nbytes = n * (rs + 5)
        self.nbytes += v.nbytes
        self.compacted += 1
        return 0

    cdef int _take(self, const int64_t[::1] items) except -1:
        """Count ``items`` out of their values; IndexError (nothing counted) for a bad one."""
        cdef Py_ssize_t n = items.shape[0], k, m
        cdef int64_t it, s, j
        cdef HeldValue* v
        for k in range(n):
            it = items[k]
            s = it >> 32
            j = -1
            if it >= 0 and s < self.cap and self.v[s].ptr != NULL:
                v = &self.v[s]
                j = held_row(v, it & ITEM_RECORD)
            if j < 0 or v.gone[j]:
                for m in range(k):
                    v = &self.v[items[m] >> 32]
                    v.gone[held_row(v, items[m] & ITEM_RECORD)] = 0
                    v.live += 1
                raise IndexError(f"item {it} names no record held")
            v.gone[j] = 1
            v.live -= 1
        self.records -= n
        return 0

    cdef void _settle(self, const int64_t[::1] items):
        """Let go of the values whose last record ``items`` took."""
        cdef Py_ssize_t k
        cdef int64_t s
        for k in range(items.shape[0]):
            s = items[k] >> 32
            if self.v[s].live == 0 and self.v[s].ptr != NULL:
                self._release(s)

    def gather(self, const int64_t[::1] items, Out dst, uint64_t row):
        """Copy the records ``items`` to rows ``row``.. of ``dst``, every field; they are let go.

        One call, the copies without the GIL, with no Python object per
        record. IndexError if an item names no record held or the rows
        would overflow ``dst``.
        """
        dst.fits(self.layout)
        cdef Py_ssize_t n = items.shape[0], k, f, nf = self.layout.nfields
        if row > dst.capacity or <uint64_t>n > dst.capacity - row:
            raise IndexError(f"{n} rows from row {row} overflow the output ({dst.capacity} rows)")
        cdef uint8_t** d = dst.bufs.ptr
        cdef const uint64_t* rbs = self.layout.row_bytes
        cdef bint block = self.block
        cdef uint64_t rb
        cdef int64_t j
        cdef const HeldValue* v
        cdef const HeldValue* pv
        # Field by field, not record by record: one field's rows are read
        # from fewer places at once, which a mixture's records, taken from
        # several values in turn, need (2x faster there, 1.3x in order).
        # A long field goes around the cache (NOTE [ Streaming stores ]):
        # a mixture's rows 1.1x to 1.15x faster on a Xeon with a large L3,
        # a shuffle's unchanged (its random reads are the bound).
        # ``at[k]``: where record k's current field starts.
        cdef uint64_t* at = <uint64_t*>malloc(2 * max(n, 1) * sizeof(uint64_t))
        if at == NULL:
            raise MemoryError()
        cdef uint64_t* jj = at + max(n, 1)
        try:
            self._take(items)
        except IndexError:
            free(at)
            raise
        with nogil:
            for k in range(n):
                v = &self.v[items[k] >> 32]
                j = held_row(v, items[k] & ITEM_RECORD)
                jj[k] = <uint64_t>j
                if v.kept != NULL:  # compacted: the record's fields side by side
                    at[k] = <uint64_t>j * self.layout.record_size
                elif block:
                    at[k] = v.col + <uint64_t>j * rbs[0]
                else:
                    at[k] = v.col
            for f in range(nf):
                rb = rbs[f]
                for k in range(n):
                    if k + GATHER_AHEAD < n:
                        pv = &self.v[items[k + GATHER_AHEAD] >> 32]
                        __builtin_prefetch(pv.ptr + at[k + GATHER_AHEAD])
                    v = &self.v[items[k] >> 32]
                    copy_out(d[f] + (row + k) * rb, v.ptr + at[k], rb, False)
                    if f + 1 == nf:
                        continue
                    if block and v.kept == NULL:  # the same record in the next column
                        at[k] += align_up(v.count * rb) + jj[k] * rbs[f + 1] - jj[k] * rb
                    else:
                        at[k] += rb
            stream_fence()
        free(at)
        self._settle(items)

    def drop(self, const int64_t[::1] items):
        """Let the records ``items`` go without copying them (repeats, a reset)."""
        self._take(items)
        self._settle(items)

    def clear(self):
        """Let every value go."""
        cdef Py_ssize_t s
        for s in range(self.cap):
            if self.v[s].ptr != NULL:
                self._release(s)

    def __dealloc__(self):
        cdef Py_ssize_t s
        if self.v != NULL:
            for s in range(self.cap):
                if self.v[s].view:
                    PyBuffer_Release(&self.views[s])
                if self.v[s].kept != NULL:
                    free(<void*>self.v[s].ptr)
                free(self.v[s].gone)
                free(self.v[s].kept)
        free(self.v)
        free(self.views)
        free(self.free_slots)


cdef _Buffers fixed_columns(Layout layout, list columns, uint64_t n):
    """The encoders' input: one buffer per field, each exactly ``n`` rows long."""
    if len(columns) != layout.nfields:
        raise ValueError(f"one column per field is needed: {layout.nfields} fields, "
                         f"{len(columns)} columns")
    cdef _Buffers src = _Buffers(columns, False, layout.names, "column")
    cdef Py_ssize_t f
    for f in range(layout.nfields):
        if not holds(src.nbytes[f], n, layout.row_bytes[f]):
            raise ValueError(_length_message(layout.names, src, layout_rows(layout), n))
    return src


cdef list layout_rows(Layout layout):
    return [layout.row_bytes[f] for f in range(layout.nfields)]


cdef str _length_message(tuple names, _Buffers src, list row_bytes, uint64_t n):
    parts = []
    for f in range(len(names)):
        rb = row_bytes[f]
        if rb:
            parts.append(f"{names[f]!r} {src.nbytes[f] / rb:g} ({src.nbytes[f]} bytes)")
    return f"every column must hold {n} records; got " + ", ".join(parts)


cdef void fill_block(Layout layout, uint8_t** src, uint64_t s, uint64_t k, uint8_t* p,
                     uint64_t size) noexcept nogil:
    """Records [s, s + k) of the columns ``src`` as one block value of ``size`` bytes."""
    cdef uint64_t off = HEADER_SIZE, rb
    cdef Py_ssize_t f
    write_header(p, 0, k, layout.fingerprint, size)
    for f in range(layout.nfields):
        rb = layout.row_bytes[f]
        if k:
            memcpy(p + off, src[f] + s * rb, k * rb)
        memset(p + off + k * rb, 0, align_up(k * rb) - k * rb)
        off += align_up(k * rb)


def encode_blocks(Layout layout, list columns, uint64_t n, uint64_t block_records):
    """Pack ``n`` records into block values of at most ``block_records`` each.

    ``columns``: one C-contiguous buffer per field, exactly ``n`` rows of it
    (ValueError naming each column's length otherwise).
    """
    if block_records == 0 or block_records > 0xFFFFFFFF:
        raise ValueError("block_records must be in 1..2**32-1")
    cdef _Buffers src = fixed_columns(layout, columns, n)
    cdef list out = []
    cdef uint64_t s = 0, k, size
    cdef uint8_t* p
    while s < n:
        k = min(block_records, n - s)
        size = layout.block_size(k)
        b = PyBytes_FromStringAndSize(NULL, size)
        p = <uint8_t*>PyBytes_AS_STRING(b)
        with nogil:
            fill_block(layout, src.ptr, s, k, p, size)
        out.append(b)
        s += k
    return out


def empty_block(Layout layout):
    """A valid block of no record: the header alone."""
    b = PyBytes_FromStringAndSize(NULL, HEADER_SIZE)
    write_header(<uint8_t*>PyBytes_AS_STRING(b), 0, 0, layout.fingerprint, HEADER_SIZE)
    return b


def encode_raw(Layout layout, list columns, uint64_t n):
    """One raw value per record: the fields concatenated in schema order."""
    cdef _Buffers src = fixed_columns(layout, columns, n)
    cdef list out = []
    cdef uint64_t r, rb
    cdef Py_ssize_t f
    cdef uint8_t* p
    for r in range(n):
        b = PyBytes_FromStringAndSize(NULL, layout.record_size)
        p = <uint8_t*>PyBytes_AS_STRING(b)
        for f in range(layout.nfields):
            rb = layout.row_bytes[f]
            memcpy(p, src.ptr[f] + r * rb, rb)
            p += rb
        out.append(b)
    return out


# -- schemas with a variable-length field (documents) ------------------------


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
    cdef readonly tuple names
    cdef uint64_t max_count
    cdef uint64_t* row_bytes

    def __cinit__(self, row_bytes, Py_ssize_t varlen, uint64_t itemsize, uint64_t fingerprint,
                  names=None):
        self.nfields = len(row_bytes)
        if not 0 <= varlen < self.nfields:
            raise ValueError("varlen must be the index of a field")
        if itemsize not in (1, 2, 4, 8):
            raise ValueError("itemsize must be 1, 2, 4 or 8")
        self.names = _names(names, self.nfields)
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
            elif nbytes > UINT64_MAX // 4 - self.fixed_size:
                raise ValueError("the record size overflows")
            self.row_bytes[i] = nbytes
            self.fixed_size += nbytes
        self.varlen = varlen
        self.itemsize = itemsize
        self.fingerprint = fingerprint
        self.max_count = UINT64_MAX // 2 // (self.fixed_size + 4)

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
    cdef uint64_t n, header_len
    cdef Reason why = check_header(p, size, FLAG_VARLEN, layout.fingerprint, layout.max_count,
                                   &n, &header_len)
    if why != R_OK:
        return why
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


cdef struct DocScan:
    # Per value, from the first pass:
    uint64_t* cnt           # documents in it
    uint64_t* first         # documents skipped (``start`` of the first value)
    uint64_t* hdr           # where its first column starts
    uint64_t* elems         # elements in it
    Reason* why
    # In all:
    uint64_t ndocs          # documents taken
    uint64_t nelem          # elements taken


cdef void scan_documents(DocLayout layout, const uint8_t** ptr, const Py_ssize_t* size,
                         Py_ssize_t n, bint block, uint64_t start, DocScan* s) noexcept nogil:
    """First pass: validate every value whole and size the outputs."""
    cdef Py_ssize_t i
    cdef uint64_t isz = layout.itemsize
    cdef const uint8_t* q
    s.ndocs = s.nelem = 0
    for i in range(n):
        s.cnt[i] = 0
        if size[i] < 0:
            s.why[i] = <Reason>(-size[i])
        elif block:
            s.why[i] = check_doc_block(layout, ptr[i], size[i], &s.cnt[i], &s.hdr[i],
                                       &s.elems[i])
        elif <uint64_t>size[i] % isz:
            s.why[i] = R_RAW_ITEMSIZE
        else:
            s.why[i] = R_OK
            s.cnt[i] = 1
            s.hdr[i] = 0
            s.elems[i] = <uint64_t>size[i] // isz
        if s.why[i] != R_OK:
            continue
        s.first[i] = start if i == 0 else 0
        if s.first[i] > s.cnt[i]:
            s.first[i] = s.cnt[i]
        s.ndocs += s.cnt[i] - s.first[i]
        if s.first[i] == 0:
            s.nelem += s.elems[i]
        elif block:
            q = ptr[i] + s.hdr[i] + layout.table_start(s.cnt[i])
            s.nelem += s.elems[i] - load_u32(q + 4 * s.first[i])


cdef void copy_documents(DocLayout layout, const uint8_t** ptr, Py_ssize_t n, bint block,
                         const DocScan* s, uint8_t* out_elems, int64_t* out_len,
                         int64_t* out_cnt, uint8_t** dst) noexcept nogil:
    """Second pass: the validated values' documents into outputs sized by the first."""
    cdef Py_ssize_t nf = layout.nfields, v = layout.varlen, f, i
    cdef uint64_t isz = layout.itemsize, d = 0, e = 0, k, a, col, j, rb, cnt, first
    cdef const uint8_t* p
    cdef const uint8_t* q
    for i in range(n):
        if s.why[i] != R_OK:
            out_cnt[i] = 0
            continue
        cnt = s.cnt[i]
        first = s.first[i]
        k = cnt - first
        out_cnt[i] = k
        p = ptr[i]
        if not block:
            if k:
                out_len[d] = s.elems[i]
                memcpy(out_elems + e * isz, p, s.elems[i] * isz)
                e += s.elems[i]
            d += k
            continue
        col = s.hdr[i]
        for f in range(nf):
            if f != v:
                rb = layout.row_bytes[f]
                memcpy(dst[f] + d * rb, p + col + first * rb, k * rb)
                col += align_up(cnt * rb)
                continue
            q = p + col
            for j in range(first, cnt):
                out_len[d + j - first] = load_u32(q + 4 * (j + 1)) - load_u32(q + 4 * j)
            a = load_u32(q + 4 * first)
            col += align_up(4 * (cnt + 1))
            memcpy(out_elems + e * isz, p + col + a * isz, (s.elems[i] - a) * isz)
            e += s.elems[i] - a
            col += align_up(s.elems[i] * isz)
        d += k


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
    cdef DocScan s
    s.cnt = <uint64_t*>malloc(m * sizeof(uint64_t))
    s.first = <uint64_t*>malloc(m * sizeof(uint64_t))
    s.hdr = <uint64_t*>malloc(m * sizeof(uint64_t))
    s.elems = <uint64_t*>malloc(m * sizeof(uint64_t))
    s.why = <Reason*>malloc(m * sizeof(Reason))
    cdef _Buffers dst
    cdef uint8_t[::1] out_elems
    cdef int64_t[::1] out_len
    cdef int64_t[::1] out_cnt
    try:
        if not (s.cnt and s.first and s.hdr and s.elems and s.why):
            raise MemoryError()
        with nogil:
            scan_documents(layout, vals.ptr, vals.size, n, block, start, &s)
        bad = [(i, _ALL_REASONS[s.why[i]]) for i in range(n) if s.why[i] != R_OK]
        elements = np.empty(s.nelem * layout.itemsize, np.uint8)
        lengths = np.empty(s.ndocs, np.int64)
        counts = np.empty(n, np.int64)
        fixed = [None if f == v else np.empty(s.ndocs * layout.row_bytes[f], np.uint8)
                 for f in range(nf)]
        # Every output is exactly as long as the first pass said, so the
        # second pass writes inside these buffers.
        out_elems, out_len, out_cnt = elements, lengths, counts
        dst = _Buffers(fixed, True, layout.names, "output")
        with nogil:
            copy_documents(layout, vals.ptr, n, block, &s,
                           &out_elems[0] if s.nelem else NULL,
                           &out_len[0] if s.ndocs else NULL,
                           &out_cnt[0] if n else NULL, dst.ptr)
    finally:
        free(s.cnt); free(s.first); free(s.hdr); free(s.elems); free(s.why)
    return elements, lengths, counts, fixed, bad


cdef _Buffers doc_columns(DocLayout layout, list columns, const int64_t[::1] offsets,
                          uint64_t n):
    """The document encoders' input, checked: columns of ``n`` rows, offsets into the elements.

    ``offsets`` must hold ``n + 1`` entries from 0, never decreasing, the
    last one the variable-length column's length in elements.
    """
    if len(columns) != layout.nfields:
        raise ValueError(f"one column per field is needed: {layout.nfields} fields, "
                         f"{len(columns)} columns")
    if <uint64_t>offsets.shape[0] != n + 1:
        raise ValueError(f"offsets must hold n + 1 = {n + 1} entries, got {offsets.shape[0]}")
    cdef uint64_t i
    if offsets[0] != 0:
        raise ValueError(f"offsets must start at 0, got {offsets[0]}")
    for i in range(n):
        if offsets[i + 1] < offsets[i]:
            raise ValueError(f"offsets decrease at document {i}")
    cdef _Buffers src = _Buffers(columns, False, layout.names, "column")
    cdef Py_ssize_t f
    for f in range(layout.nfields):
        if f == layout.varlen:
            if not holds(src.nbytes[f], offsets[n], layout.itemsize):
                raise ValueError(f"column {layout.names[f]!r} holds {src.nbytes[f]} bytes, "
                                 f"the offsets say {offsets[n]} elements of {layout.itemsize}")
        elif not holds(src.nbytes[f], n, layout.row_bytes[f]):
            raise ValueError(_length_message(layout.names, src,
                                             [layout.row_bytes[g] for g in range(layout.nfields)],
                                             n))
    return src


cdef void fill_doc_block(DocLayout layout, uint8_t** src, const int64_t* offsets, uint64_t s,
                         uint64_t k, uint8_t* p, uint64_t size) noexcept nogil:
    """Documents [s, s + k) as one block of ``size`` bytes; ``src[varlen]`` holds the elements."""
    cdef uint64_t base = offsets[s] if k else 0
    cdef uint64_t total = offsets[s + k] - base if k else 0
    cdef uint64_t off = HEADER_SIZE, rb, i, isz = layout.itemsize
    cdef uint32_t u32
    cdef Py_ssize_t f
    write_header(p, FLAG_VARLEN, k, layout.fingerprint, size)
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


cdef bytes doc_block(DocLayout layout, _Buffers src, const int64_t[::1] offsets, uint64_t s,
                     uint64_t k):
    cdef uint64_t total = offsets[s + k] - offsets[s] if k else 0
    cdef uint64_t size = layout.block_size(k, total)
    b = PyBytes_FromStringAndSize(NULL, size)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(b)
    with nogil:
        fill_doc_block(layout, src.ptr, &offsets[0], s, k, p, size)
    return b


def encode_doc_blocks(DocLayout layout, list columns, const int64_t[::1] offsets,
                      uint64_t n, uint64_t block_records, uint64_t block_bytes):
    """Pack ``n`` documents into blocks of at most ``block_records`` each.

    ``columns``: one C-contiguous buffer per field: a fixed field's ``n``
    rows, or at the variable-length field every document's elements
    concatenated. ``offsets``: ``n + 1`` element offsets into those, from 0,
    non-decreasing (ValueError otherwise, as for a column of another length).
    A block is also closed before it would grow past ``block_bytes`` (0: no
    limit), unless it holds a single document; and before its elements would
    overflow a uint32 offset. ``n == 0`` gives one empty block.
    """
    if block_records == 0 or block_records > 0xFFFFFFFF:
        raise ValueError("block_records must be in 1..2**32-1")
    cdef _Buffers src = doc_columns(layout, columns, offsets, n)
    cdef list out = []
    cdef uint64_t s = 0, k, span
    if n == 0:
        return [doc_block(layout, src, offsets, 0, 0)]
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
        out.append(doc_block(layout, src, offsets, s, k))
        s += k
    return out


def encode_doc_raw(DocLayout layout, elements, const int64_t[::1] offsets, uint64_t n):
    """One raw value per document: its elements, nothing else."""
    if layout.nfields != 1:
        raise ValueError("a raw value holds only the variable-length field")
    cdef _Buffers src = doc_columns(layout, [elements], offsets, n)
    cdef const uint8_t* base = src.ptr[0]
    cdef uint64_t isz = layout.itemsize, i
    cdef list out = []
    for i in range(n):
        if offsets[i + 1] == offsets[i]:
            out.append(b"")
        else:
            out.append(PyBytes_FromStringAndSize(<const char*>(base + offsets[i] * isz),
                                                 (offsets[i + 1] - offsets[i]) * isz))
    return out


include "_avro.pxi"
include "_protobuf.pxi"
include "_json.pxi"
include "_arrow.pxi"
