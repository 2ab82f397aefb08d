"""Values recorded during the rollout (used as PPO's old values) equal a full forward."""

import flax.linen as nn
import jax
import pytest
import jax.numpy as jnp
import numpy as np

from arl import rollout as rollout_lib
from arl.envs import GuessNumber
from arl.models.transformer import Transformer, TransformerConfig


def _model(env, value_head):
    config = TransformerConfig(
        vocab_size=env.codec.vocab_size, d_model=16, num_layers=1, num_heads=2,
        num_kv_heads=2, mlp_dim=32, max_len=rollout_lib.context_length(env),
        value_head=value_head)
    model = Transformer(config)
    dummy = jnp.zeros((1, config.max_len), jnp.int32)
    return model, nn.unbox(model.init(jax.random.key(0), dummy)["params"])


def test_recorded_values_match_a_full_forward_on_every_valid_position():
    env = GuessNumber(max_n=8, max_turns=3)
    model, params = _model(env, value_head=True)
    run = jax.jit(lambda p, k: rollout_lib.rollout(
        env, k, num_tasks=3, group_size=2, model=model, params=p))
    traj = run(params, jax.random.key(1))
    full = model.apply({"params": params}, traj.tokens).values
    width = traj.tokens.shape[1]
    valid = np.arange(width)[None, :] < np.asarray(traj.length)[:, None]
    assert traj.values.shape == traj.tokens.shape and traj.values.dtype == jnp.float32
    assert valid.sum() > valid.shape[0] * 12  # prompt + at least one turn per row
    np.testing.assert_allclose(np.where(valid, traj.values, 0.0), np.where(valid, full, 0.0),
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.where(valid, 0.0, traj.values), 0.0)


@pytest.mark.slow  # default-suite budget (one more rollout compile for a None check)
def test_no_value_head_records_nothing():
    env = GuessNumber(max_n=8, max_turns=2)
    model, params = _model(env, value_head=False)
    traj = jax.jit(lambda p, k: rollout_lib.rollout(
        env, k, num_tasks=1, group_size=2, model=model, params=p))(params, jax.random.key(2))
    assert traj.values is None
