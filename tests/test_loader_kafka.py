"""Producer and Loader against a real Apache Kafka (the cluster fixture)."""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
import threading
import time
import uuid
from typing import Any
from collections.abc import Iterator

import numpy as np
import pytest
from confluent_kafka import Consumer, Producer as KafkaProducer

import kfeed
from kfeed.synthetic import synthetic_columns, synthetic_schema
from records import left_to_the_collector

pytestmark = pytest.mark.integration

SCHEMA = synthetic_schema()


def produce(bootstrap: str, topic: str, first: int, n: int, **kwargs) -> None:
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA, **kwargs) as p:
        for i in range(first, first + n, 10000):
            ids = np.arange(i, min(i + 10000, first + n))
            p.send(synthetic_columns(ids), keys=ids)


def loader(bootstrap: str, topic: str, group: str, **kwargs) -> kfeed.Loader:
    kwargs.setdefault("until", "end")
    kwargs.setdefault("device", "cpu")
    extra = kwargs.pop("kafka", {})
    return kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": group, **extra}, topic,
                        SCHEMA, kwargs.pop("batch_size", 256), **kwargs)


# The three ways a group rebalances (kfeed.sources.group_protocol).
PROTOCOLS = {
    "eager": {"group.protocol": "classic", "partition.assignment.strategy": "range"},
    "cooperative": {"group.protocol": "classic",
                    "partition.assignment.strategy": "cooperative-sticky"},
    "consumer": {"group.protocol": "consumer"},
}


def test_200k_samples_arrive_exactly_once_bit_equal(bootstrap, make_topic, group_id) -> None:
    topic = make_topic(partitions=4)
    n = 200_000
    produce(bootstrap, topic, 0, n)
    seen = np.zeros(n, np.int64)
    with loader(bootstrap, topic, group_id) as ld:
        for batch in ld:
            ids = batch["id"].numpy()
            want = synthetic_columns(ids)
            assert np.array_equal(batch["features"].numpy(), want["features"])
            assert np.array_equal(batch["label"].numpy(), want["label"])
            np.add.at(seen, ids, 1)
        assert ld.stats()["bad_records"] == 0
    assert (seen == 1).all()


def test_keyed_partitions_match_librdkafka_murmur2(bootstrap, make_topic, group_id) -> None:
    topic = make_topic(partitions=7)
    keys = [f"user-{i}".encode() for i in range(300)]
    p = KafkaProducer({"bootstrap.servers": bootstrap, "partitioner": "murmur2_random"})
    for k in keys:
        p.produce(topic, value=b"v", key=k)
    assert p.flush(30) == 0
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group_id,
                  "auto.offset.reset": "earliest"})
    c.subscribe([topic])
    got = {}
    deadline = time.monotonic() + 60
    while len(got) < len(keys) and time.monotonic() < deadline:
        for m in c.consume(500, 1.0):
            if m.error() is None:
                got[m.key()] = m.partition()
    c.close()
    assert len(got) == len(keys)
    ours = kfeed.partitions_for(keys, 7)
    assert [got[k] for k in keys] == ours.tolist()


def test_raw_topic_from_plain_confluent_kafka(bootstrap, make_topic, group_id) -> None:
    topic = make_topic(partitions=3)
    cols = synthetic_columns(np.arange(3000))
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(3000):
        value = (cols["features"][i].tobytes() + cols["label"][i].tobytes()
                 + cols["id"][i].tobytes())
        p.produce(topic, value=value)
    assert p.flush(30) == 0
    with loader(bootstrap, topic, group_id, format="raw") as ld:
        ids = np.concatenate([b["id"].numpy().copy() for b in ld])
    assert np.array_equal(np.sort(ids), np.arange(3000))


def test_resume_from_state_dict_and_from_committed(bootstrap, make_topic) -> None:
    topic = make_topic(partitions=3)
    produce(bootstrap, topic, 0, 20_000, block_records=50)
    group = uuid.uuid4().hex
    got = []
    ld = loader(bootstrap, topic, group, batch_size=96)
    for i, batch in enumerate(ld):
        got.append(batch["id"].numpy().copy())
        if i == 40:
            break
    state = ld.state_dict()
    ld.close()
    # Resume from the checkpointed state, in a fresh group.
    with loader(bootstrap, topic, uuid.uuid4().hex, batch_size=96) as ld2:
        ld2.load_state_dict(state)
        rest = [b["id"].numpy().copy() for b in ld2]
    ids = np.concatenate(got + rest)
    assert len(ids) == 20_000 and len(np.unique(ids)) == 20_000
    # Resume from the group's committed offsets (blocks split across batches
    # carry the records to skip in the commit metadata).
    with loader(bootstrap, topic, group, batch_size=96) as ld3:
        rest3 = [b["id"].numpy().copy() for b in ld3]
    ids3 = np.concatenate(got + rest3)
    assert len(ids3) == 20_000 and len(np.unique(ids3)) == 20_000


def test_trainer_killed_between_checkpoints_resumes_exactly(bootstrap, make_topic, tmp_path) -> None:
    # (tests/test_faults.py kills at random points, under each group protocol.)
    topic = make_topic(partitions=2)
    produce(bootstrap, topic, 0, 4_000)
    ckpt, log = tmp_path / "ck.pt", tmp_path / "ids.txt"
    cmd = [sys.executable, "-m", "kfeed", "train", "--bootstrap-servers", bootstrap,
           "--topic", topic, "--group-id", uuid.uuid4().hex, "--until-end", "--batch-size", "100",
           "--checkpoint", str(ckpt), "--checkpoint-every", "5", "--log-ids", str(log),
           "--device", "cpu", "--resume",
           # The killed member's partitions go to the next run when its session
           # ends: 6 s, not librdkafka's 45.
           "-X", "session.timeout.ms=6000", "-X", "heartbeat.interval.ms=500"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and (not log.exists() or log.read_text().count("#") < 3):
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert ckpt.exists()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    # What the killed run trained after its last checkpoint is trained again
    # by the resumed run; everything up to that checkpoint must not be.
    ids = np.array(trained_ids(log.read_text()))
    assert len(ids) == len(np.unique(ids)) == 4_000


def trained_ids(log: str) -> list[int]:
    """Ids that count, from the log of runs that were killed and resumed.

    Each run starts with ``# resumed at step S`` and writes one line per step;
    of a killed run, only the steps before the next run's S count (the rest
    were trained again from the checkpoint).
    """
    runs: list[tuple[int, list[str]]] = []
    for line in log.splitlines():
        if line.startswith("# resumed at step "):
            runs.append((int(line.rsplit(" ", 1)[1]), []))
        elif not line.startswith("#"):
            runs[-1][1].append(line)
    ids: list[int] = []
    for k, (start, lines) in enumerate(runs):
        keep = runs[k + 1][0] - start if k + 1 < len(runs) else len(lines)
        assert 0 <= keep <= len(lines), "a run resumed from a step it never reached"
        ids += [int(x) for line in lines[:keep] for x in line.split()]
    return ids


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_two_loaders_in_one_group_are_disjoint_and_complete(bootstrap, make_topic,
                                                            protocol) -> None:
    topic = make_topic(partitions=4)
    produce(bootstrap, topic, 0, 16_000)
    group = uuid.uuid4().hex
    import threading

    results: list[np.ndarray] = [np.empty(0, np.int64), np.empty(0, np.int64)]

    def run(k: int) -> None:
        got = []
        with loader(bootstrap, topic, group, batch_size=64, kafka=PROTOCOLS[protocol]) as ld:
            assert ld._source.protocol == protocol
            for b in ld:
                got.append(b["id"].numpy().copy())
                time.sleep(0.002)  # a step's worth of work, so both members get to join
        results[k] = np.concatenate(got) if got else np.empty(0, np.int64)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    ids = np.concatenate(results)
    assert len(ids) == len(np.unique(ids)) == 16_000


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_bounded_read_ends_at_a_transaction_marker_under_every_protocol(
        bootstrap, make_topic, protocol) -> None:
    # Each partition ends in an aborted transaction's marker, which a consumer
    # never receives: the read ends at the high watermark all the same, in
    # offset order and through a shuffle, with the aborted records left out.
    topic = make_topic(partitions=3)
    schema = kfeed.Schema({"id": ("int64", ())})
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema, block_records=8,
                        transactional_id=f"kfeed-test-{topic}") as p:
        for first, last in ((0, 300), (300, 600), (600, 700), (700, 1000)):
            with contextlib.suppress(RuntimeError), p.transaction():
                p.send({"id": np.arange(first, last)})
                if first in (300, 700):
                    p.flush()
                    raise RuntimeError("aborted")
    want = list(range(300)) + list(range(600, 700))
    for kw in ({}, {"shuffle": kfeed.Shuffle(buffer=50, seed=1)}):
        with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                           **PROTOCOLS[protocol]}, topic, schema, 32, device="cpu",
                          until="end", **kw) as ld:
            assert ld._source.protocol == protocol
            assert sorted(i for b in ld for i in b["id"].tolist()) == want, kw


