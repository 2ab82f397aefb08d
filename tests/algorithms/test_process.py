"""Turn ids, per-turn <-> per-token maps, process (PRIME) advantages and VinePPO turn
advantages against plain-NumPy loops written from the docstrings."""

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl import algorithms as alg

# ---------------------------------------------------------------- NumPy references


def turn_ids_reference(step_end, mask):
    """Turn k = agent tokens after the k-th step end up to and including the (k+1)-th."""
    out = np.full(mask.shape, -1, np.int64)
    for b in range(mask.shape[0]):
        count = 0
        for t in range(mask.shape[1]):
            if mask[b, t]:
                out[b, t] = count
                if step_end[b, t]:
                    count += 1
    return out


def turns_to_tokens_reference(per_turn, step_end, mask):
    ids = turn_ids_reference(step_end, mask)
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if 0 <= ids[b, t] < per_turn.shape[1]:
                out[b, t] = per_turn[b, ids[b, t]]
    return out


def tokens_to_turns_reference(x, step_end, mask, num_turns):
    ids = turn_ids_reference(step_end, mask)
    out = np.zeros((mask.shape[0], num_turns))
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if 0 <= ids[b, t] < num_turns:
                out[b, ids[b, t]] += x[b, t]
    return out


def process_advantages_reference(rewards, step_end, mask, group_ids, gamma,
                                 leave_one_out=True):
    """PRIME eq. 6 literally: leave-one-out mean of the other rows' mean step rewards,
    then each token gets the discounted reward-to-go of its step. Rows without steps
    have no mean step reward and take no part in the baselines."""
    batch, length = mask.shape
    steps = [[t for t in range(length) if mask[b, t] and step_end[b, t]] for b in range(batch)]
    means = [np.mean([rewards[b, t] for t in steps[b]]) if steps[b] else None
             for b in range(batch)]
    out = np.zeros((batch, length))
    for b in range(batch):
        others = [means[j] for j in range(batch)
                  if j != b and group_ids[j] == group_ids[b] and means[j] is not None]
        baseline = np.mean(others) if (leave_one_out and others) else 0.0
        step_rewards = [rewards[b, t] - baseline for t in steps[b]]
        step = 0  # the step token t belongs to
        for t in range(length):
            if not mask[b, t]:
                continue
            out[b, t] = sum(gamma ** (s - step) * step_rewards[s]
                            for s in range(step, len(step_rewards)))
            if step_end[b, t]:
                step += 1
    return out


def vine_advantages_reference(rewards, values, known, num_turns, gamma):
    """Segments a <= k < b between known states (and the end, value 0); a first segment
    without a known value uses baseline 0."""
    batch, turns = rewards.shape
    out = np.zeros((batch, turns))
    for i in range(batch):
        n = min(int(num_turns[i]), turns)
        boundaries = [k for k in range(n) if known[i, k]] + [n]
        if not boundaries or boundaries[0] != 0:
            boundaries = [0] + boundaries
        value = lambda k: float(values[i, k]) if k < n and known[i, k] else 0.0
        for a, b in zip(boundaries[:-1], boundaries[1:]):
            ret = sum(gamma ** (j - a) * rewards[i, j] for j in range(a, b))
            adv = ret + gamma ** (b - a) * value(b) - value(a)
            out[i, a:b] = adv
    return out


def random_tokens(seed, batch=6, length=14, end_fraction=0.35, agent_fraction=0.7):
    rng = np.random.default_rng(seed)
    mask = rng.random((batch, length)) < agent_fraction
    step_end = rng.random((batch, length)) < end_fraction
    rewards = rng.normal(size=(batch, length)).astype(np.float32)
    return rng, rewards, step_end, mask


def random_turns(seed, batch=6, turns=5):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(batch, turns)).astype(np.float32)
    values = rng.normal(size=(batch, turns)).astype(np.float32)
    known = rng.random((batch, turns)) < 0.5
    num_turns = rng.integers(0, turns + 1, size=batch).astype(np.int32)
    return rewards, values, known, num_turns


