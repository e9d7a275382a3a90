"""kfeed.Producer: keyed variable-length documents, and how errors reach the caller.

The unit tests need no broker. The integration tests send keyed token
documents to the real cluster, read every partition back with plain
confluent-kafka, decode the values with ``Schema.decode_documents``, and
check that every document arrived exactly once, bit-equal, on the partition
``kfeed.partition_for(key, n)`` names.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

import kfeed
from kfeed._kafka import kafka_error as _kafka_error
from kfeed import producer as producer_module
from kfeed.producer import _take_documents

# A document's first token is its id, so that raw values (the documents
# alone, no other field) still say which document they are.
BLOCK_SCHEMA = kfeed.Schema({"tokens": ("int32", (None,)), "id": ("int64", ())})
RAW_SCHEMA = kfeed.Schema({"tokens": ("int32", (None,))})


def documents(first: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(first, first + n):
        body = rng.integers(-(2**31), 2**31 - 1, int(rng.integers(0, 300)), dtype=np.int32)
        docs.append(np.r_[np.int32(i), body].astype(np.int32))
    return docs


def as_form(docs: list[np.ndarray], form: str) -> Any:
    if form == "list":
        return docs
    if form == "flat":
        return np.concatenate(docs), np.array([len(d) for d in docs], np.int64)
    assert form == "torch"
    return torch.from_numpy(np.concatenate(docs)), torch.tensor([len(d) for d in docs])


# -- without a broker ------------------------------------------------------------


@pytest.mark.parametrize("form", ["list", "flat", "torch"])
def test_take_documents_picks_whole_documents_in_order(form: str) -> None:
    docs = documents(0, 40, seed=1) + [np.empty(0, np.int32)] * 3  # empty ones too
    idx = np.array([42, 3, 0, 17, 17, 40, 39], np.int64)
    got = _take_documents(as_form(docs, form), idx)
    if form == "list":
        picked = got
    else:
        flat, lengths = got
        flat = flat.numpy() if isinstance(flat, torch.Tensor) else flat
        picked = np.split(flat, np.cumsum(lengths)[:-1])
    assert len(picked) == len(idx)
    for i, doc in zip(idx, picked):
        assert np.array_equal(doc, docs[i]) and doc.dtype == np.int32


def test_take_documents_of_nothing() -> None:
    flat, lengths = _take_documents(as_form(documents(0, 5, seed=2), "flat"), np.empty(0, np.int64))
    assert len(flat) == 0 and len(lengths) == 0


def test_a_kafka_error_is_found_behind_the_system_error_it_caused() -> None:
    from confluent_kafka import KafkaError, KafkaException

    fatal = KafkaError(KafkaError.CLUSTER_AUTHORIZATION_FAILED, "no IdempotentWrite", fatal=True)
    try:
        try:
            raise KafkaException(fatal)
        except KafkaException as e:
            raise SystemError("returned a result with an exception set") from e
    except SystemError as e:
        assert _kafka_error(e) is fatal
    assert _kafka_error(RuntimeError("unrelated")) is None


# -- against the cluster ---------------------------------------------------------


def read_partitions(bootstrap: str, topic: str) -> dict[int, list[Any]]:
    """Every message of every partition of ``topic``, from the start to the high watermark."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"kfeed-test-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    try:
        parts = sorted(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in parts}
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        got: dict[int, list[Any]] = {p: [] for p in parts}
        left = sum(ends.values())
        while left:
            msg = consumer.poll(10)
            assert msg is not None, f"{left} message(s) missing from {topic}"
            assert msg.error() is None, msg.error()
            got[msg.partition()].append(msg)
            left -= 1
        return got
    finally:
        consumer.close()


_INTERRUPTED_FLUSH = """
import os, signal, sys, threading, time
import numpy as np, kfeed
# (started in a shell's background job, SIGINT is ignored: Python's own handler back)
signal.signal(signal.SIGINT, signal.default_int_handler)
schema = kfeed.Schema({"id": ("int64", ())})
p = kfeed.Producer({"bootstrap.servers": sys.argv[1], "max.in.flight": 1, "linger.ms": 0,
                    "batch.num.messages": 1}, sys.argv[2], schema, block_records=1)
p.send({"id": np.arange(10000)})
flushing = threading.Event()
slice_of = p._flush
def flush_slices(timeout):
    flushing.set()
    return slice_of(timeout)
p._flush = flush_slices
def interrupt():
    flushing.wait()
    time.sleep(0.05)  # in librdkafka's flush, waiting on the brokers
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
try:
    p.flush()
    print("flushed")
except KeyboardInterrupt:
    print("interrupted")
p.flush()
print(p.stats()["delivery_failures"], p.stats()["messages"])
"""


@pytest.mark.integration
def test_a_ctrl_c_in_flush_is_a_keyboard_interrupt_not_messages_lost(bootstrap: str,
                                                                      make_topic: Any) -> None:
    # Python's KeyboardInterrupt inside confluent-kafka's flush comes out as a
    # bare SystemError, which flush() read as "N message(s) not delivered".
    import subprocess
    import sys

    topic = make_topic(partitions=1)
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_FLUSH, bootstrap, topic],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["interrupted", "0", "10000"], done.stdout + done.stderr
    assert "not delivered" not in done.stderr, done.stderr


def test_client_callbacks_never_raise_and_never_keep_their_owner_alive(caplog) -> None:
    # librdkafka's dispatch must not see an exception (NOTE [ Callbacks never
    # raise ]), neither kfeed's nor a user's, and a client's callbacks must
    # not keep the object that owns the client alive.
    import weakref

    from kfeed._kafka import chain

    class Owner:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_error(self, err: int) -> None:
            self.seen.append(err)
            if err < 0:
                raise ValueError("kfeed's own callback failed")

    def theirs(err: int) -> None:
        raise RuntimeError("the user's callback failed")

    owner = Owner()
    callback = chain(owner.on_error, theirs)
    callback(1)
    callback(-1)
    assert owner.seen == [1, -1]
    failed = [r for r in caplog.records if "Kafka client callback failed" in r.getMessage()]
    assert [r.exc_info[0] for r in failed] == [RuntimeError, ValueError, RuntimeError]
    gone = Owner()
    callback = chain(gone.on_error, None)
    ref = weakref.ref(gone)
    del gone
    assert ref() is None  # freed by its count alone: the callback does not hold it
    callback(1)  # nothing to call, nothing raised