def test_bad_messages_go_to_the_dead_letter_topic(bootstrap, make_topic, group_id) -> None:
    topic = make_topic(partitions=1)
    good = SCHEMA.encode_blocks(synthetic_columns(np.arange(640)), 64)
    # Idempotent, so that a retried request on a loaded cluster writes nothing
    # twice; the bad messages' offsets are taken from the delivery reports.
    p = KafkaProducer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    bad_values = [b"not a block", good[0][:500], b"KFDB" + b"\0" * 60]
    bad_offsets: list[int] = []
    for i, v in enumerate(good):
        p.produce(topic, value=v)
        if i < len(bad_values):
            p.produce(topic, value=bad_values[i],
                      on_delivery=lambda err, m: bad_offsets.append(m.offset()))
    assert p.flush(30) == 0
    assert len(bad_offsets) == 3
    with loader(bootstrap, topic, group_id, batch_size=128) as ld:
        ids = np.concatenate([b["id"].numpy().copy() for b in ld])
        assert ld.stats()["bad_records"] == 3
    assert np.array_equal(np.sort(ids), np.arange(640))
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "auto.offset.reset": "earliest"})
    c.subscribe([f"{topic}.dlq"])
    dead, deadline = [], time.monotonic() + 60
    while len(dead) < 3 and time.monotonic() < deadline:
        dead += [m for m in c.consume(10, 1.0) if m.error() is None]
    c.close()
    assert sorted(m.value() for m in dead) == sorted(bad_values)
    assert sorted(int(dict(m.headers())["kfeed.source.offset"]) for m in dead) == bad_offsets
    for m in dead:
        h = dict(m.headers())
        assert h["kfeed.source.topic"] == topic.encode()
        assert h["kfeed.source.partition"] == b"0"
        assert h["kfeed.reason"]


@pytest.mark.parametrize(("until", "policy"), [("end", "skip"), (None, "skip"),
                                               (None, "dead_letter")])
def test_a_bad_message_at_a_partitions_end_is_committed_past(bootstrap, make_topic, group_id,
                                                            until, policy) -> None:
    # The good records filled whole batches, so the bad one after them made
    # a batch of no rows, dropped with its place: the group stayed one message
    # short for ever, and its next run read only that message and failed
    # ("all 1 messages read so far were rejected").
    topic = make_topic(partitions=1)
    produce(bootstrap, topic, 0, 128, format="raw")
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    p.produce(topic, value=b"not a record", partition=0)
    assert p.flush(30) == 0
    with loader(bootstrap, topic, group_id, batch_size=64, on_bad_record=policy,
                until=until, max_wait_ms=100, format="raw") as ld:
        assert [next(ld).size, next(ld).size] == [64, 64]
        if until is None:  # live: the next next() waits, and takes the bad message's place
            waiting = threading.Thread(target=lambda: pytest.raises(kfeed.LoaderError, next, ld),
                                       daemon=True)
            waiting.start()
            deadline = time.monotonic() + 30
            while ld.stats()["lag"] != {f"{topic}[0]": 0} and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            with pytest.raises(StopIteration):
                next(ld)
    [part] = kfeed.group_lag({"bootstrap.servers": bootstrap}, group_id, [topic])
    assert (part.committed, part.lag) == (129, 0)
    with loader(bootstrap, topic, group_id, start="committed", format="raw") as again:
        assert list(again) == []


def test_a_topic_unknown_to_the_broker_asked_is_asked_again_for_a_grace_period() -> None:
    # Just after a topic is created, the broker a client asks may not know it
    # yet. Until the grace (or the connect timeout) is over, that means "ask
    # again"; after it, the topic is not available. Fake metadata: no broker.
    from types import SimpleNamespace

    from kfeed._kafka import GONE_GRACE_S as _GONE_GRACE_S, TopicUnavailable, topic_partitions

    def answer(code=None, partitions=None):
        err = None if code is None else SimpleNamespace(code=lambda: code, str=lambda: f"E{code}")
        return SimpleNamespace(topics={"t": SimpleNamespace(error=err, partitions=partitions or {})})

    now = time.monotonic()
    ok = answer(partitions={2: None, 0: None, 1: None})
    assert topic_partitions(ok, "t", now, now + 30) == [0, 1, 2]
    for unknown in (answer(3), answer(5), answer(), SimpleNamespace(topics={})):
        assert topic_partitions(unknown, "t", now, now + 30) is None  # created a moment ago?
        late = topic_partitions(unknown, "t", now - _GONE_GRACE_S, now + 30)
        assert isinstance(late, TopicUnavailable)
        assert topic_partitions(unknown, "t", now, now) == late  # the deadline ends it too
    denied = topic_partitions(answer(29), "t", now, now + 30)  # not a matter of time
    assert denied == TopicUnavailable("E29", 29)


def test_a_missing_topic_is_named_even_when_the_last_ask_runs_out_of_time() -> None:
    # The brokers answered "unknown topic" until the deadline, and the last
    # ask, left a few milliseconds, timed out on a loaded machine: the
    # producer and the loader then said "cannot reach the brokers", though
    # they had been reached. Fake brokers: one answer, then only timeouts.
    from types import SimpleNamespace

    from confluent_kafka import KafkaError, KafkaException

    from kfeed._kafka import admin_partitions
    from kfeed.producer import Producer

    class Brokers:
        def __init__(self) -> None:
            self.asked = 0
            self.kfeed_refusal = SimpleNamespace(error=None)

        def list_topics(self, topic: str, timeout: float) -> SimpleNamespace:
            self.asked += 1
            if self.asked == 1:
                err = SimpleNamespace(code=lambda: 3, str=lambda: "Broker: Unknown topic")
                return SimpleNamespace(topics={topic: SimpleNamespace(error=err,
                                                                      partitions={})})
            time.sleep(timeout)
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Failed to get metadata"))

        def poll(self, timeout: float = 0) -> int:
            return 0

    brokers = Brokers()
    with pytest.raises(kfeed.ConsumeError) as e:
        admin_partitions(brokers, "t", "127.0.0.1:1", 0.5)
    assert str(e.value).startswith("topic 't' is not available at 127.0.0.1:1: Broker: "
                                   "Unknown topic; create it with"), e.value
    assert brokers.asked > 1
    p = Producer.__new__(Producer)
    p.topic, p._timeout, p._servers, p._fatal = "t", 0.5, "127.0.0.1:1", None
    p._producer = brokers = Brokers()
    with pytest.raises(kfeed.ProduceError) as e:
        p._partition_count()
    assert str(e.value).startswith("topic 't' is not available at 127.0.0.1:1: Broker: "
                                   "Unknown topic; create it with"), e.value
    assert brokers.asked > 1


@pytest.mark.parametrize("assignment", ["group", "static"])
def test_a_closed_producer_and_loader_are_freed_at_once(bootstrap, make_topic,
                                                        assignment) -> None:
    # The consumer keeps its rebalance callbacks after close(): they must not
    # hold the loader's pipeline (its pool, its messages) in a cycle.
    topic = make_topic(partitions=2)

    def run() -> None:
        produce(bootstrap, topic, 0, 1000)
        with loader(bootstrap, topic, f"g-{uuid.uuid4().hex}", assignment=assignment) as ld:
            assert sum(batch.size for batch in ld) > 0

    assert left_to_the_collector(run) == {}


