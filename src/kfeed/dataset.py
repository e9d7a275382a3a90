"""KafkaIterableDataset: the Loader behind torch's DataLoader interface.

For code built around ``torch.utils.data.DataLoader``. It yields the Loader's
batches (use ``DataLoader(dataset, batch_size=None)``; a DataLoader with
``batch_size`` set gets a ``ConfigError``), so batching, decoding and offsets
stay kfeed's. It is the simpler and slower path: the DataLoader adds its own
hand-over, cannot copy to the GPU on a side stream, and has no
``state_dict`` of the stream; prefer ``kfeed.Loader`` directly.

Commits: a loader counts a batch as used when it is asked for the next one.
In the main process (``num_workers=0``) that is after the step, as with
``kfeed.Loader``. A worker makes ``prefetch_factor`` batches ahead of the
training loop, so its commits can run that far ahead of the steps: a trainer
that dies may leave up to ``num_workers * prefetch_factor`` batches committed
and not trained. Where that matters, use ``kfeed.Loader``.
"""

from __future__ import annotations

import hashlib
import multiprocessing
from collections.abc import Iterator, Mapping
from multiprocessing.context import get_spawning_popen
from typing import Any

import torch

from kfeed.errors import ConfigError
from kfeed.loader import STACKED, Batch, Loader, LoaderConfig
from kfeed.outputs import OUTPUTS
from kfeed.schema import Schema
from kfeed.sources import consumer_config, group_share

__all__ = ["KafkaIterableDataset"]


