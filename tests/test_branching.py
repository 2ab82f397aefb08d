"""Monte Carlo branching (arl.rollout.branching) and the process reward models (arl.credit):
forked continuations replay the trajectory under a deterministic policy, finished rows
get no estimate, the soft estimate converges to the exact success probability, and the
PRM's states, labels and loss on a hand-made trajectory."""

import functools
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arl.rollout import branching
from arl.trainers import process_reward_models as prm_lib
from arl import envs
from arl import rollout as rollout_lib
from arl.models import transformer as transformer_lib

GREEDY = rollout_lib.SamplingConfig(greedy=True)


@pytest.fixture(scope="module")
def guess_env():
    return envs.make("guess_number", max_n=16)  # max_turns 6


@pytest.fixture(scope="module")
def tiny_policy(guess_env):
    cfg = transformer_lib.TransformerConfig(
        vocab_size=guess_env.codec.vocab_size, d_model=32, num_layers=1, num_heads=2,
        num_kv_heads=2, mlp_dim=64, max_len=rollout_lib.context_length(guess_env),
        initializer_range=0.3)  # decisive logits: greedy argmax has no near-ties
    model = transformer_lib.Transformer(cfg)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    return model, params


# ---------------------------------------------------------------- replay


BRANCH_TURNS = (1, 3, 4)
REPLAY_SAMPLES = 2


def _greedy_rollout(env, model, params, key):
    return rollout_lib.rollout(env, key, num_tasks=4, group_size=2, model=model,
                               params=params, sampling=GREEDY, record_turn_states=True)


@pytest.fixture(scope="module")
def greedy_replay(guess_env, tiny_policy):
    model, params = tiny_policy
    env = guess_env

    @jax.jit
    def run(key):
        roll_key, branch_key = jax.random.split(key)
        traj = _greedy_rollout(env, model, params, roll_key)
        carry, per_turn, reached = branching.play_continuations(
            env, branch_key, traj, branch_turns=BRANCH_TURNS, num_samples=REPLAY_SAMPLES,
            model=model, params=params, sampling=GREEDY)
        return traj, carry, per_turn, reached

    return jax.tree.map(np.asarray, run(jax.random.key(5)))


def test_greedy_continuations_replay_the_trajectory(guess_env, greedy_replay):
    traj, carry, per_turn, reached = greedy_replay
    batch, width = traj.tokens.shape
    shape = (batch, len(BRANCH_TURNS), REPLAY_SAMPLES)
    reached = reached.reshape(shape)
    want_reached = traj.turn_active[:, list(BRANCH_TURNS)]
    np.testing.assert_array_equal(reached, np.repeat(want_reached[:, :, None],
                                                     REPLAY_SAMPLES, axis=2))
    assert reached.any()
    tokens = carry.tokens.reshape(shape + (width,))
    length = carry.offset.reshape(shape)
    success = carry.success.reshape(shape)
    rewards = per_turn.reward.sum(axis=1).reshape(shape)
    for b in range(batch):
        for j, k in enumerate(BRANCH_TURNS):
            if not want_reached[b, j]:
                continue
            for s in range(REPLAY_SAMPLES):
                np.testing.assert_array_equal(tokens[b, j, s], traj.tokens[b])
                assert length[b, j, s] == traj.length[b]
                assert success[b, j, s] == traj.success[b]
                np.testing.assert_allclose(rewards[b, j, s], traj.turn_rewards[b, k:].sum(),
                                           rtol=1e-5, atol=1e-6)


def _check_mean_return(traj, values, branch_turns, num_samples, gamma, max_turns):
    """values.values[b, k] is the discounted return-to-go of the (replayed) trajectory."""
    branched = np.zeros(max_turns, bool)
    branched[list(branch_turns)] = True
    np.testing.assert_array_equal(values.known, traj.turn_active & branched[None, :])
    for b in range(traj.tokens.shape[0]):
        for k in range(max_turns):
            if not values.known[b, k]:
                assert values.values[b, k] == 0 and values.success[b, k] == 0
                continue
            rest = traj.turn_rewards[b, k:]
            want = np.sum(rest * gamma ** np.arange(len(rest)))
            np.testing.assert_allclose(values.values[b, k], want, rtol=1e-5, atol=1e-6)
            assert values.success[b, k] == float(traj.success[b])
    # Cost: the continuations play exactly the remaining turns of the reached rows.
    remaining = sum(num_samples * traj.turn_active[:, k:].sum() for k in branch_turns)
    assert int(values.env_steps) == remaining


