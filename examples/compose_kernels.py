"""A GRPO step of your own, made of `arl.algorithms` kernels and nothing else of arl.

The kernels are plain functions of arrays: this file needs jax and `pip install arl` with
no extra (no flax, no optax). A toy "policy" (a table of logits) learns to write the token
7; replace `policy_logits` with your model, `scores` with your environment's rewards and
the SGD line with your optimizer (docs/kernels.md, "Composing the kernels").

    python examples/compose_kernels.py
"""

import jax
import jax.numpy as jnp

from arl import algorithms as alg

B, T, V, G = 32, 6, 10, 8  # 4 prompts x 8 samples, 6 response tokens, vocabulary of 10
group_ids = jnp.repeat(jnp.arange(B // G), G)  # rows of a group answer the same prompt
LEARNING_RATE = 10.0


def policy_logits(params):  # stand-in for your model: logits [B, T, V]
    return jnp.broadcast_to(params["logits"], (B, T, V))


@jax.jit
def train_step(params, key):
    logits = policy_logits(params)
    tokens = jax.random.categorical(key, logits)  # sample the responses [B, T]
    mask = jnp.ones((B, T), jnp.float32)  # agent mask: 1 on tokens the policy wrote
    old_logp = alg.token_logprobs(logits, tokens)
    scores = (tokens == 7).sum(axis=1).astype(jnp.float32)  # reward of each response
    advantages = alg.group_advantages(scores, group_ids, num_groups=B // G)  # GRPO, [B]

    def loss_fn(params):
        logits = policy_logits(params)
        logp = alg.token_logprobs(logits, tokens)
        loss, metrics = alg.policy_loss(logp, old_logp, advantages, mask, clip_low=0.2,
                                        clip_high=0.28, agg="seq-mean-token-mean")
        entropy = alg.aggregate(alg.entropy(logits), mask, "token-mean")
        return loss - 0.001 * entropy, metrics

    grads, metrics = jax.grad(loss_fn, has_aux=True)(params)
    # Plain SGD; with optax: updates, opt_state = optimizer.update(grads, opt_state).
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, scores.mean()


params = {"logits": jnp.zeros((T, V))}
rewards = []
for step in range(30):
    params, reward = train_step(params, jax.random.key(step))
    rewards.append(float(reward))
print(f"mean reward {rewards[0]:.2f} -> {rewards[-1]:.2f} (optimum {T})")
assert rewards[-1] > 3 * rewards[0]
