"""BufferPool: the preallocated host batches that the codec decodes into.

In the data flow it sits between the loader's background thread, which fills a
free slot straight from Kafka message values, and the device stage
(``kfeed.device``), after which the slot is given back. For a CUDA device
slots are pinned, so the copy runs asynchronously; a slot carries the CUDA
event of its last copy and is not refilled before that event completes.
On the CPU there is no copy: the slot's tensors themselves go to the caller
(``lend``), and the slot is refilled once the caller has let go of them
(NOTE [ Lent slots ]). Either way nothing is allocated per batch in a
steady run.

Slot life cycle::

    FREE --acquire()--> FILLING --release(slot, event=None)--> FREE
                                 --lend(slot)--> LENT --(caller lets go)--> acquire()

NOTE [ Lent slots ]
~~~~~~~~~~~~~~~~~~~
On the CPU a batch's tensors are the slot's own tensors, cut to the rows
filled; the caller may keep them, or views of them, as long as it likes. A
lent slot is filled again only when nothing but the pool refers to its
storage: torch counts the references to a storage (every tensor and view
over it, every numpy array made from one), so ``acquire`` compares each
storage's count with the one taken when the slot was made, and checks that
the storage still has the same memory (``share_memory_()``, as a
DataLoader worker does to send a tensor, or ``resize_`` give a storage new
memory, which the slot's bound form would not follow). A slot the caller
still holds stays lent; past ``most_lent`` slots the oldest is forgotten,
its tensors the caller's alone, and a new slot is made. The price of a
batch is then one allocation, never a copy. Where torch does not count
storage references, every slot lent is forgotten.
"""

from __future__ import annotations

import os
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

# A jagged field's elements per record a slot starts with; it grows as batches need.
JAGGED_START = 64


class SlotState(str, Enum):
    FREE = "free"
    FILLING = "filling"
    LENT = "lent"


