"""Token streams: packing throughput and efficiency, and what compression buys on tokens.

Workload: 4,096 documents with log-normal lengths (median 500 tokens, sigma
1.0, so a mean of about 820 and a long tail), int32 token ids, packed into
batches of 8 x 2048 with an EOS after each document (``split_long=True``).
Every packer writes the same four outputs into preallocated arrays: tokens
(int64), position_ids (int64), doc_ids (int32) and cu_seqlens (int32).

- packing: ``kfeed.tokens.Packer`` (fed 256 documents at a time, as a loader
  feeds what one consume call decoded, and asked for batches after each
  feed) against two named baselines: a straightforward numpy packer (a
  Python loop over documents and row segments, numpy slice assignments) and
  a vectorized numpy packer (the whole stream at once, about ten numpy
  passes). Target: >= 10x the straightforward one.
- efficiency: real tokens / all token slots, ``split_long=True`` and
  ``False``. Target: >= 99% with ``split_long=True``.
- compression: zstd (the ``zstandard`` package) levels 1 and 3 on block
  messages of 64 documents, for two kinds of token data: Zipf-distributed
  ids (s = 1.0) over a 50,257-id vocabulary, drawn independently (no
  repeated phrases, so a lower bound for real BPE streams), stored as int32
  and as uint16; and byte-level tokens (UTF-8 bytes as int32 ids) of
  generated English-like text. Against blocks of 64 float32 feature vectors
  of 768 dimensions (standard normal). lz4 is measured only when the
  ``lz4`` package is installed.

``pytest --benchmark-only bench/test_pack.py`` runs the timed cases under
pytest-benchmark; ``python bench/test_pack.py`` prints the tables.
"""

from __future__ import annotations

import functools
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zstandard

from kfeed import Schema
from kfeed.tokens import Pack, Packer

sys.path.insert(0, str(Path(__file__).parent))
from test_micro import _info, machine, peak_traced  # noqa: E402

try:
    import lz4.frame as lz4frame
except ImportError:  # optional: measured only where installed
    lz4frame = None

DOCS = 4096
SEQ_LEN = 2048
BATCH = 8
EOS = 50_256
PAD = 0
FEED_DOCS = 256
VOCAB = 50_257
BLOCK_DOCS = 64
TARGETS = {"pack": 10.0, "efficiency": 0.99}


# -- workload ------------------------------------------------------------------


def doc_lengths(n: int = DOCS, median: float = 500, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(np.log(median), 1.0, n)).astype(np.int64)


