"""The scoring forward every loss reads (`Policy.score`) and the update's loss: the fused
log-prob + entropy, scoring only the positions a loss reads, and the flattened-token
layers, each against the plain computation it replaces."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from arl import algorithms as alg
from arl import config as config_lib
from arl import sharding as sharding_lib
from arl.models import Transformer
from arl.trainers.policy import Policy, same_prompts
from arl.trainers.update import Learner, UpdateBatch
from tests.models.helpers import SMALL, make

B, S = 4, 23


def test_fused_logprobs_and_entropy_equal_the_two_kernels():
    logits = jax.random.normal(jax.random.key(0), (3, 5, 11)) * 4
    logits = logits.at[0, 0, 3].set(-jnp.inf)  # a banned token: probability 0
    tokens = jax.random.randint(jax.random.key(1), (3, 5), 0, 11)
    logp, ent = alg.token_logprobs_and_entropy(logits, tokens)
    np.testing.assert_allclose(logp, alg.token_logprobs(logits, tokens), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent, alg.entropy(logits), rtol=1e-6, atol=1e-6)
    # Hand check of one row in float64.
    z = np.asarray(logits[1, 2], np.float64)
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    # lse - sum p z cancels in float32 on a peaked row: absolute tolerance.
    assert math.isclose(float(ent[1, 2]), float(-(p * np.log(p)).sum()), abs_tol=2e-5)
    assert math.isclose(float(logp[1, 2]), float(np.log(p[int(tokens[1, 2])])), rel_tol=1e-5)
    with pytest.raises(ValueError, match="tokens"):
        alg.token_logprobs_and_entropy(logits, tokens[:, :4])


def _policy(chunk=0, **model_overrides):
    """A policy of SMALL with `model_overrides`, on SMALL's parameters: the overrides
    (remat, attention) take the same parameters, which are initialised (compiled) once."""
    _, _, params = make(SMALL)
    model = Transformer(dataclasses.replace(SMALL, **model_overrides))
    return Policy(model=model, temperature=0.7, logprob_chunk=chunk), params


def _scored_mask(seed=3, per_row=(5, 0, 9, 7)):
    """Random scored positions (never position 0), `per_row[b]` of them in row b."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, S), np.float32)
    for b, n in enumerate(per_row):
        mask[b, rng.choice(np.arange(1, S), n, replace=False)] = 1.0
    return jnp.asarray(mask)


TOKENS = jax.random.randint(jax.random.key(7), (B, S), 0, SMALL.vocab_size)


@functools.partial(jax.jit, static_argnums=2)  # one compile for the file, not eager ops
def _plain_scores(params, tokens, temperature):
    """The previous scoring path: the model's [B, S, V] logits, tempered, then the two
    separate kernels."""
    out = Transformer(SMALL).apply({"params": params}, tokens)
    logits = out.logits[:, :-1] / temperature
    pad = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)
    return (pad(alg.token_logprobs(logits, tokens[:, 1:])), pad(alg.entropy(logits)),
            pad(out.values[:, :-1]))


