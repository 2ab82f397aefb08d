"""The update: the loss of a minibatch and a scan over epochs x minibatches of optimizer
steps.

    loss = policy (the row's: PPO's clipped ratio by default) + value_coef * value (critic)
           + kl_coef * KL(pi || pi_ref) - entropy_coef * H + echo_coef * CE(observations)
           + alpha(step) * SFT(demonstrations)

Every term is aggregated with `config.loss.agg` (`arl.algorithms.aggregate`) over the
minibatch's `UpdateBatch.mask`; a term is present when its input is (a critic's
`returns`, a reference's `ref_logp`, demonstrations' `demo_tokens`).

Every term reads log-probs (and the entropy) only where its mask is nonzero: the agent
tokens, plus the observations for ECHO's term. Given static bounds of their number per
row (`Learner.agent_token_bound`, `observation_token_bound`), the policy scores those
positions only (`Policy.score(..., scored=, max_scored=)`): the vocabulary projection
and log-softmax skip the prompt and, in multi-turn contexts, the environment's replies.

With groups of rows sharing a prompt (`Learner.group_size`, `prompt_len`: GRPO's samples
of one task) and minibatches that keep the groups whole (one minibatch, whose rows stay
in rollout order, or `Learner.shuffle = "groups"`), the model reads each group's prompt
once, the other rows continuing from its keys and values (`Policy.score(...,
group_size=, prompt_len=)`).

With `Learner.reuse_activations` (one epoch, one minibatch: the update's only step is at
the rollout's parameters) the update takes the layers' projection outputs the rollout
recorded (`Trajectory.projections`) as their forward values (`Policy.score(...,
projections=)`): the gradient of the same loss at the rollout's activations, without
the forward pass's projection matmuls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct

from arl import algorithm_table
from arl import algorithms as alg
from arl import config as config_lib
from arl import sharding as sharding_lib
from arl.trainers.policy import Policy, same_prompts


@struct.dataclass
class UpdateBatch:
    """Token-aligned `[B, S]` inputs of the loss; optional terms are None when off."""

    tokens: jax.Array  # int32: the contexts
    mask: jax.Array  # float32: agent mask x kept rows (the tokens the loss trains on)
    old_logp: jax.Array  # float32: behaviour log-probs
    advantages: jax.Array  # float32
    observation_mask: jax.Array  # float32: environment replies (ECHO's term)
    old_values: jax.Array | None = None  # float32: critic values at sampling time
    returns: jax.Array | None = None  # float32: critic targets
    ref_logp: jax.Array | None = None  # float32: reference log-probs (KL term)
    demo_tokens: jax.Array | None = None  # int32: demonstrations (SFT term)
    demo_mask: jax.Array | None = None  # float32: the demonstrator's tokens
    # float32: log-probs at the parameters the update starts from (pi_prox of the
    # off-policy corrections that need it, `Learner.proximal_logp`)
    prox_logp: jax.Array | None = None


def off_policy_inputs(loss_config: ml_collections.ConfigDict, mb: UpdateBatch):
    """(the reference of PPO's ratio, the advantages, metrics) under
    `loss_config.off_policy_correction` (`arl.algorithms.off_policy`): the behaviour
    log-probs and the advantages themselves for "none" / "bypass"; else pi_prox and the
    advantages times the correction's constant weight w (the policy loss is positively
    homogeneous in the advantage, so this is w times the loss)."""
    c = loss_config
    correction = c.off_policy_correction
    if not alg.off_policy.needs_proximal(correction):
        return mb.old_logp, mb.advantages, {}
    weights, metrics = alg.off_policy_weights(
        mb.prox_logp, mb.old_logp, mb.mask, correction=correction, level=c.off_policy_level,
        cap=c.off_policy_cap, low=c.off_policy_low, high=c.off_policy_high)
    advantages = alg.weighted_advantages(mb.advantages, weights)
    return mb.prox_logp, advantages, {f"off_policy/{k}": v for k, v in metrics.items()}


def sft_weight(loss_config: ml_collections.ConfigDict, step) -> jax.Array:
    """alpha of RL + alpha*SFT: constant, or held for `sft_hold_steps` and then decayed
    linearly to `sft_coef_final` over `sft_decay_steps` (high early, lower later)."""
    c = loss_config
    if c.sft_coef_final < 0:
        return jnp.asarray(c.sft_coef, jnp.float32)
    frac = jnp.clip((step - c.sft_hold_steps) / max(1, c.sft_decay_steps), 0.0, 1.0)
    return (c.sft_coef + frac * (c.sft_coef_final - c.sft_coef)).astype(jnp.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class Learner:
    """The loss and the minibatch update of a policy."""

    policy: Policy
    optimizer: optax.GradientTransformation
    loss_config: ml_collections.ConfigDict  # config.loss
    epochs: int
    minibatches: int
    mesh: jax.sharding.Mesh
    context_length: int
    # Static bounds of the agent (observation) tokens of one row, e.g. the env's
    # max_turns * action_len (max_turns * obs_len); 0 = score every position.
    agent_token_bound: int = 0
    observation_token_bound: int = 0
    # The batch's rows are consecutive groups of `group_size` rows sharing their first
    # `prompt_len` tokens (GRPO groups): when minibatches keep the groups whole, each
    # group's prompt is read once (`Policy.score`); 1 / 0 = no such structure.
    group_size: int = 1
    prompt_len: int = 0
    # "rows": each epoch deals shuffled rows into the minibatches; "groups": shuffled
    # whole groups of `group_size` consecutive rows, in order within each group.
    shuffle: str = "rows"
    # No row has more agent (observation) tokens than the bounds above, as in any
    # rollout: not checked on the data, so the loss traces no full-vocabulary fallback
    # (`Policy.score(..., scored_within_bound=)`), whose forward and backward pass every
    # step's program would otherwise compile and never run.
    rows_within_bounds: bool = False
    # The rollout's recorded projection outputs are the forward values of the update's
    # one step (`update(..., projections=)`); needs epochs = minibatches = 1.
    reuse_activations: bool = False
    # The policy term (`config.loss.policy_loss`, `arl.algorithm_table`), which reads
    # the loss section's clip settings with 0 as its own defaults.
    policy_loss: algorithm_table.PolicyLoss = algorithm_table.get_policy_loss("ppo")

    def __post_init__(self):
        if self.shuffle not in config_lib.MINIBATCH_SHUFFLES:
            raise ValueError(f"Learner: shuffle must be one of "
                             f"{config_lib.MINIBATCH_SHUFFLES}, got {self.shuffle!r}")
        if self.reuse_activations and (self.epochs != 1 or self.minibatches != 1):
            raise ValueError(f"Learner: reuse_activations needs epochs = 1 and minibatches "
                             f"= 1 (one step at the rollout's parameters), got epochs="
                             f"{self.epochs}, minibatches={self.minibatches}")

    @property
    def shares_prompt(self) -> bool:
        """Whether the update keeps the groups together and scores their prompts once."""
        whole_groups = self.minibatches == 1 or self.shuffle == "groups"
        return whole_groups and self.group_size > 1 and self.prompt_len > 0

    def deal_minibatches(self, batch: UpdateBatch, key) -> UpdateBatch:
        """One epoch's minibatches of `batch`, stacked on a new leading axis."""
        if self.minibatches == 1 and (self.shares_prompt or self.reuse_activations):
            # One minibatch: the order is moot (and rows keep the recorded activations').
            return jax.tree.map(lambda x: x[None], batch)
        batch_size = batch.tokens.shape[0]
        if self.shuffle == "groups":
            groups = jax.random.permutation(key, batch_size // self.group_size)
            rows = (groups[:, None] * self.group_size + jnp.arange(self.group_size)).ravel()
        else:
            rows = jax.random.permutation(key, batch_size)
        rows = rows.reshape(self.minibatches, -1)
        return jax.tree.map(lambda x: x[rows], batch)

    @property
    def norm(self) -> float | None:
        """The constant N of `seq-mean-token-sum-norm` (default: the context length)."""
        if self.loss_config.agg == "seq-mean-token-sum-norm":
            return self.loss_config.norm or float(self.context_length)
        return None

    def loss(self, params: Any, mb: UpdateBatch, step, base: Any = None, projections=None,
             prompts_equal: bool | None = None):
        """(total loss, metrics) of the trainable `params` (under LoRA merged into the
        frozen `base`) on one minibatch at train step `step`; `projections`: the layers'
        recorded projection outputs of `mb.tokens` at these parameters, or None;
        `prompts_equal`: whether the groups' rows start with the same prompt, as
        `Policy.score` takes it (None: checked there)."""
        c = self.loss_config
        params = self.policy.merge(params, base)
        scored, max_scored = mb.mask, self.agent_token_bound
        if c.echo_coef > 0:
            scored = jnp.maximum(mb.mask, mb.observation_mask)
            max_scored = (max_scored + self.observation_token_bound
                          if self.observation_token_bound else 0)
        group_size, prompt_len = ((self.group_size, self.prompt_len) if self.shares_prompt
                                  else (1, 0))
        scores = self.policy.score(params, mb.tokens, scored=scored, max_scored=max_scored,
                                   group_size=group_size, prompt_len=prompt_len,
                                   projections=projections, prompts_equal=prompts_equal,
                                   scored_within_bound=self.rows_within_bounds)
        logp, ent = scores.logp, scores.entropy
        mask = mb.mask
        norm = self.norm
        ratio_reference, advantages, off_policy_metrics = off_policy_inputs(c, mb)
        pg, metrics = self.policy_loss.fn(logp, ratio_reference, advantages, mask,
                                          self.policy_loss.clips(c), agg=c.agg, norm=norm)
        metrics = {f"policy/{k}": v for k, v in metrics.items()}
        metrics.update(off_policy_metrics)
        total = pg
        metrics["loss/policy"] = pg
        metrics["entropy"] = alg.aggregate(ent, mask, "token-mean")
        if c.entropy_coef > 0:
            total = total - c.entropy_coef * alg.aggregate(ent, mask, c.agg, norm=norm)
        if mb.returns is not None:
            vl, vmetrics = alg.value_loss(
                scores.values, mb.old_values, mb.returns, mask,
                clip=c.value_clip or None, agg=c.agg, norm=norm)
            total = total + c.value_coef * vl
            metrics["loss/value"] = vl
            metrics.update({f"value/{k}": v for k, v in vmetrics.items()})
        if mb.ref_logp is not None:
            kl_per_token = alg.kl_penalty(logp, mb.ref_logp, c.kl_kind, mask=mask > 0)
            kl = alg.aggregate(kl_per_token, mask, "token-mean")
            metrics["kl_ref"] = kl
            if not c.kl_in_reward:
                total = total + c.kl_coef * alg.aggregate(kl_per_token, mask, c.agg, norm=norm)
        if c.echo_coef > 0:
            echo = alg.observation_loss(logp, mb.observation_mask)
            total = total + c.echo_coef * echo
            metrics["loss/echo"] = echo
        if mb.demo_tokens is not None:
            demo_logp = self.policy.score(params, mb.demo_tokens, scored=mb.demo_mask,
                                          max_scored=self.agent_token_bound,
                                          entropy=False).logp
            sft = alg.sft_loss(demo_logp, mb.demo_mask)
            total = total + sft_weight(c, step) * sft
            metrics["loss/sft"] = sft
        metrics["loss/total"] = total
        return total, metrics

    def proximal_logp(self, params, batch: UpdateBatch, base=None) -> jax.Array:
        """pi_prox: the log-probs of `batch.tokens` at the parameters the update starts
        from (one forward pass, no gradient), where `batch.mask` is nonzero."""
        group_size, prompt_len = ((self.group_size, self.prompt_len) if self.shares_prompt
                                  else (1, 0))
        scores = self.policy.score(self.policy.merge(params, base), batch.tokens,
                                   scored=batch.mask, max_scored=self.agent_token_bound,
                                   group_size=group_size, prompt_len=prompt_len,
                                   entropy=False, scored_within_bound=self.rows_within_bounds)
        return jax.lax.stop_gradient(scores.logp)

    def update(self, params, opt_state, batch: UpdateBatch, key, step, base=None,
               projections=None):
        """`epochs` passes over `batch` in `minibatches` shuffled minibatches
        (`deal_minibatches`), one optimizer step each; returns (params, opt_state,
        metrics averaged over steps). `projections`: with `reuse_activations`, the
        rollout's recorded projection outputs of `batch.tokens` (`Trajectory.projections`,
        recorded at `params`)."""
        if (projections is not None) != self.reuse_activations:
            raise ValueError(f"Learner.update: projections are needed exactly when "
                             f"reuse_activations (= {self.reuse_activations}); got "
                             f"{'some' if projections is not None else 'None'}")
        batch_axes = sharding_lib.batch_sharding(self.mesh)
        if alg.off_policy.needs_proximal(self.loss_config.off_policy_correction):
            batch = batch.replace(prox_logp=self.proximal_logp(params, batch, base))
        grad_fn = jax.grad(self.loss, has_aux=True)

        def gradients(params, mb):
            if not self.shares_prompt:
                return grad_fn(params, mb, step, base, projections)
            # Checked around the whole gradient rather than inside the loss, where the
            # cond would carry each branch's residuals to the backward pass (filling
            # the other branch's with zeros).
            return jax.lax.cond(
                same_prompts(mb.tokens, self.group_size, self.prompt_len),
                lambda: grad_fn(params, mb, step, base, projections, True),
                lambda: grad_fn(params, mb, step, base, projections, False))

        (params, opt_state), metrics = scan_epochs(
            lambda params, mb: gradients(
                params, jax.lax.with_sharding_constraint(mb, batch_axes)),
            self.optimizer, params, opt_state,
            lambda epoch_key: self.deal_minibatches(batch, epoch_key), key, self.epochs)
        return params, opt_state, jax.tree.map(jnp.mean, metrics)


def scan_epochs(gradients: Callable, optimizer: optax.GradientTransformation, params,
                opt_state, deal: Callable, key: jax.Array, epochs: int, *,
                grad_norm: bool = True, pack: Callable | None = None):
    """`epochs` x minibatches of optimizer steps, as two nested `lax.scan`s.

    Epoch e deals its minibatches with `deal(key_e)` (a pytree whose leaves have a
    leading minibatch axis; `key_e` from `jax.random.split(key, epochs)`); each minibatch
    is one step: `gradients(params, mb) -> (grads, metrics)`, then the optimizer's
    update. `grad_norm` adds the gradients' global norm to the metrics; `pack` maps a
    step's metrics to what is stacked (default: the dict itself). Returns
    ((params, opt_state), metrics stacked [epochs, minibatches, ...])."""

    def minibatch(carry, mb):
        params, opt_state = carry
        grads, metrics = gradients(params, mb)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if grad_norm:
            # float32: bfloat16 gradients summed in bfloat16 lose the norm's low bits.
            metrics["grad_norm"] = optax.global_norm(
                jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        return (params, opt_state), metrics if pack is None else pack(metrics)

    def epoch(carry, epoch_key):
        return jax.lax.scan(minibatch, carry, deal(epoch_key))

    return jax.lax.scan(epoch, (params, opt_state), jax.random.split(key, epochs))
