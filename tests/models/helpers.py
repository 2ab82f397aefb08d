"""Shared small models for tests/models: one jitted init per config, reused across tests
(compilation dominates the run time on CPU)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from arl.algorithms import token_logprobs
from arl.models import Transformer, TransformerConfig

SMALL = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          mlp_dim=64, max_len=32, value_head=True)


@functools.lru_cache(maxsize=None)
def make(config: TransformerConfig, seed: int = 0):
    """(model, boxed params, plain params) for `config`, initialised once per process."""
    model = Transformer(config)
    boxed = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 1), jnp.int32))["params"]
    return model, boxed, nn.unbox(boxed)


@functools.lru_cache(maxsize=None)
def jitted_forward(config: TransformerConfig):
    """jit(params, tokens) -> ModelOutput, cached per config."""
    model = Transformer(config)
    return jax.jit(lambda params, tokens: model.apply({"params": params}, tokens))


def log_softmax_at(logits, tokens, temperature=1.0):
    """Trainer-side recomputation of behaviour log-probs: arl.algorithms.token_logprobs on
    the temperature-scaled logits (float32)."""
    return token_logprobs(logits.astype(jnp.float32) / temperature, tokens)


def hf_greedy(hf_model, tokens, mask, new_tokens: int, pad_id: int):
    """(tokens int [B, new_tokens], their log-probs) of transformers' greedy `generate`
    from left-padded `tokens` with attention `mask` (numpy; torch imported here, the
    tests that call this skip without it)."""
    import numpy as np
    import torch

    with torch.no_grad():
        out = hf_model.generate(
            torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask),
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=pad_id, eos_token_id=None, output_scores=True,
            return_dict_in_generate=True)
    generated = out.sequences[:, tokens.shape[1]:].numpy()
    logp = np.stack([torch.log_softmax(s, -1).numpy() for s in out.scores], 1)
    return generated, np.take_along_axis(logp, generated[..., None], -1)[..., 0]