@pytest.mark.parametrize("chunk, bound", [(0, 9), (4, 12)])
def test_scoring_selected_positions_equals_full_scoring(chunk, bound):
    policy, params = _policy(chunk)
    scored = _scored_mask()
    logp0, ent0, values0 = _plain_scores(params, TOKENS, 0.7)
    full = jax.jit(policy.score)(params, TOKENS)
    sel = jax.jit(lambda p, t, m: policy.score(p, t, scored=m, max_scored=bound))(
        params, TOKENS, scored)
    np.testing.assert_allclose(full.logp, logp0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(full.entropy, ent0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sel.logp, logp0 * scored, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sel.entropy, ent0 * scored, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(sel.logp * (1 - scored), 0.0)  # exactly 0 elsewhere
    np.testing.assert_allclose(sel.values, values0, rtol=1e-6, atol=1e-6)

    # Gradients of a loss that reads the scored positions only.
    weights = jax.random.normal(jax.random.key(4), (B, S)) * scored

    def loss(p, **kw):
        s = policy.score(p, TOKENS, **kw)
        return jnp.sum(s.logp * weights) + 0.1 * jnp.sum(s.entropy * weights)

    g_sel = jax.jit(jax.grad(lambda p: loss(p, scored=scored, max_scored=bound)))(params)
    g_full = jax.jit(jax.grad(loss))(params)
    for got, want in zip(jax.tree.leaves(g_sel), jax.tree.leaves(g_full)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_scoring_known_within_bound_equals_full_scoring_without_the_fallback():
    """`scored_within_bound=True`: the same scores and gradients as full scoring, and
    the program has no full-vocabulary way left in it (no `lax.cond` between the two)."""
    policy, params = _policy()
    scored = _scored_mask()  # at most 9 positions a row
    logp0, ent0, _ = _plain_scores(params, TOKENS, 0.7)
    score = lambda p, **kw: policy.score(p, TOKENS, scored=scored, max_scored=9, **kw)  # noqa: E731
    known = jax.jit(lambda p: score(p, scored_within_bound=True))(params)
    np.testing.assert_allclose(known.logp, logp0 * scored, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(known.entropy, ent0 * scored, rtol=1e-5, atol=1e-5)
    weights = jax.random.normal(jax.random.key(4), (B, S)) * scored

    def loss(p, **kw):
        return jnp.sum(score(p, **kw).logp * weights)

    g_known = jax.jit(jax.grad(lambda p: loss(p, scored_within_bound=True)))(params)
    g_checked = jax.jit(jax.grad(loss))(params)
    for got, want in zip(jax.tree.leaves(g_known), jax.tree.leaves(g_checked)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    primitives = lambda **kw: str(jax.make_jaxpr(lambda p: score(p, **kw).logp)(params))  # noqa: E731
    assert " cond[" in primitives() and " cond[" not in primitives(scored_within_bound=True)
    with pytest.raises(ValueError, match="scored_within_bound must be True or False"):
        score(params, scored_within_bound=1)


def test_a_row_over_the_bound_falls_back_to_full_scoring():
    policy, params = _policy()
    scored = _scored_mask()  # a row with 9 positions, bound 6
    logp0, ent0, _ = _plain_scores(params, TOKENS, 0.7)
    sel = jax.jit(lambda p: policy.score(p, TOKENS, scored=scored, max_scored=6))(params)
    np.testing.assert_allclose(sel.logp, logp0 * scored, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sel.entropy, ent0 * scored, rtol=1e-5, atol=1e-5)


def test_entropy_can_be_skipped_and_arguments_are_checked():
    policy, params = _policy()
    # Shapes only (traced, not compiled): whether the entropy is there.
    assert jax.eval_shape(lambda p: policy.score(p, TOKENS, entropy=False), params
                          ).entropy is None
    assert jax.eval_shape(lambda p: policy.score(p, TOKENS, scored=_scored_mask(),
                                                 max_scored=9, entropy=False), params
                          ).entropy is None
    assert jax.eval_shape(lambda p: policy.score(p, TOKENS), params).entropy.shape == (B, S)
    with pytest.raises(ValueError, match="max_scored"):
        policy.score(params, TOKENS, scored=_scored_mask(), max_scored=2.5)
    with pytest.raises(ValueError, match="scored"):
        policy.score(params, TOKENS, scored=_scored_mask()[:, :5], max_scored=9)


def loss_config(**overrides):
    """The Learner's loss settings of these tests (ECHO on unless overridden): the
    library's defaults with these tests' values."""
    c = config_lib.default_config().loss
    c.update(dict(
        clip_low=0.2, clip_high=0.2, dual_clip=0.0, agg="token-mean", norm=0.0,
        value_coef=0.5, value_clip=0.0, entropy_coef=0.01, kl_coef=0.05, kl_kind="k3",
        kl_in_reward=False, echo_coef=0.1, sft_coef=0.3, sft_coef_final=-1.0,
        sft_hold_steps=0, sft_decay_steps=100))
    c.update(overrides)
    return c


@pytest.mark.parametrize("echo_coef", [0.0, 0.1])
def test_learner_loss_with_token_bounds_equals_full_scoring(echo_coef):
    """Every term of the loss (policy, entropy, value, KL, ECHO, SFT): the same metrics
    and gradients whether the policy scores every position or only the masked ones."""
    policy, params = _policy()
    agent = _scored_mask(seed=5, per_row=(6, 3, 0, 8))
    observation = _scored_mask(seed=6, per_row=(4, 4, 2, 0)) * (1 - agent)
    keys = jax.random.split(jax.random.key(8), 4)
    mb = UpdateBatch(
        tokens=TOKENS, mask=agent,
        old_logp=-jax.random.uniform(keys[0], (B, S), minval=0.5, maxval=5.0) * agent,
        advantages=jax.random.normal(keys[1], (B, S)) * agent, observation_mask=observation,
        old_values=jax.random.normal(keys[2], (B, S)) * agent,
        returns=jax.random.normal(keys[3], (B, S)) * agent,
        ref_logp=-jax.random.uniform(keys[2], (B, S), minval=0.5, maxval=5.0) * agent,
        demo_tokens=jnp.flip(TOKENS, axis=0), demo_mask=jnp.flip(agent, axis=0))

    def learner(agent_bound, obs_bound, rows_within_bounds=False):
        return Learner(policy, optax.sgd(0.1), loss_config(echo_coef=echo_coef), epochs=1,
                       minibatches=1, mesh=None, context_length=S,
                       agent_token_bound=agent_bound, observation_token_bound=obs_bound,
                       rows_within_bounds=rows_within_bounds)

    def grads(lrn):
        return jax.jit(jax.grad(lrn.loss, has_aux=True))(params, mb, 0)

    g_full, m_full = grads(learner(0, 0))
    # Bounds checked on the data, and known to hold (the trainer's rollouts).
    for g_sel, m_sel in (grads(learner(8, 4)), grads(learner(8, 4, True))):
        assert set(m_full) == set(m_sel)
        for key in m_full:
            np.testing.assert_allclose(m_sel[key], m_full[key], rtol=1e-5, atol=1e-6,
                                       err_msg=key)
        for got, want in zip(jax.tree.leaves(g_sel), jax.tree.leaves(g_full)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def _reference_forward(params, tokens, config):
    """The decoder in its plain [B, T, D] formulation (3-D einsums, dense causal
    attention): what the flattened-token projections must reproduce."""
    def rms(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + config.norm_eps) * scale

    def rope(x):
        dim = x.shape[-1]
        inv = 1.0 / config.rope_theta ** (jnp.arange(0, dim, 2) / dim)
        ang = jnp.arange(x.shape[1])[:, None] * inv
        ang = jnp.concatenate([ang, ang], -1)[None, :, None, :]
        x1, x2 = jnp.split(x, 2, -1)
        return x * jnp.cos(ang) + jnp.concatenate([-x2, x1], -1) * jnp.sin(ang)

    h = params["embed_tokens"]["embedding"][tokens]
    length = tokens.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    for i in range(config.num_layers):
        lp = jax.tree.map(lambda x: x[i], params["layers"])
        a, att = rms(h, lp["input_layernorm"]["scale"]), lp["self_attn"]
        q = rope(jnp.einsum("btd,dhk->bthk", a, att["q_proj"]["kernel"]))
        k = rope(jnp.einsum("btd,dhk->bthk", a, att["k_proj"]["kernel"]))
        v = jnp.einsum("btd,dhk->bthk", a, att["v_proj"]["kernel"])
        groups = config.num_heads // config.num_kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        z = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(q.shape[-1])
        p = jax.nn.softmax(jnp.where(causal, z, -jnp.inf), -1)
        o = jnp.einsum("bhts,bshk->bthk", p, v)
        h = h + jnp.einsum("bthk,hkd->btd", o, att["o_proj"]["kernel"])
        m, mlp = rms(h, lp["post_attention_layernorm"]["scale"]), lp["mlp"]
        gate = jnp.einsum("btd,df->btf", m, mlp["gate_proj"]["kernel"])
        up = jnp.einsum("btd,df->btf", m, mlp["up_proj"]["kernel"])
        h = h + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, mlp["down_proj"]["kernel"])
    hidden = rms(h, params["norm"]["scale"])
    return jnp.einsum("btd,dv->btv", hidden, params["lm_head"])


def test_flattened_token_layers_equal_the_plain_formulation():
    config = dataclasses.replace(SMALL, value_head=False)
    model = Transformer(config)
    # SMALL's parameters less the value head: those an init of `config` gives (the same
    # key and shapes), without compiling that init.
    params = {k: v for k, v in make(SMALL)[2].items() if k != "value_head"}
    weights = jax.random.normal(jax.random.key(9), (B, S, config.vocab_size))
    loss = lambda f: (lambda p: jnp.sum(f(p) * weights))
    ours = lambda p: model.apply({"params": p}, TOKENS).logits
    ref = lambda p: _reference_forward(p, TOKENS, config)
    np.testing.assert_allclose(jax.jit(ours)(params), jax.jit(ref)(params), rtol=1e-5,
                               atol=1e-5)
    g_ours = jax.jit(jax.grad(loss(ours)))(params)
    g_ref = jax.jit(jax.grad(loss(ref)))(params)
    for got, want in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_config_selects_the_attention_implementation():
    from arl import config as config_lib
    c = config_lib.default_config()
    c.model.attention, c.model.attention_block = "blocked", 64
    policy = Policy.from_config(c, vocab_size=32, context_length=40, value_head=False)
    assert policy.model.config.attention == "blocked"
    assert policy.model.config.attention_block == 64
    assert config_lib.default_config().model.attention == "auto"


GROUP, PROMPT = 2, 7


def _grouped_tokens(seed=11):
    """TOKENS with each group of GROUP rows sharing its first row's first PROMPT tokens."""
    prompts = jnp.repeat(TOKENS[::GROUP, :PROMPT], GROUP, axis=0)
    return TOKENS.at[:, :PROMPT].set(prompts)


@pytest.mark.parametrize("chunk, bound, model", [
    (0, 0, {}), (0, 12, {}), (4, 0, {}), (0, 12, {"remat": True}),
    (0, 12, {"attention": "blocked", "attention_block": 8})])
def test_scoring_each_group_prompt_once_equals_full_scoring(chunk, bound, model):
    """Log-probs, entropies, values and gradients of a loss over every position: the
    same whether each group's prompt is read once or every row is read whole (layers
    rematerialised or not, dense or blocked attention)."""
    policy, params = _policy(chunk, **model)
    tokens = _grouped_tokens()
    scored = (jnp.arange(S) >= PROMPT - 2).astype(jnp.float32)[None].repeat(B, 0)
    kw = dict(scored=scored, max_scored=bound) if bound else {}
    logp0, ent0, values0 = _plain_scores(params, tokens, 0.7)
    shared = jax.jit(lambda p, t: policy.score(p, t, group_size=GROUP, prompt_len=PROMPT,
                                               **kw))(params, tokens)
    mask = scored if bound else 1.0
    np.testing.assert_allclose(shared.logp, logp0 * mask, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(shared.entropy, ent0 * mask, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(shared.values, values0, rtol=1e-5, atol=1e-5)

    weights = jax.random.normal(jax.random.key(12), (B, S)) * mask

    def loss(p, **share):
        s = policy.score(p, tokens, **kw, **share)
        return (jnp.sum(s.logp * weights) + 0.1 * jnp.sum(s.entropy * weights)
                + 0.5 * jnp.sum(s.values * weights))

    g_shared = jax.jit(jax.grad(lambda p: loss(p, group_size=GROUP, prompt_len=PROMPT)))(params)
    g_full = jax.jit(jax.grad(loss))(params)
    for got, want in zip(jax.tree.leaves(g_shared), jax.tree.leaves(g_full)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_groups_whose_prompts_differ_are_scored_whole():
    """A batch in which one group's rows start differently takes the ordinary path: the
    same numbers as without sharing, bit for bit."""
    policy, params = _policy()
    tokens = _grouped_tokens().at[3, PROMPT - 1].add(1)  # last group: rows differ at 6
    assert bool(same_prompts(_grouped_tokens(), GROUP, PROMPT))
    assert not bool(same_prompts(tokens, GROUP, PROMPT))
    assert bool(same_prompts(tokens, GROUP, PROMPT - 1))
    score = jax.jit(lambda p, t, **kw: policy.score(p, t, scored=jnp.ones((B, S)),
                                                    max_scored=S - 2, **kw),
                    static_argnames=("group_size", "prompt_len"))
    shared = score(params, tokens, group_size=GROUP, prompt_len=PROMPT)
    plain = score(params, tokens)
    np.testing.assert_array_equal(shared.logp, plain.logp)
    np.testing.assert_array_equal(shared.values, plain.values)


def test_when_the_prompt_is_shared_and_bad_arguments():
    policy, _ = _policy()
    assert policy.shares_prompt((B, S), GROUP, PROMPT)
    assert not policy.shares_prompt((B, S), 1, PROMPT)      # no groups
    assert not policy.shares_prompt((B, S), 3, PROMPT)      # 3 does not divide 4 rows
    assert not policy.shares_prompt((B, S), GROUP, 0)       # no prompt
    assert not policy.shares_prompt((B, S), GROUP, S)       # nothing after it
    for bad in (dict(group_size=2.0), dict(prompt_len=-1), dict(group_size=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            policy.shares_prompt((B, S), **{"group_size": GROUP, "prompt_len": PROMPT, **bad})


def _update_batch(tokens):
    agent = (jnp.arange(S) >= PROMPT).astype(jnp.float32)[None].repeat(B, 0)
    keys = jax.random.split(jax.random.key(13), 3)
    return UpdateBatch(
        tokens=tokens, mask=agent,
        old_logp=-jax.random.uniform(keys[0], (B, S), minval=0.5, maxval=5.0) * agent,
        advantages=jax.random.normal(keys[1], (B, S)) * agent, observation_mask=1 - agent,
        old_values=jax.random.normal(keys[2], (B, S)) * agent,
        returns=jax.random.normal(keys[2], (B, S)) * agent)


def _assert_same_update(shared, plain, params, batch, seed):
    """Parameters and metrics of `shared`'s update equal `plain`'s; returns the latter's
    parameters."""
    results = [jax.jit(lrn.update)(params, optax.sgd(0.1).init(params), batch,
                                   jax.random.key(seed), 0) for lrn in (shared, plain)]
    (p_shared, _, m_shared), (p_plain, _, m_plain) = results
    for got, want in zip(jax.tree.leaves(p_shared), jax.tree.leaves(p_plain)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for key in m_plain:
        np.testing.assert_allclose(m_shared[key], m_plain[key], rtol=1e-4, atol=1e-6,
                                   err_msg=key)
    return p_plain


def test_learner_keeps_groups_together_and_scores_their_prompt_once():
    """One minibatch: the update with the groups' prompts read once gives the parameters
    and metrics of the ordinary update (rows shuffled, every row read whole)."""
    policy, params = _policy()
    batch = _update_batch(_grouped_tokens())

    def learner(**share):
        return Learner(policy, optax.sgd(0.1), loss_config(kl_coef=0.0, echo_coef=0.0,
                                                            sft_coef=0.0),
                       epochs=2, minibatches=1, mesh=sharding_lib.make_mesh((1, 1, 1)),
                       context_length=S, **share)

    shared_learner = learner(group_size=GROUP, prompt_len=PROMPT)
    assert shared_learner.shares_prompt and not learner().shares_prompt
    assert not dataclasses.replace(shared_learner, minibatches=2).shares_prompt
    _assert_same_update(shared_learner, learner(), params, batch, seed=14)


def test_group_shuffle_deals_whole_groups_and_keeps_their_order():
    """shuffle="groups": each minibatch holds whole groups, rows in order within each;
    every row is dealt once; shuffle="rows" is a permutation of single rows."""
    policy, _ = _policy()
    ids = jnp.arange(12)
    batch = UpdateBatch(tokens=ids[:, None].repeat(3, 1), mask=jnp.zeros((12, 3)),
                        old_logp=jnp.zeros((12, 3)), advantages=jnp.zeros((12, 3)),
                        observation_mask=jnp.zeros((12, 3)))

    def dealt(shuffle, seed):
        lrn = Learner(policy, optax.sgd(0.1), loss_config(), epochs=1, minibatches=2,
                      mesh=sharding_lib.make_mesh((1, 1, 1)), context_length=3,
                      group_size=3, prompt_len=1, shuffle=shuffle)
        return np.asarray(lrn.deal_minibatches(batch, jax.random.key(seed)).tokens[..., 0])

    seen_orders = set()
    for seed in range(6):
        rows = dealt("groups", seed)
        assert rows.shape == (2, 6)
        assert sorted(rows.ravel().tolist()) == list(range(12))
        groups = rows.reshape(2, 2, 3)
        np.testing.assert_array_equal(groups % 3, np.broadcast_to([0, 1, 2], groups.shape))
        np.testing.assert_array_equal(groups // 3, groups[..., :1] // 3 + 0 * groups)
        seen_orders.add(tuple(rows.ravel()))
    assert len(seen_orders) > 1  # the groups are shuffled
    rows = dealt("rows", 0)
    assert sorted(rows.ravel().tolist()) == list(range(12))
    assert any((r.reshape(2, 3) % 3 != [0, 1, 2]).any() for r in rows)  # groups split
    with pytest.raises(ValueError, match="shuffle"):
        Learner(policy, optax.sgd(0.1), loss_config(), epochs=1, minibatches=2,
                mesh=sharding_lib.make_mesh((1, 1, 1)), context_length=3, shuffle="tasks")


def test_group_minibatches_score_each_prompt_once_with_the_same_update():
    """Two minibatches of whole groups: reading each group's prompt once gives the
    parameters and metrics of reading every row whole, with the same deal."""
    policy, params = _policy()
    batch = _update_batch(_grouped_tokens())

    def learner(prompt_len):
        return Learner(policy, optax.sgd(0.1), loss_config(kl_coef=0.0, echo_coef=0.0,
                                                            sft_coef=0.0),
                       epochs=2, minibatches=2, mesh=sharding_lib.make_mesh((1, 1, 1)),
                       context_length=S, group_size=GROUP, prompt_len=prompt_len,
                       shuffle="groups")

    assert learner(PROMPT).shares_prompt and not learner(0).shares_prompt
    p_plain = _assert_same_update(learner(PROMPT), learner(0), params, batch, seed=15)
    moved = [np.max(np.abs(a - b)) for a, b in zip(jax.tree.leaves(p_plain),
                                                   jax.tree.leaves(params))]
    assert max(moved) > 1e-3  # the update did something


def test_a_checked_prompt_skips_the_data_check_with_the_same_scores():
    """prompts_equal=True scores the shared way and False the ordinary way, each without
    the on-data check: the same numbers as the checked call on a batch of either kind."""
    policy, params = _policy()
    score = jax.jit(lambda p, t, **kw: policy.score(p, t, group_size=GROUP,
                                                    prompt_len=PROMPT, **kw),
                    static_argnames=("prompts_equal",))
    grouped, differing = _grouped_tokens(), _grouped_tokens().at[3, PROMPT - 1].add(1)
    for tokens, told in ((grouped, True), (differing, False)):
        checked, known = score(params, tokens), score(params, tokens, prompts_equal=told)
        np.testing.assert_allclose(known.logp, checked.logp, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(known.values, checked.values, rtol=1e-6, atol=1e-6)
    # Told wrong, the shared way reads the first row's prompt for the whole group.
    wrong = score(params, differing, prompts_equal=True)
    assert np.max(np.abs(wrong.logp[3] - score(params, differing).logp[3])) > 1e-4
    with pytest.raises(ValueError, match="prompts_equal"):
        policy.score(params, grouped, group_size=GROUP, prompt_len=PROMPT, prompts_equal=1)


def test_the_update_scores_groups_with_differing_prompts_whole():
    """The Learner checks each minibatch's prompts around its gradient: a batch whose last
    group's rows differ in the prompt gets the update of reading every row whole."""
    policy, params = _policy()
    batch = _update_batch(_grouped_tokens().at[3, PROMPT - 1].add(1))

    def learner(prompt_len):
        return Learner(policy, optax.sgd(0.1), loss_config(kl_coef=0.0, echo_coef=0.0,
                                                            sft_coef=0.0),
                       epochs=1, minibatches=1, mesh=sharding_lib.make_mesh((1, 1, 1)),
                       context_length=S, group_size=GROUP, prompt_len=prompt_len)

    _assert_same_update(learner(PROMPT), learner(0), params, batch, seed=16)
