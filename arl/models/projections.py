"""Linear projections whose forward value is given: the update's reuse of the rollout's
activations.

An on-policy update (one epoch, one minibatch) differentiates the model at the
parameters that just generated the batch, on the tokens the rollout fed through it. The
rollout's KV-cached decoding already computed every layer's projection outputs y = x W
(+ b) for those tokens; recomputing them is a third of the update's matmul FLOPs (the
forward's 2 N I O of the 6 N I O that forward and backward spend on a projection of I
inputs and O outputs over N tokens). `stored_linear(x, W, b, y)`
returns the recorded y as the forward value and differentiates as the projection does:

    dx = dy W^T,    dW = x^T dy,    db = sum_n dy

so the loss's gradient is the exact gradient of the model at the rollout's activations
(which equal the recomputed ones up to float summation order). `x` is the update's own
input of the projection (norms, attention and the SwiGLU gate still run forward, from
the recorded outputs), so only the weight and input gradients' matmuls remain.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

# The names of a decoder layer's projections, as in its parameter tree and in recorded
# activations (`Transformer(..., return_projections=True)`, `KVCache.projections`).
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LAYER_PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def stored_linear(input_axes: int, x: jax.Array, kernel: jax.Array, bias, stored: jax.Array
                  ) -> jax.Array:
    """`stored` [N, *out], with the gradients of x [N, *in] @ kernel [*in, *out] (+ bias
    [*out] or None) contracting the `input_axes` trailing axes of x: the projection's
    value recorded elsewhere, differentiated as the projection."""
    del x, kernel, bias
    return stored


def _stored_linear_forward(input_axes, x, kernel, bias, stored):
    return stored, (x, kernel, bias, stored)


def _stored_linear_backward(input_axes, residuals, cotangent):
    x, kernel, bias, stored = residuals
    rows = x.shape[0]
    fan_in = math.prod(kernel.shape[:input_axes])
    flat_x = x.reshape(rows, fan_in)
    flat_kernel = kernel.reshape(fan_in, -1)
    flat_dy = cotangent.reshape(rows, flat_kernel.shape[1]).astype(x.dtype)
    dx = jax.lax.dot_general(flat_dy, flat_kernel, (((1,), (1,)), ((), ())))
    d_kernel = jax.lax.dot_general(flat_x, flat_dy, (((0,), (0,)), ((), ())))
    d_bias = None if bias is None else jnp.sum(flat_dy, axis=0).reshape(bias.shape).astype(
        bias.dtype)
    return (dx.reshape(x.shape), d_kernel.reshape(kernel.shape).astype(kernel.dtype), d_bias,
            jnp.zeros_like(stored))


stored_linear.defvjp(_stored_linear_forward, _stored_linear_backward)


class StoredProjection(nn.Module):
    """The parameters of an `nn.DenseGeneral` (kernel [*in, *features], bias [*features])
    under the same name, applied through `stored_linear`: the forward value is `stored`,
    the gradients those of the projection of `x`. Only for applying existing parameters
    (their shapes are checked against the declared ones)."""

    features: tuple[int, ...]
    input_axes: int
    use_bias: bool
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    kernel_init: nn.initializers.Initializer
    bias_init: nn.initializers.Initializer

    @nn.compact
    def __call__(self, x: jax.Array, stored: jax.Array) -> jax.Array:
        """x [N, *in] -> stored [N, *features] (cast to `dtype`)."""
        in_shape = x.shape[x.ndim - self.input_axes:]
        kernel = self.param("kernel", self.kernel_init, in_shape + self.features,
                            self.param_dtype)
        bias = (self.param("bias", self.bias_init, self.features, self.param_dtype)
                if self.use_bias else None)
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        expected = x.shape[:1] + self.features
        if stored.shape != expected:
            raise ValueError(f"{self.name}: recorded projection outputs must have shape "
                             f"{expected} for this input, got {stored.shape}")
        return stored_linear(self.input_axes, x, kernel, bias, stored.astype(x.dtype))


def weight_init(config) -> nn.initializers.Initializer:
    """normal(0, config.initializer_range), the initializer of every weight matrix (the
    Hugging Face convention)."""
    return nn.initializers.normal(stddev=config.initializer_range)


def stored_projection(config, features, input_axes, kernel_names, bias_names, use_bias,
                      name) -> StoredProjection:
    """The parameters of the projection `name` (as its `nn.Dense` / `nn.DenseGeneral`
    declares them), applied with a recorded forward value (`StoredProjection`)."""
    return StoredProjection(
        features=tuple(features), input_axes=input_axes, use_bias=use_bias,
        dtype=config.dtype, param_dtype=config.param_dtype,
        kernel_init=nn.with_logical_partitioning(weight_init(config), kernel_names),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, bias_names), name=name)
