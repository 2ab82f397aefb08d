"""Learning is a feature: reward rises on real tasks, with fixed seeds and thresholds.

How the evidence is kept honest (docs/learning.md):
- CartPole (vector env, small action space): PPO from scratch against the random policy.
- Token envs: a random transformer never writes a well-formed turn, so the policy is
  warm-started with RL + alpha*SFT on the environment's *weaker* demonstrator (a bandit
  player that picks the worse arm half the time). RL's contribution is the gap between
  the demonstrator's success and the trained policy's.

The full-size token runs here are slow tests; every algorithm's reduced run is in
tests/test_learning_reduced.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl.trainers import TokenTrainer
from arl.trainers import VectorPPO
from tests.bandit_learning import bandit_config, demonstrator_success

# Each test is a long, independent training run: let pytest-xdist put them on both
# workers (tests/conftest.py).
SPREAD_OVER_WORKERS = True


def _train(trainer, steps):
    state = trainer.init_state()
    history = []
    for _ in range(steps):
        state, metrics = trainer.train_step(state)
        history.append(float(metrics["success_rate"]))
    return state, np.asarray(history)


# Measured with this recipe (sampled success, mean of the last 10 of 100 steps):
# grpo 0.92, reinforce_pp 0.92, drgrpo 0.70, rloo 0.74, ppo (critic, token GAE) 0.74;
# erpo (one environment: env-level normalisation) 0.90;
# greedy success 1.0 for all; the demonstrator 0.47.
# Each run costs ~2-3 CPU-minutes, so they are slow tests; the default suite keeps every
# algorithm's reduced run from a shared warm start (tests/test_learning_reduced.py).
@pytest.mark.slow
@pytest.mark.parametrize("algorithm,late_threshold", [
    ("grpo", 0.85), ("reinforce_pp", 0.85), ("drgrpo", 0.6), ("rloo", 0.6), ("ppo", 0.6),
    ("erpo", 0.75)])
def test_rl_beats_its_demonstrator_on_bandit(algorithm, late_threshold):
    config = bandit_config(algorithm)
    trainer = TokenTrainer(config)
    state, history = _train(trainer, config.train_steps)
    demonstrator = demonstrator_success(trainer.env)
    assert demonstrator < 0.6  # pulls the worse arm half the time
    assert history[:10].mean() < 0.1  # random init: no well-formed turns yet
    late = history[-10:].mean()
    assert late > late_threshold, history
    assert late > demonstrator + 0.1
    metrics, _ = trainer.evaluate(state.params, jax.random.key(1), greedy=True)
    assert float(metrics["success_rate"]) >= 0.9


@pytest.mark.slow  # default-suite budget (see above)
def test_vineppo_beats_its_demonstrator_on_a_two_pull_bandit():
    # Two turns (two pulls), so the Monte Carlo value of the state between them is
    # estimated by forking it twice per row. Measured (seed 0, 100 steps): sampled
    # success 0.78 over the last 10 steps (0.0 -> 0.19 at step 60 -> 0.78), greedy 1.0;
    # the continuations cost 1.0 environment step per rollout step. The demonstrator
    # succeeds 0.74 of the time here (its second pull is often the better arm).
    config = bandit_config("vineppo")
    config.env.kwargs = {"num_pulls": 2}
    config.process.mc_samples = 2
    trainer = TokenTrainer(config)
    assert trainer.branch_turns == (1,)
    state, history = _train(trainer, config.train_steps)
    demonstrator = demonstrator_success(trainer.env)
    assert history[:10].mean() < 0.1
    late = history[-10:].mean()
    assert late > 0.6, history
    assert late > demonstrator
    metrics, _ = trainer.evaluate(state.params, jax.random.key(1), greedy=True)
    assert float(metrics["success_rate"]) >= max(0.9, demonstrator + 0.1)


def test_ppo_learns_cartpole_from_scratch_reduced():
    """Three seeds trained side by side in one vmapped program; the greedy return of a
    single seed after 150 updates varies a lot (seeds 0, 1, 2 measured 267, 488, 455 with
    JAX 0.10), so the threshold is on their mean, and every seed must beat random by far."""
    import configs.ppo_cartpole as ppo_cartpole

    config = ppo_cartpole.get_config()
    config.train_steps = 150  # 76,800 environment steps per seed (full run: 977, 500k)
    trainer = VectorPPO(config)
    seeds = (0, 1, 2)
    states = jax.tree.map(lambda *x: jnp.stack(x), *[trainer.init_state(s) for s in seeds])
    returns = jax.jit(jax.vmap(lambda p, greedy: trainer.evaluate(
        p, jax.random.key(1), greedy=greedy), in_axes=(0, None)), static_argnums=1)
    random_returns = np.asarray(returns(states.params, False))
    step = jax.jit(jax.vmap(trainer.step), donate_argnums=0)
    for _ in range(config.train_steps):
        states, _ = step(states)
    trained = np.asarray(returns(states.params, True))
    assert random_returns.max() < 40, random_returns
    assert trained.mean() >= 350 and trained.min() >= 200, trained


@pytest.mark.slow
def test_ppo_solves_cartpole_within_500k_steps():
    import configs.ppo_cartpole as ppo_cartpole

    config = ppo_cartpole.get_config()
    trainer = VectorPPO(config)
    assert config.train_steps * trainer.batch_size <= 500_224
    state = trainer.init_state()
    returns = []
    for _ in range(config.train_steps):
        state, metrics = trainer.train_step(state)
        returns.append(float(metrics["episode_return"]))
    # The criterion: the mean training episode return (finished episodes, over 10
    # consecutive updates = 5,120 environment steps) reaches 475 within the budget.
    # (The greedy return of the final parameters alone is a noisier criterion: 291 at the
    # end of one measured run whose training return had reached 500.)
    rolling = np.convolve(returns, np.ones(10) / 10, mode="valid")
    assert rolling.max() >= 475, rolling[::50]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
def test_erpo_and_grpo_learn_both_members_of_a_mixture(algorithm):
    # Measured (seed 0, 120 steps): greedy success ERPO bandit 1.0 / guess_number 0.75,
    # GRPO 1.0 / 1.0; sampled at step 120: ERPO 0.875 / 0.69, GRPO 0.84 / 0.77.
    config = bandit_config(algorithm)
    config.env.name = "mixture"
    config.env.params = {}
    config.env.members = [
        dict(name="bandit", kwargs={}, params={"high_prob": 0.5}),
        dict(name="guess_number", kwargs={"max_n": 4}, params={}),
    ]
    config.train_steps = 120
    trainer = TokenTrainer(config)
    state, _ = _train(trainer, config.train_steps)
    metrics, _ = trainer.evaluate(state.params, jax.random.key(1), greedy=True)
    assert float(metrics["success_rate/0_bandit"]) >= 0.9
    assert float(metrics["success_rate/1_guess_number"]) >= 0.6
