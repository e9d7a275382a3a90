"""kfeed lag / kfeed.group_lag: a group's lag per partition, against a real broker.

Records are written with known timestamps, the group's offsets committed by
hand, so every figure the report gives is known beforehand.
"""

from __future__ import annotations

import logging
import re
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka import Producer as KafkaProducer

import kfeed

pytestmark = pytest.mark.integration


def test_lag_in_messages_and_seconds_and_the_owning_member(bootstrap, make_topic):
    topic = make_topic(partitions=2)
    group = uuid.uuid4().hex
    now_ms = int(time.time() * 1000)
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for i in range(60):  # record i of partition 0 is 100 - i seconds old
        p.produce(topic, b"x", partition=0, timestamp=now_ms - (100 - i) * 1000)
    for i in range(40):
        p.produce(topic, b"y", partition=1, timestamp=now_ms - 500_000)
    assert p.flush(30) == 0
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    c.commit(offsets=[TopicPartition(topic, 0, 20)], asynchronous=False)
    c.close()
    config = {"bootstrap.servers": bootstrap}
    p0, p1 = kfeed.group_lag(config, group, [topic])
    # One topic as a str, as the Loader takes it (it was read as letters), and a
    # topic named twice (its partitions came twice).
    for topics in (topic, [topic, topic]):
        assert [(p.partition, p.lag) for p in kfeed.group_lag(config, group, topics)] == \
            [(0, 40), (1, 40)]
    assert (p0.partition, p0.committed, p0.end, p0.lag, p0.member) == (0, 20, 60, 40, None)
    assert 79 <= p0.lag_s <= 79 + 60  # the record at offset 20 was written 80 s ago
    assert (p1.committed, p1.end, p1.lag) == (None, 40, 40)  # never committed: from the start
    assert p1.lag_s >= 499
    # Read to the end and committed: no lag, in either unit.
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    c.commit(offsets=[TopicPartition(topic, 0, 60), TopicPartition(topic, 1, 40)],
             asynchronous=False)
    c.close()
    assert [(r.lag, r.lag_s) for r in kfeed.group_lag(config, group)] == [(0, 0.0), (0, 0.0)]
    # A next record without a timestamp (-1): its age is not known (it read 56 years).
    p.produce(topic, b"z", partition=1, timestamp=-1)
    assert p.flush(30) == 0
    assert [(r.lag, r.lag_s) for r in kfeed.group_lag(config, group)] == [(0, 0.0), (1, None)]
    # A commit below the log's start (records deleted, or gone with retention): the
    # group reads next from the start, whose record's age this is (it read 0 s).
    from confluent_kafka.admin import AdminClient

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    c.commit(offsets=[TopicPartition(topic, 0, 2)], asynchronous=False)
    c.close()
    admin = AdminClient(config)
    for f in admin.delete_records([TopicPartition(topic, 0, 50)]).values():
        f.result(30)
    p0 = kfeed.group_lag(config, group, [topic])[0]
    assert (p0.committed, p0.end, p0.lag) == (2, 60, 10)
    assert 49 <= p0.lag_s <= 49 + 60  # the record at offset 50 was written 50 s ago
    # A live member owns both partitions.
    member = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                       "client.id": "trainer-7"})
    member.subscribe([topic])
    deadline = time.monotonic() + 60
    while not member.assignment() and time.monotonic() < deadline:
        member.poll(0.2)
    try:
        owners = {r.member for r in kfeed.group_lag(config, group)}
        assert len(owners) == 1 and next(iter(owners)).startswith("trainer-7@")
    finally:
        member.close()


