from collections.abc import Iterable
from typing import Any

CODES: dict[str, int]
OUT_CODES: dict[str, int]

def address(obj: Any) -> int: ...
def offsets(lengths: Any) -> tuple[Any, int, int]: ...

class Outputs:
    rows: int
    seq_len: int
    def __init__(
        self,
        rows: int,
        seq_len: int,
        tok_ptr: int,
        tok_code: int,
        pos_ptr: int,
        pos_code: int,
        doc_ptr: int,
        doc_code: int,
        cu_ptr: int,
        cu_cap: int,
    ) -> None: ...

class Core:
    def __init__(
        self, seq_len: int, has_eos: bool, eos: int, pad: int, split_long: bool
    ) -> None: ...
    def batch(
        self,
        out: Outputs,
        chunks: Iterable[tuple[Any, Any, int, int, int]],
        src_code: int,
        doc: int,
        off: int,
        finished: bool,
    ) -> tuple[int, int, int, int, int, int, int, int, int] | None: ...
