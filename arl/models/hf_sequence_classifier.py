"""Outcome reward models from Hugging Face sequence-classification checkpoints.

    spec = read_classifier_config(directory)                   # checks, reads no tensor
    params = load_sequence_classifier(directory, spec, mesh)   # {"decoder", "score"}
    scores = sequence_scores(spec, params, tokens)             # f32 [B], traceable

A `Qwen2ForSequenceClassification` / `LlamaForSequenceClassification` directory holds
the decoder (`model.*`, imported by `arl.models.hf_import` as the policy's is) and a
linear head without bias, `score.weight` [num_labels, hidden], and no `lm_head`. Its
score of token ids x_0..x_{T-1}, as transformers computes it:

    h = final_norm(decoder(x))                                [T, hidden]
    t* = max{ t : x_t != pad_token_id }   (0 when every token is the pad id)
    score = h[t*] . score.weight[0]

i.e. the head read at the last token that is not the pad id (rows are padded on the
right with `pad_token_id`, which causal attention keeps from changing h[t*]). Only
single-score models (num_labels = 1), the outcome reward models of RLHF, are accepted.
"""

from __future__ import annotations

import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np

from arl.models.hf_config import config_from_hf
from arl.models.hf_import import CONFIG_NAME, _TensorReader, load_hf_checkpoint
from arl.models.transformer import Transformer, TransformerConfig

SEQUENCE_CLASSIFIERS = ("Qwen2ForSequenceClassification", "LlamaForSequenceClassification")
SCORE_TENSOR = "score.weight"


@dataclasses.dataclass(frozen=True)
class ClassifierSpec:
    """What a sequence-classification directory's config.json says: the decoder's
    config (no LM head: logits are never computed) and the pad id the score is read
    before."""

    config: TransformerConfig
    pad_token_id: int
    architecture: str


def read_classifier_config(directory: str, *, dtype=jnp.float32,
                           max_len: int | None = None) -> ClassifierSpec:
    """The `ClassifierSpec` of `directory`; ValueError (one line naming the file and
    field) for a missing directory or config.json, an architecture other than
    `SEQUENCE_CLASSIFIERS`, num_labels != 1 or no pad_token_id."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory!r} is not a directory")
    path = os.path.join(directory, CONFIG_NAME)
    if not os.path.exists(path):
        raise ValueError(f"{directory!r} has no {CONFIG_NAME}")
    with open(path, encoding="utf-8") as f:
        hf = json.load(f)
    architectures = hf.get("architectures") or []
    known = [a for a in architectures if a in SEQUENCE_CLASSIFIERS]
    if not known:
        raise ValueError(f"{path}: architectures={architectures!r} is not a sequence "
                         f"classifier (allowed: {SEQUENCE_CLASSIFIERS})")
    num_labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
    if num_labels != 1:
        raise ValueError(f"{path}: num_labels={num_labels} (id2label has "
                         f"{len(hf.get('id2label') or {})} labels); an outcome reward "
                         "model has exactly one (num_labels=1)")
    pad = hf.get("pad_token_id")
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    if pad is None:
        raise ValueError(f"{path}: pad_token_id is not set; the score is read at the last "
                         "token before the padding, so the checkpoint must name its pad id")
    # No lm_head in a classifier: a tied config declares none, and logits are never asked.
    config = config_from_hf(hf, dtype=dtype, max_len=max_len, tie_embeddings=True)
    return ClassifierSpec(config=config, pad_token_id=int(pad), architecture=known[0])


def load_sequence_classifier(directory: str, spec: ClassifierSpec, mesh=None) -> dict:
    """{"decoder": the decoder's params (placed on `mesh` with the policy's logical-axis
    rules, as `hf_import.load_hf_checkpoint`), "score": f32 [hidden]} of `directory`.
    Strict like `load_hf_checkpoint`: every other tensor must be the decoder's."""
    reader = _TensorReader(directory)
    if SCORE_TENSOR not in reader.names():
        raise ValueError(f"{directory!r} has no {SCORE_TENSOR!r} tensor (the classifier "
                         "head)")
    expected = (1, spec.config.d_model)
    if reader.shape(SCORE_TENSOR) != expected:
        raise ValueError(f"tensor {SCORE_TENSOR!r} has shape {reader.shape(SCORE_TENSOR)}, "
                         f"expected {expected} (num_labels=1, hidden_size)")
    _, decoder = load_hf_checkpoint(directory, config=spec.config, mesh=mesh,
                                    head_tensors=(SCORE_TENSOR,))
    score = np.asarray(reader.get(SCORE_TENSOR), np.float32)[0]
    if mesh is not None:
        score = jax.device_put(score, jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec()))
    return {"decoder": decoder, "score": jnp.asarray(score)}


def scored_positions(tokens: jax.Array, pad_token_id: int) -> jax.Array:
    """int32 [B]: each row's last position whose token is not `pad_token_id` (0 for a
    row of pad ids only), transformers' pooling index."""
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    return jnp.argmax(positions[None, :] * (tokens != pad_token_id), axis=1).astype(jnp.int32)


def sequence_scores(spec: ClassifierSpec, params: dict, tokens: jax.Array) -> jax.Array:
    """float32 [B]: the classifier's score of each row of `tokens` int32 [B, T] (module
    docstring), right-padded with `spec.pad_token_id`."""
    chex.assert_rank(tokens, 2)
    chex.assert_type(tokens, jnp.int32)
    out = Transformer(spec.config).apply({"params": params["decoder"]}, tokens,
                                         compute_logits=False, return_hidden=True)
    last = scored_positions(tokens, spec.pad_token_id)
    hidden = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]
    return jnp.einsum("bd,d->b", hidden.astype(jnp.float32),
                      params["score"].astype(jnp.float32))
