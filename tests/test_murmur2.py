"""murmur2 and the key -> partition mapping, bit-exact with Kafka's Java client.

``java_murmur2`` is a line-by-line port of
``org.apache.kafka.common.utils.Utils.murmur2``, used only as a test oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kfeed
from kfeed import ConfigError, murmur2, partition_for, partitions_for
from kfeed import _murmur2

MASK = 0xFFFFFFFF


def java_murmur2(data: bytes) -> int:
    length = len(data)
    m, r = 0x5BD1E995, 24
    h = (0x9747B28C ^ length) & MASK
    for i4 in range(0, length - length % 4, 4):
        k = data[i4] | data[i4 + 1] << 8 | data[i4 + 2] << 16 | data[i4 + 3] << 24
        k = (k * m) & MASK
        k ^= k >> r
        k = (k * m) & MASK
        h = (h * m) & MASK
        h ^= k
    tail = length & ~3
    # Java's switch (length % 4) falls through 3 -> 2 -> 1.
    if length % 4 >= 3:
        h ^= data[tail + 2] << 16
    if length % 4 >= 2:
        h ^= data[tail + 1] << 8
    if length % 4 >= 1:
        h ^= data[tail]
        h = (h * m) & MASK
    h ^= h >> 13
    h = (h * m) & MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def java_partition(key: bytes, num_partitions: int) -> int:
    # Utils.toPositive(Utils.murmur2(keyBytes)) % numPartitions
    return (java_murmur2(key) & 0x7FFFFFFF) % num_partitions


# From Kafka's UtilsTest.testMurmur2.
KAFKA_VECTORS = [
    (b"21", -973932308),
    (b"foobar", -790332482),
    (b"a-little-bit-long-string", -985981536),
    (b"a-little-bit-longer-string", -1486304829),
    (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    (b"abc", 479470107),
]

HYP = settings(max_examples=300, deadline=None)


@pytest.mark.parametrize(("key", "expected"), KAFKA_VECTORS)
def test_kafka_test_vectors(key, expected):
    assert murmur2(key) == expected
    assert java_murmur2(key) == expected  # the oracle itself is right


def test_vectors_through_the_vectorised_form():
    keys = [k for k, _ in KAFKA_VECTORS]
    got = _murmur2.murmur2_many(keys)
    assert got.dtype == np.int32
    assert got.tolist() == [h for _, h in KAFKA_VECTORS]


@HYP
@given(st.binary(max_size=70))
def test_murmur2_matches_java(key):
    expected = java_murmur2(key)
    assert murmur2(key) == expected
    assert murmur2(bytearray(key)) == expected
    assert murmur2(memoryview(b"<" + key + b">")[1:-1]) == expected
    assert -(2**31) <= expected < 2**31


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=40), st.integers(1, 10_000))
def test_partitions_match_java(keys, num_partitions):
    expected = [java_partition(k, num_partitions) for k in keys]
    assert [partition_for(k, num_partitions) for k in keys] == expected
    got = partitions_for(keys, num_partitions)
    assert got.dtype == np.int32 and got.shape == (len(keys),)
    assert got.tolist() == expected
    assert _murmur2.murmur2_many(keys).tolist() == [java_murmur2(k) for k in keys]


def test_a_negative_hash_still_maps_into_range():
    # "foobar" hashes negative: Java masks the sign bit rather than taking abs().
    assert murmur2(b"foobar") < 0
    assert partition_for(b"foobar", 7) == (-790332482 & 0x7FFFFFFF) % 7 == 0
    assert partition_for(b"foobar", 7) != abs(-790332482) % 7
    assert partitions_for([b"foobar"], 7).tolist() == [0]


@HYP
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=30))
def test_str_keys_hash_as_utf8(key):
    data = key.encode("utf-8")
    assert murmur2(key) == murmur2(data) == java_murmur2(data)
    assert partition_for(key, 12) == partition_for(data, 12)
    assert partitions_for([key, data], 12).tolist() == [java_partition(data, 12)] * 2


def test_keys_may_be_any_iterable_of_mixed_types():
    keys = [b"abc", "abc", bytearray(b"abc"), memoryview(b"abc")]
    assert partitions_for(iter(keys), 5).tolist() == [java_partition(b"abc", 5)] * 4
    assert partitions_for([], 5).tolist() == []


@pytest.mark.parametrize("key", [None, 17, 1.5, ["a"], object()])
def test_a_key_that_is_not_bytes_or_str_raises(key):
    with pytest.raises(TypeError, match="bytes-like or str"):
        murmur2(key)
    with pytest.raises(TypeError, match="bytes-like or str"):
        partition_for(key, 3)
    with pytest.raises(TypeError, match="key 1"):
        partitions_for([b"ok", key, b"ok"], 3)


@pytest.mark.parametrize("n", [0, -1, -(2**31), 2.0, "3", None])
def test_num_partitions_must_be_a_positive_int(n):
    with pytest.raises(ConfigError, match="num_partitions"):
        partition_for(b"k", n)
    with pytest.raises(ConfigError, match="num_partitions"):
        partitions_for([b"k"], n)


def test_public_names():
    assert kfeed.murmur2 is murmur2
    assert kfeed.partition_for is partition_for
    assert kfeed.partitions_for is partitions_for
