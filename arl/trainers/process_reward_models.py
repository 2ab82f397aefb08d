"""Process reward models inside the train step: a learned PRM trained on Monte Carlo
labels, and PRIME's implicit PRM trained on the outcome.

Learned PRM (the article's PRM; labels as in Math-Shepherd, Wang et al. 2024, arXiv
2312.08935): a transformer with a scalar head reads the context up to the state s_k
before turn k and predicts phi(s_k) = P(success | s_k). It is trained by binary
cross-entropy on the Monte Carlo success fractions of forked continuations
(`arl.rollout.branching`) and on the known outcome of every final state. As a dense reward it
gives turn k the potential difference phi(s_{k+1}) - phi(s_k) (potential-based shaping,
Ng et al. 1999), so the shaped return of an episode telescopes to
phi(s_final) - phi(s_0) and the optimal policy is unchanged.

Implicit PRM (PRIME, Cui et al. 2025, arXiv 2502.01456): a language model pi_phi with
token rewards r_t = beta * log(pi_phi(y_t) / pi_ref(y_t)), trained so that
sigma(beta * sum_t log(pi_phi / pi_ref)) predicts the outcome (cross-entropy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from arl.algorithms import process as process_lib
from arl.optim import make_optimizer
from arl.models import transformer as transformer_lib
from arl.trainers.policy import Policy


def state_positions(traj):
    """Context positions of the states s_0 .. s_K, `[B, K + 1]` int32: the last token
    before turn k for played turns, and the last token of the row for s_k with k at or
    after the row's last turn (the final state)."""
    num_turns = traj.turn_starts.shape[1]
    k = jnp.arange(num_turns + 1)[None, :]
    final = (traj.length - 1)[:, None]
    starts = jnp.concatenate([traj.turn_starts, jnp.zeros_like(final)], axis=1) - 1
    return jnp.where(k < traj.num_turns[:, None], starts, final)


def prm_logits(prm_model, prm_params, traj):
    """The PRM's logits of phi(s_0) .. phi(s_K): `[B, K + 1]` float32."""
    out = prm_model.apply({"params": prm_params}, traj.tokens)
    return jnp.take_along_axis(out.values.astype(jnp.float32), state_positions(traj), axis=1)


def prm_turn_rewards(prm_model, prm_params, traj):
    """Dense reward of every played turn, phi(s_{k+1}) - phi(s_k), on its last agent
    token: `[B, T]` float32, no gradient."""
    phi = jax.nn.sigmoid(jax.lax.stop_gradient(prm_logits(prm_model, prm_params, traj)))
    played = jnp.arange(traj.turn_starts.shape[1])[None, :] < traj.num_turns[:, None]
    per_turn = jnp.where(played, phi[:, 1:] - phi[:, :-1], 0.0)
    return process_lib.turns_to_tokens(per_turn, traj.turn_end_mask, traj.agent_mask) * (
        traj.turn_end_mask)


def prm_loss(prm_params, prm_model, traj, labels, known):
    """Binary cross-entropy of the PRM on the Monte Carlo labels `[B, K]` where `known`,
    and on the outcome (success) of each row's final state. Returns (loss, metrics)."""
    logits = prm_logits(prm_model, prm_params, traj)
    num_turns = labels.shape[1]
    final = jax.nn.one_hot(jnp.minimum(traj.num_turns, num_turns), num_turns + 1, dtype=bool)
    targets = jnp.concatenate([labels, jnp.zeros_like(labels[:, :1])], axis=1)
    targets = jnp.where(final, traj.success.astype(jnp.float32)[:, None], targets)
    weight = jnp.concatenate([known, jnp.zeros_like(known[:, :1])], axis=1) | final
    weight = weight.astype(jnp.float32)
    losses = optax.sigmoid_binary_cross_entropy(logits, targets)
    loss = jnp.sum(losses * weight) / jnp.maximum(jnp.sum(weight), 1.0)
    correct = ((logits > 0) == (targets > 0.5)).astype(jnp.float32)
    return loss, {"prm/loss": loss,
                  "prm/accuracy": jnp.sum(correct * weight) / jnp.maximum(jnp.sum(weight), 1.0),
                  "prm/labels": jnp.sum(weight)}


def implicit_rewards(logp_phi, ref_logp, mask, beta):
    """PRIME token rewards beta * (log pi_phi - log pi_ref) on agent tokens, no gradient."""
    return jax.lax.stop_gradient(beta * (logp_phi - ref_logp) * mask)


def implicit_prm_loss(logp_phi, ref_logp, mask, success, beta):
    """PRIME's cross-entropy: sigma(beta * sum_t log(pi_phi / pi_ref)) predicts success."""
    score = beta * jnp.sum((logp_phi - ref_logp) * mask, axis=1)
    loss = jnp.mean(optax.sigmoid_binary_cross_entropy(score, success.astype(jnp.float32)))
    accuracy = jnp.mean(((score > 0) == success).astype(jnp.float32))
    return loss, {"implicit_prm/loss": loss, "implicit_prm/accuracy": accuracy}


