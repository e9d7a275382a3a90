"""A consumer group's lag, per partition, as operators read it: ``kfeed lag``.

Where it sits: beside the data flow, for the person watching a run (and for
metrics). It asks the brokers, not a loader: the group's committed offsets,
each partition's end offset, and the member that owns it (the view of
``kafka-consumer-groups --describe``), plus the lag in seconds as
kafka-lag-exporter defines it: how old the next unread record is (now minus
the timestamp of the record at the committed offset; 0 when nothing is
left).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kfeed._kafka import (
    admin_client,
    admin_partitions,
    answer,
    asked_until,
    check_timeout,
    logged_config,
    passing,
    refusal,
    refused_message,
    unreachable_message,
)
from kfeed.errors import ConfigError, ConsumeError

__all__ = ["PartitionLag", "group_exists", "group_lag"]


@dataclass(frozen=True)
class PartitionLag:
    """One partition of a group's topics: where it stands.

    committed: the group's committed offset (None: it never committed one).
    end: the partition's end (high watermark; aborted and control records
    count as lag too). lag: messages from the committed offset (or the
    log's start, when none) to the end. lag_s: the age of the next unread
    record in seconds (0.0 when there is none; None when it could not be
    read within the timeout). member: the owning member's
    ``client_id@host (member_id)``, or None when no member holds it.

    A commit past the end (``committed > end``: the topic was deleted and
    made again, say) has lag 0, though the group does not read from there:
    its next start resets by ``auto.offset.reset``. A kfeed loader's commit
    at a block message whose records it used only some of (``skip=`` in the
    commit's metadata, ``kfeed.sources.Committed``) counts that message as
    lag: the rest of its records are unread.
    """

    topic: str
    partition: int
    committed: int | None
    end: int
    lag: int
    lag_s: float | None
    member: str | None


def group_lag(kafka_config: Mapping[str, Any], group_id: str,
              topics: Sequence[str] | None = None, timeout_s: float = 10.0) -> list[PartitionLag]:
    """Per partition of ``topics`` (default: those the group committed on), the group's lag.

    >>> for p in kfeed.group_lag({"bootstrap.servers": "127.0.0.1:39092"}, "trainer"):
    ...     print(p.topic, p.partition, p.lag, p.lag_s)
    """
    return lag_of(kafka_config, group_id, topics, timeout_s, owners=True)


def lag_of(kafka_config: Mapping[str, Any], group_id: str, topics: Sequence[str] | None,
           timeout_s: float, *, owners: bool) -> list[PartitionLag]:
    """``group_lag``; ``owners``: whether to ask who owns each partition (``member``,
    else None), which only the group's coordinator answers, by an admin request
    that the brokers being away can make abort the process (``_committed_of``):
    the metrics' lag thread, in the training process, does without."""
    from confluent_kafka import (
        ConsumerGroupTopicPartitions,
        KafkaError,
        KafkaException,
        TopicPartition,
    )
    from confluent_kafka.admin import OffsetSpec

    if not isinstance(kafka_config, Mapping) or "bootstrap.servers" not in kafka_config:
        raise ConfigError("kafka_config must be a dict of librdkafka settings "
                          "with 'bootstrap.servers'")
    if not isinstance(group_id, str) or not group_id:
        raise ConfigError(f"group_id must be a non-empty string, got {group_id!r}")
    check_timeout(timeout_s)
    if isinstance(topics, str):  # one topic, as the Loader takes it
        topics = [topics]
    if topics is not None:
        if not all(isinstance(t, str) and t for t in topics):
            raise ConfigError(f"topics must be topic names, got {topics!r}")
        topics = list(dict.fromkeys(topics))  # a topic named twice counts once
    admin = admin_client(kafka_config)
    servers = str(kafka_config["bootstrap.servers"])
    # The reader of the records' ages logs as the admin client does (not to stderr).
    config = logged_config(kafka_config)

    def ask() -> tuple[Any, ...]:
        committed = {} if topics else _committed(admin, ConsumerGroupTopicPartitions(group_id),
                                                 timeout_s)
        wanted = list(topics) if topics else sorted({tp[0] for tp in committed})
        if topics:
            # One look at every topic's name: an unknown one is a mistake in the
            # name, not a topic still being made (as admin_partitions would wait for).
            known = _listed(admin, timeout_s).topics
            for t in wanted:
                if t not in known:
                    raise ConsumeError(f"no topic {t} on these brokers ({servers}): check the "
                                       f"name", topic=t)
        parts = [(t, p) for t in wanted for p in admin_partitions(admin, t, servers, timeout_s)]
        if topics:
            committed = _committed_of(config, group_id, parts, timeout_s)
        ends = admin.list_offsets({TopicPartition(t, p): OffsetSpec.latest() for t, p in parts},
                                  request_timeout=timeout_s)
        end = {(tp.topic, tp.partition): answer(admin, f).offset for tp, f in ends.items()}
        # Where the group reads next: its commit, or the log's start where it has none
        # or where retention (or deleted records) moved the start past it.
        firsts = admin.list_offsets({TopicPartition(t, p): OffsetSpec.earliest()
                                     for t, p in parts}, request_timeout=timeout_s) if parts else {}
        first = {(tp.topic, tp.partition): answer(admin, f).offset
                 for tp, f in firsts.items()}
        start = {tp: max(committed.get(tp, first[tp]), first[tp]) for tp in parts}
        return (committed, parts, end, start,
                _owners(admin, group_id, timeout_s) if owners else {})

    try:  # (a group's coordinator still loading, after a restart: asked again)
        committed, parts, end, start, owners = passing(ask, timeout_s)
    except KafkaException as e:
        if (refused := refusal(admin)) is not None:
            raise ConsumeError(refused_message(servers, refused), code=refused.code()) from e
        err = e.args[0]
        if err.code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT,
                          KafkaError._ALL_BROKERS_DOWN):
            raise ConsumeError(unreachable_message(servers, timeout_s, err.str()),
                               code=err.code()) from e
        raise ConsumeError(f"cannot read the lag of group {group_id}: {err.str()}") from e
    left = {tp: start[tp] for tp in parts if start[tp] < end[tp]}
    ages = _ages(config, left, timeout_s)
    return [PartitionLag(t, p, committed.get((t, p)), end[(t, p)],
                         max(0, end[(t, p)] - start[(t, p)]),
                         ages.get((t, p)) if (t, p) in left else 0.0, owners.get((t, p)))
            for t, p in parts]


def group_exists(kafka_config: Mapping[str, Any], group_id: str, timeout_s: float = 10.0) -> bool:
    """Whether the brokers know ``group_id``: it has members or committed offsets.

    A group the brokers never saw, or whose members left and whose offsets
    expired, reads as one with no offsets and no members: ``group_lag``
    cannot tell it from a group that has not committed yet, this can.
    """
    from confluent_kafka import ConsumerGroupState, KafkaError, KafkaException

    admin = admin_client(kafka_config)
    servers = str(kafka_config["bootstrap.servers"])
    try:
        desc = passing(lambda: answer(admin, admin.describe_consumer_groups(
            [group_id], request_timeout=timeout_s)[group_id]), timeout_s)
        return desc.state != ConsumerGroupState.DEAD
    except KafkaException as e:
        if (refused := refusal(admin)) is not None:
            raise ConsumeError(refused_message(servers, refused), code=refused.code()) from e
        err = e.args[0]
        if err.code() == KafkaError.GROUP_ID_NOT_FOUND:  # the consumer protocol's answer
            return False
        if err.code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT,
                          KafkaError._ALL_BROKERS_DOWN):
            raise ConsumeError(unreachable_message(servers, timeout_s, err.str()),
                               code=err.code()) from e
        raise ConsumeError(f"cannot describe group {group_id}: {err.str()}") from e


