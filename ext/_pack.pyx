"""The packer: documents of token ids -> dense ``[rows, seq_len]`` batches.

In the data flow it sits after the codec's ``decode_documents`` (one flat
array of token ids plus one length per document) and writes straight into
preallocated output buffers, the pool's pinned slots in the loader: token ids,
position ids, document ids and flash-attention's ``cu_seqlens``. The loop runs
without the GIL and creates no Python object per document; it works segment
by segment (the part of one document that lies in one row), so its per-token
work is a typed copy and two fills. ``kfeed.tokens.Packer`` is its front and
holds the state between calls; the rules are documented there.
"""

from libc.stdint cimport (int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t,
                          uint64_t)
from libc.string cimport memcpy

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

ctypedef fused src_t:
    int8_t
    uint8_t
    int16_t
    uint16_t
    int32_t
    uint32_t
    int64_t
    uint64_t

ctypedef fused dst_t:
    int32_t
    int64_t


cdef inline size_t out_size(int code) noexcept nogil:
    return 4 if code == C_INT32 else 8


cdef inline void convert(const src_t* s, dst_t* d, Py_ssize_t n) noexcept nogil:
    # C conversion: token ids are never range-checked, as the codec never
    # checks element values.
    cdef Py_ssize_t i
    for i in range(n):
        d[i] = <dst_t>s[i]


cdef inline void convert_to(const uint8_t* s, int sc, dst_t* d, Py_ssize_t n) noexcept nogil:
    if sc == C_INT8:
        convert(<const int8_t*>s, d, n)
    elif sc == C_UINT8:
        convert(<const uint8_t*>s, d, n)
    elif sc == C_INT16:
        convert(<const int16_t*>s, d, n)
    elif sc == C_UINT16:
        convert(<const uint16_t*>s, d, n)
    elif sc == C_INT32:
        convert(<const int32_t*>s, d, n)
    elif sc == C_UINT32:
        convert(<const uint32_t*>s, d, n)
    elif sc == C_INT64:
        convert(<const int64_t*>s, d, n)
    else:
        convert(<const uint64_t*>s, d, n)


cdef inline void copy_ids(const uint8_t* s, int sc, uint8_t* d, int dc,
                          Py_ssize_t n) noexcept nogil:
    if (sc == C_INT32 or sc == C_UINT32) and dc == C_INT32:
        memcpy(d, s, 4 * n)
    elif (sc == C_INT64 or sc == C_UINT64) and dc == C_INT64:
        memcpy(d, s, 8 * n)
    elif dc == C_INT32:
        convert_to(s, sc, <int32_t*>d, n)
    else:
        convert_to(s, sc, <int64_t*>d, n)


