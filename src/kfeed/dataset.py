"""KafkaIterableDataset: the Loader behind torch's DataLoader interface.

For code built around ``torch.utils.data.DataLoader``. It yields the Loader's
batches (use ``DataLoader(dataset, batch_size=None)``), so batching, decoding
and offsets stay kfeed's. It is the simpler and slower path: the DataLoader
adds its own hand-over, cannot copy to the GPU on a side stream, and has no
``state_dict`` of the stream; prefer ``kfeed.Loader`` directly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from kfeed.loader import Batch, Loader
from kfeed.schema import Schema

__all__ = ["KafkaIterableDataset"]


class KafkaIterableDataset(torch.utils.data.IterableDataset):
    """Each iteration opens a Loader on the CPU and yields its batches.

    With DataLoader workers, every worker joins the same consumer group, so
    the topic's partitions are shared among them.
    """

    def __init__(self, kafka_config: Mapping[str, Any] | None, topics: Any, schema: Schema,
                 batch_size: int, **loader_kwargs: Any) -> None:
        super().__init__()
        loader_kwargs.setdefault("device", "cpu")
        self.kafka_config = dict(kafka_config or {})
        self.topics = topics
        self.schema = schema
        self.batch_size = batch_size
        self.loader_kwargs = loader_kwargs

    def __iter__(self) -> Iterator[Batch]:
        with Loader(self.kafka_config, self.topics, self.schema, self.batch_size,
                    **self.loader_kwargs) as loader:
            yield from loader