def _listed(admin: Any, timeout_s: float) -> Any:
    """``admin.list_topics()``, in short calls: brokers that refuse the client raise
    that refusal (``answer``'s) after the first, not after ``timeout_s``."""
    return asked_until(lambda s: admin.list_topics(timeout=s), time.monotonic() + timeout_s,
                       lambda _err: refusal(admin))


def _committed_of(config: dict[str, Any], group_id: str, parts: list[tuple[str, int]],
                  timeout_s: float) -> dict[tuple[str, int], int]:
    """The group's committed offsets of ``parts``, asked as its own consumers ask them.

    Not by the admin client's ListConsumerGroupOffsets: that request, timed
    out while the group's coordinator does not answer, later aborts the
    whole process inside librdkafka (an assertion on a freed object, when the
    coordinator's connection drops) -- the training process, for the metrics'
    lag thread. A consumer that joins no group reads them by its own path.
    """
    from confluent_kafka import Consumer, TopicPartition

    if not parts:
        return {}
    # (read_uncommitted: the commits as they stand, not waiting for a transaction's
    # offsets to be decided, as ListConsumerGroupOffsets does not)
    consumer = Consumer({**config, "group.id": group_id, "enable.auto.commit": False,
                         "isolation.level": "read_uncommitted"})
    try:
        found = consumer.committed([TopicPartition(t, p) for t, p in parts], timeout=timeout_s)
    finally:
        consumer.close()
    return {(tp.topic, tp.partition): tp.offset for tp in found if tp.offset >= 0}


