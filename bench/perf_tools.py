"""Helpers of bench/bench_loader.py that are not contenders of their own.

- Kafka's own performance tools (``org.apache.kafka.tools.ProducerPerformance``
  and ``ConsumerPerformance``), run from the jars that ``kfeed cluster`` uses,
  and their output parsed into figures the tables compare.
- The bytes a topic holds on the broker: the sizes of its segment files in the
  cluster folder when the benchmark knows it, else Kafka's ``LogDirsCommand``
  (confluent-kafka's AdminClient has no DescribeLogDirs).
- Zipf-distributed token ids, fast enough for hundreds of MB of samples.
- Percentiles and the command-line tools found on PATH.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# -- Kafka's own tools ---------------------------------------------------------

JAVA_HEAP = "-Xmx512m"
# The command-line clients these benchmarks would compare against, if installed.
NATIVE_TOOLS = ("kcat", "kafkacat", "rdkafka_performance")


def java_command() -> list[str]:
    """``java -cp <Kafka jars>/*``, with the jars ``kfeed cluster`` resolves."""
    from kfeed.cluster import _jars

    return [_jars.java(), JAVA_HEAP, "-cp", f"{_jars.jars()}/*"]


def java_version() -> str:
    try:
        from kfeed.cluster import _jars

        out = subprocess.run([_jars.java(), "-version"], capture_output=True, text=True,
                             timeout=60)
        m = re.search(r'version "([^"]+)"', out.stderr + out.stdout)
        return m.group(1) if m else "?"
    except Exception:  # noqa: BLE001 - information only
        return "?"


def _run_java(args: list[str], timeout: float) -> tuple[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([*java_command(), *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{args[0]} failed (exit {proc.returncode}):\n{out[-3000:]}")
    return out, wall


def payload_file(folder: Path, record_bytes: int, lines: int, seed: int = 0) -> Path:
    """Random upper-case lines of ``record_bytes`` each, for ``--payload-file``.

    With ``--record-size`` the tool draws every byte of every record from a
    random generator, which costs it two thirds of its time here; from a file
    it picks one of the prepared lines per record.
    """
    rng = np.random.default_rng(seed)
    body = rng.integers(65, 91, size=(lines, record_bytes + 1), dtype=np.uint8)
    body[:, -1] = ord("\n")
    path = folder / f"payload-{record_bytes}.txt"
    path.write_bytes(body.tobytes()[:-1])
    return path


_PRODUCER_LINE = re.compile(r"(\d+) records sent, ([\d.]+) records/sec \(([\d.]+) MB/sec\), "
                            r"([\d.]+) ms avg latency, ([\d.]+) ms max latency"
                            r"(?:, (\d+) ms 50th, (\d+) ms 95th, (\d+) ms 99th, (\d+) ms 99.9th)?")


def parse_producer_performance(output: str) -> dict[str, Any]:
    """The summary line of ProducerPerformance (the last one that matches)."""
    found = _PRODUCER_LINE.findall(output)
    if not found:
        raise RuntimeError(f"no summary in ProducerPerformance output:\n{output[-2000:]}")
    rec, rate, mb, avg, mx, p50, p95, p99, p999 = found[-1]
    out: dict[str, Any] = {"records": int(rec), "records_per_s": float(rate),
                           "mib_per_s": float(mb), "avg_ms": float(avg), "max_ms": float(mx)}
    if p50:
        out.update(p50_ms=int(p50), p99_ms=int(p99), p999_ms=int(p999))
    return out


def producer_performance(bootstrap: str, topic: str, records: int, payload: Path,
                         props: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    args = ["org.apache.kafka.tools.ProducerPerformance", "--topic", topic,
            "--num-records", str(records), "--throughput", "-1", "--payload-file", str(payload),
            "--producer-props", f"bootstrap.servers={bootstrap}",
            *(f"{k}={v}" for k, v in props.items())]
    output, wall = _run_java(args, timeout)
    return {**parse_producer_performance(output), "wall": wall}


def parse_consumer_performance(output: str) -> dict[str, Any]:
    """The CSV line under ConsumerPerformance's header, by column name."""
    lines = [x.strip() for x in output.splitlines()]
    for i, line in enumerate(lines):
        if line.startswith("start.time,") and i + 1 < len(lines):
            names = [n.strip() for n in line.split(",")]
            values = [v.strip() for v in lines[i + 1].split(",")]
            if len(values) == len(names):
                row = dict(zip(names, values, strict=True))
                return {name: float(row[name]) for name in names
                        if name not in ("start.time", "end.time")}
    raise RuntimeError(f"no figures in ConsumerPerformance output:\n{output[-2000:]}")


def consumer_performance(bootstrap: str, topic: str, messages: int, group: str,
                         timeout: float = 300) -> dict[str, Any]:
    """Reads ``messages`` from the earliest offset with the Java client's defaults.

    ``fetch.*`` columns leave the group join out (the tool's ``rebalance.time.ms``).
    """
    args = ["org.apache.kafka.tools.ConsumerPerformance", "--bootstrap-server", bootstrap,
            "--topic", topic, "--messages", str(messages), "--group", group,
            "--timeout", "30000"]
    output, wall = _run_java(args, timeout)
    row = parse_consumer_performance(output)
    if row["data.consumed.in.nMsg"] < messages:
        raise RuntimeError(f"ConsumerPerformance read {row['data.consumed.in.nMsg']:.0f} of "
                           f"{messages} messages of {topic}")
    return {**row, "wall": wall}


def kcat_consume(bootstrap: str, topic: str, messages: int, timeout: float = 300) -> dict[str, Any]:
    """Read ``topic`` from the beginning to its end with kcat (librdkafka, no Python).

    Each message is printed as one byte to a pipe this process counts, so
    kcat does as little as a consumer can. The wall time includes kcat's
    start, metadata and connections.
    """
    exe = shutil.which("kcat") or shutil.which("kafkacat")
    if exe is None:
        raise RuntimeError("kcat is not installed")
    t0 = time.perf_counter()
    proc = subprocess.run([exe, "-C", "-b", bootstrap, "-t", topic, "-o", "beginning", "-e", "-q",
                           "-f", "."], capture_output=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"kcat failed (exit {proc.returncode}): {proc.stderr[-2000:]!r}")
    got = proc.stdout.count(b".")
    if got != messages:
        raise RuntimeError(f"kcat read {got} messages of {messages}")
    return {"messages": got, "wall": wall}


def native_tools() -> dict[str, str | None]:
    return {name: shutil.which(name) for name in NATIVE_TOOLS}


# -- bytes on the broker -------------------------------------------------------


def _partition_dirs(cluster_dir: Path, topic: str) -> list[Path]:
    return [d for d in cluster_dir.glob(f"*/data/{topic}-*")
            if d.is_dir() and d.name[len(topic) + 1:].isdigit()]


