"""Corpora into token documents: the first stage of an LLM token stream.

In the data flow this sits before the producer::

    corpus file (.txt, .jsonl, .parquet, .npy)  --read_corpus-->  chunks of
    documents (text, or token ids already)      --Tokenizer---->  a list of
    1-D token arrays per chunk                   --Producer.send->  a topic
    whose schema has one variable-length field, ``{"tokens": (dtype, (None,))}``

The loader then packs those documents into ``[batch, seq_len]`` rows
(``kfeed.Pack``). Files are read in chunks of documents, so memory stays
bounded by a chunk, not by the corpus; but for an object ``.npy``, which
numpy loads whole (a flat ``.npy`` with ``lengths`` is memory-mapped: the
form for large corpora).

Corpus forms:

- ``.txt``: UTF-8 text; documents are separated by one or more blank lines
  (a paragraph is a document; a line of only whitespace is blank too, so a
  document that holds blank lines, as code does, goes in ``.jsonl``); the
  line breaks inside a document are kept, a byte order mark at the start is
  not text.
- ``.jsonl``: one JSON object per line; the text is in ``text_field``, the
  optional key in ``key_field``. Blank lines are skipped.
- ``.parquet``: ``text_field`` is a string column (text) or a list-of-ints
  column (token ids, already tokenized); ``key_field`` an optional column.
- ``.npy``: token ids already: an object array of 1-D int arrays (a pickle:
  load only files you trust), or a 1-D int array of every document's tokens
  concatenated, with ``lengths`` (a 1-D int ``.npy``, one length per document).

Tokenizers: ``ByteTokenizer`` (UTF-8 bytes as ids 0..255, EOS 256, vocab
257), or a ``tokenizer.json`` read with the ``tokenizers`` package
(``HFTokenizer``), which is imported only then and never downloads anything.
No tokenizer adds an EOS: the packer appends ``eos_id`` after each document.
Nor does a document's text ever become a special token: a literal ``</s>``
in the text is encoded as the characters it is, so the EOS id marks the ends
of documents and nothing else.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from kfeed.errors import ConfigError, KfeedError, first_line

__all__ = [
    "BYTE_EOS_ID",
    "BYTE_VOCAB",
    "ByteTokenizer",
    "Chunk",
    "CorpusError",
    "HFTokenizer",
    "Tokenizer",
    "TOKEN_DTYPES",
    "as_token_arrays",
    "load_tokenizer",
    "locate_document",
    "read_corpus",
    "synthetic_documents",
    "token_schema",
]

BYTE_EOS_ID = 256
BYTE_VOCAB = 257
TOKEN_DTYPES = ("uint16", "int32", "uint32")
SUFFIXES = (".txt", ".jsonl", ".parquet", ".npy")


class CorpusError(KfeedError):
    """A corpus file cannot be read: it names the file and, where known, the line or row."""


def token_schema(dtype: str = "uint16") -> Any:
    """The schema of a token topic: one variable-length field ``tokens``."""
    from kfeed.schema import Schema

    if dtype not in TOKEN_DTYPES:
        raise KfeedError(f"token dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    return Schema({"tokens": (dtype, (None,))})


# -- tokenizers ------------------------------------------------------------------


class Tokenizer(Protocol):
    """Texts to token ids; ``eos_id`` is None when the tokenizer names none."""

    name: str
    vocab_size: int
    eos_id: int | None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Any) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; id 256 is the EOS the packer appends (vocab 257)."""

    name = "bytes"
    vocab_size = BYTE_VOCAB
    eos_id: int | None = BYTE_EOS_ID

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Any) -> str:
        arr = np.asarray(ids)
        arr = arr[arr != BYTE_EOS_ID]
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise KfeedError("byte token ids must be in 0..256")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# Names that tokenizer.json files commonly give their end-of-document token.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class HFTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` package; special tokens not added.

    Special tokens' strings in a text are encoded as plain text (``</s>`` in
    an HTML document is ``<``, ``/``, ``s``, ``>``): a document never holds
    the EOS id, or any other special id, from its text.
    """

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise KfeedError(
                f"reading {path} needs the tokenizers package: pip install tokenizers "
                "(or use --tokenizer bytes)"
            ) from None
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"no tokenizer file at {path}: give a tokenizer.json (or its "
                              f"folder), or --tokenizer bytes")
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises its own exception type
            raise ConfigError(f"cannot read tokenizer {path}: {e}: give a tokenizer.json that "
                              f"the tokenizers package wrote (Tokenizer.save), or --tokenizer "
                              f"bytes") from e
        self.name = str(path)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = next((i for i in map(self._tok.token_to_id, _EOS_NAMES) if i is not None),
                           None)
        # A special token's string in a document is its text, not the token: a
        # literal "</s>" must not end the document early (tokenizers >= 0.15.1).
        self._tok.encode_special_tokens = True
        # A saved file may carry a model's padding or truncation: a document is
        # its whole text, never cut to a length or padded with a pad id.
        self._tok.no_truncation()
        self._tok.no_padding()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int64) for e in encodings]

    def decode(self, ids: Any) -> str:
        return str(self._tok.decode([int(i) for i in np.asarray(ids)], skip_special_tokens=False))


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"bytes"``, or the path of a ``tokenizer.json`` (or of a folder holding one)."""
    if spec == "bytes":
        return ByteTokenizer()
    return HFTokenizer(spec)


