"""kfeed convert: a topic others write, re-encoded into blocks once, exactly once.

The source topics are written by confluent-kafka's ``AvroSerializer`` and by
``json.dumps``; what the loader then reads from the block topic must equal
what confluent-kafka's deserializer (or ``json.loads``) returns, record for
record. A convert killed with SIGKILL mid-topic and started again must have
written every record once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka import Producer as KafkaProducer
from records import read_columns
from test_avro import SCHEMA, check_clicks, produce_clicks, registry  # noqa: F401

import kfeed

pytestmark = pytest.mark.integration


def test_an_avro_topic_converts_to_blocks_equal_to_confluent_kafkas_deserializer(
        bootstrap, make_topic, registry):  # noqa: F811
    src = make_topic(partitions=3)
    records, bad = produce_clicks(bootstrap, src, registry)  # a schema change at the half
    seen = []
    stats = kfeed.convert({"bootstrap.servers": bootstrap}, src, src + ".blocks", SCHEMA,
                          format=kfeed.Avro(registry=registry), round_messages=3000,
                          progress=seen.append)
    assert (stats.records, stats.bad, stats.messages) == (10_000, len(bad), 10_000 + len(bad))
    assert stats.transactions >= 4 and seen and seen[-1].records == 10_000
    cols = read_columns(bootstrap, src + ".blocks", SCHEMA, batch_size=1000)
    check_clicks(cols, records, bootstrap, src, bad)
    # The blocks and their bytes are the topic's: the dead-letter copies were
    # counted among them (and among the producer's series of the topic).
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "enable.partition.eof": True, "isolation.level": "read_committed"})
    c.assign([TopicPartition(src + ".blocks", part, 0) for part in range(3)])
    sizes, ends = [], 0
    while ends < 3 and (m := c.poll(10)) is not None:
        if m.error():
            ends += 1
        else:
            sizes.append(len(m.value()))
    c.close()
    assert bad and (stats.blocks, stats.bytes_out) == (len(sizes), sum(sizes))
    # Converted already: a second run finds nothing new and writes nothing.
    again = kfeed.convert({"bootstrap.servers": bootstrap}, src, src + ".blocks", SCHEMA,
                          format=kfeed.Avro(registry=registry))
    assert (again.records, again.transactions) == (0, 0)


def test_the_progress_counts_the_lag_of_partitions_not_read_yet(bootstrap, make_topic):
    # A partition nothing was read from yet has no position: its lag was left
    # out, so the lag reported first was a partition's, then jumped up.
    src = make_topic(partitions=3)
    schema = kfeed.Schema({"id": ("int64", ())})
    n = 60_000
    with kfeed.Producer({"bootstrap.servers": bootstrap}, src, schema, format="raw") as p:
        for part in range(3):
            p.send({"id": np.arange(part * n, (part + 1) * n)}, partition=part)
    seen = []
    kfeed.convert({"bootstrap.servers": bootstrap}, src, src + ".blocks", schema, format="raw",
                  round_messages=1000, progress=lambda s: seen.append((s.messages, s.lag)))
    assert len(seen) >= 3 * n // 1000 and seen[-1] == (3 * n, 0)
    # Read plus not read is the whole topic at every round (none is read twice).
    assert [m + lag for m, lag in seen] == [3 * n] * len(seen)


def test_a_raw_topic_converts_with_its_order_per_partition(bootstrap, make_topic):
    src = make_topic(partitions=2)
    schema = kfeed.Schema({"id": ("int64", ()), "x": ("float32", (4,))})
    n = 3000
    cols = {"id": np.arange(n), "x": np.random.default_rng(1).random((n, 4), np.float32)}
    with kfeed.Producer({"bootstrap.servers": bootstrap}, src, schema, format="raw") as p:
        p.send({k: v[: n // 2] for k, v in cols.items()}, partition=0)
        p.send({k: v[n // 2:] for k, v in cols.items()}, partition=1)
    kfeed.convert({"bootstrap.servers": bootstrap}, src, src + ".blocks", schema, format="raw",
                  block_records=100, round_messages=700)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "enable.partition.eof": True, "isolation.level": "read_committed"})
    out = schema.empty(n, like="numpy")
    rows = {0: 0, 1: 0}
    ids = {0: [], 1: []}
    for part in (0, 1):
        c.assign([TopicPartition(src + ".blocks", part, 0)])
        while True:
            m = c.poll(10)
            assert m is not None
            if m.error():
                break
            res = schema.decode_into([m.value()], out, 0)
            assert 0 < res.rows <= 100 and not res.bad
            ids[part].extend(out["id"][:res.rows].tolist())
            np.testing.assert_array_equal(out["x"][:res.rows], cols["x"][out["id"][:res.rows]])
            rows[part] += res.rows
    c.close()
    assert ids[0] == list(range(n // 2)) and ids[1] == list(range(n // 2, n))  # in order
    assert rows[0] + rows[1] == n


def test_token_documents_convert_to_blocks_through_the_command_line(bootstrap, make_topic):
    from records import kfeed_cli

    src = make_topic(partitions=2)
    rng = np.random.default_rng(4)
    docs = {i: rng.integers(0, 50_000, int(rng.integers(0, 300))).tolist() for i in range(2000)}
    producer = KafkaProducer({"bootstrap.servers": bootstrap})
    for i, tokens in docs.items():
        producer.produce(src, json.dumps({"id": i, "text": "x", "tokens": tokens}).encode(),
                         partition=i % 2)
    producer.produce(src, json.dumps({"id": -1, "tokens": "not a list"}).encode(), partition=0)
    assert producer.flush(30) == 0
    done = kfeed_cli(bootstrap, "convert", "--from-topic", src, "--to-topic", src + ".blocks",
                     "--format", "json", "--field", "tokens=int32[None]", "--field", "id=int64",
                     "--round-messages", "300", "--progress-every", "600")
    assert done.returncode == 0, done.stderr
    schema = kfeed.Schema({"tokens": ("int32", (None,)), "id": ("int64", ())})
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "enable.partition.eof": True, "isolation.level": "read_committed"})
    got = {}
    for part in (0, 1):
        c.assign([TopicPartition(src + ".blocks", part, 0)])
        while (m := c.poll(10)) is not None and not m.error():
            d = schema.decode_documents([m.value()])
            assert not d.bad
            starts = np.concatenate([[0], np.cumsum(d.lengths)])
            for k, i in enumerate(d.columns["id"].tolist()):
                assert i % 2 == part and i not in got
                got[i] = d.tokens[starts[k]:starts[k + 1]].tolist()
        assert m is not None and m.error().code() == -191  # the partition's end
    assert got == docs
    dead = []  # the record whose tokens were a string
    c.assign([TopicPartition(src + ".dlq", part, 0) for part in (0, 1)])
    ends = 0
    while ends < 2 and (m := c.poll(10)) is not None:
        if m.error():
            ends += 1
        else:
            dead.append(json.loads(m.value())["id"])
    c.close()
    assert dead == [-1]


@pytest.mark.integration
def test_a_dead_letter_topic_made_before_with_fewer_partitions_takes_the_bad_records(
        bootstrap, make_topic):
    # The copies went to the source's partition numbers: a .dlq of 1 partition
    # for a source of 3 failed every round ("Unknown partition"), naming the
    # block topic, and nothing was converted.
    src = make_topic(partitions=3)
    kfeed.create_topic({"bootstrap.servers": bootstrap}, src + ".dlq", partitions=1)
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(30):
        value = {"id": i} if i % 10 else {"id": "not a number"}
        p.produce(src, json.dumps(value).encode(), partition=i % 3)
    assert p.flush(30) == 0
    schema = kfeed.Schema({"id": ("int64", ())})
    stats = kfeed.convert({"bootstrap.servers": bootstrap}, src, src + ".blocks", schema,
                          format="json", on_bad_record="dead_letter")
    assert (stats.records, stats.bad) == (27, 3)
    assert sorted(read_columns(bootstrap, src + ".blocks", schema)["id"].tolist()) == \
        [i for i in range(30) if i % 10]
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "enable.partition.eof": True, "isolation.level": "read_committed"})
    c.assign([TopicPartition(src + ".dlq", 0, 0)])
    dead = []
    while (m := c.poll(10)) is not None and not m.error():
        dead.append(json.loads(m.value())["id"])
    c.close()
    assert dead == ["not a number"] * 3


class Committed:
    """The offsets a consumer group committed on a topic, summed over its partitions.

    Read uncommitted: librdkafka then does not ask for stable offsets, which a
    convert killed inside a transaction leaves pending (until the next one
    fences it) and a read-committed fetch would wait for until it times out.
    """

    def __init__(self, bootstrap: str, group: str, topic: str, partitions: int) -> None:
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                                  "isolation.level": "read_uncommitted"})
        self.tps = [TopicPartition(topic, p) for p in range(partitions)]

    def __call__(self) -> int:
        return sum(max(tp.offset, 0) for tp in self.consumer.committed(self.tps, timeout=10))


def _dead_letter_offsets(bootstrap: str, topic: str) -> list[int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "isolation.level": "read_committed", "enable.partition.eof": True})
    c.assign([TopicPartition(topic + ".dlq", 0, 0)])
    got = []
    while (m := c.poll(10)) is not None and not m.error():
        got.append(int(dict(m.headers())["kfeed.source.offset"]))
    c.close()
    return got


def test_a_bad_message_is_dead_lettered_once_by_loaders_and_converts(bootstrap, make_topic):
    # A convert copied every bad message again, after a loader had (10 copies,
    # 20); and a loader after a convert scanned the dead-letter topic, whose
    # last offset is the convert's transaction marker, which never comes, for
    # 30 s, then stopped with "could not read ... to find what is dead-lettered".
    schema = kfeed.Schema({"id": ("int64", ())})
    config = {"bootstrap.servers": bootstrap}
    bad = list(range(0, 100, 10))
    for first in ("loader", "convert"):
        src = make_topic(partitions=1)
        p = KafkaProducer(config)
        for i in range(100):
            p.produce(src, json.dumps({"id": i if i % 10 else 1.5}).encode())
        p.flush()
        for step in (first, "loader" if first == "convert" else "convert"):
            t0 = time.monotonic()
            if step == "loader":
                with kfeed.Loader({**config, "group.id": uuid.uuid4().hex}, src, schema, 10,
                                  until="end", device="cpu", format=kfeed.Json()) as ld:
                    assert sum(b.size for b in ld) == 90
            else:
                stats = kfeed.convert(config, src, src + f".blocks-{first}", schema,
                                      format=kfeed.Json())
                assert (stats.records, stats.bad) == (90, 10)
            assert time.monotonic() - t0 < 20, step
            assert _dead_letter_offsets(bootstrap, src) == bad, (first, step)


def test_a_convert_killed_mid_topic_resumes_exactly_once(bootstrap, make_topic):
    src = make_topic(partitions=3)
    dst = src + ".blocks"
    n = 20_000
    rng = np.random.default_rng(3)
    p = KafkaProducer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for i in range(n):
        rec = {"id": i, "label": i % 10, "features": [round(x, 3) for x in rng.random(8)],
               "note": "x" * (i % 50)}
        p.produce(src, json.dumps(rec).encode(), partition=i % 3)
        if i % 1000 == 0:
            p.poll(0)
    assert p.flush(60) == 0
    env = {**os.environ, "KFEED_BOOTSTRAP": bootstrap}
    cmd = [sys.executable, "-m", "kfeed", "convert", "--from-topic", src, "--to-topic", dst,
           "--format", "json", "--field", "id=int64", "--field", "label=int64",
           "--field", "features=float32[8]", "--progress-every", "0.2",
           # The killed convert's partitions go to the next when its session
           # ends: 6 s, not librdkafka's 45.
           "-X", "session.timeout.ms=6000", "-X", "heartbeat.interval.ms=500"]
    committed = Committed(bootstrap, f"kfeed-convert.{dst}", src, 3)
    proc = subprocess.Popen([*cmd, "--round-messages", "300"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    # Killed once some rounds are committed and before the last one.
    while committed() == 0:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert committed() < n, "the convert finished before the kill"
    # Started again, following, then stopped by SIGTERM once new records are in too.
    proc = subprocess.Popen([*cmd, "--follow"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while committed() < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline + 120
        time.sleep(0.2)
    for i in range(n, n + 300):
        p.produce(src, json.dumps({"id": i, "label": 1, "features": [0.5] * 8}).encode(),
                  partition=i % 3)
    assert p.flush(30) == 0
    while committed() < n + 300:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline + 180
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "kfeed convert:" in err and "records" in err  # progress lines
    assert out.startswith("converted ")
    # It says why it ended, and how to go on (it printed no word of the signal).
    assert err.splitlines()[-1] == (f"kfeed: stopped by SIGTERM: the rounds committed stand; "
                                    f"the same command goes on after them (group "
                                    f"kfeed-convert.{dst})"), err
    schema = kfeed.Schema({"id": ("int64", ()), "label": ("int64", ()),
                           "features": ("float32", (8,))})
    cols = read_columns(bootstrap, dst, schema)
    ids = np.sort(cols["id"])
    np.testing.assert_array_equal(ids, np.arange(n + 300))  # every record once
    np.testing.assert_array_equal(cols["label"][np.argsort(cols["id"])][:n], np.arange(n) % 10)
    committed.consumer.close()


def test_a_follow_with_nothing_new_still_reports_its_progress(bootstrap, make_topic):
    # An idle --follow printed nothing, and looked hung.
    import threading

    src = make_topic(partitions=1)
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(10):
        p.produce(src, json.dumps({"id": i}).encode())
    assert p.flush(30) == 0
    stop, seen = threading.Event(), []

    def progress(st: kfeed.ConvertStats) -> None:
        seen.append(st.records)
        if seen.count(10) >= 5:  # five rounds since the last record: idle ones
            stop.set()

    timer = threading.Timer(60, stop.set)  # (the test's own bound)
    timer.start()
    try:
        st = kfeed.convert({"bootstrap.servers": bootstrap}, src, src + ".blocks",
                           kfeed.Schema({"id": ("int64", ())}), format="json", follow=True,
                           stop=stop, progress=progress)
    finally:
        timer.cancel()
    assert st.records == 10 and seen.count(10) >= 5


def following(bootstrap: str, src: str, schema: kfeed.Schema, stop: Any
              ) -> tuple[Any, list[kfeed.ConvertStats], list[BaseException]]:
    """A JSON convert of ``src`` that follows it, in a thread, until ``stop`` is set: the
    thread, and lists that get its stats or its error."""
    import threading

    seen: list[kfeed.ConvertStats] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            seen.append(kfeed.convert({"bootstrap.servers": bootstrap}, src, src + ".blocks",
                                      schema, format="json", follow=True, stop=stop))
        except Exception as e:  # noqa: BLE001 - the test reports it
            failed.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, seen, failed


def test_a_follow_reads_partitions_added_to_its_topic_within_seconds(bootstrap, make_topic):
    # librdkafka looks for them every 5 minutes by default: the records of the
    # new partitions waited that long, while the progress said "lag 0".
    import threading

    from confluent_kafka.admin import AdminClient, NewPartitions

    src = make_topic(partitions=2)
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(100):
        p.produce(src, json.dumps({"id": i}).encode(), partition=i % 2)
    assert p.flush(30) == 0
    stop = threading.Event()
    thread, _seen, failed = following(bootstrap, src, kfeed.Schema({"id": ("int64", ())}), stop)
    committed = Committed(bootstrap, f"kfeed-convert.{src}.blocks", src, 4)
    try:
        until(lambda: committed() == 100 or failed, 60)
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_partitions([NewPartitions(src, 4)])[src].result(30)
        until(lambda: len(p.list_topics(src, timeout=10).topics[src].partitions) == 4, 30)
        for i in range(100, 200):
            p.produce(src, json.dumps({"id": i}).encode(), partition=2 + i % 2)
        assert p.flush(30) == 0
        t0 = time.monotonic()
        until(lambda: committed() == 200 or failed, 60)
        took = time.monotonic() - t0
    finally:
        stop.set()
        thread.join(60)
        committed.consumer.close()
    assert not failed, failed
    assert took < 40, took
    cols = read_columns(bootstrap, src + ".blocks", kfeed.Schema({"id": ("int64", ())}))
    np.testing.assert_array_equal(np.sort(cols["id"]), np.arange(200))  # each once


def test_a_follow_whose_first_rounds_are_bad_records_waits_for_good_ones(bootstrap,
                                                                        make_topic):
    # Three bad events come first, alone in their rounds: that is not yet "every
    # record is bad" (a wrong schema), so the convert goes on, and once good
    # events come the three are dead-lettered, each once, and everything commits.
    import threading

    src = make_topic(partitions=2)
    schema = kfeed.Schema({"id": ("int64", ()), "x": ("float32", ())})
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(3):
        p.produce(src, json.dumps({"id": "not a number", "x": 1.0}).encode(), partition=i % 2)
    assert p.flush(30) == 0
    stop = threading.Event()
    thread, seen, failed = following(bootstrap, src, schema, stop)
    committed = Committed(bootstrap, f"kfeed-convert.{src}.blocks", src, 2)
    try:
        time.sleep(3)  # some rounds of the bad ones alone
        assert not failed, failed
        assert committed() == 0  # nothing committed past the bad ones yet
        n = 500
        for i in range(n):
            p.produce(src, json.dumps({"id": i, "x": i / 2}).encode(), partition=i % 2)
        assert p.flush(30) == 0
        deadline = time.monotonic() + 60
        while committed() < n + 3 and not failed and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(60)
        committed.consumer.close()
    assert not failed, failed
    assert (seen[0].records, seen[0].bad, seen[0].messages) == (500, 3, 503)
    cols = read_columns(bootstrap, src + ".blocks", schema)
    np.testing.assert_array_equal(np.sort(cols["id"]), np.arange(500))
    dlq = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                    "enable.partition.eof": True, "isolation.level": "read_committed"})
    dlq.assign([TopicPartition(src + ".dlq", part, 0) for part in (0, 1)])
    dead, ends = [], 0
    while ends < 2:
        m = dlq.poll(10)
        assert m is not None
        if m.error():
            ends += 1
        else:
            dead.append(json.loads(m.value())["id"])
    dlq.close()
    assert dead == ["not a number"] * 3  # each once


def test_a_rerun_that_starts_at_a_writers_incompatible_change_dead_letters_it(bootstrap,
                                                                               make_topic):
    # A convert ran to the end; the writer then changed its events (a field the
    # schema reads became a string) and sent 150: the rerun, whose first 100
    # records were bad, failed "all 100 messages read so far were rejected" at
    # the same offset on every retry, where a run that went on through the
    # change dead-letters them. Blocks of this schema in the block topic prove
    # it: the rerun routes them too. A first convert of such a topic still stops.
    src = make_topic(partitions=1)
    schema = kfeed.Schema({"id": ("int64", ()), "x": ("float32", ())})
    config = {"bootstrap.servers": bootstrap}
    p = KafkaProducer(config)
    for i in range(50):
        p.produce(src, json.dumps({"id": i, "x": i / 2}).encode())
    assert p.flush(30) == 0
    first = kfeed.convert(config, src, src + ".blocks", schema, format="json")
    assert (first.records, first.bad) == (50, 0)
    other = make_topic(partitions=1)  # of the changed events only, never converted
    for i in range(50, 200):
        for topic in (src, other):
            p.produce(topic, json.dumps({"id": i, "x": f"{i / 2}"}).encode())
    assert p.flush(30) == 0
    with pytest.raises(kfeed.DecodeError, match="all 100 messages read so far were rejected"):
        kfeed.convert(config, other, other + ".blocks", schema, format="json",
                      round_messages=50)
    again = kfeed.convert(config, src, src + ".blocks", schema, format="json",
                          round_messages=50)
    assert (again.records, again.bad) == (0, 150)
    cols = read_columns(bootstrap, src + ".blocks", schema)
    np.testing.assert_array_equal(np.sort(cols["id"]), np.arange(50))
    committed = Committed(bootstrap, f"kfeed-convert.{src}.blocks", src, 1)
    assert committed() == 200
    committed.consumer.close()
    assert _dead_letter_offsets(bootstrap, src) == list(range(50, 200))


def test_convert_mistakes_get_one_clear_line(bootstrap, make_topic, tmp_path, monkeypatch):
    src = make_topic(partitions=1)
    import confluent_kafka

    closed = []

    class Consumer(confluent_kafka.Consumer):
        def close(self) -> None:
            closed.append(self)
            super().close()

    monkeypatch.setattr(confluent_kafka, "Consumer", Consumer)
    conf = {"bootstrap.servers": bootstrap}
    schema = kfeed.Schema({"id": ("int64", ())})
    with pytest.raises(kfeed.ConfigError, match="both 'a'"):
        kfeed.convert(conf, "a", "a", schema, format="json")
    # Its bad records went into the blocks, in the round's transaction.
    with pytest.raises(kfeed.ConfigError, match="^a.dlq is a's dead-letter topic: convert to "
                                                "another topic$"):
        kfeed.convert(conf, "a", "a.dlq", schema, format="json")
    with pytest.raises(kfeed.ConfigError, match="from block to block"):
        kfeed.convert(conf, src, src + ".b", schema, format="block")
    with pytest.raises(kfeed.ConfigError, match="on_bad_record"):
        kfeed.convert(conf, src, src + ".b", schema, format="json", on_bad_record="drop")
    with pytest.raises(kfeed.ConsumeError, match="not available"):
        kfeed.convert(conf, f"missing-{uuid.uuid4().hex}", "x", schema, format="json",
                      connect_timeout_s=5)
    assert len(closed) == 1  # the consumer made before the topic was looked up
    # A setting a transaction refuses is refused before the topics are made.
    to_topic = f"never-{uuid.uuid4().hex}"
    with pytest.raises(kfeed.ConfigError, match="`acks` must be set to `all`"):
        kfeed.convert({**conf, "acks": "1"}, src, to_topic, schema, format="json")
    # So is a record no block holds (the topic made for it would take none either).
    with pytest.raises(kfeed.ConfigError, match="^a record of 2000008 bytes is over message"):
        kfeed.convert(conf, src, to_topic, kfeed.Schema({"x": ("uint8", (2_000_000,)),
                                                         "id": ("int64", ())}), format="json")
    # And a round larger than consume() takes ("unexpected ValueError", the topic made).
    with pytest.raises(kfeed.ConfigError, match=r"^round_messages must be an int in 1\.\.1,000,000"):
        kfeed.convert(conf, src, to_topic, schema, format="json", round_messages=2_000_000)
    from confluent_kafka.admin import AdminClient

    topics = AdminClient(conf).list_topics(timeout=30).topics
    assert to_topic not in topics and src + ".dlq" not in topics
    env = {**os.environ, "KFEED_BOOTSTRAP": bootstrap}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kfeed", "convert", "--from-topic", src,
                               "--to-topic", src + ".b", *args], env=env, check=False,
                              capture_output=True, text=True, timeout=120)

    for args, says in [
        (["--format", "avro"], "--format avro needs --registry URL"),
        (["--format", "protobuf"], "or --registry URL to read the schemas from"),
        (["--format", "protobuf", "--proto", "no_such_module:X"], "put the generated module"),
        # A module that is there: not told to put it on PYTHONPATH.
        (["--format", "protobuf", "--proto", "json:Nope"],
         "--proto json:Nope: module json has no 'Nope' (its message classes: none): name one "
         "of them"),
        (["--format", "protobuf", "--proto", "clicks_pb2"],
         "is not MODULE:MESSAGE: name the generated module and its message class (e.g. "
         "--proto clicks_pb2:Click)"),
        (["--format", "json", "--field", "id:int64"], "is not NAME=DTYPE[SHAPE][@SOURCE]"),
        (["--format", "json", "--field", "id=int64", "--field", "id=int32"], "given twice"),
        (["--format", "raw", "--registry", "http://127.0.0.1:1"], "not raw"),
        (["--format", "json", "--avro-schema", "x.avsc"], "applies to --format avro"),
        (["--format", "json", "--timestamps", "us"],
         "--timestamps applies to --format avro, not json"),
        (["--format", "json", "--round-messages", "2000000"],
         "2000000 is out of range: give an integer in 1..1000000"),
        # (It named kfeed produce.)
        (["--format", "json", "-X", "transactional.id=mine"],
         "-X transactional.id is set by kfeed convert (kfeed-convert.FROM.TO, the job's own "
         "id): leave it out of -X"),
    ]:
        done = cli(*args)
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], (args, done.stderr)
    # No --field: kfeed train's fields, which a topic of other fields lacks. It
    # said only "field 'features': missing or null, and no default".
    producer = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(5):
        producer.produce(src, json.dumps({"id": i, "temp": 20.5}).encode())
    assert producer.flush(30) == 0
    done = cli("--format", "json")
    assert done.returncode != 0 and "no --field was given, so the fields are those kfeed train " \
        "reads, features float32[768], label int64, id int64: name the topic's with --field " \
        "NAME=DTYPE[SHAPE][@SOURCE])" in done.stderr, done.stderr
    # --on-bad-record raise said only the record, not what stands nor how to go on.
    producer.produce(src, b"not json")
    assert producer.flush(30) == 0
    done = cli("--format", "json", "--field", "id=int64", "--on-bad-record", "raise")
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        f"kfeed: bad record: not JSON: the rounds before it are committed, and the "
        f"same command stops at it again; --on-bad-record dead_letter (or skip) goes past it "
        f"(topic={src}, partition=0, offset=5)"), done.stderr


def test_avro_across_processes_through_a_real_schema_registry(bootstrap, make_topic,
                                                              schema_registry):
    """Produce Avro (registering), train from it, convert it, train from the blocks."""
    topic = make_topic(partitions=2)
    env = {**os.environ, "KFEED_BOOTSTRAP": bootstrap}

    def cli(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "kfeed", *args], env=env, check=False,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (args, done.stderr)
        return done

    cli("produce", "--topic", topic, "--synthetic", "1000", "--format", "avro",
        "--registry", schema_registry)
    from confluent_kafka.schema_registry import SchemaRegistryClient

    client = SchemaRegistryClient({"url": schema_registry})
    assert f"{topic}-value" in client.get_subjects()
    trained = cli("train", "--topic", topic, "--group-id", uuid.uuid4().hex, "--until-end",
                  "--device", "cpu", "--format", "avro", "--registry", schema_registry)
    assert "trained 4 steps on 1,000 samples" in trained.stdout
    assert "bad records 0" in trained.stdout
    converted = cli("convert", "--from-topic", topic, "--to-topic", topic + ".blocks",
                    "--format", "avro", "--registry", schema_registry)
    assert converted.stdout.startswith("converted 1,000 records (0 bad)")
    again = cli("train", "--topic", topic + ".blocks", "--group-id", uuid.uuid4().hex,
                "--until-end", "--device", "cpu")
    assert "trained 4 steps on 1,000 samples" in again.stdout


# A member of the convert's group that holds every partition and then dies
# without leaving: its session (6 s, the brokers' least) must end first.
_DEAD_MEMBER = """
import sys
from confluent_kafka import Consumer
c = Consumer({"bootstrap.servers": sys.argv[1], "group.id": sys.argv[2],
              "session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
c.subscribe([sys.argv[3]])
while not c.assignment():
    c.poll(0.2)
print("assigned", flush=True)
sys.stdin.read()  # until killed
"""


def _member_of_the_convert_s_group(bootstrap, make_topic, script: str):
    """A JSON topic of 100 ids over 2 partitions, its blocks' topic, and a consumer
    of the convert's group running ``script``."""
    src = make_topic(partitions=2)
    dst = src + ".blocks"
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(100):
        p.produce(src, json.dumps({"id": i}).encode(), partition=i % 2)
    assert p.flush(30) == 0
    member = subprocess.Popen([sys.executable, "-c", script, bootstrap, f"kfeed-convert.{dst}",
                               src], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return src, dst, member


def test_a_rerun_says_it_waits_for_a_stopped_members_partitions(bootstrap, make_topic):
    # It printed "0 records ... lag 0 messages" until the dead member's session
    # ended: the lag counts only assigned partitions, and none were.
    src, dst, dead = _member_of_the_convert_s_group(bootstrap, make_topic, _DEAD_MEMBER)
    try:
        assert dead.stdout is not None and dead.stdout.readline() == "assigned\n"
    finally:
        dead.kill()
        dead.wait(30)
    done = subprocess.run([sys.executable, "-m", "kfeed", "convert", "--from-topic", src,
                           "--to-topic", dst, "--format", "json", "--field", "id=int64",
                           "--progress-every", "0.2"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "KFEED_BOOTSTRAP": bootstrap})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("converted 100 records"), done.stdout
    lines = done.stderr.splitlines()
    waits = [line for line in lines if line.startswith("kfeed convert: waiting")]
    assert waits and lines[:len(waits)] == waits, lines
    assert waits[0] == (f"kfeed convert: waiting for group kfeed-convert.{dst} to assign it "
                        f"partitions of {src} (those a stopped convert held come free when "
                        f"its session ends, within session.timeout.ms: 45 s)")
    # Once assigned, the lag counts what is left: never 0 before the records are in.
    for line in lines[len(waits):]:
        assert "lag 0 messages" not in line or " 100 records" in line, lines


_LIVE_MEMBER = """
import sys
from confluent_kafka import Consumer
c = Consumer({"bootstrap.servers": sys.argv[1], "group.id": sys.argv[2],
              "session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
c.subscribe([sys.argv[3]])
said = False
while not sys.stdin.closed:
    c.poll(0.2)
    if c.assignment() and not said:
        print("assigned", [tp.partition for tp in c.assignment()], flush=True)
        said = True
    import select
    if select.select([sys.stdin], [], [], 0)[0]:
        break
c.close()  # leaves the group: its partitions go to the convert
"""


def test_a_read_to_the_end_waits_for_the_partitions_another_member_holds(bootstrap,
                                                                         make_topic):
    # Without --follow, a convert that held only some partitions (another
    # member, or a killed restart not yet timed out, held the rest) read those
    # to their ends and exited 0: "converted 50 records", the rest never.
    src, dst, member = _member_of_the_convert_s_group(bootstrap, make_topic, _LIVE_MEMBER)
    try:
        assert member.stdout is not None and member.stdout.readline().startswith("assigned")
        convert = subprocess.Popen([sys.executable, "-m", "kfeed", "convert", "--from-topic",
                                    src, "--to-topic", dst, "--format", "json", "--field",
                                    "id=int64", "--progress-every", "0.2"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "KFEED_BOOTSTRAP": bootstrap})
        time.sleep(8)  # the group deals a partition to each; the convert's is read
        assert convert.poll() is None, convert.communicate()
    finally:
        assert member.stdin is not None
        member.stdin.write("go\n")
        member.stdin.flush()
        member.wait(30)
    out, err = convert.communicate(timeout=120)
    assert convert.returncode == 0, err
    assert out.startswith("converted 100 records"), (out, err)
    assert "kfeed convert: waiting for group" in err, err
    assert sorted(read_columns(bootstrap, dst, kfeed.Schema({"id": ("int64", ())}))["id"]
                  .tolist()) == list(range(100))


def test_converts_of_topics_whose_names_join_alike_do_not_fence_each_other(bootstrap,
                                                                           make_topic):
    # The transactional id joined the topics with dots, which names hold:
    # S -> q.X and S.q -> X had one id, and the second convert fenced the
    # first, which read its round again three times, then failed.
    import threading

    from confluent_kafka.admin import AdminClient, NewTopic

    conf = {"bootstrap.servers": bootstrap}
    a_src, out = make_topic(partitions=1), f"out-{uuid.uuid4().hex}"
    b_src = f"{a_src}.q"
    admin = AdminClient(conf)
    admin.create_topics([NewTopic(b_src, 1, 1)])[b_src].result(timeout=60)
    schema = kfeed.Schema({"id": ("int64", ())})
    p = KafkaProducer(conf)

    def produce(topic: str, ids: range) -> None:
        for i in ids:
            p.produce(topic, json.dumps({"id": i}).encode())
        assert p.flush(30) == 0

    def blocks(topic: str) -> list[int]:
        return sorted(read_columns(bootstrap, topic, schema)["id"].tolist())

    produce(a_src, range(10))
    produce(b_src, range(10))
    stop, result = threading.Event(), {}

    def follow() -> None:
        try:
            result["a"] = kfeed.convert(conf, a_src, f"q.{out}", schema, format="json",
                                        follow=True, stop=stop)
        except BaseException as e:  # noqa: BLE001 - the assertion says what it was
            result["a"] = e

    a = threading.Thread(target=follow)
    a.start()
    try:
        until(lambda: blocks(f"q.{out}") == list(range(10)), 60)
        assert kfeed.convert(conf, b_src, out, schema, format="json").records == 10
        produce(a_src, range(10, 15))
        until(lambda: "a" in result or blocks(f"q.{out}") == list(range(15)), 60)
    finally:
        stop.set()
        a.join(60)
        admin.delete_topics([b_src])
    assert not isinstance(result.get("a"), BaseException), result
    assert result["a"].records == 15 and result["a"].aborted == 0


def until(done, seconds: float) -> None:
    """Wait for ``done()``, asking every 0.2 s; fail past ``seconds``."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.2)


def test_convert_into_a_topic_of_blocks_of_another_schema_is_refused(bootstrap, make_topic):
    # kfeed produce refused it; convert wrote sample blocks among token documents.
    from records import kfeed_cli

    src, dst = make_topic(partitions=2), make_topic(partitions=2)
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(20):
        p.produce(src, json.dumps({"id": i}).encode(), partition=i % 2)
    assert p.flush(30) == 0
    tokens = kfeed.Schema({"tokens": ("int32", (None,))})
    with kfeed.Producer({"bootstrap.servers": bootstrap}, dst, tokens) as producer:
        producer.send({"tokens": (np.arange(10, dtype=np.int32), np.array([4, 6]))})
    done = kfeed_cli(bootstrap, "convert", "--from-topic", src, "--to-topic", dst,
                     "--format", "json", "--field", "id=int64")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"kfeed: topic {dst} holds kfeed blocks of another schema "), \
        done.stderr
    assert len(done.stderr.splitlines()) == 1 and "convert to another topic" in done.stderr
    with pytest.raises(kfeed.ConfigError, match="holds kfeed blocks of another schema"):
        kfeed.convert({"bootstrap.servers": bootstrap}, src, dst,
                      kfeed.Schema({"id": ("int64", ())}), format="json")
    assert Committed(bootstrap, f"kfeed-convert.{dst}", src, 2)() == 0  # nothing converted
    # Blocks of the same schema: a second convert goes on beside them.
    ids = make_topic(partitions=2)
    first = kfeed.convert({"bootstrap.servers": bootstrap}, src, ids,
                          kfeed.Schema({"id": ("int64", ())}), format="json")
    again = kfeed.convert({"bootstrap.servers": bootstrap}, src, ids,
                          kfeed.Schema({"id": ("int64", ())}), format="json", group_id="other")
    assert (first.records, again.records) == (20, 20)


def test_kfeed_convert_stays_the_function_once_its_module_is_imported() -> None:
    # The function and its module shared the name: once anything imported the
    # module (kfeed.ConvertStats, say), kfeed.convert was the module, and a
    # call raised "TypeError: 'module' object is not callable".
    import subprocess
    import sys

    script = ("import kfeed, kfeed.converter; kfeed.ConvertStats; "
              "assert callable(kfeed.convert) and kfeed.convert.__name__ == 'convert'; "
              "from kfeed import convert; assert callable(convert)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr


def test_a_round_read_again_after_a_failed_commit_is_converted_before_the_end(
        bootstrap, make_topic, monkeypatch):
    # The rewind left its partitions at their end: when the records read
    # again were not back within a consume(), the convert ended, "0 records",
    # exit 0, with them unconverted.
    from kfeed import converter
    from kfeed.errors import ProduceError
    from kfeed.producer import Producer

    src = make_topic(partitions=1)
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(500):
        p.produce(src, json.dumps({"id": i}).encode())
    assert p.flush(30) == 0
    sends, consume = Producer.send_offsets, converter._Convert._consume
    fault = {"commit": True, "slow": False}

    def send_offsets(self, consumer, offsets):
        if fault.pop("commit", False):
            fault["slow"] = True
            raise ProduceError("a commit that failed once", topic=self.topic)
        return sends(self, consumer, offsets)

    def slow_consume(self):
        if fault["slow"]:  # the records read again take longer than a consume()
            fault["slow"] = False
            return []
        return consume(self)

    monkeypatch.setattr(Producer, "send_offsets", send_offsets)
    monkeypatch.setattr(converter._Convert, "_consume", slow_consume)
    schema = kfeed.Schema({"id": ("int64", ())})
    stats = kfeed.convert({"bootstrap.servers": bootstrap}, src, src + ".blocks", schema,
                          format="json")
    assert "commit" not in fault and stats.aborted == 1
    assert stats.records == 500
    ids = read_columns(bootstrap, src + ".blocks", schema, batch_size=100)["id"]
    assert sorted(ids.tolist()) == list(range(500))


def test_large_records_convert_through_the_command_line_without_block_records(
        bootstrap, make_topic):
    # The command's --block-records defaulted to 64, which a 32 KB record
    # is too large for: "lower block_records to 30 or fewer (or leave it
    # out)", where it could not be left out.
    from records import kfeed_cli

    src = make_topic(partitions=1)
    producer = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(40):
        producer.produce(src, json.dumps({"id": i, "x": [i] * 8192}).encode())
    assert producer.flush(30) == 0
    done = kfeed_cli(bootstrap, "convert", "--from-topic", src, "--to-topic", src + ".blocks",
                     "--format", "json", "--field", "x=float32[8192]", "--field", "id=int64")
    assert done.returncode == 0, done.stderr
    schema = kfeed.Schema({"x": ("float32", (8192,)), "id": ("int64", ())})
    cols = read_columns(bootstrap, src + ".blocks", schema, batch_size=8)
    assert sorted(cols["id"].tolist()) == list(range(40))
    assert (cols["x"] == cols["id"][:, None]).all()


def test_a_document_no_message_holds_is_a_bad_record_not_the_end(bootstrap, make_topic):
    # It stopped the convert for good, in words for a send() the user never
    # made ("document 0 of this send() ... split it"), at every restart.
    from records import read_dlq

    src = make_topic(partitions=1)
    producer = KafkaProducer({"bootstrap.servers": bootstrap})
    failed = []
    for i in range(300):  # (#150: 800 KB of JSON, 1.6 MB as a block)
        ids = [0] * 400_000 if i == 150 else list(range(10 + i % 50))
        producer.produce(src, json.dumps({"id": i, "ids": ids}, separators=(",", ":")).encode(),
                         on_delivery=lambda err, _m: err is None or failed.append(err))
    assert producer.flush(30) == 0 and not failed, failed
    schema = kfeed.Schema({"ids": ("int32", (None,)), "id": ("int64", ())})
    stats = kfeed.convert({"bootstrap.servers": bootstrap}, src, src + ".blocks", schema,
                          format="json")
    assert (stats.records, stats.bad) == (299, 1)
    (dead,) = read_dlq(bootstrap, src, 1)
    headers = dict(dead.headers())
    assert headers["kfeed.source.offset"] == b"150", headers
    assert headers["kfeed.reason"].decode().startswith(
        "a document of 400,000 elements, larger than a block message holds"), headers


def test_bad_records_a_warning_held_back_are_said_at_the_end(bootstrap, make_topic, caplog):
    # Three bad records in a burst: one warning, and the other two never said.
    import logging

    src = make_topic(partitions=1)
    producer = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(20):
        value = b"not json" if i in (3, 4, 5) else json.dumps({"id": i}).encode()
        producer.produce(src, value)
    assert producer.flush(30) == 0
    schema = kfeed.Schema({"id": ("int64", ())})
    with caplog.at_level(logging.WARNING):
        stats = kfeed.convert({"bootstrap.servers": bootstrap}, src, src + ".blocks", schema,
                              format="json", on_bad_record="skip")
    assert (stats.records, stats.bad) == (17, 3)
    said = [r.getMessage() for r in caplog.records if "bad record" in r.getMessage()]
    assert len(said) == 2 and said[1].startswith("2 more bad record(s) in the last"), said
