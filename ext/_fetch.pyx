"""The fetch stage's one pass over a ``consume()`` result, in C.

A topic of one record per message (raw values, Avro events) gives the loader
hundreds of thousands of messages a second; a Python loop over them costs
more than decoding them. ``scan`` makes the one pass the fetch stage needs:
it sorts out errors, drops what lies past a bounded epoch's end, and groups
the rest into runs of one partition, so that later stages work per run, not
per message. ``partitions`` lists the partitions a result holds (for the
source's note of where they end); ``value_bytes`` sums value sizes for the
stats.

It knows messages only through their methods (``error``, ``topic``,
``partition``, ``offset``, ``value``): confluent-kafka's ``Message`` and
``MemorySource``'s records alike. ``kfeed.loader.fetch``, ``kfeed.loader.build``
and ``kfeed.sources`` call it.

``Record`` is ``MemorySource``'s message: a C type, as confluent-kafka's
``Message`` is, so that replaying from memory costs what reading Kafka's
messages does (a record of Python methods made ``scan`` 5x slower, a third
of a Protobuf stream's time), and ``scan`` reads its fields directly. The
cyclic collector does not track it (a recording's records lengthened each
full pass): a value that refers back to its record is never freed.
"""

cimport cython
from cpython.bytes cimport PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE


@cython.no_gc
cdef class Record:
    """A recorded message with the accessors of ``confluent_kafka.Message``."""

    cdef readonly object _topic, _value
    cdef readonly long _partition
    cdef readonly long long _offset, _ts

    def __cinit__(self, object topic, long partition, long long offset, object value,
                  long long ts):
        self._topic = topic
        self._partition = partition
        self._offset = offset
        self._value = value
        self._ts = ts

    def topic(self):
        return self._topic

    def partition(self):
        return self._partition

    def offset(self):
        return self._offset

    def value(self):
        return self._value

    def key(self):
        return None

    def error(self):
        return None

    def timestamp(self):
        return (1, self._ts)

    def __reduce__(self):
        return (type(self), (self._topic, self._partition, self._offset, self._value,
                             self._ts))


def scan(list msgs, dict ends):
    """One pass over consumed messages.

    ``ends``: the end offset of each partition of a bounded epoch, or None.
    Returns ``(keep, vals, runs, errors, done)``: the messages without an
    error (and below their partition's end) and their values; ``runs``,
    ``(start, stop, tp)`` for each maximal stretch of ``keep`` from one
    partition; ``errors``, ``(msg, err)`` in order; ``done``, each partition
    whose last offset before its end was seen (a partition may repeat).
    """
    cdef list keep = [], vals = [], runs = [], errors = [], done = []
    cdef Py_ssize_t n = PyList_GET_SIZE(msgs), k, start = 0
    cdef object m, err, topic, last_topic = None, tp = None, end = None
    cdef long part, last_part = -1
    cdef long long off, stop_at = 0
    cdef Record rec
    for k in range(n):
        m = <object>PyList_GET_ITEM(msgs, k)
        if type(m) is Record:
            rec = <Record>m
            topic, part = rec._topic, rec._partition
        else:
            rec = None
            err = m.error()
            if err is not None:
                errors.append((m, err))
                continue
            topic = m.topic()
            part = m.partition()
        if tp is None or part != last_part or not (topic is last_topic or topic == last_topic):
            if tp is not None and len(keep) > start:
                runs.append((start, len(keep), tp))
            tp = (topic, part)
            start = len(keep)
            last_topic, last_part = topic, part
            end = ends.get(tp) if ends is not None else None
            if end is not None:
                stop_at = end
        if end is not None:
            off = m.offset() if rec is None else rec._offset
            if off >= stop_at - 1:
                done.append(tp)
                if off >= stop_at:
                    continue
        keep.append(m)
        vals.append(m.value() if rec is None else rec._value)
    if tp is not None and len(keep) > start:
        runs.append((start, len(keep), tp))
    return keep, vals, runs, errors, done


def partitions(list msgs):
    """The set of ``(topic, partition)`` of the messages (events with no topic left out)."""
    cdef set out = set()
    cdef Py_ssize_t k
    cdef object m, topic, last_topic = None
    cdef long part, last_part = -1
    for k in range(PyList_GET_SIZE(msgs)):
        m = <object>PyList_GET_ITEM(msgs, k)
        topic = m.topic()
        if topic is None:
            continue
        part = m.partition()
        if part != last_part or not (topic is last_topic or topic == last_topic):
            out.add((topic, part))
            last_topic, last_part = topic, part
    return out


def value_bytes(list vals, Py_ssize_t start, Py_ssize_t stop):
    """Total size of ``vals[start:stop]``: bytes values by their length, others by ``len``."""
    cdef Py_ssize_t k, total = 0
    cdef object v
    if start < 0:
        start = 0
    if stop > PyList_GET_SIZE(vals):
        stop = PyList_GET_SIZE(vals)
    for k in range(start, stop):
        v = <object>PyList_GET_ITEM(vals, k)
        if type(v) is bytes:
            total += PyBytes_GET_SIZE(v)
        elif v is not None:
            total += len(v)
    return total