def check_vocab_fits(tokenizer: Tokenizer, dtype: str) -> None:
    """Refuse a tokenizer some of whose ids ``dtype`` cannot hold, before anything is sent:
    found only at the first document that uses one, the topic would already hold blocks
    of the narrower dtype."""
    top = int(np.iinfo(dtype).max)
    if tokenizer.vocab_size - 1 > top:
        raise ConfigError(f"the tokenizer {tokenizer.name} has {tokenizer.vocab_size:,} ids, "
                          f"more than {dtype} holds (0..{top:,}): give --token-dtype uint32, "
                          f"and the same one for training")


def as_token_arrays(docs: Sequence[Any], dtype: str, *, vocab: Any = None,
                    place: Callable[[int], str] | None = None) -> list[np.ndarray]:
    """Documents of ids as 1-D arrays of ``dtype``, every id checked to fit, and to be
    in ``vocab`` (a tokenizer: ids made by it) when given.

    ``place(i)`` names document ``i`` in an error (default: its number in
    ``docs``), e.g. its line in the corpus.
    """
    info = np.iinfo(dtype)
    name = place or (lambda i: f"document {i}")
    out = []
    for i, d in enumerate(docs):
        arr = np.asarray(d)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise KfeedError(f"{name(i)}: token ids must be a 1-D int array, "
                             f"got {arr.dtype} {arr.shape}")
        low, top = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
        if low < 0:
            raise KfeedError(f"{name(i)}: token id {low} is negative; token ids are >= 0")
        if top > info.max:
            raise KfeedError(f"{name(i)}: token ids {low}..{top} do not fit {dtype}; pick a "
                             f"wider --token-dtype (and the same one for training)")
        if vocab is not None and top >= vocab.vocab_size:
            raise KfeedError(f"{name(i)}: token id {top} is outside the vocabulary of "
                             f"{vocab.name} ({vocab.vocab_size} ids): give the --tokenizer "
                             f"the ids were made with")
        out.append(arr.astype(dtype, copy=False))
    return out


# -- corpus readers --------------------------------------------------------------


class Chunk(NamedTuple):
    """Some documents of a corpus, in file order.

    texts: the documents as text, or None when they are token ids already
    (then ``ids`` holds them). keys: one per document (``key_field``), or
    None. done / total: how far the file is read, in bytes or rows, for
    progress.
    """

    texts: list[str] | None
    ids: list[np.ndarray] | None
    keys: list[Any] | None
    done: int
    total: int

    def __len__(self) -> int:
        return len(self.texts if self.texts is not None else self.ids or [])


