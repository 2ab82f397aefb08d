"""Group statistics and group-relative advantages against per-group Python loops."""

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from arl import algorithms as alg

# ---------------------------------------------------------------- NumPy references


def members(group_ids, valid, num_groups):
    out = {g: [] for g in range(num_groups)}
    for i, (g, ok) in enumerate(zip(group_ids, valid)):
        if ok and 0 <= g < num_groups:
            out[int(g)].append(i)
    return out


def stats_reference(scores, group_ids, num_groups, valid):
    mean, std, count, degenerate = [], [], [], []
    for g, idx in members(group_ids, valid, num_groups).items():
        s = [float(scores[i]) for i in idx]
        n = len(s)
        m = sum(s) / n if n else 0.0
        var = sum((x - m) ** 2 for x in s) / (n - 1) if n >= 2 else 0.0
        mean.append(m)
        std.append(var ** 0.5)
        count.append(n)
        degenerate.append(n < 2 or max(s) == min(s))
    return np.array(mean), np.array(std), np.array(count), np.array(degenerate)


def group_advantages_reference(scores, group_ids, num_groups, valid, scale_by_std, eps):
    out = np.zeros(len(scores))
    for idx in members(group_ids, valid, num_groups).values():
        s = [float(scores[i]) for i in idx]
        if len(s) < 2 or max(s) == min(s):
            continue
        m = sum(s) / len(s)
        sd = (sum((x - m) ** 2 for x in s) / (len(s) - 1)) ** 0.5
        for i in idx:
            out[i] = (scores[i] - m) / (sd + eps) if scale_by_std else scores[i] - m
    return out


def rloo_reference(scores, group_ids, num_groups, valid):
    out = np.zeros(len(scores))
    for idx in members(group_ids, valid, num_groups).values():
        if len(idx) < 2:
            continue
        for i in idx:
            others = [float(scores[j]) for j in idx if j != i]
            out[i] = scores[i] - sum(others) / len(others)
    return out


def whiten_1d_reference(x, valid):
    sel = [float(v) for v, ok in zip(x, valid) if ok]
    if not sel:
        return np.zeros(len(x))
    m = sum(sel) / len(sel)
    var = sum((v - m) ** 2 for v in sel) / max(len(sel) - 1, 1)
    return np.array([(v - m) / np.sqrt(var + 1e-8) if ok else 0.0 for v, ok in zip(x, valid)])


def reinforce_pp_reference(scores, group_ids, num_groups, valid):
    if group_ids is None:
        return whiten_1d_reference(scores, valid)
    centred = np.array(scores, np.float64)
    for idx in members(group_ids, valid, num_groups).values():
        if idx:
            m = sum(float(scores[i]) for i in idx) / len(idx)
            for i in idx:
                centred[i] = scores[i] - m
    return whiten_1d_reference(centred, valid)


def env_advantages_reference(scores, group_ids, env_ids, num_groups, num_envs, valid, eps,
                             centre_on_env_mean):
    out = np.zeros(len(scores))
    env_members = members(env_ids, valid, num_envs)
    group_members = members(group_ids, valid, num_groups)
    for e, idx in env_members.items():
        s = [float(scores[i]) for i in idx]
        if len(s) < 2 or max(s) == min(s):
            continue
        m = sum(s) / len(s)
        sd = (sum((x - m) ** 2 for x in s) / (len(s) - 1)) ** 0.5
        for i in idx:
            if centre_on_env_mean:
                out[i] = (scores[i] - m) / (sd + eps)
            else:
                g = [float(scores[j]) for j in group_members[int(group_ids[i])]]
                if len(g) < 2 or max(g) == min(g):
                    continue
                out[i] = (scores[i] - sum(g) / len(g)) / (sd + eps)
    return out


def random_groups(seed, n=40, num_groups=7, binary=False):
    rng = np.random.default_rng(seed)
    if binary:
        scores = (rng.random(n) < 0.5).astype(np.float32)
    else:
        scores = rng.normal(size=n).astype(np.float32)
    group_ids = rng.integers(0, num_groups, size=n).astype(np.int32)
    valid = rng.random(n) < 0.8
    return rng, scores, group_ids, valid


# ---------------------------------------------------------------- tests


class GroupTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_statistics_match_reference(self):
        _, scores, group_ids, valid = random_groups(0)
        scores[group_ids == 3] = 0.5  # one constant group
        fn = self.variant(functools.partial(alg.group_statistics, num_groups=9))
        stats = fn(scores, group_ids, valid=valid)
        mean, std, count, degenerate = stats_reference(scores, group_ids, 9, valid)
        np.testing.assert_allclose(stats.mean, mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats.std, std, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(stats.count, count)
        np.testing.assert_array_equal(stats.degenerate, degenerate)
        present = count > 0
        np.testing.assert_allclose(stats.degenerate_fraction(),
                                   np.sum(degenerate & present) / np.sum(present))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(True, False)
    def test_group_advantages_match_reference(self, scale_by_std):
        _, scores, group_ids, valid = random_groups(1, binary=True)
        fn = self.variant(functools.partial(alg.group_advantages, num_groups=7,
                                            scale_by_std=scale_by_std))
        got = fn(scores, group_ids, valid=valid)
        chex.assert_type(got, jnp.float32)
        np.testing.assert_allclose(
            got, group_advantages_reference(scores, group_ids, 7, valid, scale_by_std, 1e-6),
            rtol=1e-5, atol=1e-5)

    def test_group_advantages_hand_computed(self):
        scores = np.array([1.0, 2.0, 3.0, 5.0, 5.0, 7.0, 0.0, 1.0], np.float32)
        group_ids = np.array([0, 0, 0, 1, 1, 2, 3, 3], np.int32)
        valid = np.array([1, 1, 1, 1, 1, 1, 1, 0], bool)
        got = alg.group_advantages(scores, group_ids, num_groups=4, valid=valid)
        # Group 0: mean 2, Bessel std 1. Group 1 constant, group 2 singleton, group 3 has
        # one valid member: all zero.
        np.testing.assert_allclose(got, [-1.0, 0.0, 1.0, 0, 0, 0, 0, 0], atol=1e-5)
        drgrpo = alg.group_advantages(scores, group_ids, num_groups=4, scale_by_std=False)
        np.testing.assert_allclose(drgrpo, [-1.0, 0.0, 1.0, 0, 0, 0, -0.5, 0.5])

    @chex.variants(with_jit=True, without_jit=True)
    def test_rloo_matches_reference(self):
        _, scores, group_ids, valid = random_groups(2)
        fn = self.variant(functools.partial(alg.rloo_advantages, num_groups=7))
        np.testing.assert_allclose(fn(scores, group_ids, valid=valid),
                                   rloo_reference(scores, group_ids, 7, valid), rtol=1e-5,
                                   atol=1e-5)
        got = alg.rloo_advantages(np.array([1.0, 2.0, 6.0, 4.0], np.float32),
                                  np.array([0, 0, 0, 1]), num_groups=2)
        np.testing.assert_allclose(got, [1.0 - 4.0, 2.0 - 3.5, 6.0 - 1.5, 0.0])

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(True, False)
    def test_reinforce_pp_matches_reference(self, with_groups):
        _, scores, group_ids, valid = random_groups(3)
        if with_groups:
            fn = self.variant(functools.partial(alg.reinforce_pp_advantages, num_groups=7))
            got = fn(scores, group_ids, valid=valid)
            want = reinforce_pp_reference(scores, group_ids, 7, valid)
        else:
            fn = self.variant(alg.reinforce_pp_advantages)
            got = fn(scores, valid=valid)
            want = reinforce_pp_reference(scores, None, None, valid)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(True, False)
    def test_env_advantages_match_reference(self, centre_on_env_mean):
        rng, scores, group_ids, valid = random_groups(4, n=60, num_groups=10, binary=True)
        env_of_group = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
        env_ids = env_of_group[group_ids].astype(np.int32)
        fn = self.variant(functools.partial(alg.env_advantages, num_groups=10, num_envs=3,
                                            centre_on_env_mean=centre_on_env_mean))
        got = fn(scores, group_ids, env_ids, valid=valid)
        want = env_advantages_reference(scores, group_ids, env_ids, 10, 3, valid, 1e-6,
                                        centre_on_env_mean)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_env_std_is_pooled_over_the_environment(self):
        # Env 0 (easy, scores 0.9/1.0) and env 1 (hard, 0/1): the group mean is local, the
        # scale is the environment's std, so env 0's small differences are not drowned.
        scores = np.array([0.9, 1.0, 1.0, 0.9, 0.0, 1.0, 1.0, 0.0], np.float32)
        group_ids = np.array([0, 0, 1, 1, 2, 2, 3, 3], np.int32)
        env_ids = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)
        got = alg.env_advantages(scores, group_ids, env_ids, num_groups=4, num_envs=2)
        std0 = np.std([0.9, 1.0, 1.0, 0.9], ddof=1)
        std1 = np.std([0.0, 1.0, 1.0, 0.0], ddof=1)
        want = np.array([-0.05 / std0, 0.05 / std0, 0.05 / std0, -0.05 / std0,
                         -0.5 / std1, 0.5 / std1, 0.5 / std1, -0.5 / std1])
        np.testing.assert_allclose(got, want, rtol=1e-4)

    def test_vmap_over_batches(self):
        _, scores, group_ids, valid = random_groups(5, n=30)
        stacked = [x.reshape(3, 10) for x in (scores, group_ids, valid)]
        fn = lambda s, g, v: alg.group_advantages(s, g, num_groups=7, valid=v)
        got = jax.vmap(fn)(*stacked)
        for i in range(3):
            np.testing.assert_allclose(got[i], fn(*(x[i] for x in stacked)), rtol=1e-6)

    def test_degenerate_inputs(self):
        for fn in (functools.partial(alg.group_advantages, num_groups=3),
                   functools.partial(alg.rloo_advantages, num_groups=3),
                   functools.partial(alg.reinforce_pp_advantages, num_groups=3),
                   lambda s, g, valid: alg.env_advantages(
                       s, g, np.zeros(4, np.int32), num_groups=3, num_envs=1,
                       valid=valid)):
            for valid in (np.zeros(4, bool), np.array([1, 0, 0, 0], bool)):
                out = fn(np.array([1.0, 1.0, 1.0, 1.0], np.float32),
                         np.array([0, 0, 1, 2], np.int32), valid=valid)
                np.testing.assert_array_equal(out, 0.0)
        # Out-of-range ids are ignored, not wrapped or clamped into a real group.
        out = alg.group_advantages(np.array([0.0, 1.0, 100.0], np.float32),
                                   np.array([0, 0, 5], np.int32), num_groups=2)
        np.testing.assert_allclose(out, [-0.7071058, 0.7071058, 0.0], rtol=1e-5)

    def test_bad_input_raises(self):
        s, g = np.zeros(4, np.float32), np.zeros(4, np.int32)
        with pytest.raises(TypeError, match="`group_ids` must have an integer dtype"):
            alg.group_advantages(s, g.astype(np.float32), num_groups=2)
        with pytest.raises(ValueError, match="`group_ids` must have the shape of `scores`"):
            alg.group_advantages(s, g[:3], num_groups=2)
        with pytest.raises(ValueError, match="`num_groups` must be a positive Python int"):
            alg.group_advantages(s, g, num_groups=0)
        with pytest.raises(ValueError, match="`scores` must have rank 1"):
            alg.rloo_advantages(s[None], g[None], num_groups=2)
        with pytest.raises(ValueError, match="needs the static `num_groups`"):
            alg.reinforce_pp_advantages(s, g)
        with pytest.raises(ValueError, match="`valid` must have the shape"):
            alg.group_statistics(s, g, num_groups=2, valid=np.ones(3, bool))


