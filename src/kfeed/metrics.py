"""Prometheus metrics of every live Loader and Producer: ``kfeed.metrics.serve(port)``.

Where it sits: beside the data flow, read-only. Loaders and producers add
themselves to ``LIVE`` when made (a weak set: nothing is kept alive for
it; a loader leaves it when closed), and keep their counters as they work; ``serve`` starts
prometheus_client's HTTP endpoint, whose collector reads those counters at
each scrape (``Loader.stats()``, ``Producer.stats()``), so a process that is
never scraped pays nothing but the counters. ``prometheus_client`` is an
optional dependency (``pip install 'kfeed[metrics]'``); without it kfeed
imports and runs as before, and only ``serve`` says what is missing.

Names follow Prometheus's conventions: the ``kfeed_`` prefix, the unit in
the name, ``_total`` for counters. The consumer lag is also published as
``kafka_consumergroup_lag{consumergroup,topic,partition}``, kafka_exporter's
name, so that dashboards and autoscalers built on it work unchanged. The lag
in seconds, ``kfeed_consumergroup_lag_seconds{consumergroup,topic,partition}``,
is how old the group's next unread record is, as kafka-lag-exporter defines
it (now minus the timestamp of the record at the committed offset, 0 when
nothing is left): a thread of ``serve`` asks the brokers for it every
``lag_interval_s`` (``kfeed.lag.lag_of``, without the owners), never the loader's own thread.

With a GPU and nvidia-ml-py present, each CUDA device a live loader feeds
also has its utilisation and memory, read from NVML at the scrape
(``kfeed_gpu_utilization_ratio``, ``kfeed_gpu_memory_used_bytes``,
``kfeed_gpu_memory_total_bytes``, labelled by the device's CUDA index and
UUID). Without NVML (no driver, no package) they are left out; the reason
is logged once.
"""

from __future__ import annotations

import atexit
import bisect
import itertools
import logging
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kfeed._kafka import ConnectionLog
from kfeed.errors import ConfigError

log = logging.getLogger("kfeed.metrics")

__all__ = ["LATENCY_BUCKETS_S", "LIVE", "WAIT_BUCKETS_S", "GpuReader", "Histogram", "register",
           "serve"]

# Every Loader and Producer made in this process and not yet collected (or closed).
LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
# Each live object's label ("0", "1", ... in the order they were made): two
# loaders of one group and topics, or two producers of a topic, in one process
# are two series, not one series twice.
_IDS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_NEXT_ID = itertools.count()


def register(obj: Any) -> None:
    """Publish ``obj`` (a Loader or a Producer) while it lives, under an id of its own."""
    if obj not in _IDS:
        _IDS[obj] = str(next(_NEXT_ID))
    LIVE.add(obj)

# The caller's wait in next() (the data stall), in seconds.
WAIT_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                  1.0, 2.5, 5.0, 10.0)

# From a batch's newest record's Kafka timestamp to its hand-out, in seconds.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0, 300.0)

_LAG_KEY = re.compile(r"(.*)\[(\d+)\]")


class Histogram:
    """Counts of observations per bucket, kept by the loader (a bisect and an add each)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, count of observations <= le), ..., ("+Inf", all)]``, as Prometheus has it."""
        out, total = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            total += n
            out.append((repr(float(bound)), total))
        out.append(("+Inf", total + self.counts[-1]))
        return out


