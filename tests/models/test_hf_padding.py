"""Left-padded batches against transformers (CPU torch, test-only): logits at the real
positions with the same attention mask, and greedy generation from left-padded prompts
equal to `generate` with that mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl.models import Transformer, generate, init_cache
from arl.models.hf_import import load_hf_checkpoint
from tests.models.helpers import hf_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 96
PAD = 0
NEW_TOKENS = 5
# Left padding as a Hugging Face tokenizer with padding_side="left" produces it.
MASK = np.array([[1, 1, 1, 1, 1, 1, 1],
                 [0, 0, 0, 1, 1, 1, 1],
                 [0, 0, 0, 0, 0, 1, 1]], np.int64)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A random Qwen2 (q/k/v biases, GQA) saved and imported: (hf model, config, params)."""
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=1e4, tie_word_embeddings=False, pad_token_id=PAD)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0)
                    + 0.3 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path, safe_serialization=True)
    config, params = load_hf_checkpoint(str(path))
    return model, config, params


def _tokens():
    rng = np.random.default_rng(4)
    return np.where(MASK == 1, rng.integers(1, VOCAB, MASK.shape), PAD)


def test_left_padded_logits_match_transformers(qwen2):
    hf_model, config, params = qwen2
    tokens = _tokens()
    # Hugging Face's own positions for left padding (what `generate` passes).
    hf_positions = np.where(MASK == 1, np.cumsum(MASK, 1) - 1, 1)
    with torch.no_grad():
        ref = hf_model(torch.as_tensor(tokens), attention_mask=torch.as_tensor(MASK),
                       position_ids=torch.as_tensor(hf_positions)).logits.numpy()
    model = Transformer(config)
    forward = jax.jit(lambda p, t, m: model.apply({"params": p}, t, attention_mask=m).logits)
    got = np.asarray(forward(params, tokens.astype(np.int32), MASK.astype(np.int32)))
    real = MASK == 1
    np.testing.assert_allclose(got[real], ref[real], atol=1e-4, rtol=1e-4)
    # Explicit positions: the same numbers as transformers given the same position_ids.
    with_positions = jax.jit(lambda p, t, m, pos: model.apply(
        {"params": p}, t, attention_mask=m, positions=pos).logits)
    got = np.asarray(with_positions(params, tokens.astype(np.int32), MASK.astype(np.int32),
                                    hf_positions.astype(np.int32)))
    np.testing.assert_allclose(got[real], ref[real], atol=1e-4, rtol=1e-4)


def test_greedy_generation_from_left_padded_prompts_matches_transformers(qwen2):
    hf_model, config, params = qwen2
    tokens = _tokens()
    hf_tokens, hf_logp = hf_greedy(hf_model, tokens, MASK, NEW_TOKENS, PAD)

    model = Transformer(config)

    @jax.jit
    def run(params, tokens, mask):
        cache = init_cache(config, tokens.shape[0], 16)
        out = model.apply({"params": params}, tokens, cache, attention_mask=mask, method="decode")
        return generate(model, params, out.cache, out.logits[:, -1], jax.random.key(0),
                        max_new_tokens=NEW_TOKENS, eot_id=-1, pad_id=PAD, greedy=True)

    gen = run(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(MASK, jnp.int32))
    np.testing.assert_array_equal(gen.tokens, hf_tokens)
    np.testing.assert_allclose(gen.logp, hf_logp, atol=1e-4)
    np.testing.assert_array_equal(gen.cache.length, MASK.sum(1) + NEW_TOKENS)