@jax.jit
def _grpo(scores, group_ids, valid):
    return alg.group_advantages(scores, group_ids, num_groups=6, valid=valid)


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1),
                  shifts=st.lists(st.floats(-50, 50), min_size=6, max_size=6))
def test_group_advantages_invariant_to_per_group_constant(seed, shifts):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=24).astype(np.float32)
    group_ids = rng.integers(0, 6, size=24).astype(np.int32)
    valid = rng.random(24) < 0.85
    shifted = scores + np.asarray(shifts, np.float32)[group_ids]
    np.testing.assert_allclose(_grpo(shifted, group_ids, valid),
                               _grpo(scores, group_ids, valid), rtol=1e-3, atol=1e-3)


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.0, 1e-30, 1e30]))
def test_group_kernels_finite_on_degenerate_scores(seed, scale):
    rng = np.random.default_rng(seed)
    scores = (scale * rng.integers(0, 2, size=16)).astype(np.float32)
    group_ids = rng.integers(0, 5, size=16).astype(np.int32)
    valid = rng.random(16) < 0.5
    for out in (_grpo(scores, group_ids, valid),
                alg.rloo_advantages(scores, group_ids, num_groups=6, valid=valid),
                alg.reinforce_pp_advantages(scores, group_ids, num_groups=6, valid=valid)):
        assert np.all(np.isfinite(out))
        np.testing.assert_array_equal(np.asarray(out)[~valid], 0.0)


