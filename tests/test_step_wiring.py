"""An oracle of the token step's wiring from credit assignment into the loss
(`TokenTrainer.learn`): the `UpdateBatch` the learner receives, compared entry by entry
with what the trajectory and the signals say it must hold. The rows a filter drops (here
DAPO's zero-variance groups, recomputed in NumPy) leave the loss mask, the advantages
are the signals' on the kept agent tokens, the returns and old values reach a critic,
and the reference log-probs reach the KL term. The credit values themselves have their
own oracle (tests/test_credit_oracle.py), the loss its own (tests/test_update_oracle.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl.trainers import TokenTrainer
from arl.trainers.policy import shift_right
from tests.test_train import tiny_config

NUM_TASKS, GROUP_SIZE = 4, 4


def _trainer(algorithm):
    c = tiny_config(algorithm)
    c.rollout.num_tasks, c.rollout.group_size = NUM_TASKS, GROUP_SIZE
    c.filters.dapo_zero_variance = True
    c.loss.kl_coef = 0.1  # a reference policy: ref_logp reaches the batch
    return TokenTrainer(c)


def _scores(traj):
    """Row scores: group 0 all equal (DAPO drops it), the others spread."""
    rng = np.random.default_rng(0)
    scores = rng.normal(size=NUM_TASKS * GROUP_SIZE).astype(np.float32)
    scores[:GROUP_SIZE] = 0.5
    mask = np.asarray(traj.agent_mask, bool)
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)  # each row's last agent token
    rewards = np.zeros(mask.shape, np.float32)
    rewards[np.arange(len(scores)), last] = scores
    return scores, rewards


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_update_batch_holds_the_signals_on_the_kept_rows(monkeypatch, algorithm):
    trainer = _trainer(algorithm)
    state = trainer.init_state()
    keys = trainer.step_keys(state.key)
    horizon = trainer.horizon(state.step)
    policy = trainer.layout.policy_params(state)
    traj = jax.jit(trainer.rollout)(policy, keys.rollout, horizon)
    scores, rewards = _scores(traj)
    traj = traj.replace(rewards=jnp.asarray(rewards))
    mask = np.asarray(traj.agent_mask, np.float32)
    assert mask[:GROUP_SIZE].sum() > 0  # the dropped rows have tokens to drop

    received = []

    class RecordingLearner:  # the batch it is given, and no update
        def update(self, params, opt_state, batch, *args):
            received.append(batch)
            # the non-finite guard reads the update's loss and gradient norm
            return params, opt_state, {"loss/total": jnp.zeros(()), "grad_norm": jnp.zeros(())}

    monkeypatch.setattr(trainer, "learner", RecordingLearner())
    # Jitted as the step runs it: one program instead of each op compiled eagerly.
    batch, metrics = jax.jit(lambda s, t, k, h, p: (
        trainer.learn(s, t, k, h, behaviour_params=p)[1], received[0])[::-1])(
            state, traj, keys, horizon, policy)
    assert len(received) == 1

    # DAPO in NumPy: a group whose scores are all equal is dropped.
    groups = scores.reshape(NUM_TASKS, GROUP_SIZE)
    valid = np.repeat(groups.max(1) > groups.min(1), GROUP_SIZE).astype(np.float32)
    assert valid.tolist() == [0.0] * GROUP_SIZE + [1.0] * (NUM_TASKS - 1) * GROUP_SIZE
    loss_mask = mask * valid[:, None]
    np.testing.assert_array_equal(batch.mask, loss_mask)

    old_values = (shift_right(traj.values[:, :-1]) * traj.agent_mask
                  if algorithm == "ppo" else None)
    signals = jax.jit(lambda t, v: trainer.credit(
        t, t.rewards, v, process_rewards=None, implicit_rewards=None, branch=None))(
            traj, old_values)
    np.testing.assert_array_equal(signals.valid, valid)
    np.testing.assert_array_equal(batch.advantages, np.asarray(signals.advantages) * loss_mask)
    assert np.any(np.asarray(batch.advantages)[GROUP_SIZE:] != 0)
    np.testing.assert_array_equal(batch.tokens, traj.tokens)
    np.testing.assert_array_equal(batch.old_logp, traj.behaviour_logp)
    np.testing.assert_array_equal(batch.observation_mask, traj.observation_mask)
    reference = jax.jit(lambda p, t: trainer.policy.score(p, t, **trainer.shared_prompt).logp)(
        trainer.layout.reference_params(state), traj.tokens)
    np.testing.assert_allclose(batch.ref_logp, reference, rtol=1e-6, atol=1e-6)
    if algorithm == "ppo":
        np.testing.assert_array_equal(batch.old_values, old_values)
        np.testing.assert_array_equal(batch.returns, signals.returns)
    else:
        assert batch.old_values is None and batch.returns is None
    assert float(metrics["kept_fraction"]) == valid.mean()
    assert float(metrics["update_skipped"]) == 0.0
