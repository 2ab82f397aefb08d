"""Real model sizes: the published shapes, bfloat16 parameters with float32 master
weights, the activation sharding rules, and a smoke test of benchmarks/real_sizes.py."""

from __future__ import annotations

import contextlib
import math
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arl import config as config_lib
from arl import sharding as sharding_lib
from arl.errors import ConfigError
from arl.models import transformer as transformer_lib
from arl.optim import MasterWeightsState, make_optimizer
from arl.trainers.policy import Policy
from configs import real_sizes

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.parametrize("shape", sorted(real_sizes.SHAPES))
def test_shapes_have_the_published_parameter_counts(shape):
    """The config's Qwen2.5 / Llama 3 shapes, built by the trainer's own model builder,
    have exactly the published parameter counts (abstract: nothing is allocated)."""
    config = real_sizes.get_config(shape)
    config_lib.validate(config, num_devices=8)
    policy = Policy.from_config(config, vocab_size=90, context_length=16, value_head=False)
    cfg = policy.model.config
    assert cfg.vocab_size == real_sizes.SHAPES[shape]["vocab_size"]  # not the codec's 90
    assert cfg.param_dtype == jnp.bfloat16 and cfg.dtype == jnp.bfloat16 and cfg.remat
    assert cfg.norm_eps == real_sizes.SHAPES[shape]["norm_eps"]
    params = nn.unbox(transformer_lib.abstract_params(policy.model))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    assert count == real_sizes.PUBLISHED_PARAMETERS[shape]
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert ("lm_head" in params) == (not real_sizes.SHAPES[shape]["tie_embeddings"])


def test_model_vocab_smaller_than_the_codec_is_a_config_error():
    config = real_sizes.get_config("qwen2.5-0.5b")
    config.model.vocab_size = 50
    with pytest.raises(ConfigError, match=r"^config\.model\.vocab_size=50 is invalid"):
        Policy.from_config(config, vocab_size=90, context_length=16, value_head=False)


# ---------------------------------------------------------------- master weights
def test_float32_parameters_get_the_plain_optimizer():
    optim = config_lib.default_config().optim
    state = make_optimizer(optim).init({"w": jnp.zeros(3)})
    assert not isinstance(state, MasterWeightsState)
    assert isinstance(make_optimizer(optim, param_dtype="bfloat16").init({"w": jnp.zeros(3)}),
                      MasterWeightsState)


def test_master_weights_follow_float32_adamw_exactly_and_round_into_the_parameters():
    """The master copy takes exactly the steps AdamW takes on a float32 copy of the
    parameters with the gradients cast to float32; every optimizer state leaf is float32
    and the bfloat16 parameters are the master copy rounded, after every step."""
    optim = config_lib.default_config().optim
    optim.learning_rate, optim.weight_decay = 3e-3, 0.01
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.bfloat16),
              "b": jnp.asarray(rng.normal(size=3), jnp.bfloat16)}
    optimizer = make_optimizer(optim, param_dtype="bfloat16")
    reference = make_optimizer(optim)  # float32 AdamW on the float32 copy
    state = optimizer.init(params)
    ref_params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    ref_state = reference.init(ref_params)

    @jax.jit
    def step(params, state, ref_params, ref_state, grads):
        updates, state = optimizer.update(grads, state, params)
        ref_updates, ref_state = reference.update(
            jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_state, ref_params)
        return (optax.apply_updates(params, updates), state,
                optax.apply_updates(ref_params, ref_updates), ref_state)

    for _ in range(5):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.bfloat16),
                             params)
        params, state, ref_params, ref_state = step(params, state, ref_params, ref_state,
                                                    grads)
        for name in params:
            np.testing.assert_array_equal(state.master[name], ref_params[name])
            assert params[name].dtype == jnp.bfloat16
            np.testing.assert_array_equal(params[name], ref_params[name].astype(jnp.bfloat16))
    assert {x.dtype for x in jax.tree.leaves(state)} <= {jnp.dtype(jnp.float32),
                                                          jnp.dtype(jnp.int32)}
    mu = state.inner[1][0].mu
    assert {x.dtype for x in jax.tree.leaves(mu)} == {jnp.dtype(jnp.float32)}


