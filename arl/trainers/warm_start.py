"""Behaviour-cloning warm start: SFT on scripted demonstrations before RL.

A randomly initialised decoder rarely samples a successful multi-turn episode, so RL on
the token environments starts from a policy behaviour-cloned on the environment's
scripted demonstrations (`config.warm_start`; docs/learning.md says why):

    params = sft_warm_start(trainer, steps=400, batch_size=64, learning_rate=3e-3)
    state = start_state(trainer, params)          # RL starts here
    # or, from the config's warm_start section:
    state = warm_start_state(trainer)

Each SFT step is one `jax.jit` program: a batch of fresh demonstrations from
`trainer.scripted_demonstrations` (the env's scripted policy `source`, `"demonstrator"`: the
weaker one, or `"oracle"`, played in the run's history mode: as generated, or per turn
with every turn a sample of its own rendered context), the masked NLL of the demonstrator's tokens (`algorithms.sft_loss`) and
an AdamW update of *all* the model's weights. Under LoRA (`model.lora_rank > 0`) those
weights become the frozen base (and so the KL reference) on which the adapters are
trained; otherwise they are the trained params, and the KL reference (`ref_params`) and
PRIME's implicit PRM (`implicit_params`) start as copies of them, so KL anchors to the
SFT policy rather than the random init.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from arl import algorithms as alg
from arl import sharding as sharding_lib
from arl.optim import make_optimizer

_SFT_KEY_SALT = 1000  # the SFT key stream: key(seed + 1000), as experiments used before


def sft_warm_start(trainer, steps: int, *, seed: int = 0, learning_rate=None,
                   source: str | None = None, batch_size: int | None = None,
                   log: Callable[[str], Any] | None = None, log_every: int = 25,
                   init_state=None):
    """The model's full parameters after `steps` behaviour-cloning steps.

    Args:
      trainer: an `arl.trainers.TokenTrainer`; its policy and environment are used.
      steps: number of SFT steps (0 returns the initial parameters).
      seed: the initial parameters are `trainer.init_state(seed)`'s (unless
        `init_state` is given); the demonstrations use `key(seed + 1000)`.
      learning_rate: AdamW learning rate; None/0 = `optim.learning_rate`.
      source: `"demonstrator"` or `"oracle"`; None/"" = `loss.sft_source`.
      batch_size: demonstrations per step; None/0 = the RL batch num_tasks*group_size.
      log: called with a line "sft step i loss x (ts)" every `log_every` steps.
      init_state: a `TrainState` of `trainer` to start from (its policy; not modified).

    Returns:
      The policy's full parameter tree (also under LoRA: base with adapters merged).
    """
    c = trainer.config
    source = source or c.loss.sft_source
    lr = learning_rate or c.optim.learning_rate
    batch_size = batch_size or trainer.batch_size
    optimizer = make_optimizer(c.optim, learning_rate=lr,  # the optim section, a constant rate
                               param_dtype=trainer.model.config.param_dtype)
    state = trainer.init_state(seed) if init_state is None else init_state
    params = trainer.policy_params(state)  # all weights, also under LoRA
    if init_state is None:
        del state
    opt_state = optimizer.init(params)
    # Placed as the step returns it (the optimizer's scalars, e.g. Adam's count,
    # replicated on the mesh), so that the first call compiles the program every later
    # call runs: an unplaced count made the second call trace and compile the SFT step
    # again (27-31 s of a tiny dataset run's start on the 2-core CPU,
    # benchmarks/first_step.py).
    placed = jax.tree.leaves(params)[0].sharding
    if isinstance(placed, jax.sharding.NamedSharding):  # as a trainer's state always is
        opt_state = jax.device_put(opt_state, sharding_lib.opt_state_shardings(
            optimizer, opt_state, jax.tree.map(lambda p: p.sharding, params),
            sharding_lib.replicated(placed.mesh)))
    env_params = trainer.task_params(batch_size, 1)

    def loss_fn(p, tokens, mask):
        # Log-probs of the demonstrator's tokens only (Policy.score's `scored`).
        with sharding_lib.activation_mesh(trainer.activation_mesh):
            logp = trainer.policy.score(p, tokens, scored=mask,
                                        max_scored=trainer.learner.agent_token_bound,
                                        entropy=False).logp
        return alg.sft_loss(logp, mask)

    @jax.jit
    def step(params, opt_state, key):
        tokens, mask = trainer.scripted_demonstrations(key, batch_size, source, env_params)
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    key = jax.random.key(seed + _SFT_KEY_SALT)
    t0 = time.time()
    for i in range(steps):
        key, sub = jax.random.split(key)
        params, opt_state, loss = step(params, opt_state, sub)
        due = log_every > 0 and ((i + 1) % log_every == 0 or i + 1 == steps)
        if log is not None and due:
            log(f"sft step {i + 1} loss {float(loss):.4f} ({time.time() - t0:.0f}s)")
    return params


def demonstration_loss(trainer, params, key, *, num_tasks: int = 64,
                       source: str | None = None) -> float:
    """Mean SFT loss (masked NLL) of `params` on `num_tasks` fresh demonstrations."""
    source = source or trainer.config.loss.sft_source
    tokens, mask = trainer.scripted_demonstrations(key, num_tasks, source,
                                          trainer.task_params(num_tasks, 1))
    logp = trainer.policy.score(params, tokens).logp
    return float(alg.sft_loss(logp, mask))


def start_state(trainer, params, state=None):
    """The RL start state with the policy `params` (e.g. from `sft_warm_start`).

    `state` (default `trainer.init_state()`) supplies everything else: a fresh optimizer
    state, the step, the PRNG key, the PRMs. Under LoRA `params` become `base_params`
    (the frozen base and KL reference; the adapters stay as initialised, B = 0, so the
    policy starts as `params`); otherwise `params` become `state.params`, and
    `ref_params` / `implicit_params`, where the config uses them, get copies (the train
    step donates its state, so they must not share buffers). `params` is moved into the
    returned state (placed with the state's shardings): do not use it after a donating
    `train_step` of that state. A value head is added (PPO: the state's, as initialised)
    or dropped to match the trainer's model, so one SFT run serves every algorithm.
    """
    state = trainer.init_state() if state is None else state
    current = state.base_params if trainer.lora is not None else state.params
    params = match_value_head(params, current)
    shardings = trainer.state_shardings()
    param_shardings = (shardings.base_params if trainer.lora is not None
                       else shardings.params)
    placed = jax.device_put(params, _policy_shardings(param_shardings, params))

    def copy():
        return jax.device_put(jax.tree.map(jnp.copy, params),
                              _policy_shardings(param_shardings, params))

    def fresh_opt_state(optimizer, new_params, opt_shardings):
        # The optimizer state of the new parameters, not of the initialisation: with
        # bfloat16 parameters it holds their float32 master copy
        # (arl.optim.float32_master_weights), which the first update would otherwise
        # reset them to. (Adam's moments and counts start at zero either way.)
        return jax.jit(optimizer.init, out_shardings=opt_shardings)(new_params)

    if trainer.lora is not None:
        state = state.replace(base_params=placed)
    else:
        state = state.replace(params=placed, opt_state=fresh_opt_state(
            trainer.optimizer, placed, shardings.opt_state))
        if state.ref_params is not None:  # the KL anchor is the SFT policy, not the init
            state = state.replace(ref_params=copy())
    if state.implicit_params is not None:  # PRIME's implicit PRM starts as the reference
        implicit = copy()
        state = state.replace(implicit_params=implicit, implicit_opt_state=fresh_opt_state(
            trainer.process_models.optimizer, implicit, shardings.implicit_opt_state))
    return state


def match_value_head(params, current):
    """`params` with the value head `current` has or lacks: one SFT run serves PPO (whose
    critic head starts as `current`'s, as initialised) and the critic-free algorithms
    (head dropped)."""
    if not isinstance(params, dict) or not isinstance(current, dict):
        return params
    if "value_head" in current and "value_head" not in params:
        return {**params, "value_head": jax.tree.map(jnp.copy, current["value_head"])}
    if "value_head" in params and "value_head" not in current:
        return {k: v for k, v in params.items() if k != "value_head"}
    return params


def _policy_shardings(param_shardings, params):
    """`param_shardings` when it matches the tree of `params`; else leave placement."""
    if jax.tree.structure(param_shardings) == jax.tree.structure(params):
        return param_shardings
    return None


def settings(config) -> dict[str, Any]:
    """`config.warm_start` resolved: steps, batch_size, learning_rate, source."""
    ws = config.warm_start
    return dict(steps=int(ws.sft_steps), batch_size=int(ws.sft_batch) or None,
                learning_rate=float(ws.sft_lr) or None, source=ws.sft_source or None)


def warm_start_state(trainer, state=None, *, log: Callable[[str], Any] | None = None,
                     log_every: int = 25, **overrides):
    """`config.warm_start.sft_steps` of SFT from `state` (default `trainer.init_state()`)
    and the RL start state from them (`start_state`); `overrides` replace the resolved
    `settings(config)` entries (steps, batch_size, learning_rate, source)."""
    c = trainer.config
    state = trainer.init_state() if state is None else state
    kwargs = {**settings(c), **overrides}
    steps = kwargs.pop("steps")
    t0 = time.time()
    params = sft_warm_start(trainer, steps, seed=c.seed, log=log, log_every=log_every,
                            init_state=state, **kwargs)
    jax.block_until_ready(params)
    if log is not None:
        log(f"warm start: {steps} SFT steps in {time.time() - t0:.1f}s")
    return start_state(trainer, params, state)
