"""`arl.trainers.tracing.trace_once`: one trace, the same program, and the train step's
update traced once per lowering."""

import jax
import jax.numpy as jnp
import numpy as np

from arl.trainers import TokenTrainer
from arl.trainers.tracing import trace_once
from tests.test_train import tiny_config


def test_replay_equals_the_function_and_traces_it_once():
    calls = []

    def program(pred, x, scale):
        def update(operand):
            calls.append(1)
            a, b = operand
            return {"a": jnp.sin(a) * scale, "b": b @ b.T}, jnp.sum(a) * scale

        replay, shapes = trace_once(update, (x, x[:2]))

        def skip(operand):
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        return jax.lax.cond(pred, replay, skip, (x, x[:2])), update((x, x[:2]))

    x = jnp.arange(12.0).reshape(4, 3)
    (replayed, direct) = jax.jit(program)(True, x, 0.5)  # `scale` is an outer tracer
    assert len(calls) == 2  # trace_once's trace and the direct call; not the cond's
    jax.tree.map(np.testing.assert_array_equal, replayed, direct)
    np.testing.assert_allclose(replayed[0]["a"], np.sin(np.arange(12.0)).reshape(4, 3) * 0.5,
                               rtol=1e-6)
    skipped, _ = jax.jit(program)(False, x, 0.5)
    assert float(skipped[1]) == 0.0 and skipped[0]["b"].shape == (2, 2)


def test_the_train_step_traces_its_update_once():
    trainer = TokenTrainer(tiny_config())
    calls = []
    update = trainer.learner.update

    def counted(*args, **kwargs):
        calls.append(1)
        return update(*args, **kwargs)

    object.__setattr__(trainer.learner, "update", counted)
    trainer.train_step.lower(trainer.abstract_state())
    assert len(calls) == 1
