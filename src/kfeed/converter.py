"""Re-encode a topic of one record per message into kfeed's block format, once.

Where it sits: before the loader, beside the producer. A topic that other
services write (Avro, Protobuf, JSON) or kfeed's raw format is read through
the same Cython decoders the loader uses, and written again as block
messages, so that every later epoch reads it at block speed::

    from-topic --consume--> decoder.decode_into --> numpy rows
               --Schema.encode_blocks--> block values --Producer--> to-topic

A schema with a variable-length field (token documents) is decoded with
``decoder.decode_documents`` instead: the field's elements flat, one length
per record, beside the fixed fields' rows.

Consume-transform-produce, exactly once (NOTE [ One transaction a round ]):
each round's blocks, its dead-letter copies and the source offsets it read
up to are one Kafka transaction. A convert that is killed and started again
goes on from the last committed round: every record is written once.

Source partition ``p`` goes to ``p % n`` of the to-topic, in order; a
to-topic that does not exist is made with the from-topic's partitions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kfeed._kafka import (ConnectionLog, admin_client, admin_partitions, bad_setting,
                          check_settings, client_config, create_topic, kafka_error, weakly,
                          within)
from kfeed.badrecords import BadRecordPolicy, BadRecords
from kfeed.errors import ConfigError, ConsumeError, KfeedError, ProduceError
from kfeed.formats import Decoder, RecordFormat, Stopped, resolve
from kfeed.producer import Producer, record_fits
from kfeed.schema import DecodeResult, Documents, Format, Schema, Target
from kfeed.sources import CONSUMER_DEFAULTS, dead_letter_headers, dead_lettered_up_to, topic_id

__all__ = ["ConvertStats", "convert"]

log = logging.getLogger("kfeed.convert")

MAX_ROUND = 1_000_000   # round_messages at most: librdkafka's consume() takes no more
_RETRIES = 3           # rounds aborted in a row before convert gives up
_LAG_ASK_S = 1.0       # the most a progress line's lag waits for the brokers
_LEAVE_S = 1.0         # the most a stopped convert waits to leave its group


class _HeldBack(Exception):
    """A round whose every record was bad, before any good one: held, not committed."""


@dataclass
class ConvertStats:
    """What a convert did so far; ``progress`` gets it after every round."""

    records: int = 0        # rows written
    bad: int = 0            # messages rejected (dead-lettered or skipped)
    messages: int = 0       # source messages read and committed
    blocks: int = 0         # block messages written
    bytes_in: int = 0
    bytes_out: int = 0
    transactions: int = 0
    aborted: int = 0
    lag: int = 0            # source messages not read yet, at the last round
    partitions: int = 0     # source partitions assigned to this convert now; 0 until the
                            # group gives it some (a stopped member's session must end first)
    source_partitions: int = 0  # the source topic's, which a read to the end must all hold
    elapsed_s: float = 0.0


class _Raw(Decoder):
    def __init__(self, schema: Schema) -> None:
        self.schema = schema

    def decode_into(self, values: Sequence[Any], out: Target, row: int) -> DecodeResult:
        return self.schema.decode_into(values, out, row, Format.RAW)

    def decode_documents(self, values: Sequence[Any]) -> Documents:
        return self.schema.decode_documents(values, Format.RAW)


def convert(
    kafka_config: Mapping[str, Any],
    from_topic: str,
    to_topic: str,
    schema: Schema,
    *,
    format: str | Format | RecordFormat,
    group_id: str | None = None,
    block_records: int | None = None,
    round_messages: int = 10_000,
    follow: bool = False,
    on_bad_record: str = "dead_letter",
    progress: Callable[[ConvertStats], None] | None = None,
    stop: threading.Event | None = None,
    connect_timeout_s: float = 30.0,
) -> ConvertStats:
    """Re-encode ``from_topic`` (``format``: Avro, Protobuf, JSON or raw) into ``to_topic``'s blocks.

    Reads with the consumer group ``group_id`` (default
    ``kfeed-convert.<to_topic>``), whose offsets move only with committed
    rounds; the transactional id is ``kfeed-convert:<from_topic>:<to_topic>``
    (a colon, which no topic name holds), so a second convert of the same
    pair fences the first, and only it. Without ``follow`` it returns once
    it holds every partition, each read to its end (while a stopped convert
    of the group still holds some, it waits for its session to end); with
    ``follow`` it waits for new records until ``stop`` is set. A bad record
    is dead-lettered to ``<from_topic>.dlq`` inside the round's transaction,
    skipped, or raised (``on_bad_record``). Returns the final ``ConvertStats``.

    >>> kfeed.convert({"bootstrap.servers": "127.0.0.1:39092"}, "clicks", "clicks.blocks",
    ...               schema, format=kfeed.Avro(registry={"url": "http://registry:8081"}))
    """
    if not isinstance(kafka_config, Mapping) or "bootstrap.servers" not in kafka_config:
        raise ConfigError("kafka_config must be a dict of librdkafka settings "
                          "with 'bootstrap.servers'")
    if not isinstance(schema, Schema):
        raise ConfigError("schema must be a kfeed.Schema")
    for name, topic in (("from_topic", from_topic), ("to_topic", to_topic)):
        if not isinstance(topic, str) or not topic:
            raise ConfigError(f"{name} must be a non-empty string, got {topic!r}")
    if from_topic == to_topic:
        raise ConfigError(f"the topic converted from and the one converted to are both "
                          f"{from_topic!r}: convert writes to another topic")
    if group_id is not None and (not isinstance(group_id, str) or not group_id.strip()):
        raise ConfigError(f"group_id must be a non-empty string or None (the default group "
                          f"kfeed-convert.{to_topic}), got {group_id!r}")
    fmt = resolve(format)
    if fmt is Format.BLOCK:
        raise ConfigError(f"{from_topic} would be converted from block to block: convert "
                          "reads avro, protobuf, json or raw topics")
    if isinstance(fmt, RecordFormat) and fmt.batches:
        raise ConfigError(f"{from_topic}: convert reads topics of one record a message (avro, "
                          f"protobuf, json, raw); an Arrow topic holds many a message and the "
                          f"loader reads it as it is, with format='arrow'")
    if not isinstance(round_messages, int) or not 1 <= round_messages <= MAX_ROUND:
        raise ConfigError(f"round_messages must be an int in 1..{MAX_ROUND:,} (what one "
                          f"consume() call takes at most), got {round_messages!r}")
    try:
        policy = BadRecordPolicy(on_bad_record)
    except ValueError:
        raise ConfigError("on_bad_record must be 'dead_letter', 'skip' or 'raise', "
                          f"got {on_bad_record!r}") from None
    if to_topic == f"{from_topic}.dlq" and policy is BadRecordPolicy.DEAD_LETTER:
        # Its bad records would go into the blocks, in the same transaction.
        raise ConfigError(f"{to_topic} is {from_topic}'s dead-letter topic: convert to "
                          f"another topic")
    decoder = fmt.decoder(schema) if isinstance(fmt, RecordFormat) else _Raw(schema)
    stop = stop or threading.Event()
    decoder.stop = stop  # a stop ends a wait for the schema registry (Stopped)
    group = group_id if group_id is not None else f"kfeed-convert.{to_topic}"
    job = _Convert(kafka_config, from_topic, to_topic, schema, fmt, decoder, policy, group,
                   block_records, round_messages, connect_timeout_s)
    try:
        return job.run(follow, progress, stop)
    finally:
        job.close(stopped=stop.is_set())


def _check_blocks(kafka_config: Mapping[str, Any], topic: str, schema: Schema,
                  timeout_s: float) -> bool:
    """Refuse an existing ``topic`` whose newest messages are blocks of another schema, or
    no kfeed blocks: a loader of either would reject the others as bad records.
    True if it holds blocks of ``schema``.

    The same check as ``kfeed produce`` makes; only each partition's newest
    committed message is read (``_kafka.newest_values``).
    """
    from kfeed._kafka import newest_values
    from kfeed.badrecords import block_fingerprint, describe_schema

    held = False
    for part, value in sorted(newest_values(kafka_config, topic, timeout_s).items()):
        if value is None:
            continue  # a tombstone says nothing of the schema
        fingerprint = block_fingerprint(value)
        if fingerprint is None or len(value) < 32:
            raise ConfigError(
                f"topic {topic} holds messages that are not kfeed blocks (the newest of "
                f"partition {part}): blocks converted into it would not read as one topic; "
                f"convert to another topic")
        if fingerprint != schema.fingerprint:
            raise ConfigError(
                f"topic {topic} holds kfeed blocks of another schema (fingerprint "
                f"{fingerprint:#018x}, the newest of partition {part}) than this convert "
                f"writes ({describe_schema(schema)}; {schema.fingerprint:#018x}): a loader of "
                f"either schema would reject the other's blocks as bad records; convert to "
                f"another topic")
        held = True
    return held


class _Convert:
    """One convert: its consumer, its transactional producer, and the rounds."""

    def __init__(self, kafka_config: Mapping[str, Any], from_topic: str, to_topic: str,
                 schema: Schema, fmt: Any, decoder: Decoder, policy: BadRecordPolicy,
                 group_id: str, block_records: int | None, round_messages: int,
                 connect_timeout_s: float) -> None:
        from confluent_kafka import Consumer, KafkaException

        self.from_topic = from_topic
        self.to_topic = to_topic
        self.schema = schema
        self.decoder = decoder
        self.round_messages = round_messages
        self.stats = ConvertStats()
        self.timeout = connect_timeout_s
        self.group = group_id
        # The settings first, as a transactional producer's and the consumer's:
        # librdkafka checks every one before any topic is made.
        check_settings(kafka_config, transactional=True)
        config = {**CONSUMER_DEFAULTS, **kafka_config, "group.id": group_id,
                  "enable.auto.commit": False, "isolation.level": "read_committed",
                  "enable.partition.eof": True, "logger": ConnectionLog()}
        try:
            self.consumer = Consumer(config)
        except KafkaException as e:
            raise bad_setting(e, config) from e
        self.producer: Producer | None = None
        try:  # what fails from here on closes the clients made
            base = client_config(kafka_config)
            nparts = self.stats.source_partitions = self._source_partitions(kafka_config)
            record_fits(schema, kafka_config)  # (before a topic is made for the blocks)
            created = create_topic(base, to_topic, partitions=nparts,
                                   timeout_s=connect_timeout_s)
            self.producer = Producer(kafka_config, to_topic, schema, block_records=block_records,
                                     transactional_id=f"kfeed-convert:{from_topic}:{to_topic}",
                                     connect_timeout_s=connect_timeout_s)
            # After init_transactions: a killed convert's open transaction is
            # aborted by now, so its newest committed blocks are readable.
            proven = not created and _check_blocks(kafka_config, to_topic, schema,
                                                   connect_timeout_s)
            self.dlq_topic = f"{from_topic}.dlq"
            self.dlq_parts = 0
            # Per source partition, its highest offset already dead-lettered:
            # what a loader (or another convert) copied is not copied again
            # (NOTE [ One copy per bad message ] in kfeed/sources.py).
            self.client = base
            self.dlq_done: dict[tuple[str, int], int] = {}
            # The source topic's id, on its copies: asked at the first bad record.
            self.source_id: str | None = None
            self.source_id_known = False
            if policy is BadRecordPolicy.DEAD_LETTER:
                create_topic(base, self.dlq_topic, partitions=nparts,
                             timeout_s=connect_timeout_s)
                # Its own count: one made before may have fewer partitions.
                self.dlq_parts = len(admin_partitions(
                    admin_client(base), self.dlq_topic, str(base["bootstrap.servers"]),
                    connect_timeout_s))
        except BaseException:
            self.close()
            raise
        self.bad = BadRecords(schema, fmt, policy, self, fail_fast=100)
        if proven:
            # Blocks of this schema were converted before: its records did
            # decode. A run that starts at a writer's incompatible change (a
            # hundred bad records in a row) routes them as a run that went on
            # through it did, rather than fail at the same offset every time.
            self.bad.good()
        self.assigned: set[int] = set()
        self.eof: set[int] = set()
        if schema.varlen is None:  # rows of a round's partition, decoded in place
            self.rows = schema.empty(round_messages, like="numpy")
            self.target = schema.bind(self.rows)
        self.dead: list[tuple[Any, str]] = []  # this round's dead-letter copies
        self.carried: list[Any] = []  # rounds held back (NOTE [ Bad records first ])

    def _source_partitions(self, kafka_config: Mapping[str, Any]) -> int:
        return len(admin_partitions(admin_client(kafka_config), self.from_topic,
                                    str(kafka_config["bootstrap.servers"]), self.timeout))

    # -- the rounds ---------------------------------------------------------------

    def run(self, follow: bool, progress: Callable[[ConvertStats], None] | None,
            stop: threading.Event) -> ConvertStats:
        t0 = time.monotonic()
        revoked = weakly(self._on_revoke)
        self.consumer.subscribe([self.from_topic], on_assign=weakly(self._on_assign),
                                on_revoke=revoked, on_lost=revoked)
        failures = 0
        while not stop.is_set():
            msgs = self._consume()
            if msgs:
                try:
                    self._round(msgs)
                    failures = 0
                except _HeldBack:
                    self.carried += msgs
                except Stopped:  # waiting for the registry: the round was aborted
                    break
                except ProduceError as e:
                    failures += 1
                    self.stats.aborted += 1
                    # A fatal error (fenced by a newer convert of the pair)
                    # no round mends: raised at once, as NOTE [ One
                    # transaction a round ] says.
                    if failures > _RETRIES or self.producer._fatal is not None:
                        raise
                    log.warning("round aborted (%s); reading its records again", e)
                    self._rewind(self.carried + msgs)
                    self.carried = []
                    self.bad.forget(lambda _m: True)  # any held are among those read again
            else:
                self.bad.waiting()
                if self.assigned and not self.stats.transactions:
                    self.stats.lag = self._lag()  # (no round has counted it yet)
            self.stats.elapsed_s = time.monotonic() - t0
            self.stats.partitions = len(self.assigned)
            if progress is not None:  # (an idle round of --follow too: it is alive)
                progress(self.stats)
            # The end: every partition of the source held, each at its end (one
            # another member holds, a stopped convert's till its session ends,
            # is read once it comes here).
            if not follow and not msgs and len(self.assigned) >= self.stats.source_partitions \
                    and self.assigned <= self.eof:
                self.bad.end_of_read()  # every record to the end was bad: that is the error
                break
        self.bad.flush()  # the bad records a warning window held back unsaid
        self.stats.elapsed_s = time.monotonic() - t0
        return self.stats

    def _consume(self) -> list[Any]:
        """The next round's messages (errors and ends of partitions taken out)."""
        from confluent_kafka import KafkaError

        got = self.consumer.consume(self.round_messages, 0.5)
        msgs = []
        for m in got:
            err = m.error()
            if err is None:
                msgs.append(m)
                self.eof.discard(m.partition())
            elif err.code() == KafkaError._PARTITION_EOF:
                self.eof.add(m.partition())
            elif err.fatal() or not err.retriable():
                raise ConsumeError(f"cannot read {self.from_topic}: {err.str()}",
                                   topic=self.from_topic, code=err.code())
            else:
                log.warning("kafka: %s", err.str())
        return msgs

    # NOTE [ One transaction a round ]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A round is what one consume() returned. Its records are decoded and
    # encoded per source partition, in offset order, and then, in one
    # transaction: the block messages, the dead-letter copies, and for each
    # partition the offset after its last message, sent with the consumer's
    # group metadata (so a convert fenced by a rebalance cannot commit). A
    # crash before the commit aborts it all (the next convert's
    # init_transactions does that); after it, all of it stands and the group
    # reads on from there. No rebalance falls inside a transaction: they
    # happen in consume(), between rounds. A round that fails to commit is
    # aborted and its partitions rewound to its first offsets, then read
    # again; a fatal error (another convert took the transactional id)
    # raises.
    #
    # NOTE [ Bad records first ]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Until a record decodes, BadRecords holds the rejected messages back: a
    # wrong schema rejects every record, and must stop the convert with one
    # error (after fail_fast of them, or at the end of a bounded read) with
    # nothing dead-lettered or committed. A round of only such messages is
    # therefore aborted before it sends anything (_HeldBack) and its messages
    # are carried: the consumer reads on, and the first round with a good
    # record routes the held ones (into its dead-letter copies) and commits
    # the carried offsets with its own. A rebalance drops the carried
    # messages of the partitions it takes away, and BadRecords forgets them:
    # their next owner reads them again from the committed offset.

    def _round(self, msgs: list[Any]) -> None:
        from confluent_kafka import TopicPartition

        by_part: dict[int, list[Any]] = {}
        for m in msgs:
            by_part.setdefault(m.partition(), []).append(m)
        ends = {m.partition(): m.offset() + 1 for m in self.carried + msgs}
        self.dead = []
        p = self.producer
        assert p is not None
        stats = self.stats
        rows = bad = blocks = nbytes = 0
        out_before = p.bytes
        messages_before = p.messages
        with p.transaction():
            for part, pms in by_part.items():
                cols, n, k = self._decode(pms)
                rows += n
                bad += k
                nbytes += sum(len(m.value() or b"") for m in pms)
                if n:
                    p.send(cols, partition=part % p.num_partitions)
            if not self.bad.good_seen:
                raise _HeldBack  # nothing was sent: the transaction is empty
            done = self._copy_dead()
            blocks = p.messages - messages_before
            p.send_offsets(self.consumer, [TopicPartition(self.from_topic, part, end)
                                           for part, end in ends.items()])
        self.dlq_done.update(done)  # (committed with the round)
        carried, self.carried = self.carried, []
        stats.records += rows
        stats.bad += bad + len(carried)
        stats.messages += len(msgs) + len(carried)
        stats.blocks += blocks
        stats.bytes_in += nbytes + sum(len(m.value() or b"") for m in carried)
        stats.bytes_out += p.bytes - out_before
        stats.transactions += 1
        stats.lag = self._lag()

    def _copy_dead(self) -> dict[tuple[str, int], int]:
        """Copy this round's dead letters not in the dead-letter topic yet (inside the
        round's transaction); the highest source offset copied per partition."""
        p = self.producer
        assert p is not None
        done: dict[tuple[str, int], int] = {}
        if self.dead and not self.source_id_known:
            self.source_id = topic_id(self.client, self.timeout, self.dead[0][0].topic())
            self.source_id_known = True
        for m, why in self.dead:
            src, part = (m.topic(), m.partition()), m.partition() % self.dlq_parts
            if src not in done:
                done[src] = self.dlq_done[src] if src in self.dlq_done else \
                    dead_lettered_up_to(self.client, self.timeout, self.dlq_topic, part, src,
                                        self.source_id)
            if m.offset() <= done[src]:
                continue
            p.copy(m, self.dlq_topic, part, dead_letter_headers(m, why, self.source_id))
            done[src] = m.offset()
        return done

    def _decode(self, msgs: list[Any]) -> tuple[dict[str, Any], int, int]:
        """Decode one partition's messages of the round: (columns, rows, bad)."""
        values = [m.value() for m in msgs]
        varlen = self.schema.varlen
        if varlen is not None:
            docs = self.decoder.decode_documents(values)
            tokens, lengths, columns = docs.tokens, docs.lengths, docs.columns
            bad = list(docs.bad)
            assert self.producer is not None
            over = self.producer.too_large(lengths)
            if over.any():  # bad records: no message holds them (one a message at most)
                of = np.searchsorted(np.cumsum(docs.counts), np.flatnonzero(over), "right")
                limit = self.producer.max_value_bytes
                for d, j in zip(np.flatnonzero(over).tolist(), of.tolist(), strict=True):
                    bad.append((j, f"a document of {int(lengths[d]):,} elements, "
                                            f"larger than a block message holds (message."
                                            f"max.bytes less 1024 for the headers, "
                                            f"{limit:,}): raise message.max.bytes (and the "
                                            f"topic's max.message.bytes)"))
                keep = ~over
                tokens, lengths = tokens[np.repeat(keep, lengths)], lengths[keep]
                columns = {k: v[keep] for k, v in columns.items()}
                bad.sort()
            cols = {**columns, varlen.name: (tokens, lengths)}
            n = len(lengths)
        else:
            res = self.decoder.decode_into(values, self.target, 0)
            if res.consumed != len(values):  # one row a message at most, and room for all
                raise KfeedError(f"the decoder took {res.consumed} of {len(values)} values")
            cols = {name: a[:res.rows] for name, a in self.rows.items()}
            n, bad = res.rows, res.bad
        if n:
            self.bad.good()
        for j, reason in bad:
            self.bad.bad(msgs[j], reason)
        return cols, n, len(bad)

    def dead_letter(self, msg: Any, reason: str) -> bool:
        """``BadRecords`` routes a rejected message here: copied within the round
        (unless it is in the dead-letter topic already: ``_copy_dead``)."""
        self.dead.append((msg, reason))
        return True

    def _rewind(self, msgs: list[Any]) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        first: dict[int, int] = {}
        for m in msgs:
            first.setdefault(m.partition(), m.offset())
        for part, offset in first.items():
            if part not in self.assigned:
                continue  # moved to another member: it reads from the committed offset
            # Not at its end any more: a round that ends the convert (not
            # following) waits for these records to be read again.
            self.eof.discard(part)
            try:
                self.consumer.seek(TopicPartition(self.from_topic, part, offset))
            except KafkaException as e:
                raise ConsumeError(f"cannot rewind {self.from_topic}[{part}] to {offset}: "
                                   f"{e.args[0].str()}", topic=self.from_topic) from e

    def _lag(self) -> int:
        """Source messages not read yet (from the consumer's cached watermarks)."""
        from confluent_kafka import TopicPartition

        lag = 0
        try:
            unread = []
            for tp in self.consumer.position([TopicPartition(self.from_topic, p)
                                              for p in sorted(self.assigned)]):
                if tp.offset < 0:  # nothing read from it yet: from where it will start
                    unread.append(tp)
                    continue
                _low, high = self.consumer.get_watermark_offsets(tp, cached=True)
                if high >= 0:
                    lag += max(0, high - tp.offset)
            if unread:  # (asked of the brokers: only until every partition is being read)
                # Briefly: a signal waits for a call into librdkafka to end, and
                # with the brokers gone an idle --follow asked for 30 s.
                timeout = min(self.timeout, _LAG_ASK_S)
                for tp in self.consumer.committed(unread, timeout=timeout):
                    low, high = self.consumer.get_watermark_offsets(tp, timeout=timeout)
                    lag += max(0, high - max(tp.offset, low))
        except Exception as e:  # noqa: BLE001 - the lag is only reported
            log.debug("lag not known: %s", kafka_error(e) or e)
        return lag

    def _on_assign(self, _consumer: Any, parts: list[Any]) -> None:
        self.assigned |= {tp.partition for tp in parts}

    def _on_revoke(self, _consumer: Any, parts: list[Any]) -> None:
        gone = {tp.partition for tp in parts}
        self.assigned -= gone
        self.eof -= gone
        self.carried = [m for m in self.carried if m.partition() not in gone]
        self.bad.forget(lambda m: m.partition() in gone)

    def close(self, stopped: bool = False) -> None:
        """Close the clients. ``stopped`` (a signal, a stop asked for): leaving the
        group waits ``_LEAVE_S`` at most, not librdkafka's 5 s for brokers that do
        not answer; the group then frees the partitions at the session's end."""
        try:
            if not stopped:
                self.consumer.close()
            elif not within(self.consumer.close, "kfeed-convert-close", _LEAVE_S):
                log.warning("this convert's leaving of group %s did not end within %g s (no "
                            "broker answered, or the group is rebalancing, held up by a member "
                            "that stopped without leaving): its partitions come free when its "
                            "session ends (session.timeout.ms)", self.group, _LEAVE_S)
        finally:
            if self.producer is not None:
                self.producer.close()

