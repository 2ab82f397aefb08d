"""Slot scheduling (`arl.rollout.slots`) and per-episode keys (`arl.rollout.episode_keys`):
with the same key a slot-scheduled rollout plays the episodes a lockstep rollout plays,
bit for bit with one slot per episode, and the same tokens, rewards and turns with fewer
slots (the log-probs then to float rounding: another batch shape); an episode's draws do
not depend on the other episodes of its batch; the config keys are checked early."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl import config as config_lib
from arl import rollout as rollout_lib
from arl.errors import ConfigError
from arl.models.transformer import Transformer, TransformerConfig
from arl.rollout import episode_keys
from arl.rollout.slots import slot_rollout
from benchmarks.long_tail_env import LongTail

ENV = LongTail(max_turns=6, action_len=4)
NUM_TASKS, GROUP = 3, 2
EXACT = ("tokens", "agent_mask", "observation_mask", "rewards", "turn_end_mask", "length",
         "group_ids", "env_ids", "num_turns", "success", "terminated", "episode_return",
         "format_errors", "process_rewards", "turn_rewards", "turn_starts", "turn_active",
         "turn_success")
FLOATS = ("behaviour_logp", "values")


def tiny_policy(env, value_head: bool = True):
    """(model, params): a one-layer policy over `env`'s codec and context."""
    config = TransformerConfig(
        vocab_size=env.codec.vocab_size, d_model=16, num_layers=1, num_heads=2,
        num_kv_heads=2, mlp_dim=32, max_len=rollout_lib.context_length(env),
        value_head=value_head)
    model = Transformer(config)
    params = model.init(jax.random.key(0), jnp.zeros((1, config.max_len), jnp.int32))
    return model, nn.unbox(params["params"])


MODEL, PARAMS = tiny_policy(ENV)
KEY = jax.random.key(4)  # groups of 2, 4 and 6 turns (6 cut at the horizon, 5)


@pytest.fixture(scope="module")
def lockstep():
    run = jax.jit(lambda p, k: rollout_lib.rollout(
        ENV, k, num_tasks=NUM_TASKS, group_size=GROUP, model=MODEL, params=p, horizon=5))
    return jax.device_get(run(PARAMS, KEY))


def _slots(num_slots, service_batch):
    run = jax.jit(lambda p, k: slot_rollout(
        ENV, k, num_tasks=NUM_TASKS, group_size=GROUP, model=MODEL, params=p, horizon=5,
        num_slots=num_slots, service_batch=service_batch, return_stats=True))
    return jax.device_get(run(PARAMS, KEY))


def test_one_slot_per_episode_plays_the_lockstep_episodes_bit_for_bit(lockstep):
    turns = np.asarray(lockstep.num_turns)
    assert len(set(turns.tolist())) > 1 and turns.max() == 5  # long-tailed, horizon cut
    traj, stats = _slots(NUM_TASKS * GROUP, 1)
    for field in EXACT + FLOATS:
        np.testing.assert_array_equal(getattr(traj, field), getattr(lockstep, field),
                                      err_msg=field)
    # One iteration per decoded token of the longest episode (4-token turns, 5 turns at
    # most), against lockstep's 5 turns x 4 tokens for every row.
    assert stats.decode_steps == np.max(np.asarray(lockstep.agent_mask).sum(1))


def test_fewer_slots_take_the_next_episodes_and_play_the_same_ones(lockstep):
    traj, stats = _slots(2, 2)
    for field in EXACT:
        np.testing.assert_array_equal(getattr(traj, field), getattr(lockstep, field),
                                      err_msg=field)
    for field in FLOATS:
        np.testing.assert_allclose(getattr(traj, field), getattr(lockstep, field),
                                   atol=2e-6, err_msg=field)
    agent_tokens = int(np.asarray(lockstep.agent_mask).sum())
    # Every decoded token in one of the 2 slots: at least half the tokens' worth of
    # iterations, and every iteration that decoded carried a busy slot.
    assert stats.busy_slot_steps == agent_tokens
    assert agent_tokens / 2 <= stats.decode_steps < agent_tokens
    assert stats.services >= 1


