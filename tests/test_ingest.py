"""kfeed produce --from files, object stores and databases, and --resume after a kill.

The S3 server is moto's, started here on loopback; the GCS server is
fake-gcs-server, built once from its Go module into kfeed's cache (the
tests of it are skipped where there is no Go toolchain); HDFS is Hadoop's
MiniDFSCluster, its jars fetched once by Maven (tests/hdfs/pom.xml), read through
hdfs-native where pyarrow finds no libhdfs; the database is Debian's
PostgreSQL, its package unpacked once into kfeed's cache and started here
on loopback (as ``nobody`` when the tests run as root, which PostgreSQL
refuses). Every row must arrive once with its values; a SIGKILL in the
middle, then the same command with ``--resume``, must deliver every row
exactly once too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from confluent_kafka import Consumer, TopicPartition
from pyarrow import feather
from records import kfeed_cli

import kfeed
from kfeed import cli
from kfeed.cluster._jars import cache_root
from kfeed.errors import ConfigError, KfeedError
from kfeed.ingest import no_password, shown, source_key
from kfeed.resume import IngestProgress, job_id

WIDTH = 32
SCHEMA = kfeed.Schema({"features": ("float32", (WIDTH,)), "label": ("int64", ()),
                       "id": ("int64", ())})


def table(ids: np.ndarray) -> pa.Table:
    feats = (ids[:, None] * 0.5 + np.arange(WIDTH)).astype(np.float32)
    return pa.table({"features": pa.FixedSizeListArray.from_arrays(pa.array(feats.ravel()), WIDTH),
                     "label": pa.array(ids % 10), "id": pa.array(ids)})


def check_topic(bootstrap: str, topic: str, n: int, ids: np.ndarray | None = None) -> None:
    """The topic holds rows 0..n-1 (or ``ids``), each once, with its values."""
    got: dict[str, list[np.ndarray]] = {"id": [], "label": [], "features": []}
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}, topic,
                      SCHEMA, 1024, device="cpu", until="end") as loader:
        for batch in loader:
            for k, parts in got.items():
                parts.append(batch[k].numpy().copy())
    cols = {k: np.concatenate(v) for k, v in got.items()}
    wanted, ids = ids, cols["id"]
    assert len(ids) == n, f"{len(ids)} rows, {len(np.unique(ids))} distinct, want {n}"
    assert np.array_equal(np.sort(ids), np.arange(n) if wanted is None else wanted)
    want = table(ids)
    assert np.array_equal(cols["label"], ids % 10)
    assert np.array_equal(cols["features"],
                          want["features"].combine_chunks().values.to_numpy().reshape(n, WIDTH))


def kill_then_resume(bootstrap: str, topic: str, source: list[str], n: int,
                     env: dict[str, str] | None = None) -> None:
    """Start ``kfeed produce SOURCE`` in small transactions, SIGKILL it once some have
    committed, run it again with --resume; the topic then holds every row once."""
    argv = [sys.executable, "-m", "kfeed", "produce", "--topic", topic, *source,
            "--transaction-mb", "0.5", "--progress-every", "60"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {}), "KFEED_BOOTSTRAP": bootstrap})
    where = source_key(source[source.index("--from") + 1])
    query = source[source.index("--query") + 1] if "--query" in source else None
    job = job_id(topic, where, query)
    # Watched without waiting for stable offsets: a read_committed client's
    # committed() waits while a transaction's offsets are pending, which is
    # almost always while the run goes on.
    watch = Consumer({"bootstrap.servers": bootstrap, "group.id": job,
                      "isolation.level": "read_uncommitted", "enable.auto.commit": False})
    progress = IngestProgress({"bootstrap.servers": bootstrap}, topic, job, where, 30.0)

    def sent() -> int:
        return max(0, watch.committed([TopicPartition(topic, 0)], timeout=30)[0].offset)

    try:
        deadline = time.monotonic() + 120
        while sent() == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"it ended before it was killed: {proc.communicate()}"
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        killed_at = sent()
        assert 0 < killed_at < n
        done = kfeed_cli(bootstrap, "produce", "--topic", topic, *source, "--resume", env=env)
        assert done.returncode == 0, done.stderr
        assert progress.done() == n
        left = n - int(done.stdout.split("after the ")[1].split(" sent")[0].replace(",", ""))
        assert done.stdout.startswith(f"produced {left:,} samples"), done.stdout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        progress.close()
        watch.close()
    check_topic(bootstrap, topic, n)


# -- local files ---------------------------------------------------------------------


def arrives_once_then_resumes(bootstrap: str, make_topic: Any, folder: str, glob: str,
                              n: int, env: dict[str, str] | None = None) -> None:
    """``--from folder`` sends rows 0..n-1 once; ``--from glob``, killed and resumed, too."""
    topic = make_topic(partitions=3)
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", folder, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"produced {n:,} samples"), done.stdout
    check_topic(bootstrap, topic, n)
    kill_then_resume(bootstrap, make_topic(partitions=3), ["--from", glob], n, env=env)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["parquet folder", "feather glob", "csv", "jsonl"])
def test_every_row_of_local_files_arrives_once(bootstrap, make_topic, tmp_path, kind) -> None:
    topic = make_topic(partitions=3)
    n = 3000
    parts = [table(np.arange(i, min(i + 1000, n))) for i in range(0, n, 1000)]
    if kind == "parquet folder":
        for i, t in enumerate(parts):
            pq.write_table(t, tmp_path / f"part-{i}.parquet", row_group_size=400)
        source = [str(tmp_path)]
    elif kind == "feather glob":
        for i, t in enumerate(parts):
            feather.write_feather(t, tmp_path / f"part-{i}.feather")
        feather.write_feather(parts[0], tmp_path / "other-0.feather")  # not matched
        source = [str(tmp_path / "part-*.feather")]
    else:  # text formats hold scalars: the features are one column each
        flat = pa.concat_tables(parts)
        feats = flat["features"].combine_chunks().values.to_numpy().reshape(n, WIDTH)
        cols = {f"f{j}": pa.array(feats[:, j]) for j in range(WIDTH)}
        t = pa.table({**cols, "label": flat["label"], "id": flat["id"]})
        path = tmp_path / ("d.csv" if kind == "csv" else "d.jsonl")
        if kind == "csv":
            pacsv.write_csv(t, path)
        else:
            path.write_text("".join(f"{r}\n" for r in _json_lines(t)))
        done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", str(path),
                         "--field", "label=label", "--field", "id=id", "--field", "f0=f0")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"produced {n:,} samples"), done.stdout
        one = kfeed.Schema({"label": ("int64", ()), "id": ("int64", ()), "f0": ("float64", ())})
        with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}, topic,
                          one, 512, device="cpu", until="end") as loader:
            got = [(b["id"].numpy().copy(), b["f0"].numpy().copy()) for b in loader]
        ids = np.concatenate([g[0] for g in got])
        f0 = np.concatenate([g[1] for g in got])
        assert np.array_equal(np.sort(ids), np.arange(n))
        assert np.array_equal(f0, feats[ids, 0].astype(np.float64))
        return
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", *source)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"produced {n:,} samples"), done.stdout
    check_topic(bootstrap, topic, n)


def test_a_bad_row_after_rows_were_sent_says_resume(bootstrap, make_topic, tmp_path) -> None:
    # Not exit 2 ("nothing was sent"): the rows of the transactions committed
    # before it are in the topic, and a rerun without --resume would send them twice.
    topic = make_topic(partitions=1)
    pq.write_table(table(np.arange(0, 3000)), tmp_path / "part-0.parquet")
    pq.write_table(table(np.arange(3000, 4000)), tmp_path / "part-1.parquet")
    bad = table(np.arange(4000, 5000))
    labels = pa.array([None] + list(range(1, 1000)), pa.int64())
    pq.write_table(bad.set_column(1, "label", labels), tmp_path / "part-2.parquet")
    argv = ("produce", "--topic", topic, "--from", str(tmp_path), "--transaction-mb", "0.1",
            "--progress-every", "600")  # (a loaded machine's slow abort: no progress line)
    done = kfeed_cli(bootstrap, *argv)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    line = lines[0]
    assert line.startswith("kfeed: ") and line.endswith(
        f"(4,000 rows before it were sent and recorded: {cli._AFTER_THE_FIX})"), line
    pq.write_table(table(np.arange(4000, 5000)), tmp_path / "part-2.parquet")
    # The same command again, as a user would type it, sends nothing twice.
    again = kfeed_cli(bootstrap, *argv)
    assert again.returncode == 2, (again.stdout, again.stderr)
    assert again.stderr.strip().splitlines() == [
        f"kfeed: 4,000 rows of {source_key(str(tmp_path))} were already sent to {topic} by an "
        f"earlier run: --resume sends the rest, --resend sends them all again"], again.stderr
    done = kfeed_cli(bootstrap, *argv, "--resume")
    assert done.returncode == 0, done.stderr
    check_topic(bootstrap, topic, 5000)


@pytest.mark.integration
def test_a_finished_source_is_sent_again_only_with_resend(bootstrap, make_topic,
                                                          tmp_path) -> None:
    topic = make_topic(partitions=2)
    pq.write_table(table(np.arange(0, 2000)), tmp_path / "part-0.parquet")
    argv = ("produce", "--topic", topic, "--from", str(tmp_path), "--progress-every", "600")
    done = kfeed_cli(bootstrap, *argv)
    assert done.returncode == 0, done.stderr
    again = kfeed_cli(bootstrap, *argv)
    assert again.returncode == 2, (again.stdout, again.stderr)
    assert again.stderr.strip().splitlines() == [
        f"kfeed: all 2,000 rows of {source_key(str(tmp_path))} were already sent to {topic} "
        f"by an earlier run: --resend sends them again"], again.stderr
    check_topic(bootstrap, topic, 2000)
    resent = kfeed_cli(bootstrap, *argv, "--resend")
    assert resent.returncode == 0, resent.stderr
    assert resent.stdout.startswith("produced 2,000 samples"), resent.stdout
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}, topic,
                      SCHEMA, 1000, device="cpu", until="end") as loader:
        ids = np.concatenate([b["id"].numpy().copy() for b in loader])
    assert np.array_equal(np.sort(ids), np.repeat(np.arange(2000), 2))


def _json_lines(t: pa.Table) -> Iterator[str]:
    import json

    for row in t.to_pylist():
        yield json.dumps(row)


@pytest.mark.integration
def test_a_setting_a_transaction_refuses_leaves_no_topic_behind(bootstrap, tmp_path) -> None:
    # Rows from a dataset go in transactions, which refuse acks other than all:
    # checked before the topic is made, not by the producer after it.
    from confluent_kafka.admin import AdminClient

    topic = f"never-{uuid.uuid4().hex}"
    pq.write_table(table(np.arange(0, 10)), tmp_path / "part-0.parquet")
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", str(tmp_path),
                     "-X", "acks=1")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines() == [
        "kfeed: bad Kafka setting: Failed to create producer: `acks` must be set to `all` "
        "when `enable.idempotence` is true: check its name and value (librdkafka's "
        "CONFIGURATION.md lists them)"], done.stderr
    topics = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30).topics
    assert topic not in topics


@pytest.mark.integration
def test_a_killed_run_resumed_sends_every_row_exactly_once(bootstrap, make_topic,
                                                           tmp_path) -> None:
    topic = make_topic(partitions=4)
    n = 200_000
    for i in range(0, n, 25_000):
        pq.write_table(table(np.arange(i, i + 25_000)), tmp_path / f"p{i:06d}.parquet",
                       row_group_size=2500)
    kill_then_resume(bootstrap, topic, ["--from", str(tmp_path / "*.parquet")], n)
    again = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from",
                      str(tmp_path / "*.parquet"), "--resume")
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("nothing to send"), again.stdout


def save_numpy(path: Path, ids: np.ndarray) -> None:
    """Rows ``ids`` as ``table`` has them, in an .npz (features, label, id)."""
    feats = (ids[:, None] * 0.5 + np.arange(WIDTH)).astype(np.float32)
    np.savez(path, features=feats, label=ids % 10, id=ids)


@pytest.mark.integration
def test_a_numpy_file_is_sent_once_and_resumes_after_a_kill(bootstrap, make_topic,
                                                            tmp_path) -> None:
    # An .npz was read whole and sent outside any transaction, with no progress
    # recorded: the same command after a crash sent every row again, silently.
    n = 200_000
    path = tmp_path / "d.npz"
    save_numpy(path, np.arange(n))
    topic = make_topic(partitions=4)
    kill_then_resume(bootstrap, topic, ["--from", str(path)], n)
    argv = ("produce", "--topic", topic, "--from", str(path), "--progress-every", "600")
    again = kfeed_cli(bootstrap, *argv)
    assert again.returncode == 2, (again.stdout, again.stderr)
    assert again.stderr.strip().splitlines() == [
        f"kfeed: all {n:,} rows of {source_key(str(path))} were already sent to {topic} by an "
        f"earlier run: --resend sends them again"], again.stderr
    # The file rewritten with more rows: a resume would skip by a count that
    # no longer names the same rows.
    save_numpy(path, np.arange(n + 10))
    again = kfeed_cli(bootstrap, *argv, "--resume")
    assert again.returncode == 2, (again.stdout, again.stderr)
    assert again.stderr.strip().splitlines() == [
        f"kfeed: --resume: --from {path} changed since the {n:,} rows were sent (its size or "
        f"modification time is not what it was): skipping {n:,} rows would send some twice and others never; send "
        f"it whole with --resend (to a new topic, or after deleting this one's records)"]
    check_topic(bootstrap, topic, n)


@pytest.mark.integration
def test_a_transaction_ends_inside_a_source_batch_once_full(bootstrap, make_topic,
                                                            tmp_path) -> None:
    # The limits were looked at after each source batch, of 65,536 rows whatever
    # their size: rows of 48 KB made a batch of 3 GB, whose transaction the
    # brokers aborted for its age, at every --resume again. Each transaction
    # ends with a marker that takes an offset: one partition's end offset less
    # its messages counts them.
    topic = make_topic(partitions=1)
    n = 10_000
    save_numpy(tmp_path / "d.npz", np.arange(n))  # 10,000 rows of 144 bytes: one batch
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", str(tmp_path / "d.npz"),
                     "--transaction-mb", "0.2", "--block-records", "64")
    assert done.returncode == 0, done.stderr
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                  "enable.partition.eof": True})
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        messages = 0
        while True:
            m = c.poll(10)
            assert m is not None
            if m.error():
                break  # the partition's end
            messages += 1
        _low, end = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    finally:
        c.close()
    transactions = end - messages
    assert transactions >= n * 144 / 0.2e6 * 0.8, (transactions, messages)
    check_topic(bootstrap, topic, n)


@pytest.mark.integration
def test_a_npy_file_is_memory_mapped_and_sent_once(bootstrap, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=2)
    ids = np.arange(150_000)
    np.save(tmp_path / "ids.npy", ids)
    argv = ("produce", "--topic", topic, "--from", str(tmp_path / "ids.npy"), "--field",
            "id=ids", "--progress-every", "600")
    done = kfeed_cli(bootstrap, *argv)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("produced 150,000 samples"), done.stdout
    assert kfeed_cli(bootstrap, *argv).returncode == 2  # not sent twice
    one = kfeed.Schema({"id": ("int64", ())})
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}, topic,
                      one, 4096, device="cpu", until="end") as loader:
        got = np.concatenate([b["id"].numpy().copy() for b in loader])
    assert np.array_equal(np.sort(got), ids)


def test_numpy_rows_skip_by_slicing_and_check_what_they_hold(tmp_path) -> None:
    from kfeed.ingest import STREAM_BATCH_ROWS, NumpyRows

    n = STREAM_BATCH_ROWS + 100
    save_numpy(tmp_path / "d.npz", np.arange(n))
    rows = NumpyRows(str(tmp_path / "d.npz"))
    try:
        got = [b.column("id") for b in rows.batches(["id", "label"], skip=5)]
        assert [len(g) for g in got] == [STREAM_BATCH_ROWS, 95]
        assert np.array_equal(np.concatenate(got), np.arange(5, n)) and rows.total == n
        assert list(rows.batches(["id"], skip=n)) == []
        with pytest.raises(KfeedError, match="holds fewer rows than the 1 more that --resume "
                                             "would leave out: it changed since the last run"):
            list(rows.batches(["id"], skip=n + 1))
    finally:
        rows.close()
    np.savez(tmp_path / "uneven.npz", features=np.zeros((3, 2), np.float32), id=np.arange(4))
    rows = NumpyRows(str(tmp_path / "uneven.npz"))
    with pytest.raises(ConfigError, match=r"uneven.npz: the arrays have different row counts "
                                          r"\(features 3, id 4\)"):
        list(rows.batches(["features", "id"]))
    rows.close()
    # A .npy is mapped, not read: its rows come from the file as they are sent.
    np.save(tmp_path / "big.npy", np.arange(10, dtype=np.int64))
    rows = NumpyRows(str(tmp_path / "big.npy"))
    (first,) = rows.batches(["big"])
    assert isinstance(first.column("big"), np.memmap)
    rows.close()


def test_a_file_rewritten_at_the_same_size_is_a_change_for_resume(tmp_path) -> None:
    # The marks held names and sizes only: a --resume after the file was
    # rewritten at the same size (ids reversed) was taken, and sent its first
    # rows twice and its last never.
    import os

    from kfeed.ingest import DatasetRows, NumpyRows

    save_numpy(tmp_path / "d.npz", np.arange(1000))
    pq.write_table(table(np.arange(1000)), tmp_path / "a.parquet")
    kinds = {NumpyRows: str(tmp_path / "d.npz"), DatasetRows: str(tmp_path / "a.parquet")}
    for kind, path in kinds.items():
        rows = kind(path)
        mark = rows.mark(600)
        rows.close()
        again = kind(path)
        again.check_mark(mark, 600)  # unchanged: resumed
        if kind is NumpyRows:  # a mark recorded before the times were kept
            again.check_mark(mark.rpartition(":")[0], 600)
        again.close()
        size, st = os.path.getsize(path), os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten, same size
        assert os.path.getsize(path) == size
        changed = kind(path)
        with pytest.raises(ConfigError, match="changed since the 600 rows were sent"):
            changed.check_mark(mark, 600)
        changed.close()


def test_the_progress_is_asked_again_while_the_group_coordinator_moves() -> None:
    # A run started right after the brokers (or the one coordinating the
    # job's group) restarted failed at once: "cannot read the progress of
    # kfeed-produce...: Failed to get committed offsets: Broker: Not coordinator".
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    class Moving:  # the coordinator answers on the third ask
        asked = 0

        def committed(self, tps, timeout):
            self.asked += 1
            if self.asked < 3:
                raise KafkaException(KafkaError((KafkaError.NOT_COORDINATOR,
                                                 KafkaError.COORDINATOR_LOAD_IN_PROGRESS)
                                                [self.asked - 1]))
            return [TopicPartition("t", 0, 1200, metadata='{"rows":1200,"mark":"m"}')]

    progress = IngestProgress.__new__(IngestProgress)
    progress.topic, progress.job, progress.timeout_s = "t", "kfeed-produce.t.x", 10.0
    progress._consumer = Moving()
    assert progress.done() == 1200 and progress.mark == "m"
    assert progress._consumer.asked == 3


def test_a_big_endian_array_is_sent_in_this_machine_s_byte_order() -> None:
    # Its dtype's name is float32 all the same: the rules let it through, and the
    # producer refused it after the topic was made ("expected dtype float32, got >f4").
    from kfeed.ingest import _settle

    for cast in (None, "float64"):
        got = _settle("be.npz", "features", "features",
                      np.arange(6, dtype=">f4").reshape(3, 2), cast)
        assert got.dtype.isnative and got.dtype == np.dtype(cast or "float32")
        assert np.array_equal(got, np.arange(6).reshape(3, 2))
    assert _settle("be.npz", "id", "id", np.arange(3, dtype=">i8"), None).dtype == np.int64


@pytest.mark.integration
def test_a_resume_naming_the_files_another_way_is_refused(bootstrap, make_topic,
                                                          tmp_path) -> None:
    # A folder, then a glob of its one file: two jobs. The --resume of the
    # second found no rows of its own and sent them all a second time.
    topic = make_topic(partitions=2)
    pq.write_table(table(np.arange(500)), tmp_path / "a.parquet")
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", str(tmp_path))
    assert done.returncode == 0, done.stderr
    glob = str(tmp_path / "*.parquet")
    again = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", glob, "--resume")
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"kfeed: --resume: no rows of {glob} are recorded as sent to {topic}, but 500 rows of "
        f"{tmp_path} are: if that is the same data, resume with --from naming it as before; "
        f"if not, leave --resume out"], again.stderr
    check_topic(bootstrap, topic, 500)
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", str(tmp_path), "--resume")
    assert done.returncode == 0 and done.stdout.startswith("nothing to send"), done.stdout


@pytest.mark.integration
def test_a_resume_after_files_changed_before_where_it_stopped_is_refused(bootstrap, make_topic,
                                                                       tmp_path) -> None:
    # A file added among those sent: the row count skipped its rows in their
    # place, sent c's again and b's never ("produced 2,000 samples, after the
    # 4,000 sent before", exit 0). A file added after them resumes.
    topic = make_topic(partitions=1)
    pq.write_table(table(np.arange(0, 2000)), tmp_path / "a.parquet")
    pq.write_table(table(np.arange(4000, 6000)), tmp_path / "c.parquet")
    argv = ("produce", "--topic", topic, "--from", str(tmp_path), "--progress-every", "600")
    assert kfeed_cli(bootstrap, *argv).returncode == 0
    pq.write_table(table(np.arange(2000, 4000)), tmp_path / "b.parquet")
    again = kfeed_cli(bootstrap, *argv, "--resume")
    assert again.returncode == 2, (again.stdout, again.stderr)
    assert again.stderr.strip().splitlines() == [
        f"kfeed: --resume: --from {tmp_path} changed since the 4,000 rows were sent (a file "
        f"added, removed or changed among the ones they came from): skipping 4,000 rows "
        f"would send some twice and others never; send it whole with --resend (to a new "
        f"topic, or after deleting this one's records), or put new files in a folder of "
        f"their own"], again.stderr
    (tmp_path / "b.parquet").unlink()
    pq.write_table(table(np.arange(6000, 7000)), tmp_path / "d.parquet")
    done = kfeed_cli(bootstrap, *argv, "--resume")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("produced 1,000 samples"), done.stdout
    check_topic(bootstrap, topic, 5000, ids=np.r_[0:2000, 4000:7000])


def _read_back(bootstrap: str, topic: str, schema: kfeed.Schema) -> dict[str, np.ndarray]:
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex}, topic,
                      schema, 4096, device="cpu", until="end") as loader:
        got = [{k: v.numpy().copy() for k, v in b.items()} for b in loader]
    return {k: np.concatenate([g[k] for g in got]) for k in schema.names}


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_text_files_read_a_column_as_its_dtype_and_quoted_newlines(bootstrap, make_topic,
                                                                   tmp_path, kind) -> None:
    # pyarrow guessed each column's type from the file's first block: whole
    # numbers for 1 MB then 2.5 stopped the read ("CSV conversion error to
    # int64"), --dtype x=float64 or not, as did a column empty at first with
    # --fill, and a quoted value holding newlines past the first block.
    n = 120_000
    ids = np.arange(n)
    x = np.where(ids < n - 10, ids, ids + 0.5)
    text = [str(int(v)) if v == int(v) else repr(float(v)) for v in x]
    path = tmp_path / f"d.{kind}"
    with path.open("w") as f:
        if kind == "csv":
            f.write("id,x,late,note\n")
            for i in range(n):
                late = "" if i < n - 10 else "7"
                f.write(f'{i},{text[i]},{late},"a note\non two lines, {i}"\n')
        else:
            for i in range(n):
                late = "null" if i < n - 10 else "7"
                f.write(f'{{"id": {i}, "x": {text[i]}, "late": {late}, "note": "n {i}"}}\n')
    # Without the --dtype, the line says what to do. The rows of the batches
    # before the bad value's are sent and recorded (exit 1). A CI run gave
    # exit 2 instead, nothing sent: the error came before the first good
    # batch, most likely from pyarrow's read-ahead meeting the bad block
    # first. Nothing sent is a mistake in the command (exit 2), also right.
    guessed = kfeed_cli(bootstrap, "produce", "--topic", make_topic(partitions=1), "--from",
                        str(path), "--field", "id=id", "--field", "x=x", "--progress-every", "600")
    assert "(a column's type is guessed from the file's first rows: give the field's with " \
        "--dtype FIELD=DTYPE)" in guessed.stderr, guessed.stderr
    sent = "rows before it were sent and recorded: after the fix, run again with --resume"
    assert (guessed.returncode, sent in guessed.stderr) in ((1, True), (2, False)), guessed.stderr
    topic = make_topic(partitions=1)
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", str(path),
                     "--field", "id=id", "--field", "x=x", "--field", "late=late",
                     "--dtype", "x=float64", "--dtype", "late=int32", "--fill", "late=0",
                     "--progress-every", "600")
    assert done.returncode == 0, done.stderr
    got = _read_back(bootstrap, topic, kfeed.Schema({"id": ("int64", ()), "x": ("float64", ()),
                                                     "late": ("int32", ())}))
    assert np.array_equal(got["id"], ids) and np.array_equal(got["x"], x)
    assert np.array_equal(got["late"], np.where(ids < n - 10, 0, 7))


@pytest.mark.integration
def test_a_later_file_of_null_lists_is_filled_to_the_width_the_first_gave(bootstrap,
                                                                          make_topic,
                                                                          tmp_path) -> None:
    # Its nulls read as Arrow's null type: filled as one number a row, where
    # the first file gave two (exit 1, 2 rows sent).
    (tmp_path / "a.jsonl").write_text('{"f": [1, 2], "id": 1}\n{"f": [3, 4], "id": 2}\n')
    (tmp_path / "b.jsonl").write_text('{"f": null, "id": 3}\n')
    topic = make_topic(partitions=1)
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", str(tmp_path),
                     "--field", "f=f", "--field", "id=id", "--fill", "f=0")
    assert done.returncode == 0, done.stderr
    got = _read_back(bootstrap, topic, kfeed.Schema({"id": ("int64", ()), "f": ("int64", (2,))}))
    assert got["f"].tolist() == [[1, 2], [3, 4], [0, 0]] and got["id"].tolist() == [1, 2, 3]


@pytest.mark.integration
def test_empty_files_are_left_out_and_a_double_star_spans_folders(bootstrap, make_topic,
                                                                  tmp_path) -> None:
    # An empty .csv among a folder's stopped the run ("Empty CSV file"); '**'
    # matched one folder level, and left out the files above and below it.
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    for i, where in enumerate(("a.csv", "sub/b.csv", "sub/deeper/c.csv")):
        (tmp_path / where).write_text(f"id,label\n{i},{i}\n")
    (tmp_path / "sub" / "empty.csv").write_text("")
    topic = make_topic(partitions=1)
    for source in (str(tmp_path), str(tmp_path / "**" / "*.csv")):
        done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", source,
                         "--field", "id=id", "--field", "label=label", "--resend")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("produced 3 samples"), done.stdout
    lone = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from",
                     str(tmp_path / "sub" / "empty.csv"), "--field", "id=id")
    assert (lone.returncode, lone.stderr.strip()) == (
        2, f"kfeed: --from {tmp_path / 'sub' / 'empty.csv'}: an empty file, which holds no "
           f"rows: check the path")


@pytest.mark.integration
def test_a_row_larger_than_a_message_is_refused_before_the_topic_is_made(bootstrap,
                                                                          tmp_path) -> None:
    # It was refused once the topic was made, with the brokers' 1 MB limit: the
    # same command with -X message.max.bytes raised then wrote to that topic,
    # which refused every message.
    from confluent_kafka.admin import AdminClient

    big = np.ones((2, 300_000), np.float32)  # 1.2 MB a row
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(big.ravel()),
                                                                    300_000)}),
                   tmp_path / "big.parquet")
    topic = f"kfeed-test-{uuid.uuid4().hex}"
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from",
                     str(tmp_path / "big.parquet"), "--field", "x=x")
    assert (done.returncode, done.stderr.strip()) == (
        2, "kfeed: a record of 1200000 bytes is over message.max.bytes=1000000 less 1024 for "
           "the headers: raise message.max.bytes (and the topic's max.message.bytes)")
    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30)
    assert topic not in md.topics


def test_source_mistakes_get_one_clear_line(tmp_path, tmp_path_factory) -> None:
    closed = "127.0.0.1:1"
    pq.write_table(table(np.arange(5)), tmp_path / "a.parquet")
    feather.write_feather(table(np.arange(5)), tmp_path / "b.feather")
    texts = tmp_path_factory.mktemp("texts")
    (texts / "a.txt").write_text("a document\n")
    cases = [
        (["--from", str(texts)],
         "a text corpus is one file, --from corpus.txt (documents separated by blank lines)"),
        (["--from", str(tmp_path / "*.csv")], "no files there match the pattern"),
        (["--from", str(tmp_path)], "the files are .feather, .parquet: a run reads one format"),
        (["--from", str(tmp_path / "a.parquet"), "--query", "SELECT 1"],
         "--query reads from a database: --from postgresql://..."),
        (["--from", "postgresql://u@127.0.0.1:1/db"], "give the rows to read with --query"),
        # A password given as a parameter is a password too: it was printed back.
        (["--from", "postgresql://u@127.0.0.1:1/db?password=hunter2&sslmode=disable"],
         "--from postgresql://u@127.0.0.1:1/db?password=***&sslmode=disable: give the rows"),
        (["--from", str(tmp_path / "missing.parquet")], "no such file or directory"),
        (["--synthetic", "5", "--resume"], "--resume applies to --from samples streamed"),
        (["--synthetic", "5", "--resend"], "--resend applies to --from samples streamed"),
        (["--from", str(tmp_path / "a.parquet"), "--resume", "--resend"],
         "--resume goes on after the rows sent before and --resend sends them again"),
        # Checked against the column's type though no batch read yet has a null.
        (["--from", str(tmp_path / "a.parquet"), "--fill", "label=abc"],
         "--fill label=abc: not a value of the column's type int64"),
    ]
    # A later file of a folder or glob that is not what its name says: it was
    # "unexpected ArrowInvalid" (its rows are counted from its metadata first).
    corrupt = tmp_path_factory.mktemp("corrupt")
    pq.write_table(table(np.arange(5)), corrupt / "a.parquet")
    (corrupt / "b.parquet").write_bytes(b"PAR1 this is not parquet")
    for source in (corrupt, corrupt / "*.parquet"):
        cases.append((["--from", str(source)], "kfeed: b.parquet: not a parquet file (Could "
                      "not open Parquet input source"))
        cases.append((["--from", str(source), "--resume"], "b.parquet: not a parquet file"))
    # An Arrow IPC stream under an .arrow name: "not a ipc file".
    streamed = tmp_path_factory.mktemp("streamed") / "s.arrow"
    with pa.OSFile(str(streamed), "wb") as sink, \
            pa.ipc.new_stream(sink, table(np.arange(3)).schema) as writer:
        writer.write_table(table(np.arange(3)))
    cases.append((["--from", str(streamed)], "kfeed: s.arrow: not an Arrow IPC file (the file "
                  "format, which .arrow and .feather name; a stream is not read)"))
    if importlib.util.find_spec("adbc_driver_postgresql") is not None:
        cases.append((["--from", "postgresql://u@127.0.0.1:1/db?password=hunter2",
                       "--query", "SELECT 1 AS id"],
                      "--from postgresql://u@127.0.0.1:1/db?password=***: cannot connect"))
    for argv, line in cases:
        done = kfeed_cli(closed, "produce", "--topic", "t", *argv, timeout=60)
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        assert line in done.stderr, (argv, done.stderr)
        assert "hunter2" not in done.stdout + done.stderr, (argv, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    # Brokers away: one line, librdkafka's own (the resume's reader's too) in the log.
    done = kfeed_cli(closed, "produce", "--topic", "t", "--from", str(tmp_path / "a.parquet"),
                     "--connect-timeout", "2", timeout=60)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines() == [
        "kfeed: cannot reach the brokers at 127.0.0.1:1 within 2s: Failed to get metadata: "
        "Local: Broker transport failure (topic=t)"], done.stderr


# -- S3 (moto's server) -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen[Any], what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} within 60 s")


S3_ENV = {"AWS_ACCESS_KEY_ID": "kfeed", "AWS_SECRET_ACCESS_KEY": "kfeed-secret",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    """moto's S3 server on loopback; the query string pyarrow takes for it."""
    port = _free_port()
    with serving([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                 port, "moto's server"):
        yield f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"


@contextlib.contextmanager
def serving(argv: list[str], port: int, what: str) -> Iterator[None]:
    """The server ``argv`` runs, while it listens on ``port``; stopped after."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(port, proc, what)
        yield
    finally:
        proc.terminate()
        proc.wait(30)


def s3_fs(params: str) -> Any:
    import pyarrow.fs as pafs

    endpoint = params.split("endpoint_override=")[1].split("&")[0]
    return pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1",
                             access_key=S3_ENV["AWS_ACCESS_KEY_ID"],
                             secret_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                             allow_bucket_creation=True)


def bucket_of_parts(fs: Any, n: int) -> str:
    """A new bucket of ``fs`` holding rows 0..n-1 in train/part-*.parquet, and other/x.parquet."""
    bucket = f"kfeed-{uuid.uuid4().hex[:8]}"
    fs.create_dir(bucket)
    for i in range(0, n, 40_000):
        pq.write_table(table(np.arange(i, i + 40_000)), f"{bucket}/train/part-{i:06d}.parquet",
                       filesystem=fs, row_group_size=2500)
    pq.write_table(table(np.arange(3)), f"{bucket}/other/x.parquet", filesystem=fs)
    return bucket


@pytest.mark.integration
def test_parquet_on_s3_arrives_once_and_resumes_after_a_kill(bootstrap, make_topic,
                                                            s3_server) -> None:
    n = 200_000
    bucket = bucket_of_parts(s3_fs(s3_server), n)
    arrives_once_then_resumes(bootstrap, make_topic, f"s3://{bucket}/train?{s3_server}",
                              f"s3://{bucket}/train/part-*.parquet?{s3_server}", n, env=S3_ENV)


# -- GCS (fake-gcs-server, built from its Go module) ------------------------------------

FAKE_GCS = "github.com/fsouza/fake-gcs-server@v1.56.1"


def fake_gcs_server() -> Path:
    """The fake-gcs-server program: built once with ``go install`` into kfeed's cache."""
    binary = cache_root() / "fake-gcs-server" / "fake-gcs-server"
    if binary.exists():
        return binary
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists()
                                else None)
    if go is None:
        pytest.skip("no Go toolchain to build fake-gcs-server with")
    binary.parent.mkdir(parents=True, exist_ok=True)
    built = subprocess.run([go, "install", FAKE_GCS], capture_output=True, text=True,
                           timeout=500, env={**os.environ, "GOBIN": str(binary.parent),
                                             "CGO_ENABLED": "0"})
    assert built.returncode == 0, built.stderr[-2000:]
    return binary