@pytest.mark.slow  # a second compile of the model's continuations (~40 s on 2 loaded cores)
def test_greedy_mean_return_is_the_discounted_return_to_go(guess_env, tiny_policy):
    model, params = tiny_policy

    @jax.jit
    def run(key):
        roll_key, branch_key = jax.random.split(key)
        traj = _greedy_rollout(guess_env, model, params, roll_key)
        return traj, branching.branch_values(
            guess_env, branch_key, traj, branch_turns=BRANCH_TURNS,
            num_samples=REPLAY_SAMPLES, model=model, params=params, sampling=GREEDY,
            estimate="mean_return", gamma=0.9)

    traj, values = jax.tree.map(np.asarray, run(jax.random.key(5)))
    _check_mean_return(traj, values, BRANCH_TURNS, REPLAY_SAMPLES, 0.9, guess_env.max_turns)


# ---------------------------------------------------------------- finished rows, errors


def test_rows_that_finished_before_the_branch_turn_get_no_estimate(guess_env):
    env = guess_env
    turns = (1, 3, 5)

    @jax.jit
    def run(key):
        traj = rollout_lib.rollout(env, key, num_tasks=16, group_size=1,
                                   action_source="oracle", record_turn_states=True)
        carry, per_turn, reached = branching.play_continuations(
            env, key, traj, branch_turns=turns, num_samples=2, action_source="oracle")
        values = branching.branch_values(env, key, traj, branch_turns=turns, num_samples=2,
                                         action_source="oracle", estimate="mean_return",
                                         gamma=0.8)
        return traj, carry, per_turn, reached, values

    traj, carry, per_turn, reached, values = jax.tree.map(np.asarray, run(jax.random.key(0)))
    num_turns = traj.num_turns
    assert np.all(traj.success)
    assert (num_turns <= 3).any() and (num_turns > 3).any()  # some rows end before turn 3
    reached = reached.reshape(16, 3, 2)
    for j, k in enumerate(turns):
        np.testing.assert_array_equal(reached[:, j, 0], num_turns > k)
        np.testing.assert_array_equal(values.known[:, k], num_turns > k)
    # Unreached copies play nothing: no turns, no tokens, no reward; they keep the success
    # their episode ended with (a continuation starts in the state it forks from).
    played = carry.num_turns.reshape(16, 3, 2)
    assert np.all(played[~reached] == 0)
    assert np.all(per_turn.active.reshape(16, 3, 2, -1)[~reached] == 0)
    assert np.all(carry.agent_mask.reshape(16, 3, 2, -1)[~reached] == 0)
    episode_success = np.broadcast_to(traj.success[:, None, None], (16, 3, 2))
    np.testing.assert_array_equal(carry.success.reshape(16, 3, 2)[~reached],
                                  episode_success[~reached])
    # The oracle is deterministic: forks replay the trajectory and succeed.
    _check_mean_return(traj, values, turns, 2, 0.8, env.max_turns)
    np.testing.assert_array_equal(values.success, values.known.astype(np.float32))
    np.testing.assert_array_equal(played[reached],
                                  np.repeat(num_turns[:, None, None] - np.array(turns)[:, None],
                                            2, axis=2)[reached])
    assert not values.known[:, [0, 2, 4]].any()


@pytest.mark.parametrize("kwargs, match", [
    (dict(branch_turns=()), r"branch_turns must name at least one turn"),
    (dict(branch_turns=(6,)), r"branch_turns=\(6,\) must be distinct turns in \[0, max_turns=6\)"),
    (dict(branch_turns=(-1,)), r"branch_turns"),
    (dict(branch_turns=(2, 2)), r"branch_turns=\(2, 2\) must be distinct"),
    (dict(num_samples=0), r"num_samples must be a positive int"),
    (dict(estimate="median"), r"estimate='median'"),
    (dict(gamma=1.5), r"gamma must be in \[0, 1\]"),
    (dict(action_source="model"), r"needs both `model` and `params`"),
])
def test_branch_values_rejects_bad_arguments(guess_env, kwargs, match):
    traj = jax.eval_shape(lambda k: rollout_lib.rollout(
        guess_env, k, num_tasks=2, group_size=1, action_source="oracle",
        record_turn_states=True), jax.random.key(0))
    args = dict(branch_turns=(1,), num_samples=2, action_source="oracle")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda k, t: branching.branch_values(guess_env, k, t, **args),
                       jax.random.key(0), traj)


def test_branching_needs_recorded_turn_states(guess_env):
    traj = jax.eval_shape(lambda k: rollout_lib.rollout(
        guess_env, k, num_tasks=2, group_size=1, action_source="oracle"), jax.random.key(0))
    with pytest.raises(ValueError, match="record_turn_states=True"):
        branching.play_continuations(guess_env, jax.random.key(0), traj, branch_turns=(1,),
                                     num_samples=1, action_source="oracle")


