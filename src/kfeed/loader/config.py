"""The loader's own settings, checked once and frozen.

``LoaderConfig`` holds every kfeed setting of a loader (the Kafka settings
stay the librdkafka dict, apart). ``Loader``, ``KafkaIterableDataset`` and
``kfeed train`` all build one, so a bad value is refused the same way
wherever it comes from, before any thread starts or any broker is asked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

import torch

from kfeed._kafka import check_topic_name
from kfeed.badrecords import BadRecordPolicy
from kfeed.device import default_device
from kfeed.errors import ConfigError
from kfeed.formats import RecordFormat, one_field, resolve
from kfeed.mix import Mix, as_int
from kfeed.outputs import check_output
from kfeed.schema import Schema
from kfeed.tokens import Pack, Shuffle

__all__ = ["LoaderConfig"]

_STARTS = ("committed", "earliest", "latest")


@dataclass(frozen=True)
class LoaderConfig:
    """Every kfeed setting of a loader; see ``kfeed.Loader`` for what each means."""

    topics: tuple[str, ...]
    schema: Schema
    batch_size: int
    device: Any = None
    format: Any = "block"
    prefetch: int | str = 2
    max_memory_bytes: int | None = None
    until: Any = None
    epochs: int | None = None
    start: Any = "committed"
    on_bad_record: Any = "dead_letter"
    fail_fast: int | None = 32
    dlq_config: Mapping[str, Any] | None = None
    drop_last: bool = False
    max_wait_ms: float = 200.0
    rank: int | None = None
    world_size: int | None = None
    assignment: str = "group"
    commit_interval_ms: float = 1000.0
    connect_timeout_s: float = 30.0
    pack: Pack | None = None
    shuffle: Shuffle | None = None
    on_revoke: Callable[[list[tuple[str, int]]], None] | None = field(default=None,
                                                                       compare=False)
    # Topics given as a kfeed.Mix: the mixture (``topics`` are then its topics).
    mix: Mix | None = None
    output: str = "torch"

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        topics = self.topics
        if isinstance(topics, Mix):
            put("mix", topics)
            topics = topics.topics
        elif self.mix is not None and not isinstance(self.mix, Mix):
            raise ConfigError(f"mix must be a kfeed.Mix, got {type(self.mix).__name__}")
        topics = [topics] if isinstance(topics, str) else list(topics or ())
        if not topics or not all(isinstance(t, str) and t for t in topics):
            raise ConfigError(f"topics must be a topic name, a list of them or a kfeed.Mix, "
                              f"got {self.topics!r}")
        for topic in topics:
            check_topic_name(topic)
        twice = sorted({t for t in topics if topics.count(t) > 1})
        if twice:
            raise ConfigError(f"topics {topics} name {', '.join(map(repr, twice))} more than "
                              f"once: give each topic once")
        if self.mix is not None and tuple(topics) != self.mix.topics:
            raise ConfigError(f"topics {topics} are not the mixture's {list(self.mix.topics)}")
        put("topics", tuple(topics))
        if not isinstance(self.schema, Schema):
            raise ConfigError("schema must be a kfeed.Schema")
        # (numpy's integers too, kept as Python ints, as Shuffle and the offset maps take them)
        put("batch_size", _positive_int("batch_size", self.batch_size))
        if self.prefetch != "auto":
            put("prefetch", _positive_int("prefetch", self.prefetch, "a positive int or 'auto'"))
        if self.max_memory_bytes is not None:
            put("max_memory_bytes", _positive_int("max_memory_bytes", self.max_memory_bytes,
                                                  "a positive int or None"))
        if isinstance(self.until, Mapping):
            put("until", _offsets("until", self.until, self.topics))
        elif not (self.until in (None, "end") or isinstance(self.until, datetime)):
            raise ConfigError(f"until must be None (stream), 'end', a datetime or a "
                              f"{{(topic, partition): offset}} dict, got {self.until!r}")
        if self.epochs is not None:
            put("epochs", _positive_int("epochs", self.epochs, "None or a positive int"))
            if self.until is None:
                raise ConfigError("epochs reads a bounded window again and again: give until= "
                                  "('end', a datetime or a {(topic, partition): offset} dict)")
        if isinstance(self.start, datetime) and isinstance(self.until, datetime) \
                and self.until.timestamp() <= self.start.timestamp():
            raise ConfigError(f"until={self.until.isoformat()} is not after start="
                              f"{self.start.isoformat()}: the window would hold nothing")
        if isinstance(self.start, Mapping):
            put("start", _offsets("start", self.start, self.topics))
        elif not (isinstance(self.start, datetime) or self.start in _STARTS):
            raise ConfigError(f"start must be 'committed', 'earliest', 'latest', a datetime or a "
                              f"{{(topic, partition): offset}} dict, got {self.start!r}")
        try:
            put("on_bad_record", BadRecordPolicy(self.on_bad_record))
        except ValueError:
            raise ConfigError("on_bad_record must be 'dead_letter', 'skip' or 'raise', "
                              f"got {self.on_bad_record!r}") from None
        if self.fail_fast is not None:
            put("fail_fast", _positive_int("fail_fast", self.fail_fast, "None or an int >= 1"))
        if self.dlq_config is not None and not isinstance(self.dlq_config, Mapping):
            raise ConfigError("dlq_config must be a dict of librdkafka settings (the "
                              "connection and login of the dead-letter producer)")
        if self.dlq_config is not None and self.on_bad_record is not BadRecordPolicy.DEAD_LETTER:
            raise ConfigError(f"dlq_config sets up the dead-letter producer, and "
                              f"on_bad_record={self.on_bad_record.value!r} sends nothing to it: "
                              f"leave dlq_config out, or on_bad_record='dead_letter'")
        if self.on_revoke is not None and not callable(self.on_revoke):
            raise ConfigError("on_revoke must be a callable taking the revoked partitions")
        if self.assignment not in ("group", "static"):
            raise ConfigError(f"assignment must be 'group' or 'static', got {self.assignment!r}")
        if not _number(self.max_wait_ms) or self.max_wait_ms <= 0:
            raise ConfigError(f"max_wait_ms must be a number > 0, got {self.max_wait_ms!r}")
        if not _number(self.connect_timeout_s) or self.connect_timeout_s <= 0:
            raise ConfigError(f"connect_timeout_s must be a number > 0, got "
                              f"{self.connect_timeout_s!r}")
        if not _number(self.commit_interval_ms) or self.commit_interval_ms < 0:
            raise ConfigError(f"commit_interval_ms must be a number >= 0, got "
                              f"{self.commit_interval_ms!r}")
        if not isinstance(self.drop_last, bool):
            raise ConfigError(f"drop_last must be True or False, got {self.drop_last!r}")
        if self.pack is not None and not isinstance(self.pack, Pack):
            raise ConfigError(f"pack must be a kfeed.Pack, got {type(self.pack).__name__}")
        varlen = self.schema.varlen
        if self.pack is not None and varlen is None:
            raise ConfigError("pack needs a schema with a variable-length token field, "
                              "e.g. {'tokens': ('int32', (None,))}")
        put("format", resolve(self.format))
        if isinstance(self.format, RecordFormat):
            if self.pack is not None and not self.format.documents:
                raise ConfigError(f"format={self.format!r} gives fixed-shape records: pack= "
                                  f"needs a token field, which kfeed reads from block, raw, "
                                  f"JSON, Avro and Protobuf topics")
            if self.pack is not None:  # the packer takes the token field alone
                one_field(self.schema, self.format.value.capitalize()
                                if self.format.value != "json" else "JSON")
            self.format.decoder(self.schema)  # the fields' dtypes, and a plain schema, checked
        if self.shuffle is not None and not isinstance(self.shuffle, Shuffle):
            raise ConfigError(f"shuffle must be a kfeed.Shuffle, got {type(self.shuffle).__name__}")
        if self.pack is None and varlen is not None:
            # Jagged: the field's elements, flat, and NAME_offsets (batch_size + 1).
            if self.shuffle is not None:
                raise ConfigError(f"the variable-length field {varlen.name!r} is read in "
                                  f"offset order; shuffle= takes it with pack= only")
            if f"{varlen.name}_offsets" in self.schema.names:
                raise ConfigError(f"field {varlen.name + '_offsets'!r}: batches hold the "
                                  f"offsets of {varlen.name!r} under that name")
        put("device", _check_device(check_output(self.output, self.schema, self.device,
                                                 self.pack is not None)))
        rank, world = _rank_and_world(self.rank, self.world_size)
        put("rank", rank)
        put("world_size", world)

    @property
    def bounded(self) -> bool:
        """A bounded read: ``until`` ends every partition where the read starts."""
        return self.until is not None

    @property
    def records(self) -> bool:
        """Whether records go one by one through an order (mix, shuffle, pack, a jagged field)."""
        return (self.pack is not None or self.shuffle is not None or self.jagged
                or self.mix is not None)

    @property
    def jagged(self) -> bool:
        """Whether batches hold a variable-length field as elements and offsets (no pack)."""
        return self.pack is None and self.schema.varlen is not None

    def check_epoch(self, epoch: Any, who: str) -> int:
        """``epoch`` as an int; refused where ``set_epoch`` of ``who`` (the class asked)
        cannot read it."""
        if self.epochs is None:
            raise ConfigError(f"set_epoch needs {who}(..., epochs=N)")
        whole = as_int(epoch)
        if whole is None or not 0 <= whole < self.epochs:
            raise ConfigError(f"epoch must be an int in 0..{self.epochs - 1}, got {epoch!r}")
        return whole

    def replace(self, **changes: Any) -> LoaderConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return LoaderConfig(**{**values, **changes})


def _offsets(name: str, offsets: Mapping[Any, Any], topics: tuple[str, ...]
             ) -> dict[tuple[str, int], int]:
    """A ``{(topic, partition): offset}`` window end, checked."""
    out: dict[tuple[str, int], int] = {}
    for key, offset in offsets.items():
        # (numpy's integers too, kept as Python ints: the window goes in states)
        part = as_int(key[1]) if isinstance(key, tuple) and len(key) == 2 else None
        if not (part is not None and part >= 0 and isinstance(key[0], str)):
            raise ConfigError(f"{name}: keys must be (topic, partition) tuples, got {key!r}")
        key = (key[0], part)
        if key[0] not in topics:
            raise ConfigError(f"{name}: {key!r} is not a partition of the topics {list(topics)}")
        value = as_int(offset)
        if value is None or value < 0:
            raise ConfigError(f"{name}: the offset of {key!r} must be an int >= 0, got {offset!r}")
        out[key] = value
    return out


def _number(x: Any) -> bool:
    """A finite int or float: NaN compares false with every bound, so it would pass them."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _positive_int(name: str, value: Any, what: str = "a positive int") -> int:
    """``value`` as a Python int (a numpy integer too), if it is one >= 1."""
    whole = as_int(value)
    if whole is None or whole < 1:
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    return whole


def _check_device(device: Any) -> torch.device:
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r} is not a torch device: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={str(device)!r}, but torch sees no CUDA device "
                              "(torch.cuda.is_available() is False): pass device='cpu', "
                              "or leave device unset to take cuda only where there is one")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device={str(device)!r}, but torch sees "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ConfigError(f"device={str(device)!r}: kfeed copies batches to 'cuda' or 'cpu'")
    return dev


def dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if dist_ready():
        rank = torch.distributed.get_rank() if rank is None else rank
        world_size = torch.distributed.get_world_size() if world_size is None else world_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if not (_int(world_size) and world_size >= 1 and _int(rank) and 0 <= rank < world_size):
        raise ConfigError(f"need ints 0 <= rank < world_size, got rank={rank!r}, "
                          f"world_size={world_size!r}")
    return rank, world_size