@pytest.fixture(scope="module")
def gcs_server() -> Iterator[str]:
    """fake-gcs-server on loopback; the query string of a gs:// URI for it."""
    port = _free_port()
    with serving([str(fake_gcs_server()), "-backend", "memory", "-scheme", "http", "-host",
                  "127.0.0.1", "-port", str(port), "-log-level", "error"], port,
                 "fake-gcs-server"):
        yield f"endpoint_override=127.0.0.1:{port}&scheme=http&anonymous=true"


@pytest.mark.integration
def test_parquet_on_gcs_arrives_once_and_resumes_after_a_kill(bootstrap, make_topic,
                                                             gcs_server) -> None:
    import pyarrow.fs as pafs

    endpoint = gcs_server.split("endpoint_override=")[1].split("&")[0]
    fs = pafs.GcsFileSystem(anonymous=True, endpoint_override=endpoint, scheme="http",
                            project_id="kfeed-test")
    n = 120_000
    bucket = bucket_of_parts(fs, n)
    arrives_once_then_resumes(bootstrap, make_topic, f"gs://{bucket}/train?{gcs_server}",
                              f"gs://{bucket}/train/part-*.parquet?{gcs_server}", n)


def test_gcs_requests_are_retried_for_a_minute_unless_the_uri_says() -> None:
    import datetime

    from kfeed.ingest import GCS_RETRY_S, remote_filesystem

    def options(query: str) -> dict:
        fs, path = remote_filesystem("gs://b/x", query)
        assert path == "b/x"
        return fs.__reduce__()[1][0]  # what the file system was made with

    at = "endpoint_override=127.0.0.1:9&scheme=http"
    minute = datetime.timedelta(seconds=GCS_RETRY_S)
    assert options(at)["retry_time_limit"] == minute  # pyarrow's own: none set
    assert options(f"{at}&anonymous=true")["retry_time_limit"] == minute
    assert options(f"{at}&anonymous=true")["anonymous"] is True
    assert options(f"{at}&retry_limit_seconds=5")["retry_time_limit"].total_seconds() == 5