# ---------------------------------------------------------------- gradients


def _degenerate_batch():
    """Group 0 a singleton, group 1 constant, group 2 ordinary, group 3 with an invalid
    member; environment 0 (groups 0, 1) has constant scores, environment 1 (2, 3) not."""
    scores = jnp.array([2.0, 2.0, 2.0, 0.1, 0.9, 0.4, 1.5, -0.3, 5.0], jnp.float32)
    group_ids = jnp.array([0, 1, 1, 2, 2, 2, 3, 3, 3])
    env_ids = jnp.array([0, 0, 0, 1, 1, 1, 1, 1, 1])
    valid = jnp.array([True] * 8 + [False])
    return scores, group_ids, env_ids, valid


@pytest.mark.parametrize("eps", [1e-6, 0.0], ids=["eps-default", "eps-0"])
@pytest.mark.parametrize("kernel", ["grpo", "drgrpo", "rloo", "reinforce_pp", "erpo",
                                    "erpo_centred", "statistics"])
def test_gradients_finite_on_degenerate_groups(kernel, eps):
    """Singleton and constant groups must not send NaN into the gradient with respect to
    the scores (users differentiate through these kernels), even at eps = 0 where a
    constant group's std + eps is 0, and the gradient of the ordinary groups is the
    analytic one."""
    scores, group_ids, env_ids, valid = _degenerate_batch()
    fns = {
        "grpo": lambda s: alg.group_advantages(s, group_ids, num_groups=4, valid=valid,
                                               eps=eps),
        "drgrpo": lambda s: alg.group_advantages(s, group_ids, num_groups=4,
                                                 scale_by_std=False, valid=valid),
        "rloo": lambda s: alg.rloo_advantages(s, group_ids, num_groups=4, valid=valid),
        "reinforce_pp": lambda s: alg.reinforce_pp_advantages(s, group_ids, num_groups=4,
                                                              valid=valid),
        "erpo": lambda s: alg.env_advantages(s, group_ids, env_ids, num_groups=4,
                                             num_envs=2, valid=valid, eps=eps),
        "erpo_centred": lambda s: alg.env_advantages(s, group_ids, env_ids, num_groups=4,
                                                     num_envs=2, valid=valid, eps=eps,
                                                     centre_on_env_mean=True),
        "statistics": lambda s: alg.group_statistics(s, group_ids, num_groups=4,
                                                     valid=valid).std,
    }
    weights = jnp.linspace(0.5, 1.5, 9 if kernel != "statistics" else 4)
    loss = lambda s: jnp.sum(fns[kernel](s) * weights)  # noqa: E731
    grads = np.asarray(jax.jit(jax.grad(loss))(scores))
    assert np.all(np.isfinite(grads)), grads
    if kernel in ("grpo", "drgrpo", "erpo", "erpo_centred"):
        # Degenerate groups (rows 0-2; for ERPO environment 0) give advantage 0 whatever
        # their scores: a flat, zero gradient.
        np.testing.assert_array_equal(grads[:3], 0.0)
    # Against central differences on the rows of ordinary groups (2 and 3's valid
    # members); the degenerate groups are flat there (or undefined at their kink).
    loss_at = jax.jit(loss)
    for i in (3, 4, 5, 6, 7):
        step = jnp.zeros(9).at[i].set(1e-2)
        numeric = (float(loss_at(scores + step)) - float(loss_at(scores - step))) / 2e-2
        np.testing.assert_allclose(grads[i], numeric, rtol=1e-2, atol=1e-3)


def test_grpo_gradient_hand_computed():
    """d/ds of A = (s - mean) / (std + eps) for one pair (s1, s2): with d = s1 - s2,
    A_1 = (d/2) / (|d|/sqrt(2) + eps), so dA_1/ds1 = -dA_1/ds2 = eps*sqrt(2)^2/2 / (...)^2
    -> 0 as eps -> 0: the advantage of a pair does not depend on the scale of d."""
    grads = jax.grad(lambda s: alg.group_advantages(
        s, jnp.array([0, 0]), num_groups=1, eps=1e-6)[0])(jnp.array([1.0, 0.0]))
    d, eps = 1.0, 1e-6
    want = (0.5 * (d / np.sqrt(2) + eps) - 0.5 * d / np.sqrt(2)) / (d / np.sqrt(2) + eps) ** 2
    np.testing.assert_allclose(np.asarray(grads), [want, -want], rtol=1e-3, atol=1e-7)
