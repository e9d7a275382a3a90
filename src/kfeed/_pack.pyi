from collections.abc import Iterable

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

CODES: dict[str, int]
OUT_CODES: dict[str, int]

def offsets(lengths: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], int, int]: ...

class Chunk:
    code: int
    ndocs: int
    def __init__(self, tokens: Buffer, offsets: npt.NDArray[np.int64]) -> None: ...

class Outputs:
    rows: int
    seq_len: int
    def __init__(
        self,
        rows: int,
        seq_len: int,
        tokens: Buffer,
        position_ids: Buffer | None = None,
        doc_ids: Buffer | None = None,
        cu_seqlens: Buffer | None = None,
    ) -> None: ...

class Core:
    def __init__(
        self, seq_len: int, has_eos: bool, eos: int, pad: int, split_long: bool
    ) -> None: ...
    def batch(
        self,
        out: Outputs,
        chunks: Iterable[Chunk],
        doc: int,
        off: int,
        finished: bool,
    ) -> tuple[int, int, int, int, int, int, int, int, int] | None: ...

def records(
    pids: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    first_item: int,
) -> npt.NDArray[np.int64]: ...
def reservoir_push(
    rng: int,
    size: int,
    n: int,
    held: npt.NDArray[np.int64],
    parts: npt.NDArray[np.int64],
    known: npt.NDArray[np.uint8],
    recs: npt.NDArray[np.int64],
    check: bool,
    emitted: npt.NDArray[np.int64],
    skipped: npt.NDArray[np.int64],
) -> tuple[int, int, int, int]: ...
def reservoir_drain(
    rng: int, n: int, held: npt.NDArray[np.int64], emitted: npt.NDArray[np.int64]
) -> int: ...
def key_minima(
    keys: npt.NDArray[np.int64], marks: npt.NDArray[np.int64], known: npt.NDArray[np.uint8]
) -> None: ...

MIX_LIMIT: int
MIX_STALLED: int
MIX_EXHAUSTED: int
MIX_NONE: int

def mix_take(
    pool: npt.NDArray[np.int64],
    head: npt.NDArray[np.int64],
    end: npt.NDArray[np.int64],
    done: npt.NDArray[np.uint8],
    idle: npt.NDArray[np.uint8],
    ring: npt.NDArray[np.int64],
    ring_start: npt.NDArray[np.int64],
    ring_len: npt.NDArray[np.int64],
    rr: npt.NDArray[np.int64],
    weights: npt.NDArray[np.int64],
    credits: npt.NDArray[np.int64],
    live: npt.NDArray[np.uint8],
    limit: int,
    out: npt.NDArray[np.int64],
) -> tuple[int, int, int]: ...
def gather_documents(
    src: Buffer,
    starts: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    itemsize: int,
    out: Buffer,
    at: npt.NDArray[np.int64],
) -> None: ...