def test_lag_is_zero_once_everything_was_handed_out(bootstrap, make_topic, group_id) -> None:
    topic = make_topic(partitions=3)
    produce(bootstrap, topic, 0, 3000)
    with loader(bootstrap, topic, group_id, batch_size=100, prefetch=4) as ld:
        next(ld)
        deadline = time.monotonic() + 10  # librdkafka's statistics come once a second
        while not ld.stats()["lag"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sum(ld.stats()["lag"].values()) > 0  # prefetched batches count as not read
        n = 100 + sum(b.size for b in ld)
        lag = ld.stats()["lag"]  # at once: not the statistics' last (stale) consumer lag
    assert n == 3000
    assert len(lag) == 3 and set(lag.values()) == {0}, lag


def test_a_document_topic_read_to_its_end_stays_committed_there_after_close(
        bootstrap, make_topic, group_id) -> None:
    # close()'s revoke committed (0, skip=64) over the (1, 0) that commit()
    # had: the same place for kfeed, but one message of lag for ever to Kafka.
    # The loader's own lag said 1 as well.
    topic = make_topic(partitions=1)
    schema = kfeed.Schema({"tokens": ("uint16", (None,))})
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema) as p:
        p.send({"tokens": [np.arange(i % 7 + 1, dtype=np.uint16) for i in range(64)]})
    ld = kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": group_id}, topic, schema, 8,
                      device="cpu", max_wait_ms=200)
    assert sum(next(ld).size for _ in range(8)) == 64
    ld.commit()
    assert ld.stats()["lag"] == {f"{topic}[0]": 0}
    ld.close()
    [part] = kfeed.group_lag({"bootstrap.servers": bootstrap}, group_id, [topic])
    assert (part.committed, part.lag) == (1, 0)


def test_lag_is_known_while_the_loader_works_from_records_it_holds(bootstrap, make_topic,
                                                                   group_id) -> None:
    # 400 documents in 7 messages: one fetch holds them all, and the packer
    # makes ~200 batches from them without fetching again. The feeder still
    # polls, so librdkafka's statistics (the partitions' ends) arrive.
    tokens = kfeed.Schema({"tokens": ("int32", (None,))})
    topic = make_topic(partitions=1)
    docs = [np.full(500, i, np.int32) for i in range(400)]
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, tokens) as p:
        p.send({"tokens": docs})
    with kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": group_id}, topic, tokens, 8,
                      device="cpu", until="end", pack=kfeed.Pack(seq_len=128, eos_id=-1)) as ld:
        deadline = time.monotonic() + 5
        while not ld.stats()["lag"] and time.monotonic() < deadline:
            next(ld)
            time.sleep(0.02)  # a training step, shorter than the feeder's put timeout
        lag = ld.stats()["lag"]
    assert list(lag) == [f"{topic}[0]"] and lag[f"{topic}[0]"] > 0, lag


def test_unreachable_broker_and_missing_topic_fail_fast(bootstrap, group_id) -> None:
    t0 = time.monotonic()
    ld = kfeed.Loader({"bootstrap.servers": "127.0.0.1:9", "group.id": group_id}, "t", SCHEMA,
                      8, device="cpu", connect_timeout_s=3)
    with pytest.raises(kfeed.ConsumeError, match="cannot reach"):
        next(ld)
    ld.close()
    assert time.monotonic() - t0 < 20
    ld = loader(bootstrap, f"missing-{uuid.uuid4().hex}", group_id, connect_timeout_s=5)
    with pytest.raises(kfeed.ConsumeError, match="not available"):
        next(ld)
    ld.close()
    with pytest.raises(kfeed.ProduceError, match="not available"):
        kfeed.Producer({"bootstrap.servers": bootstrap}, f"missing-{uuid.uuid4().hex}", SCHEMA,
                       connect_timeout_s=5)


def test_aborted_transaction_is_never_visible(bootstrap, make_topic, group_id) -> None:
    topic = make_topic(partitions=2)
    p = kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA,
                       transactional_id=uuid.uuid4().hex)
    with p.transaction():
        p.send(synthetic_columns(np.arange(0, 500)))
    with pytest.raises(RuntimeError):
        with p.transaction():
            p.send(synthetic_columns(np.arange(500, 1000)))
            p._producer.flush(30)  # the aborted records really reach the log
            raise RuntimeError("preprocessing failed")
    with p.transaction():
        p.send(synthetic_columns(np.arange(1000, 1500)))
    from test_faults import read_until

    ids = read_until(bootstrap, topic, 1000, SCHEMA)
    assert np.array_equal(np.sort(ids), np.r_[np.arange(0, 500), np.arange(1000, 1500)])


def test_a_transaction_aborted_before_its_flush_does_not_fail_the_next(bootstrap, make_topic,
                                                                       group_id) -> None:
    # The abort purges what was still queued; librdkafka reports each purged
    # message as a failed delivery, which is the abort's doing, not the next
    # transaction's failure.
    topic = make_topic(partitions=2)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA,
                        transactional_id=uuid.uuid4().hex) as p:
        for attempt in range(3):
            with pytest.raises(RuntimeError):
                with p.transaction():
                    p.send(synthetic_columns(np.arange(500, 1000)))
                    raise RuntimeError(f"preprocessing failed, attempt {attempt}")
        with p.transaction():
            p.send(synthetic_columns(np.arange(0, 500)))
    from test_faults import read_until

    ids = read_until(bootstrap, topic, 500, SCHEMA)
    assert np.array_equal(np.sort(ids), np.arange(0, 500))


def test_a_committed_transaction_is_readable_once_the_producer_closes(bootstrap, make_topic,
                                                                       group_id, caplog) -> None:
    """Kafka writes the commit markers just after commit_transaction returns: close() waits
    for them, so a bounded loader started at once ends after the records, not before."""
    from confluent_kafka import IsolationLevel, TopicPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec

    class Copied:  # a consumed message, as a dead-letter copy takes it
        def __init__(self, k: int) -> None:
            self.k = k

        def value(self) -> bytes:
            return b"bad %d" % self.k

        def key(self) -> bytes:
            return b"%d" % self.k

    topic, copies = make_topic(partitions=12), make_topic(partitions=12)
    ids = np.arange(3000)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA,
                        transactional_id=uuid.uuid4().hex) as p:
        with p.transaction():
            p.send(synthetic_columns(ids), keys=ids)
            for k in range(12 * 60):  # more messages a partition than the topic's
                p.copy(Copied(k), copies, k % 12, [])
    assert "not readable yet" not in caplog.text
    admin = AdminClient({"bootstrap.servers": bootstrap})
    parts = [TopicPartition(t, i) for t in (topic, copies) for i in range(12)]
    stable = admin.list_offsets({tp: OffsetSpec.latest() for tp in parts},
                                isolation_level=IsolationLevel.READ_COMMITTED)
    ends = admin.list_offsets({tp: OffsetSpec.latest() for tp in parts})
    behind = [(tp.topic, tp.partition) for tp, f in stable.items()
              if f.result().offset < ends[tp].result().offset]
    assert behind == []  # each partition's stable offset is past its commit marker
    with loader(bootstrap, topic, group_id) as ld:
        got = np.concatenate([b["id"].numpy() for b in ld])
    assert np.array_equal(np.sort(got), ids)


