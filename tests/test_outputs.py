"""Loader(output=...): numpy, JAX and Arrow batches keep torch's guarantees (no broker)."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
import pyarrow as pa
import pytest

import kfeed
from kfeed.loader import Loader, memory_loader

SCHEMA = kfeed.Schema({"id": ("int32", ()), "x": ("float32", (3,)), "m": ("float16", (2, 2)),
                       "flag": ("bool", ())})
JAGGED = kfeed.Schema({"id": ("int32", ()), "tokens": ("int32", (None,))})


def columns(ids: np.ndarray) -> dict[str, np.ndarray]:
    return {"id": ids.astype(np.int32),
            "x": np.stack([ids, -ids, ids * 0.5], 1).astype(np.float32),
            "m": (ids[:, None, None] * np.arange(1, 5).reshape(1, 2, 2) % 1000).astype(np.float16),
            "flag": ids % 3 == 0}


def blocks(start: int, n: int, per_block: int = 50) -> list[bytes]:
    return SCHEMA.encode_blocks(columns(np.arange(start, start + n)), per_block)


def documents(ids: np.ndarray) -> list[np.ndarray]:
    return [(np.arange(i % 7) + i).astype(np.int32) for i in ids]


def jagged_blocks(n: int) -> list[bytes]:
    ids = np.arange(n)
    return JAGGED.encode_blocks({"id": ids.astype(np.int32), "tokens": documents(ids)}, 25)


def as_columns(batch: object, output: str) -> dict[str, np.ndarray]:
    """A batch of any output as numpy columns, copied."""
    if output == "arrow":
        assert isinstance(batch, pa.RecordBatch)
        out = {"id": batch["id"].to_numpy().copy(),
               "x": batch["x"].values.to_numpy().reshape(-1, 3).copy(),
               "m": batch["m"].to_numpy_ndarray().copy(),
               "flag": batch["flag"].to_numpy(zero_copy_only=False).copy()}
        return out
    assert isinstance(batch, kfeed.Batch)
    return {k: np.array(v.numpy() if output == "torch" else v) for k, v in batch.items()}


def _jax_x64(on: bool) -> Iterator[None]:
    """JAX with 64-bit types on or off for one test (a process-wide switch)."""
    was = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", on)
    yield
    jax.config.update("jax_enable_x64", was)


@pytest.fixture
def jax_x64() -> Iterator[None]:
    yield from _jax_x64(True)


@pytest.fixture
def jax_x32() -> Iterator[None]:
    yield from _jax_x64(False)


@pytest.mark.parametrize("output", ["torch", "numpy", "jax", "arrow"])
def test_every_output_holds_every_record_once_and_kept_batches_stay_valid(output: str) -> None:
    # Every batch is kept to the end: 40 of them, far more than the pool's
    # slots, so a slot refilled under a numpy array, a JAX array or an Arrow
    # buffer would show here as wrong values.
    with memory_loader({0: blocks(0, 2000), 1: blocks(2000, 1000, 37)}, SCHEMA, 75,
                       until="end", device="cpu", output=output) as loader:
        kept = list(loader)
    kinds = {"torch": "Tensor", "numpy": "ndarray", "jax": "ArrayImpl"}
    if output != "arrow":
        assert all(type(b["x"]).__name__ == kinds[output] for b in kept)
        assert all(b.size == len(b["id"]) for b in kept)
    got = [as_columns(b, output) for b in kept]
    ids = np.concatenate([g["id"] for g in got])
    assert np.array_equal(np.sort(ids), np.arange(3000))
    for g in got:
        want = columns(g["id"].astype(np.int64))
        for name in want:
            assert np.array_equal(g[name], want[name]), name


def test_a_jax_batch_goes_into_jit_and_tree_map_as_a_dict_does(jax_x64) -> None:
    # A dict subclass JAX did not know was one opaque leaf: jit refused the
    # batch ("Error interpreting argument ... of type Batch").
    import jax.numpy as jnp

    step = jax.jit(lambda b: jnp.sum(b["x"]) + jnp.sum(b["id"]))
    with memory_loader(blocks(0, 200), SCHEMA, 50, until="end", device="cpu",
                       output="jax") as loader:
        batch = next(loader)
        assert float(step(batch)) == float(step(dict(batch)))
        doubled = jax.tree_util.tree_map(lambda a: a * 2, batch)
        assert list(doubled) == sorted(batch)
        assert np.array_equal(np.asarray(doubled["id"]), 2 * np.asarray(batch["id"]))
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(batch)]
        assert paths == [f"['{k}']" for k in sorted(batch)]
        # Its leaves in a dict's order (they came in the fields' order): a
        # batch's leaves and those of a tree JAX made from it paired wrongly.
        assert list(batch) != sorted(batch)
        leaves = jax.tree_util.tree_leaves(batch)
        assert all(a is b for a, b in zip(leaves, jax.tree_util.tree_leaves(dict(batch)),
                                          strict=True))
        summed = jax.tree_util.tree_map(lambda a, b: a + b, dict(batch), doubled)
        assert np.array_equal(np.asarray(summed["id"]), 3 * np.asarray(batch["id"]))


@pytest.mark.parametrize("output", ["numpy", "jax", "arrow"])
def test_batches_let_go_of_are_refilled_so_the_pool_stays_bounded(output: str) -> None:
    with memory_loader(blocks(0, 1000), SCHEMA, 100, loop=True, device="cpu",
                       output=output) as loader:
        for _ in range(600):
            next(loader)
        # 600 batches through a few slots: a slot whose batch the caller never
        # let go of would be forgotten and a new one made for each.
        assert loader._pool._made <= 8


@pytest.mark.parametrize("output", ["numpy", "jax", "arrow"])
def test_commits_trail_the_step_and_state_resumes_exactly(output: str) -> None:
    values = {0: blocks(0, 1200), 1: blocks(1200, 800, 37)}
    source = kfeed.MemorySource(values)
    first = Loader(None, "memory", SCHEMA, 64, source=source, until="end", device="cpu",
                   commit_interval_ms=0, output=output)
    seen = [as_columns(next(first), output)["id"]]
    assert source.committed_positions == {}  # the step using the first batch is not over
    for _ in range(6):
        seen.append(as_columns(next(first), output)["id"])
    assert source.committed_positions  # the steps before the last one
    state = first.state_dict()
    first.close()
    second = memory_loader(values, SCHEMA, 64, until="end", device="cpu", output=output)
    second.load_state_dict(state)
    seen += [as_columns(b, output)["id"] for b in second]
    ids = np.concatenate(seen)
    assert len(ids) == len(np.unique(ids)) == 2000


def test_arrow_batches_are_tables_of_arrow_types() -> None:
    with memory_loader(blocks(0, 300), SCHEMA, 128, until="end", device="cpu",
                       output="arrow") as loader:
        table = pa.Table.from_batches(list(loader))
    assert table.num_rows == 300
    assert table.schema.field("id").type == pa.int32()
    assert table.schema.field("x").type == pa.list_(pa.float32(), 3)
    assert table.schema.field("m").type == pa.fixed_shape_tensor(pa.float16(), [2, 2])
    assert table.schema.field("flag").type == pa.bool_()
    assert table["flag"].to_pylist()[:4] == [True, False, False, True]


@pytest.mark.parametrize("output", ["numpy", "arrow", "jax"])
def test_a_jagged_field_keeps_its_documents(output: str, jax_x32: None) -> None:
    with memory_loader(jagged_blocks(500), JAGGED, 64, until="end", device="cpu",
                       output=output) as loader:
        kept = list(loader)
    docs = {}
    for b in kept:
        if output == "arrow":
            assert b.schema.field("tokens").type == pa.large_list(pa.int32())
            for i, doc in zip(b["id"].to_pylist(), b["tokens"].to_pylist(), strict=True):
                docs[i] = doc
            continue
        offsets = np.asarray(b["tokens_offsets"])
        if output == "jax":  # 64-bit types off: the offsets come as int32
            assert offsets.dtype == np.int32
        tokens = np.asarray(b["tokens"])
        for k, i in enumerate(np.asarray(b["id"])):
            docs[int(i)] = tokens[offsets[k]:offsets[k + 1]].tolist()
    want = documents(np.arange(500))
    assert sorted(docs) == list(range(500))
    assert all(docs[i] == want[i].tolist() for i in range(500))


def test_jax_with_64_bit_types_on_takes_int64_fields(jax_x64: None) -> None:
    schema = kfeed.Schema({"id": ("int64", ()), "w": ("float64", (2,))})
    ids = np.arange(400)
    values = schema.encode_blocks({"id": ids, "w": np.stack([ids, ids / 2], 1)}, 50)
    with memory_loader(values, schema, 100, until="end", device="cpu", output="jax") as loader:
        kept = list(loader)
    assert all(b["id"].dtype == np.int64 and b["w"].dtype == np.float64 for b in kept)
    assert np.array_equal(np.concatenate([np.asarray(b["id"]) for b in kept]), ids)


def test_jax_64_bit_types_turned_off_after_the_loader_was_made_are_refused(jax_x64) -> None:
    # Checked only when the loader was made: one made inside
    # ``with jax.enable_x64():`` and read outside it cut 2**40 + 100 to 100.
    schema = kfeed.Schema({"id": ("int64", ())})
    ids = np.arange(300) + 2**40
    values = schema.encode_blocks({"id": ids}, 50)
    with memory_loader(values, schema, 100, until="end", device="cpu", output="jax") as loader:
        first = next(loader)
        jax.config.update("jax_enable_x64", False)
        with pytest.raises(kfeed.ConfigError, match=r"^field 'id' is int64, but JAX has 64-bit "
                                                     r"types off and would narrow it"):
            next(loader)
        jax.config.update("jax_enable_x64", True)
        rest = list(loader)  # the batch refused comes again: none is skipped
    got = np.concatenate([np.asarray(b["id"]) for b in [first, *rest]])
    assert got.dtype == np.int64 and np.array_equal(np.sort(got), ids)


def test_packed_batches_come_as_numpy() -> None:
    schema = kfeed.Schema({"tokens": ("int32", (None,))})
    values = schema.encode_blocks({"tokens": documents(np.arange(300))}, 30)
    with memory_loader(values, schema, 8, until="end", device="cpu", output="numpy",
                       pack=kfeed.Pack(32, eos_id=None)) as loader:
        kept = list(loader)
    assert all(isinstance(b["tokens"], np.ndarray) and b["tokens"].shape[1] == 32 for b in kept)
    assert all(b.pack is not None for b in kept)
    total = sum(int(b.pack.tokens) for b in kept)
    assert total == sum(len(d) for d in documents(np.arange(300)))


def test_what_an_output_cannot_hold_is_one_clear_error(jax_x32: None) -> None:
    def make(schema: kfeed.Schema = SCHEMA, **kwargs: object) -> None:
        memory_loader([], schema, 8, until="end", **kwargs).close()

    with pytest.raises(kfeed.ConfigError, match="output must be one of 'torch', 'numpy'"):
        make(output="tensorflow")
    with pytest.raises(kfeed.ConfigError, match="host memory: leave device unset"):
        make(output="numpy", device="cuda")
    # A device torch does not know: torch's own RuntimeError came out of numpy, arrow, jax.
    for output in ("torch", "numpy", "arrow", "jax"):
        with pytest.raises(kfeed.ConfigError, match="^device 'gpu' is not a torch device: "):
            make(output=output, device="gpu")
    with pytest.raises(kfeed.ConfigError, match="bfloat16, which arrow has no type for"):
        make(kfeed.Schema({"h": ("bfloat16", (4,))}), output="arrow")
    with pytest.raises(kfeed.ConfigError, match="pack= gives token rows"):
        make(kfeed.Schema({"tokens": ("int32", (None,))}), output="arrow", pack=kfeed.Pack(16, eos_id=None))
    with pytest.raises(kfeed.ConfigError, match="'id' is int64, but JAX has 64-bit types"):
        make(kfeed.Schema({"id": ("int64", ())}), output="jax")
    # Packed rows hold ids as int64: a uint32 id of 3,000,000,000 came out -1,294,967,296.
    with pytest.raises(kfeed.ConfigError, match="'tokens' is uint32, whose ids past 2..31 "
                                                "packed rows would give JAX"):
        make(kfeed.Schema({"tokens": ("uint32", (None,))}), output="jax",
             pack=kfeed.Pack(16, eos_id=0))
    make(kfeed.Schema({"tokens": ("uint32", (None,))}), output="jax")  # jagged: uint32 as is
    if jax.default_backend() == "cpu":
        with pytest.raises(kfeed.ConfigError, match="this JAX has no GPU backend"):
            make(output="jax", device="cuda")