@pytest.mark.integration
@pytest.mark.parametrize("format", ["block", "raw"])
@pytest.mark.parametrize("form", ["list", "flat"])
def test_keyed_documents_arrive_once_bit_equal_on_their_partition(
    bootstrap: str, make_topic: Any, format: str, form: str
) -> None:
    partitions = 4
    topic = make_topic(partitions=partitions)
    schema = BLOCK_SCHEMA if format == "block" else RAW_SCHEMA
    sent = documents(0, 300, seed=3) + documents(300, 200, seed=4)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema, format=format,
                        block_records=16) as producer:
        for first, n in ((0, 300), (300, 200)):
            columns: dict[str, Any] = {"tokens": as_form(sent[first:first + n], form)}
            if format == "block":
                columns["id"] = np.arange(first, first + n, dtype=np.int64)
            ids = [str(i) for i in range(first, first + n)]
            assert producer.send(columns, keys=ids) == n
    assert producer.samples == len(sent)

    seen: Counter[int] = Counter()
    for partition, messages in read_partitions(bootstrap, topic).items():
        decoded = schema.decode_documents([m.value() for m in messages], format)
        assert decoded.bad == []
        docs = np.split(decoded.tokens, np.cumsum(decoded.lengths)[:-1]) if len(decoded.lengths) else []
        if format == "raw":
            # One message per document, keyed with the id it was sent with.
            assert [m.key() for m in messages] == [str(int(d[0])).encode() for d in docs]
        else:
            assert np.array_equal(decoded.columns["id"], [int(d[0]) for d in docs])
        for doc in docs:
            i = int(doc[0])
            assert kfeed.partition_for(str(i), partitions) == partition, i
            assert doc.dtype == np.int32 and np.array_equal(doc, sent[i]), i
            seen[i] += 1
    assert sorted(seen) == list(range(len(sent)))
    assert set(seen.values()) == {1}


@pytest.mark.integration
def test_blocks_of_documents_stay_under_message_max_bytes(bootstrap: str, make_topic: Any) -> None:
    # Five documents of 400 KB each are 2 MB together: one block of 64 would
    # be refused. The producer closes each block before message.max.bytes.
    topic = make_topic(partitions=1)
    sent = [np.full(100_000, i, np.int32) for i in range(5)]
    config = {"bootstrap.servers": bootstrap, "message.max.bytes": 1_000_000, "batch.size": 1_000_000}
    with kfeed.Producer(config, topic, BLOCK_SCHEMA, block_records=64) as producer:
        producer.send({"tokens": sent, "id": np.arange(5, dtype=np.int64)}, keys=list(range(5)))
    messages = read_partitions(bootstrap, topic)[0]
    assert len(messages) == 3 and all(len(m.value()) < 1_000_000 for m in messages)
    decoded = BLOCK_SCHEMA.decode_documents([m.value() for m in messages])
    assert decoded.columns["id"].tolist() == [0, 1, 2, 3, 4]
    assert np.array_equal(decoded.tokens, np.concatenate(sent))


@pytest.mark.integration
def test_integer_keys_are_made_bytes_a_chunk_at_a_time(bootstrap: str, make_topic: Any,
                                                       monkeypatch: Any) -> None:
    # Every key was made bytes before anything was sent: a keyed send of 1M
    # 8-byte rows held 184 MB, the unkeyed one 19 MB.
    import tracemalloc

    schema = kfeed.Schema({"id": ("int64", ())})
    topic = make_topic(partitions=4)
    ids = np.arange(1_000_000)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema,
                        block_records=4096) as producer:
        tracemalloc.start()
        try:
            producer.send({"id": ids}, keys=ids)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 40e6, peak
    # Placed as before, chunk by chunk: each on its key's partition.
    monkeypatch.setattr(producer_module, "_CHUNK_KEYS", 5000)
    topic = make_topic(partitions=4)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema,
                        block_records=64) as producer:
        producer.send({"id": ids[:20_000]}, keys=ids[:20_000])
    seen = []
    for partition, messages in read_partitions(bootstrap, topic).items():
        with kfeed.Loader(None, "memory", schema, 1000, device="cpu", until="end",
                          source=kfeed.MemorySource([m.value() for m in messages])) as loader:
            got = np.concatenate([b["id"].numpy() for b in loader])
        assert all(kfeed.partition_for(str(i), 4) == partition for i in got.tolist())
        seen.append(got)
    assert np.array_equal(np.sort(np.concatenate(seen)), ids[:20_000])


