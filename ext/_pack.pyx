"""The packer: documents of token ids -> dense ``[rows, seq_len]`` batches.

In the data flow it sits after the codec's ``decode_documents`` (one flat
array of token ids plus one length per document) and writes straight into
preallocated output buffers, the pool's pinned slots in the loader: token ids,
position ids, document ids and flash-attention's ``cu_seqlens``. The loop runs
without the GIL and creates no Python object per document; it works segment
by segment (the part of one document that lies in one row), so its per-token
work is a typed copy and two fills. ``kfeed.tokens.Packer`` is its front and
holds the state between calls; the rules are documented there.

The per-token work is bound by memory writes (20 bytes per token with int64
token and position ids and int32 document ids), so it goes through the C
library where it can: position ids are a ``memcpy`` from a table of
``0..seq_len-1``, 4-byte fills are ``wmemset``, and token ids of the output's
width are a ``memcpy``; the C library picks the widest stores the CPU has
when it loads. The one loop left per token, the copy of token ids of another
width, is built for several CPU levels in the same way (see ``KFEED_CLONES``).

The front hands in objects with the buffer protocol, never addresses: a
``Chunk`` holds one feed's token ids and offsets, ``Outputs`` one batch's
output buffers, each checked for its element type and length when it is
made, so no argument from Python can make the loop read or write outside them.
"""

from libc.stdint cimport (int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t,
                          uint64_t)
from libc.stddef cimport wchar_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE,
                             PyBuffer_Release, PyObject_GetBuffer)

import numpy as np


cdef extern from "<wchar.h>" nogil:
    wchar_t* wmemset(wchar_t* dest, wchar_t c, size_t n)

# Element types by code. The numbers are private; the front passes dtype names
# through CODES.
cdef enum Code:
    C_INT8 = 1
    C_UINT8
    C_INT16
    C_UINT16
    C_INT32
    C_UINT32
    C_INT64
    C_UINT64

CODES = {
    "int8": C_INT8,
    "uint8": C_UINT8,
    "int16": C_INT16,
    "uint16": C_UINT16,
    "int32": C_INT32,
    "uint32": C_UINT32,
    "int64": C_INT64,
    "uint64": C_UINT64,
}

# The element types an output buffer may have.
OUT_CODES = {"int32": C_INT32, "int64": C_INT64}

cdef extern from *:
    """
    /* Token ids from the source's element type to the output's, as C casts
       (never range-checked, as the codec never checks element values): the one
       per-token loop the C library has no function for. With GCC or clang on
       x86-64 glibc each is also built for AVX2 and AVX-512, and the dynamic
       loader picks the version for the CPU, so one build runs on any x86-64. */
    #if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
    #if __has_attribute(target_clones)
    #define KFEED_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
    #endif
    #endif
    #ifndef KFEED_CLONES
    #define KFEED_CLONES
    #endif

    #define KFEED_CONVERT(S, D) \
        KFEED_CLONES static void convert_##S##_##D(const S##_t* s, D##_t* d, Py_ssize_t n) \
        { for (Py_ssize_t i = 0; i < n; i++) d[i] = (D##_t)s[i]; }

    KFEED_CONVERT(int8, int32)   KFEED_CONVERT(int8, int64)
    KFEED_CONVERT(uint8, int32)  KFEED_CONVERT(uint8, int64)
    KFEED_CONVERT(int16, int32)  KFEED_CONVERT(int16, int64)
    KFEED_CONVERT(uint16, int32) KFEED_CONVERT(uint16, int64)
    KFEED_CONVERT(int32, int64)  KFEED_CONVERT(uint32, int64)
    KFEED_CONVERT(int64, int32)  KFEED_CONVERT(uint64, int32)
    """
    void convert_int8_int32(const int8_t* s, int32_t* d, Py_ssize_t n) noexcept nogil
    void convert_int8_int64(const int8_t* s, int64_t* d, Py_ssize_t n) noexcept nogil
    void convert_uint8_int32(const uint8_t* s, int32_t* d, Py_ssize_t n) noexcept nogil
    void convert_uint8_int64(const uint8_t* s, int64_t* d, Py_ssize_t n) noexcept nogil
    void convert_int16_int32(const int16_t* s, int32_t* d, Py_ssize_t n) noexcept nogil
    void convert_int16_int64(const int16_t* s, int64_t* d, Py_ssize_t n) noexcept nogil
    void convert_uint16_int32(const uint16_t* s, int32_t* d, Py_ssize_t n) noexcept nogil
    void convert_uint16_int64(const uint16_t* s, int64_t* d, Py_ssize_t n) noexcept nogil
    void convert_int32_int64(const int32_t* s, int64_t* d, Py_ssize_t n) noexcept nogil
    void convert_uint32_int64(const uint32_t* s, int64_t* d, Py_ssize_t n) noexcept nogil
    void convert_int64_int32(const int64_t* s, int32_t* d, Py_ssize_t n) noexcept nogil
    void convert_uint64_int32(const uint64_t* s, int32_t* d, Py_ssize_t n) noexcept nogil


cdef inline size_t in_size(int code) noexcept nogil:
    if code == C_INT8 or code == C_UINT8:
        return 1
    if code == C_INT16 or code == C_UINT16:
        return 2
    if code == C_INT32 or code == C_UINT32:
        return 4
    return 8


cdef inline size_t out_size(int code) noexcept nogil:
    return 4 if code == C_INT32 else 8


