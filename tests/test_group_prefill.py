"""Shared group prefill (`rollout(..., share_group_prefill=...)`): reading a group's
prompt once and copying its KV cache to the group's rows plays the same episodes as
prefilling every row, and it really is a copy of the group's first row."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from arl import rollout as rollout_lib
from arl import envs
from arl.models.transformer import Transformer, TransformerConfig

ENV = envs.make("calculator", max_turns=3)  # a prompt per task ("61-78")
NUM_TASKS, GROUP = 3, 4


def _policy():
    config = TransformerConfig(
        vocab_size=ENV.codec.vocab_size, d_model=16, num_layers=1, num_heads=2,
        num_kv_heads=2, mlp_dim=32, max_len=rollout_lib.context_length(ENV), value_head=True)
    model = Transformer(config)
    params = model.init(jax.random.key(0), jnp.zeros((1, config.max_len), jnp.int32))
    return model, nn.unbox(params["params"])


MODEL, PARAMS = _policy()


def _play(share, reset_keys=None):
    run = jax.jit(lambda p, k, r: rollout_lib.rollout(
        ENV, k, num_tasks=NUM_TASKS, group_size=GROUP, model=MODEL, params=p,
        reset_keys=r, share_group_prefill=share))
    return jax.device_get(run(PARAMS, jax.random.key(1), reset_keys))


def test_shared_prefill_plays_the_same_episodes():
    """Multi-turn, value head on: same sampled tokens, masks, rewards and lengths; the
    behaviour log-probs and recorded values equal up to float32 rounding."""
    shared, per_row = _play(True), _play(False)
    for field in ("tokens", "agent_mask", "observation_mask", "rewards", "length",
                  "num_turns", "success"):
        np.testing.assert_array_equal(getattr(shared, field), getattr(per_row, field),
                                      err_msg=field)
    assert np.asarray(shared.num_turns).sum() > NUM_TASKS * GROUP  # later turns were played
    np.testing.assert_allclose(shared.behaviour_logp, per_row.behaviour_logp, atol=1e-6)
    np.testing.assert_allclose(shared.values, per_row.values, atol=1e-6)


def test_the_group_first_row_prefill_is_copied_to_its_rows():
    """Rows given their own tasks (one reset key each): with sharing forced on, every row
    carries its group's first-row prompt values (so it was copied, not recomputed), and
    the default (None, with reset_keys given) does not share."""
    keys = jax.random.split(jax.random.key(7), NUM_TASKS * GROUP)
    forced, default, per_row = _play(True, keys), _play(None, keys), _play(False, keys)
    first_obs = 1 + np.asarray(jax.vmap(ENV.reset)(
        keys, rollout_lib.default_row_params(ENV, NUM_TASKS, GROUP))[1].observation.length)
    leaders = np.repeat(np.arange(NUM_TASKS) * GROUP, GROUP)
    prompts = np.asarray(per_row.tokens)[:, :first_obs.max()]
    assert len({row.tobytes() for row in prompts}) > NUM_TASKS  # rows of a group differ
    for row in range(NUM_TASKS * GROUP):
        n = min(first_obs[row], first_obs[leaders[row]])
        np.testing.assert_allclose(forced.values[row, :n], per_row.values[leaders[row], :n],
                                   atol=1e-6)
    n = first_obs.min()
    own = np.abs(np.asarray(forced.values[:, :n]) - np.asarray(per_row.values[:, :n]))
    assert own[leaders != np.arange(NUM_TASKS * GROUP)].max() > 1e-3  # not the rows' own
    np.testing.assert_array_equal(default.tokens, per_row.tokens)
    np.testing.assert_array_equal(default.values, per_row.values)