def test_produce_cli_reports_rates(bootstrap, make_topic) -> None:
    topic = make_topic(partitions=2)
    out = subprocess.run([sys.executable, "-m", "kfeed", "produce", "--bootstrap-servers",
                          bootstrap, "--topic", topic, "--synthetic", "5000"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "produced 5,000 samples" in out.stdout and "MB/s" in out.stdout


def test_start_from_a_point_in_time_and_from_latest(bootstrap, make_topic) -> None:
    from datetime import datetime, timezone

    topic = make_topic(partitions=2)
    produce(bootstrap, topic, 0, 1000)
    time.sleep(1.0)
    since = datetime.now(timezone.utc)
    time.sleep(0.2)
    produce(bootstrap, topic, 1000, 1000)
    with loader(bootstrap, topic, uuid.uuid4().hex, start=since) as ld:
        ids = np.concatenate([b["id"].numpy().copy() for b in ld])
    assert np.array_equal(np.sort(ids), np.arange(1000, 2000))
    with loader(bootstrap, topic, uuid.uuid4().hex, start="latest") as ld:
        assert [b.size for b in ld] == []


def test_a_partition_added_while_reading_from_the_latest_is_read_from_its_start(
        bootstrap, make_topic) -> None:
    # start="latest" placed a partition added mid-read at its end too: what
    # was written to it before the group saw it (up to
    # topic.metadata.refresh.interval.ms) was never read, and committed past.
    import threading

    from confluent_kafka.admin import AdminClient, NewPartitions

    topic = make_topic(partitions=1)
    got: list[np.ndarray] = []
    ld = loader(bootstrap, topic, uuid.uuid4().hex, start="latest", until=None, batch_size=10,
                max_wait_ms=50, kafka={"topic.metadata.refresh.interval.ms": 3000})
    stop = threading.Event()

    def read() -> None:
        for batch in ld:
            got.append(batch["id"].numpy().copy())
            if stop.is_set():
                return

    def seen() -> int:
        return sum(len(g) for g in got)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not ld._fetcher.assigned:  # placed at the end: what comes next is read
            assert time.monotonic() < deadline
            time.sleep(0.1)
        produce(bootstrap, topic, 0, 100)
        while seen() < 100:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_partitions([NewPartitions(topic, 2)])[topic].result(timeout=30)
        with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, SCHEMA) as p:
            p.send(synthetic_columns(np.arange(1000, 1100)), partition=1)
        deadline = time.monotonic() + 60
        while seen() < 200 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        produce(bootstrap, topic, 5000, 1)  # (wakes the read, to end it)
        reader.join(30)
        ld.close()
    ids = np.concatenate(got)
    assert np.array_equal(np.sort(ids[ids < 5000]), np.concatenate(
        [np.arange(100), np.arange(1000, 1100)]))


@pytest.mark.parametrize("suffix", [".npz", ".parquet"])
def test_produce_cli_from_a_file(bootstrap, make_topic, group_id, tmp_path, suffix) -> None:
    topic = make_topic(partitions=2)
    cols = synthetic_columns(np.arange(700))
    path = tmp_path / f"data{suffix}"
    if suffix == ".npz":
        np.savez(path, x=cols["features"], y=cols["label"], i=cols["id"])
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({
            "x": pa.FixedSizeListArray.from_arrays(pa.array(cols["features"].ravel()), 768),
            "y": cols["label"], "i": cols["id"]}), path)
    out = subprocess.run([sys.executable, "-m", "kfeed", "produce", "--bootstrap-servers",
                          bootstrap, "--topic", topic, "--from", str(path), "--field",
                          "features=x", "--field", "label=y", "--field", "id=i"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with loader(bootstrap, topic, group_id) as ld:
        batches = list(ld)
    ids = np.concatenate([b["id"].numpy() for b in batches])
    order = np.argsort(ids)
    features = np.concatenate([b["features"].numpy() for b in batches])[order]
    assert np.array_equal(ids[order], np.arange(700))
    assert np.array_equal(features, cols["features"])


@pytest.mark.parametrize("how", ["exception", "close", "shuffled"])
def test_a_step_that_failed_leaves_its_batch_to_be_read_again(bootstrap, make_topic,
                                                              how) -> None:
    # Closing the consumer revoked every partition, and the revoke committed
    # what was handed out: the batch in hand too, whose step never finished
    # (50 of 600 records never trained, in each way of leaving).
    topic = make_topic(partitions=2)
    produce(bootstrap, topic, 0, 600, block_records=8)
    group = uuid.uuid4().hex
    kwargs = {"shuffle": kfeed.Shuffle(buffer=64, seed=0)} if how == "shuffled" else {}
    used: list[int] = []
    in_hand: list[int] = []
    ld = loader(bootstrap, topic, group, batch_size=50, **kwargs)
    try:
        with ld:
            for step, b in enumerate(ld, 1):
                if step == 3:
                    in_hand = b["id"].tolist()
                    if how == "close":
                        ld.close(commit_current=False)
                        break
                    raise RuntimeError("the step failed")
                used += b["id"].tolist()
    except RuntimeError:
        pass
    with loader(bootstrap, topic, group, batch_size=50, **kwargs) as again:
        rest = [i for b in again for i in b["id"].tolist()]
    assert set(in_hand) <= set(rest)
    assert sorted(used + rest) == sorted(set(used + rest)) == list(range(600))


def _join_mid_stream(bootstrap: str, topic: str, first_batches: int, **kwargs) -> list[np.ndarray]:
    """Loader A hands out batches (and prefetches more), then B joins the group: the
    rebalance revokes A's partitions while A holds batches not yet handed out."""
    import threading

    group = uuid.uuid4().hex
    results: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    a_started, b_started = threading.Event(), threading.Event()
    joined: dict[str, float] = {}

    def member(name: str) -> None:
        t0 = time.monotonic()
        with loader(bootstrap, topic, group, batch_size=64, **kwargs) as ld:
            for i, b in enumerate(ld):
                if i == 0:
                    joined[name] = time.monotonic() - t0
                    if name == "b":
                        b_started.set()
                results[name].append(b["id"].numpy().copy())
                if name == "a" and i == first_batches:
                    a_started.set()
                # A step's work: the rebalance lands mid-stream. A's steps are
                # slower until B reads, so that A still holds partitions then
                # (a new member waits for up to two heartbeats, 3-5 s each).
                time.sleep(0.02 if b_started.is_set() else 0.06)
    a = threading.Thread(target=member, args=("a",))
    a.start()
    assert a_started.wait(60), "loader A handed out nothing"
    b = threading.Thread(target=member, args=("b",))
    b.start()
    a.join(180)
    b.join(180)
    assert results["b"], "the rebalance gave B no batch: nothing was tested"
    print(f"a member joining mid-stream read its first batch after {joined['b']:.2f} s")
    return [np.concatenate(results[k]) for k in ("a", "b")]


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_member_joining_mid_stream_loses_and_repeats_nothing(bootstrap, make_topic,
                                                               protocol) -> None:
    topic = make_topic(partitions=4)
    produce(bootstrap, topic, 0, 16_000)
    a, b = _join_mid_stream(bootstrap, topic, first_batches=20, kafka=PROTOCOLS[protocol])
    ids = np.concatenate([a, b])
    assert len(ids) == len(np.unique(ids)) == 16_000


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_shuffling_member_joining_mid_stream_loses_and_repeats_nothing(bootstrap, make_topic,
                                                                         protocol) -> None:
    # The records of a moved partition that the shuffle used above its
    # committed offset are noted in the revoke's commit; the new owner skips
    # them (NOTE [ Commit notes ]).
    topic = make_topic(partitions=4)
    produce(bootstrap, topic, 0, 16_000)
    a, b = _join_mid_stream(bootstrap, topic, first_batches=20, kafka=PROTOCOLS[protocol],
                            shuffle=kfeed.Shuffle(buffer=256, seed=1))
    ids = np.concatenate([a, b])
    assert not np.array_equal(a[:1000], np.sort(a[:1000]))  # it did shuffle
    assert len(ids) == len(np.unique(ids)) == 16_000


def test_asynchronous_commits_count_once_the_broker_answers(bootstrap, make_topic,
                                                            group_id) -> None:
    topic = make_topic(partitions=1)
    produce(bootstrap, topic, 0, 2000)
    with loader(bootstrap, topic, group_id, batch_size=100, commit_interval_ms=1,
                until=None) as ld:
        it = iter(ld)
        next(it)
        f = ld._ledger
        # Each next() asks for a commit of the batch before; the loader's
        # thread makes it, asynchronously, and its answer is served by a later
        # consume() and recorded by a later commit.
        deadline = time.monotonic() + 20
        while not f.committed and time.monotonic() < deadline:
            next(it)
            time.sleep(0.05)  # a training step
        assert f.committed, "no asynchronous commit was acknowledged"
        (tp, (off, skip)), = f.committed.items()
        assert tp == (topic, 0) and 0 < off <= 2000 and skip >= 0
        assert not ld._source._inflight or all(o > off for (_t, o) in ld._source._inflight)


def test_a_dead_letter_copy_that_fails_stops_the_loader_before_any_commit_past_it(
        bootstrap, make_topic, group_id) -> None:
    # dlq_config names the dead-letter principal's connection; one that
    # cannot connect proves it is used, and that nothing is committed past a
    # bad record whose copy is not safe.
    topic = make_topic(partitions=1)
    good = SCHEMA.encode_blocks(synthetic_columns(np.arange(256)), 64)
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for v in [good[0], b"junk", *good[1:]]:
        p.produce(topic, value=v)
    assert p.flush(30) == 0
    ld = loader(bootstrap, topic, group_id, batch_size=64, connect_timeout_s=3,
                dlq_config={"bootstrap.servers": "127.0.0.1:9"})
    with pytest.raises(kfeed.ConsumeError, match="cannot create dead-letter topic"):
        for _ in ld:
            pass
    ld.close()
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group_id})
    from confluent_kafka import TopicPartition

    (committed,) = c.committed([TopicPartition(topic, 0)], timeout=10)
    c.close()
    assert committed.offset <= 1  # never past the bad record at offset 1


