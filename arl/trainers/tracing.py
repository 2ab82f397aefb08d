"""Tracing helpers for the compiled step."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.extend


def trace_once(fn: Callable, *example_args) -> tuple[Callable, Any]:
    """Traces `fn` once; returns (a function replaying that trace, its output shapes).

    For a `lax.cond` whose other branch must produce outputs shaped like `fn`'s (zeros,
    the inputs unchanged): `jax.eval_shape(fn, ...)` inside that branch traces `fn` a
    second time, which for a whole update (model forward, backward, optimizer) costs
    seconds of Python per compile. The replay binds the recorded primitives again, in
    the same order, so the program is the one `fn` itself would give.

    Args:
        fn: a function of pytrees of arrays (it may close over tracers of the enclosing
            trace).
        *example_args: arguments with the shapes and dtypes `fn` will be called with.

    Returns:
        (replay, shapes): `replay(*args)` computes `fn(*args)`; `shapes` is the pytree
        of `jax.ShapeDtypeStruct` of its outputs.
    """
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*example_args)
    out_tree = jax.tree.structure(shapes)

    def replay(*args):
        flat = jax.tree.leaves(args)
        return jax.tree.unflatten(out_tree, jax.extend.core.jaxpr_as_fun(closed)(*flat))

    return replay, shapes
