"""Transformer: config validation, parameter layout, KV-cache equivalence, sharding."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from arl.models import (LOGICAL_AXIS_RULES, Transformer, TransformerConfig, abstract_params,
                        init_cache, param_partition_specs, param_shardings,
                        unembedding_matrix)
from arl.models import rope as rope_lib
from arl.models import transformer as transformer_lib
from tests.models.helpers import SMALL, jitted_forward, make

# Multi-query attention, Qwen2-style QKV bias, tied embeddings, no value head.
MQA_TIED = dataclasses.replace(SMALL, num_kv_heads=1, qkv_bias=True, tie_embeddings=True,
                               value_head=False, rope_theta=1e6)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs, field", [
    (dict(d_model=30, num_heads=4), "num_heads"),
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(num_layers=0), "num_layers"),
    (dict(head_dim=7), "head_dim"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(dtype=jnp.int32), "dtype"),
    (dict(layer_unroll=0), "layer_unroll"),
    (dict(qkv_bias=1), "qkv_bias"),
    (dict(o_bias="yes"), "o_bias"),
    (dict(mlp_bias=None), "mlp_bias"),
])
def test_config_errors_name_the_field(kwargs, field):
    base = dict(vocab_size=16, d_model=32, num_heads=4, num_kv_heads=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**base)


def test_config_is_hashable_and_head_dim_default():
    assert hash(SMALL) == hash(dataclasses.replace(SMALL))
    assert SMALL.resolved_head_dim == 8
    assert dataclasses.replace(SMALL, head_dim=16).resolved_head_dim == 16


def test_call_argument_errors():
    model, _, params = make(SMALL)
    with pytest.raises(ValueError, match="tokens"):
        model.apply({"params": params}, jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="tokens"):
        model.apply({"params": params}, jnp.zeros((1, 4), jnp.float32),
                    init_cache(SMALL, 1, 8), method="decode")
    with pytest.raises(ValueError, match="cache must be a KVCache"):
        model.apply({"params": params}, jnp.zeros((1, 4), jnp.int32), None, method="decode")
    with pytest.raises(ValueError, match="cache"):
        model.apply({"params": params}, jnp.zeros((2, 4), jnp.int32),
                    init_cache(SMALL, 3, 8), method="decode")
    with pytest.raises(ValueError, match="capacity"):
        init_cache(SMALL, 2, 0)


# ----------------------------------------------------------------------------- parameters


def test_parameter_names_shapes_and_logical_axes():
    _, boxed, params = make(SMALL)
    layers = params["layers"]
    assert params["embed_tokens"]["embedding"].shape == (64, 32)
    assert layers["self_attn"]["q_proj"]["kernel"].shape == (2, 32, 4, 8)
    # The default tree has no biases at all.
    assert not [k for k in jax.tree_util.tree_leaves_with_path(params)
                if "bias" in jax.tree_util.keystr(k[0]) and "value_head" not in
                jax.tree_util.keystr(k[0])]
    assert layers["self_attn"]["k_proj"]["kernel"].shape == (2, 32, 2, 8)
    assert layers["self_attn"]["o_proj"]["kernel"].shape == (2, 4, 8, 32)
    assert layers["mlp"]["down_proj"]["kernel"].shape == (2, 64, 32)
    assert layers["input_layernorm"]["scale"].shape == (2, 32)
    assert params["lm_head"].shape == (32, 64)
    assert params["value_head"]["kernel"].shape == (32, 1)
    names = nn.get_partition_spec(boxed)
    assert names["layers"]["self_attn"]["k_proj"]["kernel"] == P(
        "layers", "embed", "kv_heads", "head_dim")
    assert names["embed_tokens"]["embedding"] == P("vocab", "embed")
    specs = param_partition_specs(boxed, LOGICAL_AXIS_RULES)
    assert specs["layers"]["mlp"]["gate_proj"]["kernel"] == P(None, "fsdp", "tensor")
    assert specs["lm_head"] == P("fsdp", "tensor")
    # abstract_params gives the same boxes without allocating.
    assert param_partition_specs(abstract_params(Transformer(SMALL))) == specs
    biased = abstract_params(Transformer(dataclasses.replace(SMALL, qkv_bias=True)))
    bias = biased["layers"]["self_attn"]["k_proj"]["bias"]
    assert bias.value.shape == (2, 2, 8) and bias.names == ("layers", "kv_heads", "head_dim")
    assert "bias" not in biased["layers"]["self_attn"]["o_proj"]
    # HF Llama attention_bias=True + mlp_bias=True.
    llama = abstract_params(Transformer(dataclasses.replace(SMALL, qkv_bias=True, o_bias=True,
                                                            mlp_bias=True)))
    expected = {("self_attn", "o_proj"): ((2, 32), ("layers", "embed")),
                ("mlp", "gate_proj"): ((2, 64), ("layers", "mlp")),
                ("mlp", "up_proj"): ((2, 64), ("layers", "mlp")),
                ("mlp", "down_proj"): ((2, 32), ("layers", "embed"))}
    for (block, proj), (shape, names) in expected.items():
        bias = llama["layers"][block][proj]["bias"]
        assert (bias.value.shape, bias.names) == (shape, names), (block, proj)
    # unboxed params carry no names -> replicated.
    assert all(s == P() for s in jax.tree.leaves(
        param_partition_specs(params), is_leaf=lambda x: isinstance(x, P)))


def test_tied_embeddings_have_no_lm_head():
    model, _, params = make(MQA_TIED)
    assert "lm_head" not in params and "value_head" not in params
    tokens = jnp.array([[1, 2, 3]])
    out = jax.jit(lambda p, t: model.apply({"params": p}, t, return_hidden=True))(params, tokens)
    assert out.values is None
    expected = out.hidden @ params["embed_tokens"]["embedding"].T
    np.testing.assert_allclose(out.logits, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(unembedding_matrix(params, MQA_TIED),
                                  params["embed_tokens"]["embedding"].T)


def test_hidden_only_output_and_unembedding_matrix():
    model, boxed, params = make(SMALL)
    tokens = jnp.array([[1, 2, 3]])
    out = jax.jit(lambda p, t: model.apply({"params": p}, t, compute_logits=False,
                                           return_hidden=True))(params, tokens)
    assert out.logits is None and out.hidden.shape == (1, 3, 32)
    ref = jitted_forward(SMALL)(params, tokens)
    np.testing.assert_allclose(out.hidden @ unembedding_matrix(boxed, SMALL), ref.logits,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.values, ref.values, rtol=1e-6)


def test_boxed_params_apply_like_plain_params():
    _, boxed, params = make(SMALL)
    tokens = jnp.array([[3, 1, 4, 1, 5]])
    forward = jitted_forward(SMALL)
    np.testing.assert_array_equal(forward(boxed, tokens).logits, forward(params, tokens).logits)


def test_causality_and_rope_relative_positions():
    _, _, params = make(SMALL)
    apply = lambda t: jitted_forward(SMALL)(params, t).logits
    a = jnp.array([[5, 6, 7, 8, 9, 10]])
    b = a.at[0, 4:].set(jnp.array([1, 2]))
    # Changing later tokens never changes earlier logits.
    np.testing.assert_array_equal(apply(a)[0, :4], apply(b)[0, :4])
    # Position matters: the same token after different prefixes differs.
    assert not np.allclose(apply(a)[0, 1], apply(jnp.array([[9, 6]]))[0, 1])


@pytest.mark.parametrize("seq_len, head_dim, theta", [(24, 8, 1e4), (1047, 64, 1e6),
                                                     (8082, 128, 5e5)])
def test_constant_rope_tables_are_the_computed_ones_within_one_rounding(seq_len, head_dim, theta):
    """The training forward pass's tables (host constants) against the program's own
    `rope_tables`: float32 angles alike, so cos and sin differ by at most one rounding."""
    const_cos, const_sin = rope_lib.constant_rope_tables(seq_len, head_dim, theta, jnp.float32)
    cos, sin = jax.jit(lambda p: rope_lib.rope_tables(p, head_dim, theta, jnp.float32))(
        jnp.arange(seq_len)[None])
    assert const_cos.shape == cos.shape == (1, seq_len, 1, head_dim)
    np.testing.assert_allclose(const_cos, cos, rtol=0, atol=2 ** -24)
    np.testing.assert_allclose(const_sin, sin, rtol=0, atol=2 ** -24)


@pytest.mark.parametrize("limit", [None, 4], ids=["constant-tables", "computed-tables"])
def test_default_positions_use_constant_rope_tables(limit, monkeypatch):
    """The forward pass at the default positions (constant tables, no cos or sin in the
    compiled program; above the size limit computed ones) equals the one given the same
    positions explicitly (tables computed in the program), logits and gradients."""
    if limit is not None:
        monkeypatch.setattr(rope_lib, "CONSTANT_ROPE_ELEMENTS", limit)
    model, _, params = make(MQA_TIED)
    tokens = jax.random.randint(jax.random.key(5), (3, 7), 0, MQA_TIED.vocab_size)
    explicit = jnp.broadcast_to(jnp.arange(7), (3, 7))

    weights = jax.random.normal(jax.random.key(6), (3, 7, MQA_TIED.vocab_size))

    def loss(p, positions):  # no trigonometry of its own, unlike e.g. sum(sin(logits))
        logits = model.apply({"params": p}, tokens, positions=positions).logits
        return jnp.sum(weights * logits ** 2), logits

    default = jax.jit(lambda p: jax.value_and_grad(loss, has_aux=True)(p, None))
    given = jax.jit(lambda p: jax.value_and_grad(loss, has_aux=True)(p, explicit))
    (_, want_logits), want_grads = given(params)
    (_, got_logits), got_grads = default(params)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    compiled = default.lower(params).compile().as_text()
    assert ("cosine(" in compiled) == (limit is not None)
    assert "cosine(" in given.lower(params).compile().as_text()


# ----------------------------------------------------------------------------- KV cache


def _cached_vs_full(config, chunks, num_valids, capacity=24):
    """Run `chunks` ([B, T_i] int arrays, num_valid [B] each) through the cache and compare
    every valid position's logits/values with one full forward pass per row."""
    model, _, params = make(config)
    step = jax.jit(lambda p, tokens, cache, nv: model.apply({"params": p}, tokens, cache,
                                                            num_valid=nv, method="decode"))
    full = lambda tokens: jitted_forward(config)(params, tokens)
    batch = chunks[0].shape[0]
    cache = init_cache(config, batch, capacity)
    rows = [[] for _ in range(batch)]
    got_logits = [[] for _ in range(batch)]
    got_values = [[] for _ in range(batch)]
    for tokens, nv in zip(chunks, num_valids):
        out = step(params, jnp.asarray(tokens), cache, jnp.asarray(nv, jnp.int32))
        cache = out.cache
        for b in range(batch):
            rows[b].extend(np.asarray(tokens)[b, :nv[b]].tolist())
            got_logits[b].extend(np.asarray(out.logits)[b, :nv[b]])
            if config.value_head:
                got_values[b].extend(np.asarray(out.values)[b, :nv[b]])
    np.testing.assert_array_equal(cache.length, [len(r) for r in rows])
    longest = max(len(r) for r in rows)
    padded = np.zeros((batch, longest), np.int32)
    for b, r in enumerate(rows):
        padded[b, :len(r)] = r
    ref = full(jnp.asarray(padded))
    for b, r in enumerate(rows):
        np.testing.assert_allclose(np.stack(got_logits[b]), ref.logits[b, :len(r)],
                                   atol=1e-5, rtol=1e-5)
        if config.value_head:
            np.testing.assert_allclose(np.stack(got_values[b]), ref.values[b, :len(r)],
                                       atol=1e-5, rtol=1e-5)
    return cache


