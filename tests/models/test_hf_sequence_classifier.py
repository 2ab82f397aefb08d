"""Outcome reward models from sequence-classification checkpoints against transformers
(CPU torch, test-only): the same scores on the same token ids (right-padded rows, a row
ending in the pad id, a row of pad ids only), sharded == unsharded, and one-line refusals
of what is not a single-score classifier."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from arl.models import hf_sequence_classifier as hsc
from arl.sharding import make_mesh

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module",
                params=["qwen2", pytest.param("llama3", marks=pytest.mark.slow)])
def standin(request, tmp_path_factory):
    from tests.hf_standins import build_reward_model_standin
    return build_reward_model_standin(str(tmp_path_factory.mktemp(request.param)),
                                      request.param)


def _token_rows(pad, vocab, rng):
    """Right-padded rows: full, short, ending in the pad id itself, all pad."""
    rows = rng.integers(0, vocab, size=(4, 12)).astype(np.int32)
    rows[rows == pad] = (pad + 1) % vocab
    rows[1, 7:] = pad
    rows[2, 5] = pad  # transformers reads before the pad run only: position 4
    rows[2, 6:] = pad
    rows[3, :] = pad
    return rows


def _transformers_scores(directory, rows):
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        directory, dtype=torch.float32).eval()
    with torch.no_grad():
        # no attention mask: what transformers scores is the tokens up to the pooled one,
        # unaffected by the right padding under causal attention
        return model(torch.tensor(rows, dtype=torch.long)).logits[:, 0].numpy()


def test_scores_equal_transformers(standin):
    spec = hsc.read_classifier_config(standin)
    params = hsc.load_sequence_classifier(standin, spec)
    rows = _token_rows(spec.pad_token_id, spec.config.vocab_size, np.random.default_rng(0))
    ours = np.asarray(jax.jit(lambda p, t: hsc.sequence_scores(spec, p, t))(params, rows))
    want = _transformers_scores(standin, rows)
    assert ours.dtype == np.float32 and ours.shape == (4,)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)
    assert np.all(np.abs(np.diff(ours)) > 1e-4)  # the rows' scores differ
    np.testing.assert_array_equal(hsc.scored_positions(rows, spec.pad_token_id),
                                  [11, 6, 4, 0])


def test_sharded_equals_unsharded(standin):
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs several devices")
    spec = hsc.read_classifier_config(standin)
    mesh = make_mesh((1, 1, 2))  # the decoder's heads and MLP split over "tensor"
    sharded = hsc.load_sequence_classifier(standin, spec, mesh)
    plain = hsc.load_sequence_classifier(standin, spec)
    rows = _token_rows(spec.pad_token_id, spec.config.vocab_size, np.random.default_rng(1))
    score = jax.jit(lambda p, t: hsc.sequence_scores(spec, p, t))
    np.testing.assert_allclose(score(sharded, rows), score(plain, rows), rtol=1e-5, atol=1e-6)


def _edited(standin, tmp_path, **fields):
    directory = str(tmp_path / "edited")
    shutil.copytree(standin, directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        hf = json.load(f)
    for key, value in fields.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    with open(path, "w") as f:
        json.dump(hf, f)
    return directory


@pytest.mark.parametrize("fields, message", [
    (dict(architectures=["Qwen2ForCausalLM"]), "is not a sequence classifier"),
    (dict(id2label={"0": "a", "1": "b"}), "num_labels=2"),
    (dict(pad_token_id=None), "pad_token_id is not set"),
])
def test_refuses_what_is_not_a_reward_model(standin, tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        hsc.read_classifier_config(_edited(standin, tmp_path, **fields))
    with pytest.raises(ValueError, match="is not a directory"):
        hsc.read_classifier_config(str(tmp_path / "missing"))


def test_bfloat16_scores_stay_near_float32(standin):
    import jax.numpy as jnp
    full = hsc.read_classifier_config(standin)
    half = hsc.read_classifier_config(standin, dtype=jnp.bfloat16)
    rows = _token_rows(full.pad_token_id, full.config.vocab_size, np.random.default_rng(2))
    want = hsc.sequence_scores(full, hsc.load_sequence_classifier(standin, full), rows)
    params = hsc.load_sequence_classifier(standin, half)
    assert params["decoder"]["embed_tokens"]["embedding"].dtype == jnp.bfloat16
    got = jax.jit(lambda p, t: hsc.sequence_scores(half, p, t))(params, rows)
    assert got.dtype == jnp.float32
    # bfloat16 keeps 8 bits of mantissa: a few percent of the scores' spread
    np.testing.assert_allclose(got, want, atol=0.05 * float(np.ptp(want)) + 1e-3)
