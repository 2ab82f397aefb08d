"""Process reward models inside the train step: a learned PRM trained on Monte Carlo
labels, and PRIME's implicit PRM trained on the outcome.

Learned PRM (the article's PRM; labels as in Math-Shepherd, Wang et al. 2024, arXiv
2312.08935): a transformer with a scalar head reads the context up to the state s_k
before turn k and predicts phi(s_k) = P(success | s_k). It is trained by binary
cross-entropy on the Monte Carlo success fractions of forked continuations
(`arl.branching`) and on the known outcome of every final state. As a dense reward it
gives turn k the potential difference phi(s_{k+1}) - phi(s_k) (potential-based shaping,
Ng et al. 1999), so the shaped return of an episode telescopes to
phi(s_final) - phi(s_0) and the optimal policy is unchanged.

Implicit PRM (PRIME, Cui et al. 2025, arXiv 2502.01456): a language model pi_phi with
token rewards r_t = beta * log(pi_phi(y_t) / pi_ref(y_t)), trained so that
sigma(beta * sum_t log(pi_phi / pi_ref)) predicts the outcome (cross-entropy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from arl.algorithms import process as process_lib


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
