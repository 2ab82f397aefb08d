"""Partial rollouts (`arl.rollout.partial_rollouts.partial_slot_rollout`, `rollout.carried_groups`):
groups beyond a step's quota are carried, unfinished, into the next step.

With the parameters held fixed, every episode a run of partial steps returns is an
episode the lockstep rollout of its group's key plays, token for token, though some were
cut mid-turn at one step's end and continued by the next; the staleness bound restarts
groups that started too long ago, so no returned token is older than it allows; and a
run stopped and resumed from its checkpoint (the carried episodes in it) ends bit for
bit where an uninterrupted run ends, in the fused step (lag 0) and at lag 2."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl import config as config_lib
from arl import rollout as rollout_lib
from arl.errors import ConfigError
from arl.rollout import partial_rollouts
from tests.test_slots import _config  # GRPO on the bandit with rollout.* overrides
from tests.test_slots import ENV, MODEL, PARAMS, tiny_policy  # LongTail(6 turns, 4 tokens)

NUM_TASKS, GROUP, CARRIED, NUM_SLOTS, STEPS = 2, 2, 2, 3, 5
HORIZON = 5
EXACT = ("tokens", "agent_mask", "observation_mask", "rewards", "turn_end_mask", "length",
         "num_turns", "success", "terminated", "episode_return", "format_errors",
         "turn_rewards", "turn_starts", "turn_active", "turn_success")


INIT_KEY = jax.random.key(1)
STEP_KEYS = [jax.random.key(10 + t) for t in range(STEPS)]


@functools.lru_cache(maxsize=None)
def _partial_run(max_staleness):
    """STEPS partial steps at fixed parameters, the version rising by one per step."""
    carried = jax.jit(lambda p: partial_rollouts.initial_carried(
        ENV, INIT_KEY, carried_groups=CARRIED, group_size=GROUP, model=MODEL, params=p,
        num_slots=NUM_SLOTS))(PARAMS)
    step = jax.jit(lambda c, k, v: partial_rollouts.partial_slot_rollout(
        ENV, k, c, num_tasks=NUM_TASKS, group_size=GROUP, model=MODEL, params=PARAMS,
        num_slots=NUM_SLOTS, version=v, max_staleness=max_staleness, horizon=HORIZON))
    steps = []
    for t, key in enumerate(STEP_KEYS):
        traj, carried, stats = step(carried, key, jnp.int32(t))
        steps.append(jax.device_get((traj, stats)))
    return steps


@pytest.fixture(scope="module")
def lockstep_episodes():
    """Every episode the run can return: the lockstep rollouts of the initial carried
    groups' key and of each step's key (a group plays the episodes of the key it was
    drawn with, however it is scheduled)."""
    run = jax.jit(lambda k, n: rollout_lib.rollout(
        ENV, k, num_tasks=n, group_size=GROUP, model=MODEL, params=PARAMS,
        horizon=HORIZON), static_argnums=1)
    return [jax.device_get(run(INIT_KEY, CARRIED))] + [
        jax.device_get(run(key, NUM_TASKS)) for key in STEP_KEYS]


def _match(traj, row, candidates):
    """(batch, row) of the lockstep episode with `traj`'s row `row`'s tokens."""
    found = [(b, r) for b, c in enumerate(candidates) for r in range(c.tokens.shape[0])
             if np.array_equal(c.tokens[r], traj.tokens[row])]
    assert len(found) == 1, f"row {row}: {len(found)} lockstep episodes match"
    return found[0]


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_returned_episodes_are_the_lockstep_episodes_continued_token_exact(
        lockstep_episodes, max_staleness):
    steps = _partial_run(max_staleness)
    seen, spans = set(), []
    for t, (traj, stats) in enumerate(steps):
        for row in range(NUM_TASKS * GROUP):
            b, r = _match(traj, row, lockstep_episodes)
            assert (b, r) not in seen  # no episode returned twice
            seen.add((b, r))
            reference = lockstep_episodes[b]
            for field in EXACT:
                np.testing.assert_array_equal(getattr(traj, field)[row],
                                              getattr(reference, field)[r], err_msg=field)
            for field in ("behaviour_logp", "values"):
                np.testing.assert_allclose(getattr(traj, field)[row],
                                           getattr(reference, field)[r], atol=2e-6,
                                           err_msg=field)
            agent = traj.agent_mask[row] > 0
            versions = traj.token_versions[row][agent]
            # No token older than the bound allows, none from the future.
            assert versions.min() >= t - max_staleness and versions.max() <= t
            spans.append(versions.max() - versions.min())
        # The group ids of a step: the tasks in the order the groups entered.
        np.testing.assert_array_equal(traj.group_ids, np.repeat(np.arange(NUM_TASKS), GROUP))
    if max_staleness:
        # Episodes cut at one step's end and finished by a later one; none restarted.
        assert max(spans) >= 1
        assert sum(int(s.restarted) for _, s in steps) == 0
    else:
        assert max(spans) == 0  # every returned episode played within one step
        assert sum(int(s.restarted) for _, s in steps) > 0
    assert all(int(s.carried) > 0 for _, s in steps)


def test_a_restart_replays_its_group_from_the_first_turn():
    """A stale group played again from its first turn with the same keys: at fixed
    parameters the staleness-0 run returns the same episodes as the staleness-2 run, in
    an order the restarts may change."""
    def episodes(steps):
        return sorted(tuple(traj.tokens[row].tolist()) for traj, _ in steps
                      for row in range(NUM_TASKS * GROUP))

    fresh_only, carried = _partial_run(0), _partial_run(2)
    shared = set(episodes(fresh_only)) & set(episodes(carried))
    assert len(shared) >= NUM_TASKS * GROUP * (STEPS - 2)


def test_bad_arguments_are_refused():
    carried = partial_rollouts.initial_carried(ENV, INIT_KEY, carried_groups=1, group_size=GROUP,
                                    model=MODEL, params=PARAMS, num_slots=2)
    with pytest.raises(ValueError, match="max_staleness=-1"):
        partial_rollouts.partial_slot_rollout(ENV, STEP_KEYS[0], carried, num_tasks=1,
                                   group_size=GROUP, model=MODEL, params=PARAMS,
                                   num_slots=2, version=0, max_staleness=-1)
    with pytest.raises(ValueError, match="carried_groups=0"):
        partial_rollouts.initial_carried(ENV, INIT_KEY, carried_groups=0, group_size=GROUP,
                              model=MODEL, params=PARAMS, num_slots=2)


@pytest.mark.parametrize("rollout, loss, field", [
    (dict(carried_groups=2), {}, "rollout.carried_groups"),  # lockstep
    (dict(schedule="slots", carried_groups=-1), {}, "rollout.carried_groups"),
    (dict(schedule="slots", carried_groups=2, max_staleness=-1), {},
     "rollout.max_staleness"),
    (dict(schedule="slots", carried_groups=2), {}, "loss.off_policy_correction"),
])
def test_config_refuses_bad_partial_settings(rollout, loss, field):
    c = _config(**rollout)
    for name, value in loss.items():
        c.loss[name] = value
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_lib.validate(c)


def test_config_takes_partial_rollouts_with_a_correction_or_no_staleness():
    c = _config(schedule="slots", carried_groups=2, max_staleness=0)
    config_lib.validate(c)
    c = _config(schedule="slots", carried_groups=2, max_staleness=2)
    c.loss.off_policy_correction = "tis"
    config_lib.validate(c)


def _run_config(policy_lag):
    """A tiny guess_number run with partial rollouts (fused at lag 0, two programs at
    lag 2)."""
    c = _config(schedule="slots", num_tasks=2, group_size=2, num_slots=2, carried_groups=1,
                max_staleness=1, policy_lag=policy_lag)
    c.env.name = "guess_number"
    c.loss.off_policy_correction = "tis"
    c.loss.echo_coef = 0.1  # keeps the parameters moving when every group is degenerate
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 16, 1, 32
    c.model.num_heads = c.model.num_kv_heads = 2
    c.warm_start.sft_steps = 0
    c.log_every, c.checkpoint_every, c.sample_every = 1, 2, 0
    return c


@pytest.mark.parametrize("policy_lag", [
    0, pytest.param(2, marks=pytest.mark.slow)])  # lag 2: also the slow SIGKILL test below
def test_a_stopped_run_resumes_with_its_carried_episodes_bit_for_bit(tmp_path, policy_lag):
    """Stopped after step 2 (checkpoint 2 holds the carried episodes) and resumed to
    step 4: the same metrics at every step and the same final checkpoint as a run of 4
    steps straight through."""
    from arl.runs import experiment
    from tests.test_experiment import _final_state, _flat_arrays

    config = _run_config(policy_lag)
    config.train_steps = 4
    reference = experiment.run(config, str(tmp_path / "reference"))
    first = _run_config(policy_lag)
    first.train_steps = 2
    experiment.run(first, str(tmp_path / "resumed"))
    resumed = experiment.run(config, str(tmp_path / "resumed"))
    assert [m["step"] for m in resumed] == [3, 4]
    for expected, got in zip(reference[2:], resumed):
        assert expected.keys() == got.keys()
        for name in expected:
            assert np.array_equal(expected[name], got[name]), name
    assert any(m["rollout/carried_episodes"] > 0 for m in reference)
    assert any(m["off_policy/token_staleness_max"] > 0 for m in reference)

    final = [_flat_arrays(_final_state(tmp_path / run, 4)) for run in ("reference", "resumed")]
    carried_prefix = "rollout_carry/" if policy_lag == 0 else "carried/"
    assert any(name.startswith(carried_prefix) for name in final[0])
    assert sorted(final[0]) == sorted(final[1])
    for name, value in final[0].items():
        assert np.array_equal(value, final[1][name]), name


@pytest.mark.slow  # io_callback steps: two more compiles
def test_a_host_environment_episode_carries_over_and_continues():
    """A host environment (its memory in the env state, stepped through io_callback from
    the slot loop) carried across steps: every returned episode is one of the lockstep
    episodes of its group's key."""
    from tests.envs.test_host_env import Reverse  # pylint: disable=import-outside-toplevel

    env = Reverse(max_turns=3)
    model, params = tiny_policy(env, value_head=False)
    carried = partial_rollouts.initial_carried(env, INIT_KEY, carried_groups=1, group_size=GROUP,
                                    model=model, params=params, num_slots=2)
    step = jax.jit(lambda c, k, v: partial_rollouts.partial_slot_rollout(
        env, k, c, num_tasks=1, group_size=GROUP, model=model, params=params, num_slots=2,
        version=v, max_staleness=2))
    lockstep = jax.jit(lambda k: rollout_lib.rollout(
        env, k, num_tasks=1, group_size=GROUP, model=model, params=params))
    candidates = [jax.device_get(lockstep(key)) for key in [INIT_KEY] + STEP_KEYS[:3]]
    spans = []
    for t, key in enumerate(STEP_KEYS[:3]):
        traj, carried, _ = jax.device_get(step(carried, key, jnp.int32(t)))
        for row in range(GROUP):
            b, r = _match(traj, row, candidates)
            for field in ("rewards", "num_turns", "length", "observation_mask"):
                np.testing.assert_array_equal(getattr(traj, field)[row],
                                              getattr(candidates[b], field)[r],
                                              err_msg=field)
            versions = traj.token_versions[row][traj.agent_mask[row] > 0]
            spans.append(versions.max() - versions.min())
    assert max(spans) >= 1  # one episode at least continued by a later step