@pytest.mark.integration
def test_a_strided_or_list_column_is_copied_a_chunk_at_a_time(bootstrap: str, make_topic: Any,
                                                             monkeypatch: Any) -> None:
    # The columns were checked by making each contiguous whole, a copy of a
    # strided column as large as the column, thrown away; and a list column
    # was made an array whole again for each chunk.
    import tracemalloc

    monkeypatch.setattr(producer_module, "_CHUNK_BYTES", 1 << 20)
    schema = kfeed.Schema({"x": ("float64", (4,)), "id": ("int64", ())})
    wide = np.zeros((500_000, 8), np.float64)  # 32 MB; x is every other column of it
    wide[:, 0::2] = np.arange(500_000)[:, None]
    topic = make_topic(partitions=1)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema) as p:
        tracemalloc.start()
        try:
            p.send({"x": wide[:, 0::2], "id": np.arange(500_000)})
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8e6, peak  # a chunk's copies; the column whole is 16 MB
        asarray = np.asarray
        calls = []
        monkeypatch.setattr(np, "asarray", lambda a, *k, **kw: calls.append(type(a))
                            or asarray(a, *k, **kw))
        p.send({"x": [[float(i)] * 4 for i in range(500_000, 600_000)],  # 4 chunks
                "id": list(range(500_000, 600_000))})
        monkeypatch.undo()
    assert calls.count(list) == 2  # each list column made an array once
    got = np.zeros(600_000, np.int64)
    for m in read_partitions(bootstrap, topic)[0]:
        out = {f.name: np.zeros((64, *f.shape), f.storage) for f in schema.fields}
        res = schema.decode_into([m.value()], schema.bind(out), 0)
        assert np.all(out["x"][:res.rows] == out["id"][:res.rows, None])
        np.add.at(got, out["id"][:res.rows], 1)
    assert np.all(got == 1)


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["block", "arrow"])
def test_a_document_larger_than_a_message_is_refused_before_any_is_sent(
        bootstrap: str, make_topic: Any, fmt: str) -> None:
    # Documents 0 to 2 went out, then the brokers refused document 3 ("Message
    # size too large"), and document 4 never went: a send again repeated 0 to 2.
    # (Arrow said only "Message size too large", from librdkafka.)
    topic = make_topic(partitions=1)
    sent = [np.full(10, i, np.int32) for i in range(5)]
    sent[3] = np.zeros(300_000, np.int32)  # 1.2 MB
    sent[4] = np.zeros(249_600, np.int32)  # just under a message, as either format
    config = {"bootstrap.servers": bootstrap, "message.max.bytes": 1_000_000}
    what = "a block" if fmt == "block" else "an Arrow message"
    with kfeed.Producer(config, topic, BLOCK_SCHEMA, block_records=2, format=fmt) as producer:
        with pytest.raises(kfeed.ConfigError, match=(
                rf"^document 3 of this send\(\) has 300,000 elements \(1,200,\d+ bytes as "
                rf"{what}\), more than a message holds \(message.max.bytes less 1024 for the "
                r"headers, 998,976\): split it, or raise message.max.bytes .*; nothing of this "
                r"call was sent$")):
            producer.send({"tokens": sent, "id": np.arange(5, dtype=np.int64)})
        producer.send({"tokens": sent[:3] + sent[4:], "id": np.array([0, 1, 2, 4])})
    values = [m.value() for m in read_partitions(bootstrap, topic)[0]]
    decoded = (BLOCK_SCHEMA.decode_documents(values) if fmt == "block" else
               kfeed.Arrow().decoder(BLOCK_SCHEMA).decode_documents(values))
    assert decoded.columns["id"].tolist() == [0, 1, 2, 4]
    assert decoded.lengths.tolist() == [10, 10, 10, 249_600]


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["json", "raw"])
def test_a_sample_larger_than_a_message_is_refused_before_any_of_the_send_is_sent(
        bootstrap: str, make_topic: Any, fmt: str) -> None:
    # The samples before it went (those of its key's partition, and all of the other
    # partitions' sent first), then librdkafka said "Message size too large".
    topic = make_topic(partitions=2)
    config = {"bootstrap.servers": bootstrap, "message.max.bytes": 1500}
    if fmt == "json":  # zeros are short in JSON, sample 4's random floats are not
        schema = kfeed.Schema({"f": ("float64", (100,)), "id": ("int64", ())})
        f = np.zeros((6, 100))
        f[4] = np.random.default_rng(0).standard_normal(100)
        columns: dict[str, Any] = {"f": f, "id": np.arange(6)}
        size = r"\d,\d{3}"
    else:  # one document a message
        schema = kfeed.Schema({"tokens": ("int32", (None,))})
        columns = {"tokens": [np.arange(400 if i == 4 else 10, dtype=np.int32)
                              for i in range(6)]}
        size = "1,601"
    keys = np.arange(6)
    assert len({kfeed.partition_for(str(k), 2) for k in keys[:4]}) == 2
    with kfeed.Producer(config, topic, schema, format=fmt) as producer:
        with pytest.raises(kfeed.ConfigError, match=(
                rf"^sample 4 of this send\(\) is {size} bytes as a message \(its key counted\), "
                r"more than message.max.bytes \(1,500\) less its headers and framing \(\d+\) "
                r"holds: raise "
                r"it \(and the topic's max.message.bytes\); nothing of this call was sent$")):
            producer.send(columns, keys=keys)
        if fmt == "raw":
            # A value under the limit, but not with its key and headers: librdkafka
            # refused it inside the loop, the samples before it sent, "samples 0".
            near = {"tokens": [np.arange(10, dtype=np.int32)] * 4
                    + [np.arange(345, dtype=np.int32)]}
            with pytest.raises(kfeed.ConfigError, match=(
                    r"^sample 4 of this send\(\) is 1,381 bytes as a message \(its key "
                    r"counted\), .*nothing of this call was sent$")):
                producer.send(near, keys=keys[:5])
        keep = [0, 1, 2, 3, 5]
        producer.send({k: [v[i] for i in keep] if isinstance(v, list) else v[keep]
                       for k, v in columns.items()}, keys=keys[keep])
    got = sorted(int(json.loads(m.value())["id"]) if fmt == "json" else int(m.key())
                 for ms in read_partitions(bootstrap, topic).values() for m in ms)
    assert got == keep


def test_an_arrow_record_larger_than_a_message_is_refused_when_the_producer_is_made() -> None:
    # Each message went to librdkafka, which refused it: "Message size too large".
    schema = kfeed.Schema({"f": ("float32", (1000,))})
    config = {"bootstrap.servers": "127.0.0.1:9", "message.max.bytes": 3000}
    with pytest.raises(kfeed.ConfigError, match=(
            r"^a record is 4,\d{3} bytes as an Arrow message, over message.max.bytes=3000 less "
            r"1024 for the headers: raise message.max.bytes")):
        kfeed.Producer(config, "t", schema, format="arrow")


def test_default_compression_follows_the_benchmark_figures() -> None:
    from kfeed.producer import default_compression

    # Integers (token ids, labels) compress and lz4 costs the loader nothing;
    # float features do not compress (bench/RESULTS.md, "Compression").
    assert default_compression(kfeed.Schema({"tokens": ("int32", (None,))})) == "lz4"
    assert default_compression(kfeed.Schema({"ids": ("uint16", (8,)), "y": ("int64", ())})) == "lz4"
    assert default_compression(kfeed.Schema({"x": ("float32", (768,)), "y": ("int64", ())})) == "none"
    assert default_compression(kfeed.Schema({"x": ("bfloat16", (4,))})) == "none"


@pytest.mark.integration
def test_sends_from_several_threads_at_once_lose_and_repeat_nothing(bootstrap: str,
                                                                    make_topic: Any) -> None:
    import threading

    from kfeed.synthetic import synthetic_columns, synthetic_schema

    schema = synthetic_schema()
    topic = make_topic(partitions=3)
    errors: list[BaseException] = []
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema) as producer:
        def work(k: int) -> None:
            try:
                for start in range(k * 6000, (k + 1) * 6000, 500):
                    ids = np.arange(start, start + 500)
                    producer.send(synthetic_columns(ids), keys=ids)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert producer.samples == 24_000
    got = []
    for part, msgs in read_partitions(bootstrap, topic).items():
        for m in msgs:
            out = schema.empty(64)
            res = schema.decode_into([m.value()], out)
            assert not res.bad
            got.append(out["id"][:res.rows].copy())
            assert all(kfeed.partition_for(str(i), 3) == part for i in out["id"][:res.rows])
    ids = np.concatenate(got)
    assert len(ids) == len(np.unique(ids)) == 24_000


def _watermarks(bootstrap: str, topic: str, n: int) -> dict[int, int]:
    """Messages per partition (high watermark less low), markers of transactions included."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex})
    try:
        return {p: (lambda lo_hi: lo_hi[1] - lo_hi[0])(
            c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)) for p in range(n)}
    finally:
        c.close()


class TransactionBrokers:
    """A transactional producer's client whose calls raise what ``answers`` holds
    for them in turn ({"commit": [exception, ...]}), then return; ``waits`` holds
    each call's timeouts."""

    def __init__(self, **answers: list[BaseException]) -> None:
        self.answers = answers
        self.waits: dict[str, list[float]] = {}
        self.order: list[str] = []  # the calls, in turn

    def _call(self, name: str, timeout: float) -> None:
        self.waits.setdefault(name, []).append(timeout)
        self.order.append(name)
        if self.answers.get(name):
            raise self.answers[name].pop(0)

    def begin_transaction(self) -> None:
        pass

    def commit_transaction(self, timeout: float) -> None:
        self._call("commit", timeout)

    def abort_transaction(self, timeout: float) -> None:
        self._call("abort", timeout)

    def send_offsets_to_transaction(self, offsets, metadata, timeout: float) -> None:
        self._call("offsets", timeout)

    def flush(self, timeout: float) -> int:
        self._call("flush", timeout)
        self.queued = self.flushed_to
        return len(self)

    flushed_to = 0  # what a flush leaves queued

    def poll(self, timeout: float = 0) -> int:
        return 0

    def __len__(self) -> int:
        return self.queued

    queued = 0

    def producer(self) -> kfeed.Producer:
        """A transactional Producer of topic "t" on these brokers, as made."""
        p = kfeed.Producer.__new__(kfeed.Producer)
        p.topic, p._timeout, p._transactional, p._in_transaction = "t", 30.0, True, False
        p._closed, p._fatal, p._written, p._unstable = False, None, {}, {}
        p._failed_n, p._first_failure = 0, None
        p._producer = self
        return p


