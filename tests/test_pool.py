"""BufferPool: the slot state machine, blocking, and no allocation per batch."""

from __future__ import annotations

import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kfeed
from kfeed import ConfigError, KfeedError, Schema
from kfeed.pool import BufferPool, SlotState

SMALL = Schema({"x": ("float32", (4,)), "y": ("int64", ())})
SEEDS = Schema({"features": ("float32", (768,)), "label": ("int64", ()), "id": ("int64", ())})

FREE, FILLING = SlotState.FREE, SlotState.FILLING


def small_pool(slots: int = 3, batch_size: int = 8) -> BufferPool:
    return BufferPool(SMALL, batch_size, slots, pin=False)


class FakeEvent:
    """Stands in for a torch.cuda.Event: counts the waits on it."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def test_a_slot_goes_round_the_cycle():
    pool = small_pool()
    assert pool.states() == [FREE] * 3
    slot = pool.acquire()
    assert slot.state is FILLING
    assert pool.states() == [FILLING, FREE, FREE]
    pool.release(slot)
    assert slot.state is FREE
    assert pool.states() == [FREE] * 3


def test_double_release_raises_and_frees_the_slot_once():
    pool = small_pool(slots=2)
    slot = pool.acquire()
    pool.release(slot)
    with pytest.raises(KfeedError, match="released twice"):
        pool.release(slot)
    # Freed once: the two slots come back, then the pool is empty.
    got = {pool.acquire(timeout=0), pool.acquire(timeout=0)}
    assert got == set(pool.slots)
    assert pool.acquire(timeout=0) is None


OPS = st.lists(
    st.tuples(st.sampled_from(["acquire", "release"]), st.integers(0, 2)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_the_state_machine_matches_its_model(ops):
    pool = small_pool(slots=3)
    model = {s.index: FREE for s in pool.slots}
    for op, i in ops:
        slot = pool.slots[i]
        if op == "acquire":
            got = pool.acquire(timeout=0)
            if FREE in model.values():
                assert got is not None and model[got.index] is FREE
                model[got.index] = FILLING
            else:
                assert got is None
        elif model[i] is FREE:
            with pytest.raises(KfeedError):
                pool.release(slot)
        else:
            pool.release(slot)
            model[i] = FREE
        assert pool.states() == [model[k] for k in range(3)]


def test_acquire_times_out_with_none_when_every_slot_is_taken():
    pool = small_pool(slots=2)
    taken = [pool.acquire(timeout=0), pool.acquire(timeout=0)]
    assert None not in taken
    assert pool.acquire(timeout=0) is None
    t0 = time.monotonic()
    assert pool.acquire(timeout=0.05) is None
    assert time.monotonic() - t0 >= 0.04
    assert pool.states() == [FILLING, FILLING]


def _acquire_in_thread(pool: BufferPool, timeout: float) -> tuple[threading.Thread, list]:
    got: list = []
    started = threading.Event()

    def run() -> None:
        started.set()
        got.append(pool.acquire(timeout=timeout))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait()
    time.sleep(0.05)  # let it block in acquire
    return thread, got


def test_a_release_wakes_a_blocked_acquire():
    pool = small_pool(slots=1)
    slot = pool.acquire()
    thread, got = _acquire_in_thread(pool, timeout=10)
    assert thread.is_alive()
    pool.release(slot)
    thread.join(5)
    assert not thread.is_alive()
    assert got == [slot] and slot.state is FILLING


def test_close_wakes_a_blocked_acquire_from_another_thread():
    pool = small_pool(slots=1)
    pool.acquire()
    thread, got = _acquire_in_thread(pool, timeout=30)
    assert thread.is_alive()
    t0 = time.monotonic()
    pool.close()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - t0 < 5
    assert got == [None]


def test_a_closed_pool_hands_out_nothing_even_with_free_slots():
    pool = small_pool(slots=2)
    pool.close()
    assert pool.acquire() is None
    assert pool.acquire(timeout=0) is None
    assert pool.states() == [FREE, FREE]


def test_acquire_waits_for_the_event_of_the_last_copy_and_resets_the_slot():
    pool = small_pool(slots=1)
    slot = pool.acquire()
    slot.rows, slot.extent = 5, {"x": 3}
    event = FakeEvent()
    pool.release(slot, event=event)
    assert slot.event is event and event.waits == 0
    again = pool.acquire()
    assert again is slot
    assert event.waits == 1 and slot.event is None
    assert (slot.rows, slot.extent) == (0, {})


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (({"x": ("float32", (4,))}, 8), {}, "kfeed.Schema"),
        ((SMALL, 0), {}, "batch_size"),
        ((SMALL, -3), {}, "batch_size"),
        ((SMALL, 2.0), {}, "batch_size"),
        ((SMALL, 8, 0), {}, "slots"),
    ],
)
def test_bad_arguments_raise_config_error(args, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        BufferPool(*args, **kwargs)


def test_pin_true_without_cuda_raises():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: pin=True is allowed here")
    with pytest.raises(ConfigError, match="pin=True needs CUDA"):
        BufferPool(SMALL, 8, pin=True)


def test_pin_defaults_to_cuda_availability():
    pool = BufferPool(SMALL, 8, 2)
    assert pool.pinned == torch.cuda.is_available()
    assert all(t.is_pinned() == pool.pinned for s in pool.slots for t in s.tensors.values())
    assert not small_pool().pinned


def test_slots_hold_one_tensor_per_field_and_nbytes_counts_them():
    pool = small_pool(slots=3, batch_size=8)
    assert len(pool) == 3
    assert pool.nbytes == 3 * 8 * SMALL.record_size == 3 * 8 * 24
    held = 0
    for slot in pool.slots:
        assert list(slot.tensors) == ["x", "y"]
        assert slot.tensors["x"].shape == (8, 4) and slot.tensors["x"].dtype == torch.float32
        assert slot.tensors["y"].shape == (8,) and slot.tensors["y"].dtype == torch.int64
        assert slot.target.capacity == 8
        assert slot.target.pointers.tolist() == [t.data_ptr() for t in slot.tensors.values()]
        held += sum(t.nbytes for t in slot.tensors.values())
    assert held == pool.nbytes
    # Every slot owns distinct memory.
    assert len({s.tensors["x"].data_ptr() for s in pool.slots}) == 3


def test_decoding_into_a_slot_target():
    pool = small_pool(slots=2, batch_size=8)
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    y = np.arange(100, 106, dtype=np.int64)
    values = SMALL.encode_blocks({"x": x, "y": y}, block_records=4)
    slot = pool.acquire()
    result = SMALL.decode_into(values, slot.target)
    assert result == (6, 2, [], 0)
    slot.rows = result.rows
    view = slot.view()
    assert view["x"].shape == (6, 4)
    np.testing.assert_array_equal(view["x"].numpy(), x)
    np.testing.assert_array_equal(view["y"].numpy(), y)


def test_a_thousand_cycles_allocate_nothing():
    # tracemalloc sees Python objects and numpy buffers; data_ptr covers the tensors.
    pool = BufferPool(SEEDS, 1024, 4, pin=False)
    assert pool.nbytes == 4 * 1024 * 3088  # ~12.6 MB
    pointers = [[t.data_ptr() for t in s.tensors.values()] for s in pool.slots]
    tensors = [list(s.tensors.values()) for s in pool.slots]
    values = SEEDS.encode_blocks(
        {
            "features": np.ones((64, 768), np.float32),
            "label": np.arange(64, dtype=np.int64),
            "id": np.arange(64, dtype=np.int64),
        }
    )

    def cycle() -> None:
        # The loader's cycle: take a slot, decode into it, give it back.
        slot = pool.acquire(timeout=1)
        slot.rows = SEEDS.decode_into(values, slot.target).rows
        pool.release(slot)

    for _ in range(10):
        cycle()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(1000):
            cycle()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 4096, f"{peak} bytes traced over 1000 cycles"
    assert [[t.data_ptr() for t in s.tensors.values()] for s in pool.slots] == pointers
    assert all(a is b for s, ts in zip(pool.slots, tensors) for a, b in zip(s.tensors.values(), ts))
    assert pool.states() == [FREE] * 4
    for slot in pool.slots:
        assert slot.rows == 64
        assert slot.view()["label"].tolist() == list(range(64))


def test_a_view_is_new_tensors_over_the_slot_whole_or_cut():
    pool = small_pool(slots=1, batch_size=8)
    slot = pool.acquire()
    slot.rows, slot.extent = 8, {"y": 3}
    view = slot.view()
    assert view["x"].shape == (8, 4) and view["y"].shape == (3,)
    for name, t in view.items():  # never the slot's own tensor: the storage counts it
        assert t is not slot.tensors[name]
        assert t.data_ptr() == slot.tensors[name].data_ptr()
    assert not slot.returned() or not slot.marks
    del view, t
    assert slot.returned() or not slot.marks


def test_buffer_pool_is_public():
    assert kfeed.BufferPool is BufferPool


# -- lent slots (the CPU: a batch's tensors are the slot's; NOTE [ Lent slots ]) ----------


def _fill(pool: BufferPool, value: float) -> tuple:
    slot = pool.acquire(timeout=0)
    slot.tensors["x"].fill_(value)
    slot.rows = 8
    return slot, pool.lend(slot)


def test_only_slots_the_caller_still_holds_count_as_kept_when_most_lent_shrinks():
    # prefetch="auto" made shallower (most_lent 36 -> 5): the slots let go of
    # already were counted as batches the loop keeps, and it was told so.
    pool = small_pool(slots=10)
    pool.most_lent = 8
    for i in range(8):
        _fill(pool, float(i))  # each batch dropped at once, as a training step does
    pool.most_lent = 2
    _fill(pool, 9.0)
    assert pool.forgotten == 0
    kept = [_fill(pool, 10.0 + i) for i in range(12)]  # (a lend forgets one slot at most)
    left = sum(slot not in pool._lent for slot, _batch in kept)
    assert pool.forgotten == left > 0  # the slots let go of are not counted


def test_slots_in_use_are_those_filling_or_held_not_those_let_go_of():
    # A lent slot stays LENT until acquire takes it back: the metric counted
    # every slot the loop had let go of, and read the pool's size all along.
    pool = small_pool(slots=3)
    _slot, held = _fill(pool, 1.0)
    _fill(pool, 2.0)  # let go of at once
    filling = pool.acquire(timeout=0)
    assert pool.states() == [SlotState.LENT, SlotState.LENT, SlotState.FILLING]
    assert pool.in_use() == 2
    del held
    assert pool.in_use() == 1
    pool.release(filling)
    assert pool.in_use() == 0


def test_slots_whose_memory_was_moved_to_send_them_are_not_counted_as_kept():
    # A DataLoader worker sends each batch by share_memory_(), which gives the
    # slot's storage other memory: every slot was counted as one the loop
    # keeps, and the worker warned the user's loop, which kept none.
    pool = small_pool(slots=10)
    pool.most_lent = 2
    for i in range(6):
        _slot, batch = _fill(pool, float(i))
        batch["x"].share_memory_()
        del batch
    assert pool.forgotten == 0
    kept = [_fill(pool, 10.0 + i) for i in range(4)]  # kept as they are: counted
    assert pool.forgotten == 4 - sum(slot in pool._lent for slot, _batch in kept) > 0


@pytest.mark.parametrize("keep", ["tensor", "view", "numpy", "nothing"])
def test_a_lent_slot_is_refilled_only_once_the_caller_lets_go(keep):
    pool = small_pool(slots=1)
    slot, batch = _fill(pool, 1.0)
    assert slot.state is SlotState.LENT
    held = {"tensor": lambda: batch["x"], "view": lambda: batch["x"][2:5],
            "numpy": lambda: batch["x"].numpy(), "nothing": lambda: None}[keep]()
    del batch
    again = pool.acquire(timeout=0)
    if keep == "nothing":
        assert again is slot  # taken back: no allocation
    else:
        assert again is not slot and slot.state is SlotState.LENT
        again.tensors["x"].fill_(2.0)  # the new slot's memory is not the caller's
        assert (np.asarray(held) == 1.0).all()
        del held
        pool.release(again)
        pool.acquire(timeout=0)  # the FREE one first
        assert pool.acquire(timeout=0) is slot  # now let go of


def test_a_lent_tensor_moved_to_shared_memory_is_never_refilled():
    # A DataLoader worker sends a tensor by moving its storage to shared
    # memory; the slot's bound form would still point at the old memory.
    pool = small_pool(slots=1)
    slot, batch = _fill(pool, 1.0)
    batch["x"].share_memory_()
    del batch
    assert pool.acquire(timeout=0) is not slot


def test_past_most_lent_the_oldest_slot_is_the_callers_alone():
    pool = BufferPool(SMALL, 8, 1, pin=False, most_lent=3)
    kept = []
    for i in range(10):
        kept.append(_fill(pool, float(i))[1])
    assert len(pool) <= 4  # the 3 lent ones tracked, and at most one more
    for i, batch in enumerate(kept):  # nothing the caller kept was refilled
        assert (batch["x"] == float(i)).all()
    kept.clear()
    before = len(pool)
    _fill(pool, 0.0)
    assert len(pool) == before  # one of those let go of came back


def test_lending_in_a_steady_loop_allocates_nothing():
    pool = BufferPool(SEEDS, 1024, 2, pin=False)
    values = SEEDS.encode_blocks({"features": np.ones((64, 768), np.float32),
                                  "label": np.arange(64), "id": np.arange(64)})
    batch = None
    pointers = set()
    for _ in range(200):
        slot = pool.acquire(timeout=0)
        slot.rows = SEEDS.decode_into(values, slot.target).rows
        batch = pool.lend(slot)  # the last batch is dropped only now, as a training loop does
        pointers.add(batch["features"].data_ptr())
    assert len(pool) <= 3
    assert len(pointers) <= 3
