"""Where the loader's message values come from: Kafka, or memory.

The loader's background thread reads through a ``Source``: it opens it, asks
for messages in bulk, pauses partitions that reached the end of a bounded
epoch, commits positions, and closes it. ``KafkaSource`` wraps a
confluent-kafka consumer (librdkafka waits without the GIL); ``MemorySource``
replays recorded message values through the very same decode, pool and
prefetch path, for unit tests and for GPU benchmarks on a machine without a
broker. Neither knows about batches or tensors.

A *position* is ``(offset, skip)``: the next message to read, and how many of
its records were already handed out (a block may straddle two batches).
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from kfeed import _fetch
from kfeed._fetch import Record
from kfeed._kafka import (
    GONE_CODES,
    GONE_GRACE_S,
    PASSING,
    REFUSED,
    ConnectionLog,
    admin_client,
    bad_setting,
    chain,
    client_config,
    topic_setting,
    wait_partitions,
    weakly,
)
from kfeed.errors import ConfigError, ConsumeError

__all__ = ["Source", "KafkaSource", "MemorySource", "TP", "Position", "Committed",
           "CONSUMER_DEFAULTS", "dead_letter_headers", "dead_lettered_up_to", "topic_id"]

log = logging.getLogger(__name__)

TP = tuple[str, int]
Position = tuple[int, int]
AssignCallback = Callable[[list[TP]], dict[TP, Position]]
RevokeCallback = Callable[[list[TP]], None]

# librdkafka settings kfeed starts from; the user's dict overrides any of them.
# Throughput: big fetches that return as soon as data exists, and a short
# back-off when the local queue is full (the 1000 ms default stalls a fast
# trainer). Memory: the pre-fetch queue is bounded explicitly.
CONSUMER_DEFAULTS: dict[str, Any] = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "auto.offset.reset": "earliest",
    "isolation.level": "read_committed",
    "fetch.min.bytes": 1,
    "fetch.wait.max.ms": 50,
    "fetch.queue.backoff.ms": 10,
    "queued.min.messages": 100000,
    "queued.max.messages.kbytes": 65536,
    "max.partition.fetch.bytes": 8 << 20,
    "fetch.max.bytes": 64 << 20,
    # Partitions added to a topic are read within seconds, not at librdkafka's
    # refresh of every 5 minutes (a convert --follow said "lag 0" meanwhile).
    "topic.metadata.refresh.interval.ms": 10_000,
}

_PREFIX = "kfeed:"

# The group protocols, named as kfeed logs them:
# - "consumer": Kafka 4's consumer group protocol (KIP-848, group.protocol=
#   consumer): the brokers assign, and a rebalance moves only the partitions
#   that change owner;
# - "cooperative": the classic protocol with cooperative-sticky assignment;
# - "eager": the classic protocol with range or roundrobin assignment, where
#   every rebalance revokes every partition first.
# kfeed keeps librdkafka's default, eager: with brokers' default heartbeats a
# joining member reads after 2.0 s, against 4.8 s (cooperative) and 5.1 s
# (consumer), and the member already reading waits 0.03 s (bench/RESULTS.md,
# "Group protocols"). Each works, and none loses or repeats a record.
_LOCAL_FATAL = -150  # librdkafka's ERR__FATAL


def group_protocol(config: Mapping[str, Any]) -> str:
    """"consumer", "cooperative" or "eager": how a consumer with ``config`` rebalances."""
    if str(config.get("group.protocol", "classic")).lower() == "consumer":
        return "consumer"
    strategy = str(config.get("partition.assignment.strategy", "range"))
    return "cooperative" if "cooperative" in strategy else "eager"


def group_share(counts: Mapping[str, int], mixture: bool,
                config: Mapping[str, Any]) -> tuple[int, str, bool]:
    """How many members of a consumer group over topics of ``counts`` partitions each
    get one: ``(members, why, dealt_apart)``.

    A mixture's members read every topic, so the smallest count. The range
    assignor (librdkafka's default) under an eager protocol deals each
    topic's partitions apart, so members beyond the largest topic's count get
    none (``dealt_apart``); otherwise the group spreads all the partitions.
    """
    strategy = str(config.get("partition.assignment.strategy", "range"))
    dealt_apart = strategy.strip().lower().startswith("range") and \
        group_protocol(config) == "eager"
    if mixture:
        return min(counts.values()), "a mixture's members each read every topic", False
    if dealt_apart:
        return max(counts.values()), "the range assignor deals each topic's partitions apart", True
    return sum(counts.values()), "the group spreads the partitions", False

# The headers of a dead-lettered message that name where it came from.
DLQ_TOPIC_HEADER = "kfeed.source.topic"
DLQ_PARTITION_HEADER = "kfeed.source.partition"
DLQ_OFFSET_HEADER = "kfeed.source.offset"
# The source topic's id: a topic deleted and made again under its name has another.
DLQ_TOPIC_ID_HEADER = "kfeed.source.topic_id"
_DLQ_WINDOW = 1000
# The dead-letter producer's message.max.bytes (librdkafka's largest), and what a
# dead-letter topic kfeed makes takes past its source topic's max.message.bytes:
# a copy is the record and the headers naming its source.
_DLQ_MESSAGE_MAX = 1_000_000_000
_DLQ_HEADROOM = 64 << 10


def dead_letter_headers(msg: Any, reason: str, topic_id: str | None = None
                        ) -> list[tuple[str, bytes]]:
    """The headers of ``msg``'s dead-letter copy: where it came from, and why."""
    return [
        (DLQ_TOPIC_HEADER, msg.topic().encode()),
        (DLQ_PARTITION_HEADER, str(msg.partition()).encode()),
        (DLQ_OFFSET_HEADER, str(msg.offset()).encode()),
        *([(DLQ_TOPIC_ID_HEADER, topic_id.encode())] if topic_id else []),
        ("kfeed.reason", reason.encode()),
    ]


def topic_id(client: Mapping[str, Any], timeout: float, topic: str) -> str | None:
    """The brokers' id of ``topic`` (None where they do not say)."""
    from confluent_kafka import KafkaException, TopicCollection

    try:
        admin = admin_client(client)  # (held until the answer: its end cancels the call)
        found = admin.describe_topics(TopicCollection([topic]))[topic]
        return str(found.result(timeout=timeout).topic_id) or None
    except (KafkaException, ConfigError, TimeoutError, ValueError, TypeError) as e:
        log.debug("cannot learn the id of %s: %s", topic, e)
        return None

# NOTE [ One copy per bad message ]
#
# Every group that reads a topic meets its bad messages, and each used to
# copy them all to <topic>.dlq again. The rule now:
# - <topic>.dlq is created with as many partitions as <topic>, and a bad
#   message of partition p goes to partition p (p modulo the count, for a
#   dead-letter topic made otherwise), in offset order;
# - before its first copy from partition p, a loader (or a kfeed convert,
#   inside its round's transaction) reads the committed end of that
#   dead-letter partition for the highest source offset of p there
#   (dead_lettered_up_to), and copies only messages above it.
# So a second group, or a trainer resumed from an older checkpoint, copies
# nothing twice. The rule is a prefix: a message below the highest copied
# offset counts as copied, so a reader that started past earlier bad
# messages (start="latest", or a time) leaves those out of the dead-letter
# topic for later readers too; they stay in the source topic. Two loaders that meet the same bad message at the same
# moment may both copy it: the check is not a transaction. A copy names
# its source topic's id (DLQ_TOPIC_ID_HEADER): a topic deleted and made
# again under its name starts at offset 0 again, and the copies of the old
# one do not count for it.


def dead_lettered_up_to(client: Mapping[str, Any], timeout: float, topic: str, part: int,
                        src: TP, src_id: str | None = None) -> int:
    """The highest offset of ``src`` already in partition ``part`` of dead-letter topic
    ``topic``; -1 if none (NOTE [ One copy per bad message ]).

    ``src_id``: the source topic's id (``topic_id``). Copies of a topic of
    the same name deleted since (another id) are not this one's: its
    offsets started again at 0.

    Reads the partition backwards in windows of ``_DLQ_WINDOW`` messages
    until one from ``src`` turns up: one window when the dead-letter topic
    has as many partitions as the source, the usual case. Committed copies
    only: those of a ``kfeed convert`` round that was aborted are not there.
    ``client``: the connection settings.
    """
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    reader = Consumer({**client, "group.id": "kfeed-dlq-reader",
                       "enable.auto.commit": False, "enable.partition.eof": True,
                       "isolation.level": "read_committed", "logger": ConnectionLog()})
    try:
        # A dead-letter topic made a moment ago may be unknown to the broker
        # asked while its metadata spreads: ask again a while.
        deadline = time.monotonic() + GONE_GRACE_S
        while True:
            try:
                lo, hi = reader.get_watermark_offsets(TopicPartition(topic, part),
                                                      timeout=timeout)
                break
            except KafkaException as e:
                if e.args[0].code() in GONE_CODES and time.monotonic() < deadline:
                    time.sleep(0.25)
                    continue
                raise ConsumeError(f"cannot read the end of {topic}[{part}]: "
                                   f"{e.args[0].str()}", topic=topic, partition=part) from e
        end = hi
        while end > lo:
            start = max(lo, end - _DLQ_WINDOW)
            best, older = _scan_dead_letters(reader, TopicPartition(topic, part, start), end,
                                             src, src_id, timeout)
            if best >= 0 or older:  # (before a copy of an older topic, none of this one)
                return best
            end = start
        return -1
    finally:
        reader.close()


def _scan_dead_letters(reader: Any, start: Any, end: int, src: TP, src_id: str | None,
                       timeout: float) -> tuple[int, bool]:
    """The highest offset of ``src`` among the dead-letter copies from ``start`` on, and
    whether a copy of an older topic of its name (another id) was among them."""
    from confluent_kafka import KafkaError

    reader.assign([start])
    best, older = -1, False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in reader.consume(500, 0.5):
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    # The end, past ``end`` too: offsets at its tail that hold
                    # no message (a transaction's marker, aborted copies) never
                    # come to the offset check below.
                    return best, older
                continue
            h = dict(m.headers() or ())
            if h.get(DLQ_TOPIC_HEADER) == src[0].encode() and \
                    h.get(DLQ_PARTITION_HEADER) == str(src[1]).encode():
                theirs = h.get(DLQ_TOPIC_ID_HEADER)
                if src_id and theirs and theirs != src_id.encode():
                    best, older = -1, True  # the copies of this topic come after
                else:
                    best = max(best, int(h.get(DLQ_OFFSET_HEADER, b"-1")))
            if m.offset() >= end - 1:
                return best, older
    raise ConsumeError(f"could not read {start.topic}[{start.partition}] within "
                       f"{timeout:g}s to find what is dead-lettered already",
                       topic=start.topic, partition=start.partition)


# Seconds without data after which a consumer asks whether its topics still exist.
IDLE_PROBE_S = 5.0


class Committed(NamedTuple):
    """A committed position, and which loader committed it.

    The commit metadata is ``kfeed:skip=N,by=LINEAGE,run=RUN,rest=NOTE``:
    ``skip`` lets a plain group restart skip the records of a split block;
    ``by`` names the chain of loaders (a trainer and the runs resumed from
    its checkpoints) that wrote it, and ``run`` the run of that chain: one
    start of the job, shared by its ranks. A resumed loader can so tell the
    commits of its chain's earlier runs, which may run past its checkpoint
    and were lost with the crash, from those of its own run's other ranks
    and of other members, which come after it (``Ledger.positions``).
    ``rest`` says which records above the position a shuffle or a packer
    already used (NOTE [ Commit notes ] in ``kfeed/loader/ledger.py``).

    A position to commit is ``(offset, skip)``, or ``(offset, skip, note)``.
    """

    offset: int
    skip: int
    by: str | None
    run: str | None = None
    rest: str | None = None


# Kafka keeps at most offset.metadata.max.bytes of a commit's metadata
# (4096 by default); a longer one fails the commit.
METADATA_MAX = 4096


# Kafka protocol error codes of a commit that goes through once the consumer
# has been polled and has joined the group's new generation:
# ILLEGAL_GENERATION (a cooperative rebalance completed meanwhile),
# REBALANCE_IN_PROGRESS, FENCED_MEMBER_EPOCH and STALE_MEMBER_EPOCH (the
# consumer protocol); and UNKNOWN_MEMBER_ID for a member of the group.
_AFTER_POLL = frozenset((22, 27, 110, 113))


# The broker refused a commit's metadata as too long (a broker whose
# offset.metadata.max.bytes is below Kafka's default).
_METADATA_TOO_LARGE = 12


def _metadata(tp: TP, pos: Sequence[Any], by: str | None, run: str | None,
              warned: set[TP], limit: int = METADATA_MAX) -> str | None:
    """A commit's metadata (see ``Committed``), its note left out if it would not fit."""
    skip = pos[1]
    fields = ([f"skip={skip}"] if skip else []) + ([f"by={by}"] if by else []) \
        + ([f"run={run}"] if run else [])
    if len(pos) > 2 and pos[2]:
        note = f"rest={pos[2]}"
        if len(_PREFIX) + len(",".join(fields)) + 1 + len(note) <= limit:
            fields.append(note)
        elif limit and tp not in warned:  # (limit 0: the broker refused notes, said once)
            warned.add(tp)
            log.warning("%s[%d]: what the shuffle used above offset %d does not fit the "
                        "commit's metadata (%d characters, Kafka keeps %d): a reader that "
                        "takes the partition over from this commit uses those records again; "
                        "a smaller Shuffle(buffer=) or more partitions keep it small",
                        tp[0], tp[1], pos[0], len(note), limit)
    return _PREFIX + ",".join(fields) if fields else None


def _parse_metadata(offset: int, metadata: str | None) -> Committed:
    skip, by, run, rest = 0, None, None, None
    if metadata and metadata.startswith(_PREFIX):
        for field in metadata[len(_PREFIX):].split(","):
            key, _, value = field.partition("=")
            if key == "skip" and value.isdigit():
                skip = int(value)
            elif key == "by" and value:
                by = value
            elif key == "run" and value:
                run = value
            elif key == "rest" and value:
                rest = value
    return Committed(offset, skip, by, run, rest)


class Source:
    """What the loader's thread needs from a stream of message values."""

    lineage: str | None = None  # written with every commit, with run (see Committed)
    run: str | None = None
    group_id = ""  # the consumer group, for metrics and logs
    # Set when the loader closes: a wait for the brokers gives up at once.
    stopping: threading.Event | None = None
    # Counted for metrics: commit requests sent, commits (or partitions of
    # one) refused, and messages copied to the dead-letter queue.
    commits_sent = 0
    commit_failures = 0
    dead_lettered = 0
    group_member = False  # must keep polling for its group's rebalances to go on
    # An error that ended the consumer (NOTE [ A fenced member stops at once ]):
    # the loader's next() raises it before it hands out another batch.
    ended: ConsumeError | None = None
    # A rebalance moves only some partitions (cooperative-sticky, or Kafka 4's
    # consumer protocol); the others keep their fetch position.
    incremental = False

    def open(
        self,
        on_assign: AssignCallback,
        on_revoke: RevokeCallback,
        assignment: Sequence[TP] | None,
    ) -> None:
        """Start reading; ``assignment`` pins partitions, None joins the group."""
        raise NotImplementedError

    def partitions(self) -> list[TP]:
        """Every partition of the source's topics."""
        raise NotImplementedError

    def watermarks(self, tp: TP, cached: bool = False) -> tuple[int, int]:
        raise NotImplementedError

    def lag(self, positions: Mapping[TP, int],
            known_ends: Mapping[TP, int] | None = None) -> dict[TP, int]:
        """Messages from ``positions`` (the caller's, per partition) to each partition's end.

        ``known_ends``: ends the caller knows (a bounded epoch's), for
        partitions whose end the source has not seen yet.
        """
        raise NotImplementedError

    def consume(self, max_messages: int, timeout: float) -> list[Any]:
        raise NotImplementedError

    def pause(self, tps: Sequence[TP]) -> None:
        raise NotImplementedError

    def resume(self, tps: Sequence[TP]) -> None:
        raise NotImplementedError

    def committed(self, tps: Sequence[TP]) -> dict[TP, Committed | None]:
        raise NotImplementedError

    def seek(self, positions: Mapping[TP, Position]) -> None:
        """Read assigned partitions again from these offsets."""
        raise NotImplementedError

    def offsets_for_time(self, tps: Sequence[TP], when: datetime) -> dict[TP, int]:
        raise NotImplementedError

    def commit(self, positions: Mapping[TP, Position], asynchronous: bool) -> dict[TP, Position]:
        """Commit ``positions``; those the broker acknowledged already.

        An asynchronous commit returns before the answer: what the broker
        acknowledges later comes from ``acknowledged()``.
        """
        raise NotImplementedError

    def acknowledged(self) -> dict[TP, Position]:
        """Positions of asynchronous commits acknowledged since the last call."""
        return {}

    def dead_letter(self, msg: Any, reason: str) -> bool:
        """Copy a rejected message to the dead-letter queue (``settle`` waits for it);
        False if it is there already."""
        raise NotImplementedError

    def settle(self) -> None:
        """Wait until every dead-lettered copy is acknowledged; raise if one failed.

        Called before offsets past a bad message are committed or saved.
        """

    def close(self) -> None:
        raise NotImplementedError


def consumer_config(kafka_config: Any) -> dict[str, Any]:
    """``kafka_config`` over kfeed's consumer defaults, checked (no broker asked)."""
    if not isinstance(kafka_config, Mapping):
        raise ConfigError("kafka_config must be a dict of librdkafka settings")
    config = {**CONSUMER_DEFAULTS, **kafka_config}
    if "bootstrap.servers" not in config:
        raise ConfigError("kafka_config needs 'bootstrap.servers'")
    if "group.id" not in config:
        raise ConfigError("kafka_config needs 'group.id': offsets are committed to a group")
    if not isinstance(config["group.id"], str) or not config["group.id"].strip():
        raise ConfigError(f"group.id must be a non-empty string, got {config['group.id']!r}")
    reset = str(config["auto.offset.reset"]).lower()
    if reset not in ("earliest", "smallest", "beginning"):
        # Never asked: the loader places each partition's start itself.
        raise ConfigError(
            f"auto.offset.reset={config['auto.offset.reset']!r}: kfeed places each "
            f"partition's start itself, by start= ('committed' by default: the group's "
            f"commit, else the earliest offset); give start='latest' (kfeed train --start "
            f"latest) to begin at the end, and leave the setting out")
    if str(config["isolation.level"]).lower() != "read_committed":
        # The records of aborted transactions (a killed producer's, a fenced
        # convert's) would be handed out, as if they were written.
        raise ConfigError(
            f"isolation.level={config['isolation.level']!r}: the records of aborted "
            f"transactions would be read as written; kfeed reads committed records "
            f"only: leave the setting out")
    if str(config["enable.auto.offset.store"]).lower() not in ("false", "0"):
        # librdkafka would store each record's offset as it is fetched, and
        # commit those (auto commit, or any commit() of stored offsets):
        # records ahead of the step, never trained if the trainer dies.
        raise ConfigError(
            f"enable.auto.offset.store={config['enable.auto.offset.store']!r}: librdkafka "
            f"would commit records as they are fetched, ahead of the steps that use them; "
            f"kfeed commits each batch after its step: leave the setting out")
    return config


class KafkaSource(Source):
    """Messages from Kafka through a confluent-kafka consumer.

    ``kafka_config`` is the librdkafka dict the user wrote; it is copied, and
    kfeed's defaults fill only the keys it lacks.
    """

    def __init__(
        self,
        kafka_config: Mapping[str, Any],
        topics: Sequence[str],
        *,
        ends: bool,
        connect_timeout: float,
        dlq_config: Mapping[str, Any] | None = None,
    ) -> None:
        from confluent_kafka import Consumer, KafkaException

        config = consumer_config(kafka_config)
        if ends:
            # The end of a bounded epoch is seen as a partition EOF event, which
            # also covers a transaction marker or aborted records at the tail;
            # an unbounded mixture passes the turn of a partition at its end.
            config.setdefault("enable.partition.eof", True)
        self.protocol = group_protocol(config)
        self.incremental = self.protocol != "eager"
        config["error_cb"] = chain(self._on_error, config.get("error_cb"))
        # (Its connection lines at DEBUG: _on_error warns of the same trouble.)
        config.setdefault("logger", ConnectionLog(trouble_level=logging.DEBUG))
        self._warn = ConnectionLog(log)
        # Lag comes from librdkafka's own statistics, so reading it never
        # blocks on a broker (one that is down, say).
        config.setdefault("statistics.interval.ms", 1000)
        config["on_commit"] = chain(self._on_commit, config.get("on_commit"))
        self._inflight: dict[tuple[TP, int], Position] = {}
        self._note_warned: set[TP] = set()  # partitions whose commit note did not fit
        self._note_limit = METADATA_MAX  # 0 once the broker refused a note as too long
        self._acked: deque[tuple[TP, Position]] = deque()
        config["stats_cb"] = chain(self._on_stats, config.get("stats_cb"))
        self._lag: dict[TP, int] = {}
        self._ends: dict[TP, int] = {}
        self._fetched_ends: dict[TP, int] = {}  # until the first statistics
        self._committed_only = True  # (consumer_config refuses read_uncommitted)
        self.topics = list(topics)
        self.connect_timeout = connect_timeout
        self._config = config
        self.group_id = str(config["group.id"])
        self._dlq_config = dict(dlq_config) if dlq_config is not None else None
        self._dlq_producer: Any = None
        self._dlq_errors: deque[tuple[Any, str]] = deque()
        self._dlq_partitions: dict[str, int] = {}  # dead-letter topic -> partitions
        self._dlq_done: dict[TP, int] = {}  # source partition -> highest offset copied
        self._dlq_inflight: dict[TP, int] = {}  # source partition -> its copy not acknowledged
        self._topic_ids: dict[str, str | None] = {}  # source topic -> its id (``topic_id``)
        try:
            self._consumer = Consumer(config)
        except KafkaException as e:
            raise bad_setting(e, config) from e
        if self._dlq_config is not None:  # its mistakes now, not at the first bad record
            try:
                self._dlq_producer = self._dead_letter_producer()
            except ConfigError as e:
                self._consumer.close()
                raise ConfigError(f"dlq_config: {e}") from None
        self._paused: set[TP] = set()
        self._assigned_once = False
        self._callback_error: BaseException | None = None
        self._listeners: tuple[AssignCallback, RevokeCallback] | None = None  # see open()
        self._fatal: Any = None
        self._gone: tuple[float, Any] | None = None  # when a topic first looked deleted
        # A deletion seen while data still came (librdkafka's queue of what it
        # fetched before, or a passing hiccup): the brokers are asked again
        # once the data stops (``_still_gone``), at most every second.
        self._suspect: Any = None
        self._probed = 0.0
        # Since when consume() has given nothing: a topic deleted after its
        # last commit went through is asked about once the data stops, for
        # no commit is refused to say so (librdkafka's fetcher reports it
        # only after topic.metadata.propagation.max.ms, 30 s and more).
        self._idle_since: float | None = None

    def _on_error(self, err: Any) -> None:
        # librdkafka reports transient trouble here and keeps retrying; the
        # loader only stalls, so that is a warning. Errors no retry can mend
        # (bad credentials, no access, a deleted topic) end the stream.
        code = err.code()
        if err.fatal() or code in REFUSED:
            self._fatal = err
        elif code in GONE_CODES and self._gone is None:
            self._gone = (time.monotonic(), err)
        self._warn.log(logging.WARNING, "kafka: %s", err.str())

    def _still_gone(self, every: float = 1.0) -> str | None:
        """A topic the brokers know no more, if any (asked at most every ``every`` s)."""
        from confluent_kafka import KafkaException

        now = time.monotonic()
        if now - self._probed < every:
            return None
        self._probed = now
        for topic in self.topics:
            try:
                md = self._consumer.list_topics(topic, timeout=min(self.connect_timeout, 5.0))
            except KafkaException:
                return None  # brokers away: that is not a deletion
            found = md.topics.get(topic)
            if found is None or (found.error is not None and found.error.code() in GONE_CODES):
                return topic
        return None

    def _raise_fatal(self) -> None:
        err = self._fatal
        if err is not None:
            raise ConsumeError(f"{err.str()}", code=err.code())

    def _on_stats(self, text: str) -> None:
        import json

        try:
            topics = json.loads(text).get("topics", {})
            lag, ends = {}, {}
            for topic, t in topics.items():
                for part, p in t.get("partitions", {}).items():
                    if int(part) < 0:
                        continue
                    tp = (topic, int(part))
                    if p.get("consumer_lag", -1) >= 0:
                        lag[tp] = int(p["consumer_lag"])
                    # read_committed reads up to the last stable offset.
                    end = p.get("ls_offset", -1) if self._committed_only else -1
                    if end < 0:
                        end = p.get("hi_offset", -1)
                    if end >= 0:
                        ends[tp] = int(end)
            self._lag, self._ends = lag, ends
        except (ValueError, KeyError, TypeError):
            log.debug("unreadable librdkafka statistics", exc_info=True)

    def lag(self, positions: Mapping[TP, int],
            known_ends: Mapping[TP, int] | None = None) -> dict[TP, int]:
        """Messages from ``positions`` to each partition's end as the last statistics saw it.

        A partition with no position yet gets librdkafka's own
        ``consumer_lag`` (from the committed offset), when it has one.
        """
        out = dict(self._lag)
        # Before the first statistics (a second in): the ends librdkafka's
        # fetches saw, as consume() noted them, or those the caller knows.
        # Never a call to the consumer here: this runs on the caller's
        # thread, and the consumer's calls wait while consume() runs.
        ends = {**(known_ends or {}), **self._fetched_ends, **self._ends}
        for tp, end in ends.items():
            if tp in positions:
                out[tp] = max(0, end - positions[tp])
        return out

    def _tp(self, tp: TP, offset: int | None = None, metadata: str | None = None) -> Any:
        from confluent_kafka import TopicPartition

        if offset is None:
            return TopicPartition(tp[0], tp[1])
        if metadata is None:
            return TopicPartition(tp[0], tp[1], offset)
        return TopicPartition(tp[0], tp[1], offset, metadata)

    def partitions(self) -> list[TP]:
        result: list[TP] = []
        for topic in self.topics:
            # In short slices, so bad credentials (reported through error_cb)
            # fail at once instead of after connect_timeout.
            def ask(timeout: float, topic: str = topic) -> Any:
                # Serves error_cb (not yet subscribed: reads nothing). A group
                # the user may not use is said once, as an error event here,
                # not through error_cb: nothing would say it again.
                event = self._consumer.poll(0)
                if event is not None and event.error() is not None:
                    self._on_error(event.error())
                self._raise_fatal()
                if self.stopping is not None and self.stopping.is_set():
                    raise ConsumeError("closed while waiting for the brokers", topic=topic)
                return self._consumer.list_topics(topic, timeout=timeout)

            result.extend((topic, p) for p in wait_partitions(
                ask, topic, self._config["bootstrap.servers"], self.connect_timeout,
                ConsumeError, lambda e: self._raise_fatal()))
        return result

    def open(self, on_assign: AssignCallback, on_revoke: RevokeCallback,
             assignment: Sequence[TP] | None) -> None:
        self.partitions()  # fails fast, with a clear error, if brokers or topics are missing
        # The fetch stage's, for _on_assign and _on_revoke; close() lets go of them.
        self._listeners = (on_assign, on_revoke)

        if assignment is None:
            self.group_member = True
            revoked = weakly(self._on_revoke)
            self._consumer.subscribe(self.topics, on_assign=weakly(self._on_assign),
                                     on_revoke=revoked, on_lost=revoked)
            log.info("joined group %s (%s protocol)", self._config.get("group.id"), self.protocol)
        else:
            offsets = on_assign(list(assignment))
            self._consumer.assign([self._tp(tp, offsets[tp][0]) for tp in assignment])

    # The group's rebalance callbacks. An exception must not cross
    # librdkafka's callback boundary: keep it and raise it from consume(), on
    # the same thread.
    def _on_assign(self, consumer: Any, parts: list[Any]) -> None:
        if self._listeners is None:
            return
        try:
            tps = [(p.topic, p.partition) for p in parts]
            self._paused.difference_update(tps)  # on_assign pauses what it wants paused
            offsets = self._listeners[0](tps)
            # The start positions go in the assignment itself: a seek right
            # after an assign fails (librdkafka's fetcher is not started yet)
            # or is undone by a late offset lookup.
            start = [self._tp(tp, offsets[tp][0]) for tp in tps]
            if self.incremental:  # assign() would fail and leave nothing assigned
                consumer.incremental_assign(start)
            else:
                consumer.assign(start)
            # librdkafka keeps a partition's pause flag across an eager
            # rebalance: a partition paused at the end of an epoch and given
            # back with records to read again must fetch.
            consumer.resume([self._tp(tp) for tp in tps if tp not in self._paused])
            held = [self._tp(tp) for tp in tps if tp in self._paused]
            if held:
                consumer.pause(held)
        except BaseException as e:  # noqa: BLE001
            self._callback_error = e

    def _on_revoke(self, consumer: Any, parts: list[Any]) -> None:
        from confluent_kafka import KafkaException

        try:
            if self._listeners is not None:
                self._listeners[1]([(p.topic, p.partition) for p in parts])
        except BaseException as e:  # noqa: BLE001
            self._callback_error = e
        # Give the partitions up here, whatever happened above. Left to
        # confluent-kafka, it asks librdkafka for the rebalance protocol
        # first, and that call can block for ever when the revoke comes from
        # close() (librdkafka#4041), holding the GIL: every thread of the
        # trainer stops. Seen once in a cooperative member's close().
        try:
            if self.incremental:
                consumer.incremental_unassign(parts)
            else:
                consumer.unassign()
        except KafkaException as e:
            log.info("giving up %d partitions after a revoke: %s", len(parts), e)

    def watermarks(self, tp: TP, cached: bool = False) -> tuple[int, int]:
        from confluent_kafka import KafkaException

        # A leader that just died is still in the metadata until the controller
        # moves leadership: retry until connect_timeout instead of failing. So
        # is a partition unknown (a partition listed: metadata coming back
        # after every broker restarted, which failed loaders 20 s in).
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                marks = self._consumer.get_watermark_offsets(
                    self._tp(tp), timeout=self.connect_timeout, cached=cached
                )
                error = None if marks is not None else "timed out"
            except KafkaException as e:
                marks, error = None, e.args[0].str()
                # (confluent-kafka marks none of these retriable: a leader that
                # moves, NOT_LEADER_FOR_PARTITION, is asked again by its code)
                code = e.args[0].code()
                if not e.args[0].retriable() and code not in PASSING \
                        and code not in GONE_CODES and "destroyed" not in error:
                    break
            if marks is not None or cached or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        if marks is None:
            raise ConsumeError(f"cannot read watermarks: {error}", topic=tp[0], partition=tp[1])
        return marks

    def consume(self, max_messages: int, timeout: float) -> list[Any]:
        msgs = self._consumer.consume(max_messages, timeout)
        if msgs and not self._ends:
            self._note_ends(msgs)
        if self.protocol == "consumer" and not self._assigned_once:
            self._check_protocol(msgs)
        now = time.monotonic()
        if msgs:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        if self._gone is not None:
            if msgs:  # data still comes: a passing metadata hiccup, or what was fetched before
                self._suspect, self._gone = self._gone[1], None
            elif now - self._gone[0] >= GONE_GRACE_S:
                self._fatal = self._gone[1]
        elif self._suspect is not None and not msgs and self._still_gone():
            # The data stopped and the topic is still unknown: the grace runs
            # from now (else only librdkafka's next report, 30 s on, starts it).
            self._gone, self._suspect = (now, self._suspect), None
        elif self._idle_since is not None and now - self._idle_since >= IDLE_PROBE_S:
            gone = self._still_gone(every=IDLE_PROBE_S)
            if gone is not None:
                from confluent_kafka import KafkaError

                self._gone = (now, KafkaError(
                    KafkaError.UNKNOWN_TOPIC_OR_PART,
                    f"{gone}: unknown topic: the brokers no longer know it (was it deleted?)"))
        self._raise_fatal()
        if self._callback_error is not None:
            e, self._callback_error = self._callback_error, None
            raise e
        return msgs

    def _note_ends(self, msgs: list[Any]) -> None:
        """The ends of the partitions just read, as librdkafka's fetches saw them (no request)."""
        for tp in _fetch.partitions(msgs):
            try:
                _lo, hi = self._consumer.get_watermark_offsets(self._tp(tp), cached=True)
            except Exception:  # noqa: BLE001 - nothing cached yet
                continue
            if hi is not None and hi >= 0:
                self._fetched_ends[tp] = hi

    def _check_protocol(self, msgs: list[Any]) -> None:
        """Brokers without the consumer protocol refuse it: say so, and how to go on.

        They refuse the first ConsumerGroupHeartbeat, which librdkafka
        reports as a fatal error in a message of ``consume()`` (not through
        error_cb), leaving the consumer dead.
        """
        for m in msgs:
            err = m.error()
            if err is None:
                self._assigned_once = True
            elif err.code() == _LOCAL_FATAL:
                raise ConsumeError(
                    f"the brokers at {self._config['bootstrap.servers']} refused "
                    f"group.protocol=consumer ({err.str()}): it needs Kafka 4 brokers with "
                    f"the consumer protocol on; set group.protocol=classic", code=err.code())

    def pause(self, tps: Sequence[TP]) -> None:
        new = [tp for tp in tps if tp not in self._paused]
        if new:
            self._consumer.pause([self._tp(tp) for tp in new])
            self._paused.update(new)

    def resume(self, tps: Sequence[TP]) -> None:
        held = [tp for tp in tps if tp in self._paused]
        if held:
            self._consumer.resume([self._tp(tp) for tp in held])
            self._paused.difference_update(held)

    def seek(self, positions: Mapping[TP, Position]) -> None:
        from confluent_kafka import KafkaException

        for tp, (offset, _skip) in positions.items():
            try:
                self._consumer.seek(self._tp(tp, offset))
            except KafkaException as e:
                raise ConsumeError(f"cannot seek to offset {offset}: {e.args[0].str()}",
                                   topic=tp[0], partition=tp[1]) from e

    def committed(self, tps: Sequence[TP]) -> dict[TP, Committed | None]:
        from confluent_kafka import KafkaException

        try:
            parts = self._coordinated(lambda: self._consumer.committed(
                [self._tp(tp) for tp in tps], timeout=self.connect_timeout))
        except KafkaException as e:
            raise ConsumeError(f"cannot read committed offsets: {e.args[0].str()}") from e
        out: dict[TP, Committed | None] = {}
        for p in parts:
            ok = p.error is None and p.offset >= 0
            out[(p.topic, p.partition)] = _parse_metadata(p.offset, p.metadata) if ok else None
        return out

    def _coordinated(self, call: Callable[[], Any]) -> Any:
        """``call()``, retried while the group coordinator moves or loads (until connect_timeout).

        On a fresh cluster, or while a broker restarts, the coordinator of the
        group answers NOT_COORDINATOR or COORDINATOR_LOAD_IN_PROGRESS for a
        few seconds; librdkafka does not retry these for an explicit call.
        """
        from confluent_kafka import KafkaError, KafkaException

        moving = {KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                  KafkaError.COORDINATOR_NOT_AVAILABLE}
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                return call()
            except KafkaException as e:
                if e.args[0].code() not in moving or time.monotonic() >= deadline:
                    raise
                log.info("group coordinator not ready (%s): retrying", e.args[0].str())
                time.sleep(0.25)

    def offsets_for_time(self, tps: Sequence[TP], when: datetime) -> dict[TP, int]:
        ms = int(when.timestamp() * 1000)
        parts = self._consumer.offsets_for_times([self._tp(tp, ms) for tp in tps],
                                                 timeout=self.connect_timeout)
        out = {}
        for p in parts:
            tp = (p.topic, p.partition)
            # -1: no message at or after that time, so start at the end.
            out[tp] = p.offset if p.offset >= 0 else self.watermarks(tp)[1]
        return out

    def commit(self, positions: Mapping[TP, Position], asynchronous: bool) -> dict[TP, Position]:
        from confluent_kafka import KafkaError, KafkaException

        if not positions:
            return {}
        self.commits_sent += 1
        offsets = [self._tp(tp, pos[0], _metadata(tp, pos, self.lineage, self.run,
                                                 self._note_warned, self._note_limit))
                   for tp, pos in positions.items()]
        if asynchronous:
            # The answer comes to _on_commit, served by a later consume().
            for tp, pos in positions.items():
                self._inflight[(tp, pos[0])] = pos
        try:
            parts = self._coordinated(lambda: self._consumer.commit(offsets=offsets,
                                                                    asynchronous=asynchronous))
        except KafkaException as e:
            if self._refused_note(e.args[0]):  # the same commit, without notes
                return self.commit(positions, asynchronous)
            self.commit_failures += 1
            why = e.args[0].str()
            # A commit from outside a group that has members (the consumer protocol).
            if e.args[0].code() == KafkaError.UNKNOWN_MEMBER_ID and not self.group_member:
                why += (f"; this loader (assignment='static') is not a member of group "
                        f"{self._config.get('group.id')!r}, which has members, and such a group "
                        f"takes no commits from outside it: give the loader a group.id of its "
                        f"own, or read with assignment='group'")
            error = ConsumeError(f"offset commit failed: {why}")
            # The group moves on (the consumer protocol's member epoch, a
            # rebalance): the same commit goes through once the consumer has
            # been polled and has taken its new assignment.
            code = e.args[0].code()
            error.after_poll = code in _AFTER_POLL or (code == KafkaError.UNKNOWN_MEMBER_ID
                                                       and self.group_member)
            raise error from e
        if asynchronous:
            return {}
        acked, failed = {}, []
        for p in parts or ():
            tp = (p.topic, p.partition)
            if p.error is None and tp in positions:
                acked[tp] = positions[tp]
            elif p.error is not None:
                if self._refused_note(p.error):
                    return self.commit(positions, asynchronous)
                failed.append(f"{p.topic}[{p.partition}]: {p.error.str()}")
        if failed:
            self.commit_failures += len(failed)
            raise ConsumeError(f"offset commit failed for {', '.join(failed)}")
        return acked

    def _on_commit(self, err: Any, parts: list[Any]) -> None:
        # Runs inside consume() or close(), on the thread that calls them.
        # Records only; the loader takes the acknowledged positions when it
        # next commits (see acknowledged()).
        # (Held ``weakly``: what this raises is logged, never passed on.)
        for p in parts or ():
            tp = (p.topic, p.partition)
            pos = self._inflight.pop((tp, p.offset), None)
            refused = err or p.error
            if refused is None:
                if pos is not None:
                    self._acked.append((tp, pos))
                self._gone = self._suspect = None  # the coordinator knows the topic (again)
                continue
            # (Imported here, not above: a commit close() makes at the
            # interpreter's exit, when imports fail, is most often a success.)
            from confluent_kafka import KafkaError

            self._refused_note(refused)
            if refused.code() in (KafkaError._FATAL, KafkaError.FENCED_INSTANCE_ID) \
                    and self._fatal is None:
                self._fenced(refused)
            if refused.code() in GONE_CODES and self._gone is None:
                # The group's coordinator no longer knows the topic: deleted,
                # most likely. librdkafka's own fetcher says so only after
                # topic.metadata.propagation.max.ms (30 s); the grace in
                # consume() applies either way.
                self._gone = (time.monotonic(), KafkaError(
                    refused.code(), f"{p.topic} [{p.partition}]: a commit was refused: "
                    f"{refused.str()} (the topic was deleted?)"))
            self.commit_failures += 1
            self._warn.log(logging.WARNING, "offset commit failed for %s[%d]@%d: %s",
                           p.topic, p.partition, p.offset, refused)

    def _fenced(self, refused: Any) -> None:
        """A commit refused as fenced, or ``Local: Fatal error``: the consumer is over.

        NOTE [ A fenced member stops at once ]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A static member (``group.instance.id``) whose id another consumer
        took, a second process of the same member say, is fenced: librdkafka
        ends the consumer with a fatal error, which no error callback brings.
        Its commits are refused from then on, and its partitions are the new
        member's, but ``consume()`` still gave the messages fetched before
        (up to 64 MiB): the loader handed out batches for seconds, every one
        read again by the new member. The first commit refused so
        (``FENCED_INSTANCE_ID``, then ``_FATAL``) ends the
        stream: ``consume()`` raises, and the loader's ``next()`` does
        before it hands out another batch (``Source.ended``), dropping those
        it holds, which the group reads again.
        """
        from confluent_kafka import KafkaError

        who = self._config.get("group.instance.id")
        why = (f"another consumer took its group.instance.id {who!r} (a second process of "
               f"the same member?), which fences this one" if who else
               "librdkafka ended the consumer (its log says why)")
        self._fatal = KafkaError(KafkaError._FATAL, f"the consumer of group {self.group_id!r} "
                                 f"can no longer commit ({refused.str()}): {why}; its "
                                 f"partitions are read by the group from its last commit")
        self.ended = ConsumeError(self._fatal.str(), code=KafkaError._FATAL)

    def _refused_note(self, error: Any) -> bool:
        """A broker that keeps less metadata than Kafka's default: commit without notes.

        Whether this is the first such refusal (the commit is worth making
        again at once, without its notes).
        """
        if error.code() == _METADATA_TOO_LARGE and self._note_limit:
            self._note_limit = 0
            log.warning("the broker refused a commit's metadata as too long "
                        "(offset.metadata.max.bytes): commits go on without notes, so a "
                        "reader taking a partition over may use records again that a "
                        "shuffle used above the committed offset")
            return True
        return False

    def acknowledged(self) -> dict[TP, Position]:
        out: dict[TP, Position] = {}
        while self._acked:
            tp, pos = self._acked.popleft()
            if tp not in out or pos > out[tp]:
                out[tp] = pos
        return out

    def dead_letter(self, msg: Any, reason: str) -> bool:
        """Send a rejected value, untouched, to ``<topic>.dlq``, without waiting.

        The loader calls ``settle()`` before it commits or saves a position
        past this message, so a crash never loses a bad record.

        Each message is copied at most once, whichever group reads it (see
        NOTE [ One copy per bad message ]).
        """
        from confluent_kafka import KafkaException

        topic = f"{msg.topic()}.dlq"
        src = (msg.topic(), msg.partition())
        if self._dlq_errors:  # NOTE [ A failed copy stops the read ]
            raise self._failure()
        if self._dlq_producer is None:
            self._dlq_producer = self._dead_letter_producer()
        if topic not in self._dlq_partitions:
            self._dlq_partitions[topic] = self._ensure_topic(topic, msg.topic())
        part = msg.partition() % self._dlq_partitions[topic]
        if msg.topic() not in self._topic_ids:
            self._topic_ids[msg.topic()] = topic_id(self._client_config(), self.connect_timeout,
                                                    msg.topic())
        src_id = self._topic_ids[msg.topic()]
        done = self._dlq_done.get(src)
        if done is None:
            done = self._dlq_done[src] = dead_lettered_up_to(
                self._client_config(), self.connect_timeout, topic, part, src, src_id)
        if msg.offset() <= done:
            return False
        # The copy before, of the same source partition, is acknowledged first
        # (NOTE [ A failed copy stops the read ]).
        deadline = time.monotonic() + self.connect_timeout
        while True:
            if src not in self._dlq_inflight:
                # Set first: a settle() on the caller's thread may serve the
                # answer before produce() returns here.
                self._dlq_inflight[src] = msg.offset()
                try:
                    self._dlq_producer.produce(
                        topic, value=msg.value(), key=msg.key(),
                        headers=dead_letter_headers(msg, reason, src_id),
                        partition=part,
                        on_delivery=functools.partial(self._on_dead_letter, src, msg.offset()),
                    )
                    break
                except BufferError:  # its queue is full: wait for acknowledgements
                    del self._dlq_inflight[src]
                except KafkaException as e:  # refused here: too large, say
                    del self._dlq_inflight[src]
                    raise self._copy_failed(e.args[0], src, msg.offset(),
                                            len(msg.value() or b""), topic) from None
            if time.monotonic() > deadline:
                raise ConsumeError(f"the dead-letter topic {topic} acknowledged no copy within "
                                   f"{self.connect_timeout:g}s ({len(self._dlq_producer)} "
                                   f"waiting): its brokers do not answer", topic=topic)
            self._dlq_producer.poll(0.05)
            if self._dlq_errors:
                raise self._failure()
        self._dlq_producer.poll(0)
        # In offset order per source partition (one idempotent producer), so
        # the prefix rule of NOTE [ One copy per bad message ] holds once
        # the copies are acknowledged, which settle() waits for.
        self._dlq_done[src] = msg.offset()
        return True

    def _dead_letter_producer(self) -> Any:
        from confluent_kafka import KafkaException, Producer

        # Any record the source topic holds, past librdkafka's 1,000,000 (the
        # brokers' default is 1,048,588): the dead-letter topic's limit decides.
        conf = {"message.max.bytes": _DLQ_MESSAGE_MAX, **self._client_config()}
        conf.update({"acks": "all", "enable.idempotence": True, "logger": ConnectionLog()})
        try:
            return Producer(conf)
        except KafkaException as e:
            raise bad_setting(e, conf) from None

    # NOTE [ A failed copy stops the read ]
    #
    # A bad record whose dead-letter copy failed is in neither place: the
    # read must not be committed past it, and no later copy from its
    # partition may land, or the prefix rule of NOTE [ One copy per bad
    # message ] would count it copied for every reader to come. So a copy
    # is sent only once the one before it from the same source partition
    # is acknowledged (``_dlq_inflight``: the copies of different partitions
    # still overlap, and the loader's thread waits only for a partition's
    # second bad record within a round trip); the first failure ends the
    # read (``ended``: the loader's next() raises it before it hands out
    # another batch) and no copy is sent after it; settle() keeps failing,
    # so no commit passes it.

    def _on_dead_letter(self, src: TP, offset: int, err: Any, msg: Any) -> None:
        if self._dlq_inflight.get(src) == offset:
            del self._dlq_inflight[src]
        if err is not None:
            self._copy_failed(err, src, offset, len(msg.value() or b""), msg.topic())
        else:  # counted once the brokers have it: a refused copy is no copy
            self.dead_lettered += 1

    def _failure(self) -> ConsumeError:
        """The error a failed copy ended the read with, as a new instance: raised in
        several threads, one instance would gather all their tracebacks."""
        assert self.ended is not None
        return copy.copy(self.ended)

    def _copy_failed(self, err: Any, src: TP, offset: int, size: int, topic: str
                     ) -> ConsumeError:
        """The copy of bad record ``src``@``offset`` to ``topic`` failed: the read ends
        (NOTE [ A failed copy stops the read ]); the error it ends with."""
        from confluent_kafka import KafkaError

        self._dlq_errors.append((err, topic))
        if self.ended is not None:
            return self.ended
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
            fix = (f"with the headers naming its source it is larger than {topic} takes (a "
                   f"dead-letter topic made before with a smaller max.message.bytes, say, or a "
                   f"smaller message.max.bytes in dlq_config): raise the topic's "
                   f"max.message.bytes, or pass bad records over with on_bad_record='skip'")
        else:
            fix = (f"the read stops so that it is not committed past it: make {topic} take "
                   f"it, or pass bad records over with on_bad_record='skip'")
        self.ended = ConsumeError(
            f"could not copy the bad record at {src[0]}[{src[1]}]@{offset} ({size:,} bytes) to "
            f"the dead-letter topic {topic}: {err.str()}: {fix}",
            topic=src[0], partition=src[1], offset=offset, code=err.code())
        return self.ended

    def settle(self) -> None:
        left = 0
        if self._dlq_producer is not None and len(self._dlq_producer):
            left = self._dlq_producer.flush(self.connect_timeout)
        if self._dlq_errors:  # NOTE [ A failed copy stops the read ]
            raise self._failure()
        if left:
            raise ConsumeError(f"{left} copies of bad records were not acknowledged by the "
                               f"dead-letter topics ({', '.join(sorted(self._dlq_partitions))}) "
                               f"within {self.connect_timeout:g}s: their brokers do not answer")

    def _ensure_topic(self, topic: str, like: str) -> int:
        """Create dead-letter topic ``topic`` with as many partitions as ``like``; its count."""
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import NewTopic

        md = self._consumer.list_topics(timeout=self.connect_timeout)
        have = md.topics.get(topic)
        if have is not None and have.error is None and have.partitions:
            return len(have.partitions)
        source = md.topics.get(like)
        count = len(source.partitions) if source is not None and source.partitions else 1
        # It takes the source's largest record, and the headers a copy adds.
        largest = topic_setting(self._client_config(), like, "max.message.bytes")
        config = {"max.message.bytes": str(int(largest) + _DLQ_HEADROOM)} \
            if largest.isdigit() else {}
        admin = admin_client(self._client_config())
        futures = admin.create_topics([NewTopic(topic, num_partitions=count, config=config)],
                                      request_timeout=self.connect_timeout)
        try:
            futures[topic].result(self.connect_timeout)
        except KafkaException as e:
            if e.args[0].name() != "TOPIC_ALREADY_EXISTS":
                raise ConsumeError(f"cannot create dead-letter topic {topic}: {e.args[0].str()}",
                                   topic=topic) from e
        except concurrent.futures.TimeoutError as e:
            raise ConsumeError(f"cannot create dead-letter topic {topic}: no answer from "
                               f"{self._client_config().get('bootstrap.servers')} within "
                               f"{self.connect_timeout:g}s", topic=topic) from e
        deadline = time.monotonic() + self.connect_timeout
        while time.monotonic() < deadline:
            have = self._consumer.list_topics(topic, timeout=self.connect_timeout).topics.get(topic)
            if have is not None and have.error is None and have.partitions and \
                    all(p.leader >= 0 for p in have.partitions.values()):
                return len(have.partitions)
            time.sleep(0.1)
        raise ConsumeError(f"dead-letter topic {topic} has no leaders", topic=topic)

    def _client_config(self) -> dict[str, Any]:
        """The connection and security settings of the dead-letter producer, admin and reader.

        ``dlq_config`` when the loader was given one (a principal that may
        create and write the dead-letter topics), else the consumer's own.
        """
        if self._dlq_config is not None:
            return {**client_config(self._config), **self._dlq_config}
        return client_config(self._config)

    def close(self) -> None:
        if self._dlq_producer is not None:
            left = self._dlq_producer.flush(self.connect_timeout)
            if left or self._dlq_errors:
                log.error("%d bad record(s) not written to the dead-letter topic",
                          left + len(self._dlq_errors))
            self._dlq_producer = None
        if self.group_member:
            self._leave_group()
        self._consumer.close()
        self._listeners = None

    def _leave_group(self) -> None:
        """Give the partitions up before close(), serving their revoke here.

        A revoke served inside librdkafka's close can hang for ever in the
        unassign it must make, a cooperative one most of all when a
        rebalance is under way (librdkafka#4527, #4884; seen in a member's
        close while another joined). Unsubscribed first, with the revoke
        served by consume(), close has nothing left to give up. Bounded: after
        the wait close() goes on as before.
        """
        from confluent_kafka import KafkaException

        deadline = time.monotonic() + min(self.connect_timeout, 10.0)
        try:
            self._consumer.unsubscribe()
            while self._consumer.assignment() and time.monotonic() < deadline:
                self._consumer.consume(1, 0.1)  # (a closing loader reads nothing more)
        except (KafkaException, RuntimeError) as e:
            log.info("leaving the group before close: %s", e)


class _EndEvent:
    """``MemorySource``'s end-of-partition event: a message whose error is librdkafka's
    ``_PARTITION_EOF``, at the offset after the partition's last record."""

    def __init__(self, tp: TP, offset: int) -> None:
        from confluent_kafka import KafkaError

        self._tp, self._offset = tp, offset
        self._error = KafkaError(KafkaError._PARTITION_EOF)

    def error(self) -> Any:
        return self._error

    def topic(self) -> str:
        return self._tp[0]

    def partition(self) -> int:
        return self._tp[1]

    def offset(self) -> int:
        return self._offset

    def value(self) -> None:
        return None


class MemorySource(Source):
    """Replays recorded message values as if they came from Kafka.

    ``values`` is a list of values for partition 0, ``{partition: values}``,
    or, for several topics (a ``kfeed.Mix``), ``{(topic, partition): values}``.
    With ``loop=True`` the recording repeats forever (offsets keep growing),
    which suits a streaming benchmark. Rejected values are kept in
    ``dead_letters``; commits are recorded in ``commits``.

    ``rebalance()`` scripts a group's rebalances, played inside ``consume()``
    as librdkafka plays them, so the loader's rebalance logic can be tested
    step by step, without a broker; ``incremental=True`` plays them as
    cooperative-sticky and the consumer protocol do (a revoke takes some
    partitions, the others keep their read position). ``first`` is the
    group's first assignment (default: every partition; partitions, or
    ``(topic, partition)`` for several topics). ``most``: at most
    this many messages a ``consume()`` call returns, as a broker's fetch size
    bounds what librdkafka holds (default: as many as asked for), so that a
    script plays while the partitions are being read. ``eof=True``: a
    partition read to its end gives an end-of-partition event, once per
    reaching it, as librdkafka's ``enable.partition.eof`` does; ``append()``
    writes more records while it is read.
    """

    def __init__(self, values: Sequence[Any] | Mapping[int, Sequence[Any]], *,
                 topic: str = "memory", loop: bool = False, incremental: bool = False,
                 first: Sequence[int | TP] | None = None, most: int | None = None,
                 eof: bool = False) -> None:
        if most is not None and (not isinstance(most, int) or most < 1):
            raise ConfigError(f"most must be an int >= 1 or None, got {most!r}")
        self.most = most
        if not isinstance(values, Mapping):
            values = {0: values}
        self.topic = topic
        self.loop = loop
        now = int(time.time() * 1000)
        by_tp = {(k if isinstance(k, tuple) else (topic, k)): vals for k, vals in values.items()}
        self._data = {
            (t, p): [Record(t, p, i, v, now) for i, v in enumerate(vals)]
            for (t, p), vals in sorted(by_tp.items())
        }
        self._next: dict[TP, int] = {}
        self._paused: set[TP] = set()
        self.eof = eof
        self._eof_at: dict[TP, int] = {}  # where each partition's last end event was
        self.commits: list[dict[TP, Position]] = []
        self.committed_positions: dict[TP, Position] = {}
        self.committed_by: dict[TP, tuple[str | None, str | None]] = {}  # (lineage, run)
        self.committed_notes: dict[TP, str | None] = {}  # Committed.rest
        self._note_warned: set[TP] = set()
        self.dead_letters: list[tuple[Any, str]] = []
        self.incremental = incremental
        self._first = None if first is None else [
            p if isinstance(p, tuple) else (topic, p) for p in first]
        self.calls = 0  # consume() calls so far
        self._script: list[tuple[int, list[TP], list[TP]]] = []
        self._callbacks: tuple[AssignCallback, RevokeCallback] | None = None

    def partitions(self) -> list[TP]:
        return list(self._data)

    def rebalance(self, at_call: int, *, revoke: Sequence[int] = (),
                  assign: Sequence[int] = ()) -> None:
        """Inside the ``at_call``-th ``consume()``: revoke partitions, then assign partitions.

        Eager (the default): a revoke takes every partition and an assign
        gives the whole new assignment. Incremental: each names the
        partitions that change.
        """
        self._script.append((at_call, [(self.topic, p) for p in revoke],
                             [(self.topic, p) for p in assign]))

    def open(self, on_assign: AssignCallback, on_revoke: RevokeCallback,
             assignment: Sequence[TP] | None) -> None:
        tps = list(assignment) if assignment is not None else self._first or self.partitions()
        self._callbacks = (on_assign, on_revoke)
        self._paused.clear()  # opened again (the next epoch): nothing is paused
        offsets = on_assign(tps)
        self._next = {tp: offsets[tp][0] for tp in tps}
        self._eof_at.clear()

    def _play(self) -> None:
        assert self._callbacks is not None
        on_assign, on_revoke = self._callbacks
        for at, revoke, assign in [x for x in self._script if x[0] == self.calls]:
            if revoke:
                on_revoke(revoke)
                for tp in revoke:
                    self._next.pop(tp, None)
                    self._eof_at.pop(tp, None)
            if assign:
                self._paused.difference_update(assign)
                offsets = on_assign(assign)
                self._next.update({tp: offsets[tp][0] for tp in assign})
                for tp in assign:
                    self._eof_at.pop(tp, None)

    def watermarks(self, tp: TP, cached: bool = False) -> tuple[int, int]:
        if self.loop:
            return (0, max(self._next.get(tp, 0), len(self._data[tp])))
        return (0, len(self._data[tp]))

    def consume(self, max_messages: int, timeout: float) -> list[Any]:
        self.calls += 1
        if self._script:
            self._play()
        if self.most is not None:
            max_messages = min(max_messages, self.most)
        out: list[Any] = []
        live = [tp for tp in self._next if tp not in self._paused]
        # Interleave partitions in runs, as a broker's fetches would.
        run = max(1, max_messages // max(1, len(live)))
        for tp in live:
            recs, i = self._data[tp], self._next[tp]
            n = len(recs)
            take = min(run, max_messages - len(out))
            if self.loop and n:
                for j in range(i, i + take):
                    r = recs[j % n]
                    out.append(r if j < n else Record(tp[0], tp[1], j, r._value, r._ts))
                self._next[tp] = i + take
            else:
                out.extend(recs[i:i + take])
                self._next[tp] = min(n, i + take)
                if self.eof and self._next[tp] == n and self._eof_at.get(tp) != n:
                    self._eof_at[tp] = n
                    out.append(_EndEvent(tp, n))
        if not out and timeout > 0:
            time.sleep(min(timeout, 0.01))
        return out

    def pause(self, tps: Sequence[TP]) -> None:
        self._paused.update(tps)

    def resume(self, tps: Sequence[TP]) -> None:
        self._paused.difference_update(tps)

    def lag(self, positions: Mapping[TP, int],
            known_ends: Mapping[TP, int] | None = None) -> dict[TP, int]:
        return {tp: max(0, self.watermarks(tp)[1] - positions.get(tp, nxt))
                for tp, nxt in self._next.items()}

    def seek(self, positions: Mapping[TP, Position]) -> None:
        for tp, (offset, _skip) in positions.items():
            self._next[tp] = offset
            self._eof_at.pop(tp, None)

    def append(self, partition: int | TP, values: Sequence[Any]) -> None:
        """Write ``values`` at the end of ``partition`` (a producer's, while it is read)."""
        tp = partition if isinstance(partition, tuple) else (self.topic, partition)
        recs = self._data[tp]
        first, now = len(recs), int(time.time() * 1000)
        recs.extend([Record(tp[0], tp[1], first + i, v, now) for i, v in enumerate(values)])

    def committed(self, tps: Sequence[TP]) -> dict[TP, Committed | None]:
        out: dict[TP, Committed | None] = {}
        for tp in tps:
            pos = self.committed_positions.get(tp)
            out[tp] = None if pos is None else Committed(
                *pos, *self.committed_by.get(tp, (None, None)), self.committed_notes.get(tp))
        return out

    def offsets_for_time(self, tps: Sequence[TP], when: datetime) -> dict[TP, int]:
        ms = int(when.timestamp() * 1000)
        return {tp: next((r.offset() for r in self._data[tp] if r._ts >= ms), len(self._data[tp]))
                for tp in tps}

    def commit(self, positions: Mapping[TP, Position], asynchronous: bool) -> dict[TP, Position]:
        if positions:
            self.commits_sent += 1
            self.commits.append(dict(positions))
            for tp, pos in positions.items():
                self.committed_positions[tp] = (pos[0], pos[1])
                # As Kafka keeps it: the metadata, the note left out if too long.
                meta = _metadata(tp, pos, self.lineage, self.run, self._note_warned)
                self.committed_notes[tp] = _parse_metadata(pos[0], meta).rest
            self.committed_by.update(dict.fromkeys(positions, (self.lineage, self.run)))
        return dict(positions)

    def dead_letter(self, msg: Any, reason: str) -> bool:
        self.dead_letters.append((msg, reason))
        self.dead_lettered += 1
        return True

    def close(self) -> None:
        self._callbacks = None  # the fetch stage's: a reference cycle otherwise
