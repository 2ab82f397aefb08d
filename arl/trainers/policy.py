"""The policy: a decoder built from the config (fresh or from a Hugging Face checkpoint),
optional LoRA adapters over a frozen base, and the scoring forward pass.

    policy = Policy.from_config(config, vocab_size=env.codec.vocab_size,
                                context_length=rollout.context_length(env))
    scores = policy.score(params, tokens)   # log-probs, entropies, values per token

`score` is what every loss reads: the RL update, the SFT warm start, the KL reference,
PRIME's implicit PRM. A value at index t belongs to token t (log pi(token_t | tokens_<t)),
the layout of `arl.rollout.Trajectory`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from flax import struct

from arl import algorithms as alg
from arl.errors import ConfigError, one_line
from arl.models import lora as lora_lib
from arl.models import transformer as transformer_lib
from arl.models.chunked_logprobs import chunked_token_logprobs


@struct.dataclass
class TokenScores:
    """Per-token outputs of the policy on a context, aligned to token index `[B, S]`."""

    logp: jax.Array  # float32: log pi(token_t | tokens_<t) (0 at t = 0 and unscored t)
    # float32: entropy of the distribution that produced token t (None when not asked for)
    entropy: jax.Array | None
    values: jax.Array | None = None  # float32: value of the state before token t


def same_prompts(tokens: jax.Array, group_size: int, prompt_len: int) -> jax.Array:
    """bool scalar: every row of each group of `group_size` consecutive rows of `tokens`
    [B, S] starts with the same `prompt_len` tokens."""
    prompts = tokens[:, :prompt_len].reshape(-1, group_size, prompt_len)
    return jnp.all(prompts == prompts[:, :1])


def shift_right(x):
    """Pads a [B, S-1] per-prediction array to [B, S] so index t belongs to token t."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)


def build_model(config: ml_collections.ConfigDict, *, vocab_size: int, context_length: int,
                value_head: bool) -> transformer_lib.Transformer:
    """The decoder of `config.model`: a fresh architecture from its fields, or that of
    `model.hf_checkpoint` (the weights are loaded by `load_pretrained`), with parameters
    in `model.param_dtype` and activations in `model.dtype`. `vocab_size` is the env
    codec's; a fresh model's `model.vocab_size` (0 = the codec's) may be larger.
    `model.layer_unroll` 0 = all layers; `model.remat` rematerialises each layer."""
    m = config.model
    param_dtype = jnp.dtype(m.param_dtype)
    if m.hf_checkpoint:
        from arl.models import hf_import  # pylint: disable=g-import-not-at-top
        with checkpoint_errors_as_config_errors(m.hf_checkpoint):
            model_config = hf_import.load_hf_config(
                m.hf_checkpoint, dtype=jnp.dtype(m.dtype), param_dtype=param_dtype,
                max_len=context_length, value_head=value_head)
        if model_config.vocab_size < vocab_size:
            raise ConfigError(
                f"config.model.hf_checkpoint={m.hf_checkpoint!r} has vocab_size "
                f"{model_config.vocab_size} < the env codec's {vocab_size}: "
                f"use the checkpoint's own tokenizer (leave env.kwargs.codec unset)")
        # Embedding rows past the tokenizer's (Qwen pads its vocabulary) are no tokens:
        # never sampled, never scored.
        model_config = dataclasses.replace(
            model_config,
            token_vocab_size=vocab_size if vocab_size < model_config.vocab_size else 0)
    else:
        model_vocab = m.vocab_size or vocab_size
        if model_vocab < vocab_size:
            raise ConfigError(
                f"config.model.vocab_size={m.vocab_size!r} is invalid: must be 0 (the env "
                f"codec's) or at least the env codec's vocab_size {vocab_size}.")
        model_config = transformer_lib.TransformerConfig(
            vocab_size=model_vocab,
            d_model=m.d_model,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            mlp_dim=m.mlp_dim,
            max_len=context_length,
            rope_theta=m.rope_theta,
            tie_embeddings=m.tie_embeddings,
            qkv_bias=m.qkv_bias,
            o_bias=m.o_bias,
            mlp_bias=m.mlp_bias,
            norm_eps=m.norm_eps,
            value_head=value_head,
            dtype=jnp.dtype(m.dtype),
            param_dtype=param_dtype,
        )
    return transformer_lib.Transformer(dataclasses.replace(
        model_config, layer_unroll=m.layer_unroll or model_config.num_layers,
        attention=m.attention, attention_block=m.attention_block, remat=m.remat))