class Group:
    def consumer_group_metadata(self) -> object:
        return object()


def test_transactional_calls_wait_in_slices_that_a_signal_can_end() -> None:
    # commit_transaction, abort_transaction and send_offsets_to_transaction
    # blocked in C for their whole timeout: a SIGTERM to kfeed produce --from
    # with the brokers gone took 85 s, where the README promises a second or so.
    from confluent_kafka import KafkaError, KafkaException

    from kfeed.producer import _SLICE_S

    def slow() -> list[BaseException]:  # brokers that answer each call on its third slice
        return [KafkaException(KafkaError(
            KafkaError._TIMED_OUT, "Timed out waiting for operation to finish, retry call to "
            "resume", retriable=True)) for _ in range(2)]

    brokers = TransactionBrokers(commit=slow(), abort=slow(), offsets=slow())
    p = brokers.producer()
    with p.transaction():
        p.send_offsets(Group(), [])
    with pytest.raises(RuntimeError), p.transaction():
        raise RuntimeError("a failed send")
    assert {k: len(v) for k, v in brokers.waits.items()} == {"offsets": 3, "commit": 3,
                                                            "abort": 3}
    assert all(0 < t <= _SLICE_S for waits in brokers.waits.values() for t in waits), brokers.waits


def test_a_coordinator_busy_with_the_last_transaction_is_asked_again() -> None:
    # On a loaded 3-broker cluster send_offsets_to_transaction failed at once
    # with CONCURRENT_TRANSACTIONS (the commit before still being written):
    # librdkafka marks it retriable, and kfeed produce --from gave up instead.
    from confluent_kafka import KafkaError, KafkaException

    def busy() -> KafkaException:
        return KafkaException(KafkaError(
            KafkaError.CONCURRENT_TRANSACTIONS, "Failed to add offsets to transaction on "
            "broker TxnCoordinator/3: Broker: Producer attempted to update a transaction "
            "while another concurrent operation on the same transaction was ongoing",
            retriable=True))

    brokers = TransactionBrokers(offsets=[busy(), busy()])
    p = brokers.producer()
    with p.transaction():
        p.send_offsets(Group(), [])
    assert len(brokers.waits["offsets"]) == 3
    lost = KafkaException(KafkaError(
        KafkaError.TOPIC_AUTHORIZATION_FAILED, "not authorized", txn_requires_abort=True))
    brokers = TransactionBrokers(offsets=[lost, busy()])  # what needs an abort: not again
    p = brokers.producer()
    with pytest.raises(kfeed.ProduceError, match="cannot send the offsets"), p.transaction():
        p.send_offsets(Group(), [])
    assert len(brokers.waits["offsets"]) == 1


def test_an_abort_first_delivers_what_the_transaction_sent() -> None:
    # An abort right after a commit (the coordinator still writing its markers)
    # was refused as INVALID_TXN_STATE, fatal, where librdkafka had not yet
    # registered the new transaction's partitions (2 aborts in 40 on a loaded
    # machine; tests/test_producer.py's nested transactions failed so in CI).
    # Its messages are delivered first, which registers their partitions.
    brokers = TransactionBrokers()
    p = brokers.producer()
    with pytest.raises(RuntimeError), p.transaction():
        brokers.queued = 3  # sent, not yet delivered
        raise RuntimeError("a failed step")
    assert brokers.order == ["flush", "abort"]
    # Brokers that deliver nothing hold the abort up a few seconds at most.
    brokers = TransactionBrokers()
    brokers.flushed_to = 3
    p = brokers.producer()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError), p.transaction():
        brokers.queued = 3
        raise RuntimeError("a failed step")
    assert brokers.order[-1] == "abort" and time.monotonic() - t0 < 8


def test_a_transactional_call_that_never_returns_ends_at_the_timeout() -> None:
    # librdkafka's send_offsets_to_transaction ignores its timeout when the
    # transaction coordinator went away with a broker's restart: kfeed produce
    # --from hung for ten minutes, and a SIGTERM with it. Fake brokers whose
    # call blocks until the test ends.
    from kfeed.producer import _STUCK_S

    release = threading.Event()

    class Stuck(TransactionBrokers):
        def send_offsets_to_transaction(self, offsets, metadata, timeout: float) -> None:
            self._call("offsets", timeout)
            release.wait(60)

    brokers = Stuck()
    p = brokers.producer()
    p._timeout = 1.0
    t0 = time.monotonic()
    try:
        with pytest.raises(kfeed.ProduceError, match="cannot send the offsets with the "
                           "transaction: librdkafka's send_offsets_to_transaction did not "
                           "return within its 1s"), p.transaction():
            p.send_offsets(Group(), [])
        took = time.monotonic() - t0
        assert 1.0 <= took < 1.0 + _STUCK_S + 1.0, took
        # The producer cannot go on, and says so at once: no abort or flush waits on it.
        assert set(brokers.waits) == {"offsets"}
        with pytest.raises(kfeed.ProduceError, match="the producer cannot go on"):
            p.send({"id": np.arange(3)})
    finally:
        release.set()


def test_an_interrupt_of_a_transactional_producer_says_nothing_of_its_flush(caplog) -> None:
    # A SIGTERM to kfeed produce --from during a commit: the producer's exit
    # flushed the aborted transaction's messages, and logged "flush after
    # Interrupted failed: KafkaError{FATAL,code=INVALID_TXN_STATE ...}".
    from confluent_kafka import KafkaError, KafkaException

    from kfeed.errors import Interrupted

    fatal = KafkaException(KafkaError(KafkaError.INVALID_TXN_STATE, "Failed to end "
                                      "transaction", fatal=True))
    brokers = TransactionBrokers(flush=[fatal])
    brokers.queued = 5
    p = brokers.producer()
    with caplog.at_level("WARNING", logger="kfeed"), pytest.raises(Interrupted):
        with p:
            raise Interrupted(15)
    assert "flush" not in brokers.waits and caplog.records == []