def test_small_updates_round_away_without_master_weights():
    """Why the master copy: 200 AdamW steps of 1e-5 down from a weight of 0.5 never move
    bfloat16 weights (each step is far below half the bfloat16 spacing there, 2^-10, and
    rounds away), but do move the master copy, by 2e-3 in all, and with it the
    parameters (the next bfloat16 number below 0.5 is 0.5 - 2^-9)."""
    optim = config_lib.default_config().optim
    optim.learning_rate, optim.max_grad_norm = 1e-5, 0.0
    start = jnp.full((8,), 0.5, jnp.bfloat16)
    plain, master = make_optimizer(optim), make_optimizer(optim, param_dtype="bfloat16")
    p_plain, s_plain = start, plain.init(start)
    p_master, s_master = start, master.init(start)
    grads = jnp.ones((8,), jnp.bfloat16)

    @jax.jit
    def steps(p_plain, s_plain, p_master, s_master):
        def body(_, carry):
            p_plain, s_plain, p_master, s_master = carry
            u, s_plain = plain.update(grads, s_plain, p_plain)
            v, s_master = master.update(grads, s_master, p_master)
            return (optax.apply_updates(p_plain, u), s_plain,
                    optax.apply_updates(p_master, v), s_master)
        return jax.lax.fori_loop(0, 200, body, (p_plain, s_plain, p_master, s_master))

    p_plain, s_plain, p_master, s_master = steps(p_plain, s_plain, p_master, s_master)
    np.testing.assert_array_equal(p_plain, start)  # stuck
    np.testing.assert_allclose(s_master.master, 0.5 - 200 * 1e-5, rtol=1e-5)
    assert float(p_master[0]) < 0.5  # moved, rounded from the master copy
    np.testing.assert_array_equal(p_master, s_master.master.astype(jnp.bfloat16))


# ---------------------------------------------------------------- activation sharding
def _small_model():
    config = transformer_lib.TransformerConfig(
        vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64)
    model = transformer_lib.Transformer(config)
    tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, 64)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    return model, params, tokens


def test_constraints_are_no_ops_without_a_mesh_or_on_one_device():
    model, params, tokens = _small_model()

    def logits(mesh):
        def fn(p, t):
            with (sharding_lib.activation_mesh(mesh) if mesh else contextlib.nullcontext()):
                return model.apply({"params": p}, t).logits
        return fn

    plain = jax.jit(logits(None)).lower(params, tokens).as_text()
    one = jax.jit(logits(sharding_lib.make_mesh((1, 1, 1)))).lower(params, tokens).as_text()
    assert "sharding_constraint" not in plain
    assert one == plain  # the same program, operation for operation
    eight = jax.jit(logits(sharding_lib.make_mesh((2, 2, 2)))).lower(params, tokens).as_text()
    # Per layer: residual x3, q, k, v, attention output, MLP hidden (the layer scan's
    # body is traced once); the embedding table, its rows, the final norm and the logits.
    assert eight.count("sharding_constraint") >= 12


def test_activation_specs_follow_the_rules_and_drop_axes_that_do_not_divide():
    mesh = sharding_lib.make_mesh((1, 2, 4))

    def fn(x, y, z):
        with sharding_lib.activation_mesh(mesh):
            return (transformer_lib.constrain_activation(x, transformer_lib.RESIDUAL),
                    transformer_lib.constrain_activation(y, heads("kv_heads")),
                    transformer_lib.constrain_activation(z, heads("heads")))

    def heads(kind):
        return ("activation_batch", "activation_length", f"activation_{kind}",
                "activation_head_dim")

    text = jax.jit(fn).lower(jnp.zeros((4, 3, 16)), jnp.zeros((4, 3, 2, 2)),
                             jnp.zeros((4, 3, 8, 2))).as_text()
    batch = '{"data", "fsdp"}'
    assert f'[{batch}, {{}}, {{}}]> : tensor<4x3x16xf32>' in text  # the residual stream
    # 2 KV heads on the 4-way tensor axis stay whole; 8 query heads are split.
    assert f'[{batch}, {{}}, {{}}, {{}}]> : tensor<4x3x2x2xf32>' in text
    assert f'[{batch}, {{}}, {{"tensor"}}, {{}}]> : tensor<4x3x8x2xf32>' in text


