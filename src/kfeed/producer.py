"""Producer: columns of samples -> Kafka messages, never silently dropped.

The producer half of the data flow. ``send`` checks the columns against the
schema, picks each keyed sample's partition with the Java-compatible
partitioner, packs each partition's samples into block messages (or one raw
message per sample) with the Cython encoder, and hands them to a
confluent-kafka producer set up for durability (acks=all, idempotence). A
full local queue makes ``send`` wait, not fail; a failed delivery makes
``flush`` raise.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kfeed.errors import ConfigError, ProduceError
from kfeed.partition import partitions_for
from kfeed.schema import Format, Schema

__all__ = ["Producer", "PRODUCER_DEFAULTS"]

log = logging.getLogger(__name__)

# Durable by default; batching tuned for block messages of ~200 KB. The user's
# dict overrides any key.
PRODUCER_DEFAULTS: dict[str, Any] = {
    "acks": "all",
    "enable.idempotence": True,
    "linger.ms": 5,
    "batch.size": 1 << 20,
    "queue.buffering.max.kbytes": 262144,
    "message.max.bytes": 8 << 20,
}

_COMPRESSION = ("none", "gzip", "snappy", "lz4", "zstd")

Partitioner = Callable[[Any, int], int]


class Producer:
    """Sends columns of samples to ``topic`` as block or raw messages.

    >>> with Producer({"bootstrap.servers": "127.0.0.1:39092"}, "train", schema) as p:
    ...     p.send({"features": x, "label": y, "id": ids}, keys=ids.astype(str))
    """

    def __init__(
        self,
        kafka_config: Mapping[str, Any],
        topic: str,
        schema: Schema,
        *,
        format: str | Format = "block",
        block_records: int = 64,
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
        if not isinstance(topic, str) or not topic:
            raise ConfigError(f"topic must be a non-empty string, got {topic!r}")
        if not isinstance(schema, Schema):
            raise ConfigError("schema must be a kfeed.Schema")
        if not isinstance(block_records, int) or not 1 <= block_records <= 0xFFFFFFFF:
            raise ConfigError(f"block_records must be a positive int, got {block_records!r}")
        if compression is not None and compression not in _COMPRESSION:
            raise ConfigError(f"compression must be one of {_COMPRESSION}, got {compression!r}")
        if partitioner != "murmur2" and not callable(partitioner):
            raise ConfigError("partitioner must be 'murmur2' or a callable (key, n) -> partition")
        self.topic = topic
        self.schema = schema
        self.format = Format.parse(format)
        self.block_records = block_records
        self.partitioner = partitioner
        config = {**PRODUCER_DEFAULTS, **kafka_config}
        if compression is not None:
            config["compression.type"] = compression
        if transactional_id is not None:
            config["transactional.id"] = transactional_id
        block_bytes = schema.block_nbytes(block_records)
        if self.format is Format.BLOCK and block_bytes > int(config["message.max.bytes"]):
            raise ConfigError(
                f"a block of {block_records} records is {block_bytes} bytes, over "
                f"message.max.bytes={config['message.max.bytes']}; lower block_records")
        user_error_cb = config.get("error_cb")

        def error_cb(err: Any) -> None:
            # A fatal error (no access, fenced, bad credentials) is kept and
            # raised by send/flush: librdkafka will not recover from it.
            if err.fatal() or err.code() in (-169, -181, 29, 31, 53):
                self._fatal = err
            log.warning("kafka: %s", err)
            if user_error_cb is not None:
                user_error_cb(err)

        self._fatal: Any = None
        config["error_cb"] = error_cb
        config.setdefault("logger", logging.getLogger("kfeed.librdkafka"))
        try:
            self._producer = _Producer(config)
        except KafkaException as e:
            raise ConfigError(f"bad kafka_config: {e.args[0].str()}") from e
        self._timeout = connect_timeout_s
        self.num_partitions = self._partition_count()
        self._headers = [
            ("kfeed.fingerprint", schema.fingerprint.to_bytes(8, "little")),
            ("kfeed.format", self.format.value.encode()),
        ]
        self._lock = threading.Lock()  # never held while calling librdkafka
        self._failed = 0
        self._first_error: Any = None
        self.samples = 0
        self.messages = 0
        self.bytes = 0
        self._transactional = transactional_id is not None
        if self._transactional:
            try:
                self._producer.init_transactions(self._timeout)
            except KafkaException as e:
                raise ProduceError(f"cannot start transactions: {e.args[0].str()}",
                                   topic=topic) from e

    def _partition_count(self) -> int:
        from confluent_kafka import KafkaException

        # In short slices, so bad credentials fail at once, not after the timeout.
        deadline = time.monotonic() + self._timeout
        while True:
            self._producer.poll(0)
            self._raise_fatal()
            try:
                md = self._producer.list_topics(
                    self.topic, timeout=min(0.5, max(0.01, deadline - time.monotonic())))
                break
            except KafkaException as e:
                if time.monotonic() < deadline:
                    continue
                self._raise_fatal()
                raise ProduceError(f"cannot reach the brokers within {self._timeout:g}s: "
                                   f"{e.args[0].str()}", topic=self.topic) from e
        tmd = md.topics.get(self.topic)
        if tmd is None or tmd.error is not None or not tmd.partitions:
            err = tmd.error if tmd is not None else None
            why = err.str() if err is not None else "no partitions"
            raise ProduceError(f"topic {self.topic!r} is not available: {why}", topic=self.topic,
                               code=err.code() if err is not None else None)
        return len(tmd.partitions)

    def _raise_fatal(self) -> None:
        err = self._fatal
        if err is not None:
            raise ProduceError(f"the producer cannot go on: {err.str()}", topic=self.topic,
                               code=err.code())

    # -- sending --------------------------------------------------------------

    def send(self, columns: Mapping[str, Any], keys: Sequence[Any] | None = None) -> int:
        """Send N samples (columns with a shared first dimension); returns N."""
        views, n, _owners = self.schema._columns(columns)
        if n == 0:
            return 0
        if keys is None:
            self._send_group(columns, None, None)
        else:
            keys = list(keys)
            if len(keys) != n:
                raise ConfigError(f"{len(keys)} keys for {n} samples")
            parts = self._partitions(keys)
            order = np.argsort(parts, kind="stable")
            bounds = np.flatnonzero(np.diff(parts[order])) + 1
            for idx in np.split(order, bounds):
                part = int(parts[idx[0]])
                sub = {name: _take(columns[name], idx) for name in self.schema.names}
                self._send_group(sub, part, [keys[i] for i in idx])
        with self._lock:
            self.samples += n
        return n

    def _partitions(self, keys: list[Any]) -> np.ndarray:
        if self.partitioner == "murmur2":
            return partitions_for([_key_bytes(k) for k in keys], self.num_partitions)
        parts = np.fromiter((self.partitioner(k, self.num_partitions) for k in keys),
                            dtype=np.int64, count=len(keys))
        if parts.size and (parts.min() < 0 or parts.max() >= self.num_partitions):
            raise ConfigError(f"the partitioner returned a partition outside "
                              f"0..{self.num_partitions - 1}")
        return parts

    def _send_group(self, columns: Mapping[str, Any], partition: int | None,
                    keys: list[Any] | None) -> None:
        if self.format is Format.BLOCK:
            values = self.schema.encode_blocks(columns, self.block_records)
            for v in values:
                self._produce(v, None, partition)
        else:
            values = self.schema.encode_raw(columns)
            if keys is None:
                for v in values:
                    self._produce(v, None, partition)
            else:
                for v, k in zip(values, keys):
                    self._produce(v, _key_bytes(k), partition)

    def _produce(self, value: bytes, key: bytes | None, partition: int | None) -> None:
        kwargs: dict[str, Any] = {} if partition is None else {"partition": partition}
        while True:
            try:
                self._producer.produce(self.topic, value, key, headers=self._headers,
                                       on_delivery=self._on_delivery, **kwargs)
                break
            except BufferError:
                # The local queue is full: wait for deliveries instead of
                # dropping or failing (backpressure).
                self._producer.poll(0.05)
                self._raise_fatal()
        self.messages += 1
        self.bytes += len(value)
        self._producer.poll(0)

    def _on_delivery(self, err: Any, msg: Any) -> None:
        if err is not None:
            with self._lock:
                self._failed += 1
                first = self._first_error is None
                if first:
                    self._first_error = err
            if first:
                log.error("delivery to %s failed: %s", msg.topic(), err)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every message to be acknowledged; raise if any failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        left = len(self._producer)
        while left:
            # In slices, so a fatal error ends the wait instead of hanging it.
            slice_s = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if slice_s <= 0:
                break
            left = self._producer.flush(slice_s)
            self._raise_fatal()
        self._raise_failures(left)

    def _raise_failures(self, left: int = 0) -> None:
        with self._lock:
            failed, first = self._failed, self._first_error
            self._failed, self._first_error = 0, None
        if failed or left:
            raise ProduceError(
                f"{failed} message(s) not delivered" + (f", {left} still queued" if left else "")
                + (f"; first error: {first.str()}" if first is not None else ""),
                topic=self.topic, code=first.code() if first is not None else None)

    # -- transactions ---------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Producer]:
        """Everything sent inside is committed together, or aborted on an exception."""
        from confluent_kafka import KafkaException

        if not self._transactional:
            raise ConfigError("transaction() needs a transactional_id")
        self._producer.begin_transaction()
        try:
            yield self
            self.flush()
            self._producer.commit_transaction(self._timeout)
        except BaseException:
            try:
                self._producer.abort_transaction(self._timeout)
            except KafkaException as e:
                log.error("abort_transaction failed: %s", e)
            raise

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.flush()
        else:
            # Still deliver what was sent; the original exception wins.
            self._producer.flush(self._timeout)


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


def _take(column: Any, idx: np.ndarray) -> Any:
    if type(column).__module__.startswith("torch"):
        import torch

        return column[torch.from_numpy(idx)]
    return np.asarray(column)[idx]
