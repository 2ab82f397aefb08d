"""Argument checks shared by the kernels.

Every check runs in Python on static shapes and dtypes, so it fires before tracing (and
also inside `jax.jit`/`jax.vmap`, where shapes are still static). Errors name the kernel,
the argument and what was expected, so a wrong call fails at the call site instead of as
an opaque broadcasting error deep inside XLA.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _shape_str(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def array(fn: str, name: str, x, *, rank: int | None = None, layout: str = "",
                    min_rank: int | None = None) -> jax.Array:
    """Converts `x` to an array and checks its rank.

    Args:
        fn: name of the calling kernel, for the message.
        name: name of the argument, for the message.
        x: the value.
        rank: required rank, or None.
        layout: human-readable expected layout such as "[B, T]".
        min_rank: minimum rank, or None.

    Returns:
        `x` as a jax array.
    """
    if x is None:
        raise ValueError(f"{fn}: `{name}` is required (expected an array {layout}).")
    try:
        x = jnp.asarray(x)
    except TypeError as e:
        raise TypeError(f"{fn}: `{name}` must be an array {layout}, got {type(x)!r}.") from e
    if rank is not None and x.ndim != rank:
        raise ValueError(
                f"{fn}: `{name}` must have rank {rank} {layout}, got shape {_shape_str(x.shape)} "
                f"(rank {x.ndim}).")
    if min_rank is not None and x.ndim < min_rank:
        raise ValueError(
                f"{fn}: `{name}` must have rank >= {min_rank} {layout}, got shape "
                f"{_shape_str(x.shape)}.")
    return x


def floating(fn: str, name: str, x, **kwargs) -> jax.Array:
    """An array with a floating dtype, promoted to at least float32."""
    x = array(fn, name, x, **kwargs)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: `{name}` must have a floating dtype, got {x.dtype}.")
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def integer(fn: str, name: str, x, **kwargs) -> jax.Array:
    """An array with an integer dtype."""
    x = array(fn, name, x, **kwargs)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{fn}: `{name}` must have an integer dtype, got {x.dtype}.")
    return x


def boolean(fn: str, name: str, x, **kwargs) -> jax.Array:
    """A mask: bool, or numeric where non-zero means True."""
    x = array(fn, name, x, **kwargs)
    if x.dtype == jnp.bool_:
        return x
    if jnp.issubdtype(x.dtype, jnp.number):
        return x != 0
    raise TypeError(f"{fn}: `{name}` must be a boolean or numeric mask, got {x.dtype}.")


def same_shape(fn: str, name: str, x: jax.Array, ref_name: str, ref_shape) -> None:
    if tuple(x.shape) != tuple(ref_shape):
        raise ValueError(
                f"{fn}: `{name}` must have the shape of `{ref_name}` {_shape_str(ref_shape)}, got "
                f"{_shape_str(x.shape)}.")


def shape(fn: str, name: str, x: jax.Array, expected, layout: str = "") -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(
                f"{fn}: `{name}` must have shape {layout} = {_shape_str(expected)}, got "
                f"{_shape_str(x.shape)}.")


def choice(fn: str, name: str, value, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(
                f"{fn}: unknown {name} {value!r}; allowed values: {', '.join(map(repr, allowed))}.")
    return value


def is_concrete_number(x) -> bool:
    if isinstance(x, numbers.Number):
        return True
    if isinstance(x, (np.ndarray, np.generic)) and np.ndim(x) == 0:
        return True
    return False


def scalar(fn: str, name: str, x, *, low=None, high=None, low_open=False,
                      allow_none=False):
    """A scalar hyper-parameter: a Python number (range-checked) or a scalar array.

    Traced scalars are accepted so hyper-parameters can be scheduled or vmapped over;
    their range cannot be checked before tracing.
    """
    if x is None:
        if allow_none:
            return None
        raise ValueError(f"{fn}: `{name}` is required.")
    if is_concrete_number(x):
        v = float(x)
        if not np.isfinite(v):
            raise ValueError(f"{fn}: `{name}` must be finite, got {x!r}.")
        if low is not None and (v < low or (low_open and v == low)):
            bound = f"> {low}" if low_open else f">= {low}"
            raise ValueError(f"{fn}: `{name}` must be {bound}, got {x!r}.")
        if high is not None and v > high:
            raise ValueError(f"{fn}: `{name}` must be <= {high}, got {x!r}.")
        return x
    x = jnp.asarray(x)
    if x.ndim != 0:
        raise ValueError(f"{fn}: `{name}` must be a scalar, got shape {_shape_str(x.shape)}.")
    return x


def positive_int(fn: str, name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
        raise ValueError(f"{fn}: `{name}` must be a positive Python int (static), got {x!r}.")
    return int(x)