@pytest.mark.parametrize("config", [SMALL, MQA_TIED], ids=["gqa-value-head", "mqa-qkv-bias-tied"])
def test_cached_decoding_matches_full_forward(config):
    rng = np.random.default_rng(0)
    tok = lambda t: rng.integers(0, config.vocab_size, size=(3, t)).astype(np.int32)
    chunks = [tok(6)] + [tok(1) for _ in range(4)] + [tok(3), tok(1), tok(1)]
    num_valids = ([[6, 2, 0]]               # padded prefill, one empty row
                  + [[1, 1, 1], [0, 1, 1], [1, 1, 0], [1, 0, 1]]   # rows idle at times
                  + [[3, 1, 2]]             # an env observation chunk, padded
                  + [[1, 1, 1], [0, 0, 1]])
    _cached_vs_full(config, chunks, num_valids)


def test_rows_with_num_valid_zero_keep_their_cache_bit_for_bit():
    model, _, params = make(SMALL)
    step = jax.jit(lambda p, t, c, nv: model.apply({"params": p}, t, c,
                                                   num_valid=nv, method="decode").cache)
    cache = step(params, jnp.array([[1, 2, 3], [4, 5, 6]]), init_cache(SMALL, 2, 8),
                 jnp.array([3, 2]))
    new = step(params, jnp.array([[7, 8], [9, 9]]), cache, jnp.array([0, 2]))
    np.testing.assert_array_equal(new.keys[:, 0], cache.keys[:, 0])
    np.testing.assert_array_equal(new.values[:, 0], cache.values[:, 0])
    np.testing.assert_array_equal(new.length, [3, 4])
    # Row 1's padded slot 2 was overwritten by its new valid token.
    assert not np.array_equal(new.keys[:, 1, 2], cache.keys[:, 1, 2])