cdef inline void copy_ids(const uint8_t* s, int sc, uint8_t* d, int dc,
                          Py_ssize_t n) noexcept nogil:
    """``n`` token ids from ``s`` (element code ``sc``) to ``d`` (``dc``)."""
    if in_size(sc) == out_size(dc):
        memcpy(d, s, n * out_size(dc))  # the same width: the cast keeps the bits
    elif dc == C_INT32:
        if sc == C_INT8:
            convert_int8_int32(<const int8_t*>s, <int32_t*>d, n)
        elif sc == C_UINT8:
            convert_uint8_int32(<const uint8_t*>s, <int32_t*>d, n)
        elif sc == C_INT16:
            convert_int16_int32(<const int16_t*>s, <int32_t*>d, n)
        elif sc == C_UINT16:
            convert_uint16_int32(<const uint16_t*>s, <int32_t*>d, n)
        elif sc == C_INT64:
            convert_int64_int32(<const int64_t*>s, <int32_t*>d, n)
        else:
            convert_uint64_int32(<const uint64_t*>s, <int32_t*>d, n)
    else:
        if sc == C_INT8:
            convert_int8_int64(<const int8_t*>s, <int64_t*>d, n)
        elif sc == C_UINT8:
            convert_uint8_int64(<const uint8_t*>s, <int64_t*>d, n)
        elif sc == C_INT16:
            convert_int16_int64(<const int16_t*>s, <int64_t*>d, n)
        elif sc == C_UINT16:
            convert_uint16_int64(<const uint16_t*>s, <int64_t*>d, n)
        elif sc == C_INT32:
            convert_int32_int64(<const int32_t*>s, <int64_t*>d, n)
        else:
            convert_uint32_int64(<const uint32_t*>s, <int64_t*>d, n)


