"""Key -> partition, bit-exact with Kafka's Java default partitioner.

Used by the producer to pick a keyed sample's partition before it is packed
into a block, so blocks never mix partitions and a Java or librdkafka
(``partitioner=murmur2_random``) producer would have chosen the same one.
The hash itself is ``ext/_murmur2.pyx``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kfeed import _murmur2
from kfeed.errors import ConfigError

__all__ = ["murmur2", "partition_for", "partitions_for"]

Key = bytes | bytearray | memoryview | str


def murmur2(key: Key) -> int:
    """Java's ``Utils.murmur2`` of ``key`` (str keys are hashed as UTF-8)."""
    return _murmur2.murmur2(key)


def partition_for(key: Key, num_partitions: int) -> int:
    """``(murmur2(key) & 0x7fffffff) % num_partitions``, as Java does for keyed records."""
    _check_partitions(num_partitions)
    return (_murmur2.murmur2(key) & 0x7FFFFFFF) % num_partitions


def partitions_for(keys: Iterable[Key], num_partitions: int) -> np.ndarray:
    """``partition_for`` of many keys at once, as an int32 array."""
    _check_partitions(num_partitions)
    return _murmur2.partition_many(keys, num_partitions)


def _check_partitions(num_partitions: int) -> None:
    if not isinstance(num_partitions, int) or num_partitions <= 0:
        raise ConfigError(f"num_partitions must be a positive int, got {num_partitions!r}")