def read_corpus(
    path: str | Path,
    *,
    text_field: str = "text",
    key_field: str | None = None,
    lengths: str | Path | None = None,
    chunk_docs: int = 1024,
) -> Iterator[Chunk]:
    """The documents of a corpus file, ``chunk_docs`` at a time (see the module docstring)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise CorpusError(f"{path}: a corpus is {', '.join(SUFFIXES)}, got "
                          f"{path.suffix or 'no suffix'!r}: write the documents as one of "
                          f"those, or send a file of samples without --tokenizer, --text-field "
                          f"and --lengths, its columns named with --field")
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    if chunk_docs <= 0:
        raise KfeedError(f"chunk_docs must be positive, got {chunk_docs}")
    if lengths is not None and suffix != ".npy":
        raise ConfigError(f"{path}: lengths apply to a flat .npy only: leave them out")
    if key_field is not None and suffix in (".txt", ".npy"):
        raise ConfigError(f"{path}: a {suffix} corpus has no fields, so no key field: leave "
                          f"it out")
    if suffix == ".txt":
        return _read_txt(path, chunk_docs)
    if suffix == ".jsonl":
        return _read_jsonl(path, text_field, key_field, chunk_docs)
    if suffix == ".parquet":
        return _read_parquet(path, text_field, key_field, chunk_docs)
    return _read_npy(path, lengths, chunk_docs)


def locate_document(path: str | Path, index: int) -> str:
    """Where document ``index`` (from 0, in file order) of a corpus is, for an error.

    ``FILE:LINE`` (its first line) for a .txt or .jsonl, ``FILE: row R`` for
    a .parquet, ``FILE: document I`` for a .npy. The file is read again up to
    that document: for errors, not for every document.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    lines: Iterator[int] | None = None
    if suffix == ".txt":
        lines = (first for first, _text, _done in _txt_documents(path))
    elif suffix == ".jsonl":
        lines = (lineno for lineno, _raw, _done in _jsonl_lines(path))
    if lines is None:
        return f"{path}: {'row' if suffix == '.parquet' else 'document'} {index}"
    for i, line in enumerate(lines):
        if i == index:
            return f"{path}:{line}"
    return f"{path}: document {index}"


def _txt_documents(path: Path) -> Iterator[tuple[int, str, int]]:
    """Each document of a .txt corpus: its first line, its text, the bytes read so far."""
    done = 0
    para: list[str] = []
    first = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            done += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CorpusError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start}): "
                                  f"convert the file to UTF-8") from None
            if lineno == 1 and line.startswith("\ufeff"):
                line = line[1:]  # a byte order mark (as .jsonl lines lose theirs)
            if line.strip():
                if not para:
                    first = lineno
                para.append(line)
                continue
            if para:
                yield first, "".join(para).rstrip("\r\n"), done
                para = []
    if para:
        yield first, "".join(para).rstrip("\r\n"), done


def _read_txt(path: Path, chunk_docs: int) -> Iterator[Chunk]:
    total = path.stat().st_size
    texts: list[str] = []
    for _first, text, done in _txt_documents(path):
        texts.append(text)
        if len(texts) >= chunk_docs:
            yield Chunk(texts, None, None, done, total)
            texts = []
    if texts:
        yield Chunk(texts, None, None, total, total)


def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes, int]]:
    """Each line of a .jsonl corpus that is not blank: its number, its bytes, the bytes read."""
    done = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            done += len(raw)
            if raw.strip():
                yield lineno, raw, done


