"""Token streams: packing documents into ``[batch, seq_len]`` rows, and shuffling.

In the data flow this sits between the codec and the batch. For a schema with a
variable-length token field, ``Schema.decode_documents`` turns message values
into one flat array of token ids plus one length per document; a ``Packer``
packs those documents into dense rows (the Cython loop in ``ext/_pack.pyx``,
writing straight into preallocated, possibly pinned, buffers); a
``ShuffleBuffer`` may reorder records on the way, seeded and exactly
resumable. Both keep a small state that a loader puts in its ``state_dict``.

Packing rules (``Pack``):

- Each document is followed by ``eos_id`` (unless ``eos_id`` is None); a
  document's *unit* is its tokens plus that EOS. An empty document gives
  nothing, not even an EOS.
- ``split_long=True``: the units are concatenated and cut into rows of
  ``seq_len``; a unit that does not fit in what is left of a row continues at
  the start of the next row, or of the next batch. Only the last row of the
  stream is padded.
- ``split_long=False``: a unit never straddles rows. One that does not fit in
  what is left of the row starts the next row, and the rest of the row is
  padded with ``pad_id``. A unit longer than ``seq_len`` is cut to its first
  ``seq_len`` tokens, which drops its EOS, and counts as truncated.
- Outputs, per batch of ``rows`` rows: ``tokens``; ``position_ids``, which
  restart at 0 at every segment (the part of one document, or one run of
  padding, that lies in one row); ``doc_ids``, the ordinal of each token's
  document within the batch (a document continued across rows keeps its id;
  -1 for padding); ``cu_seqlens``, int32, the flattened start of every
  segment then ``rows * seq_len``, the form flash-attention's varlen kernels
  take (``position_ids == 0`` exactly where a segment starts). Only the
  first ``segments + 1`` entries are written; the rest of the buffer is left
  as it was (writing it would cost as much as the batch's position ids).
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kfeed import _pack
from kfeed.errors import ConfigError, KfeedError

__all__ = ["Pack", "Packer", "PackInfo", "PackTarget", "Shuffle", "ShuffleBuffer"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_SRC_CODES = {np.dtype(name): code for name, code in _pack.CODES.items()}
_OUT_KEYS = ("tokens", "position_ids", "doc_ids", "cu_seqlens")

_NO_CUT = np.empty(0, np.int64)


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _plain_ints(spec: object, *names: str) -> None:
    """A frozen spec's numpy integers as Python ints: its states go to JSON and ``torch.load``."""
    for name in names:
        value = getattr(spec, name)
        if isinstance(value, np.integer):
            object.__setattr__(spec, name, int(value))


@dataclass(frozen=True)
class Pack:
    """How documents become rows: ``seq_len`` tokens each (see the module docstring)."""

    seq_len: int
    eos_id: int | None
    pad_id: int = 0
    split_long: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.seq_len) or self.seq_len <= 0:
            raise ConfigError(f"seq_len must be a positive int, got {self.seq_len!r}")
        if self.eos_id is not None and not (
            _is_int(self.eos_id) and _INT32_MIN <= self.eos_id <= _INT32_MAX
        ):
            raise ConfigError(f"eos_id must be None or an int32 token id, got {self.eos_id!r}")
        if not (_is_int(self.pad_id) and _INT32_MIN <= self.pad_id <= _INT32_MAX):
            raise ConfigError(f"pad_id must be an int32 token id, got {self.pad_id!r}")
        if not isinstance(self.split_long, bool):
            raise ConfigError(f"split_long must be a bool, got {self.split_long!r}")
        _plain_ints(self, "seq_len", "eos_id", "pad_id")


class PackInfo(NamedTuple):
    """What one ``Packer.next_batch`` wrote.

    rows: rows filled (``batch_size`` except at the end of the stream).
    segments: segments in those rows; ``cu_seqlens[:segments + 1]`` are the
    valid entries. max_seqlen: the longest segment. tokens: real tokens
    (EOS included); padding: ``rows * seq_len - tokens``. documents:
    documents finished in this batch (empty ones included), in feed order.
    truncated: documents cut to ``seq_len`` (``split_long=False`` only).
    """

    rows: int
    segments: int
    max_seqlen: int
    tokens: int
    padding: int
    documents: int
    truncated: int


class PackTarget(NamedTuple):
    """Output buffers checked once: the packer's hold on them, and the buffers."""

    outputs: _pack.Outputs
    owners: tuple[Any, ...]


def _is_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch")


def _dtype_name(buf: Any) -> str:
    return str(buf.dtype).removeprefix("torch.")


def _out_view(name: str, buf: Any, shape: tuple[int, ...] | None, dtypes: tuple[str, ...],
              min_len: int = 0) -> np.ndarray:
    """A numpy view of an output buffer (numpy array or CPU tensor), checked."""
    if _is_tensor(buf):
        if buf.device.type != "cpu":
            raise ConfigError(f"out[{name!r}] must be a CPU tensor, got {buf.device}")
        contiguous = buf.is_contiguous()
    elif isinstance(buf, np.ndarray):
        if not buf.flags.writeable:
            raise ConfigError(f"out[{name!r}] is read-only")
        contiguous = buf.flags.c_contiguous
    else:
        raise ConfigError(f"out[{name!r}] must be a numpy array or a torch tensor")
    dtype = _dtype_name(buf)
    if dtype not in dtypes:
        raise ConfigError(f"out[{name!r}]: dtype must be {' or '.join(dtypes)}, got {dtype}")
    got = tuple(buf.shape)
    if shape is not None and got != shape:
        raise ConfigError(f"out[{name!r}] must have shape {shape}, got {got}")
    if shape is None and (len(got) != 1 or got[0] < min_len):
        raise ConfigError(f"out[{name!r}] must be 1-D with at least {min_len} entries, got {got}")
    if not contiguous:
        raise ConfigError(f"out[{name!r}] must be contiguous")
    return buf.detach().numpy() if _is_tensor(buf) else buf