def test_stable_offsets_are_asked_of_every_broker_known_and_a_failure_says_so(
        monkeypatch, caplog) -> None:
    # With the bootstrap broker gone, the wait for the last commit to be
    # readable asked only it, for 10 s, then blamed "another producer's open
    # transaction".
    import logging

    from confluent_kafka import KafkaError, KafkaException

    import kfeed.producer as producer_module

    asked: list[str] = []

    class Unanswering:
        def list_offsets(self, *a, **k):
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT,
                                            "Failed to query partition leaders"))

    def admin(config):
        asked.append(config["bootstrap.servers"])
        return Unanswering()

    class Known:  # the producer's metadata: brokers 2 and 3 still there
        def list_topics(self, timeout=None):
            broker = type("B", (), {})
            b2, b3 = broker(), broker()
            b2.host, b2.port, b3.host, b3.port = "127.0.0.1", 9093, "127.0.0.1", 9094
            return type("Md", (), {"brokers": {2: b2, 3: b3}})()

    monkeypatch.setattr(producer_module, "admin_client", admin)
    p = producer_module.Producer.__new__(producer_module.Producer)
    p.topic, p._timeout, p._client, p._servers = "t", 0.5, {}, "127.0.0.1:9092"
    p._unstable, p._producer = {("t", 0): 5}, Known()
    with caplog.at_level(logging.WARNING, logger="kfeed.producer"):
        p._await_readable()
    assert asked == ["127.0.0.1:9093,127.0.0.1:9094"]
    assert "t[0] are not readable yet after 0s (the brokers did not say where they stand " \
           "(Failed to query partition leaders))" in caplog.text, caplog.text


def test_a_record_no_message_holds_is_found_without_a_broker() -> None:
    from kfeed.producer import record_fits

    schema = kfeed.Schema({"features": ("float32", (4096,)), "id": ("int64", ())})
    assert record_fits(schema, {}) == 60 and record_fits(schema, {}, "raw") == 1
    assert record_fits(schema, {"message.max.bytes": 5_000_000}) == 304
    assert record_fits(schema, {"message.max.bytes": "0x4c4b40"}) == 304  # (as librdkafka reads it)
    assert record_fits(schema, {}, "json") == 0  # sizes vary: checked at send()
    with pytest.raises(kfeed.ConfigError, match=r"^a record of 16392 bytes is over "
                                                r"message.max.bytes=10000 less 1024 "):
        record_fits(schema, {"message.max.bytes": 10_000}, "raw")


@pytest.mark.integration
def test_blocks_fit_what_a_broker_takes_by_default(bootstrap: str, make_topic: Any) -> None:
    # Blocks were sized against the producer's own 8 MiB message.max.bytes:
    # 64 records of 16 KB made 1 MB messages the broker refused (its default
    # is 1048588), and the whole send failed at flush().
    topic = make_topic(partitions=1)
    schema = kfeed.Schema({"features": ("float32", (4096,)), "id": ("int64", ())})
    config = {"bootstrap.servers": bootstrap}
    with kfeed.Producer(config, topic, schema) as p:
        assert p.block_records == 60  # 64 would not fit: as many as do
        p.send({"features": np.ones((200, 4096), np.float32), "id": np.arange(200)})
    assert _watermarks(bootstrap, topic, 1) == {0: 4}
    with pytest.raises(kfeed.ConfigError) as e:
        kfeed.Producer(config, topic, schema, block_records=64)
    assert str(e.value) == (
        "a block of 64 records is 1049120 bytes, over message.max.bytes=1000000 less 1024 for "
        "the headers: lower block_records to 60 or fewer (or leave it out), or raise "
        "message.max.bytes (and the topic's max.message.bytes)")


@pytest.mark.integration
@pytest.mark.parametrize("fields", [{"f": ("float32", ())}, {"label": ("int8", ())},
                                    {"f": ("float32", ()), "g": ("int8", ())}])
def test_records_under_8_bytes_are_sent_and_read_back(bootstrap: str, make_topic: Any,
                                                      fields: Any) -> None:
    # Blocks pad each column to 8 bytes: a block of 2 such records is no larger
    # than one of 1, and sizing blocks by that difference divided by zero.
    topic = make_topic(partitions=1)
    schema = kfeed.Schema(fields)
    cols = {name: (np.arange(300) % 100).astype(dtype) for name, (dtype, _) in fields.items()}
    config = {"bootstrap.servers": bootstrap}
    with kfeed.Producer(config, topic, schema) as p:
        assert schema.block_nbytes(p.block_records) <= 1_000_000 - 1024
        p.send(cols)
    with kfeed.Loader({**config, "group.id": uuid.uuid4().hex}, topic, schema, 64,
                      device="cpu", until="end") as loader:
        got = [b for b in loader]
    for name in fields:
        assert np.concatenate([b[name].numpy() for b in got]).tolist() == cols[name].tolist()
    # The most that fit: one more would not.
    limit = 1000
    most = producer_module._most_records(schema, limit)
    assert schema.block_nbytes(most) <= limit < schema.block_nbytes(most + 1)


@pytest.mark.integration
def test_messages_without_keys_are_dealt_to_every_partition(bootstrap: str,
                                                            make_topic: Any) -> None:
    # librdkafka's sticky partitioner put all 16 blocks of a send() on one
    # partition: the other ranks of a static assignment read nothing.
    topic = make_topic(partitions=4)
    schema = kfeed.Schema({"x": ("float32", (8,)), "id": ("int64", ())})
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema) as p:
        p.send({"x": np.zeros((1024, 8), np.float32), "id": np.arange(1024)})
        p.send({"x": np.zeros((8, 8), np.float32), "id": np.arange(8)},
               partition=np.int64(2))  # numpy's ints are ints
    assert _watermarks(bootstrap, topic, 4) == {0: 4, 1: 4, 2: 5, 3: 4}


@pytest.mark.integration
def test_keys_follow_partitions_added_to_the_topic(bootstrap: str, make_topic: Any) -> None:
    # The partition count was read once, when the producer was made: keys
    # sent after partitions were added still went to the first two.
    from confluent_kafka.admin import AdminClient, NewPartitions

    topic = make_topic(partitions=2)
    schema = kfeed.Schema({"id": ("int64", ())})
    config = {"bootstrap.servers": bootstrap, "topic.metadata.refresh.interval.ms": 1000}
    with kfeed.Producer(config, topic, schema, format="raw") as p:
        p.send({"id": np.arange(100)}, keys=range(100))
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_partitions([NewPartitions(topic, 6)])[topic].result(30)
        deadline = time.monotonic() + 30
        while p.num_partitions < 6 and time.monotonic() < deadline:
            p.send({"id": np.arange(0)}, keys=[])  # a call looks again once a second
            time.sleep(0.2)
        p.send({"id": np.arange(100, 400)}, keys=range(100, 400))
    placed = {int(m.key()): part for part, messages in read_partitions(bootstrap, topic).items()
              for m in messages}
    assert sorted(placed) == list(range(400))
    assert all(placed[k] == kfeed.partition_for(str(k), 2) for k in range(100))
    assert all(placed[k] == kfeed.partition_for(str(k), 6) for k in range(100, 400))