GAMMAS = (1.0, 0.9, 0.5)


# ---------------------------------------------------------------- turn ids and maps


class TurnMapsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_turn_ids_hand_computed(self):
        # <bos> a a| o a| o o a  ; step ends marked '|'; a step end off the mask is ignored.
        mask = np.array([[0, 1, 1, 0, 1, 0, 0, 1]], bool)
        step_end = np.array([[1, 0, 1, 1, 1, 0, 0, 0]], bool)
        ids = self.variant(alg.turn_ids)(step_end, mask)
        np.testing.assert_array_equal(ids, [[-1, 0, 0, -1, 1, -1, -1, 2]])
        chex.assert_type(ids, jnp.int32)

    @chex.variants(with_jit=True, without_jit=True)
    def test_maps_hand_computed(self):
        mask = np.array([[0, 1, 1, 0, 1, 0, 1, 1]], bool)
        step_end = np.array([[0, 0, 1, 0, 1, 0, 0, 1]], bool)
        per_turn = np.array([[10.0, 20.0]], np.float32)  # turn 2 is beyond K: gets 0
        tokens = self.variant(alg.turns_to_tokens)(per_turn, step_end, mask)
        np.testing.assert_array_equal(tokens, [[0, 10, 10, 0, 20, 0, 0, 0]])
        x = np.arange(8, dtype=np.float32)
        turns = self.variant(functools.partial(alg.tokens_to_turns, num_turns=3))(
            x[None], step_end, mask)
        np.testing.assert_array_equal(turns, [[1 + 2, 4, 6 + 7]])
        turns = self.variant(functools.partial(alg.tokens_to_turns, num_turns=2))(
            x[None], step_end, mask)
        np.testing.assert_array_equal(turns, [[3, 4]])  # turn 2's tokens are dropped

    def test_maps_match_reference_and_invert_on_turn_ends(self):
        for seed in range(3):
            rng, x, step_end, mask = random_tokens(seed)
            np.testing.assert_array_equal(alg.turn_ids(step_end, mask),
                                          turn_ids_reference(step_end, mask))
            per_turn = rng.normal(size=(6, 4)).astype(np.float32)
            np.testing.assert_allclose(alg.turns_to_tokens(per_turn, step_end, mask),
                                       turns_to_tokens_reference(per_turn, step_end, mask),
                                       rtol=1e-6)
            np.testing.assert_allclose(
                alg.tokens_to_turns(x, step_end, mask, num_turns=4),
                tokens_to_turns_reference(x, step_end, mask, 4), rtol=1e-5, atol=1e-6)
            # Values placed on turn ends round-trip: tokens_to_turns o (turns_to_tokens *
            # turn_end) is the identity on the turns that end inside the row.
            ends = step_end & mask
            on_ends = np.asarray(alg.turns_to_tokens(per_turn, step_end, mask)) * ends
            back = np.asarray(alg.tokens_to_turns(on_ends, step_end, mask, num_turns=4))
            ended = np.arange(4)[None, :] < np.minimum(ends.sum(1), 4)[:, None]
            np.testing.assert_allclose(back[ended], per_turn[ended], rtol=1e-6)
            assert np.all(back[~ended] == 0)

    def test_vmap_over_leading_axis(self):
        rng, x, step_end, mask = random_tokens(7)
        per_turn = rng.normal(size=(6, 3)).astype(np.float32)
        stack = lambda a: a.reshape((2, 3) + a.shape[1:])
        got = jax.vmap(alg.turns_to_tokens)(stack(per_turn), stack(step_end), stack(mask))
        np.testing.assert_allclose(got.reshape(6, -1),
                                   turns_to_tokens_reference(per_turn, step_end, mask))
        got = jax.vmap(functools.partial(alg.tokens_to_turns, num_turns=3))(
            stack(x), stack(step_end), stack(mask))
        np.testing.assert_allclose(got.reshape(6, -1),
                                   tokens_to_turns_reference(x, step_end, mask, 3),
                                   rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- process advantages

# Three rows of group 0 and one of group 1; two turns of two agent tokens, each followed
# by one observation token; step rewards on the turn ends.
HAND_MASK = np.tile(np.array([1, 1, 0, 1, 1, 0], bool), (4, 1))
HAND_END = np.tile(np.array([0, 1, 0, 0, 1, 0], bool), (4, 1))
HAND_REWARDS = np.zeros((4, 6), np.float32)
HAND_REWARDS[:, [1, 4]] = [[1, 3], [0, 2], [0, 0], [2, 4]]
HAND_GROUPS = np.array([0, 0, 0, 1], np.int32)


class ProcessAdvantagesTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_computed(self):
        fn = self.variant(functools.partial(alg.process_advantages, num_groups=2, gamma=0.5))
        got = fn(HAND_REWARDS, HAND_END, HAND_MASK, HAND_GROUPS)
        # Row means 2, 1, 0; leave-one-out baselines 0.5, 1, 1.5; row 3 is alone: none.
        # Row 0: steps [0.5, 2.5] -> [0.5 + 0.5 * 2.5, 2.5].
        want = np.array([[1.75, 1.75, 0, 2.5, 2.5, 0],
                         [-0.5, -0.5, 0, 1.0, 1.0, 0],
                         [-2.25, -2.25, 0, -1.5, -1.5, 0],
                         [4.0, 4.0, 0, 4.0, 4.0, 0]])
        np.testing.assert_allclose(got, want, rtol=1e-6)
        chex.assert_type(got, jnp.float32)

    @chex.variants(with_jit=True, without_jit=True)
    def test_no_baseline_and_undiscounted(self):
        fn = self.variant(functools.partial(alg.process_advantages, num_groups=2,
                                            leave_one_out=False))
        got = fn(HAND_REWARDS, HAND_END, HAND_MASK, HAND_GROUPS)
        want = np.array([[4, 4, 0, 3, 3, 0], [2, 2, 0, 2, 2, 0], [0, 0, 0, 0, 0, 0],
                         [6, 6, 0, 4, 4, 0]], np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-6)

    def test_matches_numpy_reference(self):
        for seed, gamma in enumerate(GAMMAS):
            _, rewards, step_end, mask = random_tokens(seed + 10)
            groups = np.array([0, 0, 0, 1, 1, 2], np.int32)
            loo = gamma != 0.5  # the static arguments of the property test below
            got = alg.process_advantages(rewards, step_end, mask, groups, num_groups=3,
                                         gamma=gamma, leave_one_out=loo)
            want = process_advantages_reference(rewards, step_end, mask, groups, gamma, loo)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_step_end_equal_to_mask_gives_token_level_returns(self):
        _, rewards, _, mask = random_tokens(3)
        groups = np.arange(6, dtype=np.int32)
        got = alg.process_advantages(rewards, mask, mask, groups, num_groups=6, gamma=0.9)
        want = alg.discounted_returns(rewards, mask, gamma=0.9)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # Every agent token is a step: the leave-one-out baseline is subtracted per token.
        got = alg.process_advantages(rewards, mask, mask, np.zeros(6, np.int32),
                                     num_groups=1, gamma=1.0)
        want = process_advantages_reference(rewards, mask, mask, np.zeros(6), 1.0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_every_token_of_a_turn_gets_its_turns_value(self):
        _, rewards, step_end, mask = random_tokens(4)
        groups = np.array([0, 0, 1, 1, 2, 2], np.int32)
        got = np.asarray(alg.process_advantages(rewards, step_end, mask, groups,
                                                num_groups=3, gamma=0.9))
        ids = turn_ids_reference(step_end, mask)
        for b in range(6):
            for k in set(ids[b][ids[b] >= 0]):
                assert np.ptp(got[b][ids[b] == k]) == 0.0

    def test_jit_and_vmap(self):
        _, rewards, step_end, mask = random_tokens(5)
        groups = np.array([0, 0, 1, 0, 1, 1], np.int32)
        fn = functools.partial(alg.process_advantages, num_groups=2, gamma=0.9)
        want = process_advantages_reference(rewards, step_end, mask, groups, 0.9)
        np.testing.assert_allclose(jax.jit(fn)(rewards, step_end, mask, groups), want,
                                   rtol=1e-5, atol=1e-5)
        stack = lambda a: np.stack([a, a[::-1]])
        got = jax.vmap(fn)(stack(rewards), stack(step_end), stack(mask), stack(groups))
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
        want_rev = process_advantages_reference(rewards[::-1], step_end[::-1], mask[::-1],
                                                groups[::-1], 0.9)
        np.testing.assert_allclose(got[1], want_rev, rtol=1e-5, atol=1e-5)

    def test_degenerate_inputs_are_finite_and_zero_off_the_mask(self):
        rewards = np.full((3, 5), np.nan, np.float32)  # garbage off the step ends
        mask = np.zeros((3, 5), bool)
        step_end = np.zeros((3, 5), bool)
        mask[1, 1:3] = True
        step_end[1, 2] = True
        rewards[1, 2] = 0.5
        groups = np.array([0, 0, 1], np.int32)
        got = np.asarray(alg.process_advantages(rewards, step_end, mask, groups,
                                                num_groups=2, gamma=0.9))
        assert np.all(np.isfinite(got))
        # Row 0 has no steps: it is no baseline for row 1, which keeps its reward.
        np.testing.assert_allclose(got[1], [0, 0.5, 0.5, 0, 0])
        assert np.all(got[[0, 2]] == 0)
        got = alg.process_advantages(np.zeros((2, 4), np.float32), np.zeros((2, 4), bool),
                                     np.zeros((2, 4), bool), np.array([0, 0], np.int32),
                                     num_groups=1)
        np.testing.assert_array_equal(got, 0.0)


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), gamma=st.sampled_from(GAMMAS),
                  end_fraction=st.sampled_from((0.0, 0.3, 1.0)))
