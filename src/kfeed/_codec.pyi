from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

REASONS: dict[int, str]

class Layout:
    nfields: int
    record_size: int
    fingerprint: int
    def __init__(self, row_bytes: Sequence[int], fingerprint: int) -> None: ...
    def block_nbytes(self, count: int) -> int: ...

def decode(
    layout: Layout,
    values: Sequence[object],
    dst_ptrs: npt.NDArray[np.uint64],
    capacity: int,
    row: int,
    block: bool,
    start: int,
    split: bool,
) -> tuple[int, int, int, list[tuple[int, str]]]: ...
def encode_blocks(
    layout: Layout, columns: list[npt.NDArray[np.uint8]], n: int, block_records: int
) -> list[bytes]: ...
def encode_raw(layout: Layout, columns: list[npt.NDArray[np.uint8]], n: int) -> list[bytes]: ...

DOC_REASONS: dict[int, str]

class DocLayout:
    nfields: int
    varlen: int
    itemsize: int
    fixed_size: int
    fingerprint: int
    def __init__(
        self, row_bytes: Sequence[int], varlen: int, itemsize: int, fingerprint: int
    ) -> None: ...
    def block_nbytes(self, count: int, elements: int) -> int: ...

def decode_documents(
    layout: DocLayout, values: Sequence[object], block: bool, start: int
) -> tuple[
    npt.NDArray[np.uint8],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    list[npt.NDArray[np.uint8] | None],
    list[tuple[int, str]],
]: ...
def encode_doc_blocks(
    layout: DocLayout,
    columns: list[npt.NDArray[np.uint8]],
    offsets: npt.NDArray[np.int64],
    n: int,
    block_records: int,
    block_bytes: int,
) -> list[bytes]: ...
def encode_doc_raw(
    layout: DocLayout, elements: npt.NDArray[np.uint8], offsets: npt.NDArray[np.int64], n: int
) -> list[bytes]: ...
