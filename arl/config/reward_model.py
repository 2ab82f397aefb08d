"""`config.reward_model`: an outcome reward model loaded from a sequence-classification
checkpoint, scoring each finished episode inside the compiled step
(`arl.trainers.reward_model`; docs/bring_your_task.md)."""

from __future__ import annotations

from arl.config.checks import check_range, fail
from arl.config.model import FLOAT_DTYPES

import ml_collections


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # A Qwen2ForSequenceClassification / LlamaForSequenceClassification directory
    # (num_labels=1, its own tokenizer and chat template); "": no reward model. Each
    # episode's conversation is rendered with its template and tokenized with its
    # tokenizer on the host; the frozen model scores it in the step, sharded like the
    # policy, and weight * score is added to the episode's outcome.
    c.hf_checkpoint = ""
    c.weight = 1.0
    # Tokens of the rendered conversation the model reads: a longer one loses its
    # beginning (counted: reward/reward_model/truncated).
    c.max_length = 1024
    c.dtype = "float32"  # its parameters and activations, "float32" or "bfloat16"
    return c


def validate(config) -> None:
    r = config.reward_model
    if not isinstance(r.hf_checkpoint, str):
        fail("reward_model.hf_checkpoint", r.hf_checkpoint,
             "expected a directory path, or '' for none")
    check_range(config, "reward_model.weight")
    check_range(config, "reward_model.max_length", 1, integer=True)
    if r.dtype not in FLOAT_DTYPES:
        fail("reward_model.dtype", r.dtype, f"allowed values are {FLOAT_DTYPES}")
    if r.hf_checkpoint:
        from arl.models.hf_sequence_classifier import read_classifier_config
        try:
            read_classifier_config(r.hf_checkpoint)
        except (ValueError, OSError) as error:
            fail("reward_model.hf_checkpoint", r.hf_checkpoint, str(error))
