"""What the ranks of one job agree on over ``torch.distributed``.

- A bounded epoch's end (``EpochAgreement``): used by the loader's
  ``next()`` when ``until="end"``, so a rank that ran out of data does not
  leave the others waiting in DDP's gradient all-reduce.
- A resumed job's run (``shared_run``): rank 0's run id, which every rank
  writes with its commits, so the ranks believe each other's commits and
  not those of the run that crashed (NOTE [ Whose commits win ] in
  ``kfeed.loader.ledger``).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

__all__ = ["EpochAgreement", "collective_device", "shared_run"]


def collective_device(backend: str) -> torch.device:
    """Where a collective's tensor must live: NCCL takes only CUDA tensors."""
    if str(backend).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shared_run(run: str) -> str:
    """Rank 0's ``run``, on every rank (a collective: every rank calls it once)."""
    return str(from_rank0(run))


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` (any picklable object), on every rank: a collective."""
    box = [value]
    torch.distributed.broadcast_object_list(
        box, src=0, device=collective_device(torch.distributed.get_backend()))
    return box[0]


class EpochAgreement:
    """Ranks of a bounded epoch stop at the same step, so DDP never waits on one that ran out.

    Each step, every rank posts whether it has the batch of the step after
    (an asynchronous ``all_reduce(MIN)``), and reads the answer for this
    step, posted one step earlier: by then it has long arrived, so the step
    waits on no collective and no device sync. The tensor lives on the
    default group's device (CUDA for NCCL, which refuses CPU tensors); on
    CUDA the collective and the copy of its answer to pinned host memory
    run on a side stream, so reading the answer waits for them alone, not
    for the training stream.
    """

    def __init__(self) -> None:
        self.device = collective_device(torch.distributed.get_backend())
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._posted: deque[tuple[Any, torch.Tensor, Any]] = deque()

    def post(self, have: bool) -> None:
        value = torch.tensor([1 if have else 0], dtype=torch.int32)
        if not self.cuda:
            work = torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN,
                                                async_op=True)
            self._posted.append((work, value, None))
            return
        host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        with torch.cuda.stream(self._stream):
            t = value.to(self.device, non_blocking=True)
            work = torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN,
                                                async_op=True)
            work.wait()  # orders the side stream after the collective
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._posted.append((work, host, event))

    def answer(self) -> bool:
        """Whether every rank has the batch of the oldest question still open."""
        work, value, event = self._posted.popleft()
        if event is None:
            work.wait()
        else:
            event.synchronize()
        return bool(value.item())

    def drain(self) -> None:
        while self._posted:
            self.answer()

    def finish(self) -> None:
        """This rank ran out where it had said it has a batch (a rebalance took it back).

        It goes on saying "no batch" to every question the others ask, until
        the answer says the epoch is over for all, so every rank makes the
        same collectives: the others stop at most two steps later, rather
        than wait forever for this rank's next question.
        """
        while self._posted:
            self.post(False)
            if not self.answer():
                self.drain()