def test_writes_past_capacity_are_dropped_not_clamped():
    model, _, params = make(SMALL)
    tokens = jnp.array([[1, 2, 3, 4, 5, 6]])
    prefill = jax.jit(lambda p, c: model.apply({"params": p}, tokens, c, method="decode").cache)
    small = prefill(params, init_cache(SMALL, 1, 4))
    large = prefill(params, init_cache(SMALL, 1, 8))
    np.testing.assert_allclose(small.keys, large.keys[:, :, :4], atol=1e-6)
    np.testing.assert_array_equal(small.length, [6])


def test_vmap_over_independent_batches_equals_flat_batch():
    _, _, params = make(SMALL)
    tokens = jax.random.randint(jax.random.key(3), (2, 4, 6), 0, SMALL.vocab_size)
    forward = jitted_forward(SMALL)
    stacked = jax.jit(jax.vmap(lambda t: forward(params, t).logits))(tokens)
    flat = forward(params, tokens.reshape(8, 6)).logits.reshape(2, 4, 6, -1)
    np.testing.assert_allclose(stacked, flat, atol=1e-5, rtol=1e-5)


def test_bfloat16_activations_give_float32_logits_close_to_float32():
    _, _, params = make(SMALL)  # same parameter tree; only activations change
    tokens = jnp.array([[1, 2, 3, 4, 5, 6]])
    out = jitted_forward(dataclasses.replace(SMALL, dtype=jnp.bfloat16))(params, tokens)
    assert out.logits.dtype == jnp.float32 and out.values.dtype == jnp.float32
    ref = jitted_forward(SMALL)(params, tokens)
    assert np.all(np.isfinite(out.logits))
    # Measured error 0.0018: about three times that.
    np.testing.assert_allclose(out.logits, ref.logits, atol=0.006)


