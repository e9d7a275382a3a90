"""The last hop of the data flow: a filled pool slot -> tensors on the device.

On CUDA the loader's thread calls ``copy`` as soon as a slot is filled, so a
batch is already on its way to the device while the previous step runs, and
``next()`` itself only calls ``adopt``. ``copy`` issues the slot's pinned
tensors to the device on a side stream with ``non_blocking=True`` and
records an event. The loader's thread waits for that event, without the GIL,
before it queues the batch and gives the slot back, so the caller's thread
never waits on the copy: ``adopt`` only records the tensors
(``record_stream``) for the caller's current stream, for the caching
allocator, and ``copy`` has done that already for the stream the caller's
last ``adopt`` saw. While the caller keeps to one stream, ``next()`` makes
one CUDA call a batch, the look at the current stream, where it made five.

On the CPU there is no device stage: the loader's thread lends the slot's
tensors to the caller as they are (``BufferPool.lend``, NOTE [ Lent
slots ]), so a batch stays valid however long the caller keeps it. A memcpy
per batch made in ``next()`` cost the caller 120-160 us per 320 KB packed
batch; made by the loader's thread, it halved the CPU throughput (1.36M to
0.69M samples/s); see bench/RESULTS.md.

Issuing the CUDA copy from ``next()`` instead cost the caller 150 us a batch
on an H200 (three copies, a stream switch, an event, and the GIL lost to the
loader's thread in between), about 7 % of a 2 ms step. The data stall of a
loop that synchronises every 2 ms step fell from 2.5-6.0 % to 1.2-1.4 % once
the thread was woken only after ``adopt`` (NOTE [ Room is made last ] in
``kfeed/loader/feeder.py``) and the copy recorded the tensors itself, and
to 0.7-1.0 % once the thread waited for the copy (bench/RESULTS.md, "GPU
check").
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

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
        # The CUDA device copied to (None off CUDA): "cuda" is the current one of
        # the thread that made the loader.
        self.index = self.device.index if self.device.index is not None else (
            torch.cuda.current_device() if self.cuda else None)
        self._bound: int | None = None  # the thread whose current stream is the side stream
        self._caller: Any = None  # the stream the caller's last adopt ordered

    def bind_thread(self) -> None:
        """Make the side stream the calling thread's current stream (the loader's thread).

        ``copy`` on that thread then skips the stream switch, about a quarter
        of its host time.
        """
        if self.cuda:
            torch.cuda.set_stream(self._stream)
            self._bound = threading.get_ident()

    def copy(self, slot: Slot) -> tuple[dict[str, torch.Tensor], Any, Any]:
        """The slot's filled rows on the device (CUDA), the event that ends the copy,
        and the stream the tensors are already recorded for (or None).

        Any thread may call it. The copy is only issued: the slot must not be
        refilled, nor the tensors go through ``adopt`` to another stream,
        before the event completes.
        The tensors are recorded (``record_stream``) for the stream that the
        caller's last ``adopt`` ordered: the caller then records nothing
        while that stays its stream, three CUDA calls fewer in ``next()``.
        """
        src = slot.view()
        on_side = threading.get_ident() == self._bound
        caller = self._caller
        with contextlib.nullcontext() if on_side else torch.cuda.stream(self._stream):
            out = {name: t.to(self.device, non_blocking=True) for name, t in src.items()}
            event = torch.cuda.Event()
            event.record(self._stream)
            if caller is not None:
                for t in out.values():
                    t.record_stream(caller)
        return out, event, caller

    def adopt(self, tensors: dict[str, torch.Tensor], recorded: Any) -> None:
        """Let the calling thread's current stream use ``tensors``, whose copy is over.

        ``recorded`` is the stream ``copy`` recorded them for.
        """
        if not self.cuda:
            return
        current = torch.cuda.current_stream(self.index)
        if recorded is None or recorded.cuda_stream != current.cuda_stream:
            # The tensors were allocated on the side stream; tell the caching
            # allocator they are used on the caller's stream too.
            for t in tensors.values():
                t.record_stream(current)
            self._caller = current
