"""Compile a kernel as one XLA program when it is called outside a trace.

Inside a user's `jax.jit`/`vmap`/`grad` a kernel is plain traced code. Called eagerly
(notebooks, tests, host-side metrics) it would otherwise dispatch op by op, compiling
every primitive separately; here it is compiled once per (shapes, static arguments).
Python scalars, strings, None and tuples are static: argument checks see concrete
values and run while tracing, before anything is compiled. Pass values that change
every call (scheduled coefficients) as arrays, or they recompile.
"""

from __future__ import annotations

import functools
import inspect

import jax
import numpy as np


def _is_dynamic(value) -> bool:
    return isinstance(value, (jax.Array, np.ndarray))


def compiled_when_eager(f):
    """Decorator: jit `f` with its non-array arguments static, unless already traced."""
    signature = inspect.signature(f)
    compiled = {}

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
            return f(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs).arguments
        arguments = {k: np.asarray(v) if isinstance(v, list) else v
                     for k, v in arguments.items()}
        static = tuple(sorted(k for k, v in arguments.items() if not _is_dynamic(v)))
        if static not in compiled:
            compiled[static] = jax.jit(f, static_argnames=static)
        return compiled[static](**arguments)

    return wrapper