cdef inline void fill32(int32_t* d, int32_t value, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    # Where wchar_t has 4 bytes (Linux, macOS), wmemset is the C library's
    # fill of 4-byte elements; the test is a constant the compiler folds.
    if sizeof(wchar_t) == 4:
        wmemset(<wchar_t*>d, <wchar_t>value, n)
    else:
        for i in range(n):
            d[i] = value


cdef inline void fill(uint8_t* d, int dc, int64_t value, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    cdef int64_t* d64
    if dc == C_INT32:
        fill32(<int32_t*>d, <int32_t>value, n)
    else:
        d64 = <int64_t*>d
        for i in range(n):
            d64[i] = value


cdef void count(uint8_t* d, int dc, Py_ssize_t n) noexcept nogil:
    """``0, 1, ..., n - 1`` into ``d``, int32 or int64."""
    cdef Py_ssize_t i
    for i in range(n):
        if dc == C_INT32:
            (<int32_t*>d)[i] = <int32_t>i
        else:
            (<int64_t*>d)[i] = i



cdef int element_code(const char* fmt, Py_ssize_t itemsize, bint out) noexcept:
    """The element code of a buffer's struct format, 0 if it is not one we take.

    Native integers only (a byte-order prefix other than this little-endian
    host's is refused); ``out``: the output types, int32 and int64.
    """
    if fmt == NULL:
        return 0 if out else C_UINT8  # no format means unsigned bytes
    cdef char c = fmt[0]
    if c == b"@" or c == b"=" or c == b"<":
        fmt += 1
        c = fmt[0]
    if c == 0 or fmt[1] != 0:
        return 0
    cdef bint signed
    if c == b"b" or c == b"h" or c == b"i" or c == b"l" or c == b"q":
        signed = True
    elif c == b"B" or c == b"H" or c == b"I" or c == b"L" or c == b"Q":
        signed = False
    else:
        return 0
    if out:
        if not signed:
            return 0
        return C_INT32 if itemsize == 4 else C_INT64 if itemsize == 8 else 0
    if itemsize == 1:
        return C_INT8 if signed else C_UINT8
    if itemsize == 2:
        return C_INT16 if signed else C_UINT16
    if itemsize == 4:
        return C_INT32 if signed else C_UINT32
    if itemsize == 8:
        return C_INT64 if signed else C_UINT64
    return 0


def offsets(const int64_t[::1] lengths):
    """``(offsets, total, nonempty)`` of document lengths, in one pass.

    ``offsets``: int64, ``len(lengths) + 1`` entries from 0; ``total``: the
    sum; ``nonempty``: how many lengths are not 0. ValueError if one is
    negative.
    """
    cdef Py_ssize_t n = lengths.shape[0], i
    out = np.empty(n + 1, np.int64)
    cdef int64_t[::1] o = out
    cdef int64_t total = 0, v
    cdef Py_ssize_t nonempty = 0
    o[0] = 0
    for i in range(n):
        v = lengths[i]
        if v < 0:
            raise ValueError("lengths must be >= 0")
        total += v
        nonempty += v != 0
        o[i + 1] = total
    return out, total, nonempty


cdef class Chunk:
    """Documents fed in one go: token ids and their offsets, held for the packing loop.

    ``tokens``: a 1-D C-contiguous buffer of integers (its element type is
    read from the buffer's format); ``offsets``: int64, ``ndocs + 1`` entries
    from 0, never decreasing, the last one ``len(tokens)``: document ``d`` is
    ``tokens[offsets[d]:offsets[d + 1]]``. Both are checked here and held
    while the chunk lives, so the loop reads inside them only. ``owed``
    (optional, uint8 per document): a document of no tokens whose EOS is
    still to come (the rest of one whose tokens are all out already, NOTE
    [ Elastic resume ]); any other document of no tokens gives nothing.

    ``gather_documents`` makes the other kind: documents that stay where they
    lie, in several arrays, each read through its own address (``ptrs``);
    ``offs`` then only counts their lengths.
    """

    cdef Py_buffer view
    cdef bint held
    cdef const uint8_t* ids
    cdef readonly int code
    cdef readonly Py_ssize_t ndocs
    cdef const int64_t[::1] offs
    cdef const uint8_t[::1] owed_view
    cdef const uint8_t* owed
    cdef const uint8_t** ptrs            # gathered: document d starts at ptrs[d]
    cdef list keep                       # gathered: the arrays ptrs point into

    def __cinit__(self, tokens=None, const int64_t[::1] offsets=None,
                  const uint8_t[::1] owed=None):
        self.ptrs = NULL
        self.owed = NULL
        if tokens is None:  # gathered: gather_documents fills it in
            return
        try:
            PyObject_GetBuffer(tokens, &self.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
        except (TypeError, BufferError, ValueError) as e:
            raise ValueError(f"tokens must be a C-contiguous buffer: {e}") from None
        self.held = True
        self.code = element_code(self.view.format, self.view.itemsize, False)
        if self.code == 0:
            raise ValueError(f"tokens must hold native integers, got format "
                             f"{(self.view.format or b'B').decode()!r}")
        if offsets.shape[0] < 1:
            raise ValueError("offsets needs ndocs + 1 entries")
        cdef Py_ssize_t n = offsets.shape[0] - 1, d
        cdef int64_t count = self.view.len // self.view.itemsize
        if offsets[0] != 0:
            raise ValueError(f"offsets must start at 0, got {offsets[0]}")
        for d in range(n):
            if offsets[d + 1] < offsets[d]:
                raise ValueError(f"offsets decrease at document {d}")
        if offsets[n] != count:
            raise ValueError(f"the offsets end at {offsets[n]}, tokens holds {count}")
        self.ids = <const uint8_t*>self.view.buf
        self.ndocs = n
        self.offs = offsets
        if owed is not None:
            if owed.shape[0] != n:
                raise ValueError(f"owed has {owed.shape[0]} entries for {n} documents")
            self.owed_view = owed
            if n:
                self.owed = &owed[0]

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)
        free(self.ptrs)


cdef class Outputs:
    """The output buffers of one batch, held while this object lives.

    ``tokens`` (required), ``position_ids`` and ``doc_ids``: C-contiguous
    int32 or int64 buffers of ``rows * seq_len`` elements (the ``[rows,
    seq_len]`` arrays); ``cu_seqlens``: int32 with at least ``rows * seq_len
    + 1`` entries. ``None``: not written. Objects with the buffer protocol,
    never addresses: the element type and length come from the buffer, so
    the loop cannot write past any of them.
    """

    cdef Py_buffer views[4]
    cdef bint held[4]
    cdef uint8_t* tokens
    cdef int tok
    cdef uint8_t* pos
    cdef int pos_code
    cdef uint8_t* positions  # 0..seq_len-1 as position ids: a segment's are its first n
    cdef uint8_t* docs
    cdef int doc_code
    cdef int32_t* cu
    cdef readonly Py_ssize_t rows
    cdef readonly Py_ssize_t seq_len

    def __cinit__(self, Py_ssize_t rows, Py_ssize_t seq_len, tokens, position_ids=None,
                  doc_ids=None, cu_seqlens=None):
        if rows <= 0 or seq_len <= 0:
            raise ValueError("rows and seq_len must be positive")
        if rows > (<Py_ssize_t>1 << 62) // seq_len:
            raise ValueError("rows * seq_len is too large")
        if tokens is None:
            raise ValueError("the token buffer is required")
        self.rows = rows
        self.seq_len = seq_len
        cdef Py_ssize_t slots = rows * seq_len
        self.tokens = self._hold(0, "tokens", tokens, slots, &self.tok)
        self.pos = self._hold(1, "position_ids", position_ids, slots, &self.pos_code)
        self.docs = self._hold(2, "doc_ids", doc_ids, slots, &self.doc_code)
        cdef int cu_code = 0
        self.cu = <int32_t*>self._hold(3, "cu_seqlens", cu_seqlens, -(slots + 1), &cu_code)
        if self.cu != NULL and cu_code != C_INT32:
            raise ValueError("cu_seqlens must hold int32")
        if self.pos != NULL:
            self.positions = <uint8_t*>malloc(seq_len * out_size(self.pos_code))
            if self.positions == NULL:
                raise MemoryError()
            count(self.positions, self.pos_code, seq_len)

    cdef uint8_t* _hold(self, int i, str name, obj, Py_ssize_t n, int* code) except? NULL:
        """Hold buffer ``i``: ``n`` elements exactly, or at least ``-n``; NULL for None."""
        if obj is None:
            return NULL
        try:
            PyObject_GetBuffer(obj, &self.views[i],
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE)
        except (TypeError, BufferError, ValueError) as e:
            raise ValueError(f"{name} must be a writable C-contiguous buffer: {e}") from None
        self.held[i] = True
        cdef Py_buffer* v = &self.views[i]
        code[0] = element_code(v.format, v.itemsize, True)
        if code[0] == 0:
            raise ValueError(f"{name} must hold int32 or int64, got format "
                             f"{(v.format or b'B').decode()!r}")
        cdef Py_ssize_t have = v.len // v.itemsize
        if (n >= 0 and have != n) or (n < 0 and have < -n):
            raise ValueError(f"{name} holds {have} elements, needs "
                             f"{'' if n >= 0 else 'at least '}{n if n >= 0 else -n}")
        return <uint8_t*>v.buf

    def __dealloc__(self):
        free(self.positions)
        cdef int i
        for i in range(4):
            if self.held[i]:
                PyBuffer_Release(&self.views[i])


cdef inline void segment(uint8_t* pos, const uint8_t* positions, int pos_code, uint8_t* docs,
                         int doc_code, Py_ssize_t at, Py_ssize_t n,
                         int64_t doc_id) noexcept nogil:
    """Position and document ids of one segment of ``n`` slots from ``at``."""
    cdef size_t psz = out_size(pos_code)
    if pos != NULL:
        memcpy(pos + at * psz, positions, n * psz)
    if docs != NULL:
        fill(docs + at * out_size(doc_code), doc_code, doc_id, n)


cdef class Core:
    """The packing loop and where the current batch stands.

    A batch may be filled from several sources (the chunks documents were
    fed in) in turn: ``batch()`` opens a batch and packs from one chunk after
    another; when a chunk runs out before the batch is full, ``_run`` leaves
    the batch's cursor here for the next one.
    """

    cdef Py_ssize_t L
    cdef bint has_eos
    cdef int64_t eos
    cdef int64_t pad
    cdef bint split_long
    # The cursor of the current batch.
    cdef Py_ssize_t rows                 # rows done
    cdef Py_ssize_t col                  # column in the current row
    cdef Py_ssize_t segments
    cdef Py_ssize_t max_seqlen
    cdef int64_t tokens                  # real tokens written
    cdef int64_t truncated
    cdef int64_t doc_id                  # the id of the next document in this batch
    cdef int64_t documents               # documents finished

    def __cinit__(self, Py_ssize_t seq_len, bint has_eos, int64_t eos, int64_t pad,
                  bint split_long):
        if seq_len <= 0:
            raise ValueError("seq_len must be positive")
        self.L = seq_len
        self.has_eos = has_eos
        self.eos = eos
        self.pad = pad
        self.split_long = split_long

    def batch(self, Outputs out, chunks, Py_ssize_t doc, int64_t off, bint finished):
        """Pack the next batch into ``out`` from ``chunks``, starting at document ``doc``.

        ``chunks``: the front's pending ``Chunk`` objects in order; ``off``
        tokens of document ``doc`` of the first one are already out (EOS
        counted, so less than that document's tokens plus its EOS).
        ``finished``: the stream ends with the last chunk, so the batch may
        have fewer rows, its last row padded.

        Returns None if the chunks cannot fill the batch (and nothing
        changed), else ``(used, doc, off, rows, segments, max_seqlen,
        tokens, truncated, documents)``: the first ``used`` chunks are packed
        whole and the packer continues at document ``doc`` of the next one,
        with ``off`` tokens of it out. One call per batch, so the front does
        no per-chunk work in Python.
        """
        if out.seq_len != self.L:
            raise ValueError("out has another seq_len")
        cdef Py_ssize_t used = 0, last = len(chunks) - 1, ndocs = 0
        cdef bint complete = False
        cdef Chunk c
        cdef int64_t unit
        self.rows = self.col = self.segments = self.max_seqlen = 0
        self.tokens = self.truncated = self.doc_id = self.documents = 0
        for c in chunks:
            ndocs = c.ndocs
            if not 0 <= doc <= ndocs:
                raise ValueError("doc is outside the chunk's documents")
            if off:
                # The cursor must lie inside the document, or the loop would
                # write before the segment it starts.
                unit = c.offs[doc + 1] - c.offs[doc] if doc < ndocs else 0
                if unit:
                    unit += self.has_eos
                if off < 0 or off >= unit or not self.split_long:
                    raise ValueError(f"off {off} is outside document {doc} ({unit} tokens)")
            complete, doc, off = self._run(out, c.ids, c.ptrs, c.code, &c.offs[0], c.owed,
                                           ndocs, doc, off, finished and used == last)
            if complete:
                break
            doc = off = 0
            used += 1
        if not complete:
            return None
        if doc == ndocs:  # the batch ended with the chunk's last document
            used += 1
            doc = 0
        return (used, doc, off, self.rows, self.segments, self.max_seqlen, self.tokens,
                self.truncated, self.documents)

    cdef (bint, Py_ssize_t, int64_t) _run(self, Outputs out, const uint8_t* s,
                                          const uint8_t** ptrs, int src_code,
                                          const int64_t* offsets, const uint8_t* owed,
                                          Py_ssize_t ndocs, Py_ssize_t doc, int64_t off,
                                          bint final):
        """Pack from document ``doc`` (``off`` tokens of it already out) of one chunk.

        Document ``d`` starts at ``s + offsets[d]`` elements, or at ``ptrs[d]``
        when the chunk is gathered.

        Returns ``(complete, doc, off)``. Not complete: the chunk ran out
        before the batch was full and ``final`` is false; the next chunk goes
        on from the cursor. Complete: the batch is done, with fewer rows than
        ``out.rows`` only when ``final``.
        """
        cdef size_t isz = in_size(src_code)
        cdef size_t tsz = out_size(out.tok)
        cdef Py_ssize_t L = self.L, rows = out.rows, at, take, a, b
        cdef Py_ssize_t r = self.rows, col = self.col, nseg = self.segments
        cdef Py_ssize_t maxlen = self.max_seqlen
        cdef int64_t real = self.tokens, trunc = self.truncated, doc_id = self.doc_id
        cdef int64_t done = self.documents, n, unit
        cdef bint has_eos = self.has_eos, split_long = self.split_long
        cdef int64_t eos = self.eos, pad = self.pad
        cdef uint8_t* tokens = out.tokens
        cdef int tok = out.tok
        cdef int32_t* cu = out.cu
        cdef uint8_t* pos = out.pos
        cdef const uint8_t* positions = out.positions
        cdef uint8_t* docs = out.docs
        cdef int pos_code = out.pos_code, doc_code = out.doc_code
        cdef bint complete = True
        cdef const uint8_t* src
        with nogil:
            while r < rows:
                while col < L:
                    while doc < ndocs and offsets[doc + 1] == offsets[doc] \
                            and not (has_eos and owed != NULL and owed[doc]):
                        doc += 1  # an empty document gives nothing, not even an EOS
                        done += 1
                    if doc == ndocs:
                        break
                    n = offsets[doc + 1] - offsets[doc]
                    unit = n + has_eos
                    if split_long:
                        take = unit - off
                        if take > L - col:
                            take = L - col
                    else:
                        take = unit if unit < L else L
                        if take > L - col:
                            break  # it starts the next row; this one is padded
                    at = r * L + col
                    a = off
                    b = off + take if off + take < n else n
                    if b > a:
                        src = ptrs[doc] if ptrs != NULL else s + offsets[doc] * isz
                        copy_ids(src + a * isz, src_code, tokens + at * tsz, tok, b - a)
                    if off + take > n:
                        fill(tokens + (at + b - a) * tsz, tok, eos, 1)
                    segment(pos, positions, pos_code, docs, doc_code, at, take, doc_id)
                    if cu != NULL:
                        cu[nseg] = <int32_t>at
                    nseg += 1
                    if take > maxlen:
                        maxlen = take
                    real += take
                    col += take
                    if split_long:
                        off += take
                        if off < unit:
                            continue
                    elif unit > L:
                        trunc += 1
                    off = 0
                    doc += 1
                    done += 1
                    doc_id += 1
                if col < L:
                    if doc == ndocs and not final:
                        complete = False  # the next source goes on from here
                        break
                    if doc == ndocs and col == 0:
                        break  # the stream is over: no empty rows
                    at = r * L + col
                    fill(tokens + at * tsz, tok, pad, L - col)
                    segment(pos, positions, pos_code, docs, doc_code, at, L - col, -1)
                    if cu != NULL:
                        cu[nseg] = <int32_t>at
                    nseg += 1
                    if L - col > maxlen:
                        maxlen = L - col
                r += 1
                col = 0
            if complete and cu != NULL:
                cu[nseg] = <int32_t>(r * L)  # the total; what follows is not written
        self.rows = r
        self.col = col
        self.segments = nseg
        self.max_seqlen = maxlen
        self.tokens = real
        self.truncated = trunc
        self.doc_id = doc_id
        self.documents = done
        return complete, doc, off


# -- the shuffle's reservoir -----------------------------------------------------
#
# ``kfeed.tokens.ShuffleBuffer`` keeps its records as rows of int64 arrays
# ``[partition id, offset, sub, item]`` (the item: an id the caller chose, a
# staging row say) and its partitions as rows ``[read offset, read sub,
# arrived offset, arrived sub]`` with two known flags each. The loops below
# push, drain and take the minima of many records in one call, with the same
# SplitMix64 draws in the same order as the buffer's Python ``_draw``, so a
# seed gives one order however the records are grouped into calls.

cdef extern from *:
    """
    /* The high 64 bits of a 64 x 64-bit product: Lemire's multiply-shift. */
    static inline uint64_t kfeed_mulhi64(uint64_t a, uint64_t b) {
    #if defined(__SIZEOF_INT128__)
        return (uint64_t)(((unsigned __int128)a * b) >> 64);
    #else
        uint64_t a_lo = (uint32_t)a, a_hi = a >> 32, b_lo = (uint32_t)b, b_hi = b >> 32;
        uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo, lo_hi = a_lo * b_hi;
        uint64_t cross = (lo_lo >> 32) + (uint32_t)hi_lo + lo_hi;
        return a_hi * b_hi + (hi_lo >> 32) + (cross >> 32);
    #endif
    }
    """
    uint64_t kfeed_mulhi64(uint64_t a, uint64_t b) noexcept nogil


cdef inline uint64_t draw(uint64_t* rng, uint64_t n) noexcept nogil:
    """SplitMix64 (Steele, Lea, Flood 2014), then a slot below ``n``."""
    rng[0] += <uint64_t>0x9E3779B97F4A7C15
    cdef uint64_t z = rng[0]
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EB
    return kfeed_mulhi64(z ^ (z >> 31), n)


cdef inline void copy_key(int64_t[:, ::1] dst, Py_ssize_t i, const int64_t[:, ::1] src,
                          Py_ssize_t j) noexcept nogil:
    dst[i, 0] = src[j, 0]
    dst[i, 1] = src[j, 1]
    dst[i, 2] = src[j, 2]
    dst[i, 3] = src[j, 3]


cdef int check_rows(str name, const int64_t[:, ::1] a, Py_ssize_t need) except -1:
    if a.shape[1] != 4:
        raise ValueError(f"{name} must have 4 columns, got {a.shape[1]}")
    if a.shape[0] < need:
        raise ValueError(f"{name} has {a.shape[0]} rows, needs {need}")
    return 0


cdef int check_partitions(const int64_t[:, ::1] recs, Py_ssize_t m,
                          Py_ssize_t nparts) except -1:
    cdef Py_ssize_t i
    for i in range(m):
        if recs[i, 0] < 0 or recs[i, 0] >= nparts:
            raise ValueError(f"record {i} names partition id {recs[i, 0]}, "
                             f"not one of the {nparts} known")
    return 0


def records(const int64_t[::1] pids, const int64_t[::1] offsets, const int64_t[::1] counts,
            int64_t first_item):
    """The rows to push for records taken ``counts[j]`` from message ``j``, in order.

    ``[pids[j], offsets[j], index in message j, item]``, the items counting
    from ``first_item``: one call per fetch, no Python object per record.
    """
    cdef Py_ssize_t m = counts.shape[0], j, at = 0
    cdef int64_t k, total = 0
    if pids.shape[0] != m or offsets.shape[0] != m:
        raise ValueError("one pid, one offset and one count per message are needed")
    for j in range(m):
        if counts[j] < 0:
            raise ValueError(f"count {counts[j]} of message {j} is negative")
        total += counts[j]
    out = np.empty((total, 4), np.int64)
    cdef int64_t[:, ::1] r = out
    with nogil:
        for j in range(m):
            for k in range(counts[j]):
                r[at, 0] = pids[j]
                r[at, 1] = offsets[j]
                r[at, 2] = k
                r[at, 3] = first_item + at
                at += 1
    return out


def reservoir_push(uint64_t rng, Py_ssize_t size, Py_ssize_t n, int64_t[:, ::1] held,
                   int64_t[:, ::1] parts, uint8_t[:, ::1] known,
                   const int64_t[:, ::1] recs, bint check, int64_t[:, ::1] emitted,
                   int64_t[::1] skipped):
    """Push ``recs`` (rows ``[partition id, offset, sub, item]``) through a reservoir.

    ``held``: the ``n`` records held, slot by slot, room for ``size``
    (``size`` 0: in order, every record comes out as it is pushed).
    ``parts``/``known``: per partition id, the read and arrived positions
    and whether each is known. ``check``: a record at or below its
    partition's arrived position is a repeat, skipped (its item goes to
    ``skipped``); otherwise it moves the arrived position. Every record
    pushed moves the read position. Emitted records go to ``emitted`` in
    order; both outputs need room for every record.

    Returns ``(rng, n, emitted, skipped)``: the generator's state, the
    records held, and how many rows of each output were written.
    """
    cdef Py_ssize_t m = recs.shape[0], nparts = parts.shape[0]
    check_rows("held", held, size)
    check_rows("parts", parts, 0)
    check_rows("recs", recs, 0)
    check_rows("emitted", emitted, m)
    if known.shape[0] < nparts or known.shape[1] != 2:
        raise ValueError("known needs 2 flags per partition")
    if skipped.shape[0] < m:
        raise ValueError(f"skipped has {skipped.shape[0]} entries, needs {m}")
    if size < 0 or not 0 <= n <= size:
        raise ValueError(f"{n} records held in a reservoir of {size}")
    check_partitions(recs, m, nparts)
    cdef Py_ssize_t i, j, ne = 0, ns = 0
    cdef int64_t p, o, s
    with nogil:
        for i in range(m):
            p = recs[i, 0]
            o = recs[i, 1]
            s = recs[i, 2]
            if check:
                if known[p, 1] and (o < parts[p, 2] or (o == parts[p, 2] and s < parts[p, 3])):
                    skipped[ns] = recs[i, 3]
                    ns += 1
                    continue
                parts[p, 2] = o
                parts[p, 3] = s + 1
                known[p, 1] = 1
            parts[p, 0] = o
            parts[p, 1] = s + 1
            known[p, 0] = 1
            if size == 0:
                copy_key(emitted, ne, recs, i)
                ne += 1
            elif n < size:
                copy_key(held, n, recs, i)
                n += 1
            else:
                j = <Py_ssize_t>draw(&rng, <uint64_t>size)
                copy_key(emitted, ne, held, j)
                ne += 1
                copy_key(held, j, recs, i)
    return rng, n, ne, ns


def reservoir_drain(uint64_t rng, Py_ssize_t n, int64_t[:, ::1] held,
                    int64_t[:, ::1] emitted):
    """Emit the ``n`` records held, in random order, into ``emitted``; the new ``rng``.

    Each draw takes one of the records left and the last one fills its slot.
    """
    check_rows("held", held, n)
    check_rows("emitted", emitted, n)
    cdef Py_ssize_t j, k = 0
    with nogil:
        while n > 0:
            j = <Py_ssize_t>draw(&rng, <uint64_t>n)
            copy_key(emitted, k, held, j)
            k += 1
            n -= 1
            copy_key(held, j, held, n)
    return rng


def key_minima(const int64_t[:, ::1] keys, int64_t[:, ::1] marks, uint8_t[::1] known):
    """Lower ``marks[p]`` (``[offset, sub]`` per partition id) to every key of ``keys``.

    ``keys``: rows ``[partition id, offset, sub, ...]``; ``known[p]`` is set
    for a partition a key or an earlier mark named.
    """
    cdef Py_ssize_t m = keys.shape[0], nparts = marks.shape[0], i
    if keys.shape[1] < 3 or marks.shape[1] != 2:
        raise ValueError("keys need 3 columns and marks 2")
    if known.shape[0] < nparts:
        raise ValueError("known needs one flag per partition")
    cdef int64_t p, o, s
    for i in range(m):
        if keys[i, 0] < 0 or keys[i, 0] >= nparts:
            raise ValueError(f"key {i} names partition id {keys[i, 0]}, "
                             f"not one of the {nparts} known")
    with nogil:
        for i in range(m):
            p = keys[i, 0]
            o = keys[i, 1]
            s = keys[i, 2]
            if not known[p] or o < marks[p, 0] or (o == marks[p, 0] and s < marks[p, 1]):
                marks[p, 0] = o
                marks[p, 1] = s
                known[p] = 1


# Why mix_take stopped (kfeed.mix.Mixer reads them).
cdef enum:
    MIX_LIMIT_C = 0      # it took ``limit`` records
    MIX_STALLED_C = 1    # the source drawn waits for records of its next partition
    MIX_EXHAUSTED_C = 2  # the source drawn has no partition left (each read to its end)
    MIX_NONE_C = 3       # no source may be drawn (none live, or every weight 0)

MIX_LIMIT, MIX_STALLED, MIX_EXHAUSTED, MIX_NONE = (MIX_LIMIT_C, MIX_STALLED_C,
                                                    MIX_EXHAUSTED_C, MIX_NONE_C)


def mix_take(const int64_t[:, ::1] pool, int64_t[::1] head, const int64_t[::1] end,
             const uint8_t[::1] done, const uint8_t[::1] idle, int64_t[::1] ring,
             const int64_t[::1] ring_start, int64_t[::1] ring_len, int64_t[::1] rr,
             const int64_t[::1] weights, int64_t[::1] credits, const uint8_t[::1] live,
             Py_ssize_t limit, int64_t[:, ::1] out):
    """Take up to ``limit`` records in the mixture's order into ``out``.

    Sources are drawn by smooth weighted round robin: every draw adds each
    drawable source's weight to its credit, the source with the most credit
    (the lowest index on a tie) is drawn and gives back the sum of the
    weights. Over any stretch of draws each source's count stays within a
    couple of records of its share. Within a source, its partitions take
    turns record by record, in ``ring`` order (``ring[ring_start[s]:][:ring_len[s]]``,
    the next one at ``rr[s]``). A partition's records wait in
    ``pool[head[p]:end[p]]``; one that is ``done`` (read to its end) and
    empty leaves the ring when its turn comes. One that is ``idle`` (an
    unbounded read at the partition's end for now: nothing more in Kafka)
    and empty passes its turn to the next of its ring, unless every one
    of them is idle or waits (a source with no records holds the mixture).

    A draw is made only once its record is there, so where the stream stops
    (a partition not fetched yet) does not change the order: the records
    taken depend only on the state and the records, never on timing; but
    for a partition's turn passed while it was idle, which depends on when
    its next records were written.
    Returns ``(taken, why, source)``: ``why`` one of the ``MIX_*`` codes,
    ``source`` the source that stalled or ran out (else -1).
    """
    cdef Py_ssize_t nsrc = weights.shape[0], nparts = head.shape[0], nring = ring.shape[0]
    cdef Py_ssize_t s, p, k, j, best, passed, turn, n = 0
    cdef int64_t total, v, bestv
    cdef int why = MIX_LIMIT_C
    cdef Py_ssize_t src = -1
    check_rows("pool", pool, 0)
    check_rows("out", out, limit)
    if credits.shape[0] != nsrc or live.shape[0] != nsrc or ring_start.shape[0] != nsrc \
            or ring_len.shape[0] != nsrc or rr.shape[0] != nsrc:
        raise ValueError("credits, live, ring_start, ring_len and rr need one entry per source")
    if end.shape[0] != nparts or done.shape[0] != nparts or idle.shape[0] != nparts:
        raise ValueError("head, end, done and idle need one entry per partition id")
    for p in range(nparts):
        if not 0 <= head[p] <= end[p] <= pool.shape[0]:
            raise ValueError(f"partition id {p}: rows {head[p]}..{end[p]} are not in the pool")
    for s in range(nsrc):
        if weights[s] < 0 or ring_len[s] < 0 or ring_start[s] < 0 \
                or ring_start[s] > nring or ring_len[s] > nring - ring_start[s]:
            raise ValueError(f"source {s}: a negative weight, or its ring is not in ``ring``")
        if ring_len[s] and not 0 <= rr[s] < ring_len[s]:
            raise ValueError(f"source {s}: turn {rr[s]} of a ring of {ring_len[s]}")
        for k in range(ring_start[s], ring_start[s] + ring_len[s]):
            if not 0 <= ring[k] < nparts:
                raise ValueError(f"ring entry {k} names partition id {ring[k]}")
    with nogil:
        total = 0
        for s in range(nsrc):
            if live[s]:
                total += weights[s]
        while n < limit:
            if total <= 0:
                why = MIX_NONE_C
                break
            best = -1
            bestv = 0
            for s in range(nsrc):
                if live[s] and weights[s] > 0:
                    v = credits[s] + weights[s]
                    if best < 0 or v > bestv:
                        best = s
                        bestv = v
            passed = 0  # idle partitions whose turn passed in this draw
            turn = rr[best]
            while True:
                if ring_len[best] == 0:
                    why = MIX_EXHAUSTED_C
                    break
                k = ring_start[best] + rr[best]
                p = ring[k]
                if head[p] < end[p]:
                    break
                if not done[p]:
                    if idle[p] and passed + 1 < ring_len[best]:
                        passed += 1
                        rr[best] = (rr[best] + 1) % ring_len[best]
                        continue
                    # The turn stays where the draw found it, whichever partitions
                    # were known idle: the state does not depend on when that was.
                    # (Passing happens only in unbounded reads, where no partition
                    # is done, so the ring did not change meanwhile.)
                    if passed:
                        rr[best] = turn
                    why = MIX_STALLED_C
                    break
                # Read to its end and empty: out of the ring, the next takes its turn.
                for j in range(k, ring_start[best] + ring_len[best] - 1):
                    ring[j] = ring[j + 1]
                ring_len[best] -= 1
                if rr[best] >= ring_len[best]:
                    rr[best] = 0
            if why != MIX_LIMIT_C:
                src = best
                break
            copy_key(out, n, pool, head[p])
            head[p] += 1
            n += 1
            rr[best] = (rr[best] + 1) % ring_len[best]
            for s in range(nsrc):
                if live[s]:
                    credits[s] += weights[s]
            credits[best] -= total
    return n, why, src


def gather_documents(list tokens, list starts, const int64_t[::1] fetch_of,
                     const int64_t[::1] local, const int64_t[::1] cut, str dtype):
    """Documents out of several fetches, one after another, as a gathered ``Chunk``.

    Document ``i`` is document ``local[i]`` of fetch ``fetch_of[i]``: the
    tokens of ``tokens[f]`` (an array of ``dtype`` seen as bytes) from
    ``starts[f][local[i]]`` to ``starts[f][local[i] + 1]``, less its first
    ``cut[i]`` tokens (``cut`` empty: none). No token moves: the chunk holds
    the arrays and each document's address, and the packer copies each once,
    straight into the batch. A document cut to no tokens is owed its EOS (the
    rest of one whose tokens all came out before a resume, NOTE [ Elastic
    resume ]). Gives ``(chunk, lengths, owed)``: each document's length in
    tokens, and those owed their EOS (uint8 per document; None if none is);
    every index is checked here.
    """
    cdef int code = CODES.get(dtype, 0)
    cdef Py_ssize_t n = fetch_of.shape[0], nf = len(tokens), i, f, d
    cdef Py_ssize_t itemsize = in_size(code)
    cdef int64_t a, b, c
    if code == 0 or len(starts) != nf or local.shape[0] != n \
            or (cut.shape[0] != 0 and cut.shape[0] != n):
        raise ValueError("a fetch and a document per id, starts per fetch, an integer dtype")
    cdef const uint8_t[::1] tv
    cdef const int64_t[::1] sv
    cdef int64_t[::1] lv, ov
    cdef Chunk chunk = Chunk()
    chunk.keep = []  # the views, so the addresses below stay valid
    chunk.code = code
    chunk.ndocs = n
    chunk.ptrs = <const uint8_t**>malloc(max(n, 1) * sizeof(uint8_t*))
    cdef const uint8_t** src = <const uint8_t**>malloc(max(nf, 1) * sizeof(uint8_t*))
    cdef const int64_t** bounds = <const int64_t**>malloc(max(nf, 1) * sizeof(int64_t*))
    cdef int64_t* have = <int64_t*>malloc(max(nf, 1) * sizeof(int64_t))
    cdef int64_t* docs = <int64_t*>malloc(max(nf, 1) * sizeof(int64_t))
    if chunk.ptrs == NULL or src == NULL or bounds == NULL or have == NULL or docs == NULL:
        free(src); free(bounds); free(have); free(docs)
        raise MemoryError()
    try:
        for f in range(nf):
            tv = tokens[f]
            sv = starts[f]
            chunk.keep.append((tv, sv))
            src[f] = &tv[0] if tv.shape[0] else NULL
            bounds[f] = &sv[0] if sv.shape[0] else NULL
            have[f] = tv.shape[0] // itemsize
            docs[f] = sv.shape[0] - 1
        lengths = np.empty(n, np.int64)
        offs = np.empty(n + 1, np.int64)
        lv = lengths
        ov = offs
        owed = None
        ov[0] = 0
        for i in range(n):
            f = fetch_of[i]
            d = local[i]
            if f < 0 or f >= nf or d < 0 or d >= docs[f]:
                raise ValueError(f"document {i}: {d} of fetch {f}, outside what is held")
            a = bounds[f][d]
            b = bounds[f][d + 1]
            c = cut[i] if cut.shape[0] else 0
            if a < 0 or b < a or b > have[f] or c < 0:
                raise ValueError(f"document {i}: tokens {a} to {b} (less {c}) of {have[f]}")
            if c and a + c >= b:
                if owed is None:
                    owed = np.zeros(n, np.uint8)
                owed[i] = 1
            a = min(a + c, b)
            chunk.ptrs[i] = src[f] + a * itemsize if b > a else NULL
            lv[i] = b - a
            ov[i + 1] = ov[i] + (b - a)
        chunk.offs = offs
        if owed is not None:
            chunk.owed_view = owed
            chunk.owed = &chunk.owed_view[0]
        return chunk, lengths, owed
    finally:
        free(src); free(bounds); free(have); free(docs)
