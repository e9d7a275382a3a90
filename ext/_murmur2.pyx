"""Java-compatible murmur2, the hash behind Kafka's default partitioner.

Bit-exact with ``org.apache.kafka.common.utils.Utils.murmur2`` (seed
0x9747b28c), so a key lands on the same partition whether a Java producer, a
librdkafka producer with ``partitioner=murmur2_random`` or kfeed sent it.
Knows nothing of Kafka clients or torch; ``kfeed.partition`` is its front.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, uint8_t, uint32_t
from libc.stdlib cimport free, malloc

import numpy as np

cdef uint32_t SEED = 0x9747b28c
cdef uint32_t M = 0x5bd1e995


cdef inline int32_t murmur2_c(const uint8_t* data, Py_ssize_t length) noexcept nogil:
    cdef uint32_t h = SEED ^ <uint32_t>length
    cdef uint32_t k
    cdef Py_ssize_t i, tail = length & ~(<Py_ssize_t>3)
    for i in range(0, tail, 4):
        k = (<uint32_t>data[i] | (<uint32_t>data[i + 1] << 8)
             | (<uint32_t>data[i + 2] << 16) | (<uint32_t>data[i + 3] << 24))
        k *= M
        k ^= k >> 24
        k *= M
        h *= M
        h ^= k
    # The Java switch falls through from case 3 to case 1.
    cdef Py_ssize_t rest = length & 3
    if rest == 3:
        h ^= <uint32_t>data[tail + 2] << 16
    if rest >= 2:
        h ^= <uint32_t>data[tail + 1] << 8
    if rest >= 1:
        h ^= <uint32_t>data[tail]
        h *= M
    h ^= h >> 13
    h *= M
    h ^= h >> 15
    return <int32_t>h


cdef object _as_key(object key):
    if isinstance(key, str):
        return (<str>key).encode("utf-8")
    return key


def murmur2(key):
    """The signed 32-bit murmur2 hash of ``key`` (bytes-like, or str as UTF-8)."""
    cdef Py_buffer view
    key = _as_key(key)
    try:
        PyObject_GetBuffer(key, &view, PyBUF_SIMPLE)
    except TypeError:
        raise TypeError(f"murmur2 key must be bytes-like or str, not {type(key).__name__}") from None
    try:
        return murmur2_c(<const uint8_t*>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef _hash_many(object keys, int32_t num_partitions):
    """Hash every key; map to partitions when ``num_partitions`` > 0."""
    cdef list ks = [_as_key(k) for k in keys]
    cdef Py_ssize_t n = len(ks), i, got = 0
    cdef Py_buffer* views = <Py_buffer*>malloc(max(n, 1) * sizeof(Py_buffer))
    if views == NULL:
        raise MemoryError()
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] res = out
    try:
        for i in range(n):
            try:
                PyObject_GetBuffer(ks[i], &views[i], PyBUF_SIMPLE)
            except TypeError:
                raise TypeError(
                    f"key {i} must be bytes-like or str, not {type(ks[i]).__name__}") from None
            got += 1
        with nogil:
            for i in range(n):
                res[i] = murmur2_c(<const uint8_t*>views[i].buf, views[i].len)
                if num_partitions > 0:
                    res[i] = (res[i] & 0x7fffffff) % num_partitions
    finally:
        for i in range(got):
            PyBuffer_Release(&views[i])
        free(views)
    return out


def murmur2_many(keys):
    """murmur2 of each key, as an int32 numpy array."""
    return _hash_many(keys, 0)


def partition_many(keys, int num_partitions):
    """Java's default partition of each key, as an int32 numpy array."""
    if num_partitions <= 0:
        raise ValueError(f"num_partitions must be positive, got {num_partitions}")
    return _hash_many(keys, num_partitions)
