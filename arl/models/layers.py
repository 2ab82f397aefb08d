"""The decoder layer's blocks other than attention: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from arl.models.activations import swiglu
from arl.models.partitioning import MLP, constrain_activation
from arl.models.projections import stored_projection, weight_init
from arl.models.transformer_config import TransformerConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, statistics in float32 (Zhang & Sennrich 2019)."""

    eps: float
    dtype: Any
    param_dtype: Any
    axis: str = "embed"  # logical name of the normalised axis ("head_dim": Qwen3's q/k norms)

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones,
                                                                 (self.axis,)),
                           (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # HF casts back to the activation dtype before the scale multiply; keep that order
        # so bfloat16 checkpoints reproduce exactly. The product of two bfloat16 numbers
        # is exact in float32, so multiplying there and rounding once gives the same
        # values, and the backward pass then sums the scale's gradient over the tokens
        # in float32 (a bfloat16 sum of B*T products keeps ~3 significant digits).
        return (normed.astype(self.dtype).astype(jnp.float32)
                * scale.astype(self.dtype).astype(jnp.float32)).astype(self.dtype)

class SwiGLU(nn.Module):
    """down(silu(gate x) * up x) (Shazeer 2020, arXiv 2002.05202).

    The three projections run on the tokens flattened to [B*T, D] (a free reshape): on
    [B, T, D] the weight gradients contract two axes (B, T), and XLA's CPU backend then
    wrote the [B, T, mlp] gradient transposed to [mlp, B*T] before each weight-gradient
    matmul, about a third of the modest peer step (docs/performance.md, "Attention and
    the update"); flattened, every matmul is a plain 2-D one with no transposed copy.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, stored=None):
        """x [..., d_model] -> (output [..., d_model], the projections' outputs {name:
        [..., features]}); `stored`: recorded outputs of the three projections, taken as
        their forward values (`StoredProjection`), or None."""
        cfg = self.config
        leading = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        produced = {}

        def dense(x, features, names, name):
            if stored is None:
                out = nn.Dense(features, use_bias=cfg.mlp_bias, dtype=cfg.dtype,
                               param_dtype=cfg.param_dtype,
                               kernel_init=nn.with_logical_partitioning(weight_init(cfg), names),
                               bias_init=nn.with_logical_partitioning(nn.initializers.zeros,
                                                                      names[-1:]),
                               name=name)(x)
            else:
                out = stored_projection(cfg, (features,), 1, names, names[-1:], cfg.mlp_bias,
                                        name)(x, stored[name].reshape(-1, features))
            produced[name] = out.reshape(leading + (features,))
            return out

        gate = dense(x, cfg.mlp_dim, ("embed", "mlp"), "gate_proj")
        up = dense(x, cfg.mlp_dim, ("embed", "mlp"), "up_proj")
        # The activation sharding names [B, T, mlp]: constrained in that shape (free
        # reshapes; no operation at all without a mesh).
        hidden = constrain_activation(
            swiglu(gate, up).reshape(leading + (cfg.mlp_dim,)),
            MLP).reshape(-1, cfg.mlp_dim)
        out = dense(hidden, cfg.d_model, ("mlp", "embed"), "down_proj")
        return out.reshape(leading + (cfg.d_model,)), produced
