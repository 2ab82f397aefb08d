r"""Two-stage learning demonstration (DESIGN.md section 7): SFT on the environment's
*weaker* demonstrator alone, then RL (+ a small alpha*SFT floor) from the SFT weights.

Reports, on the same fresh tasks: the random (untrained) policy, the demonstrator, the
oracle, the policy after SFT alone and after SFT + RL, sampled (temperature 1) and greedy.

    python -m experiments.learning_stages --config=configs/grpo_guess_number.py \
        --sft_steps=200 --config.train_steps=200

Stage 1 is a plain behaviour-cloning loop (the trainer's model, AdamW at
`optim.learning_rate`, batches of `num_tasks * group_size` demonstrations generated on
the fly); stage 2 is `Trainer.train_step` with the config as given, starting from the
stage-1 parameters (fresh optimizer state). With `--config.model.lora_rank=8` stage 1
still trains all weights and they become stage 2's frozen base (and KL reference), on
which the adapters are trained.
"""

from __future__ import annotations

import json
import os
import pickle
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from arl import algorithms as alg
from arl import rollout as rollout_lib
from arl.train import Trainer


def sft_warm_start(trainer: Trainer, steps: int, *, seed: int = 0, learning_rate=None,
                   source: str | None = None, batch_size: int | None = None, log=None):
    """Parameters after `steps` of behaviour cloning on `source` demonstrations
    (default: `config.loss.sft_source`, the env's weaker demonstrator)."""
    c = trainer.config
    source = source or c.loss.sft_source
    lr = learning_rate or c.optim.learning_rate
    optimizer = optax.chain(optax.clip_by_global_norm(max(c.optim.max_grad_norm, 1e-6)
                                                      if c.optim.max_grad_norm else 1e9),
                            optax.adamw(lr, b1=c.optim.b1, b2=c.optim.b2))
    state = trainer.init_state(seed)
    params = trainer.policy_params(state)  # all weights, also under LoRA
    opt_state = optimizer.init(params)
    batch_size = batch_size or trainer.batch_size
    env_params = trainer.row_params(batch_size, 1)

    def loss_fn(p, tokens, mask):
        logp, _, _ = trainer._forward(p, tokens)  # pylint: disable=protected-access
        return alg.sft_loss(logp, mask)

    @jax.jit
    def step(params, opt_state, key):
        demo = rollout_lib.rollout(
            trainer.env, key, num_tasks=batch_size, group_size=1,
            action_source=source, env_params=env_params)
        loss, grads = jax.value_and_grad(loss_fn)(params, demo.tokens, demo.agent_mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    key = jax.random.key(seed + 1000)
    t0 = time.time()
    for i in range(steps):
        key, sub = jax.random.split(key)
        params, opt_state, loss = step(params, opt_state, sub)
        if log is not None and (i + 1) % 25 == 0:
            log(f"sft step {i + 1} loss {float(loss):.4f} ({time.time() - t0:.0f}s)")
    return params


def evaluate(trainer: Trainer, params, *, greedy: bool, rounds: int = 4, seed: int = 12345):
    """Success rate and mean turns over `rounds` x (num_tasks * group_size) fresh tasks."""
    success, turns = [], []
    for r in range(rounds):
        metrics, _ = trainer.evaluate(params, jax.random.key(seed + r), greedy=greedy)
        success.append(float(metrics["success_rate"]))
        turns.append(float(metrics["turns_mean"]))
    return float(np.mean(success)), float(np.mean(turns))


def scripted(trainer: Trainer, source: str, num_tasks: int = 1024, seed: int = 7):
    traj = rollout_lib.rollout(
        trainer.env, jax.random.key(seed), num_tasks=num_tasks, group_size=1,
        action_source=source, env_params=trainer.row_params(num_tasks, 1))
    return (float(np.mean(np.asarray(traj.success))),
            float(np.mean(np.asarray(traj.num_turns))))


def run_stages(config, *, sft_steps: int, rl_steps: int | None = None, log=print,
               eval_rounds: int = 4, sft_batch: int | None = None, sft_lr=None,
               sft_cache: str = ""):
    """Runs both stages; returns a dict of every measured number."""
    rl_steps = config.train_steps if rl_steps is None else rl_steps
    trainer = Trainer(config)
    out = {"sft_steps": sft_steps, "rl_steps": rl_steps}
    out["demonstrator"] = scripted(trainer, "demonstrator")
    out["oracle"] = scripted(trainer, "oracle")
    init = trainer.init_state()
    out["random_sampled"] = evaluate(trainer, trainer.policy_params(init), greedy=False,
                                     rounds=eval_rounds)
    del init
    log(f"baselines {json.dumps(out)}")

    t0 = time.time()
    if sft_cache and os.path.exists(sft_cache):  # a tuning aid: reuse stage 1
        with open(sft_cache, "rb") as f:
            params = jax.tree.map(jnp.asarray, pickle.load(f))
    else:
        params = sft_warm_start(trainer, sft_steps, seed=config.seed, batch_size=sft_batch,
                                learning_rate=sft_lr, log=log)
        if sft_cache:
            with open(sft_cache, "wb") as f:
                pickle.dump(jax.tree.map(np.asarray, params), f)
    out["sft_wall_s"] = time.time() - t0
    out["sft_sampled"] = evaluate(trainer, params, greedy=False, rounds=eval_rounds)
    out["sft_greedy"] = evaluate(trainer, params, greedy=True, rounds=eval_rounds)
    log(f"after SFT ({out['sft_wall_s']:.0f}s): sampled {out['sft_sampled']} "
        f"greedy {out['sft_greedy']}")

    state = trainer.init_state()
    if trainer.lora is not None:  # the SFT weights become the frozen base (and reference)
        state = state.replace(base_params=params)
    else:
        state = state.replace(params=params)
        if state.ref_params is not None:  # the KL anchor is the SFT policy, not the init
            state = state.replace(ref_params=jax.tree.map(jnp.copy, params))
    if state.implicit_params is not None:  # PRIME's implicit PRM starts as the reference
        state = state.replace(implicit_params=jax.tree.map(jnp.copy, params))
    t0 = time.time()
    history = []
    for i in range(rl_steps):
        state, metrics = trainer.train_step(state)
        history.append(float(metrics["success_rate"]))
        if (i + 1) % 10 == 0:
            log(f"rl step {i + 1} success {np.mean(history[-10:]):.3f} "
                f"turns {float(metrics['turns_mean']):.2f} "
                f"entropy {float(metrics['entropy']):.3f} "
                f"({time.time() - t0:.0f}s)")
    out["rl_wall_s"] = time.time() - t0
    out["rl_history"] = history
    out["rl_last10_sampled"] = float(np.mean(history[-10:])) if history else None
    policy = trainer.policy_params(state)
    out["rl_sampled"] = evaluate(trainer, policy, greedy=False, rounds=eval_rounds)
    out["rl_greedy"] = evaluate(trainer, policy, greedy=True, rounds=eval_rounds)
    log(f"after SFT+RL ({out['rl_wall_s']:.0f}s): sampled {out['rl_sampled']} "
        f"greedy {out['rl_greedy']}")
    return out, state


def warm_start_settings(config_path: str):
    """Stage-1 settings from the config file's optional module-level `WARM_START` dict
    (`sft_steps`, `sft_batch`, `sft_lr`; the library does not read it)."""
    import importlib.util  # pylint: disable=g-import-not-at-top

    spec = importlib.util.spec_from_file_location("_arl_config_file", config_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ws = getattr(module, "WARM_START", {})
    return dict(sft_steps=int(ws.get("sft_steps", 200)),
                sft_batch=int(ws.get("sft_batch", 0)) or None,
                sft_lr=float(ws.get("sft_lr", 0.0)) or None)


def main(argv):
    del argv
    from absl import flags  # pylint: disable=g-import-not-at-top

    from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

    config = flags.FLAGS.config
    settings = warm_start_settings(config_flags.get_config_filename(flags.FLAGS["config"]))
    if flags.FLAGS.sft_steps >= 0:
        settings["sft_steps"] = flags.FLAGS.sft_steps
    if flags.FLAGS.sft_batch:
        settings["sft_batch"] = flags.FLAGS.sft_batch
    if flags.FLAGS.sft_lr:
        settings["sft_lr"] = flags.FLAGS.sft_lr
    result, _ = run_stages(config, **settings, sft_cache=flags.FLAGS.sft_cache,
                           log=lambda s: print(s, flush=True))
    result.pop("rl_history")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Experiment config file.")
    flags.DEFINE_integer("sft_steps", -1,
                         "Behaviour-cloning steps before RL (-1: config.warm_start).")
    flags.DEFINE_integer("sft_batch", 0,
                         "Demonstrations per SFT step (0: config.warm_start, else the RL batch).")
    flags.DEFINE_float("sft_lr", 0.0,
                       "SFT learning rate (0: config.warm_start, else optim.learning_rate).")
    flags.DEFINE_string("sft_cache", "", "Pickle of the stage-1 params (read if present).")
    flags.mark_flags_as_required(["config"])
    app.run(main)