@pytest.mark.slow  # two gradient compilations (~25 s on a busy 2-core CPU)
def test_remat_gives_identical_gradients():
    tokens = jnp.array([[1, 2, 3, 4, 5]])
    _, _, params = make(SMALL)

    def grads(config):
        model = Transformer(config)
        loss = lambda p: jnp.sum(model.apply({"params": p}, tokens).logits ** 2)
        return jax.jit(jax.grad(loss))(params)

    plain, remat = grads(SMALL), grads(dataclasses.replace(SMALL, remat=True))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 plain, remat)


def test_unrolled_layer_scan_is_the_same_model():
    """layer_unroll changes the compiled loop, not the parameters or the numbers: the same
    parameters give the same logits, gradients and cached decoding."""
    unrolled = dataclasses.replace(SMALL, layer_unroll=SMALL.num_layers)
    _, _, params = make(SMALL)
    _, _, unrolled_params = make(unrolled)
    jax.tree.map(np.testing.assert_array_equal, params, unrolled_params)
    tokens = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])

    def grads(config):
        loss = lambda p: jnp.sum(Transformer(config).apply({"params": p}, tokens).logits ** 2)
        return jax.jit(jax.grad(loss))(params)

    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 grads(SMALL), grads(unrolled))
    np.testing.assert_allclose(jitted_forward(unrolled)(params, tokens).logits,
                               jitted_forward(SMALL)(params, tokens).logits, atol=1e-6)
    rng = np.random.default_rng(1)
    chunks = [rng.integers(0, SMALL.vocab_size, size=(2, t)).astype(np.int32)
              for t in (4, 1, 1)]
    _cached_vs_full(unrolled, chunks, [[4, 2], [1, 1], [0, 1]])