@pytest.mark.integration
def test_an_aborted_transactions_failures_do_not_fail_the_next(bootstrap: str, make_topic: Any,
                                                               caplog) -> None:
    # A message the broker refused in a transaction the caller's error then
    # aborted was raised again by the next, healthy transaction's flush().
    topic = make_topic(partitions=1)
    schema = kfeed.Schema({"x": ("uint8", (None,)), "id": ("int64", ())})
    # librdkafka takes 8 MB here, the broker 1 MB: the refusal comes back later.
    config = {"bootstrap.servers": bootstrap, "message.max.bytes": 8 << 20}
    p = kfeed.Producer(config, topic, schema, transactional_id=uuid.uuid4().hex,
                       compression="none")
    with pytest.raises(RuntimeError), p.transaction():
        p.send({"x": [np.ones(2_000_000, np.uint8)], "id": np.arange(1)})
        p._producer.flush(10)  # the broker's answer is in
        raise RuntimeError("the caller's own error")
    assert "in the aborted transaction: 1 message(s) to " in caplog.text
    committed = 0
    for _ in range(3):
        try:
            with p.transaction():
                p.send({"x": [np.zeros(10, np.uint8)], "id": np.arange(1)})
            committed += 1
        except kfeed.ProduceError as e:
            # librdkafka may fail the next one on its own (its sequence numbers
            # skip the refused message), never with the refused message's error.
            assert "not delivered" not in str(e) and "too large" not in str(e), e
    assert committed >= 2
    p.close()
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                  "isolation.level": "read_committed", "enable.partition.eof": True})
    c.assign([TopicPartition(topic, 0, 0)])
    values = []
    while (m := c.poll(10)) is not None and m.error() is None:
        values.append(m.value())
    c.close()
    assert m is not None and m.error().code() == -191  # the partition's end
    assert len(schema.decode_documents(values).lengths) == committed


@pytest.mark.integration
def test_an_abort_that_fails_fatally_leaves_the_callers_error_raised(bootstrap: str,
                                                                      make_topic: Any,
                                                                      caplog) -> None:
    # A broker answered an abort with INVALID_TXN_STATE (a fatal error, which
    # confluent-kafka then raises from poll too): the raw KafkaException replaced
    # the error that had ended the transaction (`kfeed produce` printed
    # "unexpected KafkaException" in place of the file that could not be read).
    from confluent_kafka import KafkaError, KafkaException

    topic = make_topic(partitions=1)
    schema = kfeed.Schema({"x": ("int64", ())})
    p = kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema,
                       transactional_id=uuid.uuid4().hex)
    real = p._producer
    fatal = KafkaError(KafkaError.INVALID_TXN_STATE, "Failed to end transaction: Broker: "
                       "Producer attempted a transactional operation in an invalid state",
                       fatal=True)

    class Refusing:  # the real producer, but its abort fails as the broker's did
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def __len__(self) -> int:
            return len(real)

        aborted = False

        def abort_transaction(self, *args: Any) -> None:
            self.aborted = True
            raise KafkaException(fatal)

        def poll(self, *args: Any) -> int:
            if self.aborted:
                raise KafkaException(fatal)
            return real.poll(*args)

    p._producer = Refusing()
    with pytest.raises(ValueError, match="^the file that cannot be read$"), p.transaction():
        p.send({"x": np.arange(10)})
        raise ValueError("the file that cannot be read")
    assert "abort_transaction failed: Failed to end transaction" in caplog.text
    # The fatal error is kept: the next transaction refuses at once, as a ProduceError.
    with pytest.raises(kfeed.ProduceError, match="^the producer cannot go on: Failed to end"):
        with p.transaction():
            pass
    real.abort_transaction(10)


@pytest.mark.integration
def test_a_closed_producer_refuses_to_send_and_a_process_says_what_it_lost(
        bootstrap: str, make_topic: Any) -> None:
    # send() after close() returned as if sent, and the samples were lost at
    # exit; a process that ended with messages queued lost them without a word.
    topic = make_topic(partitions=1)
    schema = kfeed.Schema({"id": ("int64", ())})
    config = {"bootstrap.servers": bootstrap}
    p = kfeed.Producer(config, topic, schema)
    p.send({"id": np.arange(10)})
    p.close()
    p.close()  # (twice is fine)
    with pytest.raises(kfeed.ProduceError, match="^the producer is closed: what is sent now "
                                                 "would never be delivered"):
        p.send({"id": np.arange(10, 20)})
    # A process that ends with messages queued, never flushed (the linger keeps
    # them in librdkafka's queue): they are lost, and it says so.
    script = (f"import numpy as np, kfeed\n"
              f"p = kfeed.Producer({{'bootstrap.servers': {bootstrap!r}, 'linger.ms': 60000}}, "
              f"{topic!r}, kfeed.Schema({{'id': ('int64', ())}}))\n"
              f"p.send({{'id': np.arange(20, 30)}})\n")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert f"the process exits with 1 message(s) to {topic} not delivered, now lost: close() " \
           f"the Producer (or use `with`) before it ends" in done.stderr, done.stderr


_FENCED = """
import sys, numpy as np, kfeed
b, topic = sys.argv[1], sys.argv[2]
schema = kfeed.Schema({"id": ("int64", ())})
first = kfeed.Producer({"bootstrap.servers": b, "linger.ms": 1000}, topic, schema,
                       transactional_id="t-" + topic)
tx = first.transaction()
tx.__enter__()
first.send({"id": np.arange(4)})
second = kfeed.Producer({"bootstrap.servers": b}, topic, schema, transactional_id="t-" + topic)
try:
    tx.__exit__(None, None, None)
except kfeed.ProduceError as e:
    print("commit refused")
    why = str(e)
try:
    first.close()
except kfeed.ProduceError:
    print("close refused")
second.close()
print(why)
"""


