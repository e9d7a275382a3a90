"""kfeed.Producer: keyed variable-length documents, and how errors reach the caller.

The unit tests need no broker. The integration tests send keyed token
documents to the real cluster, read every partition back with plain
confluent-kafka, decode the values with ``Schema.decode_documents``, and
check that every document arrived exactly once, bit-equal, on the partition
``kfeed.partition_for(key, n)`` names.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

import kfeed
from kfeed._kafka import kafka_error as _kafka_error
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