# ---------------------------------------------------------------- Monte Carlo convergence


@functools.lru_cache(maxsize=None)
def demonstrator_success(low, high, hidden, turns_left):
    """P(the demonstrator finds `hidden` within `turns_left` turns from [low, high]): each
    turn it guesses uniformly in [low, high] with probability 1/2, else the midpoint."""
    if turns_left == 0:
        return 0.0

    def after(guess):
        if guess == hidden:
            return 1.0
        if guess < hidden:
            return demonstrator_success(guess + 1, high, hidden, turns_left - 1)
        return demonstrator_success(low, guess - 1, hidden, turns_left - 1)

    uniform = np.mean([after(g) for g in range(low, high + 1)])
    return 0.5 * uniform + 0.5 * after((low + high) // 2)


def test_soft_estimate_converges_to_the_exact_success_probability():
    # Four turns (not the default six, where the demonstrator almost always succeeds):
    # success probabilities of the mid-episode states spread over (0, 1).
    env = envs.make("guess_number", max_n=16, max_turns=4)
    turns = (1, 2)

    @functools.partial(jax.jit, static_argnames=("num_samples", "estimate"))
    def run(key, traj, num_samples, estimate):
        return branching.branch_values(env, key, traj, branch_turns=turns,
                                       num_samples=num_samples,
                                       action_source="demonstrator", estimate=estimate)

    traj = jax.jit(lambda k: rollout_lib.rollout(
        env, k, num_tasks=32, group_size=1, action_source="demonstrator",
        record_turn_states=True))(jax.random.key(1))
    states = jax.tree.map(np.asarray, traj.turn_states)
    active = np.asarray(traj.turn_active)
    truth, where = [], []
    for b in range(32):
        for k in turns:
            if active[b, k]:
                truth.append(demonstrator_success(int(states.low[b, k]),
                                                  int(states.high[b, k]),
                                                  int(states.hidden[b, k]),
                                                  env.max_turns - k))
                where.append((b, k))
    assert len(where) > 30
    truth = np.asarray(truth)
    assert 0.3 < truth.mean() < 0.9 and truth.std() > 0.1  # not a trivial target
    rows, cols = map(np.asarray, zip(*where))

    def estimate(key, num_samples, kind):
        out = jax.tree.map(np.asarray, run(key, traj, num_samples, kind))
        assert out.known[rows, cols].all() and out.known.sum() == len(where)
        return out.values[rows, cols], out.success[rows, cols]

    # Two compiles: K = 4 ("soft") and K = 64 ("hard"; `success` holds the soft estimate
    # whatever the estimate); K = 256 averages four independent K = 64 calls (soft is a
    # mean over samples). K = 4 -> 64 checks the samples within one call are independent.
    keys = jax.random.split(jax.random.key(2), 4)
    soft4, success4 = estimate(keys[0], 4, "soft")
    np.testing.assert_array_equal(soft4, success4)
    hard, soft64 = estimate(keys[0], 64, "hard")
    estimates = {4: soft4, 64: soft64}
    estimates[256] = np.mean([soft64] + [estimate(k, 64, "hard")[1] for k in keys[1:]], axis=0)
    errors = {n: float(np.mean(np.abs(e - truth))) for n, e in estimates.items()}
    print("mean absolute error of the soft estimate by num_samples:", errors)
    assert errors[4] > errors[64] > errors[256], errors
    assert errors[256] < 0.04, errors
    assert errors[4] > 2.5 * errors[64], errors  # ~ sqrt(16) = 4 for independent samples
    assert errors[64] > 1.4 * errors[256], errors  # ~ sqrt(4) = 2

    # Hard: one success among 64 samples; every state with a fair chance has one.
    assert set(np.unique(hard)) <= {0.0, 1.0}
    assert np.all(hard >= soft64)
    assert np.all(hard[truth > 0.2] == 1.0)


# ---------------------------------------------------------------- credit (PRM)


def _hand_trajectory():
    """Two rows, K = 3 turns of two agent tokens, one observation token after each:
    <bos> p p | a a | o | a a | o | a a | o. Row 0 succeeds after two turns, row 1 fails
    after three."""
    batch, width = 2, 13
    agent = np.zeros((batch, width), np.float32)
    turn_end = np.zeros((batch, width), np.float32)
    for b, n in enumerate((2, 3)):
        for k in range(n):
            agent[b, 3 + 3 * k: 5 + 3 * k] = 1
            turn_end[b, 4 + 3 * k] = 1
    zeros = np.zeros((batch, width), np.float32)
    zb = np.zeros((batch,), np.int32)
    return rollout_lib.Trajectory(
        tokens=np.zeros((batch, width), np.int32), agent_mask=agent,
        observation_mask=zeros, behaviour_logp=zeros, rewards=zeros,
        turn_end_mask=turn_end, length=np.array([9, 12], np.int32),
        group_ids=zb, env_ids=zb, num_turns=np.array([2, 3], np.int32),
        success=np.array([True, False]), terminated=np.array([True, False]),
        episode_return=zeros[:, 0], format_errors=zb,
        turn_starts=np.array([[3, 6, 9], [3, 6, 9]], np.int32),
        turn_active=np.array([[1, 1, 0], [1, 1, 1]], bool))


class _FakePRM:
    """`apply` returns the parameters as the per-position value logits."""

    def apply(self, variables, tokens):
        return types.SimpleNamespace(values=variables["params"]["logits"] + 0 * tokens)


def test_state_positions_hand_made():
    traj = _hand_trajectory()
    # s_k is the last token before turn k; at and after the last turn, the row's last token.
    np.testing.assert_array_equal(prm_lib.state_positions(traj),
                                  [[2, 5, 8, 8], [2, 5, 8, 11]])


def test_prm_loss_uses_known_labels_and_the_final_outcome():
    traj = _hand_trajectory()
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 13)).astype(np.float32)
    params = {"logits": jnp.asarray(logits)}
    labels = np.array([[0.25, 0.5, 0.9], [0.75, 0.1, 0.3]], np.float32)
    known = np.array([[True, False, False], [True, True, False]])
    loss, metrics = prm_lib.prm_loss(params, _FakePRM(), traj, labels, known)

    def bce(x, y):
        p = 1 / (1 + np.exp(-x))
        return -(y * np.log(p) + (1 - y) * np.log(1 - p))

    # Row 0: s_0 (label 0.25), final s_2 (success 1). Row 1: s_0, s_1, final s_3 (fail 0).
    picked = [(0, 2, 0.25), (0, 8, 1.0), (1, 2, 0.75), (1, 5, 0.1), (1, 11, 0.0)]
    want = np.mean([bce(logits[b, t], y) for b, t, y in picked])
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert float(metrics["prm/labels"]) == 5
    accuracy = np.mean([(logits[b, t] > 0) == (y > 0.5) for b, t, y in picked])
    np.testing.assert_allclose(metrics["prm/accuracy"], accuracy, rtol=1e-6)
    # The gradient touches exactly the labelled positions.
    grads, _ = jax.grad(prm_lib.prm_loss, has_aux=True)(params, _FakePRM(), traj, labels,
                                                       known)
    touched = {(b, t) for b, t in zip(*np.nonzero(np.asarray(grads["logits"])))}
    assert touched == {(b, t) for b, t, _ in picked}