@pytest.mark.integration
def test_a_close_that_raised_is_not_told_again_at_exit(bootstrap: str, make_topic: Any) -> None:
    # A fenced producer's close() raised, and the exit then said "close() the
    # Producer" of the aborted transaction's messages, as if it had never been.
    import subprocess
    import sys

    topic = make_topic(partitions=1)
    done = subprocess.run([sys.executable, "-c", _FENCED, bootstrap, topic],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["commit refused", "close refused"], done.stdout
    assert "now lost" not in done.stderr, done.stderr
    # librdkafka says "fenced by newer producer instance", also of a transaction
    # that outlived its timeout, where no other producer was: the line says both.
    assert "fenced" in done.stdout.split("\n")[2] and (
        "(the brokers fence a transactional producer when another one of the same "
        "transactional.id starts, a second run of the same job, or when a transaction "
        "outlives transaction.timeout.ms)") in done.stdout.split("\n")[2], done.stdout


def test_a_ragged_nested_list_names_its_field() -> None:
    # numpy's "setting an array element with a sequence" named no field.
    schema = kfeed.Schema({"x": ("float32", (3,)), "id": ("int64", ())})
    with pytest.raises(kfeed.ConfigError, match=r"^field 'x': not an array of rows of shape "
                                                r"\(3,\) \(setting an array element"):
        schema.encode_blocks({"x": [[1, 2, 3], [1, 2]], "id": [1, 2]}, 8)


def test_bfloat16_fields_take_ml_dtypes_arrays_as_torch_tensors() -> None:
    # JAX's and ml_dtypes' bfloat16 arrays were refused: "expected dtype uint16, got bfloat16".
    import ml_dtypes

    schema = kfeed.Schema({"emb": ("bfloat16", (4,)), "id": ("int64", ())})
    x = torch.randn(8, 4).to(torch.bfloat16)
    ids = np.arange(8)
    want = schema.encode_block({"emb": x, "id": ids})
    as_numpy = x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    assert schema.encode_block({"emb": as_numpy, "id": ids}) == want
    with pytest.raises(kfeed.ConfigError) as e:
        schema.encode_block({"emb": x.float().numpy(), "id": ids})
    assert str(e.value) == ("field 'emb': expected dtype bfloat16 (a torch.bfloat16 tensor, a "
                            "numpy array of ml_dtypes' bfloat16, or its bits as uint16), got "
                            "float32")


@pytest.mark.integration
def test_leaving_the_with_block_by_an_exception_says_what_was_not_delivered(
        bootstrap: str, make_topic: Any, caplog) -> None:
    # The caller's exception won, as it should, and the refused message went unsaid.
    topic = make_topic(partitions=1)
    schema = kfeed.Schema({"x": ("uint8", (None,)), "id": ("int64", ())})
    config = {"bootstrap.servers": bootstrap, "message.max.bytes": 8 << 20}
    with pytest.raises(ValueError), kfeed.Producer(config, topic, schema,
                                                   compression="none") as p:
        p.send({"x": [np.ones(2_000_000, np.uint8)], "id": np.arange(1)})
        raise ValueError("bad row in the data loop")
    assert f"after ValueError: 1 message(s) to {topic} not delivered; first error: Broker: " \
           f"Message size too large" in caplog.text


def test_producer_mistakes_before_any_connection() -> None:
    closed = {"bootstrap.servers": "127.0.0.1:1"}
    with pytest.raises(kfeed.ConfigError, match=r"^topic name 'bad name!' is not valid"):
        kfeed.Producer(closed, "bad name!", RAW_SCHEMA)  # (it said: create it with create_topic)
    with pytest.raises(kfeed.ConfigError, match="block_records must be None or an int"):
        kfeed.Producer(closed, "t", RAW_SCHEMA, block_records=True)


@pytest.mark.integration
def test_a_transactional_send_outside_a_transaction_and_a_flush_timeout_say_so(
        bootstrap: str, make_topic: Any) -> None:
    topic = make_topic(partitions=1)
    schema = kfeed.Schema({"x": ("float32", (256,)), "id": ("int64", ())})
    cols = {"x": np.zeros((64, 256), np.float32), "id": np.arange(64)}
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema,
                        transactional_id=uuid.uuid4().hex, block_records=np.int64(8)) as p:
        with pytest.raises(kfeed.ConfigError, match="^a transactional producer sends only "
                                                    "inside `with producer.transaction"):
            p.send(cols)  # was: "cannot send: ... Local: Erroneous state"
        with pytest.raises(kfeed.ConfigError, match=r"^send_offsets\(\) commits offsets with "
                                                    r"a transaction: call it inside"):
            p.send_offsets(None, [])  # was: "... Operation not valid in state Ready"
        with p.transaction():
            p.send(cols)
        with pytest.raises(kfeed.ConfigError, match="^transactions do not nest"):
            with p.transaction():
                p.send(cols)
                with p.transaction():  # was: "... Operation not valid in state InTransaction"
                    pass
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema) as p:
        for _ in range(20):
            p.send(cols)
        with pytest.raises(kfeed.ProduceError, match=r"^flush timed out with \d+ message\(s\) "
                                                     r"still queued, none failed"):
            p.flush(timeout=1e-6)  # was: "0 message(s) not delivered, N still queued"


@pytest.mark.integration
def test_a_bad_key_sends_nothing_of_the_call(bootstrap: str, make_topic: Any) -> None:
    # Keys were turned to bytes as each message went: the first four were sent.
    topic = make_topic(partitions=1)
    schema = kfeed.Schema({"id": ("int64", ())})
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema, format="raw") as p:
        with pytest.raises(kfeed.ConfigError, match="keys must be bytes, str or int, got float"):
            p.send({"id": np.arange(6)}, keys=[0, 1, 2, 3, 4.0, 5], partition=0)
        assert p.stats()["messages"] == p.stats()["samples"] == 0


@pytest.mark.integration
def test_a_large_send_is_encoded_a_chunk_at_a_time(bootstrap: str, make_topic: Any,
                                                   monkeypatch) -> None:
    # Every block of the call was encoded into one list before the first was
    # sent: a 1 GiB memory-mapped array took 1.3 GiB more to send.
    from kfeed import producer as producer_module

    monkeypatch.setattr(producer_module, "_CHUNK_BYTES", 100_000)
    topic = make_topic(partitions=3)
    schema = kfeed.Schema({"x": ("float32", (256,)), "id": ("int64", ())})
    most = []
    encode = kfeed.Schema.encode_blocks

    def spy(self, columns, *args, **kwargs):
        most.append(len(columns["id"]))
        return encode(self, columns, *args, **kwargs)

    monkeypatch.setattr(kfeed.Schema, "encode_blocks", spy)
    ids = np.arange(3000)
    x = np.repeat(ids[:, None], 256, axis=1).astype(np.float32)
    with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, schema) as p:
        p.send({"x": x, "id": ids}, keys=ids)
        p.send({"x": x, "id": ids + 3000})
    assert max(most) <= 128 and sum(most) == 6000  # 96 rows of 1,032 bytes a chunk
    monkeypatch.undo()
    got = {}
    for part, msgs in read_partitions(bootstrap, topic).items():
        for m in msgs:
            out = {f.name: np.zeros((64, *f.shape), f.storage) for f in schema.fields}
            res = schema.decode_into([m.value()], schema.bind(out), 0)
            for i, row in zip(out["id"][:res.rows], out["x"][:res.rows], strict=True):
                assert int(i) not in got and np.all(row == i % 3000)
                got[int(i)] = part
    assert sorted(got) == list(range(6000))
    assert all(got[i] == kfeed.partition_for(str(i).encode(), 3) for i in range(3000))