class Packer:
    """Packs a stream of documents into batches of ``batch_size`` rows.

    ``feed(tokens, lengths)`` appends documents (e.g. ``Documents.tokens`` and
    ``.lengths`` from ``Schema.decode_documents``); ``next_batch(out)`` packs
    the next batch into preallocated buffers and returns a ``PackInfo``, or
    None while the documents fed so far cannot fill a whole batch;
    ``finish()`` marks the end of the stream so the last rows come out,
    padded. Feeding in any chunking gives the same batches.

    ``state()`` is ``{"docs": D, "offset": K}``: D documents (counted from
    the start of the stream, or from the state loaded) have been packed
    whole, and the first K tokens of the next one (EOS counted) are already
    out, so a batch boundary may fall inside a document. A new packer given
    that state with ``load_state`` and fed the documents from number D on
    continues with the identical next batch.
    """

    def __init__(self, pack: Pack, batch_size: int) -> None:
        if not isinstance(pack, Pack):
            raise ConfigError(f"pack must be a kfeed.Pack, got {type(pack).__name__}")
        if not _is_int(batch_size) or batch_size <= 0:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        self.pack = pack
        self.batch_size = int(batch_size)
        self._slots = self.batch_size * pack.seq_len
        # Pending documents, in the chunks they were fed in. Document d of a
        # chunk is elements offsets[d]..offsets[d + 1] of its tokens; the
        # chunk holds both buffers.
        self._chunks: deque[_pack.Chunk] = deque()
        self._core = _pack.Core(pack.seq_len, pack.eos_id is not None,
                                0 if pack.eos_id is None else pack.eos_id, pack.pad_id,
                                pack.split_long)
        # Pending tokens that surely fill a batch (split_long=False may pad
        # up to half of every row).
        self._need = self._slots if pack.split_long else (self._slots + 1) // 2
        self._dtype: np.dtype | None = None
        self._doc = 0  # next document of the first chunk to pack
        self._off = 0  # tokens of it already out
        self._docs = 0  # documents packed whole, counted from the start
        self._pending = 0  # tokens still to come out of the pending documents
        self._finished = False
        self._fed = False
        # Counters since the packer was made.
        self.batches = 0
        self.tokens = 0
        self.padding = 0
        self.truncated = 0

    # -- input ---------------------------------------------------------------

    def feed(self, tokens: Any, lengths: Any, *, copy: bool = True,
             owed: np.ndarray | None = None) -> None:
        """Append documents: ``tokens`` 1-D (all concatenated), ``lengths`` one per document.

        ``copy=False`` keeps a reference to ``tokens`` instead of a copy until
        its documents are packed (e.g. the fresh arrays of
        ``Schema.decode_documents``): the caller must not change it meanwhile.
        ``owed`` (bool per document): a document of length 0 that still gives
        its EOS, the rest of one whose tokens all came out before a resume.
        """
        if self._finished:
            raise ConfigError("feed after finish(): the stream is over")
        flat = np.asarray(tokens.numpy() if _is_tensor(tokens) else tokens)
        lens = np.asarray(lengths.numpy() if _is_tensor(lengths) else lengths)
        code = _SRC_CODES.get(flat.dtype)
        if flat.ndim != 1 or code is None:
            raise ConfigError(
                f"tokens must be a 1-D array of an integer dtype, got {flat.dtype} {flat.shape}"
            )
        if lens.ndim != 1 or (lens.size and lens.dtype.kind not in "iu"):
            raise ConfigError("lengths must be a 1-D array of ints")
        try:
            offsets, total, nonempty = _pack.offsets(np.ascontiguousarray(lens, np.int64))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if total != len(flat):
            raise ConfigError(f"lengths add up to {total}, tokens holds {len(flat)}")
        if self._dtype is None:
            self._dtype = flat.dtype
        elif flat.dtype != self._dtype:
            raise ConfigError(f"tokens must stay {self._dtype}, got {flat.dtype}")
        self._fed = True
        if not lens.size:
            return
        flat = np.array(flat, copy=True) if copy else np.ascontiguousarray(flat)
        flags = None
        if owed is not None and not self.pack.split_long:
            raise ConfigError("owed= is for split_long=True: without it no document is cut, "
                              "so none owes its EOS")
        if owed is not None and self.pack.eos_id is not None:
            flags = np.ascontiguousarray(owed, np.uint8)
            if flags.shape != lens.shape:
                raise ConfigError(f"owed has {flags.size} entries for {lens.size} documents")
            nonempty += int((flags.astype(bool) & (lens == 0)).sum())
        self._append(_pack.Chunk(flat, offsets, flags), lens, total, nonempty)

    def _feed_gathered(self, tokens: list[np.ndarray], starts: list[np.ndarray],
                       fetch_of: np.ndarray, local: np.ndarray,
                       cut: np.ndarray | None) -> None:
        """The loader's ``feed`` of documents left where they lie: no copy before the packing.

        Document ``i`` is document ``local[i]`` of ``tokens[fetch_of[i]]``,
        whose documents start at ``starts[f]`` (one more entry than it holds
        documents), less its first ``cut[i]`` tokens; one cut to no tokens
        still gives its EOS. The packer holds the arrays until it packed them;
        the caller must not change them meanwhile.
        """
        if self._finished:
            raise ConfigError("feed after finish(): the stream is over")
        dtype = tokens[0].dtype if tokens else np.dtype(np.int32)
        if self._dtype is None:
            self._dtype = dtype
        elif dtype != self._dtype:
            raise ConfigError(f"tokens must stay {self._dtype}, got {dtype}")
        self._fed = True
        if not len(fetch_of):
            return
        try:
            chunk, lens, owed = _pack.gather_documents(
                [t.view(np.uint8) for t in tokens], starts, fetch_of, local,
                _NO_CUT if cut is None else cut, dtype.name)
        except ValueError as e:
            raise KfeedError(f"a document to pack is not held: a bug in kfeed ({e})") from None
        nonempty = int(np.count_nonzero(lens))
        if owed is not None and self.pack.eos_id is not None:
            nonempty += int(owed.sum())
        self._append(chunk, lens, int(lens.sum()), nonempty)

    def _append(self, chunk: Any, lens: np.ndarray, total: int, nonempty: int) -> None:
        """Queue a chunk of ``lens`` documents (``total`` tokens, ``nonempty`` giving any)."""
        if self._off and not self._chunks:
            n = int(lens[0])
            unit = n + (self.pack.eos_id is not None) if n else 0
            if unit <= self._off:
                raise ConfigError(
                    f"the document resumed at holds {unit} tokens (EOS counted), not more "
                    f"than the {self._off} already out: fed from the wrong document"
                )
        self._chunks.append(chunk)
        if self.pack.split_long:
            self._pending += total + (nonempty if self.pack.eos_id is not None else 0)
        else:
            units = np.where(lens > 0, lens + (self.pack.eos_id is not None), 0)
            self._pending += int(np.minimum(units, self.pack.seq_len).sum())

    def finish(self) -> None:
        """The stream is over: the next batches may be partial and padded."""
        self._finished = True

    def reopen(self) -> None:
        """More documents come after ``finish()`` after all (a bounded read given more
        partitions): the batches packed stay as they went out, and later documents
        start a new row, as after a partial batch."""
        self._finished = False

    @property
    def pending_documents(self) -> int:
        """Documents fed and not yet packed whole."""
        return sum(c.ndocs for c in self._chunks) - self._doc

    @property
    def pending_tokens(self) -> int:
        """Tokens (EOS counted) still to come out of the documents fed."""
        return self._pending

    # -- output --------------------------------------------------------------

    def empty(self, *, like: str = "numpy", pin_memory: bool = False,
              token_dtype: str = "int64", position_dtype: str = "int64",
              doc_dtype: str = "int32") -> dict[str, Any]:
        """Output buffers for one batch: tokens, position_ids, doc_ids, cu_seqlens."""
        for name, dt in (("token_dtype", token_dtype), ("position_dtype", position_dtype),
                         ("doc_dtype", doc_dtype)):
            if dt not in _pack.OUT_CODES:
                raise ConfigError(f"{name} must be 'int32' or 'int64', got {dt!r}")
        shape = (self.batch_size, self.pack.seq_len)
        dtypes = {"tokens": token_dtype, "position_ids": position_dtype, "doc_ids": doc_dtype,
                  "cu_seqlens": "int32"}
        shapes = {"tokens": shape, "position_ids": shape, "doc_ids": shape,
                  "cu_seqlens": (self._slots + 1,)}
        if like == "numpy":
            return {k: np.empty(shapes[k], dtypes[k]) for k in _OUT_KEYS}
        if like == "torch":
            import torch

            return {k: torch.empty(shapes[k], dtype=getattr(torch, dtypes[k]),
                                   pin_memory=pin_memory) for k in _OUT_KEYS}
        raise ConfigError(f"like must be 'numpy' or 'torch', got {like!r}")

    def bind(self, out: Mapping[str, Any]) -> PackTarget:
        """Check output buffers once and keep their addresses for many batches.

        ``tokens`` is required; ``position_ids``, ``doc_ids`` and
        ``cu_seqlens`` are written when present. ``[batch_size, seq_len]``
        int32 or int64, and ``cu_seqlens`` 1-D int32 with at least
        ``batch_size * seq_len + 1`` entries; numpy arrays or CPU tensors
        (pinned ones included).
        """
        if not isinstance(out, Mapping):
            raise ConfigError("out must be a mapping of name -> array or tensor")
        extra = set(out) - set(_OUT_KEYS)
        if extra:
            raise ConfigError(f"out has unknown keys {sorted(extra)}; known: {list(_OUT_KEYS)}")
        if "tokens" not in out:
            raise ConfigError("out needs 'tokens'")
        shape = (self.batch_size, self.pack.seq_len)
        ints = ("int32", "int64")
        views: dict[str, np.ndarray] = {}
        for key in ("tokens", "position_ids", "doc_ids"):
            if key in out:
                views[key] = _out_view(key, out[key], shape, ints)
        if "cu_seqlens" in out:
            if self._slots + 1 > _INT32_MAX:
                raise ConfigError("batch_size * seq_len is too large for int32 cu_seqlens")
            views["cu_seqlens"] = _out_view("cu_seqlens", out["cu_seqlens"], None, ("int32",),
                                            self._slots + 1)
        try:
            outputs = _pack.Outputs(self.batch_size, self.pack.seq_len, **views)
        except ValueError as e:  # the checks above should have said it first
            raise ConfigError(str(e)) from None
        return PackTarget(outputs, tuple(out.values()))

    def next_batch(self, out: Mapping[str, Any] | PackTarget, *,
                   partial: bool = False) -> PackInfo | None:
        """Pack the next batch into ``out``; None if the documents fed cannot fill it yet.

        After ``finish()`` the last batch may have fewer rows (its last row
        padded), and then None comes back for good. ``partial=True`` packs
        what was fed even if it cannot fill the batch, as after ``finish()``,
        but the stream goes on: later documents start a new row. (The loader
        does this once ``max_wait_ms`` has passed on a stream that trickles.)
        When None comes back the contents of ``out`` are unspecified.
        """
        target = out if isinstance(out, PackTarget) else self.bind(out)
        bound = (target.outputs.rows, target.outputs.seq_len)
        if bound != (self.batch_size, self.pack.seq_len):
            raise ConfigError(f"out was bound for [{bound[0]}, {bound[1]}], this packer writes "
                              f"[{self.batch_size}, {self.pack.seq_len}]")
        final = self._finished or partial
        if (not final and self._pending < self._need) or not self._chunks:
            return None
        if partial and not self._finished and self._pending <= 0:
            # Only empty documents pending: they go out (and are counted in
            # PackInfo.documents) with the next batch that has tokens.
            return None
        # One batch may take documents from several chunks; one call packs it.
        res = self._core.batch(target.outputs, self._chunks, self._doc, self._off, final)
        if res is None:
            return None
        used, self._doc, self._off, rows, segments, max_seqlen, real, truncated, done = res
        for _ in range(used):
            self._chunks.popleft()
        self._docs += done
        self._pending -= real
        if rows == 0:
            return None
        padding = rows * self.pack.seq_len - real
        self.batches += 1
        self.tokens += real
        self.padding += padding
        self.truncated += truncated
        return PackInfo(rows, segments, max_seqlen, real, padding, done, truncated)

    @property
    def efficiency(self) -> float:
        """Real tokens over all token slots written so far (1.0 before any)."""
        total = self.tokens + self.padding
        return self.tokens / total if total else 1.0

    # -- state ---------------------------------------------------------------

    @property
    def offset(self) -> int:
        """Tokens of the next document already out: ``state()["offset"]``, without the dict."""
        return self._off

    def state(self) -> dict[str, int]:
        """``{"docs": D, "offset": K}``: where the next batch starts (see the class doc)."""
        return {"docs": self._docs, "offset": self._off}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state()`` of another packer; before anything is fed."""
        if self._fed:
            raise ConfigError("load_state must come before the first feed")
        if not isinstance(state, Mapping) or set(state) != {"docs", "offset"}:
            raise ConfigError(f"not a packer state: {state!r}")
        docs, off = state["docs"], state["offset"]
        if not (_is_int(docs) and _is_int(off) and docs >= 0 and off >= 0):
            raise ConfigError(f"not a packer state: {state!r}")
        if off and not self.pack.split_long:
            raise ConfigError("with split_long=False no batch ends inside a document")
        self._docs, self._off = int(docs), int(off)
        self._pending = -self._off

    def __repr__(self) -> str:
        return (f"Packer({self.pack!r}, batch_size={self.batch_size}, "
                f"pending_documents={self.pending_documents}, state={self.state()})")


# -- shuffling -----------------------------------------------------------------


@dataclass(frozen=True)
class Shuffle:
    """A seeded shuffle buffer of ``buffer`` records (see ``ShuffleBuffer``)."""

    buffer: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.buffer) or self.buffer <= 0:
            raise ConfigError(f"buffer must be a positive int, got {self.buffer!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**64:
            raise ConfigError(f"seed must be an int in 0..2**64-1, got {self.seed!r}")
        _plain_ints(self, "buffer", "seed")


_MASK64 = 2**64 - 1
_GAMMA = 0x9E3779B97F4A7C15
_STATE_VERSION = 1
_HOLE = -1  # the item of a held record of a loaded state not pushed again yet

Key = tuple[Hashable, int, int]  # (partition, offset, sub-index)


def _position(x: Any) -> int:
    """An offset, sub or count of a state: an int in int64, not negative (else ValueError)."""
    n = operator.index(x)  # (TypeError for a float, or a string)
    if not 0 <= n < 2**63:
        raise ValueError(f"{x!r} is not an offset")
    return n


def _key(pair: Any) -> tuple[int, int]:
    """A state's ``[offset, sub]``, checked as ``_position`` checks each."""
    o, sub = pair
    return _position(o), _position(sub)


