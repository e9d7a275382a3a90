"""kfeed produce --from a dataset against pyarrow reading the same data alone.

The figures for bench/RESULTS.md ("Ingestion"): ``--rows`` of the seeds'
samples (768 float32 features, int64 label and id) in 8 Parquet files, read

- by pyarrow alone: ``pyarrow.dataset`` over the files, every batch read
  (the columns ``kfeed produce`` reads), nothing else done with them;
- by ``kfeed produce --from GLOB`` into a fresh topic of the broker that
  ``$KFEED_BOOTSTRAP`` names, with the producer at its default settings
  (transactions of 64 MB, which record the progress for ``--resume``),
  timed from the call to its return (all acknowledged).

once from local files and once from moto's S3 server, started here on
loopback. Each side runs ``--repeat`` times, interleaved; the best counts.
Target: kfeed at >= 0.8x pyarrow's rate. Run:
``python bench/bench_ingest.py [--rows 100000] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from kfeed import cli
from kfeed.synthetic import synthetic_columns

S3_ENV = {"AWS_ACCESS_KEY_ID": "kfeed", "AWS_SECRET_ACCESS_KEY": "kfeed-secret",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def table(ids: np.ndarray) -> pa.Table:
    cols = synthetic_columns(ids)
    return pa.table({"features": pa.FixedSizeListArray.from_arrays(
        pa.array(cols["features"].ravel()), 768), "label": pa.array(cols["label"]),
        "id": pa.array(cols["id"])})


def pyarrow_alone(files: list[str], fs: pafs.FileSystem) -> int:
    rows = 0
    for batch in ds.dataset(files, filesystem=fs, format="parquet").to_batches(
            columns=["features", "label", "id"]):
        rows += batch.num_rows
    return rows


def kfeed_produce(source: str) -> None:
    topic = f"bench-ingest-{uuid.uuid4().hex[:8]}"
    code = cli.main(["produce", "--topic", topic, "--from", source, "--progress-every", "600"])
    assert code == 0


def run(label: str, source: str, files: list[str], fs: pafs.FileSystem, n: int,
        repeat: int) -> None:
    best = {"pyarrow alone": 0.0, "kfeed produce": 0.0}
    for _ in range(repeat):
        t = time.perf_counter()
        assert pyarrow_alone(files, fs) == n
        best["pyarrow alone"] = max(best["pyarrow alone"], n / (time.perf_counter() - t))
        t = time.perf_counter()
        kfeed_produce(source)
        best["kfeed produce"] = max(best["kfeed produce"], n / (time.perf_counter() - t))
    mb = n * (768 * 4 + 16) / 1e6
    ratio = best["kfeed produce"] / best["pyarrow alone"]
    print(f"\n{label}: {n:,} rows ({mb:,.0f} MB), rows/s, best of {repeat}:")
    for name, rate in best.items():
        print(f"| {name} | {rate:,.0f} rows/s | {rate * mb / n:,.0f} MB/s |")
    print(f"| kfeed / pyarrow | {ratio:.2f}x (target >= 0.8x) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    if not os.environ.get("KFEED_BOOTSTRAP"):
        raise SystemExit("set KFEED_BOOTSTRAP (e.g. kfeed cluster up)")
    n, parts = args.rows, 8
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i in range(parts):
            path = Path(tmp) / f"part-{i}.parquet"
            pq.write_table(table(np.arange(i * n // parts, (i + 1) * n // parts)), path)
            files.append(str(path))
        run("local Parquet", f"{tmp}/part-*.parquet", files, pafs.LocalFileSystem(), n,
            args.repeat)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(S3_ENV)
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http",
                               region="us-east-1", allow_bucket_creation=True)
        fs.create_dir("bench")
        files = []
        for i in range(parts):
            path = f"bench/train/part-{i}.parquet"
            pq.write_table(table(np.arange(i * n // parts, (i + 1) * n // parts)), path,
                           filesystem=fs)
            files.append(path)
        run("Parquet on S3 (moto's server on loopback)",
            f"s3://bench/train/part-*.parquet?endpoint_override=127.0.0.1:{port}&scheme=http"
            f"&region=us-east-1", files, fs, n, args.repeat)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