@pytest.mark.integration
def test_blocks_into_a_compacted_topic_say_why_the_brokers_refuse_them(
        bootstrap: str, make_topic: Any, group_id: str) -> None:
    # The brokers' bare "Broker failed to validate record" (after a warning
    # line that said the same); in a transaction, "Local: Erroneous state".
    ids = kfeed.Schema({"id": ("int64", ())})
    topic = make_topic(partitions=1, config={"cleanup.policy": "compact"})
    said = (f": {topic} is compacted (cleanup.policy=compact), which takes only messages with "
            f"a key; a block of records has none: write to a topic that is not compacted, or "
            f"send one record a message with its key")
    with pytest.raises(kfeed.ProduceError) as refused:
        with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, ids) as p:
            p.send({"id": np.arange(100)}, keys=np.arange(100))
    assert "not delivered; first error: Broker: Broker failed to validate record" + said \
        in str(refused.value), refused.value
    p = kfeed.Producer({"bootstrap.servers": bootstrap}, topic, ids,
                       transactional_id=f"{group_id}-tx", block_records=16)
    try:
        with pytest.raises(kfeed.ProduceError) as refused:
            with p.transaction():
                for _ in range(200):  # until a send finds the transaction failed
                    p.send({"id": np.arange(1000)})
                    time.sleep(0.01)
        assert "Erroneous state" not in str(refused.value), refused.value
        assert "Broker failed to validate record" in str(refused.value), refused.value
    finally:
        with contextlib.suppress(kfeed.KfeedError):
            p.close()
    raw = kfeed.Producer({"bootstrap.servers": bootstrap}, topic, ids, format="raw")
    with raw:  # one record a message, keyed: what a compacted topic takes
        raw.send({"id": np.arange(10)}, keys=np.arange(10))


def test_batch_size_is_left_to_librdkafka_to_read() -> None:
    # Read by kfeed as a decimal int when the producer was made, for the error
    # of a batch too large: "abc" was a bare ValueError, not librdkafka's
    # verdict, and "0x10000", which librdkafka takes, one too.
    ids = kfeed.Schema({"id": ("int64", ())})
    with pytest.raises(kfeed.ConfigError, match='bad Kafka setting: Invalid value for '
                                                'configuration property "batch.size"'):
        kfeed.Producer({"bootstrap.servers": "127.0.0.1:1", "batch.size": "abc"}, "t", ids)
    with pytest.raises(kfeed.ProduceError, match="cannot reach the brokers"):
        kfeed.Producer({"bootstrap.servers": "127.0.0.1:1", "batch.size": "0x10000"}, "t", ids,
                       connect_timeout_s=1)


@pytest.mark.integration
def test_messages_into_a_topic_of_small_batches_say_why_the_brokers_refuse_them(
        bootstrap: str, make_topic: Any) -> None:
    # Each message fit the topic's max.message.bytes, but librdkafka sends
    # up to batch.size in one batch, which the brokers check whole: every one
    # was refused with a bare "Message size too large".
    schema = kfeed.Schema({"id": ("int64", ()), "x": ("float32", (40,))})
    rows = {"id": np.arange(2000), "x": np.random.default_rng(0).random((2000, 40), np.float32)}
    topic = make_topic(partitions=1, config={"max.message.bytes": 20_000})
    with pytest.raises(kfeed.ProduceError) as refused:  # (batches of 100 ms of sends)
        with kfeed.Producer({"bootstrap.servers": bootstrap, "linger.ms": 100}, topic, schema,
                            format="raw") as p:
            p.send(rows)
    assert (f"2000 message(s) not delivered; first error: Broker: Message size too large: "
            f"{topic} takes batches of messages of max.message.bytes=20,000 bytes at most (its "
            f"brokers check a batch whole), and this producer batches up to batch.size="
            f"1,000,000: set batch.size and message.max.bytes to 20,000 or less") \
        in str(refused.value), refused.value
    small = {"bootstrap.servers": bootstrap, "batch.size": 20_000, "message.max.bytes": 20_000}
    with kfeed.Producer(small, topic, schema, format="raw") as p:  # as the error says
        p.send(rows)
    assert p.acked_bytes > 0 and p.delivery_failures == 0


@pytest.mark.integration
def test_an_interrupted_producer_waits_a_moment_and_says_what_it_left(
        bootstrap: str, make_topic: Any) -> None:
    # It waited for the acknowledgements for the whole timeout (30 s when the
    # brokers went away), then logged them apart from the interrupt.
    topic = make_topic(partitions=1)
    ids = kfeed.Schema({"id": ("int64", ())})

    class GoneAway:  # the client once the brokers went away: nothing is acknowledged
        def flush(self, timeout: float) -> int:
            time.sleep(timeout)
            return 10

        def __len__(self) -> int:
            return 10

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as stopped:
        with kfeed.Producer({"bootstrap.servers": bootstrap}, topic, ids, block_records=10) as p:
            p.send({"id": np.arange(100)})
            p._producer.flush(30)
            real, p._producer = p._producer, GoneAway()
            raise KeyboardInterrupt
    assert time.monotonic() - t0 < 10
    assert stopped.value.__notes__ == [
        f"10 message(s) to {topic} not acknowledged 2s after the interrupt: they may be "
        f"missing from the topic"]
    real.flush(30)

    class Interrupted(GoneAway):  # Ctrl-C while close() waits for the acknowledgements
        def flush(self, timeout: float) -> int:
            raise KeyboardInterrupt

    # In close() (the end of a with block too), the interrupt came out with no
    # word, and the producer, closed, said nothing at exit either.
    for closing in (lambda p: p.close(), lambda p: p.__exit__(None, None, None)):
        p = kfeed.Producer({"bootstrap.servers": bootstrap}, topic, ids, block_records=10)
        p.send({"id": np.arange(100)})
        p._producer.flush(30)
        real, p._producer = p._producer, Interrupted()
        with pytest.raises(KeyboardInterrupt) as stopped:
            closing(p)
        assert stopped.value.__notes__ == [
            f"10 message(s) to {topic} not acknowledged when interrupted: they may be "
            f"missing from the topic"]
        real.flush(30)


@pytest.mark.integration
def test_failed_deliveries_of_a_long_send_are_counted_not_kept(bootstrap: str,
                                                               make_topic: Any) -> None:
    # Each failed delivery's error was kept until the flush, which only
    # counts them and says the first: about 120 bytes each, for the whole send.
    import tracemalloc

    topic = make_topic(partitions=1, config={"cleanup.policy": "compact"})  # keys needed
    ids = kfeed.Schema({"id": ("int64", ())})
    p = kfeed.Producer({"bootstrap.servers": bootstrap}, topic, ids, block_records=1)
    p.send({"id": np.arange(500)})
    p._producer.flush(30)
    p._poll(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(10):
            p.send({"id": np.arange(1000)})
            p._producer.flush(30)
            p._poll(0)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert p.delivery_failures == 10_500
    assert grown < 300_000, grown  # (10,000 kept errors: 1.2 MB)
    with pytest.raises(kfeed.ProduceError, match=r"^10500 message\(s\) .*not delivered.*"
                                                 r"first error: "):
        p.flush(30)
    p._closed = True
