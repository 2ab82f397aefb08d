"""StarPO-S variance filter, DAPO zero-variance mask and the horizon schedule."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl import algorithms as alg


def starpo_reference(scores, group_ids, num_groups, keep_fraction, valid):
    stds = {}
    for g in range(num_groups):
        s = [float(x) for x, gi, ok in zip(scores, group_ids, valid) if ok and gi == g]
        if s:
            m = sum(s) / len(s)
            stds[g] = (sum((x - m) ** 2 for x in s) / (len(s) - 1)) ** 0.5 if len(s) > 1 else 0
    ranked = sorted(stds, key=lambda g: (-stds[g], g))
    k = max(1, int(keep_fraction * len(ranked) + 1e-6))
    kept = set(ranked[:k])
    return np.array([bool(ok) and int(g) in kept for g, ok in zip(group_ids, valid)])


def dapo_reference(scores, group_ids, num_groups, valid):
    keep = np.zeros(len(scores), bool)
    for g in range(num_groups):
        idx = [i for i in range(len(scores)) if valid[i] and group_ids[i] == g]
        if len(idx) >= 2 and len({float(scores[i]) for i in idx}) > 1:
            keep[idx] = True
    return keep


class FilterTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_starpo_matches_reference(self):
        rng = np.random.default_rng(0)
        for keep_fraction in (0.25, 0.5, 1.0):
            scores = rng.normal(size=48).astype(np.float32)
            group_ids = rng.integers(0, 10, size=48).astype(np.int32)
            valid = rng.random(48) < 0.9
            fn = self.variant(functools.partial(alg.starpo_keep_mask, num_groups=12,
                                                keep_fraction=keep_fraction))
            np.testing.assert_array_equal(
                fn(scores, group_ids, valid=valid),
                starpo_reference(scores, group_ids, 12, keep_fraction, valid))

    def test_starpo_hand_computed(self):
        # Four groups of two with stds 0, 0.71, 2.83, 1.41: p = 0.5 keeps groups 2 and 3.
        scores = np.array([1, 1, 0, 1, 0, 4, 0, 2], np.float32)
        group_ids = np.array([0, 0, 1, 1, 2, 2, 3, 3], np.int32)
        keep = alg.starpo_keep_mask(scores, group_ids, num_groups=4, keep_fraction=0.5)
        np.testing.assert_array_equal(keep, [0, 0, 0, 0, 1, 1, 1, 1])
        keep = alg.starpo_keep_mask(scores, group_ids, num_groups=4, keep_fraction=0.1)
        np.testing.assert_array_equal(keep, [0, 0, 0, 0, 1, 1, 0, 0])  # at least one group

    @chex.variants(with_jit=True, without_jit=True)
    def test_dapo_matches_reference(self):
        rng = np.random.default_rng(1)
        scores = (rng.random(40) < 0.3).astype(np.float32)
        group_ids = rng.integers(0, 9, size=40).astype(np.int32)
        valid = rng.random(40) < 0.9
        fn = self.variant(functools.partial(alg.dapo_zero_variance_mask, num_groups=9))
        np.testing.assert_array_equal(fn(scores, group_ids, valid=valid),
                                      dapo_reference(scores, group_ids, 9, valid))
        keep = alg.dapo_zero_variance_mask(np.array([1, 1, 0, 1, 1], np.float32),
                                           np.array([0, 0, 1, 1, 2], np.int32), num_groups=3)
        np.testing.assert_array_equal(keep, [0, 0, 1, 1, 0])

    def test_degenerate_inputs(self):
        none_valid = np.zeros(4, bool)
        args = (np.ones(4, np.float32), np.zeros(4, np.int32))
        np.testing.assert_array_equal(
            alg.starpo_keep_mask(*args, num_groups=2, valid=none_valid), False)
        np.testing.assert_array_equal(alg.dapo_zero_variance_mask(*args, num_groups=2), False)

    def test_horizon_schedule(self):
        rounds = (3, 6, 10)
        for step, want in ((0, 3), (99, 3), (100, 6), (250, 10), (10**6, 10), (-5, 3)):
            assert int(alg.horizon_schedule(step, rounds=rounds, every=100)) == want
        traced = jax.jit(lambda s: alg.horizon_schedule(s, rounds=rounds, every=100))
        np.testing.assert_array_equal(
            jax.vmap(traced)(jnp.array([0, 150, 900])), [3, 6, 10])

    def test_bad_input_raises(self):
        s, g = np.zeros(4, np.float32), np.zeros(4, np.int32)
        with pytest.raises(ValueError, match="`keep_fraction` must be a Python float in"):
            alg.starpo_keep_mask(s, g, num_groups=2, keep_fraction=0.0)
        with pytest.raises(ValueError, match="`rounds` must be a non-empty sequence"):
            alg.horizon_schedule(0, rounds=(), every=10)
        with pytest.raises(ValueError, match="`every` must be a positive Python int"):
            alg.horizon_schedule(0, rounds=(1, 2), every=0)
        with pytest.raises(TypeError, match="`step` must have an integer dtype"):
            alg.horizon_schedule(0.5, rounds=(1, 2), every=3)