def serve(port: int, addr: str = "127.0.0.1", lag_interval_s: float = 15.0) -> Any:
    """Serve the metrics of every live Loader and Producer on ``addr:port`` (``/metrics``).

    Returns the HTTP server (``shutdown()`` stops it, and the lag reader).
    Port 0 picks a free one: ``server.server_port``. Every
    ``lag_interval_s`` the brokers are asked how old each Kafka loader's
    group's next unread record is (``kfeed_consumergroup_lag_seconds``).
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as e:
        raise ConfigError("kfeed.metrics.serve needs prometheus_client: "
                          "pip install 'kfeed[metrics]'") from e
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"port must be an int in 0..65535, got {port!r}")
    if isinstance(lag_interval_s, bool) or not isinstance(lag_interval_s, (int, float)) \
            or not 0 < lag_interval_s <= 86400:
        raise ConfigError(f"lag_interval_s must be seconds in (0, 86400], got "
                          f"{lag_interval_s!r}")
    ages = _LagSeconds(float(lag_interval_s))
    registry = CollectorRegistry(auto_describe=False)
    gpus = GpuReader.open()
    registry.register(_Collector(ages, gpus))
    try:
        server, _thread = start_http_server(port, addr, registry=registry)
    except OSError as e:
        if gpus is not None:
            gpus.close()
        raise ConfigError(f"cannot serve metrics on {addr}:{port}: {e.strerror}") from e
    ages.start()
    # A round under way when the process exits must end first: librdkafka's
    # clients do not survive the interpreter's teardown.
    atexit.register(ages.close)
    shutdown = server.shutdown

    def stop() -> None:
        shutdown()
        server.server_close()  # the port, free for another serve()
        ages.close()
        atexit.unregister(ages.close)
        if gpus is not None:
            gpus.close()

    server.shutdown = stop
    return server


def _live() -> list[Any]:
    """The live loaders and producers (a copy: others may be made meanwhile)."""
    while True:
        try:
            return list(LIVE)
        except RuntimeError:  # the weak set changed during the copy
            continue


class _LagSeconds(threading.Thread):
    """Every ``interval_s``: each live Kafka loader's group lag in seconds, from the brokers.

    ``ages`` maps (group, topic, partition) to the age of the group's next
    unread record; it is replaced whole after each round, so a scrape reads
    one round's values. A round that fails (brokers away) drops that
    group's values, with one warning until it works again.
    """

    def __init__(self, interval_s: float) -> None:
        super().__init__(name="kfeed-lag-seconds", daemon=True)
        self.interval_s = interval_s
        self.ages: dict[tuple[str, str, str], float] = {}
        self.stopped = threading.Event()
        self._failing: set[str] = set()
        # One for every round's clients, so that brokers away say so in one
        # line every 10 minutes, not each round's new client's line.
        self._log = ConnectionLog(every_s=600.0)

    def close(self) -> None:
        """Stop, once the round under way ends (within its brokers' timeout)."""
        self.stopped.set()
        if self.is_alive():
            self.join(timeout=15.0)

    def run(self) -> None:
        from kfeed.lag import lag_of

        while not self.stopped.is_set():
            ages: dict[tuple[str, str, str], float] = {}
            for config, group, topics in lag_targets(_live()):
                if self.stopped.is_set():
                    return
                try:
                    # (not who owns each partition: see lag_of)
                    parts = lag_of({**config, "logger": self._log}, group, topics,
                                   timeout_s=min(10.0, max(1.0, self.interval_s)), owners=False)
                except Exception as e:  # noqa: BLE001 - brokers away, or librdkafka's own errors
                    if group not in self._failing:
                        log.warning("lag in seconds of group %s: %s", group, e)
                    self._failing.add(group)
                    continue
                self._failing.discard(group)
                for p in parts:
                    if p.lag_s is not None:
                        ages[(group, p.topic, str(p.partition))] = p.lag_s
            self.ages = ages
            self.stopped.wait(self.interval_s)


def lag_targets(objs: Iterable[Any]) -> list[tuple[Any, str, list[str]]]:
    """(connection settings, group, topics) to ask the lag of: per group, the topics of
    all its live loaders (two loaders of one group may read different topics)."""
    targets: dict[str, tuple[Any, str, list[str]]] = {}
    for obj in objs:
        target = getattr(obj, "lag_target", lambda: None)()
        if target is not None:
            config, group, topics = target
            known = targets.setdefault(group, (config, group, []))[2]
            known.extend(t for t in topics if t not in known)
    return list(targets.values())


class GpuReader:
    """Utilisation and memory of the CUDA devices loaders feed, from NVML.

    ``nvml`` is the ``pynvml`` module (nvidia-ml-py), initialised. A device
    is found by its UUID (``torch.cuda.get_device_properties(i).uuid``), as
    ``CUDA_VISIBLE_DEVICES`` renumbers devices and NVML does not.
    """

    def __init__(self, nvml: Any, uuid_of: Callable[[int], str] | None = None) -> None:
        self.nvml = nvml
        self._uuid_of = uuid_of or _torch_uuid
        self._handles: dict[int, tuple[str, Any] | None] = {}
        self._failed: set[int] = set()

    @classmethod
    def open(cls) -> GpuReader | None:
        """A reader, or None (the reason logged) without nvidia-ml-py, a driver or a GPU."""
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            import pynvml
        except ImportError:
            log.info("no GPU metrics: nvidia-ml-py is not installed")
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            log.info("no GPU metrics: NVML cannot start: %s", e)
            return None
        return cls(pynvml)

    def close(self) -> None:
        """Shut NVML down, once (``nvmlInit`` counts its callers)."""
        nvml, self.nvml = self.nvml, None
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as e:
                log.debug("NVML shutdown: %s", e)

    def _handle(self, index: int) -> tuple[str, Any] | None:
        """``(uuid, NVML handle)`` of CUDA device ``index``; None if NVML does not know it."""
        if index not in self._handles:
            uuid = self._uuid_of(index)
            found = None
            for name in (uuid, f"GPU-{uuid}", f"MIG-{uuid}"):
                try:
                    found = (name, self.nvml.nvmlDeviceGetHandleByUUID(name))
                    break
                except self.nvml.NVMLError:
                    continue
            if found is None:
                log.warning("no GPU metrics for cuda:%d: NVML knows no device %s", index, uuid)
            self._handles[index] = found
        return self._handles[index]

    def read(self, indices: set[int]) -> list[tuple[list[str], float, int, int]]:
        """Per device: ``([index, uuid], utilisation 0..1, memory used, memory total)``."""
        if self.nvml is None:  # closed (a scrape that came as the server stopped)
            return []
        out = []
        for index in sorted(indices):
            found = self._handle(index)
            if found is None:
                continue
            uuid, handle = found
            try:
                busy = self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            except self.nvml.NVMLError as e:
                if index not in self._failed:
                    log.warning("GPU metrics of cuda:%d: %s", index, e)
                    self._failed.add(index)
                continue
            self._failed.discard(index)
            out.append(([str(index), uuid], busy, int(mem.used), int(mem.total)))
        return out


def _torch_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


class _Collector:
    """Reads every live loader's and producer's counters at a scrape."""

    def __init__(self, ages: _LagSeconds, gpus: GpuReader | None = None) -> None:
        self.ages = ages
        self.gpus = gpus

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        loader_labels = ["consumergroup", "topics", "loader"]
        c = {name: CounterMetricFamily(f"kfeed_loader_{name}", doc, labels=loader_labels)
             for name, doc in (("samples", "samples handed out"),
                               ("bytes", "message bytes decoded"),
                               ("batches", "batches handed out"),
                               ("commits", "offset commits sent"),
                               ("commit_failures", "offset commits (or partitions) refused"),
                               ("dead_lettered", "messages copied to the dead-letter topic"),
                               ("rebalances", "partition assignments received"))}
        stage = CounterMetricFamily("kfeed_loader_stage_seconds",
                                    "time the loader's thread spent, by stage: fetch "
                                    "(consume), decode (decode, order, pack), copy (to the "
                                    "device)", labels=[*loader_labels, "stage"])
        slots = GaugeMetricFamily("kfeed_loader_pool_slots_in_use",
                                  "pool slots filling, being copied, or lent and held",
                                  labels=loader_labels)
        depth = GaugeMetricFamily("kfeed_loader_prefetch_batches",
                                  "batches the loader may hold ready (prefetch; 'auto' moves it)",
                                  labels=loader_labels)
        bad = CounterMetricFamily("kfeed_loader_bad_records", "messages rejected, by reason",
                                  labels=[*loader_labels, "reason"])
        # The histogram takes a wait when it ends; the counter holds the one under
        # way too, so a trainer starved now shows as stalled now.
        stall = CounterMetricFamily("kfeed_loader_stall_seconds",
                                    "the caller's time waiting in next() for a batch, the "
                                    "wait under way included (the data stall)",
                                    labels=loader_labels)
        wait = HistogramMetricFamily("kfeed_loader_wait_seconds",
                                     "the caller's wait in next() for a batch (the data stall)",
                                     labels=loader_labels)
        latency = HistogramMetricFamily(
            "kfeed_loader_latency_seconds",
            "from the Kafka timestamp of a batch's newest record to the batch's hand-out "
            "(in offset order; not with shuffle or pack)", labels=loader_labels)
        startup = GaugeMetricFamily("kfeed_loader_startup_seconds",
                                    "from the first next() to the first batch (so far, "
                                    "while it has not come)",
                                    labels=loader_labels)
        pool = GaugeMetricFamily("kfeed_loader_pool_bytes", "host memory of the buffer pool",
                                 labels=loader_labels)
        held = GaugeMetricFamily("kfeed_loader_held_bytes",
                                 "records a shuffle or a mixture holds beside the pool",
                                 labels=loader_labels)
        lag = GaugeMetricFamily("kafka_consumergroup_lag",
                                "messages not read yet, per partition (kafka_exporter's name)",
                                labels=["consumergroup", "topic", "partition"])
        producer_labels = ["topic", "producer"]
        p = {name: CounterMetricFamily(f"kfeed_producer_{name}", doc, labels=producer_labels)
             for name, doc in (("samples", "samples sent"), ("messages", "messages sent"),
                               ("bytes", "message bytes sent"),
                               ("delivery_failures", "messages the brokers did not take"))}
        queued = GaugeMetricFamily("kfeed_producer_queue_messages",
                                   "messages handed to librdkafka and not acknowledged yet",
                                   labels=producer_labels)
        devices: set[int] = set()
        lags: dict[tuple[str, str, str], int] = {}
        groups: set[str] = set()  # of the live loaders: a closed one's ages go with it
        for obj in _live():
            stats = obj.stats()
            if "lag" not in stats:  # a producer
                labels = [obj.topic, _IDS.get(obj, "")]
                for name, family in p.items():
                    family.add_metric(labels, stats[name])
                queued.add_metric(labels, stats["queued"])
                continue
            group = stats["group"]
            groups.add(group)
            labels = [group, ",".join(obj.topics), _IDS.get(obj, "")]
            # (Resolved when the loader was made: a scrape's thread has its own
            # current device.)
            index = getattr(obj, "cuda_index", None)
            if index is not None:
                devices.add(index)
            for name, family in c.items():
                family.add_metric(labels, stats[name])
            for reason, n in stats["bad_by_reason"].items():
                bad.add_metric([*labels, reason], n)
            stall.add_metric(labels, stats["wait_s"])
            wait.add_metric(labels, stats["wait_histogram"].cumulative(),
                            stats["wait_histogram"].sum)
            latency.add_metric(labels, stats["latency_histogram"].cumulative(),
                               stats["latency_histogram"].sum)
            startup.add_metric(labels, stats["startup_s"])
            pool.add_metric(labels, stats["pool_bytes"])
            held.add_metric(labels, stats["held_bytes"])
            slots.add_metric(labels, stats["pool_slots_in_use"])
            depth.add_metric(labels, stats["prefetch"])
            for name in ("fetch", "decode", "copy"):
                stage.add_metric([*labels, name], stats[f"{name}_s"])
            for key, n in stats["lag"].items():
                m = _LAG_KEY.fullmatch(key)
                if m is not None:  # one series a partition: the largest, if two read it
                    where = (group, m.group(1), m.group(2))
                    lags[where] = max(n, lags.get(where, n))
        for where, n in lags.items():
            lag.add_metric(list(where), n)
        lag_s = GaugeMetricFamily("kfeed_consumergroup_lag_seconds",
                                  "age of the group's next unread record (committed offset)",
                                  labels=["consumergroup", "topic", "partition"])
        for (group, topic, partition), age in self.ages.ages.items():
            if group in groups:  # (the reader's round may be older than a close)
                lag_s.add_metric([group, topic, partition], age)
        yield from c.values()
        yield from (bad, stall, wait, latency, startup, pool, held, slots, depth, stage, lag, lag_s)
        yield from p.values()
        yield queued
        if self.gpus is not None and devices:
            yield from self._gpu_families(devices)

    def _gpu_families(self, devices: set[int]) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        gpu_labels = ["gpu", "uuid"]
        busy = GaugeMetricFamily("kfeed_gpu_utilization_ratio",
                                 "share of the last sample period in which a kernel ran "
                                 "(NVML), per device a loader feeds", labels=gpu_labels)
        used = GaugeMetricFamily("kfeed_gpu_memory_used_bytes", "device memory in use (NVML)",
                                 labels=gpu_labels)
        total = GaugeMetricFamily("kfeed_gpu_memory_total_bytes", "device memory (NVML)",
                                  labels=gpu_labels)
        assert self.gpus is not None
        for labels, ratio, mem_used, mem_total in self.gpus.read(devices):
            busy.add_metric(labels, ratio)
            used.add_metric(labels, mem_used)
            total.add_metric(labels, mem_total)
        yield from (busy, used, total)