def topic_bytes(bootstrap: str, topics: list[str],
                cluster_dir: str | None) -> tuple[dict[str, int], str]:
    """Bytes of each topic's log on the broker, and where the figure came from.

    A segment file is as long as the record batches appended to it (Kafka
    does not preallocate them by default); index files are left out.
    """
    if cluster_dir:
        root = Path(cluster_dir)
        sizes = {}
        for t in topics:
            dirs = _partition_dirs(root, t)
            if not dirs:
                raise RuntimeError(f"no partition folders of {t} under {root}/*/data")
            sizes[t] = sum(f.stat().st_size for d in dirs for f in d.glob("*.log"))
        return sizes, f"segment files under {cluster_dir}"
    output, _ = _run_java(["org.apache.kafka.tools.LogDirsCommand", "--bootstrap-server",
                           bootstrap, "--describe", "--topic-list", ",".join(topics)], 120)
    doc = json.loads(next(x for x in output.splitlines() if x.startswith("{")))
    sizes = dict.fromkeys(topics, 0)
    for broker in doc["brokers"]:
        for log_dir in broker["logDirs"]:
            for part in log_dir["partitions"]:
                topic = part["partition"].rsplit("-", 1)[0]
                if topic in sizes:
                    sizes[topic] += int(part["size"])
    return sizes, "Kafka's LogDirsCommand"


# -- token-like data -----------------------------------------------------------

VOCAB = 50_257
_ZIPF_TABLE_BITS = 22
_zipf: tuple[np.ndarray, np.ndarray] | None = None


def _zipf_table() -> tuple[np.ndarray, np.ndarray]:
    """An inverse-CDF table of Zipf(1.0) ranks over VOCAB and a rank -> id permutation."""
    global _zipf
    if _zipf is None:
        p = 1.0 / np.arange(1, VOCAB + 1)
        cdf = np.cumsum(p / p.sum())
        size = 1 << _ZIPF_TABLE_BITS
        table = np.searchsorted(cdf, (np.arange(size) + 0.5) / size).astype(np.uint16)
        perm = np.random.default_rng(1).permutation(VOCAB).astype(np.int32)
        _zipf = table, perm
    return _zipf


def zipf_tokens(ids: np.ndarray, width: int) -> np.ndarray:
    """``[len(ids), width]`` int32 token ids, Zipf(1.0) over a 50,257-id vocabulary.

    Ranks are mapped to random ids and drawn independently (no repeated
    phrases), as in bench/test_pack.py's ``zipf_ids``, but from a 4M-entry
    inverse-CDF table: a lookup per token instead of a binary search, so
    hundreds of MB take seconds. The rows depend only on ``ids[0]`` and the
    number of rows, so a producer chunk is the same in every run.
    """
    table, perm = _zipf_table()
    rng = np.random.default_rng([7, int(ids[0]) if len(ids) else 0])
    draws = rng.integers(0, len(table), size=(len(ids), width), dtype=np.uint32)
    return perm[table[draws]]


# -- statistics ----------------------------------------------------------------


def percentiles(values: np.ndarray, qs: tuple[float, ...] = (50, 99, 99.9)) -> list[float]:
    if len(values) == 0:
        return [float("nan")] * len(qs)
    return [float(x) for x in np.percentile(values, qs)]


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kfeed-bench-"))
