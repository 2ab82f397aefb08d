"""A single-instance traced function whose batches reach the host in ONE call.

Host environments (`arl.envs.host`) answer every row of a turn in one Python call: a
callback per row would serialise the batch. `batched_host_function` wraps a NumPy
function of whole batches as a `jax.custom_batching.custom_vmap` whose batching rule
merges the mapped axes (nested vmaps included) into one leading axis and makes one
ordered `jax.experimental.io_callback`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental import io_callback


def _flatten_batch(args, axis_size, in_batched):
    """Moves every argument to a leading axis of `axis_size` (broadcasting unbatched ones)."""
    return [a if b else jnp.broadcast_to(a, (axis_size,) + jnp.shape(a))
            for a, b in zip(args, in_batched)]


def batched_host_function(host_fn: Callable, result_shapes: Callable[[int], Sequence]):
    """A single-instance traced function whose batches reach the host in ONE call.

    `host_fn(*arrays)` takes NumPy arrays with a leading batch axis [B, ...] and returns
    a tuple of NumPy arrays `result_shapes(B)` (a sequence of `jax.ShapeDtypeStruct` with
    leading axis B). The returned function takes single-instance arrays and returns the
    single-instance results; under `jax.vmap` (any depth) its batching rule merges the
    mapped axes into one leading axis and makes one ordered `io_callback`.
    """

    def call(*args):
        batch = args[0].shape[0]
        return tuple(io_callback(host_fn, tuple(result_shapes(batch)), *args, ordered=True))

    @custom_vmap
    def batched(*args):
        return call(*args)

    @batched.def_vmap
    def batched_rule(axis_size, in_batched, *args):
        # vmap over an already batched call (a vmap of a vmap): fold the new axis into
        # the batch axis, one callback for all.
        args = _flatten_batch(args, axis_size, in_batched)
        inner = args[0].shape[1]
        merged = [a.reshape((axis_size * inner,) + a.shape[2:]) for a in args]
        outs = batched(*merged)
        return (tuple(o.reshape((axis_size, inner) + o.shape[1:]) for o in outs),
                (True,) * len(outs))

    @custom_vmap
    def single(*args):
        outs = batched(*[jnp.asarray(a)[None] for a in args])
        return tuple(o[0] for o in outs)

    @single.def_vmap
    def single_rule(axis_size, in_batched, *args):
        outs = batched(*_flatten_batch(args, axis_size, in_batched))
        return tuple(outs), (True,) * len(outs)

    return single