@dataclasses.dataclass(frozen=True)
class Policy:
    """A decoder with its sampling temperature, optional LoRA and log-prob chunking.

    Full fine-tuning: the trainable parameters are the model's tree. LoRA (`lora` set):
    they are {"lora": adapters} (plus {"value_head": ...} for a critic), applied to a
    frozen `base` tree by `merge`."""

    model: transformer_lib.Transformer
    temperature: float = 1.0
    logprob_chunk: int = 0  # > 0: log-probs from hidden states, this many positions at a time
    lora: lora_lib.LoraConfig | None = None

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, *, vocab_size: int,
                    context_length: int, value_head: bool) -> "Policy":
        m = config.model
        lora = None
        if m.lora_rank > 0:
            lora = lora_lib.LoraConfig(rank=m.lora_rank, alpha=float(m.lora_alpha),
                                       targets=tuple(m.lora_targets))
        model = build_model(config, vocab_size=vocab_size, context_length=context_length,
                            value_head=value_head)
        return cls(model=model, temperature=config.rollout.temperature,
                   logprob_chunk=m.logprob_chunk, lora=lora)

    def init_params(self, key: jax.Array) -> Any:
        """Fresh parameters of the whole model (unboxed)."""
        dummy = jnp.zeros((1, self.model.config.max_len), jnp.int32)
        return nn.unbox(self.model.init(key, dummy)["params"])

    def init_adapters(self, key: jax.Array, base: Any) -> Any:
        """The trainable tree under LoRA: adapters with B = 0 (the policy starts as the
        base), plus the base's value head, which trains with them."""
        params = {"lora": lora_lib.init_lora(key, base, self.lora)}
        if "value_head" in base:
            params["value_head"] = base["value_head"]
        return params

    def merge(self, trainable: Any, base: Any = None) -> Any:
        """The policy's parameter tree: `trainable` itself, or under LoRA the base with
        the adapters merged in (and a trained value head)."""
        if self.lora is None:
            return trainable
        merged = lora_lib.merge_lora(base, trainable["lora"], self.lora)
        if "value_head" in trainable:
            merged = {**merged, "value_head": trainable["value_head"]}
        return merged

    def score(self, params: Any, tokens: jax.Array, *, scored: jax.Array | None = None,
              max_scored: int = 0, entropy: bool = True, group_size: int = 1,
              prompt_len: int = 0, projections: dict[str, jax.Array] | None = None,
              prompts_equal: bool | None = None,
              scored_within_bound: bool = False) -> TokenScores:
        """Per-token log-probs (at the sampling temperature), entropies and values of
        `tokens` [B, S] under the full parameter tree `params`.

        scored, max_scored: the positions the caller reads, float or bool [B, S] (e.g. a
          loss mask), and a static bound K >= scored[b].sum() of their number per row
          (e.g. a rollout's agent tokens: at most max_turns * action_len). With both, the
          vocabulary projection and the log-softmax run on the K gathered positions of each
          row only ([B, K, V] logits instead of [B, S, V]); logp and entropy are then 0 at
          every other position, and the numbers at the scored ones are those of the full
          computation up to float summation order. Should a row exceed K, the whole batch
          falls back to the full computation (same numbers, no saving). Position 0 has no
          prediction and is never scored. Values are always computed at every position.
        scored_within_bound: True when the caller knows no row exceeds K (e.g. the rows
          of a rollout, whose agent tokens never do): the fallback is then not traced,
          saving its program (under differentiation, its forward and backward pass).
          A row that did exceed K would be scored at its first K positions only.
        entropy: False skips the entropies (`TokenScores.entropy` is None) for callers that
          read only log-probs.
        group_size, prompt_len: the rows are consecutive groups of `group_size` rows whose
          first `prompt_len` tokens are meant to be equal (a GRPO group's shared prompt).
          The model then reads each group's prompt once and the rest of every row against
          a copy of that prompt's keys and values (`shares_prompt`), saving
          group_size - 1 of every group_size forward and backward passes over the
          prompt, with any attention implementation. Same numbers as without up to float
          summation order. Whether the prompts are equal is checked on the data: a batch
          where they are not is scored the ordinary way (same result).
        prompts_equal: None (default): that check, a `lax.cond` between the two ways;
          True / False: the caller has checked (`same_prompts`), and only that way is
          traced. Under differentiation a `lax.cond` carries the residuals of both
          branches (each filling the other's with zeros), so a caller taking gradients
          does better to branch around the whole gradient (`Learner.update` does).
        projections: the layers' projection outputs of `tokens` recorded at `params`
          ({name: [L, B, S, *features]}, e.g. `Trajectory.projections`), taken as the
          forward values of the projections (`Transformer(..., projections=)`): same
          numbers up to float summation order, without the forward pass's projection
          matmuls.
        """
        if scored is not None and max_scored:
            if not isinstance(max_scored, int) or isinstance(max_scored, bool) or max_scored < 0:
                raise ValueError(f"Policy.score: max_scored must be a non-negative int, got "
                                 f"{max_scored!r}")
            if scored.shape != tokens.shape:
                raise ValueError(f"Policy.score: scored must have the shape of tokens "
                                 f"{tokens.shape}, got {scored.shape}")
        select = scored is not None and 0 < max_scored < tokens.shape[1] - 1
        share = self.shares_prompt(tokens.shape, group_size, prompt_len)
        if prompts_equal is not None and not isinstance(prompts_equal, bool):
            raise ValueError(f"Policy.score: prompts_equal must be None, True or False, got "
                             f"{prompts_equal!r}")
        if not isinstance(scored_within_bound, bool):
            raise ValueError(f"Policy.score: scored_within_bound must be True or False, got "
                             f"{scored_within_bound!r}")
        if not select and not self.logprob_chunk and not share:
            return self._full_score(params, tokens, entropy, projections)
        if share and prompts_equal is None:
            hidden, values = jax.lax.cond(
                same_prompts(tokens, group_size, prompt_len),
                lambda: self._shared_prompt_forward(params, tokens, group_size, prompt_len,
                                                    projections),
                lambda: self._forward(params, tokens, projections))
        elif share and prompts_equal:
            hidden, values = self._shared_prompt_forward(params, tokens, group_size,
                                                         prompt_len, projections)
        else:
            hidden, values = self._forward(params, tokens, projections)
        hidden, targets = hidden[:, :-1], tokens[:, 1:]
        if select:
            wanted = scored[:, 1:] > 0
        if select and scored_within_bound:
            logp, ent = self._selected_stats(params, hidden, targets, wanted, max_scored)
        elif select:
            logp, ent = jax.lax.cond(
                jnp.max(jnp.sum(wanted, axis=1)) <= max_scored,
                lambda h: self._selected_stats(params, h, targets, wanted, max_scored),
                lambda h: tuple(jnp.where(wanted, x, 0.0) for x in self._token_stats(
                    params, h, targets)),
                hidden)
        else:
            logp, ent = self._token_stats(params, hidden, targets)
        values = None if values is None else shift_right(values[:, :-1])
        return TokenScores(logp=shift_right(logp), entropy=shift_right(ent) if entropy else None,
                           values=values)

    def shares_prompt(self, shape: tuple[int, ...], group_size: int, prompt_len: int) -> bool:
        """Whether `score` on tokens of `shape` [B, S] reads each group's prompt once:
        groups of `group_size` > 1 rows that divide B, and 0 < `prompt_len` < S."""
        for name, value in (("group_size", group_size), ("prompt_len", prompt_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Policy.score: {name} must be a non-negative int, got "
                                 f"{value!r}")
        batch, length = shape
        return group_size > 1 and batch % group_size == 0 and 0 < prompt_len < length

    def _forward(self, params, tokens, projections=None):
        """(final hidden states [B, S, D], values [B, S] or None) of the model on tokens."""
        out = self.model.apply({"params": params}, tokens, return_hidden=True,
                               compute_logits=False, projections=projections)
        return out.hidden, out.values

    def _shared_prompt_forward(self, params, tokens, group_size: int, prompt_len: int,
                               projections=None):
        """`_forward` reading the first `prompt_len` tokens of each group of `group_size`
        rows once (from the group's first row); every row of the group continues from a
        copy of their keys and values (`Transformer(..., return_kv=, prefix_kv=)`)."""
        prompt_projections = rest_projections = None
        if projections is not None:  # [L, B, S, ...]: rows on axis 1, positions on 2
            prompt_projections = jax.tree.map(lambda x: x[:, ::group_size, :prompt_len],
                                              projections)
            rest_projections = jax.tree.map(lambda x: x[:, :, prompt_len:], projections)
        prompt = self.model.apply({"params": params}, tokens[::group_size, :prompt_len],
                                  return_kv=True, return_hidden=True, compute_logits=False,
                                  projections=prompt_projections)
        to_rows = lambda x, axis=0: jnp.repeat(x, group_size, axis=axis)  # noqa: E731
        prefix = transformer_lib.KVCache(keys=to_rows(prompt.cache.keys, 1),
                                         values=to_rows(prompt.cache.values, 1),
                                         length=to_rows(prompt.cache.length))
        rest = self.model.apply({"params": params}, tokens[:, prompt_len:], prefix_kv=prefix,
                                return_hidden=True, compute_logits=False,
                                projections=rest_projections)
        hidden = jnp.concatenate([to_rows(prompt.hidden), rest.hidden], axis=1)
        values = None
        if rest.values is not None:
            values = jnp.concatenate([to_rows(prompt.values), rest.values], axis=1)
        return hidden, values

    def _full_score(self, params, tokens, entropy: bool, projections=None) -> TokenScores:
        """Every position, from the model's [B, S, V] logits."""
        out = self.model.apply({"params": params}, tokens, projections=projections)
        logits = out.logits[:, :-1] / jnp.maximum(self.temperature, 1e-6)
        targets = tokens[:, 1:]
        ent = None
        if entropy:
            logp, ent = alg.token_logprobs_and_entropy(logits, targets)
            ent = shift_right(ent)
        else:
            logp = alg.token_logprobs(logits, targets)
        values = None if out.values is None else shift_right(out.values[:, :-1])
        return TokenScores(logp=shift_right(logp), entropy=ent, values=values)

    def _token_stats(self, params, hidden, targets):
        """(log-prob, entropy) float32 [B, N] of `targets` [B, N] predicted from the final
        hidden states [B, N, D]: `logprob_chunk` positions at a time (arl.models.chunked_logprobs,
        never the whole [B, N, V] logits), or in one piece as the model's own head does."""
        if self.logprob_chunk:
            matrix, vocab_major = transformer_lib.output_matrix(params, self.model.config)
            return chunked_token_logprobs(hidden, matrix, targets, self.logprob_chunk,
                                          jnp.maximum(self.temperature, 1e-6),
                                          vocab_major=vocab_major)
        unembed = transformer_lib.unembedding_matrix(params, self.model.config)
        batch, length, width = hidden.shape
        logits = jnp.einsum("nd,dv->nv", hidden.reshape(batch * length, width),
                            unembed.astype(hidden.dtype), preferred_element_type=jnp.float32)
        logits = logits.reshape(batch, length, -1) / jnp.maximum(self.temperature, 1e-6)
        return alg.token_logprobs_and_entropy(logits, targets)

    def _selected_stats(self, params, hidden, targets, wanted, max_scored: int):
        """`_token_stats` on the first `max_scored` wanted positions of each row only,
        scattered back to [B, N] (zeros elsewhere). Requires wanted.sum(1) <= max_scored."""
        length = hidden.shape[1]
        order = jnp.arange(length, dtype=jnp.int32)

        def row_index(row_wanted):
            # Slot r holds the r-th wanted position; unused slots point past the end.
            rank = jnp.cumsum(row_wanted, dtype=jnp.int32) - 1
            slot = jnp.where(row_wanted, rank, max_scored)
            return jnp.full((max_scored,), length, jnp.int32).at[slot].set(order, mode="drop")

        index = jax.vmap(row_index)(wanted)  # [B, K], `length` = unused
        used = index < length
        safe = jnp.where(used, index, 0)
        picked_hidden = jnp.take_along_axis(hidden, safe[..., None], axis=1)
        picked_targets = jnp.take_along_axis(targets, safe, axis=1)
        stats = self._token_stats(params, picked_hidden, picked_targets)

        def scatter(values):
            return jax.vmap(lambda i, x: jnp.zeros((length,), x.dtype).at[i].set(
                x, mode="drop"))(index, jnp.where(used, values, 0.0))

        return tuple(scatter(x) for x in stats)


def load_pretrained(config: ml_collections.ConfigDict, model: transformer_lib.Transformer,
                    mesh) -> Any | None:
    """The weights of `config.model.hf_checkpoint` placed on `mesh`, or None."""
    if not config.model.hf_checkpoint:
        return None
    from arl.models import hf_import  # pylint: disable=g-import-not-at-top
    with checkpoint_errors_as_config_errors(config.model.hf_checkpoint):
        _, params = hf_import.load_hf_checkpoint(config.model.hf_checkpoint,
                                                 config=model.config, mesh=mesh)
    return params


@contextlib.contextmanager
def checkpoint_errors_as_config_errors(path: str):
    """Re-raises what the Hugging Face import refuses (an unsupported config.json, missing
    or mismatching tensors: `hf_import.CheckpointMismatchError`, a ValueError; a missing
    file) as a `ConfigError` naming `config.model.hf_checkpoint`."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, KeyError, OSError) as error:
        raise ConfigError(f"config.model.hf_checkpoint={path!r} is invalid: "
                          f"{one_line(error)}") from error
