CODES: dict[str, int]
OUT_CODES: dict[str, int]

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
    rows: int
    segments: int
    max_seqlen: int
    tokens: int
    truncated: int
    documents: int
    def __init__(
        self, seq_len: int, has_eos: bool, eos: int, pad: int, split_long: bool
    ) -> None: ...
    def start(self) -> None: ...
    def run(
        self,
        out: Outputs,
        src: int,
        src_code: int,
        offsets_ptr: int,
        ndocs: int,
        doc: int,
        off: int,
        final: bool,
    ) -> tuple[bool, int, int]: ...
