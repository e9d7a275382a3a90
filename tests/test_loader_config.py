"""The Loader's own settings: where its pool lives, how it shuts down. No broker."""

from __future__ import annotations

import numpy as np
import torch

import kfeed
from kfeed.sources import MemorySource
from kfeed.synthetic import synthetic_columns, synthetic_schema

SCHEMA = synthetic_schema()


def test_a_cpu_loader_never_pins_even_where_cuda_exists(monkeypatch) -> None:
    # Pinning is for the copy to a CUDA device; on a CUDA machine a
    # device="cpu" loader pinned anyway. Here CUDA is made to look present:
    # a pin would fail, so the loader must not ask for one.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    values = SCHEMA.encode_blocks(synthetic_columns(np.arange(64)), 8)
    with kfeed.Loader(None, "memory", SCHEMA, 16, device="cpu", until="end",
                      source=MemorySource(values)) as ld:
        assert ld._pool.pinned is False
        assert sum(b.size for b in ld) == 64