def test_process_advantages_property(seed, gamma, end_fraction):
    rng, rewards, step_end, mask = random_tokens(seed, end_fraction=end_fraction)
    groups = rng.integers(0, 3, size=6).astype(np.int32)
    got = np.asarray(alg.process_advantages(rewards, step_end, mask, groups, num_groups=3,
                                            gamma=gamma, leave_one_out=True))
    want = process_advantages_reference(rewards, step_end, mask, groups, gamma)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.all(got[~mask] == 0)


# ---------------------------------------------------------------- VinePPO advantages

VINE_REWARDS = np.array([[0.0, 0.0, 1.0]], np.float32)
VINE_VALUES = np.array([[0.5, 0.25, 0.75]], np.float32)


class VineAdvantagesTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_computed_all_known(self):
        fn = self.variant(alg.vine_advantages)
        got = fn(VINE_REWARDS, VINE_VALUES, np.ones((1, 3), bool), np.array([3], np.int32))
        np.testing.assert_allclose(got, [[-0.25, 0.5, 0.25]], rtol=1e-6)
        chex.assert_type(got, jnp.float32)

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_computed_segments(self):
        num_turns = np.array([3], np.int32)
        fn = self.variant(alg.vine_advantages)
        # V(s_1) unknown: turns 0 and 1 share r_0 + r_1 + V(s_2) - V(s_0) = 0.25.
        got = fn(VINE_REWARDS, VINE_VALUES, np.array([[1, 0, 1]], bool), num_turns)
        np.testing.assert_allclose(got, [[0.25, 0.25, 0.25]], rtol=1e-6)
        fn = self.variant(functools.partial(alg.vine_advantages, gamma=0.5))
        got = fn(VINE_REWARDS, VINE_VALUES, np.array([[1, 0, 1]], bool), num_turns)
        np.testing.assert_allclose(got, [[0.25 * 0.75 - 0.5] * 2 + [0.25]], rtol=1e-6)
        # V(s_0) unknown: the first segment has baseline 0.
        fn = self.variant(alg.vine_advantages)
        got = fn(VINE_REWARDS, VINE_VALUES, np.array([[0, 1, 1]], bool), num_turns)
        np.testing.assert_allclose(got, [[0.25, 0.5, 0.25]], rtol=1e-6)
        # Nothing known: every played turn gets the return.
        got = fn(VINE_REWARDS, VINE_VALUES, np.zeros((1, 3), bool), num_turns)
        np.testing.assert_allclose(got, [[1.0, 1.0, 1.0]], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_zero_beyond_num_turns(self):
        rewards = np.array([[0.0, 1.0, np.nan]], np.float32)  # garbage after the end
        values = np.array([[0.5, 0.25, np.nan]], np.float32)
        got = self.variant(alg.vine_advantages)(rewards, values, np.ones((1, 3), bool),
                                                np.array([2], np.int32))
        np.testing.assert_allclose(got, [[-0.25, 0.75, 0.0]], rtol=1e-6)

    def test_matches_numpy_reference(self):
        for seed, gamma in enumerate(GAMMAS):
            rewards, values, known, num_turns = random_turns(seed)
            got = alg.vine_advantages(rewards, values, known, num_turns, gamma=gamma)
            want = vine_advantages_reference(rewards, values, known, num_turns, gamma)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_all_known_is_the_one_step_td_error(self):
        rewards, values, _, num_turns = random_turns(11)
        num_turns = np.full_like(num_turns, 5)
        got = alg.vine_advantages(rewards, values, np.ones_like(values, bool), num_turns,
                                  gamma=0.9)
        next_values = np.concatenate([values[:, 1:], np.zeros((6, 1), np.float32)], axis=1)
        np.testing.assert_allclose(got, rewards + 0.9 * next_values - values, rtol=1e-5,
                                   atol=1e-6)

    def test_jit_and_vmap(self):
        rewards, values, known, num_turns = random_turns(12)
        fn = functools.partial(alg.vine_advantages, gamma=0.9)
        want = vine_advantages_reference(rewards, values, known, num_turns, 0.9)
        np.testing.assert_allclose(jax.jit(fn)(rewards, values, known, num_turns), want,
                                   rtol=1e-5, atol=1e-5)
        stack = lambda a: a.reshape((2, 3) + a.shape[1:])
        got = jax.vmap(fn)(stack(rewards), stack(values), stack(known), stack(num_turns))
        np.testing.assert_allclose(got.reshape(6, 5), want, rtol=1e-5, atol=1e-5)

    def test_degenerate_rows_are_finite(self):
        rewards = np.full((2, 4), np.nan, np.float32)
        values = np.full((2, 4), np.inf, np.float32)
        got = alg.vine_advantages(rewards, values, np.ones((2, 4), bool),
                                  np.array([0, 0], np.int32))
        np.testing.assert_array_equal(got, 0.0)


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), gamma=st.sampled_from(GAMMAS))
def test_vine_advantages_property(seed, gamma):
    rewards, values, known, num_turns = random_turns(seed)
    got = np.asarray(alg.vine_advantages(rewards, values, known, num_turns, gamma=gamma))
    want = vine_advantages_reference(rewards, values, known, num_turns, gamma)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.all(got[np.arange(5)[None, :] >= num_turns[:, None]] == 0)