def lag_cmd(bootstrap: str, group: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KFEED_BOOTSTRAP": bootstrap}
    return subprocess.run([sys.executable, "-m", "kfeed", "lag", "--group-id", group, *args],
                          env=env, check=False, capture_output=True, text=True, timeout=120)


def test_the_command_prints_a_table_and_a_summary(bootstrap, make_topic):
    topic, other = make_topic(partitions=1), make_topic(partitions=1)
    group = uuid.uuid4().hex
    p = KafkaProducer({"bootstrap.servers": bootstrap})
    for _ in range(7):
        p.produce(topic, b"z", partition=0)
    assert p.flush(30) == 0
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    c.commit(offsets=[TopicPartition(other, 0, 0)], asynchronous=False)  # the group exists
    c.close()
    done = lag_cmd(bootstrap, group, "--topic", topic)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].split() == ["TOPIC", "PARTITION", "COMMITTED", "END", "LAG", "LAG_S", "MEMBER"]
    assert lines[1].split()[:5] == [topic, "0", "-", "7", "7"]
    assert lines[-1].startswith(f"group {group}: lag 7 messages over 1 partitions")


def test_a_member_that_committed_nothing_is_asked_for_its_topics(bootstrap, make_topic):
    topic = make_topic(partitions=1)
    group = uuid.uuid4().hex
    member = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    member.subscribe([topic])
    deadline = time.monotonic() + 60
    while not member.assignment() and time.monotonic() < deadline:
        member.poll(0.2)
    try:
        none = lag_cmd(bootstrap, group)
    finally:
        member.close()
    assert (none.returncode, none.stderr) == (1, f"kfeed: group {group} committed no offsets: "
                                                 f"name its topics with --topic T\n")


def test_a_group_or_topic_the_brokers_do_not_know_is_named(bootstrap, make_topic):
    # A group never seen was told to name its topics, and then got a full table; an
    # unknown topic took 11 s and was to be created.
    topic = make_topic(partitions=1)
    group = f"no-such-group-{uuid.uuid4().hex}"
    for args in ((), ("--topic", topic)):
        done = lag_cmd(bootstrap, group, *args)
        assert (done.returncode, done.stdout, done.stderr) == (1, "", (
            f"kfeed: no group {group} on these brokers (no members, no committed offsets): "
            f"check the name\n"))
    missing = f"no-such-topic-{uuid.uuid4().hex}"
    done = lag_cmd(bootstrap, group, "--topic", missing)
    assert (done.returncode, done.stderr) == (1, (
        f"kfeed: no topic {missing} on these brokers ({bootstrap}): check the name "
        f"(topic={missing})\n"))


def test_brokers_out_of_reach_are_one_error_and_no_librdkafka_warning(caplog):
    # The error named them, and librdkafka's own line was logged at WARNING
    # too: a program without logging set up got it on stderr as well.
    with caplog.at_level(logging.WARNING), pytest.raises(
            kfeed.ConsumeError, match="^cannot reach the brokers at 127.0.0.1:1 within 2s"):
        kfeed.group_lag({"bootstrap.servers": "127.0.0.1:1"}, "nobody", timeout_s=2)
    assert [r.getMessage() for r in caplog.records if r.name == "kfeed.librdkafka"] == []


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), "5", True, np.float32(-1)])
def test_a_timeout_that_is_no_number_of_seconds_is_one_clear_error(timeout_s):
    # group_lag passed it to the admin client: a raw ValueError or TypeError,
    # or "cannot reach the brokers ... within 0s"; create_topic's TypeError.
    config = {"bootstrap.servers": "127.0.0.1:1"}
    for call in (lambda: kfeed.group_lag(config, "g", timeout_s=timeout_s),
                 lambda: kfeed.create_topic(config, "t", timeout_s=timeout_s)):
        with pytest.raises(kfeed.ConfigError,
                           match=f"^timeout_s must be a number of seconds > 0, got "
                                 f"{re.escape(repr(timeout_s))}$"):
            call()


def test_a_numpy_timeout_is_a_number_of_seconds():
    with pytest.raises(kfeed.ConsumeError, match="^cannot reach the brokers at 127.0.0.1:1 "):
        kfeed.group_lag({"bootstrap.servers": "127.0.0.1:1"}, "nobody", timeout_s=np.float64(1))