def test_sharded_forward_equals_the_unsharded_one():
    model, params, tokens = _small_model()
    mesh = sharding_lib.make_mesh((2, 2, 2))
    shardings = transformer_lib.param_shardings(
        transformer_lib.abstract_params(model, *tokens.shape), mesh)

    def fn(p, t):
        with sharding_lib.activation_mesh(mesh):
            return model.apply({"params": p}, t).logits

    want = jax.jit(lambda p, t: model.apply({"params": p}, t).logits)(params, tokens)
    got = jax.jit(fn)(jax.device_put(params, shardings),
                      jax.device_put(tokens, sharding_lib.batch_sharding(mesh)))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- the benchmark, tiny
@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, BENCH)
    try:
        import real_sizes as bench_module  # pylint: disable=g-import-not-at-top
        yield bench_module
    finally:
        sys.path.remove(BENCH)


def test_benchmark_tiny_step_compiles_without_remat_warnings_and_trains(bench, capfd):
    """The benchmark's tiny point on an FSDP x tensor mesh (1, 4, 2): XLA's arguments are
    exactly the estimate's state term (bfloat16 parameters + float32 master, mu, nu, plus
    the step counters and key), the partitioner logs no involuntary rematerialization,
    and one real step keeps bfloat16 parameters equal to their float32 master copy."""
    config = bench.make_config("tiny", (1, 4, 2), num_tasks=2, group_size=4)
    trainer = bench.make_trainer(config)
    state = trainer.init_state()
    compiled = trainer.train_step.lower(state).compile()
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    stats = compiled.memory_analysis()
    terms = bench.estimate(trainer)
    small = 64  # the step, the key and the optimizer's two step counters
    assert terms["state"] <= stats.argument_size_in_bytes <= terms["state"] + small
    assert stats.alias_size_in_bytes == stats.argument_size_in_bytes  # state donated
    new_state, metrics = compiled(state)
    assert int(new_state.step) == 1 and np.isfinite(float(metrics["loss/total"]))
    master = new_state.opt_state.master
    for p, m in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(master)):
        assert p.dtype == jnp.bfloat16 and m.dtype == jnp.float32
        np.testing.assert_array_equal(p, m.astype(jnp.bfloat16))
    result = {"shape": "tiny", "mesh": [1, 4, 2], "batch": 8, "context": 36,
              "compiler": {"arguments": 1, "outputs": 1, "aliased": 1, "temps": 1,
                           "total": 2 ** 30}, "estimate": dict(terms, total=2 ** 30),
              "lower_s": 1.0, "compile_s": 2.0}
    assert "| tiny | (1, 4, 2) | 36 | 2 |" in bench.table([result])
    assert bench.relative_error(result) == 0 and bench.fits(result, 16)


def test_estimate_counts_the_blocked_attention_working_set(bench):
    """Beyond one block the layer term holds one block pair's three float32 [b, H, c, c]
    arrays and the float32 dq [b, H, S, Dh], not the dense [b, H, S, S] scores."""
    config = bench.make_config("tiny", (1, 1, 1), num_tasks=2, group_size=4)
    dense = bench.estimate(bench.make_trainer(config))
    config.model.attention_block = 16
    trainer = bench.make_trainer(config)
    blocked = bench.estimate(trainer)
    cfg, rows, seq = trainer.model.config, 8, trainer.context_length
    assert seq == 36  # block_layout(36, 16): 3 blocks of 16
    weights = dense["layer"] - 3 * rows * cfg.num_heads * seq * seq * 4
    assert blocked["layer"] - weights == (3 * rows * cfg.num_heads * 16 * 16 * 4
                                         + rows * cfg.num_heads * seq * cfg.resolved_head_dim * 4)


def test_context_slopes_from_the_shortest_context_of_at_least_1k(bench):
    def point(context, total_gib, temps_gib):
        return {"shape": "s", "mesh": [1, 8, 1], "context": context,
                "compiler": {"total": total_gib * 2 ** 30, "temps": temps_gib * 2 ** 30}}

    results = [point(4000, 5, 4), point(500, 1.5, 0.5), point(1000, 2, 1)]
    # log(4) / log(4) = 1.00 for the temporaries; log(5 / 2) / log(4) = 0.66 for the total
    assert bench.context_slopes(results) == (
        "- s (1, 8, 1), context 1000 -> 4000: slope of the total 0.66, of the temporaries 1.00")
    assert bench.context_slopes(results[:1]) == ""
