"""One optimizer builder for every trainer: `arl.optim.make_optimizer` against a plain
NumPy AdamW, and every trainer honours every `optim.*` field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arl import config as config_lib
from arl.optim import make_optimizer, rl_updates
from arl.trainers import VectorPPO


def _numpy_adamw(params, grads_seq, *, lr_at, b1, b2, eps, weight_decay, max_grad_norm):
    """AdamW (Loshchilov & Hutter 2019) with global-norm clipping, written out plainly."""
    p = np.array(params, np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads_seq, start=1):
        g = np.array(g, np.float64)
        norm = np.sqrt(np.sum(g * g))
        if max_grad_norm > 0 and norm > max_grad_norm:
            g = g * (max_grad_norm / norm)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1 ** t)
        v_hat = v / (1 - b2 ** t)
        p = p - lr_at(t - 1) * (m_hat / (np.sqrt(v_hat) + eps) + weight_decay * p)
    return p


@pytest.mark.parametrize("schedule, warmup, max_grad_norm, weight_decay, eps", [
    ("constant", 0, 0.0, 0.0, 1e-8),       # no clipping at all
    ("linear", 2, 0.5, 0.01, 1e-5),
    ("cosine", 1, 1.0, 0.1, 1e-3),
])
def test_make_optimizer_matches_numpy_adamw(schedule, warmup, max_grad_norm, weight_decay, eps):
    o = config_lib.default_config().optim
    o.learning_rate, o.schedule, o.warmup_steps = 0.1, schedule, warmup
    o.max_grad_norm, o.weight_decay, o.eps, o.b1, o.b2 = max_grad_norm, weight_decay, eps, 0.8, 0.95
    total = 6
    optimizer = make_optimizer(o, total_updates=total)
    schedule_fn = optax.join_schedules(
        [optax.linear_schedule(0.0, 0.1, warmup),
         {"constant": optax.constant_schedule(0.1),
          "linear": optax.linear_schedule(0.1, 0.0, total - warmup),
          "cosine": optax.cosine_decay_schedule(0.1, total - warmup)}[schedule]],
        [warmup]) if warmup else {"constant": optax.constant_schedule(0.1),
                                  "linear": optax.linear_schedule(0.1, 0.0, total),
                                  "cosine": optax.cosine_decay_schedule(0.1, total)}[schedule]
    rng = np.random.default_rng(0)
    params = rng.normal(size=5).astype(np.float32)
    grads_seq = [3.0 * rng.normal(size=5).astype(np.float32) for _ in range(total)]
    p, state = jnp.asarray(params), optimizer.init(jnp.asarray(params))
    for g in grads_seq:
        updates, state = optimizer.update(jnp.asarray(g), state, p)
        p = optax.apply_updates(p, updates)
    want = _numpy_adamw(params, grads_seq, lr_at=lambda t: float(schedule_fn(t)), b1=0.8,
                        b2=0.95, eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm)
    np.testing.assert_allclose(np.asarray(p), want, rtol=2e-5, atol=1e-6)


def _vector_config(**optim):
    c = config_lib.default_config()
    c.algorithm, c.env.name = "ppo_vector", "gymnax:CartPole-v1"
    c.train_steps = 3
    c.vector.num_envs, c.vector.num_steps, c.vector.hidden_sizes = 2, 8, (8,)
    c.updates.epochs, c.updates.minibatches = 1, 2
    for key, value in optim.items():
        c.optim[key] = value
    return c


def test_vector_ppo_trains_without_gradient_clipping():
    """optim.max_grad_norm = 0 means "no clipping" in VectorPPO too (it used to build
    clip_by_global_norm(0.0), which zeroes every update)."""
    trainer = VectorPPO(_vector_config(max_grad_norm=0.0))
    state = trainer.init_state()
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = trainer.train_step(state)
    after = jax.tree.map(np.asarray, state.params)
    moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))]
    assert max(moved) > 1e-4 and all(np.isfinite(m) for m in moved)
    assert np.isfinite(float(metrics["loss/total"]))


@pytest.mark.parametrize("field, value", [
    ("schedule", "cosine"), ("warmup_steps", 2), ("b1", 0.5), ("b2", 0.9),
    ("weight_decay", 0.3), ("eps", 1e-2), ("max_grad_norm", 0.01)])
def test_vector_ppo_honours_every_optim_field(field, value):
    """VectorPPO's optimizer is the shared builder's for its config: the same updates on
    the same gradients, and a different one from the default when the field changes."""
    config = _vector_config(**{field: value})
    trainer = VectorPPO(config)
    want = make_optimizer(config.optim, total_updates=rl_updates(config))
    default = make_optimizer(_vector_config().optim, total_updates=rl_updates(config))
    params = jnp.linspace(-1.0, 1.0, 7)
    # Norms 0.2-0.6: below the default clip (1.0), above 0.01, different at every step.
    grads = [jnp.sin(params * (i + 1)) * 0.1 * (i + 1) for i in range(3)]

    def run(optimizer):
        p, state = params, optimizer.init(params)
        for g in grads:
            updates, state = optimizer.update(g, state, p)
            p = optax.apply_updates(p, updates)
        return np.asarray(p)

    np.testing.assert_array_equal(run(trainer.optimizer), run(want))
    assert not np.allclose(run(want), run(default))


def test_optim_eps_is_validated():
    c = config_lib.default_config()
    c.optim.eps = 0.0
    with pytest.raises(config_lib.ConfigError, match=r"config\.optim\.eps=0\.0"):
        config_lib.validate(c)
