"""Decoding on one KV-cache buffer per layer (`KVCache.per_layer`, `per_layer_params`,
`decodes_per_layer`): the same model as the scan over the stacked cache, in direct calls,
in `generate` and in a multi-turn rollout, and bad per-layer inputs rejected by name."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl import envs
from arl import rollout as rollout_lib
from arl.models import Transformer, generate, init_cache
from arl.models import transformer as transformer_lib
from arl.models.transformer import KVCache, decodes_per_layer, per_layer_params
from tests.models.helpers import SMALL, make

LAYERS = SMALL.num_layers


def _prefilled(config=SMALL, batch=4, capacity=32):
    _, _, params = make(SMALL)
    model = Transformer(config)
    prompt = jax.random.randint(jax.random.key(3), (batch, 6), 0, config.vocab_size)
    num_valid = jnp.asarray([6, 2, 4, 1][:batch], jnp.int32)
    out = model.apply({"params": params}, prompt, init_cache(config, batch, capacity),
                      num_valid=num_valid, method="decode")
    last = jnp.take_along_axis(out.logits, (num_valid - 1)[:, None, None], axis=1)[:, 0]
    return model, params, out.cache, last


def test_per_layer_and_stacked_forms_round_trip():
    _, _, cache, _ = _prefilled()
    layered = cache.per_layer()
    assert layered.is_per_layer and not cache.is_per_layer
    batch, capacity, kv, head_dim = cache.keys.shape[1:]
    assert len(layered.keys) == len(layered.values) == LAYERS
    assert layered.keys[0].shape == (batch, kv, head_dim, capacity)  # slots last
    assert layered.values[0].shape == (batch, kv, capacity, head_dim)
    assert layered.capacity == cache.capacity == 32
    for layer in range(LAYERS):
        for b, slot, h, i in [(0, 0, 0, 0), (1, 5, 1, 7), (3, 2, 0, 31)]:
            assert layered.keys[layer][b, h, i, slot] == cache.keys[layer, b, slot, h, i]
            assert layered.values[layer][b, h, slot, i] == cache.values[layer, b, slot, h, i]
        np.testing.assert_array_equal(layered.keys[layer],
                                      np.transpose(cache.keys[layer], (0, 2, 3, 1)))
        np.testing.assert_array_equal(layered.values[layer],
                                      np.transpose(cache.values[layer], (0, 2, 1, 3)))
    back = layered.stacked()
    np.testing.assert_array_equal(back.keys, cache.keys)
    np.testing.assert_array_equal(back.values, cache.values)
    assert layered.per_layer() is layered and cache.stacked() is cache


@pytest.mark.parametrize("attention_block", [512, 8])  # dense cached path / blocked
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("layer_params", ["stacked", "per_layer"])
def test_a_call_on_the_per_layer_cache_is_the_stacked_call(attention_block, q_len,
                                                            layer_params):
    """Logits, values and every written cache slot equal the scan over the stacked cache
    to float32 rounding; rows with num_valid 0 keep their buffers bit for bit."""
    config = dataclasses.replace(SMALL, attention_block=attention_block)
    model, params, cache, _ = _prefilled(config)
    tokens = jax.random.randint(jax.random.key(5), (4, q_len), 0, SMALL.vocab_size)
    num_valid = jnp.asarray([q_len, 1, 0, q_len], jnp.int32)
    given = params if layer_params == "stacked" else per_layer_params(params)
    call = jax.jit(lambda p, c: model.apply({"params": p}, tokens, c,
                                            num_valid=num_valid, method="decode"))
    stacked = call(params, cache)
    layered = call(given, cache.per_layer())
    assert layered.cache.is_per_layer
    np.testing.assert_allclose(layered.logits, stacked.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layered.values, stacked.values, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(layered.cache.length, stacked.cache.length)
    restacked = layered.cache.stacked()
    np.testing.assert_allclose(restacked.keys, stacked.cache.keys, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(restacked.values, stacked.cache.values, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(restacked.keys[:, 2], cache.keys[:, 2])


def test_per_layer_params_are_the_stacked_slices():
    _, boxed, params = make(SMALL)
    split = per_layer_params(boxed)  # boxed or plain
    assert isinstance(split["layers"], tuple) and len(split["layers"]) == LAYERS
    for layer, tree in enumerate(split["layers"]):
        jax.tree.map(lambda whole, part, i=layer: np.testing.assert_array_equal(whole[i], part),
                     params["layers"], tree)
    np.testing.assert_array_equal(split["embed_tokens"]["embedding"],
                                  params["embed_tokens"]["embedding"])
    again = per_layer_params(split)["layers"]  # already split: the same arrays, no copy
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(split["layers"])))


def test_generate_decodes_per_layer_when_every_layer_is_unrolled():
    """`layer_unroll >= num_layers` decodes on per-layer buffers: the same sampled tokens,
    log-probs and final cache (stacked again) as the scanned layers, from a different
    program (so the comparison is not one path traced twice)."""
    unrolled = dataclasses.replace(SMALL, layer_unroll=LAYERS)
    assert decodes_per_layer(unrolled) and not decodes_per_layer(SMALL)
    outputs, programs = [], []
    for config in (SMALL, unrolled):
        model, params, cache, last = _prefilled(config)

        def sample(params, cache, last, model=model):
            return generate(model, params, cache, last, jax.random.key(4), max_new_tokens=12,
                            eot_id=SMALL.vocab_size - 1, pad_id=0, temperature=0.7)
        programs.append(str(jax.make_jaxpr(sample)(params, cache, last)))
        outputs.append(jax.jit(sample)(params, cache, last))
    scanned, layered = outputs
    assert programs[0] != programs[1]
    assert not layered.cache.is_per_layer  # handed back in the form it came in
    np.testing.assert_array_equal(layered.tokens, scanned.tokens)
    np.testing.assert_array_equal(layered.length, scanned.length)
    np.testing.assert_allclose(layered.logp, scanned.logp, atol=1e-5)
    np.testing.assert_allclose(layered.values, scanned.values, atol=1e-5)
    np.testing.assert_allclose(layered.cache.keys, scanned.cache.keys, rtol=1e-5, atol=1e-6)


def test_a_multi_turn_rollout_plays_the_same_episodes_per_layer():
    """guess_number, 4 turns: decoding and the replies' prefill on per-layer buffers (the
    turn loop converts once) play the same tokens as the scanned layers."""
    env = envs.make("guess_number", max_n=8, max_turns=4)
    trajectories = []
    for unroll in (1, 2):
        config = transformer_lib.TransformerConfig(
            vocab_size=env.codec.vocab_size, d_model=32, num_layers=2, num_heads=4,
            num_kv_heads=2, mlp_dim=64, max_len=rollout_lib.context_length(env),
            value_head=True, layer_unroll=unroll)
        model = Transformer(config)
        params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
        run = jax.jit(lambda p, k, model=model: rollout_lib.rollout(
            env, k, num_tasks=4, group_size=2, model=model, params=p))
        trajectories.append(jax.device_get(run(params, jax.random.key(1))))
    scanned, layered = trajectories
    for field in ("tokens", "agent_mask", "rewards", "length", "num_turns"):
        np.testing.assert_array_equal(getattr(layered, field), getattr(scanned, field),
                                      err_msg=field)
    assert np.asarray(scanned.num_turns).max() > 1  # replies were prefilled
    np.testing.assert_allclose(layered.behaviour_logp, scanned.behaviour_logp, atol=1e-5)
    np.testing.assert_allclose(layered.values, scanned.values, atol=1e-5)


def test_bad_per_layer_inputs_are_named():
    model, params, cache, _ = _prefilled()
    token = jnp.zeros((4, 1), jnp.int32)
    short = cache.per_layer().replace(keys=cache.per_layer().keys[:1])
    with pytest.raises(ValueError, match=r"per-layer cache needs 2 keys arrays of shape \(4, 2, 8, 32\) "
                       r"\(batch, kv_heads, head_dim, capacity\) and 2 values arrays"):
        model.apply({"params": params}, token, short, method="decode")
    with pytest.raises(ValueError, match="got 0 / 0 arrays"):
        model.apply({"params": params}, token, KVCache(keys=(), values=(), length=cache.length),
                    method="decode")
    wrong = KVCache(keys=tuple(k[:, :, :1] for k in cache.keys),
                    values=tuple(cache.values), length=cache.length)
    with pytest.raises(ValueError, match="per-layer cache"):
        model.apply({"params": params}, token, wrong, method="decode")
    with pytest.raises(ValueError, match="need a per-layer cache"):
        model.apply({"params": per_layer_params(params)}, token, cache, method="decode")