# The references to a tensor's storage (tensors, views, numpy arrays over
# it), counted by torch; None where this torch has no such count.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _physical_memory() -> int | None:
    """This machine's memory in bytes; None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _storage_marks(tensors: dict[str, torch.Tensor]
                   ) -> tuple[tuple[Any, int, int, int, int], ...]:
    """Per tensor: its storage, the storage's handle for ``_storage_use_count``, its
    memory's address and size, and the references to it (the mark's own among them).

    The storage object is held, not looked up from the tensor at each check:
    a slot's return is looked at for each field of each batch (0.27 us a
    field, where the look-up made it 0.44).
    """
    if _storage_use_count is None:
        return ()
    marks = []
    for t in tensors.values():
        st = t.untyped_storage()
        marks.append((st, st._cdata, st.data_ptr(), st.nbytes(), _storage_use_count(st._cdata)))
    return tuple(marks)


class Slot:
    """One preallocated batch: a tensor per field, ``[batch_size, *shape]``."""

    __slots__ = ("index", "tensors", "sizes", "nbytes", "target", "state", "event", "rows",
                 "extent", "marks")

    def __init__(self, index: int, tensors: dict[str, torch.Tensor], target: Any) -> None:
        self.index = index
        self.target = target  # the bound form the filler writes through
        self._hold(tensors)
        self.state = SlotState.FREE
        self.event: Any = None  # CUDA event of the last copy out of this slot
        self.rows = 0
        self.extent: dict[str, int] = {}  # entries filled, for tensors not counted in rows

    def _hold(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.sizes = tuple((name, t, len(t)) for name, t in tensors.items())
        self.nbytes = sum(t.nbytes for t in tensors.values())
        self.marks = _storage_marks(tensors)  # see NOTE [ Lent slots ]

    def grow(self, name: str, length: int, pin: bool) -> torch.Tensor:
        """Make ``name`` (a 1-D jagged field's elements) hold ``length``, keeping what it holds.

        Only while FILLING: the old tensor was never lent in this fill.
        """
        old = self.tensors[name]
        new = torch.empty(max(length, 2 * len(old)), dtype=old.dtype, pin_memory=pin)
        used = self.extent.get(name, 0)
        new[:used].copy_(old[:used])
        self._hold({**self.tensors, name: new})
        return new

    def view(self) -> dict[str, torch.Tensor]:
        """The filled rows of each field, as new tensors over the slot's storage.

        A field filled whole is a ``detach()`` of the slot's tensor (a third
        of a slice's cost); either way a new tensor, which the storage's
        reference count sees (NOTE [ Lent slots ]).
        """
        rows, extent = self.rows, self.extent
        out = {}
        for name, t, size in self.sizes:
            n = extent.get(name, rows) if extent else rows
            out[name] = t.detach() if n == size else t[:n]
        return out

    def returned(self) -> bool:
        """Whether a lent slot's tensors are the pool's alone again, on the same memory."""
        if not self.marks:
            return False
        for st, handle, ptr, nbytes, count in self.marks:
            if _storage_use_count(handle) != count or st.data_ptr() != ptr \
                    or st.nbytes() != nbytes:
                return False
        return True

    def moved(self) -> bool:
        """Whether a lent slot's storage has other memory now (``share_memory_()``, as a
        DataLoader worker does to send a batch): not the caller keeping it."""
        return any(st.data_ptr() != ptr or st.nbytes() != nbytes
                   for st, _handle, ptr, nbytes, _count in self.marks)

    def __repr__(self) -> str:
        return f"Slot({self.index}, {self.state.value}, rows={self.rows})"


class BufferPool:
    """A ring of preallocated batches, pinned when CUDA is available.

    ``pin=None`` pins if CUDA is available; ``pin=True`` without CUDA is a
    ``ConfigError``. ``acquire`` blocks (up to ``timeout``) until a slot is
    free and its last device copy has completed. Slots handed to the caller
    with ``lend`` come back by themselves (NOTE [ Lent slots ]); at most
    ``most_lent`` are kept track of.
    """

    def __init__(
        self, schema: Schema, batch_size: int, slots: int = 4, *, pin: bool | None = None,
        packer: Packer | None = None, most_lent: int = 8,
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
        self._packer = packer
        self._made = 0
        try:
            first = self._make()
            # Checked before the rest are made: a million slots take minutes
            # to make, and all of this machine's memory once filled.
            need = slots * sum(t.nbytes for t in first.tensors.values())
            memory = _physical_memory()
            if memory is not None and need > memory:
                raise MemoryError(f"{need} bytes, more than the {memory} bytes of memory here")
            self._slots = [first, *(self._make() for _ in range(slots - 1))]
        except (MemoryError, RuntimeError) as e:  # torch's allocators raise RuntimeError
            what = (f"[{packer.batch_size}, {packer.pack.seq_len}] packed rows" if packer
                    else f"{batch_size} records of {schema.record_size} bytes")
            raise ConfigError(f"the loader's {slots} batches of {what} do not fit in memory "
                              f"here: a smaller prefetch or batch_size, or smaller fields "
                              f"({e})") from None
        self._free: deque[Slot] = deque(self._slots)
        self._lent: deque[Slot] = deque()
        self.most_lent = most_lent
        self.forgotten = 0  # lent slots the caller still held past most_lent, left to it
        self._cond = threading.Condition(threading.Lock())
        self._closed = False

    def _make(self) -> Slot:
        # A packer's slots hold packed token rows instead of the schema's fields.
        target: Any = None
        if self._packer is None and self.schema.varlen is not None:
            tensors = self._jagged_empty()
        elif self._packer is None:
            tensors = self.schema.empty(self.batch_size, like="torch", pin_memory=self.pinned)
            target = self.schema.bind(tensors)
        else:
            tensors = self._packer.empty(like="torch", pin_memory=self.pinned)
            target = self._packer.bind(tensors)
        self._made += 1
        return Slot(self._made - 1, tensors, target)

    def _jagged_empty(self) -> dict[str, torch.Tensor]:
        """A jagged schema's slot: fixed fields ``[batch, *shape]``, the variable-length
        field's elements (1-D, grown as batches need: ``Slot.grow``), ``NAME_offsets``."""
        n, pin = self.batch_size, self.pinned
        out = {}
        for f in self.schema.fields:
            if f.variable:
                out[f.name] = torch.empty(n * JAGGED_START, dtype=f.torch_dtype, pin_memory=pin)
                out[f"{f.name}_offsets"] = torch.empty(n + 1, dtype=torch.int64, pin_memory=pin)
            else:
                out[f.name] = torch.empty((n, *f.shape), dtype=f.torch_dtype, pin_memory=pin)
        return out

    @property
    def nbytes(self) -> int:
        """Host memory held by the pool (lent slots included)."""
        return sum(s.nbytes for s in self._slots)

    @property
    def slots(self) -> tuple[Slot, ...]:
        return tuple(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def states(self) -> list[SlotState]:
        return [s.state for s in self._slots]

    def in_use(self) -> int:
        """Slots filling, being copied, or lent and still held: a lent slot the caller
        let go of is free, though it stays LENT until ``acquire`` takes it back."""
        with self._cond:
            return sum(s.state is not SlotState.FREE and not (
                s.state is SlotState.LENT and s.returned()) for s in self._slots)

    def acquire(self, timeout: float | None = None) -> Slot | None:
        """A FREE slot, now FILLING; None if none frees up within ``timeout``.

        While slots are lent, one the caller let go of is FREE too, and if
        there is none a new slot is made: a lending pool does not wait.
        """
        with self._cond:
            if not self._free and self._lent and not self._closed:
                self._free.append(self._take_back())
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

    def lend(self, slot: Slot) -> dict[str, torch.Tensor]:
        """The filled rows of ``slot``, the caller's to keep; the slot is LENT until let go."""
        with self._cond:
            if slot.state is not SlotState.FILLING:
                raise KfeedError(f"slot {slot.index} lent while {slot.state.value}")
            slot.state = SlotState.LENT
            self._lent.append(slot)
            if len(self._lent) > self.most_lent:
                old = self._lent.popleft()
                self._slots.remove(old)  # the caller's alone now
                # (one let go of already, past a most_lent made smaller, or one
                # whose memory was moved to send it, is no batch the caller keeps)
                self.forgotten += not old.returned() and not old.moved()
        return slot.view()

    def _take_back(self) -> Slot:
        """A lent slot the caller let go of, FREE now, or a new slot (under the lock)."""
        for slot in self._lent:
            if slot.returned():
                self._lent.remove(slot)
                slot.state = SlotState.FREE
                return slot
        slot = self._make()
        self._slots.append(slot)
        return slot

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
