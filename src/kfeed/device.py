"""The last hop of the data flow: a filled pool slot -> tensors on the device.

On CUDA, a side stream copies the slot's pinned tensors to the device with
``non_blocking=True`` and records an event; the caller's current stream waits
on that event, so the training step is ordered after the copy without the CPU
ever blocking, and the pool refills the slot only once the event completes.
On the CPU the copy is a plain memcpy into tensors the caller owns, so a batch
stays valid however long the caller keeps it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kfeed.pool import Slot

__all__ = ["DeviceCopier", "default_device"]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class DeviceCopier:
    """Copies slots to one device; owns the side stream on CUDA."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None

    def copy(self, slot: Slot) -> tuple[dict[str, torch.Tensor], Any]:
        """The slot's filled rows on the device, and the event guarding the slot."""
        src = slot.view()
        if not self.cuda:
            return {name: _copy_single_threaded(t) for name, t in src.items()}, None
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            out = {name: t.to(self.device, non_blocking=True) for name, t in src.items()}
            event = torch.cuda.Event()
            event.record(self._stream)
        current.wait_event(event)
        for t in out.values():
            # The tensors were allocated on the side stream; tell the caching
            # allocator they are used on the caller's stream too.
            t.record_stream(current)
        return out, event


def _copy_single_threaded(t: torch.Tensor) -> torch.Tensor:
    """A plain memcpy into a new tensor.

    ``Tensor.clone`` runs on torch's OpenMP pool, whose threads fight the
    loader's thread, librdkafka and the broker for the cores; one memcpy is
    several times faster here (see bench/RESULTS.md).
    """
    out = torch.empty_like(t)
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: copy the 2-byte words
        np.copyto(out.view(torch.int16).numpy(), t.view(torch.int16).numpy())
    else:
        np.copyto(out.numpy(), t.numpy())
    return out