def test_a_bad_record_the_dead_letter_topic_refuses_stops_the_read_and_is_never_passed(
        bootstrap, make_topic, group_id) -> None:
    # The copy failed (too large for the dead-letter topic) and the read went
    # on: every commit failed, as warnings only, and a later bad record's copy
    # landed, so the next group took the first for copied and passed it: lost.
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = make_topic(partitions=1)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(f"{topic}.dlq", 1, config={"max.message.bytes": "1000"})]
                        )[f"{topic}.dlq"].result(30)
    good = SCHEMA.encode_blocks(synthetic_columns(np.arange(256)), 64)
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for v in [good[0], b"X" * 5000, *good[1:]]:
        p.produce(topic, value=v)
    assert p.flush(30) == 0
    refused = (rf"could not copy the bad record at {topic}\[0\]@1 \(5,000 bytes\) to the "
               rf"dead-letter topic {topic}.dlq: .*max.message.bytes.*on_bad_record='skip'")
    with pytest.raises(kfeed.ConsumeError, match=refused), \
            loader(bootstrap, topic, group_id, batch_size=64) as ld:
        for _ in ld:
            pass
    p.produce(topic, value=b"junk")  # a bad record small enough, after it
    p.produce(topic, value=good[0])
    assert p.flush(30) == 0
    for group in (group_id, f"{group_id}-other"):  # the same group again, and another one
        with pytest.raises(kfeed.ConsumeError, match=refused), \
                loader(bootstrap, topic, group, batch_size=64) as ld:
            for _ in ld:
                pass
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
        (committed,) = c.committed([TopicPartition(topic, 0)], timeout=10)
        _low, copies = c.get_watermark_offsets(TopicPartition(f"{topic}.dlq", 0), timeout=10)
        c.close()
        assert committed.offset <= 1 and copies == 0


def test_a_bad_record_as_large_as_its_topic_takes_is_dead_lettered(bootstrap, group_id) -> None:
    # The dead-letter producer kept librdkafka's message.max.bytes (1,000,000)
    # and the topic it made the brokers' (1 MiB): a 1.5 MB bad record of a topic
    # made for 2 MB stopped every read at it, a raw traceback of MSG_SIZE_TOO_LARGE.
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"kfeed-test-{uuid.uuid4().hex}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1, config={"max.message.bytes": "2000000"})]
                        )[topic].result(30)
    try:
        good = SCHEMA.encode_blocks(synthetic_columns(np.arange(128)), 64)
        p = KafkaProducer({"bootstrap.servers": bootstrap, "message.max.bytes": 2_000_000})
        for v in [good[0], b"X" * 1_500_000, good[1]]:
            p.produce(topic, value=v)
        assert p.flush(30) == 0
        with loader(bootstrap, topic, group_id, batch_size=64,
                    kafka={"fetch.max.bytes": 4_000_000}) as ld:
            assert sum(b.size for b in ld) == 128
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": group_id})
        _low, copies = c.get_watermark_offsets(TopicPartition(f"{topic}.dlq", 0), timeout=10)
        c.close()
        assert copies == 1
    finally:
        for f in admin.delete_topics([topic, f"{topic}.dlq"]).values():
            with contextlib.suppress(Exception):
                f.result(30)


class _BadMessage:
    """A bad record of partition t[0] at ``offset``, as confluent-kafka gives it."""

    def __init__(self, offset: int) -> None:
        self._offset = offset

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return b"bad"

    def key(self) -> None:
        return None


def _dead_letter_source(producer: Any, timeout_s: float) -> Any:
    """A KafkaSource with only its dead-letter state, copying through ``producer``, t.dlq made."""
    from collections import deque

    from kfeed.sources import KafkaSource

    source = KafkaSource.__new__(KafkaSource)
    source.connect_timeout, source.ended, source.dead_lettered = timeout_s, None, 0
    source._dlq_producer, source._dlq_errors = producer, deque()
    source._dlq_partitions, source._topic_ids = {"t.dlq": 1}, {"t": None}
    source._dlq_done, source._dlq_inflight = {("t", 0): -1}, {}
    return source


def test_a_copy_waits_for_the_one_before_of_its_partition_and_none_follows_a_failure() -> None:
    # Copies were sent without waiting: one sent while the copy before it was
    # in flight landed after that one failed, and the prefix rule took the
    # failed one for copied.
    from confluent_kafka import KafkaError

    class Refusing:  # a dead-letter producer whose brokers refuse the first copy
        def __init__(self) -> None:
            self.queued: list = []
            self.sent: list[int] = []

        def produce(self, topic, value=None, key=None, headers=None, partition=None,
                    on_delivery=None) -> None:
            self.queued.append(on_delivery)
            self.sent.append(on_delivery.args[1])

        def poll(self, timeout: float = 0) -> int:
            if timeout and self.queued:  # the answer comes while the loader waits
                self.queued.pop(0)(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), _BadMessage(0))
            return 0

        def __len__(self) -> int:
            return len(self.queued)

    source = _dead_letter_source(Refusing(), timeout_s=5.0)
    assert source.dead_letter(_BadMessage(10), "bad")
    with pytest.raises(kfeed.ConsumeError, match=r"bad record at t\[0\]@10 "):
        source.dead_letter(_BadMessage(11), "bad")
    assert source._dlq_producer.sent == [10]
    with pytest.raises(kfeed.ConsumeError, match=r"bad record at t\[0\]@10 "):
        source.settle()
    assert source.dead_lettered == 0  # sent, refused: not copied


def test_a_copy_acknowledged_before_produce_returns_does_not_hold_the_next_one() -> None:
    # A settle() on the caller's thread can serve a copy's answer before the
    # loader's thread is back from produce(): the copy was marked in flight
    # after its answer came, for ever, and the partition's next bad record
    # waited out the timeout, then ended the read.
    class AnsweredAtOnce:
        def __init__(self) -> None:
            self.sent: list[int] = []

        def produce(self, topic, value=None, key=None, headers=None, partition=None,
                    on_delivery=None) -> None:
            self.sent.append(on_delivery.args[1])
            on_delivery(None, _BadMessage(on_delivery.args[1]))  # served meanwhile, elsewhere

        def poll(self, timeout: float = 0) -> int:
            return 0

        def __len__(self) -> int:
            return 0

    source = _dead_letter_source(AnsweredAtOnce(), timeout_s=0.5)
    assert source.dead_letter(_BadMessage(10), "bad") and source.dead_letter(_BadMessage(11), "bad")
    assert source._dlq_producer.sent == [10, 11] and source._dlq_inflight == {}
    assert source.dead_lettered == 2