def test_gcs_uri_mistakes_get_one_clear_line(tmp_path) -> None:
    closed = "127.0.0.1:9"  # nothing is sent: the URI is refused first
    for uri, line in [
        ("gs://b/x.parquet?anonymous=maybe", "anonymous='maybe': say true or false"),
        ("gs://b/x.parquet?anonymous=true&region=eu", "unknown option 'region' for gs://"),
        ("gs://b/x.parquet?anonymous=true&retry_limit_seconds=soon", "is not a number"),
        # Nothing listens there: given up after the retry limit, not minutes later.
        ("gs://b/x.parquet?endpoint_override=127.0.0.1:9&scheme=http&anonymous=true"
         "&retry_limit_seconds=1", "cannot open it"),
    ]:
        done = kfeed_cli(closed, "produce", "--topic", "t", "--from", uri, timeout=60)
        assert done.returncode == 2, (uri, done.stdout, done.stderr)
        assert line in done.stderr, (uri, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


# -- HDFS (Hadoop's MiniDFSCluster, from Maven) -----------------------------------------

HDFS_DIR = Path(__file__).with_name("hdfs")


def hdfs_jars() -> Path:
    """The MiniDFSCluster's jars: copied once by Maven into kfeed's cache."""
    libs = cache_root() / "hdfs-minicluster" / "libs"
    if any(libs.glob("hadoop-client-minicluster-*.jar")):
        return libs
    if not (shutil.which("mvn") and shutil.which("java")):
        pytest.skip("no Maven or Java to run Hadoop's MiniDFSCluster with")
    libs.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".libs-", dir=libs.parent))
    try:
        done = subprocess.run(["mvn", "-B", "-q", "-f", str(HDFS_DIR / "pom.xml"),
                               "dependency:copy-dependencies", f"-DoutputDirectory={tmp}",
                               "-DincludeScope=runtime"],
                              capture_output=True, text=True, timeout=500)
        assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
        tmp.rename(libs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return libs


@pytest.fixture(scope="module")
def hdfs_server(tmp_path_factory) -> Iterator[str]:
    """A MiniDFSCluster (one NameNode, one DataNode) on loopback; its hdfs:// address."""
    pytest.importorskip("hdfs_native")
    libs = hdfs_jars()
    port = _free_port()
    log = tmp_path_factory.mktemp("hdfs") / "minicluster.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["java", "-Xmx512m", "-cp", f"{libs}/*",
                                 str(HDFS_DIR / "MiniHdfs.java"),
                                 str(log.parent / "data"), str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "ready hdfs://" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "the MiniDFSCluster did not start in 180 s"
            time.sleep(0.2)
        yield f"hdfs://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.integration
def test_parquet_on_hdfs_arrives_once_and_resumes_after_a_kill(bootstrap, make_topic,
                                                              hdfs_server) -> None:
    import io

    from hdfs_native import Client

    client = Client(hdfs_server)
    root = f"/kfeed-{uuid.uuid4().hex[:8]}"
    n = 120_000
    for i in range(0, n, 40_000):
        buf = io.BytesIO()
        pq.write_table(table(np.arange(i, i + 40_000)), buf, row_group_size=2500)
        with client.create(f"{root}/train/part-{i:06d}.parquet") as f:
            f.write(buf.getvalue())
    arrives_once_then_resumes(bootstrap, make_topic, f"{hdfs_server}{root}/train",
                              f"{hdfs_server}{root}/train/part-*.parquet", n)


def test_hdfs_without_libhdfs_says_what_to_do(monkeypatch) -> None:
    import pyarrow.fs as pafs

    from kfeed.ingest import remote_filesystem

    try:
        pafs.FileSystem.from_uri("hdfs://127.0.0.1:9/")
    except OSError:
        pass  # no JVM or libhdfs: what this test is about
    else:
        pytest.skip("pyarrow loads libhdfs here")
    with pytest.raises(kfeed.ConfigError, match="leave the query out"):
        remote_filesystem("hdfs://127.0.0.1:9/x.parquet", "user=a")
    with pytest.raises(kfeed.ConfigError, match="no NameNode answers at 127.0.0.1:9"):
        remote_filesystem("hdfs://127.0.0.1:9/x.parquet", "")  # (hdfs-native would wait)
    monkeypatch.setitem(sys.modules, "hdfs_native.fsspec", None)  # as if not installed
    with pytest.raises(kfeed.ConfigError, match=r"install hdfs-native \(pip install"):
        remote_filesystem("hdfs://127.0.0.1:9/x.parquet", "")


# -- PostgreSQL (Debian's package) ----------------------------------------------------


def postgres_bin() -> Path:
    """The folder of Debian's PostgreSQL server programs: installed, or unpacked into the cache."""
    for found in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (found / "initdb").exists():
            return found
    unpacked = cache_root() / "postgresql-deb"
    done = sorted(unpacked.glob("usr/lib/postgresql/*/bin/initdb"))
    if done:
        return done[-1].parent
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb") and shutil.which("apt-cache")):
        pytest.skip("no PostgreSQL, and no apt-get to fetch Debian's package of it")

    def server_package() -> str | None:
        found = subprocess.run(["apt-cache", "search", "--names-only", r"^postgresql-[0-9]+$"],
                               capture_output=True, text=True, check=False, timeout=120)
        names = sorted((line.split()[0] for line in found.stdout.splitlines() if line),
                       key=lambda name: int(name.split("-")[1]))
        return names[-1] if names else None

    package = server_package()
    if package is None:
        subprocess.run(["apt-get", "update"], check=True, capture_output=True, timeout=600)
        package = server_package()
    assert package is not None, "Debian has no postgresql-N package here"
    work = Path(tempfile.mkdtemp(prefix="kfeed-pgdeb-"))
    try:
        for name in (package, "libpq5"):
            subprocess.run(["apt-get", "download", name], cwd=work, check=True,
                           capture_output=True, timeout=600)
        tmp = unpacked.with_name(f".postgresql-deb-{os.getpid()}")
        for deb in work.glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True, timeout=300)
        tmp.rename(unpacked)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return next(unpacked.glob("usr/lib/postgresql/*/bin/initdb")).parent


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A PostgreSQL server on loopback, trust auth for user kfeed; its URI."""
    bindir = postgres_bin()
    root = Path(tempfile.mkdtemp(prefix="kfeed-pg-"))
    user: tuple[int, int] | None = None
    if os.geteuid() == 0:  # PostgreSQL will not run as root: it runs as nobody
        nobody = pwd.getpwnam("nobody")
        user = (nobody.pw_uid, nobody.pw_gid)
        unpacked = cache_root() / "postgresql-deb"
        if unpacked in bindir.parents:  # under root's home: a copy nobody can read
            shutil.copytree(unpacked, root / "deb", symlinks=True)
            bindir = root / "deb" / bindir.relative_to(unpacked)
        root.chmod(0o755)
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if user:
        for p in (root, sock):
            os.chown(p, *user)

    def as_user() -> None:
        if user:
            os.setgid(user[1])
            os.setuid(user[0])

    libs = sorted({str(p.parent) for p in bindir.parents[3].glob("lib/*/libpq.so*")})
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(libs + [os.environ.get(
        "LD_LIBRARY_PATH", "")])}
    subprocess.run([str(bindir / "initdb"), "-D", str(data), "-U", "kfeed", "--auth=trust",
                    "-E", "UTF8", "--no-sync"], check=True, capture_output=True, timeout=300,
                   preexec_fn=as_user, env=env)
    port = _free_port()
    log = open(root / "postgres.log", "w")  # noqa: SIM115 - closed after the server stops
    proc = subprocess.Popen([str(bindir / "postgres"), "-D", str(data), "-h", "127.0.0.1",
                             "-p", str(port), "-k", str(sock), "-c", "fsync=off"],
                            stdout=log, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=as_user)  # noqa: PLW1509 - drops root before exec
    try:
        _wait_for_port(port, proc, "postgres")
        yield f"postgresql://kfeed@127.0.0.1:{port}/postgres"
    finally:
        proc.send_signal(signal.SIGINT)  # PostgreSQL's fast shutdown
        proc.wait(60)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.integration
def test_a_query_arrives_once_and_resumes_after_a_kill(bootstrap, make_topic,
                                                      postgres) -> None:
    import adbc_driver_postgresql.dbapi as pg

    n = 200_000
    name = f"samples_{uuid.uuid4().hex[:8]}"
    ids = np.arange(n)
    feats = (ids[:, None] * 0.5 + np.arange(WIDTH)).astype(np.float32)
    rows = pa.table({"id": pa.array(ids[::-1].copy()),  # stored out of order: ORDER BY sorts
                     "label": pa.array(ids[::-1] % 10),
                     "features": pa.array(list(feats[::-1]), pa.list_(pa.float32()))})
    with pg.connect(postgres) as conn, conn.cursor() as cur:
        cur.adbc_ingest(name, rows, mode="create")
        cur.execute(f"CREATE SEQUENCE {name}_runs")
        conn.commit()

    def runs() -> int:  # how many times the query ran: its subquery takes a number each time
        with pg.connect(postgres) as conn, conn.cursor() as cur:
            cur.execute(f"SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {name}_runs")
            return int(cur.fetchone()[0])

    query = f"SELECT features, label, id, (SELECT nextval('{name}_runs')) AS run FROM {name} " \
            f"ORDER BY id"
    topic = make_topic(partitions=3)
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", postgres, "--query",
                     query)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"produced {n:,} samples"), done.stdout
    check_topic(bootstrap, topic, n)
    # The run read the result twice: once opened for its schema, then again.
    assert runs() == 1
    again = make_topic(partitions=3)
    kill_then_resume(bootstrap, again, ["--from", postgres, "--query", query], n)
    # The killed run and the resume: once each (the resume ran it three times).
    assert runs() == 3


def _active(postgres: str, marker: str) -> bool:
    """Whether a query holding ``marker`` runs on the server."""
    import adbc_driver_postgresql.dbapi as pg

    with pg.connect(postgres) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND "
                    f"query LIKE '%{marker}%' AND pid <> pg_backend_pid()")
        return int(cur.fetchone()[0]) > 0


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_query_runs_ends_the_command_and_the_query_at_once(
        bootstrap, make_topic, postgres, sig) -> None:
    # A call into the driver held the main thread, and the command's handlers
    # with it: a SIGTERM waited for the query's first row (27 s of 30), and
    # SIGINT, caught by the driver's own handler, ended in "--query: ...
    # current transaction is aborted", exit 2.
    marker = f"m{uuid.uuid4().hex[:12]}"
    query = (f"SELECT i::bigint AS id, i::bigint AS label, ARRAY[i::real] AS features, "
             f"'{marker}' AS marker FROM generate_series(0, 9) i WHERE pg_sleep(60) IS NOT NULL")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kfeed", "produce", "--topic", make_topic(partitions=1),
         "--from", postgres, "--query", query], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "KFEED_BOOTSTRAP": bootstrap},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    try:
        deadline = time.monotonic() + 60
        while not _active(postgres, marker) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(sig)
        t0 = time.monotonic()
        _out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
        lines = err.splitlines()
        assert proc.returncode == 128 + sig and len(lines) == 1 and \
            lines[0].startswith("kfeed: "), (proc.returncode, lines)
        assert took < 10, took
        deadline = time.monotonic() + 10  # cancelled, not left running on the server
        while _active(postgres, marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _active(postgres, marker)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.integration
def test_an_error_in_a_query_s_result_after_rows_were_sent_says_resume(bootstrap, make_topic,
                                                                       postgres) -> None:
    # The driver's error came out as "unexpected OSError" with a traceback's
    # hint, and never said that the rows before it were sent and recorded.
    n, bad = 300_000, 250_000
    # (The division above the sort: under it, every row is computed before the first
    # is sent, and the error comes first.)
    query = (f"SELECT id, label, (1 / ({bad} - id))::bigint AS x FROM (SELECT i::bigint AS "
             f"id, (i % 10)::bigint AS label FROM generate_series(0, {n - 1}) i ORDER BY i) s")
    topic = make_topic(partitions=1)
    args = ["produce", "--topic", topic, "--from", postgres, "--query", query,
            "--field", "id=id", "--field", "x=x", "--transaction-mb", "1"]
    done = kfeed_cli(bootstrap, *args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    sent = int(re.search(r"\(([\d,]+) rows before it were sent and recorded: after the fix, "
                         r"run again with --resume", lines[0])[1].replace(",", ""))
    assert lines[0].startswith("kfeed: --query: ") and "division by zero" in lines[0], lines
    assert 0 < sent < bad
    got = _read_back(bootstrap, topic, kfeed.Schema({"id": ("int64", ()), "x": ("int64", ())}))
    assert got["id"].tolist() == list(range(sent))  # what was recorded, once


@pytest.mark.integration
@pytest.mark.parametrize("column, line", [
    # The driver reads an oid as int32: 4000000000 was sent as -294967296.
    ("4000000000::oid AS u", "column 'u' of the query on {where} is PostgreSQL's oid, an "
     "unsigned 32-bit number that the driver reads as int32 (a value past 2**31 - 1 "
     "negative): cast it in the query (u::bigint)"),
    ("2.5::numeric AS u", "column 'u' of the query on {where} is PostgreSQL's numeric, which "
     "kfeed produce cannot send: cast it in the query (u::float8, or u::bigint for whole "
     "numbers)"),
])
def test_a_query_column_the_driver_reads_wrong_is_refused(bootstrap, postgres, column,
                                                          line) -> None:
    done = kfeed_cli(bootstrap, "produce", "--topic", "never-made", "--from", postgres,
                     "--query", f"SELECT 1::bigint AS id, {column}", "--field", "id=id",
                     "--field", "u=u")
    where = postgres.split("@")[1]
    assert (done.returncode, done.stderr) == (2, f"kfeed: {line.format(where=where)}\n")


@pytest.mark.integration
def test_a_query_with_two_columns_of_one_name_is_refused_in_one_line(bootstrap, postgres) -> None:
    done = kfeed_cli(bootstrap, "produce", "--topic", "never-made", "--from", postgres,
                     "--query", "SELECT 1::bigint AS id, 2::bigint AS label, 3::bigint AS id",
                     "--field", "id=id", "--field", "label=label")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "kfeed: the query on 127.0.0.1:" + postgres.split(":")[-1].split("/")[0]
        + "/postgres has 2 columns named 'id', which field 'id' reads: give each a name of "
          "its own (in a query, ... AS other_name)"], done.stderr


@pytest.mark.integration
def test_a_source_that_pauses_longer_than_the_transaction_timeout_loses_nothing(
        bootstrap, make_topic, postgres) -> None:
    # A query whose rows stop coming for a while (a slow join, a busy
    # database): the open transaction must not wait for them, or the brokers
    # abort it once it is older than transaction.timeout.ms (4 s here, checked
    # by the brokers every 10 s: the pause outlasts both).
    n, pause_at = 60_000, 30_000
    query = (f"SELECT i::bigint AS id, (i % 10)::bigint AS label, "
             f"ARRAY(SELECT (i * 0.5 + j)::real FROM generate_series(0, {WIDTH - 1}) j) "
             f"AS features FROM generate_series(0, {n - 1}) i "
             f"WHERE i <> {pause_at} OR pg_sleep(14) IS NOT NULL")  # rows stream in order
    topic = make_topic(partitions=3)
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", postgres,
                     "--query", query, "-X", "transaction.timeout.ms=4000")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"produced {n:,} samples"), done.stdout
    check_topic(bootstrap, topic, n)


@pytest.mark.integration
def test_credentials_in_an_s3_uri_are_never_printed(bootstrap, make_topic, s3_server) -> None:
    # pyarrow takes s3://KEY:SECRET@bucket/...: kfeed printed the URI back whole.
    fs = s3_fs(s3_server)
    bucket = f"kfeed-{uuid.uuid4().hex[:8]}"
    fs.create_dir(bucket)
    for part in ("a", "b"):  # no rows: "nothing to send" names the source
        pq.write_table(table(np.arange(0)), f"{bucket}/empty/{part}.parquet", filesystem=fs)
    secret = "TopSecretValue123"
    at = f"s3://{S3_ENV['AWS_ACCESS_KEY_ID']}:{secret}@{bucket}"
    topic = make_topic(partitions=1)
    for argv, code, line in (
            ([f"{at}/empty?{s3_server}"], 0, "nothing to send: s3://kfeed:***@"),
            ([f"{at}/empty?{s3_server}&session_token={secret}"], 2, "session_token=***"),
            ([f"{at}/nothing?{s3_server}"], 2, "--from s3://kfeed:***@")):
        done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", *argv, timeout=120,
                         env={"AWS_EC2_METADATA_DISABLED": "true"})
        out = done.stdout + done.stderr
        assert done.returncode == code and line in out, out
        assert secret not in out, out
    assert shown(f"{at}/p?secret_key=x&region=eu") == \
        f"s3://kfeed:***@{bucket}/p?secret_key=***&region=eu"
    assert shown("data/*.parquet") == "data/*.parquet"


def test_only_a_uri_s_authority_holds_a_password() -> None:
    # An "@" anywhere was taken for the end of a user's password: a path with
    # one was shown (and named its job) with a password put in, and so was a
    # user named without one.
    for uri in ("file:///data/a@b/x.parquet", "s3://bucket/runs@2024/*.parquet",
                "postgresql://reader@db/warehouse", "/data/a@b", "gs://b/p?note=a@b"):
        assert no_password(uri) == shown(uri) == uri
    assert no_password("s3://key:pass@bucket/runs@2024/x") == "s3://key:***@bucket/runs@2024/x"
    assert no_password("http://u:p@ss@h:8/x") == "http://u:***@h:8/x"  # an "@" in the password
    assert no_password("postgresql://u:p@h") == "postgresql://u:***@h"
    for password in ("pa?ss", "pa#ss"):  # (libpq takes them so)
        assert no_password(f"postgresql://u:{password}@host/db") == "postgresql://u:***@host/db"


def test_a_job_is_named_by_its_source_without_its_secrets() -> None:
    assert source_key("postgresql://reader:hunter2@db:5432/wh") == \
        "postgresql://reader:***@db:5432/wh"
    assert source_key("s3://b/p/*.parquet?secret_key=x&region=eu&access_key=y&scheme=http") == \
        "s3://b/p/*.parquet?region=eu&scheme=http"
    assert source_key("s3://b/p?scheme=http&region=eu") == source_key("s3://b/p?region=eu&scheme=http")
    assert job_id("t", source_key("postgresql://u:old@h/d"), "SELECT 1") == \
        job_id("t", source_key("postgresql://u:new@h/d"), "SELECT 1")
    # A password given or read from ~/.pgpass: one job. And the names jobs were
    # first recorded under stay theirs (an "@" in a path too), or a rerun sends
    # every row again.
    assert source_key("postgresql://reader@db/wh") == "postgresql://reader:***@db/wh"
    assert job_id("t", source_key("s3://b/runs@2024/x.parquet"), None) == \
        "kfeed-produce.t.913fbb4e4cac"


def test_a_local_job_is_named_by_its_absolute_path(tmp_path, monkeypatch) -> None:
    # However the path is typed, one job; the same relative path elsewhere, another.
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    key = source_key(str(tmp_path / "data"))
    assert source_key("data") == source_key("data/") == source_key("./data") == key
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert source_key("data") != key
    assert source_key("../data/*.parquet") == f"{key}/*.parquet"


def test_a_glob_s_question_mark_is_a_wildcard_and_hidden_folders_are_left_out(tmp_path) -> None:
    from kfeed.ingest import DatasetRows, split_params

    for name in ("x1", "x2", "x10"):
        pq.write_table(table(np.arange(3)), tmp_path / f"{name}.parquet")
    # Written beside the data by Spark, Hadoop and others: never rows to send.
    for hidden in ("_temporary/0/part-0.parquet", ".staging/x3.parquet", "_SUCCESS"):
        (tmp_path / hidden).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table(np.arange(3)), tmp_path / hidden)
    names = [Path(f).name for f in DatasetRows(str(tmp_path / "x?.parquet")).files]
    assert names == ["x1.parquet", "x2.parquet"]
    assert [Path(f).relative_to(tmp_path).as_posix()
            for f in DatasetRows(str(tmp_path)).files] == \
        ["x1.parquet", "x10.parquet", "x2.parquet"]
    assert split_params("s3://b/part-?.parquet?endpoint_override=h:1&scheme=http") == \
        ("s3://b/part-?.parquet", "endpoint_override=h:1&scheme=http")
    assert split_params("s3://b/part-?.parquet") == ("s3://b/part-?.parquet", "")
    assert split_params("/data/x?.parquet") == ("/data/x?.parquet", "")


def test_a_file_or_folder_named_with_glob_characters_is_read_as_it_is_named(tmp_path) -> None:
    from kfeed.ingest import DatasetRows, is_stream

    (tmp_path / "run[2024]").mkdir()
    pq.write_table(table(np.arange(3)), tmp_path / "run[2024]" / "data[1].parquet")
    pq.write_table(table(np.arange(3, 5)), tmp_path / "run[2024]" / "data1.parquet")
    one = str(tmp_path / "run[2024]" / "data[1].parquet")
    assert is_stream(one, None, False) and is_stream(str(tmp_path / "run[2024]"), None, False)
    assert [Path(f).name for f in DatasetRows(one).files] == ["data[1].parquet"]
    assert [Path(f).name for f in DatasetRows(str(tmp_path / "run[2024]")).files] == \
        ["data1.parquet", "data[1].parquet"]
    # A glob in such a folder: its name as it is, the file's as a pattern
    # (the folder's brackets were a pattern too, and matched nothing).
    inside = str(tmp_path / "run[2024]" / "data?.parquet")
    assert is_stream(inside, None, False)
    assert [Path(f).name for f in DatasetRows(inside).files] == ["data1.parquet"]
    # Where no such file is, the brackets are a pattern still.
    pq.write_table(table(np.arange(3)), tmp_path / "data7.parquet")
    pattern = str(tmp_path / "data[0-9].parquet")
    assert [Path(f).name for f in DatasetRows(pattern).files] == ["data7.parquet"]


def test_a_later_file_without_a_column_is_named(tmp_path) -> None:
    from kfeed.ingest import DatasetRows

    pq.write_table(table(np.arange(3)), tmp_path / "a.parquet")
    pq.write_table(table(np.arange(3, 5)).drop_columns(["label"]), tmp_path / "b.parquet")
    rows = DatasetRows(str(tmp_path))
    got = rows.batches(["features", "label", "id"])
    assert next(got).num_rows == 3 and rows.where == "a.parquet"
    with pytest.raises(kfeed.ConfigError, match=r"^b.parquet has no column 'label', which the "
                                                 r"files before it have: give every file the "
                                                 r"same columns$"):
        next(got)


def test_a_later_file_of_no_rows_without_a_column_holds_nothing_missing(tmp_path) -> None:
    # A writer's empty part with another schema stopped the run: no column,
    # though no row lacked a value.
    from kfeed.ingest import DatasetRows

    pq.write_table(table(np.arange(3)), tmp_path / "a.parquet")
    pq.write_table(table(np.arange(0)).drop_columns(["label"]), tmp_path / "b.parquet")
    pq.write_table(table(np.arange(3, 5)), tmp_path / "c.parquet")
    rows = DatasetRows(str(tmp_path))
    got = list(rows.batches(["features", "label", "id"]))
    assert np.concatenate([b["id"].to_numpy() for b in got]).tolist() == [0, 1, 2, 3, 4]
    assert rows._ends == [3, 3, 5]
    # One that sorts first: pyarrow took the dataset's columns from it, and
    # the run stopped ("has no column 'label' for field 'label' (it has: id)").
    (tmp_path / "a.parquet").rename(tmp_path / "d.parquet")
    (tmp_path / "b.parquet").rename(tmp_path / "a.parquet")
    rows = DatasetRows(str(tmp_path))
    assert "label" in rows.names() and rows.total == 5
    got = list(rows.batches(["features", "label", "id"]))
    assert np.concatenate([b["id"].to_numpy() for b in got]).tolist() == [3, 4, 0, 1, 2]
    assert np.concatenate([b["label"].to_numpy() for b in got]).tolist() == \
        (np.array([3, 4, 0, 1, 2]) % 10).tolist()


def test_a_column_of_empty_lists_is_named_with_what_to_do() -> None:
    # It was "field 'x': dimensions must be positive, got (0,)": no file,
    # no column, nothing to do about it.
    from kfeed.ingest import batch_columns

    batch = pa.record_batch({"x": pa.array([[], []], pa.list_(pa.float32())), "id": [0, 1]})
    with pytest.raises(kfeed.ConfigError, match=r"^column 'x' of el\.parquet \(field 'x'\) "
                                                 r"holds only empty lists: a field needs an "
                                                 r"element a row at least; leave the column out"):
        batch_columns("el.parquet", batch, {"x": "x", "id": "id"}, {}, {})


def test_a_source_through_a_link_is_the_job_of_the_files_it_names(tmp_path) -> None:
    # The job is named with links resolved, but its files' marks were not:
    # a --resume through a link refused every run as "changed since".
    from kfeed.ingest import DatasetRows

    (tmp_path / "real").mkdir()
    for k in range(2):
        pq.write_table(table(np.arange(3 * k, 3 * k + 3)), tmp_path / "real" / f"{k}.parquet")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    real, link = DatasetRows(str(tmp_path / "real")), DatasetRows(str(tmp_path / "link"))
    assert source_key(str(tmp_path / "link")) == source_key(str(tmp_path / "real"))
    list(real.batches(["id"]))
    link.check_mark(real.mark(6), 6)  # nothing changed: no error
    assert link.files == real.files


@pytest.mark.parametrize("suffix, rows", [(".jsonl", '{"id": 1}\n{"id": 2}\n'),
                                          (".csv", "id\n1\n2\n")])
def test_a_file_of_blank_lines_holds_no_rows(tmp_path, suffix, rows) -> None:
    # pyarrow refuses one ("Empty JSON stream", "Empty CSV file"): among a
    # folder's files it stopped the run, and first in it, it was "not a json file".
    from kfeed.ingest import DatasetRows

    for blank_first in (True, False):
        folder = tmp_path / f"first-{blank_first}"
        folder.mkdir()
        (folder / f"{'a' if blank_first else 'c'}{suffix}").write_text("\n  \n\t\n")
        (folder / f"b{suffix}").write_text(rows)
        got = DatasetRows(str(folder))
        assert [Path(f).name for f in got.files] == [f"b{suffix}"]
        assert sum(b.num_rows for b in got.batches(["id"])) == 2
    lone = folder / f"c{suffix}"
    with pytest.raises(kfeed.ConfigError, match=rf"^--from {re.escape(str(lone))}: an empty "
                                                 rf"file \(only blank lines\), which holds no "
                                                 rf"rows: check the path$"):
        DatasetRows(str(lone))


@pytest.mark.integration
def test_a_later_file_that_differs_is_named_in_the_run_and_in_its_resume(bootstrap, make_topic,
                                                                         tmp_path) -> None:
    # A list of another width in the second file: the first run sent the first
    # file's rows; the resume must not send the second's (its first batch was unchecked).
    topic = make_topic(partitions=1)
    pq.write_table(table(np.arange(0, 2000)), tmp_path / "a.parquet")
    wide = table(np.arange(2000, 2100))
    wide = wide.set_column(0, "features", pa.FixedSizeListArray.from_arrays(
        pa.array(np.zeros(100 * 8, np.float32)), 8))
    pq.write_table(wide, tmp_path / "b.parquet")
    argv = ("produce", "--topic", topic, "--from", str(tmp_path), "--transaction-mb", "0.1",
            "--progress-every", "600")
    done = kfeed_cli(bootstrap, *argv)
    assert done.returncode == 1, (done.stdout, done.stderr)
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("kfeed: b.parquet: a later batch gives ") and line.endswith(
        f"(2,000 rows before it were sent and recorded: {cli._AFTER_THE_FIX})"), line
    again = kfeed_cli(bootstrap, *argv, "--resume")
    assert again.returncode == 2, (again.stdout, again.stderr)
    assert again.stderr.strip().splitlines()[-1].startswith(
        "kfeed: b.parquet: a later batch gives "), again.stderr
    check_topic(bootstrap, topic, 2000)
    # A file that cannot be read after some rows were sent says how many were.
    csv = tmp_path / "csv"
    csv.mkdir()
    lines = ["id,label"] + [f"{i},{i % 10}" for i in range(70_000)]
    (csv / "a.csv").write_text("\n".join(lines) + "\n")
    (csv / "b.csv").write_text("id,label\n70000,2,5\n")  # a row of three columns
    topic = make_topic(partitions=1)
    done = kfeed_cli(bootstrap, "produce", "--topic", topic, "--from", str(csv), "--field",
                     "id=id", "--field", "label=label", "--transaction-mb", "0.1",
                     "--progress-every", "600")
    assert done.returncode == 1, (done.stdout, done.stderr)
    line = done.stderr.strip().splitlines()[-1]
    # (Every row before the batch that failed: the open transaction's rows are
    # committed before the error is raised; it said 65,536, a batch's worth less.)
    assert line.startswith("kfeed: b.csv: ") and "3" in line and line.endswith(
        f"(70,000 rows before it were sent and recorded: {cli._AFTER_THE_FIX})"), line


def test_a_stalled_send_holds_a_few_batches_not_the_file(tmp_path) -> None:
    # While the producer waits on the brokers, pyarrow must not read on: its
    # own read-ahead held most of a file (1.2 to 2.7 GB seen).
    from kfeed.ingest import STREAM_BATCH_ROWS, DatasetRows, ReadAhead

    width, groups = 16, 40
    batch_bytes = STREAM_BATCH_ROWS * (width * 4 + 16)
    writer = None
    for g in range(groups):
        ids = np.arange(g * STREAM_BATCH_ROWS, (g + 1) * STREAM_BATCH_ROWS)
        feats = np.ones(STREAM_BATCH_ROWS * width, np.float32)
        t = pa.table({"id": ids, "label": ids,
                      "features": pa.FixedSizeListArray.from_arrays(pa.array(feats), width)})
        if writer is None:
            writer = pq.ParquetWriter(tmp_path / "big.parquet", t.schema, compression="none")
        writer.write_table(t, row_group_size=STREAM_BATCH_ROWS)
    writer.close()
    del t, feats, ids
    rows = DatasetRows(str(tmp_path / "big.parquet"))
    batches = ReadAhead(rows.batches(["features", "id", "label"]))
    try:
        first = next(batches)
        assert first.num_rows == STREAM_BATCH_ROWS
        most = 0
        deadline = time.monotonic() + 2.0  # a stalled send: nothing taken for a while
        # The one taken, ReadAhead's two and the one it waits to put, pyarrow's
        # one ahead, and the row groups they are slices of: about 10 here.
        while time.monotonic() < deadline and most <= 12 * batch_bytes:
            most = max(most, pa.total_allocated_bytes())
            time.sleep(0.05)
        assert most <= 12 * batch_bytes, (most / batch_bytes, "batches held")
        assert sum(b.num_rows for b in batches) == (groups - 1) * STREAM_BATCH_ROWS
    finally:
        batches.close()


def test_read_ahead_keeps_order_raises_errors_waits_as_asked_and_stops_when_closed() -> None:
    import threading

    from kfeed.ingest import ReadAhead

    assert list(ReadAhead(iter(range(100)), depth=3)) == list(range(100))

    def failing() -> Iterator[int]:
        yield 1
        raise OSError("the disk went away")

    got = ReadAhead(failing())
    assert next(got) == 1
    with pytest.raises(OSError, match="the disk went away"):
        next(got)
    with pytest.raises(StopIteration):
        next(got)

    release = threading.Event()

    def slow() -> Iterator[int]:
        yield 1
        release.wait(30)
        yield 2

    late = ReadAhead(slow())
    assert late.take(5.0) == 1
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        late.take(0.2)
    assert 0.15 < time.monotonic() - t0 < 5.0
    release.set()
    assert late.take(5.0) == 2
    with pytest.raises(StopIteration):
        late.take(5.0)

    closed = threading.Event()

    def endless() -> Iterator[int]:
        try:
            n = 0
            while True:
                yield n
                n += 1
        finally:
            closed.set()

    ahead = ReadAhead(endless(), depth=2)
    assert [next(ahead) for _ in range(5)] == [0, 1, 2, 3, 4]
    ahead.close()  # the thread stops and closes its source before close() returns
    assert closed.is_set()
    assert not any(t.name == "kfeed-read-ahead" for t in threading.enumerate())


def test_read_ahead_cancels_a_read_under_way_when_closed_and_leaves_one_stuck(
        monkeypatch) -> None:
    # A read that blocks (a slow query) held close() for as long as it took.
    import threading

    from kfeed import ingest

    monkeypatch.setattr(ingest, "CANCEL_WAIT_S", 0.3)
    cancelled = threading.Event()

    def blocked(unblock: threading.Event) -> Iterator[int]:
        yield 1
        unblock.wait(30)
        yield 2

    ahead = ingest.ReadAhead(blocked(cancelled), cancel=cancelled.set)
    assert ahead.take(5.0) == 1
    t0 = time.monotonic()
    ahead.close()
    assert cancelled.is_set() and not ahead.stuck and time.monotonic() - t0 < 2
    never = threading.Event()
    stuck = ingest.ReadAhead(blocked(never), cancel=lambda: None)
    assert stuck.take(5.0) == 1
    t0 = time.monotonic()
    stuck.close()  # left behind: the source must not be closed under it
    assert stuck.stuck and time.monotonic() - t0 < 2
    never.set()
