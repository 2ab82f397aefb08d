"""Qwen3 (per-head q/k RMSNorm, explicit head_dim) and Llama 3.1 (rope_type "llama3"
frequency scaling) against transformers (CPU torch, test-only): logits of a plain batch
past the original context, logits of left-padded rows, and KV-cached greedy generation
from left-padded prompts; the import refuses what it does not implement in one line, and
export(import(x)) loads back in transformers with the same logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl.models import Transformer, generate, init_cache
from arl.models import hf_import
from arl.models.rope import Llama3RopeScaling, scaled_inverse_frequencies
from tests.models.helpers import hf_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 96
PAD = 0
NEW_TOKENS = 5
MASK = np.array([[1] * 9, [0, 0, 0] + [1] * 6, [0] * 7 + [1] * 2], np.int64)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128, rope_theta=1e4, tie_word_embeddings=False,
        pad_token_id=PAD))


def _llama31():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=1e4, rope_scaling=dict(LLAMA3_SCALING), tie_word_embeddings=False,
        pad_token_id=PAD))


BUILDERS = {"qwen3": _qwen3, "llama3.1": _llama31}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request, tmp_path_factory):
    """(name, hf model, directory, config, params) of a random model saved and imported."""
    model = BUILDERS[request.param]().eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0)
                    + 0.3 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    config, params = hf_import.load_hf_checkpoint(str(path))
    return request.param, model, str(path), config, params


def test_import_reads_the_family(family):
    name, _, _, config, params = family
    if name == "qwen3":
        assert config.qk_norm and config.resolved_head_dim == 16 and config.rope_scaling is None
        assert params["layers"]["self_attn"]["q_norm"]["scale"].shape == (2, 16)
    else:
        assert not config.qk_norm
        assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 16)


def test_logits_past_the_original_context_match_transformers(family):
    _, hf_model, _, config, params = family
    tokens = np.random.default_rng(0).integers(1, VOCAB, (2, 40))
    with torch.no_grad():
        ref = hf_model(torch.as_tensor(tokens)).logits.numpy()
    got = Transformer(config).apply({"params": params}, jnp.asarray(tokens, jnp.int32)).logits
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4, rtol=1e-4)


def _padded_tokens():
    rng = np.random.default_rng(4)
    return np.where(MASK == 1, rng.integers(1, VOCAB, MASK.shape), PAD)


def test_left_padded_logits_match_transformers(family):
    _, hf_model, _, config, params = family
    tokens = _padded_tokens()
    hf_positions = np.where(MASK == 1, np.cumsum(MASK, 1) - 1, 1)
    with torch.no_grad():
        ref = hf_model(torch.as_tensor(tokens), attention_mask=torch.as_tensor(MASK),
                       position_ids=torch.as_tensor(hf_positions)).logits.numpy()
    got = Transformer(config).apply({"params": params}, jnp.asarray(tokens, jnp.int32),
                                    attention_mask=jnp.asarray(MASK, jnp.int32)).logits
    real = MASK == 1
    np.testing.assert_allclose(np.asarray(got)[real], ref[real], atol=1e-4, rtol=1e-4)


def test_cached_greedy_generation_from_left_padded_prompts_matches_transformers(family):
    _, hf_model, _, config, params = family
    tokens = _padded_tokens()
    hf_tokens, hf_logp = hf_greedy(hf_model, tokens, MASK, NEW_TOKENS, PAD)
    model = Transformer(config)
    cache = init_cache(config, tokens.shape[0], 16)
    out = model.apply({"params": params}, jnp.asarray(tokens, jnp.int32), cache,
                      attention_mask=jnp.asarray(MASK, jnp.int32), method="decode")
    gen = generate(model, params, out.cache, out.logits[:, -1], jax.random.key(0),
                   max_new_tokens=NEW_TOKENS, eot_id=-1, pad_id=PAD, greedy=True)
    np.testing.assert_array_equal(gen.tokens, hf_tokens)
    np.testing.assert_allclose(gen.logp, hf_logp, atol=1e-4)


def test_export_round_trip_loads_in_transformers(family, tmp_path):
    name, hf_model, _, config, params = family
    model_type = "qwen3" if name == "qwen3" else "llama"
    hf_import.save_hf_checkpoint(str(tmp_path), params, config, model_type=model_type)
    reloaded = type(hf_model).from_pretrained(str(tmp_path)).eval()
    tokens = torch.as_tensor(np.random.default_rng(1).integers(1, VOCAB, (1, 24)))
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(tokens).logits.numpy(),
                                   hf_model(tokens).logits.numpy(), atol=1e-5)
    assert hf_import.load_hf_config(str(tmp_path)) == config


def test_scaled_frequencies_hand_computed():
    # head_dim 8, theta 1e4: f = 1, 0.1, 0.01, 0.001; wavelengths 6.3, 63, 628, 6283.
    # Original context 16, low 1, high 4: 6.3 is medium (4 <= w <= 16), blended with
    # a = (16 / 6.28 - 1) / 3; the others are slowed by the factor 8.
    got = scaled_inverse_frequencies(8, 1e4, Llama3RopeScaling(8.0, 1.0, 4.0, 16))
    a = (16 / (2 * np.pi) - 1) / 3
    np.testing.assert_allclose(got, [(1 - a) / 8 + a, 0.1 / 8, 0.01 / 8, 0.001 / 8],
                               rtol=1e-6)


@pytest.mark.parametrize("fields, match", [
    ({"model_type": "qwen3_moe"}, r"model_type='qwen3_moe' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling.rope_type='yarn' is not supported \(allowed: 'default', 'llama3'\)"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     r"rope_scaling of rope_type 'llama3' lacks \['low_freq_factor'"),
    ({"rope_scaling": dict(LLAMA3_SCALING, beta_fast=32)},
     r"rope_scaling.beta_fast=32 is not supported"),
])
def test_unsupported_fields_are_refused_in_one_line(fields, match):
    base = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16}
    with pytest.raises(ValueError, match=match) as error:
        hf_import.config_from_hf({**base, **fields})
    assert "\n" not in str(error.value)