def _as_partition(p: Any) -> Hashable:
    # A state that went through JSON has lists where tuples were.
    return tuple(_as_partition(x) for x in p) if isinstance(p, list) else p


def _rows(n: int) -> np.ndarray:
    return np.empty((n, 4), np.int64)


class _Fifo:
    """Record rows in the order they were appended, in chunks; counted from the start."""

    __slots__ = ("chunks", "end", "start")

    def __init__(self) -> None:
        self.chunks: deque[np.ndarray] = deque()
        self.start = 0  # the index of chunks[0]'s first row
        self.end = 0    # rows appended

    def append(self, rows: np.ndarray) -> None:
        if len(rows):
            self.chunks.append(rows)
            self.end += len(rows)

    def since(self, first: int) -> list[np.ndarray]:
        """The rows from index ``first`` on, as views of the chunks."""
        out, at = [], self.start
        for c in self.chunks:
            if at + len(c) > first:
                out.append(c[max(0, first - at):])
            at += len(c)
        return out

    def drop_before(self, first: int) -> None:
        while self.chunks and self.start + len(self.chunks[0]) <= first:
            self.start += len(self.chunks.popleft())


class ShuffleBuffer:
    """A seeded reservoir shuffle over records keyed ``(partition, offset, sub)``.

    ``push`` offers one record; while fewer than ``buffer`` are held it is
    kept, afterwards a slot drawn at random is emitted and the new record
    takes its place. ``drain()`` emits what is left, in random order, at the
    end of a bounded stream. The random numbers come from SplitMix64 seeded
    with ``seed`` and a slot is ``(draw * held) >> 64``, so the order depends
    only on the seed and the order of the pushes, never on numpy's version
    nor on how the pushes are grouped: ``push_many`` offers many records in
    one call (the loop in ``ext/_pack.pyx``), with integer items, and emits
    exactly what as many ``push`` calls would.

    Records of one partition must be pushed in increasing ``(offset, sub)``
    order (Kafka's order); ``sub`` numbers the records inside one message
    (a block). A record at or below the last one pushed for its partition is
    a repeat and is skipped.

    Exact resume. ``state()`` holds, per partition, the *watermark* (every
    record below it was emitted) and the *read position* (every record below
    it was pushed); between the two, a record was emitted unless it is one of
    ``held`` (the buffer's keys, slot by slot, at most ``buffer``) or of
    ``outbox`` (emitted but not yet acknowledged, see ``ack``). Storing the
    few held keys rather than the emitted ones keeps the state bounded by the
    buffer size. A new buffer given that state re-reads each partition from
    its watermark (``resume_offsets()``): records already emitted are
    skipped, held ones go back into their slots, and records past the read
    position wait until every held one is back; then the outbox comes out
    again in its order and the shuffle goes on as if never stopped. Given the
    same records after the read positions, in the same order, the emitted
    sequence equals that of an uninterrupted run.

    ``ack=True``: a downstream stage (a packer, a prefetch queue) holds what
    was emitted until it is really used; ``ack(n)`` declares the next ``n``
    emitted records used. Until then they stay in ``state()``'s outbox and a
    resume emits them again, so nothing is lost with the downstream's buffers.
    ``track_used=True`` (with ``ack``) keeps the records acknowledged since
    the last ``mark_used()`` too, for ``watermarks(used=True)``: what a
    consumer may commit is known without a pass over the buffer per batch.

    Inside, records are rows ``[partition id, offset, sub, item]`` of int64
    arrays (``pid`` gives a partition's id); ``push`` keeps its items in a
    table and pushes their ids.
    """

    def __init__(self, shuffle: Shuffle | None, *, ack: bool = False,
                 track_used: bool = False) -> None:
        if shuffle is None:
            # In order: every record comes out as it is pushed. The loader uses
            # this for packing without shuffling, for the same exact resume.
            shuffle, size = Shuffle(buffer=1, seed=0), 0
        elif isinstance(shuffle, Shuffle):
            size = shuffle.buffer
        else:
            raise ConfigError(f"shuffle must be a kfeed.Shuffle, got {type(shuffle).__name__}")
        self.shuffle = shuffle
        self._size = size
        self._ack = bool(ack)
        self._track_used = bool(track_used) and self._ack
        self._rng = shuffle.seed & _MASK64
        # Partitions: id -> [read offset, read sub, arrived offset, arrived sub]
        # (read: after the last record processed; arrived: after the last
        # pushed) and whether each is known.
        self._pid: dict[Hashable, int] = {}
        self._parts: list[Hashable] = []
        self._pos = np.zeros((4, 4), np.int64)
        self._known = np.zeros((4, 2), np.uint8)
        try:
            self._held = _rows(max(size, 1))  # slot -> the record held there
        except MemoryError:
            raise ConfigError(f"Shuffle(buffer={size:,}) does not fit in memory here (its "
                              f"index alone takes {32 * size / 2**30:,.1f} GiB, before the "
                              f"records it holds): a smaller buffer") from None
        self._n = 0
        self._outbox = _Fifo()  # emitted (ack=True): acknowledged up to _acked
        self._acked = 0
        self._used = 0  # acknowledged and marked used (track_used)
        # Restoring a loaded state.
        self._holes: dict[tuple[int, int, int], int] = {}  # key -> slot, or -1 - restore row
        self._restore = _rows(0)  # the saved outbox, its items filled as they come back
        self._waiting: list[tuple[int, int, int, int]] = []  # pushed while holes remain
        self._touched = False
        # Partitions taken over from another reader's commit (``allow``): id ->
        # (read offset, read sub, the keys below it still to deliver).
        self._allow: dict[int, tuple[int, int, set[tuple[int, int]]]] = {}
        # push()'s items by id.
        self._objs: dict[int, Any] = {}
        self._next_obj = 0
        self.emitted = 0  # records emitted (and acknowledged, with ack=True)
        self.skipped = 0  # repeats skipped

    # -- partitions ------------------------------------------------------------

    def pid(self, partition: Hashable) -> int:
        """The id of ``partition`` in the rows ``push_many`` takes (given on first use)."""
        p = self._pid.get(partition)
        if p is None:
            p = self._pid[partition] = len(self._parts)
            self._parts.append(partition)
            if p == len(self._pos):
                self._pos = np.concatenate([self._pos, np.zeros_like(self._pos)])
                self._known = np.concatenate([self._known, np.zeros_like(self._known)])
        return p

    def partition(self, pid: int) -> Hashable:
        """The partition whose id is ``pid`` (``pid``'s inverse)."""
        return self._parts[pid]

    def read_position(self, partition: Hashable) -> tuple[int, int] | None:
        """``(offset, sub)`` after the last record of ``partition`` taken, if known."""
        p = self._pid.get(partition)
        if p is None or not self._known[p, 0]:
            return None
        return int(self._pos[p, 0]), int(self._pos[p, 1])

    def partition(self, pid: int) -> Hashable:
        """The partition of id ``pid``."""
        return self._parts[pid]

    def known_pid(self, partition: Hashable) -> int | None:
        """The id of ``partition``, or None if it has none yet."""
        return self._pid.get(partition)

    def _key(self, row: Any) -> Key:
        return (self._parts[int(row[0])], int(row[1]), int(row[2]))

    # -- the stream ------------------------------------------------------------

    def _draw(self, n: int) -> int:
        # SplitMix64 (Steele, Lea, Flood 2014), then Lemire's multiply-shift;
        # ext/_pack.pyx draws the same numbers.
        self._rng = s = (self._rng + _GAMMA) & _MASK64
        z = ((s ^ (s >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return ((z ^ (z >> 31)) * n) >> 64

    def push(self, partition: Hashable, offset: int, item: Any,
             sub: int = 0) -> list[tuple[Key, Any]]:
        """Offer one record; returns the records emitted now, as ``(key, item)``."""
        oid = self._next_obj
        self._next_obj += 1
        self._objs[oid] = item
        rec = np.array([[self.pid(partition), offset, sub, oid]], np.int64)
        emitted, skipped = self.push_many(rec)
        for s in skipped.tolist():
            del self._objs[s]
        return self._objects(emitted)

    def _objects(self, emitted: np.ndarray) -> list[tuple[Key, Any]]:
        return [(self._key(r), self._objs.pop(r[3])) for r in emitted.tolist()]

    def push_many(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Offer records in order: rows ``[partition id, offset, sub, item]`` (int64).

        ``item`` is any int >= 0 of the caller's (an index into its own
        store of records). Returns the rows emitted, in order, and the items
        of the repeats skipped.
        """
        self._touched = True
        recs = np.ascontiguousarray(records, np.int64)
        if recs.ndim != 2 or recs.shape[1] != 4:
            raise ConfigError(f"records must be rows of 4 ints, got shape {recs.shape}")
        if len(recs) and not 0 <= int(recs[:, 0].min()) <= int(recs[:, 0].max()) < len(
                self._parts):
            raise ConfigError(f"records name partition ids {int(recs[:, 0].min())}.."
                              f"{int(recs[:, 0].max())}; the ids pid() gave are "
                              f"0..{len(self._parts) - 1}")
        emitted: list[np.ndarray] = []
        skipped: list[np.ndarray] = []
        if self._allow:
            recs, dropped = self.screen(recs)
            if len(dropped):
                skipped.append(dropped)
        i = 0
        if self._holes and len(recs):
            i = self._push_restoring(recs, emitted, skipped)
        if i < len(recs):
            self._process(recs[i:], True, emitted, skipped)
        if self._allow:  # notes whose records were all read
            for p, (ro, rs, _keys) in list(self._allow.items()):
                if self._known[p, 0] and (int(self._pos[p, 0]), int(self._pos[p, 1])) >= (ro, rs):
                    del self._allow[p]
        return _joined(emitted), (np.concatenate(skipped) if skipped
                                  else np.empty(0, np.int64))

    def _process(self, recs: np.ndarray, check: bool, emitted: list[np.ndarray],
                 skipped: list[np.ndarray]) -> None:
        m = len(recs)
        out, skip = _rows(m), np.empty(m, np.int64)
        try:
            self._rng, self._n, ne, ns = _pack.reservoir_push(
                self._rng, self._size, self._n, self._held, self._pos, self._known, recs,
                check, out, skip)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.skipped += ns
        if ns:
            skipped.append(skip[:ns])
        if ne:
            self._emit(out[:ne], emitted)

    def _emit(self, rows: np.ndarray, emitted: list[np.ndarray]) -> None:
        emitted.append(rows)
        if self._ack:
            self._outbox.append(rows)
        else:
            self.emitted += len(rows)

    def _push_restoring(self, recs: np.ndarray, emitted: list[np.ndarray],
                        skipped: list[np.ndarray]) -> int:
        """Records while a loaded state's are coming back; where the rest go on normally."""
        pos, known = self._pos, self._known
        skip: list[int] = []
        done = len(recs)
        for i, (p, o, s, item) in enumerate(recs.tolist()):
            if not 0 <= p < len(self._parts):
                raise ConfigError(f"record {i} names partition id {p}, "
                                  f"not one of the {len(self._parts)} known")
            where = self._holes.pop((p, o, s), None)
            if where is not None:
                if where >= 0:
                    self._held[where, 3] = item
                else:
                    self._restore[-1 - where, 3] = item
                if not self._holes:
                    self._release(emitted, skipped)
                    done = i + 1
                    break
                continue
            if known[p, 1] and (o, s) < (pos[p, 2], pos[p, 3]):
                self.skipped += 1
                skip.append(item)
                continue
            pos[p, 2], pos[p, 3], known[p, 1] = o, s + 1, 1
            self._waiting.append((p, o, s, item))
        if skip:
            skipped.insert(0, np.array(skip, np.int64))
        return done

    def _release(self, emitted: list[np.ndarray], skipped: list[np.ndarray]) -> None:
        """Every held record is back: replay the outbox, then what waited."""
        restore, self._restore = self._restore, _rows(0)
        if len(restore):
            emitted.append(restore)  # already in the outbox with ack=True
            if not self._ack:
                self.emitted += len(restore)
        waiting, self._waiting = self._waiting, []
        if waiting:
            self._process(np.array(waiting, np.int64), False, emitted, skipped)

    def drain(self) -> list[tuple[Key, Any]]:
        """The end of a bounded stream: emit every record held, in random order."""
        return self._objects(self.drain_many())

    def drain_many(self) -> np.ndarray:
        """``drain``, as rows ``[partition id, offset, sub, item]``."""
        if self._holes:
            missing = sorted((self._parts[p], o, s) for p, o, s in self._holes)
            raise KfeedError(
                f"{len(self._holes)} records of the loaded state were never pushed again "
                f"(re-read every partition from resume_offsets()); first: {missing[:5]}"
            )
        out = _rows(self._n)
        if self._n:
            self._rng = _pack.reservoir_drain(self._rng, self._n, self._held, out)
            self._n = 0
            self._emit(out, [])
        return out

    def seek(self, partition: Hashable, offset: int, sub: int = 0) -> None:
        """Records of a partition not seen yet start at ``(offset, sub)``; those below are repeats."""
        p = self.pid(partition)
        if not self._known[p, 0]:
            self._pos[p] = (int(offset), int(sub), int(offset), int(sub))
            self._known[p] = (1, 1)

    def allow(self, partition: Hashable, read: tuple[int, int],
              keys: Iterable[tuple[int, int]]) -> None:
        """Below ``read``, only ``keys`` of ``partition`` are still to come; after ``seek``.

        What another reader noted in its commit (NOTE [ Commit notes ] in
        ``kfeed/loader/ledger.py``): it delivered every record of the
        partition from the committed position up to ``read`` but ``keys``.
        The others are skipped as repeats when they are pushed again.
        """
        p = self.pid(partition)
        self._allow[p] = (int(read[0]), int(read[1]), {(int(o), int(s)) for o, s in keys})

    def noted(self) -> dict[Hashable, tuple[int, int]]:
        """The partitions ``allow`` still screens, each with the read position of its note."""
        return {self._parts[p]: (ro, rs) for p, (ro, rs, _keys) in self._allow.items()}

    def screen(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``[partition id, offset, sub, item]`` less those ``allow`` skips; their items.

        Only records past the partition's read position are screened: below
        it, the buffer itself tells repeats from a loaded state's records.
        The note stays until the buffer's own reading passes its read
        position (``push_many``), so rows screened twice (a mixture screens
        them before its queues) get the same answer.
        """
        if not self._allow or not len(records):
            return records, np.empty(0, np.int64)
        keep = np.ones(len(records), np.bool_)
        pids = records[:, 0]
        o, s = records[:, 1], records[:, 2]
        for p, (ro, rs, keys) in list(self._allow.items()):
            mine = pids == p
            if not mine.any():
                continue
            below = mine & ((o < ro) | ((o == ro) & (s < rs)))
            if self._known[p, 0]:
                po, ps = int(self._pos[p, 0]), int(self._pos[p, 1])
                below &= (o > po) | ((o == po) & (s >= ps))
            for i in np.flatnonzero(below).tolist():
                keep[i] = (int(o[i]), int(s[i])) in keys
        if keep.all():
            return records, np.empty(0, np.int64)
        self.skipped += int((~keep).sum())
        return records[keep], records[~keep, 3].copy()

    def rest(self, *, used: bool = False, most: int | None = None
             ) -> dict[Hashable, tuple[tuple[int, int], np.ndarray | None]]:
        """Per partition: where its reading got to, and the keys ``[offset, sub]`` below that
        were not delivered (held, emitted but not acknowledged or, with ``used``, not used),
        in order. Every other record between ``watermarks(used=used)`` and that position was.
        A partition with more than ``most`` such keys gets None for them.
        """
        k = len(self._parts)
        rows = _joined([self._held[:self._n], *self._unacked(used)])
        counts = np.bincount(rows[:, 0], minlength=k)
        if most is not None and (counts > most).any():  # those are not sorted
            rows = rows[counts[rows[:, 0]] <= most]
        if len(rows) > 1:  # one sort for every partition, then each one's slice
            rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
        bounds = np.searchsorted(rows[:, 0], np.arange(k + 1)).tolist()
        out: dict[Hashable, tuple[tuple[int, int], np.ndarray | None]] = {}
        for p in range(k):
            if not self._known[p, 0]:
                continue
            read = (int(self._pos[p, 0]), int(self._pos[p, 1]))
            keys: np.ndarray | None = rows[bounds[p]:bounds[p + 1], 1:3]
            note = self._allow.get(p)
            if note is not None:  # keys of the note not read yet are not delivered either
                later = sorted(key for key in note[2] if key >= read)
                if later:
                    keys = np.concatenate([keys, np.array(later, np.int64)])
                read = max(read, note[:2])
            if most is not None and counts[p] > most:
                keys = None
            out[self._parts[p]] = (read, keys)
        return out

    def first_unacked(self, *, used: bool = False) -> Key | None:
        """The first record emitted and not acknowledged (``used``: not used), if any."""
        for rows in self._unacked(used):
            if len(rows):
                return self._key(rows[0])
        return None

    def ack(self, n: int = 1) -> None:
        """The next ``n`` records emitted are used (``ack=True``)."""
        if not self._ack:
            raise ConfigError("ack() needs ShuffleBuffer(..., ack=True)")
        waiting = self._outbox.end - self._acked
        if not _is_int(n) or not 0 <= n <= waiting:
            raise ConfigError(f"ack({n!r}): {waiting} records are waiting for one")
        self._acked += int(n)
        self.emitted += int(n)
        self._outbox.drop_before(self._used if self._track_used else self._acked)

    def mark_used(self) -> None:
        """What was acknowledged so far is used (``track_used``): see ``watermarks(used=True)``."""
        self._used = self._acked
        self._outbox.drop_before(self._used)

    @property
    def unused(self) -> int:
        """Records acknowledged and not marked used yet (``track_used``)."""
        return self._acked - self._used if self._track_used else 0

    def __len__(self) -> int:
        """Records held (holes of a loaded state included) or waiting."""
        return self._n + len(self._waiting)

    @property
    def restoring(self) -> bool:
        """Whether records of a loaded state are still to be pushed again."""
        return bool(self._holes)

    def arrived(self) -> tuple[np.ndarray, np.ndarray]:
        """Per partition id, ``[offset, sub]`` after the last record pushed, and whether known.

        A record below it is a repeat, or a held record of a loaded state
        coming back (``kfeed.mix.Mixer.push`` passes those straight on).
        """
        k = len(self._parts)
        return self._pos[:k, 2:4], self._known[:k, 1]

    # -- the items, for a caller that moves its stored records ------------------

    def items(self) -> np.ndarray:
        """Every item the buffer holds (held, waiting, or to be replayed); holes left out."""
        parts = [self._held[:self._n, 3], self._restore[:, 3],
                 np.array([w[3] for w in self._waiting], np.int64)]
        out = np.concatenate(parts)
        return out[out >= 0]

    def remap(self, table: np.ndarray) -> None:
        """Replace every item ``i`` the buffer holds by ``table[i]``."""
        for a in (self._held[:self._n, 3], self._restore[:, 3]):
            mask = a >= 0
            a[mask] = table[a[mask]]
        self._waiting = [(p, o, s, int(table[i])) for p, o, s, i in self._waiting]

    # -- state -----------------------------------------------------------------

    def _unacked(self, used: bool = False) -> list[np.ndarray]:
        if self._ack:
            return self._outbox.since(self._used if used else self._acked)
        return [self._restore]

    def watermarks(self, *, used: bool = False) -> dict[Hashable, tuple[int, int]]:
        """Per partition, the ``(offset, sub)`` below which every record was emitted.

        ``used=True`` (``track_used``): below which every record was emitted
        and acknowledged before the last ``mark_used()``.
        """
        k = len(self._parts)
        marks = self._pos[:k, :2].copy()
        known = self._known[:k, 0].copy()
        for rows in [self._held[:self._n]] + self._unacked(used):
            if len(rows):
                _pack.key_minima(rows, marks, known)
        return {self._parts[p]: (int(o), int(s))
                for p, (o, s) in enumerate(marks.tolist()) if known[p]}

    def resume_offsets(self) -> dict[Hashable, int]:
        """Per partition, the offset to re-read from after a resume."""
        return {p: o for p, (o, _s) in self.watermarks().items()}

    def _keys(self, rows: list[np.ndarray]) -> list[list[Any]]:
        parts = self._parts
        return [[parts[p], o, s] for r in rows for p, o, s, _ in r.tolist()]

    def state(self) -> dict[str, Any]:
        """A small, JSON-friendly description of where the shuffle stands."""
        marks = self.watermarks()
        read = {self._parts[p]: (int(o), int(s))
                for p, (o, s) in enumerate(self._pos[:len(self._parts), :2].tolist())
                if self._known[p, 0]}
        state = {
            "version": _STATE_VERSION,
            "buffer": self._size,
            "seed": self.shuffle.seed,
            "rng": self._rng,
            "emitted": self.emitted,
            "partitions": [[p, list(marks[p]), list(read.get(p, marks[p]))] for p in marks],
            "held": self._keys([self._held[:self._n]]),
            "outbox": self._keys(self._unacked()),
        }
        if self._allow:  # partitions taken over from a commit's note
            state["allow"] = self._allow_state()
        return state

    def _allow_state(self) -> list[list[Any]]:
        out = []
        for p, (ro, rs, keys) in sorted(self._allow.items()):
            read = (int(self._pos[p, 0]), int(self._pos[p, 1]))
            out.append([self._parts[p], [ro, rs],
                        sorted([o, s] for o, s in keys if (o, s) >= read)])
        return out

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state()``; before the first push."""
        if self._touched:
            raise ConfigError("load_state must come before the first push")
        try:
            version, size, seed = state["version"], state["buffer"], state["seed"]
            rng, emitted = int(state["rng"]), _position(state["emitted"])
            parts = [(_as_partition(p), _key(w), _key(r)) for p, w, r in state["partitions"]]
            held = [(_as_partition(p), _position(o), _position(s)) for p, o, s in state["held"]]
            outbox = [(_as_partition(p), _position(o), _position(s))
                      for p, o, s in state["outbox"]]
            allow = [(_as_partition(p), _key(r), [_key(k) for k in keys])
                     for p, r, keys in state.get("allow", ())]
            read = dict((p, r) for p, _w, r in parts)
            # A record held or to hand out again was read: its partition is in
            # the state, and it lies before where that partition was read to.
            # (Past it, the buffer waited for a record that never comes back.)
            unread = [[p, o, sub] for p, o, sub in held + outbox  # (partitions must hash)
                      if p not in read or (o, sub) >= read[p]]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ConfigError(f"not a shuffle state: {e!r}") from None
        if unread:
            p = unread[0][0]
            raise ConfigError(f"not a shuffle state: record {unread[0]} is " + (
                f"past where its partition was read to, {list(read[p])}" if p in read
                else "of a partition it does not list"))
        if version != _STATE_VERSION:
            raise ConfigError(f"shuffle state version {version!r}, expected {_STATE_VERSION}")
        if (size, seed) != (self._size, self.shuffle.seed):
            def name(size: int, seed: int) -> str:
                return f"Shuffle(buffer={size}, seed={seed})" if size else "no shuffle"

            raise ConfigError(f"the state was saved with {name(size, seed)}, this is "
                              f"{name(self._size, self.shuffle.seed)}")
        if len(held) > self._size or len(set(held) | set(outbox)) != len(held) + len(outbox):
            raise ConfigError("not a shuffle state: held records repeat or overflow the buffer")
        self._rng = rng & _MASK64
        self.emitted = emitted
        for p, _w, (o, s) in parts:
            i = self.pid(p)
            self._pos[i] = (o, s, o, s)
            self._known[i] = (1, 1)
        for p, read, keys in allow:
            self.allow(p, read, keys)
        held_rows = [(self.pid(p), o, s, _HOLE) for p, o, s in held]
        out_rows = [(self.pid(p), o, s, _HOLE) for p, o, s in outbox]
        if held_rows:
            self._held[:len(held_rows)] = held_rows
        self._n = len(held_rows)
        self._holes = {r[:3]: j for j, r in enumerate(held_rows)}
        self._restore = np.array(out_rows, np.int64).reshape(-1, 4)
        self._holes.update({r[:3]: -1 - i for i, r in enumerate(out_rows)})
        if self._ack:
            self._outbox.append(self._restore.copy())
        self._touched = True

    @staticmethod
    def without(state: Mapping[str, Any], partitions: set[Hashable]) -> dict[str, Any]:
        """``state`` with ``partitions`` left out: what a member keeps when they are revoked.

        Their held and unacknowledged records go to the partitions' new owner,
        which reads them again from the committed watermark.
        """
        def keep(p: Any) -> bool:
            return _as_partition(p) not in partitions

        out = dict(state)
        out["partitions"] = [e for e in state["partitions"] if keep(e[0])]
        out["held"] = [k for k in state["held"] if keep(k[0])]
        out["outbox"] = [k for k in state["outbox"] if keep(k[0])]
        if "allow" in state:
            out["allow"] = [e for e in state["allow"] if keep(e[0])]
        return out

    def __repr__(self) -> str:
        return (f"ShuffleBuffer({self.shuffle!r}, held={self._n}, "
                f"emitted={self.emitted}, restoring={self.restoring})")


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _rows(0)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
