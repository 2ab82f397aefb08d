"""An outcome reward model from a checkpoint, scoring each finished episode in the step.

    rm = OutcomeRewardModel.from_config(config, env)   # None without reward_model.hf_checkpoint
    params = rm.load(mesh)                             # frozen; TrainState.reward_model_params
    traj, metrics = rm(params, traj, env_weight)       # traced, inside train_step

The model is a sequence classifier read by `arl.models.hf_sequence_classifier` (a
Qwen2/Llama `...ForSequenceClassification` directory with num_labels=1). It reads text
in its own tokenizer and chat template, not the policy's, so the episode crosses to
the host once per step (one ordered `io_callback`): each row is decoded to its
conversation (`arl.rewards.functions.episodes`: the prompt's messages, then the
agent's turns as "assistant" and the env's replies as "user"), rendered with the
model's chat template (no generation prompt) and tokenized, kept to its last
`reward_model.max_length` tokens (the beginning is cut: a reward model judges the
answer) and right-padded with the model's pad id into int32 [B, max_length]. The
model's forward pass then runs in the compiled step on the parameters held in the
train state (placed with the policy's logical-axis shardings, never updated):

    reward(episode) = env_weight * (the env's turn rewards) + reward_model.weight * score

added on the last agent token of the episode's last turn, as the Python reward
functions' outcome is (`arl.trainers.python_rewards.add_outcome`). Logged:
`reward/reward_model/mean` and `std` (of the scores of the episodes that played a
turn) and `reward/reward_model/truncated` (rows cut to max_length this step; the first
cut also warns once).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.experimental import io_callback

from arl import sharding as sharding_lib
from arl.rewards.functions import episodes
from arl.errors import ConfigError, one_line
from arl.models import hf_sequence_classifier as classifier_lib
from arl.models import transformer as transformer_lib
from arl.rollout.trajectory import Trajectory
from arl.trainers.python_rewards import add_outcome


class OutcomeRewardModel:
    """A frozen sequence-classification reward model as a traceable transform of a
    trajectory (module docstring)."""

    def __init__(self, env, directory: str, spec: classifier_lib.ClassifierSpec, codec,
                 *, weight: float = 1.0, max_length: int = 1024):
        self.env = env
        self.directory = directory
        self.spec = spec
        self.codec = codec  # the reward model's tokenizer and chat template
        self.weight = float(weight)
        self.max_length = int(max_length)
        self.warned_truncation = False

    @classmethod
    def from_config(cls, config, env) -> "OutcomeRewardModel | None":
        r = config.reward_model
        if not r.hf_checkpoint:
            return None
        from arl.text.hf_codec import HFCodec  # pylint: disable=g-import-not-at-top
        try:
            spec = classifier_lib.read_classifier_config(
                r.hf_checkpoint, dtype=jnp.dtype(r.dtype), max_len=r.max_length)
            codec = HFCodec.from_pretrained(r.hf_checkpoint)
        except (ValueError, OSError) as error:
            raise ConfigError(f"config.reward_model.hf_checkpoint={r.hf_checkpoint!r} is "
                              f"invalid: {one_line(error)}") from error
        if getattr(codec, "chat_template", None) is None:
            raise ConfigError(f"config.reward_model.hf_checkpoint={r.hf_checkpoint!r} is "
                              "invalid: its tokenizer has no chat template to render the "
                              "episodes with")
        return cls(env, r.hf_checkpoint, spec, codec, weight=r.weight,
                   max_length=r.max_length)

    # ------------------------------------------------------------------ parameters
    @functools.cached_property
    def _boxed(self):
        return transformer_lib.abstract_params(transformer_lib.Transformer(self.spec.config))

    def abstract_params(self) -> dict:
        """Shapes and dtypes of `load`'s parameters."""
        return {"decoder": nn.unbox(self._boxed),
                "score": jax.ShapeDtypeStruct((self.spec.config.d_model,), jnp.float32)}

    def param_shardings(self, mesh) -> dict:
        """The decoder's with the policy's logical-axis rules; the score head replicated."""
        return {"decoder": transformer_lib.param_shardings(self._boxed, mesh),
                "score": sharding_lib.replicated(mesh)}

    def load(self, mesh=None) -> dict:
        """The checkpoint's parameters, placed on `mesh` (`param_shardings`)."""
        try:
            return classifier_lib.load_sequence_classifier(self.directory, self.spec, mesh)
        except (ValueError, KeyError, OSError) as error:
            raise ConfigError(f"config.reward_model.hf_checkpoint={self.directory!r} is "
                              f"invalid: {one_line(error)}") from error

    # ------------------------------------------------------------------ host side
    def token_ids(self, conversation: list[dict]) -> list[int]:
        """The reward model's ids of one conversation (its chat template, no generation
        prompt), before truncation."""
        return self.codec.chat_ids(conversation, add_generation_prompt=False)

    def host_tokens(self, tokens, agent_mask, length, task_rows):
        """(int32 [B, max_length] right-padded ids, int32 [] rows truncated) on the host."""
        rows = None if task_rows.shape[0] == 0 else task_rows
        batch = episodes(self.env, tokens, agent_mask, length, rows)
        out = np.full((len(batch), self.max_length), self.spec.pad_token_id, np.int32)
        truncated = 0
        for b, conversation in enumerate(batch.messages):
            ids = self.token_ids(conversation)
            if len(ids) > self.max_length:
                truncated += 1
                ids = ids[len(ids) - self.max_length:]
            out[b, :len(ids)] = ids
        if truncated and not self.warned_truncation:
            self.warned_truncation = True
            warnings.warn(f"reward_model: {truncated} of {len(batch)} conversations are "
                          f"longer than reward_model.max_length={self.max_length} tokens "
                          "and lose their beginning (counted in "
                          "reward/reward_model/truncated)", stacklevel=2)
        return out, np.asarray(truncated, np.int32)

    def model_tokens(self, traj: Trajectory):
        """(ids int32 [B, max_length], truncated int32 []) of `traj`'s rows (traced)."""
        batch = traj.tokens.shape[0]
        rows = traj.task_rows if traj.task_rows is not None else jnp.zeros((0,), jnp.int32)
        shapes = (jax.ShapeDtypeStruct((batch, self.max_length), jnp.int32),
                  jax.ShapeDtypeStruct((), jnp.int32))
        return io_callback(self.host_tokens, shapes, traj.tokens, traj.agent_mask,
                           traj.length, rows, ordered=True)

    # ------------------------------------------------------------------ traced
    def scores(self, params, traj: Trajectory) -> tuple[jax.Array, jax.Array]:
        """(scores f32 [B], rows truncated int32 []) of `traj`'s episodes."""
        ids, truncated = self.model_tokens(traj)
        params = jax.lax.stop_gradient(params)
        return classifier_lib.sequence_scores(self.spec, params, ids), truncated

    def __call__(self, params, traj: Trajectory, env_weight: float = 1.0
                 ) -> tuple[Trajectory, dict[str, jax.Array]]:
        scores, truncated = self.scores(params, traj)
        played = jnp.any(traj.turn_end_mask > 0, axis=1)
        count = jnp.maximum(jnp.sum(played), 1)
        mean = jnp.sum(jnp.where(played, scores, 0.0)) / count
        var = jnp.sum(jnp.where(played, (scores - mean) ** 2, 0.0)) / count
        metrics = {"reward/reward_model/mean": mean,
                   "reward/reward_model/std": jnp.sqrt(var),
                   "reward/reward_model/truncated": truncated.astype(jnp.float32)}
        return add_outcome(traj, self.weight * scores, env_weight), metrics