def test_a_leader_or_coordinator_that_moves_is_asked_again() -> None:
    # Right after a cluster restart, kfeed.group_lag failed at once with
    # "Coordinator load in progress", and a loader's first look at a
    # partition's end with "Not leader for partition": confluent-kafka marks
    # neither retriable, so the watermarks' retry gave up on it.
    from confluent_kafka import KafkaError, KafkaException

    from kfeed._kafka import passing
    from kfeed.sources import KafkaSource

    answers = [KafkaException(KafkaError(14)), KafkaException(KafkaError(6)), "lag"]

    def ask() -> str:
        item = answers.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def fails(code: int) -> Any:
        def call() -> None:
            raise KafkaException(KafkaError(code))
        return call

    assert passing(ask, 10.0) == "lag" and answers == []
    t0 = time.monotonic()
    with pytest.raises(KafkaException):  # a topic that is not there: not asked again
        passing(fails(KafkaError.UNKNOWN_TOPIC_OR_PART), 10.0)
    assert time.monotonic() - t0 < 1
    with pytest.raises(KafkaException):  # a passing one that stays: until the timeout
        passing(fails(KafkaError.COORDINATOR_NOT_AVAILABLE), 0.6)
    assert 0.5 < time.monotonic() - t0 < 3

    class Moving:  # a consumer whose partition's leader moves once
        calls = 0

        def get_watermark_offsets(self, tp, timeout=None, cached=False):
            Moving.calls += 1
            if Moving.calls == 1:
                raise KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))
            return (0, 42)

    source = KafkaSource.__new__(KafkaSource)
    source.connect_timeout, source._consumer = 10.0, Moving()
    assert source.watermarks(("t", 0)) == (0, 42) and Moving.calls == 2

    class Recovering:  # every broker restarted: a listed partition unknown for a while
        calls = 0

        def get_watermark_offsets(self, tp, timeout=None, cached=False):
            Recovering.calls += 1
            if Recovering.calls <= 2:
                raise KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION))
            return (0, 7)

    source._consumer = Recovering()
    assert source.watermarks(("t", 0)) == (0, 7) and Recovering.calls == 3


@pytest.mark.parametrize(("code", "member", "later"), [
    (22, True, True),    # ILLEGAL_GENERATION: a cooperative rebalance completed meanwhile
    (27, True, True),    # REBALANCE_IN_PROGRESS
    (110, True, True),   # FENCED_MEMBER_EPOCH (the consumer protocol)
    (113, True, True),   # STALE_MEMBER_EPOCH
    (25, True, True),    # UNKNOWN_MEMBER_ID: the member joins again at its next poll
    (25, False, False),  # ... but a loader outside the group never will
    (29, True, False),   # TOPIC_AUTHORIZATION_FAILED
])
def test_a_commit_refused_for_the_group_s_generation_is_made_after_the_next_poll(
        code, member, later) -> None:
    # Under cooperative-sticky with commit_interval_ms=0, a member's step
    # raised "offset commit failed: ... Specified group generation id is not
    # valid" in 7 of 30 runs where another member joined: the rebalance had
    # completed between the poll and the commit. Made again after the next
    # poll (Fetcher._commit), it goes through.
    from confluent_kafka import KafkaError, KafkaException

    from kfeed.sources import KafkaSource

    class Refusing:
        def commit(self, offsets=None, asynchronous=True):
            raise KafkaException(KafkaError(code))

    source = KafkaSource.__new__(KafkaSource)
    source._consumer, source.connect_timeout, source.group_member = Refusing(), 5.0, member
    source.commits_sent = source.commit_failures = 0
    source.lineage, source.run, source._note_warned, source._note_limit = "l", "r", set(), 4096
    source._inflight, source._config = {}, {"group.id": "g"}
    with pytest.raises(kfeed.ConsumeError) as refused:
        source.commit({("t", 0): (5, 0)}, asynchronous=False)
    assert refused.value.after_poll is later


def test_a_topic_whose_leaders_are_gone_is_one_line_before_produce_writes(monkeypatch) -> None:
    # kfeed produce into it ended "unexpected KafkaException: ... Failed to get
    # watermark offsets: Local: Timed out", exit 1, naming neither the cause
    # nor that nothing was sent.
    import confluent_kafka
    from confluent_kafka import KafkaError, KafkaException

    from kfeed._kafka import newest_values

    class Leaderless:
        def __init__(self, config) -> None:
            pass

        def list_topics(self, topic, timeout=None):
            class Md:
                topics = {topic: type("T", (), {"partitions": {0: None, 1: None}})()}
            return Md()

        def get_watermark_offsets(self, tp, timeout=None):
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT,
                                            "Failed to get watermark offsets: Local: Timed out"))

        def close(self) -> None:
            pass

    monkeypatch.setattr(confluent_kafka, "Consumer", Leaderless)
    with pytest.raises(kfeed.ProduceError, match=r"^cannot read the newest messages of t within "
                                                 r"5s, to check what it holds \(.*Timed out\): "
                                                 r"its partitions' leaders do not answer; "
                                                 r"nothing was sent"):
        newest_values({"bootstrap.servers": "127.0.0.1:1"}, "t", 5.0)


def test_a_mistake_in_dlq_config_is_one_line_when_the_loader_is_made(bootstrap) -> None:
    # It came at the first bad record, as a 22-line traceback of librdkafka's refusal.
    with pytest.raises(kfeed.ConfigError, match="^dlq_config: bad Kafka setting: .*no.such.prop"):
        loader(bootstrap, "never-read", "g", dlq_config={"no.such.prop": 1})


def test_dataloader_workers_share_the_partitions_and_read_every_id_once(
        bootstrap, make_topic, group_id) -> None:
    import torch

    topic = make_topic(partitions=4)
    produce(bootstrap, topic, 0, 4000)
    ds = kfeed.KafkaIterableDataset({"bootstrap.servers": bootstrap, "group.id": group_id},
                                    topic, SCHEMA, 100, until="end")
    # forkserver, as the docs advise: a forked worker inherits the Kafka
    # clients the parent process holds, whose librdkafka threads a fork does
    # not copy (a worker crashed so once this process had made many).
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                     multiprocessing_context="forkserver")
    ids = np.concatenate([b["id"].numpy() for b in dl])
    assert len(ids) == 4000 and np.array_equal(np.sort(ids), np.arange(4000))


def test_persistent_dataloader_workers_read_the_window_again_each_pass(
        bootstrap, make_topic, group_id) -> None:
    # Persistent workers keep their seeds, so each pass was the same run: the
    # second took the first's commits at the window's end as another worker's
    # of its own run, went on from there whatever the start, and read nothing.
    import torch

    topic = make_topic(partitions=4)
    produce(bootstrap, topic, 0, 1000)
    ds = kfeed.KafkaIterableDataset({"bootstrap.servers": bootstrap, "group.id": group_id},
                                    topic, SCHEMA, 100, start="earliest", until="end")
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                                     multiprocessing_context="forkserver")
    for _ in range(2):
        ids = np.concatenate([b["id"].numpy() for b in dl])
        assert np.array_equal(np.sort(ids), np.arange(1000))


def test_more_dataloader_workers_than_partitions_in_a_group_is_one_clear_error(
        bootstrap, make_topic, group_id) -> None:
    # A worker of the group with no partition never ended, and the DataLoader,
    # which takes batches from each worker in turn, waited on it for ever.
    import torch

    topic = make_topic(partitions=1)
    produce(bootstrap, topic, 0, 300)
    ds = kfeed.KafkaIterableDataset({"bootstrap.servers": bootstrap, "group.id": group_id},
                                    topic, SCHEMA, 100, until="end")
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, timeout=120,
                                     multiprocessing_context="forkserver")
    with pytest.raises(kfeed.ConfigError, match=(
            f"2 DataLoader workers share the partitions in a consumer group \\({topic} has 1; "
            f"the range assignor deals each topic's partitions apart\\): a worker without one "
            f"would hold the DataLoader up for ever; use at most 1 worker, more partitions")):
        list(dl)