def zipf_ids(n: int, seed: int = 1) -> np.ndarray:
    """Token ids with Zipf(1.0) frequencies over VOCAB, ranks mapped to random ids."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, VOCAB + 1)
    ranks = rng.choice(VOCAB, size=n, p=p / p.sum())
    return rng.permutation(VOCAB)[ranks].astype(np.int32)


def english_like_bytes(n: int, seed: int = 2) -> np.ndarray:
    """UTF-8 bytes of generated text: Zipf-distributed words, sentences, paragraphs."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    freq = 1.0 / np.arange(1, 27) ** 0.9
    words = ["".join(rng.choice(letters, size=int(rng.integers(1, 11)), p=freq / freq.sum()))
             for _ in range(8000)]
    p = 1.0 / np.arange(1, len(words) + 1)
    picks = rng.choice(len(words), size=n // 5, p=p / p.sum())
    out, sentence = [], 0
    for i, w in enumerate(picks):
        word = words[w]
        if sentence == 0:
            word = word.capitalize()
        sentence += 1
        if sentence > rng.integers(6, 20):
            word += "." if rng.random() < 0.9 else ","
            sentence = 0
            if rng.random() < 0.1:
                word += "\n\n"
        out.append(word)
    text = " ".join(out).encode()
    return np.frombuffer(text, np.uint8)[:n].astype(np.int32)


# -- the packers -------------------------------------------------------------------


def kfeed_pack(packer_args, flat, lengths, out, target, sink) -> int:
    packer = Packer(*packer_args)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = 0
    for a in range(0, len(lengths), FEED_DOCS):
        b = min(a + FEED_DOCS, len(lengths))
        # No copy: like the fresh arrays of decode_documents, nothing changes them.
        packer.feed(flat[offsets[a] : offsets[b]], lengths[a:b], copy=False)
        while (info := packer.next_batch(target)) is not None:
            tokens += info.tokens
            sink(out, info.rows, info.segments)
    packer.finish()
    while (info := packer.next_batch(target)) is not None:
        tokens += info.tokens
        sink(out, info.rows, info.segments)
    return tokens


_ARANGE = np.arange(SEQ_LEN, dtype=np.int64)


def straightforward_pack(flat, lengths, out, sink) -> int:
    """A Python loop over documents and row segments, numpy slice assignments."""
    tokens, pos, ids, cu = out["tokens"], out["position_ids"], out["doc_ids"], out["cu_seqlens"]
    L = SEQ_LEN
    r = c = nseg = doc_id = real = 0
    start = 0
    for n in lengths.tolist():
        unit = np.append(flat[start : start + n], EOS)
        start += n
        o = 0
        while o < len(unit):
            take = min(len(unit) - o, L - c)
            tokens[r, c : c + take] = unit[o : o + take]
            pos[r, c : c + take] = _ARANGE[:take]
            ids[r, c : c + take] = doc_id
            cu[nseg] = r * L + c
            nseg += 1
            c += take
            o += take
            real += take
            if c == L:
                r, c = r + 1, 0
                if r == BATCH:
                    cu[nseg] = BATCH * L
                    sink(out, BATCH, nseg)
                    r = nseg = 0
                    doc_id = -1 if o == len(unit) else 0
        doc_id += 1
    if r or c:
        if c:
            tokens[r, c:] = PAD
            pos[r, c:] = _ARANGE[: L - c]
            ids[r, c:] = -1
            cu[nseg] = r * L + c
            nseg += 1
            r += 1
        cu[nseg] = r * L
        sink(out, r, nseg)
    return real


def python_pack(flat, lengths, out, sink) -> int:
    """Python lists token by token (the way ``group_texts`` recipes chunk a stream),
    one numpy conversion per batch."""
    L, slots = SEQ_LEN, BATCH * SEQ_LEN
    toks: list[int] = []
    pos: list[int] = []
    ids: list[int] = []
    cu: list[int] = []
    doc_id = real = 0
    start = 0

    def flush(rows: int) -> None:
        n = rows * L
        out["tokens"][:rows] = np.array(toks[:n], np.int64).reshape(rows, L)
        out["position_ids"][:rows] = np.array(pos[:n], np.int64).reshape(rows, L)
        out["doc_ids"][:rows] = np.array(ids[:n], np.int32).reshape(rows, L)
        out["cu_seqlens"][: len(cu)] = cu
        out["cu_seqlens"][len(cu)] = n
        sink(out, rows, len(cu))

    for n in lengths.tolist():
        unit = flat[start : start + n].tolist()
        unit.append(EOS)
        start += n
        p = 0
        for i, t in enumerate(unit):
            if i == 0 or len(toks) % L == 0:
                cu.append(len(toks))
                p = 0
            toks.append(t)
            pos.append(p)
            ids.append(doc_id)
            p += 1
            real += 1
            if len(toks) == slots:
                flush(BATCH)
                toks, pos, ids, cu = [], [], [], []
                doc_id = -1 if i == len(unit) - 1 else 0
        doc_id += 1
    if toks:
        pad = -len(toks) % L
        if pad:
            cu.append(len(toks))
        toks += [PAD] * pad
        pos += list(range(pad))
        ids += [-1] * pad
        flush(len(toks) // L)
    return real


def vectorized_pack(flat, lengths, out, sink) -> int:
    """The whole stream at once in numpy passes, then one copy per batch."""
    L, slots = SEQ_LEN, BATCH * SEQ_LEN
    units = lengths + 1
    ends = np.cumsum(units)
    starts = ends - units
    total = int(ends[-1])
    size = -(-total // L) * L
    stream = np.full(size, PAD, np.int64)
    is_eos = np.zeros(total, bool)
    is_eos[ends - 1] = True
    stream[:total][is_eos] = EOS
    stream[:total][~is_eos] = flat
    seg = np.union1d(starts, np.arange(0, size, L))
    if total < size:
        seg = np.union1d(seg, [total])
    mark = np.zeros(size, np.int64)
    mark[seg] = seg
    pos = np.arange(size, dtype=np.int64) - np.maximum.accumulate(mark)
    first = np.zeros(size, np.int32)
    first[starts] = 1
    gid = np.cumsum(first, dtype=np.int32) - 1
    gid[total:] = -1
    for b in range(0, size, slots):
        e = min(b + slots, size)
        rows = (e - b) // L
        out["tokens"][:rows] = stream[b:e].reshape(rows, L)
        out["position_ids"][:rows] = pos[b:e].reshape(rows, L)
        ids = gid[b:e] - gid[b]
        ids[gid[b:e] < 0] = -1
        out["doc_ids"][:rows] = ids.reshape(rows, L)
        s = seg[(seg >= b) & (seg < e)] - b
        out["cu_seqlens"][: len(s)] = s
        out["cu_seqlens"][len(s)] = e - b
        sink(out, rows, len(s))
    return total


# -- compression -----------------------------------------------------------------


def token_blocks(schema: Schema, flat: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    return schema.encode_blocks({schema.varlen.name: (flat, lengths)}, BLOCK_DOCS)


def feature_blocks(n_records: int) -> list[bytes]:
    schema = Schema({"features": ("float32", (768,))})
    x = np.random.default_rng(3).standard_normal((n_records, 768), dtype=np.float32)
    return schema.encode_blocks({"features": x}, 64)


def codec_figures(name: str, blocks: list[bytes], compress, decompress, decode=None) -> dict:
    raw = sum(len(b) for b in blocks)
    packed = [compress(b) for b in blocks]
    for p, b in zip(packed, blocks):
        assert decompress(p) == b
    t_c = median_seconds(lambda: [compress(b) for b in blocks], 3)
    t_d = median_seconds(lambda: [decompress(p) for p in packed], 7)
    row = {
        "data": name,
        "raw": raw,
        "compressed": sum(len(p) for p in packed),
        "compress_s": t_c,
        "decompress_s": t_d,
        "blocks": len(blocks),
    }
    if decode is not None:
        row["decode_s"] = median_seconds(lambda: decode(blocks), 7)
    return row


# -- timing ------------------------------------------------------------------------


def interleaved(fns: list[Callable[[], object]], repeat: int) -> list[list[float]]:
    """Times of each function, run in turn ``repeat`` times, so that a change of
    load on a shared machine hits every contender alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return times


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Workload:
    def __init__(self, median: float = 500, docs: int = DOCS) -> None:
        self.lengths = doc_lengths(docs, median)
        self.flat = zipf_ids(int(self.lengths.sum()))
        self.pack = Pack(SEQ_LEN, eos_id=EOS, pad_id=PAD)
        self.out = Packer(self.pack, BATCH).empty()
        self.target = Packer(self.pack, BATCH).bind(self.out)

    def kfeed(self, sink=lambda *a: None) -> int:
        return kfeed_pack((self.pack, BATCH), self.flat, self.lengths, self.out, self.target, sink)

    def straightforward(self, sink=lambda *a: None) -> int:
        return straightforward_pack(self.flat, self.lengths, self.out, sink)

    def vectorized(self, sink=lambda *a: None) -> int:
        return vectorized_pack(self.flat, self.lengths, self.out, sink)

    def python(self, sink=lambda *a: None) -> int:
        return python_pack(self.flat, self.lengths, self.out, sink)


def collect(run) -> list[tuple]:
    got = []

    def sink(out, rows, nseg):
        got.append((rows, nseg, *(np.asarray(out[k]).copy() for k in
                                  ("tokens", "position_ids", "doc_ids", "cu_seqlens"))))

    run(sink)
    return got


def check(w: Workload) -> None:
    """The three packers write the same batches, so the timings compare like with like."""
    want = collect(w.kfeed)
    for other in (w.straightforward, w.vectorized, w.python):
        got = collect(other)
        assert len(got) == len(want)
        for g, k in zip(got, want):
            rows = k[0]
            assert g[:2] == k[:2]
            for a, b in zip(g[2:5], k[2:5]):
                np.testing.assert_array_equal(a[:rows], b[:rows])
            np.testing.assert_array_equal(g[5][: k[1] + 1], k[5][: k[1] + 1])


def efficiency(lengths: np.ndarray, flat: np.ndarray, split_long: bool) -> tuple[float, int]:
    packer = Packer(Pack(SEQ_LEN, eos_id=EOS, pad_id=PAD, split_long=split_long), BATCH)
    out = packer.empty()
    packer.feed(flat, lengths)
    packer.finish()
    while packer.next_batch(out) is not None:
        pass
    return packer.efficiency, packer.truncated


# -- pytest-benchmark --------------------------------------------------------------

@functools.cache
def _workload() -> Workload:
    w = Workload()
    check(w)
    return w


def test_pack(benchmark):
    w = _workload()
    _info(benchmark, "pack", tokens=int(w.lengths.sum() + len(w.lengths)), docs=DOCS,
          seq_len=SEQ_LEN, batch=BATCH, baseline="straightforward numpy packer",
          target=f">= {TARGETS['pack']}x")
    benchmark(w.kfeed)


def test_pack_baseline_numpy_segment_loop(benchmark):
    w = _workload()
    _info(benchmark, "pack", docs=DOCS)
    benchmark.pedantic(w.straightforward, rounds=5, iterations=1)


def test_pack_baseline_numpy_vectorized(benchmark):
    w = _workload()
    _info(benchmark, "pack", docs=DOCS)
    benchmark(w.vectorized)


def test_pack_baseline_python_lists(benchmark):
    w = _workload()
    _info(benchmark, "pack", docs=DOCS)
    benchmark.pedantic(w.python, rounds=2, iterations=1)


def test_zstd_decode_token_block(benchmark):
    w = _workload()
    schema = Schema({"tokens": ("int32", (None,))})
    block = token_blocks(schema, w.flat, w.lengths)[0]
    packed = zstandard.ZstdCompressor(level=3).compress(block)
    _info(benchmark, "zstd decode", bytes=len(block), ratio=len(block) / len(packed))
    benchmark(zstandard.ZstdDecompressor().decompress, packed)


def test_zstd_decode_feature_block(benchmark):
    block = feature_blocks(64)[0]
    packed = zstandard.ZstdCompressor(level=3).compress(block)
    _info(benchmark, "zstd decode", bytes=len(block), ratio=len(block) / len(packed))
    benchmark(zstandard.ZstdDecompressor().decompress, packed)


# -- script mode -------------------------------------------------------------------


def main() -> int:
    w = Workload()
    check(w)
    real = int(w.lengths.sum() + len(w.lengths))
    print(f"machine: {machine()}, zstandard {zstandard.__version__}, "
          f"lz4 {'not installed' if lz4frame is None else 'installed'}")
    print(f"platform: {platform.platform()}")
    print(f"workload: {DOCS} documents, log-normal lengths (median "
          f"{int(np.median(w.lengths))}, mean {w.lengths.mean():.0f}, max {w.lengths.max()}), "
          f"{real:,} tokens with EOS; batches of {BATCH} x {SEQ_LEN}\n")

    failed = 0
    fns = [w.kfeed, w.straightforward, w.vectorized, w.python]
    times = interleaved(fns, 7)
    peaks = [peak_traced(f) for f in fns]
    print("| packer | median time | tokens/s | kfeed speed-up: median of pairs (best runs) "
          "| peak traced |")
    print("|---|---|---|---|---|")
    names = ["kfeed Packer (Cython)", "numpy, a loop over row segments",
             "numpy, vectorized over the whole stream", "Python lists, token by token"]
    ratios = []
    for name, ts, peak in zip(names, times, peaks):
        t = statistics.median(ts)
        pair = statistics.median(b / a for a, b in zip(times[0], ts))
        ratios.append(pair)
        print(f"| {name} | {t * 1e3:.1f} ms | {real / t / 1e6:.0f} M | {pair:.1f}x "
              f"({min(ts) / min(times[0]):.1f}x) | {peak / 2**20:.1f} MiB |")
    print()
    for name, ratio in (("Python lists", ratios[3]), ("numpy segment loop", ratios[1])):
        ok = ratio >= TARGETS["pack"]
        failed += not ok
        print(f"target: >= {TARGETS['pack']}x the straightforward packer ({name}): "
              f"{ratio:.1f}x {'ok' if ok else 'MISSED'}")

    print("\nSpeed-up over the numpy segment loop by document length (about 3.3M tokens each, "
          "log-normal, sigma 1.0):\n")
    print("| median length | documents | segments per batch | kfeed | numpy segment loop "
          "| speed-up |")
    print("|---|---|---|---|---|---|")
    for median in (50, 500, 2000):
        docs = int(3.3e6 / (median * np.exp(0.5)))
        v = w if median == 500 else Workload(median, docs)
        tk, ts = interleaved([v.kfeed, v.straightforward], 7)
        n = int(v.lengths.sum() + len(v.lengths))
        segs = []
        v.kfeed(lambda out, rows, nseg: segs.append(nseg / rows * BATCH))
        rate_k, rate_s = n / statistics.median(tk) / 1e6, n / statistics.median(ts) / 1e6
        print(f"| {median} | {docs} | {np.mean(segs):.0f} | {rate_k:.0f} M tokens/s "
              f"| {rate_s:.0f} M tokens/s "
              f"| {statistics.median(b / a for a, b in zip(tk, ts)):.1f}x |")
    print()

    print("| packing | efficiency (real / all slots) | truncated documents |")
    print("|---|---|---|")
    for split in (True, False):
        eff, trunc = efficiency(w.lengths, w.flat, split)
        if split:
            ok = eff >= TARGETS["efficiency"]
            failed += not ok
        print(f"| split_long={split} | {eff * 100:.2f}% | {trunc} |")
    print(f"\ntarget: >= {TARGETS['efficiency'] * 100:.0f}% with split_long=True\n")

    i32 = Schema({"tokens": ("int32", (None,))})
    u16 = Schema({"tokens": ("uint16", (None,))})
    text = english_like_bytes(real)
    data = [
        ("Zipf ids, int32", token_blocks(i32, w.flat, w.lengths), i32),
        ("Zipf ids, uint16", token_blocks(u16, w.flat.astype(np.uint16), w.lengths), u16),
        ("byte-level text, int32", token_blocks(i32, text[: w.lengths.sum()], w.lengths), i32),
        ("float32 features 768-d", feature_blocks(2048), None),
    ]
    codecs = []
    for level in (1, 3):
        c = zstandard.ZstdCompressor(level=level)
        codecs.append((f"zstd-{level}", c.compress, zstandard.ZstdDecompressor().decompress))
    if lz4frame is not None:
        codecs.append(("lz4", lz4frame.compress, lz4frame.decompress))
    print("| data | codec | block | ratio | compress | decompress | decompress per 1k tokens "
          "| kfeed decode (no compression) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, blocks, schema in data:
        decode = (lambda bs, s=schema: s.decode_documents(bs)) if schema is not None else None
        for cname, comp, decomp in codecs:
            f = codec_figures(name, blocks, comp, decomp, decode)
            ntok = real if schema is not None else None
            per_k = (f"{f['decompress_s'] / ntok * 1e9:.2f} µs" if ntok else
                     f"{f['decompress_s'] / 2048 * 1e6:.2f} µs per record")
            dec = f"{f['raw'] / f['decode_s'] / 1e9:.1f} GB/s" if "decode_s" in f else "-"
            print(f"| {name} | {cname} | {f['raw'] / f['blocks'] / 1024:.0f} KiB "
                  f"| {f['raw'] / f['compressed']:.2f}x "
                  f"| {f['raw'] / f['compress_s'] / 1e6:.0f} MB/s "
                  f"| {f['raw'] / f['decompress_s'] / 1e9:.2f} GB/s | {per_k} | {dec} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
