"""Producer: columns of samples -> Kafka messages, never silently dropped.

The producer half of the data flow. ``send`` checks the columns against the
schema, picks each keyed sample's partition with the Java-compatible
partitioner, packs each partition's samples into block messages (or one raw
message per sample) with the Cython encoder, and hands them to a
confluent-kafka producer set up for durability (acks=all, idempotence). A
full local queue makes ``send`` wait, not fail; a failed delivery makes
``flush`` raise, and so does any error librdkafka will not get past, as a
``ProduceError`` with its Kafka code (NOTE [ Callbacks never raise ]).
A transactional producer's ``close`` returns once what it committed is
readable (NOTE [ A commit is readable a moment later ]).
Token documents (a schema with a variable-length field) are sent the same
way, keyed one partition per document.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kfeed import metrics
from kfeed._kafka import (
    REFUSED,
    ConnectionLog,
    admin_client,
    bad_setting,
    chain,
    check_topic_name,
    client_config,
    kafka_error,
    topic_setting,
    wait_partitions,
)
from kfeed.badrecords import FINGERPRINT_HEADER, SCHEMA_HEADER, schema_header
from kfeed.errors import ConfigError, ProduceError
from kfeed.formats import RecordFormat, resolve
from kfeed.mix import as_int
from kfeed.partition import partitions_for
from kfeed.schema import Format, Schema

__all__ = ["Producer", "PRODUCER_DEFAULTS"]

log = logging.getLogger(__name__)

@atexit.register
def _lost_at_exit() -> None:
    # A message waiting for delivery keeps its producer alive (its delivery
    # callback holds it): one never closed is still published at exit
    # (metrics.LIVE), where librdkafka drops what it still queues.
    for producer in [o for o in list(metrics.LIVE) if isinstance(o, Producer)]:
        with contextlib.suppress(Exception):  # (at exit, anything may be half gone)
            left = 0 if producer._closed else len(producer._producer)
            if left:
                log.warning("the process exits with %d message(s) to %s not delivered, now "
                            "lost: close() the Producer (or use `with`) before it ends",
                            left, producer.topic)

# Durable by default; batching tuned for block messages of ~200 KB. The user's
# dict overrides any key.
PRODUCER_DEFAULTS: dict[str, Any] = {
    "acks": "all",
    "enable.idempotence": True,
    "linger.ms": 5,
    "batch.size": 1_000_000,
    "queue.buffering.max.kbytes": 262144,
    # What a broker takes by default (its message.max.bytes, 1048588): blocks
    # are sized below it. Larger ones need the topic's max.message.bytes raised.
    "message.max.bytes": 1_000_000,
}

_COMPRESSION = ("none", "gzip", "snappy", "lz4", "zstd")

# Records a block message holds, unless block_records says otherwise (fewer
# where 64 would not fit in message.max.bytes).
_BLOCK_RECORDS = 64

# A send() of fixed-shape rows encodes this much at a time (see send).
_CHUNK_BYTES = 64 << 20
_CHUNK_KEYS = 1 << 16  # integer keys made bytes at a time (a chunk of rows at most this)

# How long close() waits for the commit markers of the transactions this
# producer committed (NOTE [ A commit is readable a moment later ]).
_READABLE_WAIT_S = 10.0

# librdkafka's codes for a message purged from its queues before delivery
# (RD_KAFKA_RESP_ERR__PURGE_QUEUE, __PURGE_INFLIGHT), as an abort does.
_PURGED = (-152, -151)
_INVALID_RECORD = 87  # the brokers would not validate a record (a compacted topic's unkeyed one)
_TOO_LARGE = 10  # MESSAGE_TOO_LARGE: a batch of messages over the topic's max.message.bytes
_STATE = -172  # "Erroneous state": a transaction a failed delivery left only to abort
_INTERRUPT_FLUSH_S = 2.0  # an interrupted `with Producer` waits this long for deliveries

Partitioner = Callable[[Any, int], int]


def default_compression(schema: Schema) -> str:
    """The codec kfeed picks when neither ``compression`` nor the Kafka dict names one.

    From bench/RESULTS.md ("Compression"): lz4 shrinks integer data such as
    token ids by about 1.4x and the loader reads it at the uncompressed rate;
    on float features no codec saves more than a few percent while each
    costs the producer up to half its rate (zstd also slows the loader 2-3x).
    So: lz4 when every field is an integer, none when any is floating point.
    """
    if all(np.dtype(f.storage).kind in "iu" and f.dtype != "bfloat16" for f in schema.fields):
        return "lz4"
    return "none"


class Producer:
    """Sends columns of samples to ``topic`` as block or raw messages, JSON objects or Avro records.

    ``format``: ``"block"`` (default), ``"raw"`` (one record a message) or
    ``kfeed.Json()`` (one JSON object a message, for consumers other than
    kfeed; ``Loader(format=kfeed.Json())`` reads it back), or
    ``kfeed.Avro(registry=...)`` (Avro in the Confluent wire format, the
    schema ``kfeed.avro.writer_schema(schema)`` registered under
    ``<topic>-value`` when the producer is made).

    ``block_records``: records a block (or Arrow) message holds; by default
    64, or fewer where 64 would pass ``message.max.bytes`` (1,000,000 by
    default, what a broker takes unless its topic's ``max.message.bytes`` is
    raised). Messages without a key are dealt to the partitions in turn.

    >>> with Producer({"bootstrap.servers": "127.0.0.1:39092"}, "train", schema) as p:
    ...     p.send({"features": x, "label": y, "id": ids}, keys=ids.astype(str))
    """

    def __init__(
        self,
        kafka_config: Mapping[str, Any],
        topic: str,
        schema: Schema,
        *,
        format: str | Format | RecordFormat = "block",
        block_records: int | None = None,
        compression: str | None = None,
        transactional_id: str | None = None,
        partitioner: str | Partitioner = "murmur2",
        connect_timeout_s: float = 30.0,
    ) -> None:
        from confluent_kafka import KafkaException
        from confluent_kafka import Producer as _Producer

        if not isinstance(kafka_config, Mapping) or "bootstrap.servers" not in kafka_config:
            raise ConfigError("kafka_config must be a dict of librdkafka settings "
                              "with 'bootstrap.servers'")
        check_topic_name(topic)
        if not isinstance(schema, Schema):
            raise ConfigError("schema must be a kfeed.Schema")
        chosen = block_records is None  # 64, or as many as a message holds
        if chosen:
            block_records = _BLOCK_RECORDS
        if isinstance(block_records, (bool, np.bool_)) or not isinstance(
                block_records, (int, np.integer)) or not 1 <= block_records <= 0xFFFFFFFF:
            raise ConfigError(f"block_records must be None or an int in 1..{0xFFFFFFFF}, got "
                              f"{block_records!r}")
        block_records = int(block_records)
        if compression is not None and compression not in _COMPRESSION:
            raise ConfigError(f"compression must be one of {_COMPRESSION}, got {compression!r}")
        if partitioner != "murmur2" and not callable(partitioner):
            raise ConfigError("partitioner must be 'murmur2' or a callable (key, n) -> partition")
        self.topic = topic
        self.schema = schema
        self.format = resolve(format)
        # Arrow: several samples a message, as blocks. The others but blocks: one
        # sample a message, with its key (raw, JSON, Avro, Protobuf).
        self._batched = isinstance(self.format, RecordFormat) and self.format.batches
        self._one_a_message = self.format is not Format.BLOCK and not self._batched
        # Formats others read (JSON, Avro): made, checked and (Avro) registered now.
        self._encoder = (self.format.encoder(schema, topic)
                         if isinstance(self.format, RecordFormat) else None)
        self.block_records = block_records
        self.partitioner = partitioner
        config = {**PRODUCER_DEFAULTS, **kafka_config}
        if compression is None and not {"compression.type", "compression.codec"} & set(kafka_config):
            compression = default_compression(schema)
        if compression is not None:
            config["compression.type"] = compression
        if transactional_id is not None:
            config["transactional.id"] = transactional_id
        self._message_max = message_max_bytes(config)
        self._batch_size = config.get("batch.size")  # (as given: read in _refused)
        self._block_bytes = value_max_bytes(self._message_max)
        limit = f"message.max.bytes={config['message.max.bytes']} less 1024 for the headers"
        raise_it = "raise message.max.bytes (and the topic's max.message.bytes)"
        fixed = schema.varlen is None
        fit = record_fits(schema, config, self.format)
        if fixed and self._batched:
            assert self._encoder is not None
            one = self._encoder.message_bytes(0)
            if one > self._block_bytes:
                raise ConfigError(f"a record is {one:,} bytes as an Arrow message, over {limit}: "
                                  f"{raise_it}")
        block_bytes = schema.block_nbytes(block_records)
        if self.format is Format.BLOCK and block_bytes > self._block_bytes:
            if not fixed:
                raise ConfigError(f"a block of {block_records} records is {block_bytes} bytes, "
                                  f"over {limit}: lower block_records or {raise_it}")
            if not chosen:
                raise ConfigError(f"a block of {block_records} records is {block_bytes} bytes, "
                                  f"over {limit}: lower block_records to {fit} or fewer (or "
                                  f"leave it out), or {raise_it}")
            block_records = self.block_records = fit
        self._warn = ConnectionLog(log)
        self._fatal: Any = None
        # (monotonic time, text) of the last error librdkafka said, for
        # progress lines that stall while the brokers are gone.
        self.last_error: tuple[float, str] | None = None
        self.polled_at = 0.0  # (monotonic) the last poll or flush: delivery reports run in them
        self._closed = False
        # Delivery failures since flush last took them: how many, and the first
        # (each one kept grew by a report a message over a long send that failed).
        # Set by _on_delivery, which runs inside this thread's poll or flush,
        # without a lock (NOTE [ Callbacks never raise ]).
        self._failed_n = 0
        self._first_failure: Any = None
        config["error_cb"] = chain(self._on_error, config.get("error_cb"))
        # (Its connection lines at DEBUG: _on_error warns of the same trouble.)
        config.setdefault("logger", ConnectionLog(trouble_level=logging.DEBUG))
        self._servers = str(config["bootstrap.servers"])
        self._client = client_config(config)
        # Transactional: the offset after each partition's last delivered
        # message (the topic's, or a copy's topic), and, once committed,
        # those close() waits to be readable.
        self._written: dict[tuple[str, int], int] = {}
        self._unstable: dict[tuple[str, int], int] = {}
        try:
            self._producer = _Producer(config)
        except KafkaException as e:
            raise bad_setting(e, config) from e
        self._timeout = connect_timeout_s
        self.num_partitions = self._partition_count()
        # Partitions added to the topic later are found as librdkafka finds
        # them, at most this long after (keyed placement then follows them).
        self._recount_s = int(config.get("topic.metadata.refresh.interval.ms", 300_000)) / 1000
        self._counted_at = time.monotonic()
        self._turn = -1  # the partition the last message without one was dealt to
        # The schema travels with each message (~60 bytes), so that a loader
        # with another schema can say what the topic holds.
        self._headers = [
            (FINGERPRINT_HEADER, schema.fingerprint.to_bytes(8, "little")),
            (SCHEMA_HEADER, schema_header(schema)),
            ("kfeed.format", self.format.value.encode()),
        ]
        self.samples = 0
        self.messages = 0
        self.bytes = 0
        self.copies = 0  # consumed messages sent on to other topics (``copy``)
        self.acked_bytes = 0  # of the topic's messages, acknowledged by the brokers
        self._mark = (0, 0)  # (samples, bytes) sent, at the end of the last chunk
        self.delivery_failures = 0
        self.purged = 0  # messages an aborted transaction threw away before delivery
        self._transactional = transactional_id is not None
        self._in_transaction = False
        if self._transactional:
            try:
                self._sliced(self._producer.init_transactions, self._timeout)
            except (KafkaException, SystemError) as e:
                raise self._error("cannot start transactions", e) from e
        metrics.register(self)

    def _partition_count(self) -> int:
        def ask(timeout: float) -> Any:
            self._poll(0)
            self._raise_fatal()
            return self._producer.list_topics(self.topic, timeout=timeout)

        def fatal(e: BaseException) -> None:
            err = kafka_error(e)
            if err is not None and err.fatal():
                raise self._error("the producer cannot go on", e) from e
            self._raise_fatal()

        return len(wait_partitions(ask, self.topic, self._servers, self._timeout, ProduceError,
                                   fatal))

    def _recount_partitions(self) -> None:
        """Take up partitions added to the topic since they were last counted.

        Keys are placed here, not by librdkafka, so the count must follow the
        topic's as librdkafka's would. A broker that does not answer at once
        leaves the count as it was: the next interval asks again.
        """
        from confluent_kafka import KafkaException

        now = time.monotonic()
        if not 0 <= self._recount_s <= now - self._counted_at:
            return
        self._counted_at = now
        try:
            md = self._producer.list_topics(self.topic, timeout=1.0)
        except (KafkaException, SystemError):
            return
        found = md.topics.get(self.topic)
        if found is not None and found.error is None and len(found.partitions) > self.num_partitions:
            log.info("%s: %d partitions, %d before", self.topic, len(found.partitions),
                     self.num_partitions)
            self.num_partitions = len(found.partitions)

    def _check_open(self) -> None:
        """Refuse to send once closed (or after a fatal error)."""
        if self._closed:
            raise ProduceError("the producer is closed: what is sent now would never be "
                               "delivered; send before close(), or make a new producer",
                               topic=self.topic)
        self._raise_fatal()

    def _raise_fatal(self) -> None:
        err = self._fatal
        if err is not None:
            why = _WHY_FENCED if err.code() in _FENCED else ""
            raise ProduceError(f"the producer cannot go on: {err.str()}{why}", topic=self.topic,
                               code=err.code())

    def _error(self, what: str, exc: BaseException) -> ProduceError:
        """``exc``, raised by a confluent-kafka call, as a ProduceError with its Kafka code.

        A fatal error is kept, so that every later call raises it at once.
        """
        err = kafka_error(exc)
        if err is None and isinstance(exc, SystemError) and "without setting an exception" \
                in str(exc):
            # A KeyboardInterrupt raised inside confluent-kafka's flush comes out
            # so: what it stopped was delivered, or is still queued.
            raise KeyboardInterrupt(f"{what}: interrupted") from exc
        if err is None:
            return ProduceError(f"{what}: {exc!r}", topic=self.topic)
        if err.code() == _LOCAL_FATAL and not err.fatal():
            # produce() refuses with a bare "Local: Fatal error"; the error
            # itself waits in librdkafka's queue, for the next poll.
            err = self._fatal or self._serve_fatal() or err
        if err.fatal() and self._fatal is None:
            self._fatal = err
        if err.code() == _STATE and self._transactional and self._failed_delivery():
            # A delivery failed, and the transaction can only be aborted: that
            # failure is what went wrong, not the state it left.
            first = self._first_failure
            return ProduceError(f"{what}: a message was not delivered, and the transaction "
                                f"can only be aborted: {first.str()}{self._refused(first)}",
                                topic=self.topic, code=first.code())
        why = _WHY_FENCED if err.code() in _FENCED else ""
        return ProduceError(f"{what}: {err.str()}{why}", topic=self.topic, code=err.code())

    def _failed_delivery(self, seconds: float = 2.0) -> bool:
        """Whether a delivery failed, its report served within ``seconds`` if need be (a
        transaction fails before the reports of its failed messages come)."""
        from confluent_kafka import KafkaException

        deadline = time.monotonic() + seconds
        while not self._failed_n and time.monotonic() < deadline:
            try:
                self._poll(_SLICE_S)
            except (KafkaException, SystemError):
                break  # (a fatal error: the caller's own is raised)
        return bool(self._failed_n)

    def _serve_fatal(self, seconds: float = 2.0) -> Any | None:
        """Poll until confluent-kafka raises the fatal error librdkafka holds; give it."""
        from confluent_kafka import KafkaException

        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                self._poll(_SLICE_S)
            except (KafkaException, SystemError) as e:
                err = kafka_error(e)
                if err is not None and err.fatal():
                    return err
        return None

    # -- sending --------------------------------------------------------------

    def send(self, columns: Mapping[str, Any], keys: Sequence[Any] | None = None, *,
             partition: int | None = None) -> int:
        """Send N samples (columns with a shared first dimension); returns N.

        ``columns`` maps field names to arrays, or is a ``pyarrow.Table`` or
        ``RecordBatch`` whose columns ``kfeed.arrowformat`` reads as the
        loader reads Arrow messages. With a variable-length field, its column is a list of 1-D arrays (one
        document per sample) or ``(flat, lengths)``, as ``Schema.encode_blocks``
        takes it; keys then give one partition per document. ``partition``
        sends them all to that partition instead (keys, if any, still go with
        raw and JSON messages).

        ``keys``: one a sample, each ``bytes``, ``str`` (sent as UTF-8) or an
        int (sent as its decimal digits, ``str(k)``). A sample goes to the
        partition that Kafka's default partitioner picks for its key's bytes
        (murmur2, as the Java producer), or the ``partitioner``'s.
        """
        self._check_open()
        self._recount_partitions()
        if _is_arrow(columns):
            from kfeed.arrowformat import table_columns

            columns = table_columns(self.schema, columns)
        if self.schema.varlen is not None:
            _views, offsets, n, _owners = self.schema._doc_columns(columns)
            if self.format is Format.BLOCK:
                self._check_documents(np.diff(offsets), "a block",
                                      lambda k: self.schema.block_nbytes(1, k))
            elif self._batched:
                assert self._encoder is not None
                self._check_documents(np.diff(offsets), "an Arrow message",
                                      self._encoder.message_bytes)
        else:
            # Checked, and sent a chunk at a time from these arrays: a strided
            # column is copied a chunk at a time, a list made an array once.
            columns, n = self.schema._checked_columns(columns, None)
        if partition is not None:
            part = as_int(partition)
            if part is None or not 0 <= part < self.num_partitions:
                raise ConfigError(f"partition must be an int in 0..{self.num_partitions - 1} "
                                  f"({self.topic} has {self.num_partitions}), got {partition!r}")
            partition = part
        # Integer keys (an array) are all good: made bytes and placed a chunk at a
        # time, so a keyed send holds no more than an unkeyed one.
        int_keys = isinstance(keys, np.ndarray) and keys.ndim == 1 and \
            keys.dtype.kind in "iu" and self.partitioner == "murmur2"
        if keys is not None:
            keys = keys if int_keys else list(keys)
            if len(keys) != n:
                raise ConfigError(f"{len(keys)} keys for {n} samples")
        if n == 0:
            return 0
        # Every other key is checked (and placed) before anything is sent: a
        # bad one never leaves part of the call sent.
        key_bytes = parts = None
        if keys is not None and not int_keys:
            key_bytes = [_key_bytes(k) for k in keys]
            if partition is None:
                parts = self._partitions(keys, key_bytes)
        # Fixed-shape rows go in chunks of about _CHUNK_BYTES, so that what
        # one call holds encoded stays bounded however large its columns (a
        # memory-mapped file, say), as librdkafka's queue bounds the rest.
        step = n
        if self.schema.varlen is None:
            per_chunk = _CHUNK_BYTES // max(1, self.schema.record_size)
            if int_keys:  # and their bytes, about 40 a key
                per_chunk = min(per_chunk, _CHUNK_KEYS)
            step = max(self.block_records, per_chunk - per_chunk % self.block_records)
        for a in range(0, n, step):
            b = min(n, a + step)
            cols = columns if step >= n else {name: _rows(columns[name], a, b)
                                              for name in self.schema.names}
            if int_keys:
                chunk = keys[a:b].tolist()
                chunk_bytes = [_key_bytes(k) for k in chunk]
                chunk_parts = None if partition is not None else self._partitions(chunk,
                                                                                  chunk_bytes)
            else:
                chunk_bytes = None if key_bytes is None else key_bytes[a:b]
                chunk_parts = None if parts is None else parts[a:b]
            self._send_rows(cols, chunk_parts, chunk_bytes, partition, a)
            self.samples += b - a
            self._mark = (self.samples, self.bytes)  # one assignment: read whole by any thread
        return n

    @property
    def max_value_bytes(self) -> int:
        """The bytes a message's value may hold (message.max.bytes less 1024 for headers)."""
        return self._block_bytes

    def too_large(self, lengths: np.ndarray) -> np.ndarray:
        """Which documents (of ``lengths`` elements) no block message holds (a mask)."""
        lengths = np.asarray(lengths, np.int64)
        over = least_over(lengths, self._block_bytes, lambda k: self.schema.block_nbytes(1, k))
        return lengths >= over if over is not None else np.zeros(len(lengths), bool)

    def _check_documents(self, lengths: np.ndarray, what: str,
                         size_of: Callable[[int], int]) -> None:
        """Refuse, before any is sent, a call with a document larger than a message
        (``size_of(elements)``: the bytes of ``what``, one document alone)."""
        i = too_large(lengths, self._block_bytes, size_of)
        if i is not None:
            raise ConfigError(
                f"document {i} of this send() has {int(lengths[i]):,} elements "
                f"({size_of(int(lengths[i])):,} bytes as {what}), more "
                f"than a message holds (message.max.bytes less 1024 for the headers, "
                f"{self._block_bytes:,}): split it, or raise message.max.bytes (and the "
                f"topic's max.message.bytes); nothing of this call was sent")

    def acknowledged(self) -> tuple[float, int]:
        """Samples and bytes the brokers acknowledged so far (for progress lines).

        Samples are counted a chunk at a time and bytes a message at a time:
        the samples are the acknowledged share of the bytes up to the last
        whole chunk sent, so the count never runs ahead of the brokers, and
        never goes back.
        """
        samples, nbytes = self._mark
        acked = self.acked_bytes
        return (min(samples, samples * acked / nbytes) if nbytes else 0.0), acked

    def _send_rows(self, columns: Mapping[str, Any], parts: np.ndarray | None,
                   keys: list[bytes] | None, partition: int | None, first: int) -> None:
        """Rows to ``partition`` (or dealt in turn), or each to its key's in ``parts``:
        all made messages, and checked, before any is sent. ``first``: the index of
        the first row in the call to send()."""
        if parts is None:
            groups = [(columns, partition, keys, None)]
        else:
            assert keys is not None
            order = np.argsort(parts, kind="stable")
            bounds = np.flatnonzero(np.diff(parts[order])) + 1
            variable = self.schema.varlen.name if self.schema.varlen is not None else None
            groups = [({name: (_take_documents(columns[name], idx) if name == variable
                               else _take(columns[name], idx))
                        for name in self.schema.names}, int(parts[idx[0]]),
                       [keys[i] for i in idx], idx)
                      for idx in np.split(order, bounds)]
        made = [(self._messages(cols), part, ks, idx) for cols, part, ks, idx in groups]
        # librdkafka counts the key, the headers and their framing in a message's
        # size too: a value just under message.max.bytes failed inside the loop
        # below. (With kfeed's 3 headers, 79 bytes, and a 1-byte key, it took
        # values of 1,378 bytes at most under message.max.bytes=1500.)
        room = self._message_max - 64 - sum(len(name) + len(v) for name, v in self._headers)
        for values, _part, ks, idx in made:
            if not self._one_a_message or max(map(len, values), default=0) + (
                    max(map(len, ks), default=0) if ks is not None else 0) <= room:
                continue  # (blocks and Arrow messages are made to fit)
            sizes = [len(v) + (len(ks[i]) if ks is not None else 0) for i, v in enumerate(values)]
            big = next((i for i, n in enumerate(sizes) if n > room), None)
            if big is None:
                continue
            row = first + (big if idx is None else int(idx[big]))
            raise ConfigError(
                f"sample {row} of this send() is {sizes[big]:,} bytes as a message (its key "
                f"counted), more than message.max.bytes ({self._message_max:,}) less its "
                f"headers and framing ({self._message_max - room:,}) holds: raise it (and the "
                f"topic's max.message.bytes); " + (f"samples 0 to {first - 1} were sent"
                                                    if first else "nothing of this call was sent"))
        for values, part, ks, _idx in made:
            for i, v in enumerate(values):
                if ks is None or not self._one_a_message:  # (blocks go without keys)
                    self._produce(v, None, self._dealt(part))
                else:  # (bytes already: send() made them so)
                    self._produce(v, ks[i], part)

    def _partitions(self, keys: list[Any], key_bytes: list[bytes]) -> np.ndarray:
        if self.partitioner == "murmur2":
            return partitions_for(key_bytes, self.num_partitions)
        parts = np.fromiter((self.partitioner(k, self.num_partitions) for k in keys),
                            dtype=np.int64, count=len(keys))
        if parts.size and (parts.min() < 0 or parts.max() >= self.num_partitions):
            raise ConfigError(f"the partitioner returned a partition outside "
                              f"0..{self.num_partitions - 1}")
        return parts

    def _messages(self, columns: Mapping[str, Any]) -> list[bytes]:
        """The message values of rows ``columns``, in the producer's format."""
        if self.format is Format.BLOCK:
            if self.schema.varlen is None:
                return self.schema.encode_blocks(columns, self.block_records)
            # Documents vary in size: close a block before it outgrows a message.
            return self.schema.encode_blocks(columns, self.block_records,
                                             block_bytes=self._block_bytes)
        if self._batched:
            assert self._encoder is not None
            return self._encoder.encode_blocks(columns, self.block_records, self._block_bytes)
        return (self._encoder.encode(columns) if self._encoder is not None
                else self.schema.encode_raw(columns))

    def _dealt(self, partition: int | None) -> int:
        """``partition``, or for a message without one the next partition in turn.

        librdkafka's sticky partitioner would put every message of a send(),
        all made within a few ms, on one partition: the ranks and group
        members reading the others would get none of them.
        """
        if partition is not None:
            return partition
        self._turn = (self._turn + 1) % self.num_partitions
        return self._turn

    def copy(self, msg: Any, topic: str, partition: int, headers: list[tuple[str, bytes]]) -> None:
        """Send a consumed message's value and key, unchanged, to ``topic`` (a dead-letter copy).

        Inside ``transaction()`` the copy is committed with everything else.
        """
        self._check_open()
        self._produce(msg.value(), msg.key(), partition, topic=topic, headers=headers)

    def _produce(self, value: bytes, key: bytes | None, partition: int | None, *,
                 topic: str | None = None, headers: list[tuple[str, bytes]] | None = None) -> None:
        from confluent_kafka import KafkaException

        if self._transactional and not self._in_transaction:
            raise ConfigError("a transactional producer sends only inside "
                              "`with producer.transaction():`")

        kwargs: dict[str, Any] = {} if partition is None else {"partition": partition}
        try:
            while True:
                try:
                    self._producer.produce(topic or self.topic, value, key,
                                           headers=self._headers if headers is None else headers,
                                           on_delivery=self._on_delivery, **kwargs)
                    break
                except BufferError:
                    # The local queue is full: wait for deliveries instead of
                    # dropping or failing (backpressure).
                    self._poll(_SLICE_S)
                    self._raise_fatal()
            if topic is None:  # (a dead-letter copy is not the topic's: ``copies``)
                self.messages += 1
                self.bytes += len(value or b"")
            else:
                self.copies += 1
            self._poll(0)
        except (KafkaException, SystemError) as e:
            raise self._error("cannot send", e) from e

    def _on_error(self, err: Any) -> None:
        # See NOTE [ Callbacks never raise ]. An error librdkafka will not get
        # past (bad credentials, no access) is kept and raised by send/flush.
        if err.fatal() or err.code() in REFUSED:
            self._fatal = err
        self.last_error = (time.monotonic(), err.str())
        self._warn.log(logging.WARNING, "kafka: %s", err.str())

    def _on_delivery(self, err: Any, msg: Any) -> None:
        # See NOTE [ Callbacks never raise ]: record, never lock, never raise.
        if err is not None and self._transactional and err.code() in _PURGED:
            # Thrown away by an abort (nothing else purges a transactional
            # producer's queue; a fatal error is raised on its own): the
            # transaction that sent it has failed already, the next one has not.
            self.purged += 1
        elif err is not None:
            if self._first_failure is None:
                self._first_failure = err
            self._failed_n += 1
            self.delivery_failures += 1
        else:
            if msg.topic() == self.topic:
                self.acked_bytes += len(msg)
            if self._transactional:
                self._written[(msg.topic(), msg.partition())] = msg.offset() + 1

    def _poll(self, timeout: float) -> None:
        """librdkafka's poll, noting when: acknowledgements arrive only while it runs."""
        self._producer.poll(timeout)
        self.polled_at = time.monotonic()

    def stats(self) -> dict[str, int]:
        """Samples, messages and bytes sent, delivery failures, and messages not acknowledged yet."""
        return {"samples": self.samples, "messages": self.messages, "bytes": self.bytes,
                "delivery_failures": self.delivery_failures, "queued": len(self._producer)}

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every message to be acknowledged; raise if any failed."""
        from confluent_kafka import KafkaException

        self._raise_fatal()
        try:
            left = self._flush(timeout)
        except (KafkaException, SystemError) as e:
            raise self._error(f"{len(self._producer)} message(s) not delivered", e) from e
        self._raise_fatal()
        self._raise_failures(left)

    def _flush(self, timeout: float | None) -> int:
        """librdkafka's flush, in slices of _SLICE_S; the messages still queued."""
        # See NOTE [ Callbacks never raise ] for why the slices are short.
        deadline = None if timeout is None else time.monotonic() + timeout
        left = len(self._producer)
        while left and self._fatal is None:
            slice_s = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
            if slice_s <= 0:
                break
            left = self._producer.flush(slice_s)
            self.polled_at = time.monotonic()
        return left

    def _take_failures(self) -> tuple[int, Any]:
        """The delivery failures waiting, taken: how many, and the first (or None)."""
        failed, first = self._failed_n, self._first_failure
        self._failed_n, self._first_failure = 0, None
        return failed, first

    @staticmethod
    def _undelivered(failed: int, left: int, first: Any, to: str = "") -> str:
        return (f"{failed} message(s){to} not delivered" + (f", {left} still queued" if left
                                                            else "")
                + (f"; first error: {first.str()}" if first is not None else ""))

    def _settle_failures(self, when: str, left: int = 0) -> None:
        """Log (not raise) the failures waiting, and forget them: another error is raised."""
        failed, first = self._take_failures()
        if failed or left:
            log.error("%s: %s", when, self._undelivered(failed, left, first, f" to {self.topic}"))

    def _raise_failures(self, left: int = 0) -> None:
        failed, first = self._take_failures()
        if left and not failed:  # a flush(timeout) ran out: nothing failed
            raise ProduceError(f"flush timed out with {left} message(s) still queued, none "
                               f"failed: they are still being delivered, and flush() again "
                               f"waits for them (sending them again would repeat them)",
                               topic=self.topic)
        if failed or left:
            raise ProduceError(self._undelivered(failed, left, first) + self._refused(first),
                               topic=self.topic, code=first.code() if first is not None else None)

    def _refused(self, first: Any) -> str:
        """Why the brokers refused a record they would not validate, or a batch too large,
        where kfeed can tell."""
        if first is not None and first.code() == _TOO_LARGE:
            try:  # (librdkafka took it, 0x... too)
                batch = min(int(str(self._batch_size), 0), self._message_max)
            except ValueError:
                return ""
            limit = topic_setting(self._client, self.topic, "max.message.bytes")
            if not limit.isdigit() or int(limit) >= batch:
                return ""
            return (f": {self.topic} takes batches of messages of max.message.bytes="
                    f"{int(limit):,} bytes at most (its brokers check a batch whole), and this "
                    f"producer batches up to batch.size={batch:,}: set batch.size "
                    f"and message.max.bytes to {int(limit):,} or less (-X batch.size=... -X "
                    f"message.max.bytes=...), or raise the topic's max.message.bytes")
        if first is None or first.code() != _INVALID_RECORD:
            return ""
        if "compact" not in topic_setting(self._client, self.topic, "cleanup.policy"):
            return ""
        if self.format is Format.BLOCK:
            sent, how = ("a block of records has none", "send one record a message with its "
                         "key (format='raw', keys=...; kfeed produce --format raw --keyed)")
        else:
            sent, how = ("these were sent without one",
                         "send every message with a key (keys=...; kfeed produce --keyed)")
        return (f": {self.topic} is compacted (cleanup.policy=compact), which takes only "
                f"messages with a key; {sent}: write to a topic that is not compacted, "
                f"or {how}")

    # -- transactions ---------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Producer]:
        """Everything sent inside is committed together, or aborted on an exception."""
        from confluent_kafka import KafkaException

        if not self._transactional:
            raise ConfigError("transaction() needs a transactional_id")
        if self._in_transaction:
            raise ConfigError("transactions do not nest: send inside the open "
                              "`with producer.transaction():`")
        self._check_open()
        try:
            self._producer.begin_transaction()
        except (KafkaException, SystemError) as e:
            raise self._error("cannot begin a transaction", e) from e
        self._in_transaction = True
        try:
            yield self
            self.flush()
            try:
                self._sliced(self._producer.commit_transaction, self._timeout)
            except (KafkaException, SystemError) as e:
                raise self._error("cannot commit the transaction", e) from e
            self._unstable.update(self._written)
            self._written.clear()
            self._in_transaction = False
        except BaseException as exc:
            self._written.clear()
            self._in_transaction = False
            if self._fatal is None:
                # The exception that ends the transaction is the one raised:
                # an abort that fails (even fatally: the brokers then abort it
                # when it times out) is kept and logged, never raised over it.
                # An interrupt waits a moment only, and says nothing of it: the
                # brokers abort what it leaves open, and its messages go with it.
                interrupt = isinstance(exc, KeyboardInterrupt)
                try:
                    if not interrupt:
                        self._settle_partitions()
                    self._sliced(self._producer.abort_transaction,
                                 _INTERRUPT_FLUSH_S if interrupt else self._timeout)
                    # The aborted messages' reports are in now: their failures
                    # are this transaction's, not the next one's.
                    self._poll(0)
                except (KafkaException, SystemError) as e:
                    if not interrupt:
                        log.error("%s", self._error("abort_transaction failed", e))
                if interrupt:
                    self._take_failures()
                else:
                    self._settle_failures("in the aborted transaction")
            raise

    def _settle_partitions(self) -> None:
        """Before an abort: deliver what the transaction sent, for ``_ABORT_SETTLE_S`` at
        most, so that its partitions are registered with it.

        Right after a commit the coordinator still writes that transaction's
        markers (PrepareCommit), and answers the next one's AddPartitionsToTxn
        with CONCURRENT_TRANSACTIONS; librdkafka asks again after its back-off,
        but sends an abort's EndTxn at once, which the coordinator, still in
        PrepareCommit, refuses as INVALID_TXN_STATE: fatal, the producer lost
        (2 aborts in 40, each right after a commit, on a loaded machine). A
        message delivered was written inside the transaction: its partition
        is registered by then.
        """
        self._flush(min(self._timeout, _ABORT_SETTLE_S))

    def _sliced(self, call: Callable[..., Any], timeout: float, *args: Any) -> Any:
        """A transactional call of librdkafka's (init, commit, abort, send_offsets),
        ``call(*args, slice)``, made in slices of ``_SLICE_S`` (``_on_thread``)
        until ``timeout``: a signal is raised between two, not after the whole
        ``timeout`` (85 s for a SIGTERM with the brokers gone). A call that times
        out is resumed by the next one with the same arguments; one that failed
        with a retriable error is made again."""
        from confluent_kafka import KafkaError, KafkaException

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return self._on_thread(call, args, max(0.01, min(_SLICE_S, left)), deadline,
                                       timeout)
            except KafkaException as e:
                # A retriable error is asked again until the timeout: a slice
                # that timed out (the call resumes), or a coordinator still
                # busy with the transaction before (CONCURRENT_TRANSACTIONS,
                # which a cluster under load gave send_offsets_to_transaction
                # right after the previous commit).
                err = kafka_error(e)
                if err is None or not err.retriable() or err.fatal() or \
                        err.txn_requires_abort() or left <= _SLICE_S:
                    raise
                if err.code() != KafkaError._TIMED_OUT:
                    time.sleep(_SLICE_S)

    def _on_thread(self, call: Callable[..., Any], args: tuple[Any, ...], slice_s: float,
                   deadline: float, timeout: float) -> Any:
        """``call(*args, slice_s)`` on a thread of its own, waited for in steps of ``_SLICE_S``.

        librdkafka's send_offsets_to_transaction can block past the timeout it is
        given (a transaction coordinator lost in a broker's restart held it for
        ten minutes, a SIGTERM with it): a signal is raised here at once, and a
        call still running ``_STUCK_S`` after ``deadline`` (the end of the
        ``timeout`` the caller gave), or after an interrupt, is left to the
        process's exit, the producer with it: every later call raises that, as
        a fatal error does (the brokers abort its transaction at the
        transaction's timeout; the next run of the job fences it).
        """
        from confluent_kafka import KafkaException

        done, out = threading.Event(), []

        def run() -> None:
            try:
                out.append((True, call(*args, slice_s)))
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                out.append((False, e))
            finally:
                done.set()

        threading.Thread(target=run, name="kfeed-transaction", daemon=True).start()
        until = max(time.monotonic() + slice_s, deadline) + _STUCK_S
        try:
            while not done.wait(_SLICE_S):
                if time.monotonic() >= until:
                    break
        except BaseException:
            # An interrupt: a call within its slice ends in a moment, and the
            # abort that follows is then not refused as a conflicting call.
            if not done.wait(2 * _SLICE_S):
                self._stuck(call, timeout)
            raise
        if not done.is_set():
            self._stuck(call, timeout)
            assert self._fatal is not None
            raise KafkaException(self._fatal)
        ok, value = out[0]
        if not ok:
            raise value
        return value

    def _stuck(self, call: Callable[..., Any], timeout: float) -> None:
        """``call`` did not return: the producer cannot go on (see ``_on_thread``)."""
        from confluent_kafka import KafkaError

        name = getattr(call, "__name__", "a transactional call")
        if self._fatal is None:
            self._fatal = KafkaError(
                KafkaError._TIMED_OUT, f"librdkafka's {name} did not return within its "
                f"{timeout:g}s (its transaction coordinator went away, with a broker that "
                f"restarted, say): the brokers abort the open transaction at its timeout",
                fatal=True)

    def send_offsets(self, consumer: Any, offsets: Sequence[Any]) -> None:
        """Inside ``transaction()``: commit ``consumer``'s ``offsets`` with it.

        ``offsets`` are confluent-kafka ``TopicPartition``s, each the next
        offset to read. They count only if the transaction commits
        (consume-transform-produce: exactly once).
        """
        from confluent_kafka import KafkaException

        if not self._transactional:
            raise ConfigError("send_offsets() needs a transactional_id")
        if not self._in_transaction:
            raise ConfigError("send_offsets() commits offsets with a transaction: call it "
                              "inside `with producer.transaction():`")
        metadata, offsets = consumer.consumer_group_metadata(), list(offsets)
        try:
            self._sliced(self._producer.send_offsets_to_transaction, self._timeout, offsets,
                         metadata)
        except (KafkaException, SystemError) as e:
            raise self._error("cannot send the offsets with the transaction", e) from e

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Deliver everything sent; a transactional producer also waits until
        read_committed consumers can read what it committed. What it raises (a
        failure to deliver) is the last word on the messages it names: the exit
        does not say them again."""
        try:
            self.flush()
            self._await_readable()
        except KeyboardInterrupt as e:
            # Closed all the same, so the exit says nothing more: say it here.
            failed, first = self._take_failures()
            self._note_left(e, len(self._producer), failed, first, "when interrupted")
            raise
        finally:
            self._closed = True
            metrics.LIVE.discard(self)  # no longer published, as a closed loader is not

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        from confluent_kafka import KafkaException

        if exc_type is None:
            self.close()
            return
        self._closed = True  # (what was not delivered is said here, not again at exit)
        metrics.LIVE.discard(self)  # as close() does
        if self._fatal is None:
            # Still deliver what was sent; the original exception wins, and
            # what was not delivered is said, never dropped in silence. An
            # interrupt waits a moment only (brokers that went away would hold
            # it for the whole timeout), and what it left is said with it.
            interrupt = isinstance(exc, KeyboardInterrupt)
            if interrupt and self._transactional:
                # Sent inside transactions only: the one the interrupt left open
                # is aborted (by transaction(), or by the brokers at its timeout),
                # its messages with it. A flush would only fail on its state.
                return
            try:
                left = self._flush(_INTERRUPT_FLUSH_S if interrupt else self._timeout)
            except (KafkaException, SystemError) as e:
                log.error("flush after %s failed: %s", exc_type.__name__, e)
                return
            if not interrupt:
                self._settle_failures(f"after {exc_type.__name__}", left)
                return
            failed, first = self._take_failures()
            self._note_left(exc, left, failed, first,
                            f"{_INTERRUPT_FLUSH_S:g}s after the interrupt")

    def _note_left(self, exc: BaseException, left: int, failed: int, first: Any,
                   when: str) -> None:
        """Notes on ``exc``: the messages not acknowledged ``when``, and those that failed."""
        if left:
            exc.add_note(f"{left:,} message(s) to {self.topic} not acknowledged {when}: "
                         f"they may be missing from the topic")
        if failed:
            exc.add_note(f"{failed:,} message(s) to {self.topic} not delivered: "
                         f"{first.str()}")

    def _await_readable(self) -> None:
        """Wait (at most _READABLE_WAIT_S) until the transactions committed are readable."""
        if not self._unstable:
            return
        from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        waiting, self._unstable = self._unstable, {}
        admin = admin_client({**self._client, "bootstrap.servers": self._brokers()})
        wait_s = min(self._timeout, _READABLE_WAIT_S)
        deadline = time.monotonic() + wait_s
        failed = None  # why the last question had no answer
        while True:
            try:
                stable = admin.list_offsets(
                    {TopicPartition(t, p): OffsetSpec.latest() for t, p in waiting},
                    isolation_level=IsolationLevel.READ_COMMITTED,
                    request_timeout=max(0.5, deadline - time.monotonic()))
                for tp, future in stable.items():
                    if future.result().offset >= waiting[(tp.topic, tp.partition)]:
                        del waiting[(tp.topic, tp.partition)]
                failed = None
            except KafkaException as e:  # a leader moving: asked again below
                failed = e.args[0].str() if e.args and hasattr(e.args[0], "str") else str(e)
                log.debug("cannot read the stable offsets of %s: %s", self.topic, e)
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if waiting:
            why = (f"the brokers did not say where they stand ({failed})" if failed else
                   "another producer's open transaction holds them back")
            log.warning("the last transaction is committed, but %s are not readable yet "
                        "after %.0fs (%s): a loader started now may stop before it",
                        ", ".join(f"{t}[{p}]" for t, p in sorted(waiting)), wait_s, why)

    def _brokers(self) -> str:
        """Every broker the producer knows, as bootstrap servers: an admin client made
        from the bootstrap list alone finds no one when those brokers went away."""
        try:
            md = self._producer.list_topics(timeout=1.0)
            found = ",".join(f"{b.host}:{b.port}" for b in md.brokers.values())
        except Exception:  # noqa: BLE001 - the bootstrap list, then
            found = ""
        return found or self._servers


# NOTE [ A commit is readable a moment later ]
#
# Kafka answers commit_transaction once the transaction coordinator has
# decided the commit; it then writes a commit marker into each partition the
# transaction wrote, and only the marker moves the partition's last stable
# offset, up to which read_committed consumers read. For a few milliseconds
# after the commit the records are durable but not readable, and a bounded
# loader (until="end") started in that gap takes the older stable offset as
# its end: it ends without them, though the producer (or `kfeed produce
# --from`) has already returned. So close() waits until each partition's
# stable offset has passed the last message this producer committed there.
# Another producer's transaction left open on the partition holds the stable
# offset back for as long as it stays open; close() stops waiting after
# _READABLE_WAIT_S and says so.


# NOTE [ Callbacks never raise ]
#
# confluent-kafka runs error_cb and on_delivery inside poll() and flush(), on
# the calling thread. When librdkafka raises a fatal error (an idempotent
# producer refused IdempotentWrite, a fenced transactional id) confluent-kafka
# does not call error_cb: it sets a KafkaException on the thread and stops
# librdkafka's dispatch. But a poll() or flush() of 200 ms or more runs in
# 200 ms chunks, and it starts the next chunk anyway: the delivery reports
# of the purged messages are then served with that exception still set, and
# the first C call in a Python callback fails with SystemError. A callback
# that had just taken a lock never released it, and the next one waited for
# it forever:
#
#   flush(0.5) ─ chunk 1 ─> error_cb(_FATAL) ─> KafkaException set, yield
#              └ chunk 2 ─> on_delivery ─> lock.acquire() ok ─> SystemError
#              └ chunk 3 ─> on_delivery ─> lock.acquire() blocks forever
#
# So:
# - every poll and flush runs in slices of _SLICE_S, under one chunk, so a
#   fatal error ends the call and reaches the caller as a KafkaException;
# - the callbacks take no lock and only record (counts), and error_cb (through
#   _kafka.chain, as the loader's consumer callbacks) keeps its own exceptions
#   and a user callback's from escaping into librdkafka's dispatch;
# - every confluent-kafka call is wrapped: a KafkaException, or a SystemError
#   it caused, becomes a ProduceError with the Kafka error's code, and a fatal
#   error is kept, so that later calls raise it at once instead of waiting.

# Under confluent-kafka's 200 ms chunk, so that each call runs librdkafka's
# dispatch once (see NOTE [ Callbacks never raise ]).
_SLICE_S = 0.1
# The most an abort waits for the transaction's messages to be delivered first
# (Producer._settle_partitions).
_ABORT_SETTLE_S = 5.0
# A transactional call that has not returned this long after its caller's
# timeout will not (see Producer._on_thread).
_STUCK_S = 1.0
# librdkafka's ERR__FATAL: what produce() says once a fatal error was raised.
_LOCAL_FATAL = -150
# A transactional producer fenced (_FENCED, PRODUCER_FENCED, INVALID_PRODUCER_EPOCH),
# and why that happens, which librdkafka's "fenced by newer producer instance" hides.
_FENCED = (-144, 90, 47)
_WHY_FENCED = (" (the brokers fence a transactional producer when another one of the same "
               "transactional.id starts, a second run of the same job, or when a transaction "
               "outlives transaction.timeout.ms)")


def _key_bytes(key: Any) -> bytes:
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, (int, np.integer)):
        return str(int(key)).encode()
    raise ConfigError(f"keys must be bytes, str or int, got {type(key).__name__}")


def _is_arrow(columns: Any) -> bool:
    """Whether ``columns`` is a pyarrow Table or RecordBatch (without importing pyarrow)."""
    return type(columns).__module__.startswith("pyarrow") and hasattr(columns, "num_rows")


def _rows(column: Any, a: int, b: int) -> Any:
    """Rows ``a:b`` of a fixed-shape column: a view where the column allows one."""
    if type(column).__module__.startswith("torch"):
        return column[a:b]
    return np.asarray(column)[a:b]


def _take(column: Any, idx: np.ndarray) -> Any:
    if type(column).__module__.startswith("torch"):
        import torch

        return column[torch.from_numpy(idx)]
    return np.asarray(column)[idx]


def _take_documents(column: Any, idx: np.ndarray) -> Any:
    """Documents ``idx`` of a variable-length column: a list of arrays, or ``(flat, lengths)``."""
    if not isinstance(column, tuple):
        # A list (or other sequence) of 1-D arrays; Schema checked its shape.
        return [column[int(i)] for i in idx]
    flat, lengths = column
    if type(lengths).__module__.startswith("torch"):
        lengths = lengths.numpy()
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    take_lengths = lengths[idx]
    # Element positions of the chosen documents, in order, without a loop
    # per document: each run starts at its document's start.
    run_starts = np.zeros(len(idx), np.int64)
    np.cumsum(take_lengths[:-1], out=run_starts[1:])
    positions = (np.arange(int(take_lengths.sum()), dtype=np.int64)
                 + np.repeat(starts[idx] - run_starts, take_lengths))
    return _take(flat, positions), take_lengths


def too_large(lengths: Sequence[int] | np.ndarray, limit: int,
              size_of: Callable[[int], int]) -> int | None:
    """The first document (of ``lengths`` elements each) whose message alone, of
    ``size_of(elements)`` bytes, is over ``limit``, or None: a document larger than a
    message, which no message holds. ``size_of`` grows with the elements: the least
    length over the limit is found by bisection, in a few calls."""
    lengths = np.asarray(lengths, np.int64)
    over = least_over(lengths, limit, size_of)
    return None if over is None else int(np.argmax(lengths >= over))


def least_over(lengths: np.ndarray, limit: int, size_of: Callable[[int], int]) -> int | None:
    """The least length whose message, of ``size_of(length)`` bytes, is over ``limit``, if
    one of ``lengths`` reaches it (else None): every document as long or longer is too
    large. By bisection, ``size_of`` growing with the length."""
    if not lengths.size or size_of(int(lengths.max())) <= limit:
        return None
    fits, over = -1, int(lengths.max())
    while over - fits > 1:
        mid = (fits + over) // 2
        if size_of(mid) > limit:
            over = mid
        else:
            fits = mid
    return over


def record_fits(schema: Schema, kafka_config: Mapping[str, Any],
                format: str | Format | RecordFormat = "block") -> int:
    """The most records of ``schema`` a ``format`` message holds under ``kafka_config``'s
    message.max.bytes (kfeed's blocks and raw records of fixed shapes; 0 for others,
    whose sizes vary); a ConfigError where not one does. It asks no broker: a command
    calls it before it makes a topic for the records."""
    if schema.varlen is not None or format not in (Format.BLOCK, Format.RAW):
        return 0  # (a name or a Format: "avro" needs no registry asked here)
    fmt = Format(format)
    message_max = message_max_bytes({**PRODUCER_DEFAULTS, **kafka_config})
    block_bytes = value_max_bytes(message_max)
    # (a raw message holds one)
    fit = (_most_records(schema, block_bytes) if fmt is Format.BLOCK
           else int(schema.record_size <= block_bytes))
    if fit < 1:
        raise ConfigError(f"a record of {schema.record_size} bytes is over message.max.bytes="
                          f"{message_max} less 1024 for the headers: raise message.max.bytes "
                          f"(and the topic's max.message.bytes)")
    return fit


def message_max_bytes(config: Mapping[str, Any]) -> int:
    """``message.max.bytes`` as librdkafka reads it (``0x...`` too)."""
    value = config["message.max.bytes"]
    try:
        return int(str(value), 0)
    except ValueError:
        raise ConfigError(f"message.max.bytes must be a whole number of bytes, got "
                          f"{value!r}") from None


def value_max_bytes(message_max: int) -> int:
    """The bytes a message's value may hold: room kept for the key, the headers and
    the record's framing."""
    return max(40, message_max - 1024)


def _most_records(schema: Schema, limit: int) -> int:
    """The most records of ``schema`` (fixed shapes) a block of at most ``limit`` bytes holds.

    Each column is padded to 8 bytes, so a record's share of a block is not
    one number (records under 8 bytes add nothing to some counts): the
    largest count that fits, by bisection.
    """
    lo, hi = 0, limit // max(1, schema.record_size) + 1  # block_nbytes(hi) > limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if schema.block_nbytes(mid) <= limit:
            lo = mid
        else:
            hi = mid
    return lo
