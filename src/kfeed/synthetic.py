"""The seeds' synthetic workload: samples that ``kfeed produce --synthetic`` sends.

In the data flow it stands where a real dataset would: ids -> columns
(768 float32 features, an int64 label, the int64 id) -> ``kfeed.Producer``.
``kfeed train --task mlp`` reads the same schema back, and tests and
benchmarks use these columns as their oracle. Numpy only: no torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CLASSES", "FEATURES", "synthetic_columns", "synthetic_schema"]

FEATURES = 768
CLASSES = 10


def synthetic_schema() -> Any:
    """``features`` float32[768], ``label`` int64, ``id`` int64: what ``kfeed train`` reads."""
    from kfeed.schema import Schema

    return Schema({"features": ("float32", (FEATURES,)), "label": ("int64", ()),
                   "id": ("int64", ())})


def synthetic_columns(ids: Any) -> dict[str, Any]:
    """Samples that depend on their id alone, with a label learnable from them."""
    import numpy as np

    ids = np.asarray(ids, dtype=np.int64)
    mixed = (ids[:, None] * 2654435761 + np.arange(FEATURES) * 40503) % 65521
    features = (mixed.astype(np.float32) / 65521.0) - 0.5
    label = features[:, :CLASSES].argmax(axis=1).astype(np.int64)
    return {"features": features, "label": label, "id": ids}
