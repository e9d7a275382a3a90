"""What a batch is handed out as: torch tensors, numpy arrays, JAX arrays or Arrow.

Where it sits: the very last hop, in the caller's ``next()``, after the
device stage (``kfeed.device``). The loader works in torch tensors
throughout; ``Loader(..., output=...)`` only changes the type of the
values handed out, never the pipeline, the ledger or ``state_dict()``:

- ``"torch"`` (default): a ``Batch`` of tensors on ``device``.
- ``"numpy"``: a ``Batch`` of numpy arrays (``Tensor.numpy()``: no copy).
  Host memory: the device is the CPU.
- ``"jax"``: a ``Batch`` of JAX arrays through DLPack, with no copy: on
  the GPU when torch and JAX both have one (the CUDA copy is ordered
  before JAX reads it by the DLPack stream protocol), else on the CPU.
  A 64-bit field needs ``jax.config.update("jax_enable_x64", True)``
  (JAX would narrow it, and copy). Without it, the loader's own int64
  arrays come as int32 copies, whose values fit: a jagged field's
  ``NAME_offsets``, and packed batches' ``tokens`` and ``position_ids``.
- ``"arrow"``: a ``pyarrow.RecordBatch``, for Ray Data, Polars and DuckDB,
  with no copy but for bool fields (Arrow packs them in bits). A field of
  shape ``()`` is a primitive column, ``(k,)`` a ``fixed_size_list``, more
  dimensions Arrow's ``fixed_shape_tensor``, a variable-length field a
  ``large_list``. A RecordBatch has no room for ``Batch.offsets``: the
  loader's ``state_dict()`` says where to resume.

NOTE [ Output lifetime ]
~~~~~~~~~~~~~~~~~~~~~~~~
Every output is a view of the batch's memory, not a copy, so every output
keeps the torch path's guarantees: a batch stays valid until the caller
lets go of it, however many ``next()`` calls later, and never less than
until the next ``next()``. On the CPU the pool slot under it is refilled
only once nothing refers to it: a numpy array, a DLPack capsule held by
JAX and an Arrow buffer each keep a reference to the slot's torch storage,
which the pool counts (NOTE [ Lent slots ] in ``kfeed.pool``). The records
are committed after the step, as with torch: once the caller asks for the
next batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kfeed.errors import ConfigError
from kfeed.schema import Schema

__all__ = ["OUTPUTS", "check_output", "converter"]

OUTPUTS = ("torch", "numpy", "jax", "arrow")

# Outputs that live in host memory: their loader's device is the CPU.
_HOST = ("numpy", "arrow")


def _device_type(device: Any) -> str | None:
    """``device``'s type; None for what is not a torch device (the loader's
    device check refuses it next, in the words it has for every output)."""
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        return None


def check_output(output: Any, schema: Schema, device: Any, packed: bool) -> Any:
    """Refuse what ``output`` cannot hold; the device it implies when none is given."""
    if output not in OUTPUTS:
        raise ConfigError(f"output must be one of {', '.join(map(repr, OUTPUTS))}, "
                          f"got {output!r}")
    if output == "torch":
        return device
    if output in _HOST:
        if device is not None and _device_type(device) not in ("cpu", None):
            raise ConfigError(f"output={output!r} gives batches in host memory: leave device "
                              f"unset or pass device='cpu', not {str(device)!r}")
        bf16 = [f.name for f in schema.fields if f.dtype == "bfloat16"]
        if bf16:
            raise ConfigError(f"field {bf16[0]!r} is bfloat16, which {output} has no type for: "
                              f"use output='torch' or 'jax', or a float16/float32 field")
        if output == "arrow":
            _module("pyarrow", output)
            if packed:
                raise ConfigError("output='arrow' gives one row per record; pack= gives token "
                                  "rows with cu_seqlens of another length: use output='torch', "
                                  "'numpy' or 'jax'")
        return "cpu" if device is None else device
    jax = _module("jax", output)
    _check_x64(jax, schema, packed)
    jax_gpu = _has_gpu_backend(jax)
    if device is None:
        return "cuda" if torch.cuda.is_available() and jax_gpu else "cpu"
    if _device_type(device) == "cuda" and not jax_gpu:
        raise ConfigError(f"device={str(device)!r}, but this JAX has no GPU backend: install "
                          f"JAX's CUDA build, or pass device='cpu'")
    return device


def _check_x64(jax: Any, schema: Schema, packed: bool) -> None:
    """Refuse a schema whose values JAX, with its 64-bit types off, would narrow."""
    if jax.config.jax_enable_x64:
        return
    wide = [f for f in schema.fields if f.storage.itemsize == 8]
    if wide:
        raise ConfigError(f"field {wide[0].name!r} is {wide[0].dtype}, but JAX has 64-bit "
                          f"types off and would narrow it: call jax.config.update("
                          f"'jax_enable_x64', True) first, or make it a 32-bit field")
    if packed and schema.varlen is not None and schema.varlen.dtype == "uint32":
        # Packed rows hold token ids as int64, narrowed to int32 for such a JAX.
        raise ConfigError(f"field {schema.varlen.name!r} is uint32, whose ids past 2**31 "
                          f"packed rows would give JAX with 64-bit types off as negative "
                          f"int32: call jax.config.update('jax_enable_x64', True) first, "
                          f"or make it an int32 field")


def converter(output: str, schema: Schema, packed: bool) -> Callable[[Any], Any] | None:
    """The function from a torch ``Batch`` to what ``next()`` hands out; None for torch."""
    if output == "numpy":
        return _as_numpy
    if output == "jax":
        import jax

        _register_pytree(jax)

        def as_jax(batch: Any) -> Any:
            # Looked at each batch: a loader made inside ``with jax.enable_x64():``
            # and read outside it had its int64 values cut to int32, silently.
            _check_x64(jax, schema, packed)
            return _as_jax(batch, not jax.config.jax_enable_x64)

        return as_jax
    if output == "arrow":
        return lambda batch: _as_arrow(batch, schema)
    return None


def _module(name: str, output: str) -> Any:
    try:
        return __import__(name)
    except ImportError:
        raise ConfigError(f"output={output!r} needs {name}: pip install {name}") from None


def _has_gpu_backend(jax: Any) -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # no such backend in this build of jaxlib
        return False


def _as_numpy(batch: Any) -> Any:
    from kfeed.loader import Batch

    return Batch({k: t.numpy() for k, t in batch.items()}, batch.size, batch.offsets, batch.pack)


_registered = False


def _register_pytree(jax: Any) -> None:
    """Make ``Batch`` a JAX pytree of its arrays, by field name, so that a batch goes
    into ``jax.jit`` and ``jax.tree_util`` as a dict does (an unregistered dict
    subclass is one opaque leaf, which ``jit`` refuses): its leaves in the order
    of the sorted names, as a dict's. Taken apart and put back together by JAX,
    it is a plain dict: its offsets and pack info stay outside. (A dict is
    another kind of node: to map over a batch and a tree made from it at once,
    pass ``dict(batch)``.)"""
    global _registered
    if _registered:
        return
    from kfeed.loader import Batch

    tree = jax.tree_util
    tree.register_pytree_with_keys(
        Batch, lambda b: ([(tree.DictKey(k), b[k]) for k in sorted(b)], tuple(sorted(b))),
        lambda keys, values: dict(zip(keys, values, strict=True)),
        flatten_func=lambda b: ([b[k] for k in sorted(b)], tuple(sorted(b))))
    _registered = True


def _as_jax(batch: Any, narrow: bool) -> Any:
    import jax.dlpack

    from kfeed.loader import Batch

    out = {}
    for k, t in batch.items():
        if narrow and t.dtype == torch.int64:  # the loader's own: offsets, packed rows
            t = t.to(torch.int32)
        out[k] = jax.dlpack.from_dlpack(t)
    return Batch(out, batch.size, batch.offsets, batch.pack)


def _as_arrow(batch: Any, schema: Schema) -> Any:
    from kfeed.arrowformat import record_batch

    # The Arrow types kfeed writes its Arrow messages in.
    return record_batch(schema, {
        f.name: (batch[f.name].numpy(), batch[f"{f.name}_offsets"].numpy()) if f.variable
        else batch[f.name].numpy() for f in schema.fields})
