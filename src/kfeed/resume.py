"""Where an ingestion run is, kept in Kafka itself: ``kfeed produce --from ... --resume``.

Where it sits: between the rows ``kfeed.ingest`` reads and the producer.
Rows from files, object stores and databases are sent inside transactions
of the producer (``Producer.transaction``); each transaction also commits,
through Kafka's transactional offset commit (``send_offsets``, as a
consume-transform-produce job commits what it consumed), how many of the
source's rows are sent so far. Both land together or not at all, so after
a crash the rows in the topic (as read_committed consumers, the loader
among them, see them) are exactly the first ``done`` rows of the source.

NOTE [ Ingestion progress ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The progress is the committed offset of a consumer group of its own,
``kfeed-produce.<topic>.<job>``, on partition 0 of the target topic: the
offset is the count of rows sent, and its metadata says so in words (the
source, the rows). Nobody consumes with that group; ``kfeed lag`` would
show it, with a meaningless lag. ``job`` is a hash of the source and the
query (credentials left out, ``ingest.source_key``), so the same command
finds its own progress, and another source into the same topic has its own (a
``--resume`` that finds none of its own while others are recorded is refused:
the same files named another way, a folder then a glob, would be sent twice). The producer's ``transactional.id`` is the
group's name: a restarted run fences the one it replaces, whose open
transaction the brokers abort, so a killed run's last rows are never seen.
A run with neither ``--resume`` nor ``--resend`` is refused once rows are
recorded (they would be sent twice); ``--resend`` starts from the source's
first row and records its progress anew. Resuming skips the rows already sent by reading them
again (files whose row counts are in their metadata are skipped unopened),
so the source must give its rows in the same order: files are read in
sorted order, and a query needs an ``ORDER BY`` on a unique key. So that
files do not move under the count, the note also holds a digest of the
names and sizes of the files the rows came from (``Rows.mark``): a file
added, removed or changed among them refuses the resume; files added after
them are read on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from kfeed.errors import ProduceError

__all__ = ["IngestProgress", "job_id", "other_sources"]


def job_id(topic: str, source: str, query: str | None) -> str:
    """The name of one source's ingestion into ``topic``: its group and transactional id."""
    digest = hashlib.blake2b(f"{source}\0{query or ''}".encode(), digest_size=6).hexdigest()
    return f"kfeed-produce.{topic}.{digest}"


class IngestProgress:
    """The rows of one source sent to ``topic``, as committed with the last transaction."""

    def __init__(self, kafka_config: Mapping[str, Any], topic: str, job: str, source: str,
                 timeout_s: float, marker: Callable[[int], str | None] = lambda rows: None
                 ) -> None:
        from confluent_kafka import Consumer

        from kfeed._kafka import logged_config

        self.topic, self.job, self.source, self.timeout_s = topic, job, source, timeout_s
        # What must not change for a resume after N rows (``Rows.mark``): recorded
        # with the count, and the last one found by ``done`` as ``mark``.
        self.marker = marker
        self.mark: str | None = None
        # librdkafka's lines go to logging, folded, as the producer's do: not to stderr.
        self._consumer = Consumer({**logged_config(kafka_config), "group.id": job,
                                   "enable.auto.commit": False,
                                   "isolation.level": "read_committed"})

    def done(self) -> int:
        """Rows recorded as sent by the last committed transaction (0 if none)."""
        from confluent_kafka import KafkaException, TopicPartition

        from kfeed._kafka import PASSING, passing

        def ask() -> Any:
            got = self._consumer.committed([TopicPartition(self.topic, 0)],
                                           timeout=self.timeout_s)
            if got[0].error is not None and got[0].error.code() in PASSING:
                raise KafkaException(got[0].error)
            return got

        try:  # (a group coordinator still loading or moving, after a restart: asked again)
            got = passing(ask, self.timeout_s)
        except KafkaException as e:
            raise ProduceError(f"cannot read the progress of {self.job}: {e.args[0].str()}"
                               ) from e
        if got[0].error is not None:  # e.g. a commit still pending: never guess 0
            raise ProduceError(f"cannot read the progress of {self.job}: {got[0].error.str()}")
        try:
            self.mark = json.loads(got[0].metadata or "{}").get("mark")
        except (ValueError, AttributeError):
            self.mark = None
        return max(0, got[0].offset)

    def record(self, producer: Any, rows: int) -> None:
        """Inside ``producer.transaction()``: ``rows`` sent once it commits."""
        from confluent_kafka import TopicPartition

        note = json.dumps({"rows": rows, "source": self.source, "mark": self.marker(rows)},
                          separators=(",", ":"))
        producer.send_offsets(self._consumer, [TopicPartition(self.topic, 0, rows,
                                                              metadata=note)])

    def close(self) -> None:
        self._consumer.close()


def other_sources(kafka_config: Mapping[str, Any], topic: str, job: str,
                  timeout_s: float) -> list[tuple[str, int]]:
    """The other sources with rows recorded as sent to ``topic``: (source, rows) each.

    For a ``--resume`` that finds nothing of its own: the same files named
    another way (a folder, then a glob) are another job, whose rows it would
    send again.
    """
    from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition

    from kfeed._kafka import admin_client, answer, refusal, refused_message

    admin = admin_client(kafka_config)
    prefix = f"kfeed-produce.{topic}."
    try:
        groups = [g.group_id for g in answer(admin, admin.list_consumer_groups(
            request_timeout=timeout_s)).valid
            if g.group_id.startswith(prefix) and g.group_id != job]
        found = []
        for group in groups:  # (one group a request: the admin API asks so)
            future = admin.list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group, [TopicPartition(topic, 0)])],
                request_timeout=timeout_s)[group]
            for tp in answer(admin, future).topic_partitions:
                if tp.error is None and tp.offset > 0:
                    try:
                        source = json.loads(tp.metadata or "{}").get("source", group)
                    except ValueError:
                        source = group
                    found.append((str(source), int(tp.offset)))
    except KafkaException as e:
        if (refused := refusal(admin)) is not None:
            raise ProduceError(refused_message(str(kafka_config.get("bootstrap.servers")),
                                               refused), code=refused.code()) from e
        raise ProduceError(f"cannot read the progress recorded in {topic}: "
                           f"{e.args[0].str()}") from e
    return sorted(found)