_KILL_FLAGS = (
    "--config=configs/grpo_guess_number.py", "--config.train_steps=5", "--config.log_every=1",
    "--config.checkpoint_every=2", "--config.sample_every=0",
    "--config.rollout.num_tasks=2", "--config.rollout.group_size=2",
    "--config.rollout.schedule=slots", "--config.rollout.num_slots=2",
    "--config.rollout.carried_groups=1", "--config.rollout.max_staleness=1",
    "--config.rollout.policy_lag=2", "--config.loss.off_policy_correction=tis",
    "--config.model.d_model=16", "--config.model.num_layers=1", "--config.model.mlp_dim=32",
    "--config.model.num_heads=2", "--config.model.num_kv_heads=2",
    "--config.warm_start.sft_steps=0", "--config.loss.echo_coef=0.1",
)


@pytest.mark.slow  # three CLI processes
def test_a_sigkilled_cli_run_with_carried_episodes_resumes_exactly(tmp_path):
    """`experiments.train` with partial rollouts at lag 2, killed with SIGKILL after step 3
    (checkpoint 2 committed: its carried episodes, rollouts 3 and 4 in flight), restarted
    on the same workdir: every metric of every step and the final checkpoint as an
    uninterrupted run's."""
    import os
    import signal

    from arl.runs import writers
    from tests.test_experiment import _final_state, _flat_arrays, _train

    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", tmp_path / "jax_cache")
    reference = _train(tmp_path / "reference", _KILL_FLAGS, cache)
    assert reference.returncode == 0, reference.stdout[-3000:]
    killed = _train(tmp_path / "resumed", _KILL_FLAGS, cache, "--debug_kill_after_step=3")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    resumed = _train(tmp_path / "resumed", _KILL_FLAGS, cache)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "Resumed from step 2" in resumed.stdout
    expected = writers.read_metrics(tmp_path / "reference")
    assert writers.read_metrics(tmp_path / "resumed") == expected
    assert any(m["rollout/carried_episodes"] > 0 for m in expected)
    final = [_flat_arrays(_final_state(tmp_path / run, 5)) for run in ("reference", "resumed")]
    assert any(name.startswith("carried/") for name in final[0])
    assert sorted(final[0]) == sorted(final[1])
    for name, value in final[0].items():
        assert np.array_equal(value, final[1][name]), name


@pytest.mark.slow
def test_a_sharded_step_with_carried_episodes_equals_one_device():
    """Partial rollouts on a 2x2x2 mesh (the carried episodes replicated, the trained
    batch over data x FSDP, parameters over FSDP and tensor) give one device's metrics
    and parameters after three steps (tolerances as tests/test_train.py's)."""
    import math

    from arl.trainers import build

    def three_steps(mesh):
        c = _run_config(0)
        c.rollout.num_tasks, c.rollout.group_size, c.rollout.num_slots = 4, 2, 4
        c.mesh = mesh
        trainer = build(c)
        state, history = trainer.init_state(), []
        devices = {len(x.sharding.device_set) for x in jax.tree.leaves(state.params)}
        assert devices == {math.prod(mesh)}, devices
        for _ in range(3):
            state, metrics = trainer.train_step(state)
            history.append(jax.device_get(metrics))
        return jax.device_get(trainer.policy_params(state)), history

    params, single = three_steps((1, 1, 1))
    sharded_params, sharded = three_steps((2, 2, 2))
    assert max(m["off_policy/token_staleness_max"] for m in single) > 0
    for got, want in zip(sharded, single):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)
    for got, want in zip(jax.tree.leaves(sharded_params), jax.tree.leaves(params)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