@dataclasses.dataclass(frozen=True, eq=False)
class ProcessModels:
    """The process reward models a token trainer carries in its state (`config.process`):
    the learned PRM (`train_prm`) and PRIME's implicit PRM (`implicit_coef > 0`). Each
    takes one optimizer step per train step."""

    settings: ml_collections.ConfigDict  # config.process
    policy: Policy
    prm_model: transformer_lib.Transformer | None
    optimizer: optax.GradientTransformation | None
    # Groups of rows sharing their first `prompt_len` tokens: the implicit PRM reads each
    # group's prompt once (`Policy.score`); 1 / 0 = every row whole.
    group_size: int = 1
    prompt_len: int = 0

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, policy: Policy, *,
                    group_size: int = 1, prompt_len: int = 0) -> "ProcessModels":
        p = config.process
        optimizer = prm_model = None
        if p.train_prm or p.implicit_coef > 0:
            optimizer = make_optimizer(config.optim, learning_rate=p.prm_learning_rate,
                                       param_dtype=policy.model.config.param_dtype)
        if p.train_prm:
            prm_model = transformer_lib.Transformer(
                dataclasses.replace(policy.model.config, value_head=True))
        return cls(settings=p, policy=policy, prm_model=prm_model, optimizer=optimizer,
                   group_size=group_size, prompt_len=prompt_len)

    @property
    def uses_implicit_prm(self) -> bool:
        return self.settings.implicit_coef > 0

    def _implicit_logp(self, params, tokens):
        """The implicit PRM's per-token log-probs of `tokens` [B, S]."""
        return self.policy.score(params, tokens, entropy=False, group_size=self.group_size,
                                 prompt_len=self.prompt_len).logp

    def initial_fields(self, key, reference_params, context_length: int) -> dict[str, Any]:
        """The state fields of the models at the start: a fresh PRM; the implicit PRM
        starts as the reference policy."""
        fields = {}
        if self.prm_model is not None:
            dummy = jnp.zeros((1, context_length), jnp.int32)
            prm_params = nn.unbox(self.prm_model.init(key, dummy)["params"])
            fields.update(prm_params=prm_params,
                          prm_opt_state=self.optimizer.init(prm_params))
        if self.uses_implicit_prm:
            fields.update(implicit_params=reference_params,
                          implicit_opt_state=self.optimizer.init(reference_params))
        return fields

    def field_shardings(self, abstract, param_shardings, mesh, opt_shardings
                        ) -> dict[str, Any]:
        """Shardings of the fields `initial_fields` adds (`abstract`: the state's shapes)."""
        fields = {}
        if self.prm_model is not None:
            prm_shardings = transformer_lib.param_shardings(
                transformer_lib.abstract_params(self.prm_model), mesh)
            fields.update(prm_params=prm_shardings,
                          prm_opt_state=opt_shardings(self.optimizer, abstract.prm_opt_state,
                                                      prm_shardings))
        if self.uses_implicit_prm:
            fields.update(implicit_params=param_shardings,
                          implicit_opt_state=opt_shardings(
                              self.optimizer, abstract.implicit_opt_state, param_shardings))
        return fields

    def process_rewards(self, state, traj):
        """Dense turn rewards `[B, S]` (on turn ends): the env's process reward and the
        learned PRM's potential differences, each with its weight."""
        p = self.settings
        rewards = p.reward_weight * traj.process_rewards
        if self.prm_model is not None and p.prm_weight > 0:
            rewards = rewards + p.prm_weight * prm_turn_rewards(
                self.prm_model, state.prm_params, traj)
        return rewards

    def implicit_token_rewards(self, state, traj, ref_logp):
        """PRIME's token rewards `[B, S]`, or None when the implicit PRM is off."""
        if not self.uses_implicit_prm:
            return None
        logp_phi = self._implicit_logp(state.implicit_params, traj.tokens)
        return implicit_rewards(logp_phi, ref_logp, traj.agent_mask, self.settings.implicit_coef)

    def update(self, state, traj, ref_logp, branch) -> tuple[dict[str, Any], dict[str, Any]]:
        """One optimizer step of the learned PRM (on the Monte Carlo labels) and of
        PRIME's implicit PRM (on the outcome): (new state fields, metrics)."""
        p = self.settings
        fields, metrics = {}, {}
        if self.prm_model is not None:
            labels = branch.success if p.mc_estimate == "mean_return" else branch.values
            grads, prm_metrics = jax.grad(prm_loss, has_aux=True)(
                state.prm_params, self.prm_model, traj, labels, branch.known)
            updates, opt_state = self.optimizer.update(
                grads, state.prm_opt_state, state.prm_params)
            fields.update(prm_params=optax.apply_updates(state.prm_params, updates),
                          prm_opt_state=opt_state)
            metrics.update(prm_metrics)
        if self.uses_implicit_prm:
            def loss(params):
                logp_phi = self._implicit_logp(params, traj.tokens)
                return implicit_prm_loss(logp_phi, ref_logp, traj.agent_mask, traj.success,
                                         p.implicit_coef)
            grads, implicit_metrics = jax.grad(loss, has_aux=True)(state.implicit_params)
            updates, opt_state = self.optimizer.update(
                grads, state.implicit_opt_state, state.implicit_params)
            fields.update(implicit_params=optax.apply_updates(state.implicit_params, updates),
                          implicit_opt_state=opt_state)
            metrics.update(implicit_metrics)
        return fields, metrics