def _committed(admin: Any, request: Any, timeout_s: float) -> dict[tuple[str, int], int]:
    futures = admin.list_consumer_group_offsets([request], request_timeout=timeout_s)
    result = answer(admin, next(iter(futures.values())))
    return {(tp.topic, tp.partition): tp.offset for tp in result.topic_partitions
            if tp.offset >= 0}


def _owners(admin: Any, group_id: str, timeout_s: float) -> dict[tuple[str, int], str]:
    futures = admin.describe_consumer_groups([group_id], request_timeout=timeout_s)
    desc = answer(admin, futures[group_id])
    owners = {}
    for m in desc.members:
        who = f"{m.client_id}@{m.host} ({m.member_id})"
        for tp in (m.assignment.topic_partitions if m.assignment else []):
            owners[(tp.topic, tp.partition)] = who
    return owners


def _ages(config: dict[str, Any], left: dict[tuple[str, int], int],
          timeout_s: float) -> dict[tuple[str, int], float]:
    """Per partition with records left, from its offset: the age of its next record, seconds.

    A partition whose next readable record does not come within the timeout,
    or has no timestamp (-1), is left out; one with none (only aborted or
    control records left) is 0.
    """
    from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Consumer, KafkaError, TopicPartition

    if not left:
        return {}
    consumer = Consumer({**config, "group.id": "kfeed-lag-reader", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "enable.partition.eof": True,
                         "auto.offset.reset": "earliest"})
    try:
        consumer.assign([TopicPartition(t, p, o) for (t, p), o in left.items()])
        out: dict[tuple[str, int], float | None] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) < len(left) and time.monotonic() < deadline:
            m = consumer.poll(0.2)
            if m is None:
                continue
            key = (m.topic(), m.partition())
            if key in out or key not in left:
                continue
            if m.error() is None:
                kind, ms = m.timestamp()
                # A record without a timestamp (-1): its age is not known.
                out[key] = (max(0.0, time.time() - ms / 1000)
                            if kind != TIMESTAMP_NOT_AVAILABLE and ms >= 0 else None)
            elif m.error().code() == KafkaError._PARTITION_EOF:
                out[key] = 0.0
            else:
                continue
            consumer.incremental_unassign([TopicPartition(*key)])
        return {tp: age for tp, age in out.items() if age is not None}
    finally:
        consumer.close()