# ----------------------------------------------------------------------------- sharding


def test_sharded_forward_matches_unsharded():
    model, boxed, params = make(SMALL)
    tokens = jax.random.randint(jax.random.key(7), (4, 6), 0, SMALL.vocab_size)
    forward = lambda p, t: model.apply({"params": p}, t)
    ref = jitted_forward(SMALL)(params, tokens)

    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(AxisType.Auto,) * 3)
    shardings = param_shardings(boxed, mesh, LOGICAL_AXIS_RULES)
    sharded_params = jax.device_put(params, shardings)
    q = sharded_params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (2, 16, 2, 8)
    sharded_tokens = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"))))
    with jax.set_mesh(mesh):
        out = jax.jit(forward)(sharded_params, sharded_tokens)
    np.testing.assert_allclose(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.values, ref.values, rtol=1e-5, atol=1e-6)


def test_partition_specs_drop_axes_that_do_not_divide():
    boxed = abstract_params(Transformer(SMALL))  # 4 heads, 2 kv heads
    mesh = jax.make_mesh((2, 1, 4), ("data", "fsdp", "tensor"),
                         axis_types=(AxisType.Auto,) * 3)
    specs = param_partition_specs(boxed, LOGICAL_AXIS_RULES, mesh)
    assert specs["layers"]["self_attn"]["q_proj"]["kernel"] == P(None, "fsdp", "tensor", None)
    assert specs["layers"]["self_attn"]["k_proj"]["kernel"] == P(None, "fsdp", None, None)
    # vocab 64 divides by 4; the spec is usable for device_put.
    jax.device_put(jnp.zeros((64, 32)), NamedSharding(mesh, specs["embed_tokens"]["embedding"]))


def test_gather_embedding_casts_and_gathers_the_table_once():
    config = dataclasses.replace(SMALL, dtype=jnp.bfloat16)  # float32 parameters
    model, boxed, params = make(config)
    tokens = jax.random.randint(jax.random.key(3), (4, 6), 0, config.vocab_size)
    gathered = transformer_lib.gather_embedding(boxed, config)  # boxed trees too
    table = gathered["embed_tokens"]["embedding"]
    assert table.dtype == jnp.bfloat16
    np.testing.assert_array_equal(table, params["embed_tokens"]["embedding"].astype(
        jnp.bfloat16))
    assert gathered["layers"] is boxed["layers"]
    forward = jax.jit(lambda p: model.apply({"params": p}, tokens).logits)
    np.testing.assert_array_equal(forward(nn.unbox(gathered)), forward(params))

    # Under an activation mesh the table comes out as the forward pass reads it: split
    # over "tensor" along the vocabulary, gathered over "fsdp" (the parameter's own
    # layout splits d_model over "fsdp").
    mesh = jax.make_mesh((1, 4, 2), ("data", "fsdp", "tensor"),
                         axis_types=(AxisType.Auto,) * 3)
    shardings = param_shardings(boxed, mesh, LOGICAL_AXIS_RULES)
    assert shardings["embed_tokens"]["embedding"].spec == P("tensor", "fsdp")
    sharded = jax.device_put(params, shardings)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        out = jax.jit(lambda p: transformer_lib.gather_embedding(p, config)[
            "embed_tokens"]["embedding"])(sharded)
    assert out.sharding.spec in (P("tensor"), P("tensor", None))
    np.testing.assert_array_equal(out, table)
