"""LoRA adapters as a parameter transform: exact identity at init, the merge formula,
gradients only on the adapters, training moves the policy while the reference (the
base itself) stays put."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arl.algorithms import token_logprobs
from arl.models import TransformerConfig
from arl.models.lora import LoraConfig, init_lora, merge_lora, num_lora_params
from tests.models.helpers import make

CONFIG = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4,
                           num_kv_heads=2, mlp_dim=64, max_len=32)
LORA_ALL = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"))
TOKENS = jax.random.randint(jax.random.key(9), (2, 12), 0, 64)


def test_zero_init_is_the_base_and_merge_formula():
    _, _, base = make(CONFIG)
    adapters = init_lora(jax.random.key(0), base, LORA_ALL)
    merge = jax.jit(lambda b, a: merge_lora(b, a, LORA_ALL))
    merged = merge(base, adapters)
    jax.tree.map(np.testing.assert_array_equal, merged, base)
    # Counts: r * (d_in + d_out) per layer per target.
    d, h, kv, dh, f = 32, 4, 2, 8, 64
    per_layer = 4 * ((d + h * dh) + 2 * (d + kv * dh) + (h * dh + d) + 2 * (d + f) + (f + d))
    assert num_lora_params(adapters) == per_layer

    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32),
                            adapters)
    merged = merge(base, adapters)
    a, b = np.asarray(adapters["o_proj"]["a"]), np.asarray(adapters["o_proj"]["b"])
    w = np.asarray(base["layers"]["self_attn"]["o_proj"]["kernel"])  # [L, H, Dh, D]
    expected = w + 2.0 * np.einsum("lir,lro->lio", a, b).reshape(w.shape)
    np.testing.assert_allclose(merged["layers"]["self_attn"]["o_proj"]["kernel"], expected,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(merged["layers"]["mlp"]["up_proj"]["kernel"] -
                                  base["layers"]["mlp"]["up_proj"]["kernel"] != 0, True)
    np.testing.assert_array_equal(merged["embed_tokens"]["embedding"],
                                  base["embed_tokens"]["embedding"])


def test_training_adapters_moves_policy_not_reference():
    model, _, base = make(CONFIG)
    lora = LoraConfig(rank=2, alpha=4.0)  # q_proj, v_proj
    adapters = init_lora(jax.random.key(1), base, lora)
    optimizer = optax.adam(5e-2)

    def nll(adapters):
        logits = model.apply({"params": merge_lora(base, adapters, lora)}, TOKENS).logits
        return -jnp.mean(token_logprobs(logits[:, :-1], TOKENS[:, 1:]))

    @jax.jit
    def train(adapters):
        def body(carry, _):
            adapters, opt_state = carry
            loss, grads = jax.value_and_grad(nll)(adapters)
            updates, opt_state = optimizer.update(grads, opt_state, adapters)
            return (optax.apply_updates(adapters, updates), opt_state), loss
        (adapters, _), losses = jax.lax.scan(body, (adapters, optimizer.init(adapters)),
                                             None, length=20)
        return adapters, losses

    grads = jax.jit(jax.grad(nll))(adapters)
    # At init B = 0, so dL/dA = 0 and all signal goes to B (LoRA paper, section 4.1).
    np.testing.assert_array_equal(grads["q_proj"]["a"], 0.0)
    assert float(jnp.abs(grads["q_proj"]["b"]).max()) > 0
    assert set(grads) == {"q_proj", "v_proj"}

    base_before = jax.tree.map(np.array, base)
    trained, losses = train(adapters)
    assert float(losses[-1]) < float(losses[0]) - 0.2
    jax.tree.map(np.testing.assert_array_equal, base, base_before)
    # The reference policy is the base: unchanged logits; the policy moved away from it.
    forward = jax.jit(lambda p: model.apply({"params": p}, TOKENS).logits)
    ref_logits = forward(base)
    policy_logits = forward(merge_lora(base, trained, lora))
    assert float(jnp.abs(policy_logits - ref_logits).max()) > 0.1


def test_bfloat16_base_float32_adapters():
    config = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4,
                               mlp_dim=64, max_len=32, dtype=jnp.bfloat16,
                               param_dtype=jnp.bfloat16)
    model, _, base = make(config)
    lora = LoraConfig(rank=2)
    adapters = init_lora(jax.random.key(2), base, lora)
    assert adapters["v_proj"]["a"].dtype == jnp.float32
    merged = merge_lora(base, adapters, lora)
    assert merged["layers"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    grads = jax.jit(jax.grad(lambda ad: jnp.sum(model.apply(
        {"params": merge_lora(base, ad, lora)}, TOKENS).logits)))(adapters)
    assert grads["v_proj"]["b"].dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(grads["v_proj"]["b"])))


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "rank"), (dict(alpha=0.0), "alpha"), (dict(targets=("w_proj",)), "targets"),
    (dict(targets=()), "targets"), (dict(targets=("q_proj", "q_proj")), "targets"),
])
def test_config_rejections(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoraConfig(**kwargs)


def test_merge_rejects_mismatched_adapters():
    _, _, base = make(CONFIG)
    adapters = init_lora(jax.random.key(0), base, LoraConfig(rank=2))
    with pytest.raises(ValueError, match="targets"):
        merge_lora(base, adapters, LoraConfig(rank=2, targets=("q_proj",)))
    with pytest.raises(ValueError, match="q_proj"):
        merge_lora(base, adapters, LoraConfig(rank=3))
    with pytest.raises(ValueError, match="Transformer"):
        init_lora(jax.random.key(0), {"layers": {}}, LoraConfig())