def test_prm_turn_rewards_telescope_on_turn_ends():
    traj = _hand_trajectory()
    logits = np.random.default_rng(1).normal(size=(2, 13)).astype(np.float32)
    rewards = np.asarray(prm_lib.prm_turn_rewards(_FakePRM(), {"logits": logits}, traj))
    phi = 1 / (1 + np.exp(-logits))
    assert np.all(rewards[traj.turn_end_mask == 0] == 0)
    np.testing.assert_allclose(rewards[0, [4, 7]], [phi[0, 5] - phi[0, 2], phi[0, 8] - phi[0, 5]],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rewards.sum(1), [phi[0, 8] - phi[0, 2], phi[1, 11] - phi[1, 2]],
                               rtol=1e-5, atol=1e-6)


def test_implicit_prm_rewards_and_loss():
    rng = np.random.default_rng(2)
    logp_phi = rng.normal(size=(3, 5)).astype(np.float32)
    ref_logp = rng.normal(size=(3, 5)).astype(np.float32)
    mask = (rng.random((3, 5)) < 0.6).astype(np.float32)
    success = np.array([True, False, True])
    rewards = prm_lib.implicit_rewards(logp_phi, ref_logp, mask, 0.05)
    np.testing.assert_allclose(rewards, 0.05 * (logp_phi - ref_logp) * mask, rtol=1e-6)
    loss, metrics = prm_lib.implicit_prm_loss(logp_phi, ref_logp, mask, success, 0.05)
    score = 0.05 * ((logp_phi - ref_logp) * mask).sum(1)
    want = np.mean(np.asarray(optax.sigmoid_binary_cross_entropy(score, success * 1.0)))
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    p = 1 / (1 + np.exp(-score))
    np.testing.assert_allclose(loss, -np.mean(np.where(success, np.log(p), np.log(1 - p))),
                               rtol=1e-5)
    np.testing.assert_allclose(metrics["implicit_prm/accuracy"],
                               np.mean((score > 0) == success))