@pytest.mark.parametrize("strategy", ["range", "roundrobin"])
def test_workers_on_two_topics_of_one_partition_count_them_as_the_assignor_deals(
        bootstrap, make_topic, group_id, strategy) -> None:
    # Two topics of one partition each: the range assignor gives both to one
    # worker and none to the other, which held the DataLoader up for ever; the
    # check counted 2 partitions for 2 workers. Round robin spreads them.
    import torch

    topics = [make_topic(partitions=1) for _ in range(2)]
    for i, topic in enumerate(topics):
        produce(bootstrap, topic, i * 300, 300)
    config = {"bootstrap.servers": bootstrap, "group.id": group_id,
              "partition.assignment.strategy": strategy}
    ds = kfeed.KafkaIterableDataset(config, topics, SCHEMA, 100, until="end")
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, timeout=120,
                                     multiprocessing_context="forkserver")
    if strategy == "range":
        with pytest.raises(kfeed.ConfigError, match=(
                f"{topics[0]} has 1, {topics[1]} has 1; the range assignor deals each topic's "
                f"partitions apart.* use at most 1 worker, more partitions, "
                f"partition.assignment.strategy=roundrobin or assignment='static'")):
            list(dl)
        return
    ids = np.concatenate([b["id"].numpy() for b in dl])
    assert np.array_equal(np.sort(ids), np.arange(600))


def test_workers_of_one_dataloader_iteration_follow_each_others_commits(
        bootstrap, make_topic, group_id, monkeypatch) -> None:
    # Each worker's loader was a run of its own: with start="earliest" a worker
    # that joined after another had read (and committed) a partition read it
    # again from the start (200 to 300 of 1,000 records twice). Here worker 1
    # reads everything first, then worker 0 of the same iteration joins.
    import types

    import torch

    topic = make_topic(partitions=4)
    produce(bootstrap, topic, 0, 1000)
    ds = kfeed.KafkaIterableDataset({"bootstrap.servers": bootstrap, "group.id": group_id},
                                    topic, SCHEMA, 100, until="end", start="earliest")
    worker = types.SimpleNamespace(num_workers=2, id=1, seed=7001)
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: worker)
    # Each worker iterates a copy of its own, as the DataLoader sends them.
    first = np.concatenate([b["id"].numpy() for b in pickle.loads(pickle.dumps(ds))])
    assert np.array_equal(np.sort(first), np.arange(1000))
    worker.id, worker.seed = 0, 7000
    assert sum(b.size for b in pickle.loads(pickle.dumps(ds))) == 0  # all read, by its sibling
    # The next iteration of the DataLoader (another base seed) is another run.
    worker.seed = 9000
    assert sum(b.size for b in pickle.loads(pickle.dumps(ds))) == 1000


def test_the_workers_of_every_rank_count_against_the_partitions_of_a_group(
        bootstrap, make_topic, group_id) -> None:
    # Each rank checked its own 2 workers against the 2 partitions, while the
    # group had 4 members: workers without one, and a DataLoader waiting on them.
    import torch

    topic = make_topic(partitions=2)
    produce(bootstrap, topic, 0, 300)
    ds = kfeed.KafkaIterableDataset({"bootstrap.servers": bootstrap, "group.id": group_id},
                                    topic, SCHEMA, 100, until="end", rank=0, world_size=2)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, timeout=120,
                                     multiprocessing_context="forkserver")
    with pytest.raises(kfeed.ConfigError, match=(
            f"2 DataLoader workers on each of 2 ranks \\(4 members\\) share the partitions "
            f"in a consumer group \\({topic} has 2; the range assignor deals each topic's "
            f"partitions apart\\): a worker without one would hold the DataLoader up for "
            f"ever; use at most 1 worker a rank, more partitions")):
        list(dl)


def test_the_dataset_and_its_schema_travel_to_spawned_workers() -> None:
    import pickle

    ds = kfeed.KafkaIterableDataset({"bootstrap.servers": "x", "group.id": "g"}, "t", SCHEMA,
                                    10, until="end", shuffle=kfeed.Shuffle(buffer=8, seed=1))
    back = pickle.loads(pickle.dumps(ds))
    assert back.config == ds.config and back.config.schema.fingerprint == SCHEMA.fingerprint


def test_the_dataset_checks_its_settings_when_made() -> None:
    with pytest.raises(kfeed.ConfigError, match="batch_size must be a positive int"):
        kfeed.KafkaIterableDataset({"bootstrap.servers": "x", "group.id": "g"}, "t", SCHEMA, 0)


@contextlib.contextmanager
def own_broker(tmp_path, monkeypatch, **overrides: str) -> Iterator[str]:
    """A 1-node cluster of this test's own with broker settings ``overrides``; its servers."""
    from kfeed import cluster

    monkeypatch.setenv("KFEED_CLUSTER_REGISTRY", str(tmp_path / "registry"))
    state = tmp_path / "own-broker"
    servers = cluster.up(nodes=1, dir=state, port=cluster.free_port_base(1, 39692),
                         overrides=overrides)
    try:
        yield servers
    finally:
        cluster.down(state, wipe=True)


def test_brokers_without_the_consumer_protocol_refuse_it_in_one_clear_error(
        tmp_path, monkeypatch) -> None:
    # A broker of its own, with the consumer group protocol switched off.
    with own_broker(tmp_path, monkeypatch,
                    **{"group.coordinator.rebalance.protocols": "classic"}) as servers:
        kfeed.create_topic({"bootstrap.servers": servers}, "t", partitions=1)
        with kfeed.Producer({"bootstrap.servers": servers}, "t", SCHEMA) as p:
            p.send(synthetic_columns(np.arange(100)))
        ld = kfeed.Loader({"bootstrap.servers": servers, "group.id": "g",
                           "group.protocol": "consumer"}, "t", SCHEMA, 10, device="cpu",
                          connect_timeout_s=10)
        with pytest.raises(kfeed.ConsumeError) as e:
            next(ld)
        ld.close()
        assert str(e.value).startswith(f"the brokers at {servers} refused group.protocol="
                                       "consumer (")
        assert str(e.value).endswith("set group.protocol=classic")
        classic = loader(servers, "t", "g2", batch_size=10, kafka={"group.protocol": "classic"})
        with classic:
            assert sum(b.size for b in classic) == 100


def test_a_broker_that_keeps_less_metadata_gets_commits_without_notes(
        tmp_path, monkeypatch, caplog) -> None:
    # A broker of its own keeping 64 characters of commit metadata: a shuffle's
    # notes do not fit. Its first refusal switches them off and the same
    # commit goes through without them: records may come again, none is lost.
    with own_broker(tmp_path, monkeypatch, **{"offset.metadata.max.bytes": "64"}) as servers:
        kfeed.create_topic({"bootstrap.servers": servers}, "t", partitions=2)
        produce(servers, "t", 0, 3000)
        shuffle = kfeed.Shuffle(buffer=500, seed=0)
        got: list[int] = []
        with caplog.at_level("WARNING", logger="kfeed.sources"):
            for kw in ({"commit_interval_ms": 0}, {"start": "committed"}):
                with loader(servers, "t", "g", batch_size=100, shuffle=shuffle, **kw) as ld:
                    for i, b in enumerate(ld):
                        got += b["id"].tolist()
                        if "commit_interval_ms" in kw and i == 10:
                            break
        assert sorted(set(got)) == list(range(3000))  # nothing lost
        assert "refused a commit's metadata as too long" in caplog.text
        # The commits went through: a third loader of the group finds nothing left.
        with loader(servers, "t", "g", batch_size=100, start="committed") as ld:
            assert sum(b.size for b in ld) == 0


def test_stats_never_waits_for_the_loaders_thread(bootstrap, make_topic, group_id) -> None:
    # A streaming loader that read everything sits in consume(); stats() on
    # the caller's thread must not wait for it (a consumer call would).
    topic = make_topic(partitions=1)
    produce(bootstrap, topic, 0, 300)
    with loader(bootstrap, topic, group_id, batch_size=100, until=None) as ld:
        next(ld), next(ld), next(ld)
        t = time.monotonic()
        for _ in range(20):
            ld.stats()
        took = time.monotonic() - t
    assert took < 2.0, took  # 20 calls; one wait for a consume() would be 0.1 s or more