# A JSON escape of a UTF-16 surrogate: a pair is one character, a lone one is no text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _read_jsonl(path: Path, text_field: str, key_field: str | None,
                chunk_docs: int) -> Iterator[Chunk]:
    total = path.stat().st_size
    texts: list[str] = []
    keys: list[Any] = []
    for lineno, raw, done in _jsonl_lines(path):
        where = f"{path}:{lineno}"
        try:
            # Decoded here, strictly: json.loads takes the bytes of a lone
            # surrogate (ED A0 80), which are no UTF-8, into a str that cannot
            # be encoded again.
            obj = json.loads(raw.decode("utf-8").removeprefix("\ufeff"))
        except UnicodeDecodeError as e:
            raise CorpusError(f"{where}: not UTF-8 ({e.reason} at byte {e.start}): convert "
                              f"the file to UTF-8") from None
        except json.JSONDecodeError as e:
            raise CorpusError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise CorpusError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if text_field not in obj:
            raise CorpusError(f"{where}: no field {text_field!r} (fields: {sorted(obj)[:8]}): "
                              f"name the text's field (--text-field FIELD)")
        text = obj[text_field]
        if not isinstance(text, str):
            raise CorpusError(f"{where}: field {text_field!r} must be a string, "
                              f"got {type(text).__name__}: give the text as a JSON string, or "
                              f"name the text's field (--text-field FIELD)")
        key = _key(obj.get(key_field), key_field, where) if key_field is not None else None
        if _SURROGATE_ESCAPE.search(raw):
            for name, value in ((text_field, text), (key_field, key)):
                _check_surrogates(value, name, where)
        texts.append(text)
        if key_field is not None:
            keys.append(key)
        if len(texts) >= chunk_docs:
            yield Chunk(texts, None, keys if key_field else None, done, total)
            texts, keys = [], []
    if texts:
        yield Chunk(texts, None, keys if key_field else None, total, total)


def _check_surrogates(value: Any, field: str | None, where: str) -> None:
    if not isinstance(value, str):
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start]
        raise CorpusError(f"{where}: field {field!r} holds a lone surrogate "
                          f"(\\u{ord(bad):04x}), half of a UTF-16 pair, which is no text UTF-8 "
                          f"can carry: fix the line") from None


def _key(value: Any, key_field: str, where: str) -> str | int:
    if isinstance(value, bool) or value is None or not isinstance(value, (str, int)):
        got = "nothing" if value is None else type(value).__name__
        raise CorpusError(f"{where}: key field {key_field!r} must be a string or an int, got {got}")
    return value