def test_an_episode_does_not_depend_on_the_other_episodes_of_its_batch(lockstep):
    """Episode e's task and draws come from e's own keys: the first two groups of a batch
    of three are the episodes of a batch of two."""
    run = jax.jit(lambda p, k: rollout_lib.rollout(
        ENV, k, num_tasks=NUM_TASKS - 1, group_size=GROUP, model=MODEL, params=p, horizon=5))
    smaller = jax.device_get(run(PARAMS, KEY))
    rows = (NUM_TASKS - 1) * GROUP
    for field in ("tokens", "num_turns", "rewards", "turn_starts"):
        np.testing.assert_array_equal(getattr(smaller, field),
                                      getattr(lockstep, field)[:rows], err_msg=field)
    np.testing.assert_allclose(smaller.behaviour_logp, lockstep.behaviour_logp[:rows],
                               atol=2e-6)


def test_episode_keys_are_the_documented_fold_ins():
    key = jax.random.key(5)
    reset = episode_keys.group_reset_keys(key, 3, 2)
    expected = [jax.random.fold_in(key, g) for g in (0, 0, 1, 1, 2, 2)]
    np.testing.assert_array_equal(jax.random.key_data(reset),
                                  np.stack([jax.random.key_data(k) for k in expected]))
    keys = episode_keys.episode_keys(key, 4)
    action, step = episode_keys.turn_keys(keys, jnp.array([0, 1, 2, 3]))
    turn = jax.random.fold_in(jax.random.fold_in(key, 2), 2)
    np.testing.assert_array_equal(jax.random.key_data(action[2]),
                                  jax.random.key_data(jax.random.fold_in(turn, 0)))
    np.testing.assert_array_equal(jax.random.key_data(step[2]),
                                  jax.random.key_data(jax.random.fold_in(turn, 1)))
    # Raw uint32 keys are batches by their leading axis too.
    assert episode_keys.is_batch(jnp.zeros((4, 2), jnp.uint32))
    assert not episode_keys.is_batch(jnp.zeros((2,), jnp.uint32))
    assert not episode_keys.is_batch(key) and episode_keys.is_batch(keys)


def test_a_groups_members_play_different_episodes_from_one_task(lockstep):
    """The rows of a group share their task (reset key) and prompt, and draw from their
    own episode keys: at temperature 1 their actions differ, while their first
    observations are the same."""
    agent = np.asarray(lockstep.agent_mask).astype(bool)
    tokens = np.asarray(lockstep.tokens)
    for g in range(NUM_TASKS):
        a, b = 2 * g, 2 * g + 1
        prompt = int(np.argmax(agent[a]))
        np.testing.assert_array_equal(tokens[a, :prompt], tokens[b, :prompt])
        assert not np.array_equal(tokens[a][agent[a]][:4], tokens[b][agent[b]][:4]), g


def test_row_keys_draw_from_the_softmax_and_new_noise_per_turn_and_token():
    """Per-row noise (`row_noise`) keyed by episode, turn and token: 20000 rows draw from
    softmax(logits / T) (each frequency within 5 standard errors), top_k keeps to the k
    largest logits, and the noise of two turns, two tokens or two episodes differs."""
    from arl.models import sampling  # pylint: disable=import-outside-toplevel

    rows = 20000
    logits = jnp.broadcast_to(jnp.log(jnp.array([0.5, 0.25, 0.15, 0.07, 0.03])), (rows, 5))
    keys = episode_keys.episode_keys(jax.random.key(9), rows)
    action, _ = episode_keys.turn_keys(keys, jnp.zeros((rows,), jnp.int32))
    for temperature in (1.0, 2.0):
        tokens, _ = sampling.sample_from_logits(
            None, logits, temperature=temperature,
            gumbel=sampling.row_noise(action, 0, 5))
        want = np.asarray(jax.nn.softmax(logits[0] / temperature))
        got = np.bincount(np.asarray(tokens), minlength=5) / rows
        np.testing.assert_array_less(np.abs(got - want),
                                     5 * np.sqrt(want * (1 - want) / rows) + 1e-9)
    top2, _ = sampling.sample_from_logits(None, logits, top_k=2,
                                          gumbel=sampling.row_noise(action, 0, 5))
    assert set(np.unique(np.asarray(top2)).tolist()) == {0, 1}
    next_turn, _ = episode_keys.turn_keys(keys, jnp.ones((rows,), jnp.int32))
    noise = {name: np.asarray(sampling.row_noise(k, t, 5)[:8]) for name, k, t in (
        ("turn 0 token 0", action, 0), ("turn 0 token 1", action, 1),
        ("turn 1 token 0", next_turn, 0))}
    for name, x in noise.items():
        assert len({row.tobytes() for row in x}) == 8, name  # episodes differ
    assert not np.any(noise["turn 0 token 0"] == noise["turn 0 token 1"])
    assert not np.any(noise["turn 0 token 0"] == noise["turn 1 token 0"])


