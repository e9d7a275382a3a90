"""BufferPool: the preallocated host batches that the codec decodes into.

In the data flow it sits between the loader's background thread, which fills a
free slot straight from Kafka message values, and the copy of the filled slot
to the device (issued by that thread on CUDA, made by the caller's ``next()``
on the CPU), after which the slot is given back. Slots are pinned when CUDA
is available so that copy can run asynchronously; a slot carries the CUDA
event of its last copy and is not refilled before that event completes.
Nothing is allocated per batch once the pool exists.

Slot life cycle::

    FREE --acquire()--> FILLING --release(slot, event=None)--> FREE
"""

from __future__ import annotations

import threading
from collections import deque
from enum import Enum
from typing import Any

import torch

from kfeed.errors import ConfigError, KfeedError
from kfeed.schema import Schema
from kfeed.tokens import Packer

# Slot and SlotState are the pool's own: the loader fills slots, users never see one.
__all__ = ["BufferPool"]


class SlotState(str, Enum):
    FREE = "free"
    FILLING = "filling"


class Slot:
    """One preallocated batch: a tensor per field, ``[batch_size, *shape]``."""

    __slots__ = ("index", "tensors", "target", "state", "event", "rows", "extent")

    def __init__(self, index: int, tensors: dict[str, torch.Tensor], target: Any) -> None:
        self.index = index
        self.tensors = tensors
        self.target = target  # the bound form the filler writes through
        self.state = SlotState.FREE
        self.event: Any = None  # CUDA event of the last copy out of this slot
        self.rows = 0
        self.extent: dict[str, int] = {}  # entries filled, for tensors not counted in rows

    def view(self) -> dict[str, torch.Tensor]:
        """The filled rows of each field."""
        rows, extent = self.rows, self.extent
        return {name: t[:extent.get(name, rows)] for name, t in self.tensors.items()}

    def __repr__(self) -> str:
        return f"Slot({self.index}, {self.state.value}, rows={self.rows})"


class BufferPool:
    """A ring of preallocated batches, pinned when CUDA is available.

    ``pin=None`` pins if CUDA is available; ``pin=True`` without CUDA is a
    ``ConfigError``. ``acquire`` blocks (up to ``timeout``) until a slot is
    free and its last device copy has completed.
    """

    def __init__(
        self, schema: Schema, batch_size: int, slots: int = 4, *, pin: bool | None = None,
        packer: Packer | None = None,
    ) -> None:
        if not isinstance(schema, Schema):
            raise ConfigError("schema must be a kfeed.Schema")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(slots, int) or slots < 1:
            raise ConfigError(f"slots must be a positive int, got {slots!r}")
        cuda = torch.cuda.is_available()
        if pin is None:
            pin = cuda
        elif pin and not cuda:
            raise ConfigError("pin=True needs CUDA; no CUDA device is available")
        self.schema = schema
        self.batch_size = batch_size
        self.pinned = bool(pin)
        self._slots: list[Slot] = []
        for i in range(slots):
            # A packer's slots hold packed token rows instead of the schema's fields.
            if packer is None:
                tensors = schema.empty(batch_size, like="torch", pin_memory=self.pinned)
                target: Any = schema.bind(tensors)
            else:
                tensors = packer.empty(like="torch", pin_memory=self.pinned)
                target = packer.bind(tensors)
            self._slots.append(Slot(i, tensors, target))
        self._free: deque[Slot] = deque(self._slots)
        self._cond = threading.Condition(threading.Lock())
        self._closed = False

    @property
    def nbytes(self) -> int:
        """Host memory held by the pool."""
        return sum(t.nbytes for s in self._slots for t in s.tensors.values())

    @property
    def slots(self) -> tuple[Slot, ...]:
        return tuple(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def states(self) -> list[SlotState]:
        return [s.state for s in self._slots]

    def acquire(self, timeout: float | None = None) -> Slot | None:
        """A FREE slot, now FILLING; None if none frees up within ``timeout``."""
        with self._cond:
            if not self._free and not self._cond.wait_for(
                lambda: self._free or self._closed, timeout
            ):
                return None
            if self._closed:
                return None
            slot = self._free.popleft()
            slot.state = SlotState.FILLING
        if slot.event is not None:
            # The device may still be reading this slot from its last batch.
            slot.event.synchronize()
            slot.event = None
        slot.rows = 0
        slot.extent = {}
        return slot

    def release(self, slot: Slot, event: Any = None) -> None:
        """Give a slot back; with ``event``, it is refilled only once it completes."""
        with self._cond:
            if slot.state is SlotState.FREE:
                raise KfeedError(f"slot {slot.index} released twice")
            slot.state = SlotState.FREE
            slot.event = event
            self._free.append(slot)
            self._cond.notify()

    def close(self) -> None:
        """Wake every waiter; acquire returns None from now on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __repr__(self) -> str:
        return (
            f"BufferPool(slots={len(self._slots)}, batch_size={self.batch_size}, "
            f"pinned={self.pinned}, nbytes={self.nbytes})"
        )
