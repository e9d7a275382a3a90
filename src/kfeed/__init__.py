"""kfeed: feed GPU training from Apache Kafka.

A producer turns samples into Kafka messages; a loader turns those messages
into batches of tensors already on the GPU, and commits a batch's offsets only
after the training step that used it. The names below are the whole public
API; everything with an underscore is private.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kfeed.errors import (
    ClusterError,
    ConfigError,
    ConsumeError,
    DecodeError,
    KfeedError,
    LoaderError,
    ProduceError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "Schema",
    "DecodeResult",
    "Avro",
    "Protobuf",
    "Json",
    "Arrow",
    "Producer",
    "convert",
    "ConvertStats",
    "Loader",
    "LoaderConfig",
    "Batch",
    "KafkaIterableDataset",
    "Source",
    "MemorySource",
    "Mix",
    "Pack",
    "PackInfo",
    "Packer",
    "Shuffle",
    "ShuffleBuffer",
    "BufferPool",
    "create_topic",
    "group_lag",
    "PartitionLag",
    "murmur2",
    "partition_for",
    "partitions_for",
    "KfeedError",
    "ConfigError",
    "DecodeError",
    "ProduceError",
    "ConsumeError",
    "LoaderError",
    "ClusterError",
]

# Every other name loads its module on first use, so that `import kfeed` is
# quick: the command line starts (and takes a Ctrl-C) at once, and `kfeed
# cluster` and the producer-only paths never import torch.
_LAZY = {
    "create_topic": "kfeed._kafka",
    "Arrow": "kfeed.arrowformat",
    "Avro": "kfeed.avro",
    "ConvertStats": "kfeed.converter",
    "convert": "kfeed.converter",
    "Json": "kfeed.jsonformat",
    "PartitionLag": "kfeed.lag",
    "group_lag": "kfeed.lag",
    "Mix": "kfeed.mix",
    "Protobuf": "kfeed.protobuf",
    "murmur2": "kfeed.partition",
    "partition_for": "kfeed.partition",
    "partitions_for": "kfeed.partition",
    "Producer": "kfeed.producer",
    "DecodeResult": "kfeed.schema",
    "Schema": "kfeed.schema",
    "MemorySource": "kfeed.sources",
    "Source": "kfeed.sources",
    "Pack": "kfeed.tokens",
    "Packer": "kfeed.tokens",
    "PackInfo": "kfeed.tokens",
    "Shuffle": "kfeed.tokens",
    "ShuffleBuffer": "kfeed.tokens",
    "BufferPool": "kfeed.pool",
    "Loader": "kfeed.loader",
    "LoaderConfig": "kfeed.loader",
    "Batch": "kfeed.loader",
    "KafkaIterableDataset": "kfeed.dataset",
}

if TYPE_CHECKING:
    from kfeed._kafka import create_topic
    from kfeed.arrowformat import Arrow
    from kfeed.avro import Avro
    from kfeed.converter import ConvertStats, convert
    from kfeed.dataset import KafkaIterableDataset
    from kfeed.jsonformat import Json
    from kfeed.lag import PartitionLag, group_lag
    from kfeed.loader import Batch, Loader, LoaderConfig
    from kfeed.mix import Mix
    from kfeed.partition import murmur2, partition_for, partitions_for
    from kfeed.pool import BufferPool
    from kfeed.producer import Producer
    from kfeed.protobuf import Protobuf
    from kfeed.schema import DecodeResult, Schema
    from kfeed.sources import MemorySource, Source
    from kfeed.tokens import Pack, Packer, PackInfo, Shuffle, ShuffleBuffer


# Modules the docs call into by name (kfeed.avro.writer_schema, kfeed.metrics.serve).
_MODULES = ("avro", "metrics", "protobuf")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    import importlib

    if module is None and name in _MODULES:
        return importlib.import_module(f"kfeed.{name}")
    if module is None:
        raise AttributeError(f"module 'kfeed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