def test_slot_rollout_refuses_bad_sizes():
    with pytest.raises(ValueError, match="num_slots=7"):
        slot_rollout(ENV, KEY, num_tasks=NUM_TASKS, group_size=GROUP, model=MODEL,
                     params=PARAMS, num_slots=7)
    with pytest.raises(ValueError, match="service_batch=3"):
        slot_rollout(ENV, KEY, num_tasks=NUM_TASKS, group_size=GROUP, model=MODEL,
                     params=PARAMS, num_slots=2, service_batch=3)


def _config(**rollout):
    c = config_lib.default_config()
    c.algorithm = "grpo"
    c.env.name = "bandit"
    for name, value in rollout.items():
        c.rollout[name] = value
    return c


@pytest.mark.parametrize("rollout, field", [
    (dict(schedule="continuous"), "rollout.schedule"),
    (dict(schedule="slots", num_slots=129), "rollout.num_slots"),
    (dict(schedule="slots", num_slots=-1), "rollout.num_slots"),
    (dict(schedule="slots", num_slots=4, slot_service_batch=5), "rollout.slot_service_batch"),
])
def test_config_refuses_bad_schedule_settings(rollout, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_lib.validate(_config(**rollout))


def test_config_refuses_slots_with_what_needs_lockstep():
    c = _config(schedule="slots")
    c.process.mc_samples = 2
    with pytest.raises(ConfigError, match=r"rollout\.schedule.*branching"):
        config_lib.validate(c)
    c = _config(schedule="slots")
    c.updates.reuse_rollout_activations = True
    with pytest.raises(ConfigError, match=r"reuse_rollout_activations.*slot"):
        config_lib.validate(c)
    config_lib.validate(_config(schedule="slots", num_slots=32, slot_service_batch=8))


@pytest.mark.slow  # two more compiles with io_callback steps: the file's largest cost
def test_slots_step_a_host_environment_from_inside_the_loop():
    """A host environment (io_callback steps) served from the slot loop's conditional
    branch plays the lockstep episodes."""
    from tests.envs.test_host_env import Reverse  # pylint: disable=import-outside-toplevel

    env = Reverse(max_turns=2)
    model, params = tiny_policy(env, value_head=False)
    lockstep = jax.jit(lambda p, k: rollout_lib.rollout(
        env, k, num_tasks=2, group_size=2, model=model, params=p))(params, KEY)
    slots = jax.jit(lambda p, k: slot_rollout(
        env, k, num_tasks=2, group_size=2, model=model, params=p, num_slots=2))(params, KEY)
    for field in ("tokens", "rewards", "num_turns", "length", "observation_mask"):
        np.testing.assert_array_equal(getattr(slots, field), getattr(lockstep, field),
                                      err_msg=field)


@pytest.mark.slow
def test_a_train_step_with_slots_logs_the_lockstep_metrics_bit_for_bit():
    """The trainer's rollout (`rollout.schedule`) with one slot per episode: the same
    episodes, so the same update and metrics, bit for bit, for two steps."""
    from arl.trainers import TokenTrainer  # pylint: disable=import-outside-toplevel

    logged = {}
    for scheduler in ("lockstep", "slots"):
        c = _config(schedule=scheduler, num_tasks=2, group_size=2)
        c.env.name = "guess_number"
        c.model.d_model, c.model.num_layers, c.model.mlp_dim = 16, 1, 32
        c.model.num_heads = c.model.num_kv_heads = 2
        trainer = TokenTrainer(c)
        state = trainer.init_state()
        history = []
        for _ in range(2):
            state, metrics = trainer.train_step(state)
            history.append(jax.device_get(metrics))
        logged[scheduler] = history
    for lock, slot in zip(logged["lockstep"], logged["slots"]):
        assert lock.keys() == slot.keys()
        for name in lock:
            np.testing.assert_array_equal(slot[name], lock[name], err_msg=name)
    assert logged["slots"][0]["response_tokens_mean"] > 0