cdef inline void fill(uint8_t* d, int dc, int64_t value, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    cdef int32_t* d32
    cdef int64_t* d64
    if dc == C_INT32:
        d32 = <int32_t*>d
        for i in range(n):
            d32[i] = <int32_t>value
    else:
        d64 = <int64_t*>d
        for i in range(n):
            d64[i] = value


cdef inline void iota(uint8_t* d, int dc, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    cdef int32_t* d32
    cdef int64_t* d64
    if dc == C_INT32:
        d32 = <int32_t*>d
        for i in range(n):
            d32[i] = <int32_t>i
    else:
        d64 = <int64_t*>d
        for i in range(n):
            d64[i] = i


cdef size_t in_size(int code) noexcept nogil:
    if code == C_INT8 or code == C_UINT8:
        return 1
    if code == C_INT16 or code == C_UINT16:
        return 2
    if code == C_INT32 or code == C_UINT32:
        return 4
    return 8


cdef class Outputs:
    """The output buffers of one batch, as raw addresses (kept alive by the caller).

    ``[rows, seq_len]`` C-contiguous token ids, position ids and document ids
    (address 0: not written), and ``cu_seqlens`` with room for
    ``rows * seq_len + 1`` int32 entries (address 0: not written).
    """

    cdef uint8_t* tokens
    cdef int tok
    cdef uint8_t* pos
    cdef int pos_code
    cdef uint8_t* docs
    cdef int doc_code
    cdef int32_t* cu
    cdef Py_ssize_t cu_cap
    cdef readonly Py_ssize_t rows
    cdef readonly Py_ssize_t seq_len

    def __cinit__(self, Py_ssize_t rows, Py_ssize_t seq_len, uint64_t tok_ptr, int tok_code,
                  uint64_t pos_ptr, int pos_code, uint64_t doc_ptr, int doc_code,
                  uint64_t cu_ptr, Py_ssize_t cu_cap):
        if rows <= 0 or seq_len <= 0:
            raise ValueError("rows and seq_len must be positive")
        if tok_ptr == 0:
            raise ValueError("the token buffer is required")
        for code, ptr in ((tok_code, tok_ptr), (pos_code, pos_ptr), (doc_code, doc_ptr)):
            if ptr and code not in OUT_CODES.values():
                raise ValueError("output buffers hold int32 or int64")
        if cu_ptr and cu_cap < rows * seq_len + 1:
            raise ValueError("cu_seqlens needs rows * seq_len + 1 entries")
        self.rows = rows
        self.seq_len = seq_len
        self.tokens = <uint8_t*>tok_ptr
        self.tok = tok_code
        self.pos = <uint8_t*>pos_ptr
        self.pos_code = pos_code
        self.docs = <uint8_t*>doc_ptr
        self.doc_code = doc_code
        self.cu = <int32_t*>cu_ptr
        self.cu_cap = cu_cap


cdef inline void segment(uint8_t* pos, int pos_code, uint8_t* docs, int doc_code,
                         Py_ssize_t at, Py_ssize_t n, int64_t doc_id) noexcept nogil:
    """Position and document ids of one segment of ``n`` slots from ``at``."""
    if pos != NULL:
        iota(pos + at * out_size(pos_code), pos_code, n)
    if docs != NULL:
        fill(docs + at * out_size(doc_code), doc_code, doc_id, n)


cdef class Core:
    """The packing loop and where the current batch stands.

    A batch may be filled from several sources (the chunks documents were
    fed in) in turn: ``start()`` opens a batch, each ``run()`` packs from one
    source and, when that source runs out before the batch is full, leaves
    the batch's cursor here for the next source.
    """

    cdef Py_ssize_t L
    cdef bint has_eos
    cdef int64_t eos
    cdef int64_t pad
    cdef bint split_long
    # The cursor of the current batch.
    cdef readonly Py_ssize_t rows        # rows done
    cdef Py_ssize_t col                  # column in the current row
    cdef readonly Py_ssize_t segments
    cdef readonly Py_ssize_t max_seqlen
    cdef readonly int64_t tokens         # real tokens written
    cdef readonly int64_t truncated
    cdef int64_t doc_id                  # the id of the next document in this batch
    cdef readonly int64_t documents      # documents finished

    def __cinit__(self, Py_ssize_t seq_len, bint has_eos, int64_t eos, int64_t pad,
                  bint split_long):
        if seq_len <= 0:
            raise ValueError("seq_len must be positive")
        self.L = seq_len
        self.has_eos = has_eos
        self.eos = eos
        self.pad = pad
        self.split_long = split_long

    def start(self):
        """Open a new batch."""
        self.rows = self.col = self.segments = self.max_seqlen = 0
        self.tokens = self.truncated = self.doc_id = self.documents = 0

    def run(self, Outputs out, uint64_t src, int src_code, uint64_t offsets_ptr,
            Py_ssize_t ndocs, Py_ssize_t doc, int64_t off, bint final):
        """Pack from document ``doc`` (``off`` tokens of it already out) of one source.

        ``src``: the address of the source's token ids (``src_code``
        elements); ``offsets_ptr``: of its ``ndocs + 1`` int64 document
        offsets, from 0 and non-decreasing (the caller checks). Returns
        ``(complete, doc, off)``. Not complete: the source ran out before the
        batch was full and ``final`` is false; the next source goes on from
        the cursor. Complete: the batch is done, with fewer rows than
        ``out.rows`` only when ``final`` (the stream is over; the last row is
        padded), and the packer continues at ``doc`` with ``off`` tokens of
        it out.
        """
        if src_code not in CODES.values():
            raise ValueError("unknown element type")
        if not 0 <= doc <= ndocs or out.seq_len != self.L:
            raise ValueError("doc is outside the documents, or out has another seq_len")
        cdef const uint8_t* s = <const uint8_t*>src
        cdef const int64_t* offsets = <const int64_t*>offsets_ptr
        cdef size_t isz = in_size(src_code)
        cdef size_t tsz = out_size(out.tok)
        cdef Py_ssize_t L = self.L, rows = out.rows, at, take, a, b, i
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
        cdef uint8_t* docs = out.docs
        cdef int pos_code = out.pos_code, doc_code = out.doc_code
        cdef Py_ssize_t cu_cap = out.cu_cap
        cdef bint complete = True
        with nogil:
            while r < rows:
                while col < L:
                    while doc < ndocs and offsets[doc + 1] == offsets[doc]:
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
                        copy_ids(s + (offsets[doc] + a) * isz, src_code,
                                 tokens + at * tsz, tok, b - a)
                    if off + take > n:
                        fill(tokens + (at + b - a) * tsz, tok, eos, 1)
                    segment(pos, pos_code, docs, doc_code, at, take, doc_id)
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
                    segment(pos, pos_code, docs, doc_code, at, L - col, -1)
                    if cu != NULL:
                        cu[nseg] = <int32_t>at
                    nseg += 1
                    if L - col > maxlen:
                        maxlen = L - col
                r += 1
                col = 0
            if complete and cu != NULL:
                # The entries past the valid ones repeat the total, so the
                # whole buffer is a valid cu_seqlens (empty sequences at the end).
                for i in range(nseg, cu_cap):
                    cu[i] = <int32_t>(r * L)
        self.rows = r
        self.col = col
        self.segments = nseg
        self.max_seqlen = maxlen
        self.tokens = real
        self.truncated = trunc
        self.doc_id = doc_id
        self.documents = done
        return complete, doc, off
