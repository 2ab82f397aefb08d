"""LoRA: trainable low-rank adapters on a frozen `Transformer` (Hu et al. 2021,
"LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685).

For every targeted projection with kernel W (viewed as a [d_in, d_out] matrix per
layer) the policy uses

    W' = W + (alpha / r) * A @ B,     A [d_in, r] ~ N(0, 1/d_in),  B [r, d_out] = 0

so at initialisation the policy equals the base model exactly. Only A and B are
trained; W stays frozen (no optimizer state, no gradient kept for it).

Design: a parameter transform, not a new module. `merge_lora(base, adapters, config)`
returns an ordinary parameter tree for `Transformer.apply`, so everything that takes
params (the train step's forward, `generate`, `model_token_logprobs`) works unchanged:

    adapters = init_lora(key, base_params, lora_config)      # the trainable state
    def loss(adapters, batch):
        params = merge_lora(base_params, adapters, lora_config)  # inside jit
        ...policy forward with params...
        ...reference forward with base_params...               # KL(ref) anchor
    optax state = optimizer.init(adapters)                     # adapters only

The reference policy is the base without adapters (`base_params` itself, not a second
copy of the weights). Inside the train step the policy, the behaviour policy and the
reference all share the one frozen base; what differs is the small adapter tree.
`merge_lora` builds the merged kernels transiently inside the compiled step (one
targeted kernel's worth of temporary memory per layer scan; XLA fuses the add into
the consumer where it can); the stored state is base (frozen, possibly bfloat16) +
adapters (float32) + optimizer state of the adapters only, which is what lets a large
model fit. Adapters are replicated (r * (d_in + d_out) per layer is small); the base
keeps its own shardings.

Targets name the projections of `Transformer`: q_proj, k_proj, v_proj, o_proj
(attention) and gate_proj, up_proj, down_proj (MLP).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# How many leading axes (after the stacked layer axis) of each kernel are its input.
_INPUT_AXES = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2,
               "gate_proj": 1, "up_proj": 1, "down_proj": 1}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank r, scale alpha (the update is alpha / r * A @ B) and the targeted projections
    (default q_proj and v_proj, as in the LoRA paper)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self):
        if not isinstance(self.rank, (int, np.integer)) or isinstance(self.rank, bool) \
                or self.rank < 1:
            raise ValueError(f"LoraConfig.rank must be a positive int, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha must be > 0, got {self.alpha!r}")
        targets = tuple(self.targets)
        if not targets or any(t not in ALL_TARGETS for t in targets) or \
                len(set(targets)) != len(targets):
            raise ValueError(f"LoraConfig.targets must be distinct names from {ALL_TARGETS}, "
                             f"got {self.targets!r}")
        object.__setattr__(self, "targets", targets)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _block(target: str) -> str:
    return "self_attn" if target in ATTENTION_TARGETS else "mlp"


def _kernel(params, target: str):
    try:
        return params["layers"][_block(target)][target]["kernel"]
    except KeyError as e:
        raise ValueError(f"params have no layers/{_block(target)}/{target}/kernel; pass the "
                         f"parameters of an arl Transformer") from e


def _split(kernel_shape, target):
    """(num_layers, d_in, d_out) of a stacked kernel [L, *in_axes, *out_axes]."""
    n_in = _INPUT_AXES[target]
    return (kernel_shape[0], math.prod(kernel_shape[1:1 + n_in]),
            math.prod(kernel_shape[1 + n_in:]))


def init_lora(key: jax.Array, base_params, config: LoraConfig, dtype=jnp.float32) -> dict:
    """Adapters {target: {"a": [L, d_in, r], "b": [L, r, d_out]}} in `dtype` (float32 by
    default, whatever the base dtype): A ~ N(0, 1/d_in), B = 0, so merge_lora(base,
    init_lora(...)) == base exactly."""
    base_params = nn.unbox(base_params)
    adapters = {}
    for target, k in zip(config.targets, jax.random.split(key, len(config.targets))):
        layers, d_in, d_out = _split(_kernel(base_params, target).shape, target)
        adapters[target] = {
            "a": jax.random.normal(k, (layers, d_in, config.rank), dtype) / math.sqrt(d_in),
            "b": jnp.zeros((layers, config.rank, d_out), dtype),
        }
    return adapters


def lora_delta(adapter: dict, kernel_shape, config: LoraConfig) -> jax.Array:
    """(alpha / r) * A @ B reshaped to the kernel's [L, ...] shape, float32."""
    delta = jnp.einsum("lir,lro->lio", adapter["a"].astype(jnp.float32),
                       adapter["b"].astype(jnp.float32))
    return (config.scale * delta).reshape(kernel_shape)


def merge_lora(base_params, adapters: dict, config: LoraConfig):
    """Parameters of the adapted policy: every targeted kernel W becomes
    W + (alpha / r) A B (summed in float32, cast back to W's dtype); all other leaves are
    the base's own arrays. Gradients flow to `adapters` only (the base is wrapped in
    stop_gradient)."""
    base_params = jax.tree.map(jax.lax.stop_gradient, nn.unbox(base_params))
    if set(adapters) != set(config.targets):
        raise ValueError(f"adapters have targets {sorted(adapters)} but the LoraConfig "
                         f"targets {sorted(config.targets)}")
    layers = dict(base_params["layers"])
    for target in config.targets:
        kernel = _kernel(base_params, target)
        expected = _split(kernel.shape, target)
        a_shape = (expected[0], expected[1], config.rank)
        if adapters[target]["a"].shape != a_shape or \
                adapters[target]["b"].shape != (expected[0], config.rank, expected[2]):
            raise ValueError(f"adapters[{target!r}] must have a {a_shape} and b "
                             f"{(expected[0], config.rank, expected[2])}, got "
                             f"{adapters[target]['a'].shape} and {adapters[target]['b'].shape}")
        merged = (kernel.astype(jnp.float32)
                  + lora_delta(adapters[target], kernel.shape, config)).astype(kernel.dtype)
        block = dict(layers[_block(target)])
        block[target] = {**block[target], "kernel": merged}
        layers[_block(target)] = block
    return {**base_params, "layers": layers}


def num_lora_params(adapters) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(adapters)))
