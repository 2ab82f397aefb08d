"""The decoder's hyper-parameters (`TransformerConfig`) and what follows from them alone."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from arl.models import attention_kernels as attention_lib
from arl.models.rope import Llama3RopeScaling


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of the decoder. Frozen and hashable (a static module attribute).

    Attributes:
      vocab_size: number of token ids.
      qk_norm: RMSNorm over head_dim of every query and key head after the projection,
        before RoPE (Qwen3's q_norm / k_norm; params self_attn/{q,k}_norm/scale).
      rope_scaling: None, or an `arl.models.rope.Llama3RopeScaling` (Llama 3.1+).
      token_vocab_size: 0, or the number of ids that are tokens when the embedding is
        padded past the tokenizer (Qwen pads 151665 tokens to 151936 rows): the logits of
        ids >= token_vocab_size are masked (`mask_padded_vocab`) and the log-prob matrices
        (`output_matrix`) cut to the tokens, so those ids are never sampled or scored.
      d_model: residual stream width.
      num_layers: number of decoder layers.
      num_heads: query heads.
      num_kv_heads: key/value heads; grouped-query attention when < num_heads. Must
        divide num_heads.
      head_dim: per-head width; defaults to d_model // num_heads.
      mlp_dim: SwiGLU hidden width.
      max_len: default KV-cache capacity (`init_cache` callers may pass their own).
      rope_theta: RoPE base (10_000 for Llama 2, 500_000 for Llama 3, 1e6 for Qwen2).
      norm_eps: RMSNorm epsilon.
      qkv_bias: biases on the q/k/v projections (Qwen2; with o_bias, HF Llama's
        `attention_bias=True`).
      o_bias: a bias on the attention output projection o_proj (HF Llama
        `attention_bias=True` sets both qkv_bias and o_bias; Qwen2 has none).
      mlp_bias: biases on gate_proj, up_proj and down_proj (HF Llama `mlp_bias=True`).
      tie_embeddings: logits use the input embedding matrix transposed.
      value_head: add a scalar value head on the final hidden state.
      dtype: activation dtype (float32 or bfloat16). Norms, attention softmax, logits and
        values are always float32.
      param_dtype: parameter dtype.
      initializer_range: std of the normal initialiser of every matrix (HF convention).
      remat: rematerialise each layer in the backward pass (saves activation memory).
      layer_unroll: layers per iteration of the layer scan in cache-free calls (training,
        recomputation): 1 = a loop of one compiled layer, num_layers = fully unrolled.
        Unrolling lets XLA drop the per-layer buffers the scan stacks for the backward
        pass, at a compile time that grows with the depth. Calls with a stacked KV cache
        run one layer per iteration; with a per-layer cache (`KVCache.per_layer()`) the
        layers run one after another. Fully unrolled, `generate` and the rollout's turns
        decode on a per-layer cache (`decodes_per_layer`).
      attention: self-attention of cache-free calls (training, scoring): "dense" (the
        [B, H, T, T] scores in one piece), "blocked" (FlashAttention-style tiling in JAX,
        memory linear in T, `arl.models.attention_kernels`), "cudnn" (cuDNN's fused kernel via
        `jax.nn.dot_product_attention`, NVIDIA GPUs only) or "auto" (dense up to
        `attention_block` tokens, blocked beyond). KV-cached calls follow the same rule
        with the cache's capacity as the length: blocked reads only the cache blocks up
        to the last query's slot (`attention.cached_attention`); cudnn attends densely.
      attention_block: the largest query / key block of the blocked attention (the
        context is cut into the fewest equal blocks, `attention.block_layout`).
    """

    vocab_size: int
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int | None = None
    mlp_dim: int = 512
    max_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    value_head: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    initializer_range: float = 0.02
    remat: bool = False
    layer_unroll: int = 1
    attention: str = "auto"
    attention_block: int = 512
    token_vocab_size: int = 0
    qk_norm: bool = False
    rope_scaling: Any = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                     "mlp_dim", "max_len", "layer_unroll", "attention_block"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TransformerConfig.{name} must be a positive int, got {value!r}")
        for name in ("qkv_bias", "o_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"TransformerConfig.{name} must be a bool, got "
                                 f"{getattr(self, name)!r}")
        if isinstance(self.token_vocab_size, bool) or not isinstance(
                self.token_vocab_size, (int, np.integer)) or not (
                0 <= self.token_vocab_size <= self.vocab_size):
            raise ValueError(f"TransformerConfig.token_vocab_size must be an int in [0, "
                             f"vocab_size={self.vocab_size}], got {self.token_vocab_size!r}")
        if not isinstance(self.qk_norm, (bool, np.bool_)):
            raise ValueError(f"TransformerConfig.qk_norm must be a bool, got {self.qk_norm!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling,
                                                            Llama3RopeScaling):
            raise ValueError(f"TransformerConfig.rope_scaling must be None or a "
                             f"Llama3RopeScaling, got {self.rope_scaling!r}")
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(
                    f"TransformerConfig.num_heads={self.num_heads} must divide "
                    f"d_model={self.d_model} (or set head_dim explicitly)")
        elif not isinstance(self.head_dim, (int, np.integer)) or self.head_dim < 1:
            raise ValueError(f"TransformerConfig.head_dim must be a positive int or None, "
                             f"got {self.head_dim!r}")
        if self.resolved_head_dim % 2:
            raise ValueError(f"TransformerConfig.head_dim must be even for RoPE, got "
                             f"{self.resolved_head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TransformerConfig.num_kv_heads={self.num_kv_heads} must divide "
                f"num_heads={self.num_heads}")
        if not self.rope_theta > 0:
            raise ValueError(f"TransformerConfig.rope_theta must be > 0, got {self.rope_theta}")
        if not self.norm_eps > 0:
            raise ValueError(f"TransformerConfig.norm_eps must be > 0, got {self.norm_eps}")
        if self.attention not in attention_lib.IMPLEMENTATIONS:
            raise ValueError(f"TransformerConfig.attention must be one of "
                             f"{attention_lib.IMPLEMENTATIONS}, got {self.attention!r}")
        for name in ("dtype", "param_dtype"):
            dt = jnp.dtype(getattr(self, name))
            if not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"TransformerConfig.{name} must be a float dtype "
                                 f"(float32, bfloat16, float16), got {dt}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads


# Below every real logit and finite: exp(z - max) is exactly 0, and 0 * z stays 0 in an
# entropy (-inf would give NaN there).
MASKED_LOGIT = -1e30


def mask_padded_vocab(logits, config: TransformerConfig):
    """`logits` [..., vocab_size] with the ids >= config.token_vocab_size (padding rows
    of the embedding, no token) at MASKED_LOGIT; unchanged when it is 0."""
    if not config.token_vocab_size or config.token_vocab_size == config.vocab_size:
        return logits
    ids = jnp.arange(logits.shape[-1])
    return jnp.where(ids < config.token_vocab_size, logits, MASKED_LOGIT).astype(logits.dtype)


def projection_features(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Each layer projection's output shape per token (q/k/v: heads x head_dim)."""
    head_dim = config.resolved_head_dim
    return {"q_proj": (config.num_heads, head_dim), "k_proj": (config.num_kv_heads, head_dim),
            "v_proj": (config.num_kv_heads, head_dim), "o_proj": (config.d_model,),
            "gate_proj": (config.mlp_dim,), "up_proj": (config.mlp_dim,),
            "down_proj": (config.d_model,)}


def decodes_per_layer(config: TransformerConfig) -> bool:
    """Whether decoding runs on a per-layer cache and per-layer weights: with every layer
    unrolled (`layer_unroll >= num_layers`), where the program has one layer body per
    layer anyway; a scanned layer stack keeps the stacked cache. Other models (a config
    that is not a `TransformerConfig`) keep their own cache."""
    return isinstance(config, TransformerConfig) and config.layer_unroll >= config.num_layers