def test_a_static_loader_committing_into_a_group_with_members_says_why(bootstrap,
                                                                         make_topic) -> None:
    # Under the consumer protocol a group with members takes no commit from
    # outside it; the end-of-read commit fails with one clear line.
    topic = make_topic(partitions=2)
    produce(bootstrap, topic, 0, 640)
    group = uuid.uuid4().hex
    member = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                       "group.protocol": "consumer"})
    member.subscribe([topic])
    try:
        deadline = time.monotonic() + 60
        while not member.assignment() and time.monotonic() < deadline:
            member.poll(0.2)
        assert member.assignment(), "the member got no partition"
        ld = loader(bootstrap, topic, group, assignment="static")
        try:
            with pytest.raises(kfeed.ConsumeError, match="not a member of group .*, which has "
                                                         "members.* a group.id of its own"):
                for _ in ld:
                    member.poll(0)  # (the member stays in the group)
        finally:
            ld.close()
    finally:
        member.close()


def test_a_static_member_fenced_by_another_with_its_id_stops_at_once(
        bootstrap, make_topic, group_id) -> None:
    # A second process of the same static member fences the first, whose
    # commits are refused from then on; it went on handing out the batches
    # fetched before (794 in 16 s once), each read again by the new member.
    ids = kfeed.Schema({"id": ("int64", ())})
    topic = make_topic(partitions=2)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, ids, block_records=16) as p:
        p.send({"id": np.arange(200_000)})
    config = {"bootstrap.servers": bootstrap, "group.id": group_id,
              "group.instance.id": "trainer-0"}
    first = kfeed.Loader(config, topic, ids, 50, device="cpu", commit_interval_ms=100)
    second = None
    try:
        for _ in range(5):
            next(first)
        second = kfeed.Loader(config, topic, ids, 50, device="cpu")
        assert next(second).size == 50  # it holds the partitions now
        handed = 0
        deadline = time.monotonic() + 60
        with pytest.raises(kfeed.ConsumeError, match=(
                f"the consumer of group '{group_id}' can no longer commit \\(.*\\): another "
                f"consumer took its group.instance.id 'trainer-0'")):
            while time.monotonic() < deadline:
                next(first)
                handed += 1
                time.sleep(0.01)
        assert handed < 200, handed
    finally:
        with contextlib.suppress(kfeed.KfeedError):
            first.close()
        if second is not None:
            second.close()


def test_a_state_whose_records_retention_deleted_says_so(bootstrap, make_topic, group_id,
                                                         caplog) -> None:
    # A state saved before the job was down, and retention deleted its records
    # meanwhile: in offset order the loss went unsaid (librdkafka's offset reset
    # alone); with shuffle the loader waited for ever for its held records.
    import logging

    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    ids = kfeed.Schema({"id": ("int64", ())})
    topic = make_topic(partitions=1)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, ids, block_records=16) as p:
        p.send({"id": np.arange(2000)})  # 125 messages

    def read(group: str, **kwargs) -> kfeed.Loader:
        return kfeed.Loader({"bootstrap.servers": bootstrap, "group.id": group}, topic, ids, 50,
                            device="cpu", **{"until": "end", **kwargs})

    states = {}
    for name, shuffle in (("plain", None), ("shuffled", kfeed.Shuffle(buffer=100, seed=0))):
        with read(f"{group_id}-{name}", shuffle=shuffle) as ld:
            for _ in range(20):
                next(ld)
            states[name] = ld.state_dict()
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for done in admin.delete_records([TopicPartition(topic, 0, 80)]).values():
        done.result()  # records 0..1279 gone
    with caplog.at_level(logging.WARNING, logger="kfeed.loader"):
        with read(f"{group_id}-plain") as ld:
            ld.load_state_dict(states["plain"])
            rest = np.concatenate([b["id"].numpy() for b in ld])
    assert np.array_equal(rest, np.arange(1280, 2000))
    assert [r.getMessage() for r in caplog.records if "retention" in r.getMessage()] == [
        f"{topic}[0]: the state resumes at offset 62, but the brokers keep the partition from "
        f"offset 80 on: 18 message(s) were deleted (retention) before they were read; reading "
        f"goes on from offset 80"]
    with read(f"{group_id}-shuffled", shuffle=kfeed.Shuffle(buffer=100, seed=0),
              until=None) as ld:
        ld.load_state_dict(states["shuffled"])
        with pytest.raises(kfeed.ConsumeError, match=(
                f"^{topic}\\[0\\]: the state resumes at offset \\d+, but the brokers keep the "
                f"partition from offset 80 on: .* the state holds records of them")):
            next(ld)


@pytest.mark.parametrize("shuffle", [None, kfeed.Shuffle(buffer=64, seed=1)], ids=["in order", "shuffled"])
def test_a_transactional_topic_read_to_its_end_has_no_lag_left(bootstrap, make_topic, group_id,
                                                                shuffle) -> None:
    # The commit was the last record's offset + 1, where the transaction's
    # commit marker lies: the group's lag stayed 1 a partition for ever.
    ids = kfeed.Schema({"id": ("int64", ())})
    topic = make_topic(partitions=2)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, ids,
                        transactional_id=f"{group_id}-tx") as p:
        with p.transaction():
            p.send({"id": np.arange(1000)})
    config = {"bootstrap.servers": bootstrap, "group.id": group_id}
    with kfeed.Loader(config, topic, ids, 64, device="cpu", until="end", shuffle=shuffle) as ld:
        assert sum(b.size for b in ld) == 1000
    lags = kfeed.group_lag(config, group_id, [topic])
    assert [(p.committed, p.lag) for p in lags] == [(p.end, 0) for p in lags]


def test_a_topic_made_again_under_its_name_has_its_own_bad_records_dead_lettered(
        bootstrap, group_id, caplog) -> None:
    # Offsets start at 0 again in the new topic, and its bad record below the
    # old one's highest copy counted as copied: not in the dead-letter topic,
    # while the warning said "sent to".
    import logging

    from confluent_kafka.admin import AdminClient, NewTopic

    from records import read_dlq

    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic = f"kfeed-test-{uuid.uuid4().hex}"

    def fill(bad_at: int, tag: bytes) -> None:
        produce(bootstrap, topic, 0, bad_at, format="raw")
        p = KafkaProducer({"bootstrap.servers": bootstrap})
        p.produce(topic, value=tag, partition=0)
        assert p.flush(30) == 0

    def made() -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                admin.create_topics([NewTopic(topic, 1, 1)])[topic].result()
                return
            except Exception:  # noqa: BLE001 - the deletion still under way
                assert time.monotonic() < deadline, "the topic could not be made again"
                time.sleep(0.5)

    try:
        made()
        fill(10, b"bad one")
        with loader(bootstrap, topic, f"{group_id}-1", format="raw") as ld:
            assert sum(b.size for b in ld) == 10
        admin.delete_topics([topic])[topic].result()
        made()
        fill(1, b"bad two")
        with caplog.at_level(logging.WARNING, logger="kfeed.loader"), \
                loader(bootstrap, topic, f"{group_id}-2", format="raw") as ld:
            assert sum(b.size for b in ld) == 1
            assert ld.stats()["dead_lettered"] == 1
        assert [m.value() for m in read_dlq(bootstrap, topic, 2)] == [b"bad one", b"bad two"]
        assert f"bad record at {topic}[0]@1, sent to {topic}.dlq" in caplog.text
    finally:
        admin.delete_topics([topic, f"{topic}.dlq"])


def test_a_commit_acknowledged_at_the_interpreter_s_exit_needs_no_import(monkeypatch) -> None:
    # close()'s commit, run by a loader collected at exit, imported
    # confluent_kafka in its callback: "ImportError: sys.meta_path is None",
    # a traceback after a job's real error.
    from collections import deque
    from types import SimpleNamespace

    from kfeed.sources import KafkaSource

    source = KafkaSource.__new__(KafkaSource)
    source._inflight, source._acked = {(("t", 0), 7): (7, 0)}, deque()
    source._gone = source._suspect = None
    monkeypatch.setitem(sys.modules, "confluent_kafka", None)  # imports fail, as at exit
    source._on_commit(None, [SimpleNamespace(topic="t", partition=0, offset=7, error=None)])
    assert list(source._acked) == [(("t", 0), (7, 0))]