def _read_parquet(path: Path, text_field: str, key_field: str | None,
                  chunk_docs: int) -> Iterator[Chunk]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: not a Parquet file ({e})") from None
    names = pf.schema_arrow.names
    for field in (text_field, key_field):
        if field is not None and field not in names:
            raise CorpusError(f"{path}: no column {field!r} (columns: {names})")
    kind = pf.schema_arrow.field(text_field).type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        as_text = True
    elif (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and \
            pa.types.is_integer(kind.value_type):
        as_text = False
    else:
        raise CorpusError(f"{path}: column {text_field!r} must hold strings (text) or lists of "
                          f"ints (token ids), got {kind}: name such a column with --text-field, "
                          f"or send the file as samples, without --text-field, its columns "
                          f"named with --field")
    total = pf.metadata.num_rows
    row = 0
    columns = [text_field] + ([key_field] if key_field and key_field != text_field else [])
    for batch in pf.iter_batches(batch_size=chunk_docs, columns=columns):
        col = batch.column(text_field)
        if col.null_count:
            first = row + int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise CorpusError(f"{path}: row {first}: column {text_field!r} is null")
        keys = None
        if key_field is not None:
            where = f"{path}: rows {row}..{row + len(batch) - 1}"
            keys = [_key(k, key_field, where) for k in batch.column(key_field).to_pylist()]
        if as_text:
            yield Chunk(col.to_pylist(), None, keys, row + len(batch), total)
        else:
            offsets = col.offsets.to_numpy()
            values = col.values.to_numpy(zero_copy_only=False)
            if offsets[0] or len(values) != offsets[-1]:  # a sliced array: rebase
                values = values[offsets[0]:offsets[-1]]
                offsets = offsets - offsets[0]
            if len(values) and col.values.null_count:
                raise CorpusError(f"{path}: rows {row}..: column {text_field!r} holds null ids")
            ids = [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
            yield Chunk(None, ids, keys, row + len(batch), total)
        row += len(batch)


def _read_npy(path: Path, lengths_path: str | Path | None, chunk_docs: int) -> Iterator[Chunk]:
    try:
        arr = np.load(path, mmap_mode="r")  # pickles refused here
    except ValueError:
        arr = None
    except OSError as e:
        raise CorpusError(f"{path}: not a .npy file ({e})") from None
    if arr is None:
        if lengths_path is not None:
            raise CorpusError(f"{path}: an object array holds its documents; drop the lengths")
        try:
            arr = np.load(path, allow_pickle=True)
        except Exception as e:
            raise CorpusError(f"{path}: not a .npy file ({e})") from None
        if arr.dtype != object or arr.ndim != 1:
            raise CorpusError(f"{path}: expected a 1-D object array of documents")
        total = len(arr)
        for i in range(0, total, chunk_docs):
            docs = [np.asarray(d) for d in arr[i:i + chunk_docs]]
            for j, d in enumerate(docs):
                if d.ndim != 1 or (d.size and d.dtype.kind not in "iu"):
                    raise CorpusError(f"{path}: document {i + j} must be a 1-D int array, "
                                      f"got {d.dtype} {d.shape}")
            yield Chunk(None, docs, None, min(i + chunk_docs, total), total)
        return
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise CorpusError(f"{path}: a flat .npy must be a 1-D int array (with lengths), "
                          f"got {arr.dtype} {arr.shape}")
    if lengths_path is None:
        raise CorpusError(f"{path}: a flat array of token ids needs --lengths FILE.npy "
                          "(one length per document)")
    if not Path(lengths_path).is_file():
        raise CorpusError(f"{lengths_path}: no such file of lengths")
    try:
        lengths = np.load(lengths_path)  # pickles refused: a lengths file is ints
    except (OSError, ValueError) as e:
        raise CorpusError(f"{lengths_path}: not a .npy file of lengths "
                          f"({first_line(e)})") from None
    if lengths.ndim != 1 or (lengths.size and lengths.dtype.kind not in "iu") or \
            (lengths.size and lengths.min() < 0):
        raise CorpusError(f"{lengths_path}: lengths must be a 1-D array of ints >= 0")
    if int(lengths.sum()) != len(arr):
        raise CorpusError(f"{lengths_path}: lengths add up to {int(lengths.sum())}, "
                          f"{path} holds {len(arr)} ids")
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = len(lengths)
    for i in range(0, total, chunk_docs):
        j = min(i + chunk_docs, total)
        # One read of the memory map per chunk; the documents are views of it.
        flat = np.array(arr[offsets[i]:offsets[j]])
        ids = [flat[a - offsets[i]:b - offsets[i]] for a, b in zip(offsets[i:j], offsets[i + 1:j + 1])]
        yield Chunk(None, ids, None, j, total)


# -- synthetic text --------------------------------------------------------------

_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will more can about said up out what some into them time only other new could "
    "than its over like after first also made two most may any these well where down water "
    "stream river data model train batch token partition broker offset log record topic "
    "signal light stone forest market city music history paper field system network memory "
    "engine garden window winter summer morning evening island bridge mountain valley road "
    "letter story number order answer question reason moment voice market school family "
    "small large early late quick slow bright dark simple careful open quiet strong gentle "
    "runs reads writes turns holds keeps moves grows falls builds finds brings carries "
    "because while although before through between across under above around without"
).split()
_MEDIAN_BYTES = 500
_SIGMA = 0.8  # log-normal spread: ~90% of documents between 135 and 1,850 bytes


def synthetic_documents(start: int, count: int, *, seed: int = 0) -> list[str]:
    """Documents ``start .. start + count - 1`` of a seeded synthetic corpus.

    Each document depends on ``(seed, index)`` alone, so any chunking gives
    the same corpus. Lengths are log-normal in bytes, median about 500;
    sentences of 4..18 words from a small built-in word list.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed must be an int >= 0, got {seed!r}")
    words = np.array(_WORDS)
    out = []
    for i in range(start, start + count):
        rng = np.random.default_rng([seed, i])
        target = max(16, min(20_000, int(_MEDIAN_BYTES * math.exp(_SIGMA * rng.standard_normal()))))
        parts: list[str] = []
        size = 0
        while size < target:
            n = int(rng.integers(4, 19))
            chosen = words[rng.integers(0, len(words), n)]
            sentence = " ".join(chosen.tolist()).capitalize() + "."
            parts.append(sentence)
            size += len(sentence) + 1
        out.append(" ".join(parts)[:target].rstrip())
    return out
