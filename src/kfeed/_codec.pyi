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