# ---------------------------------------------------------------- argument errors

Z2 = np.zeros((2, 3), np.float32)
B2 = np.ones((2, 3), bool)


@pytest.mark.parametrize("call, match", [
    (lambda: alg.turn_ids(np.ones(3, bool), B2), r"turn_ids: `step_end` must have rank 2"),
    (lambda: alg.turn_ids(B2, np.ones(3, bool)), r"turn_ids: `mask` must have rank 2"),
    (lambda: alg.turns_to_tokens(np.zeros(2, np.float32), B2, B2),
     r"turns_to_tokens: `per_turn` must have rank 2"),
    (lambda: alg.turns_to_tokens(np.zeros((3, 2), np.float32), B2, B2),
     r"`per_turn` has batch 3"),
    (lambda: alg.tokens_to_turns(Z2, B2, B2, num_turns=0), r"num_turns must be a positive"),
    (lambda: alg.tokens_to_turns(Z2[0], B2, B2, num_turns=2), r"`x` must have rank 2"),
    (lambda: alg.process_advantages(Z2[0], B2, B2, np.zeros(2, np.int32), num_groups=1),
     r"process_advantages: `process_rewards` must have rank 2"),
    (lambda: alg.process_advantages(Z2, B2, B2, np.zeros((2, 1), np.int32), num_groups=1),
     r"`group_ids` must have rank 1"),
    (lambda: alg.process_advantages(Z2, B2, B2[:, :2], np.zeros(2, np.int32), num_groups=1),
     r"`step_end`"),
    (lambda: alg.process_advantages(Z2, B2, B2, np.zeros(2, np.int32), num_groups=1,
                                    gamma=1.5), r"gamma must be in \[0, 1\]"),
    (lambda: alg.vine_advantages(Z2[0], Z2, B2, np.ones(2, np.int32)),
     r"vine_advantages: `turn_rewards` must have rank 2"),
    (lambda: alg.vine_advantages(Z2, Z2[:, :2], B2, np.ones(2, np.int32)), r"`turn_values`"),
    (lambda: alg.vine_advantages(Z2, Z2, B2[0], np.ones(2, np.int32)),
     r"`value_known` must have rank 2"),
    (lambda: alg.vine_advantages(Z2, Z2, B2, np.ones((2, 1), np.int32)),
     r"`num_turns` must have rank 1"),
    (lambda: alg.vine_advantages(Z2, Z2, B2, np.ones(3, np.int32)),
     r"`num_turns` must have shape \(2,\)"),
    (lambda: alg.vine_advantages(Z2, Z2, B2, np.ones(2, np.int32), gamma=-0.1),
     r"gamma must be in \[0, 1\]"),
])
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_monte_carlo_values_match_numpy_under_jit():
    """VinePPO's mean return and Math-Shepherd's soft / hard labels over the last axis,
    against NumPy, jitted; bfloat16 returns give float32 values."""
    rng = np.random.default_rng(0)
    returns = rng.normal(size=(3, 2, 5)).astype(np.float32)
    success = rng.random((3, 2, 5)) < 0.3
    success[0, 0] = False  # no continuation succeeded: hard 0, soft 0
    expected = {"mean_return": returns.mean(-1), "soft": success.mean(-1),
                "hard": success.max(-1).astype(np.float32)}
    for estimate, want in expected.items():
        got = jax.jit(alg.monte_carlo_values, static_argnames="estimate")(
            returns, success, estimate=estimate)
        assert got.dtype == jnp.float32 and got.shape == (3, 2)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(alg.monte_carlo_values(returns, success, "hard")[0, 0], 0.0)
    low = alg.monte_carlo_values(jnp.asarray(returns, jnp.bfloat16), success, "mean_return")
    assert low.dtype == jnp.float32
    np.testing.assert_allclose(low, returns.mean(-1), atol=2e-2)


@pytest.mark.parametrize("call, match", [
    (lambda: alg.monte_carlo_values(Z2, B2, "median"),
     r"monte_carlo_values: estimate='median'; allowed values are \('mean_return', 'soft', 'hard'\)"),
    (lambda: alg.monte_carlo_values(Z2, B2[:, :2], "soft"),
     r"`success` must have the shape of `returns`"),
    (lambda: alg.monte_carlo_values(np.zeros((2, 0), np.float32), np.zeros((2, 0)), "soft"),
     r"non-empty last axis"),
])
def test_monte_carlo_values_bad_arguments(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
