from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

REASONS: dict[int, str]

class Layout:
    nfields: int
    record_size: int
    fingerprint: int
    names: tuple[str, ...]
    def __init__(
        self, row_bytes: Sequence[int], fingerprint: int, names: Sequence[str] | None = None
    ) -> None: ...
    def block_nbytes(self, count: int) -> int: ...

class Out:
    capacity: int
    nfields: int
    def __init__(self, layout: Layout, buffers: Iterable[Buffer]) -> None: ...
    @property
    def addresses(self) -> tuple[int, ...]: ...

def decode(
    layout: Layout,
    values: Iterable[object],
    out: Out,
    row: int,
    block: bool,
    start: int,
    split: bool,
) -> tuple[int, int, int, list[tuple[int, str]]]: ...
def decode_counted(
    layout: Layout,
    values: Iterable[object],
    out: Out,
    row: int,
    block: bool,
    start: int,
    split: bool,
    counts: npt.NDArray[np.int64],
) -> tuple[int, int, int, list[tuple[int, str]]]: ...
def gather(
    layout: Layout, src: Out, rows: npt.NDArray[np.int64], dst: Out, row: int
) -> None: ...

class Held:
    limit: int
    values: int
    records: int
    nbytes: int
    compacted: int
    def __init__(self, layout: Layout, block: bool, limit: int = 0) -> None: ...
    def add(
        self,
        values: Iterable[object],
        pids: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], list[tuple[int, str]]]: ...
    def gather(self, items: npt.NDArray[np.int64], dst: Out, row: int) -> None: ...
    def drop(self, items: npt.NDArray[np.int64]) -> None: ...
    def clear(self) -> None: ...

def encode_blocks(
    layout: Layout, columns: list[Buffer], n: int, block_records: int
) -> list[bytes]: ...
def empty_block(layout: Layout) -> bytes: ...
def encode_raw(layout: Layout, columns: list[Buffer], n: int) -> list[bytes]: ...

DOC_REASONS: dict[int, str]

class DocLayout:
    nfields: int
    varlen: int
    itemsize: int
    fixed_size: int
    fingerprint: int
    names: tuple[str, ...]
    def __init__(
        self,
        row_bytes: Sequence[int],
        varlen: int,
        itemsize: int,
        fingerprint: int,
        names: Sequence[str] | None = None,
    ) -> None: ...
    def block_nbytes(self, count: int, elements: int) -> int: ...

def decode_documents(
    layout: DocLayout, values: Iterable[object], block: bool, start: int
) -> tuple[
    npt.NDArray[np.uint8],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    list[npt.NDArray[np.uint8] | None],
    list[tuple[int, str]],
]: ...
def encode_doc_blocks(
    layout: DocLayout,
    columns: list[Buffer],
    offsets: npt.NDArray[np.int64],
    n: int,
    block_records: int,
    block_bytes: int,
) -> list[bytes]: ...
def encode_doc_raw(
    layout: DocLayout, elements: Buffer, offsets: npt.NDArray[np.int64], n: int
) -> list[bytes]: ...

# -- formats others write (_avro.pxi, _protobuf.pxi, _json.pxi) ---------------------

AVRO_CODES: dict[str, int]
AVRO_KINDS: dict[str, int]
PB_KINDS: dict[str, int]

class AvroPlan:
    notes: tuple[str, ...]
    nfields: int
    def __init__(
        self,
        layout: Layout,
        nodes: npt.NDArray[np.int64],
        kids: npt.NDArray[np.int64],
        codes: list[int],
        defaults: list[bytes | None],
        notes: list[str],
    ) -> None: ...

class ProtobufPlan:
    notes: tuple[str, ...]
    nfields: int
    def __init__(
        self,
        layout: Layout,
        entries: npt.NDArray[np.int64],
        msgs: npt.NDArray[np.int64],
        codes: list[int],
        defaults: list[bytes | None],
        notes: list[str],
        varfield: int = -1,
        clears: npt.NDArray[np.int64] | None = None,
    ) -> None: ...

class JsonPlan:
    notes: tuple[str, ...]
    nfields: int
    def __init__(
        self,
        layout: Layout,
        nodes: npt.NDArray[np.int64],
        keys: npt.NDArray[np.int64],
        names: bytes,
        codes: list[int],
        shapes: list[tuple[int, ...]],
        defaults: list[bytes | None],
        notes: list[str],
    ) -> None: ...

def avro_decode(
    layout: Layout, plans: AvroPlan | dict[int, AvroPlan | str], values: Sequence[object],
    out: Out, row: int, framed: bool,
) -> tuple[int, int, list[tuple[int, str]], int | None]: ...
def pb_decode(
    layout: Layout, plan: ProtobufPlan, values: Sequence[object], out: Out, row: int,
    framed: bool,
) -> tuple[int, int, list[tuple[int, str]]]: ...
def json_decode(
    layout: Layout, plan: JsonPlan, values: Sequence[object], out: Out, row: int
) -> tuple[int, int, list[tuple[int, str]]]: ...