class KafkaIterableDataset(torch.utils.data.IterableDataset):
    """Each iteration opens a Loader on the CPU and yields its batches.

    The settings are checked here, when the dataset is made, not in a
    worker (but for more workers than partitions, known once a worker asks
    the brokers). With DataLoader workers, every worker opens its own consumer in
    the same consumer group, so the topic's partitions are shared among them
    and each record is read by one worker once (more workers than partitions
    is a ``ConfigError``, and so is a given ``source``, which no group
    shares); with ``assignment="static"``
    the workers of a rank deal out its share of the partitions, as ranks do
    (worker ``w`` of rank ``r`` reads as rank ``r * num_workers + w``). Start the workers with
    ``multiprocessing_context="forkserver"`` (or ``"spawn"``) when the
    process holds Kafka clients of its own: a forked worker inherits them
    without the librdkafka threads behind them, and may crash freeing them.

    With ``epochs=N`` and a window (``until=`` a datetime, or a map naming
    every partition: each epoch is a new loader), ``set_epoch(e)`` before each
    epoch's loop reads epoch ``e``'s order, as ``Loader.set_epoch`` does;
    workers kept between epochs (``persistent_workers=True``) see it too.
    """

    def __init__(self, kafka_config: Mapping[str, Any] | None, topics: Any, schema: Schema,
                 batch_size: int, **loader_kwargs: Any) -> None:
        super().__init__()
        loader_kwargs.setdefault("device", "cpu")
        self.source = loader_kwargs.pop("source", None)
        self.kafka_config = dict(kafka_config or {})
        output = loader_kwargs.get("output", "torch")
        if output != "torch" and output in OUTPUTS:
            # The DataLoader converts what a dataset yields (numpy arrays into
            # tensors) and cannot collate JAX arrays or Arrow batches. (Said
            # first: the output's own checks would ask for what is no use here.)
            raise ConfigError(f"KafkaIterableDataset yields torch batches, which a DataLoader "
                              f"takes as they are; output={output!r} needs no "
                              f"DataLoader: iterate kfeed.Loader(..., "
                              f"output={output!r}) directly")
        self.config = LoaderConfig(topics, schema, batch_size, **loader_kwargs)
        if self.source is None:  # (in the main process: a worker's error comes wrapped)
            consumer_config(self.kafka_config)
        if self.config.epochs is not None and (self.config.until == "end" or
                                               self.config.start in ("committed", "latest")):
            raise ConfigError("with epochs=, each epoch of a KafkaIterableDataset opens a new "
                              "loader, which would find the window's ends anew (the group's "
                              "commits move with every epoch): give start= and until= a "
                              "datetime or a {(topic, partition): offset} dict naming every "
                              "partition (start= may be 'earliest'), so that every epoch "
                              "reads the same window")
        # Shared memory: persistent DataLoader workers got their copy of the
        # dataset once, when they started, and must still see set_epoch.
        self._epoch = multiprocessing.Value("q", 0, lock=False)
        self._passes = 0  # iterations of this copy (a persistent DataLoader worker's)

    @property
    def epoch(self) -> int:
        return int(self._epoch.value)

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` at the next iteration, as ``DistributedSampler.set_epoch``.

        Call it in the main process before each epoch's loop.
        """
        epoch = self.config.check_epoch(epoch, "KafkaIterableDataset")
        self._epoch.value = epoch

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if get_spawning_popen() is None:  # a copy, not a DataLoader worker starting
            state["_epoch"] = self.epoch
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["_epoch"], int):
            state["_epoch"] = multiprocessing.Value("q", state["_epoch"], lock=False)
        self.__dict__.update(state)

    def __iter__(self) -> Iterator[Batch]:
        config = self.config
        worker = torch.utils.data.get_worker_info()
        run = None
        workers = 1 if worker is None else worker.num_workers
        if workers > 1 and config.assignment == "static":
            config = config.replace(rank=config.rank * workers + worker.id,
                                    world_size=config.world_size * workers)
        elif workers > 1:
            self._check_group_workers(workers)
            # One run for the workers of one DataLoader iteration (their seeds
            # less their ids are its base seed): a partition another worker read
            # first goes on from its commit, whatever the start, as between the
            # ranks of a job (NOTE [ Whose commits win ]). With a run each, a
            # worker that joined later read it again from the start. Persistent
            # workers keep their seeds from pass to pass, so the pass counts too
            # (each pass iterates every worker's copy once): the same run, the
            # next pass went on from the last one's commits and read nothing.
            self._passes += 1
            run = hashlib.blake2b(f"{worker.seed - worker.id}/{self.epoch}/{self._passes}".encode(),
                                  digest_size=6).hexdigest()
        with Loader.from_config(self.kafka_config, config, source=self.source,
                                one_epoch=True, run=run) as loader:
            if self.epoch:
                loader.set_epoch(self.epoch)
            # Not ``yield from``: closing this generator (a worker whose parent
            # is gone, a DataLoader dropped) would close the loader first with
            # its default, committing the batch in hand, which a worker made
            # and never handed over. A batch not known to be trained is read
            # again instead (``__exit__`` with the GeneratorExit).
            for batch in loader:
                yield batch

    def _check_group_workers(self, workers: int) -> None:
        """Workers that share partitions in a group: a source of their own each would
        read every record once per worker, and a worker left without a partition
        would hold the DataLoader, which takes batches from each worker in turn,
        for ever (the others wait on it with their batches made)."""
        if self.source is not None:
            raise ConfigError(f"a given source in {workers} DataLoader workers is read whole "
                              f"by each (no consumer group shares it): pass "
                              f"assignment='static', which deals its partitions out")
        from kfeed._kafka import admin_client, admin_partitions

        admin = admin_client(self.kafka_config)
        servers = str(self.kafka_config.get("bootstrap.servers"))
        counts = {t: len(admin_partitions(admin, t, servers, self.config.connect_timeout_s))
                  for t in self.config.topics}
        have, how, dealt_apart = group_share(counts, self.config.mix is not None,
                                             self.kafka_config)
        # Every rank's workers are members of the one group.
        ranks = self.config.world_size or 1
        members = workers * ranks
        if have < members:
            who = (f"{workers} DataLoader workers" if ranks == 1 else
                   f"{workers} DataLoader workers on each of {ranks} ranks ({members} members)")
            given = ", ".join(f"{t} has {n}" for t, n in counts.items())
            most = have // ranks
            fewer = (f"use at most {most} worker{'s' if most > 1 else ''}"
                     f"{' a rank' if ranks > 1 else ''}, " if most else "use ")
            other = ", partition.assignment.strategy=roundrobin" if dealt_apart else ""
            raise ConfigError(f"{who} share the partitions in a consumer group ({given}; {how}): "
                              f"a worker without one would hold the DataLoader up for ever; "
                              f"{fewer}more partitions{other} or assignment='static'")


def _refuse_stacking(batch: Any, *, collate_fn_map: Any = None) -> Any:
    raise ConfigError(STACKED)


# A DataLoader with batch_size set collates kfeed's batches: torch's
# default_collate looks its map up before it stacks anything, where batches
# of other sizes (a read's last one, a stream's partial ones) failed with
# torch's own "stack expects each tensor to be equal size". (Batch.update
# refuses the stacked ones too, where a collate does without the map.)
try:
    from torch.utils.data._utils.collate import default_collate_fn_map
except ImportError:  # (a torch without the map: Batch.update says it)
    pass
else:
    default_collate_fn_map[Batch] = _refuse_stacking
