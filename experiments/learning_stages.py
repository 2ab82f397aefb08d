r"""Two-stage learning demonstration (docs/learning.md): SFT on the environment's
*weaker* demonstrator alone, then RL (+ a small alpha*SFT floor) from the SFT weights.

Reports, on the same fresh tasks: the random (untrained) policy, the demonstrator, the
oracle, the policy after SFT alone and after SFT + RL, sampled (temperature 1) and greedy.

    python -m experiments.learning_stages --config=configs/grpo_guess_number.py \
        --sft_steps=200 --config.train_steps=200

Stage 1 is `arl.trainers.warm_start.sft_warm_start` with the config's `warm_start` section
(behaviour cloning of the trainer's model, AdamW at `warm_start.sft_lr`, batches of
`warm_start.sft_batch` demonstrations generated on the fly; the flags override it), the
same stage `experiments.train` runs before RL; stage 2 is `TokenTrainer.train_step` with the
config as given, starting from the stage-1 parameters (`arl.trainers.warm_start.start_state`:
fresh optimizer state, KL reference = the SFT weights). With `--config.model.lora_rank=8`
stage 1 still trains all weights and they become stage 2's frozen base (and KL
reference), on which the adapters are trained.
"""

from __future__ import annotations

import json
import os
import pickle
import time

import jax
import jax.numpy as jnp
import numpy as np

from arl import rollout as rollout_lib
from arl.trainers import warm_start as warm_start_lib
from arl.trainers import TokenTrainer


def evaluate(trainer: TokenTrainer, params, *, greedy: bool, rounds: int = 4, seed: int = 12345):
    """Success rate and mean turns over `rounds` x (num_tasks * group_size) fresh tasks."""
    success, turns = [], []
    for r in range(rounds):
        metrics, _ = trainer.evaluate(params, jax.random.key(seed + r), greedy=greedy)
        success.append(float(metrics["success_rate"]))
        turns.append(float(metrics["turns_mean"]))
    return float(np.mean(success)), float(np.mean(turns))


def scripted(trainer: TokenTrainer, source: str, num_tasks: int = 1024, seed: int = 7):
    traj = rollout_lib.rollout(
        trainer.env, jax.random.key(seed), num_tasks=num_tasks, group_size=1,
        action_source=source, env_params=trainer.task_params(num_tasks, 1))
    return (float(np.mean(np.asarray(traj.success))),
            float(np.mean(np.asarray(traj.num_turns))))


def run_stages(config, *, sft_steps: int | None = None, rl_steps: int | None = None,
               log=print, eval_rounds: int = 4, sft_batch: int | None = None, sft_lr=None,
               sft_cache: str = ""):
    """Runs both stages; returns a dict of every measured number. `sft_steps`,
    `sft_batch`, `sft_lr` (None: from `config.warm_start`) override the config."""
    ws = warm_start_lib.settings(config)
    sft_steps = ws["steps"] if sft_steps is None else sft_steps
    sft_batch = sft_batch or ws["batch_size"]
    sft_lr = sft_lr or ws["learning_rate"]
    rl_steps = config.train_steps if rl_steps is None else rl_steps
    trainer = TokenTrainer(config)
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
        params = warm_start_lib.sft_warm_start(
            trainer, sft_steps, seed=config.seed, batch_size=sft_batch,
            learning_rate=sft_lr, source=ws["source"], log=log)
        if sft_cache:
            with open(sft_cache, "wb") as f:
                pickle.dump(jax.tree.map(np.asarray, params), f)
    out["sft_wall_s"] = time.time() - t0
    out["sft_sampled"] = evaluate(trainer, params, greedy=False, rounds=eval_rounds)
    out["sft_greedy"] = evaluate(trainer, params, greedy=True, rounds=eval_rounds)
    log(f"after SFT ({out['sft_wall_s']:.0f}s): sampled {out['sft_sampled']} "
        f"greedy {out['sft_greedy']}")

    # The SFT weights become the policy and KL reference (under LoRA the frozen base).
    state = warm_start_lib.start_state(trainer, params)
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


def main(argv):
    del argv
    from absl import flags  # pylint: disable=g-import-not-at-top

    from experiments import cli  # pylint: disable=g-import-not-at-top

    config = cli.loaded_config(flags.FLAGS["config"])
    steps = flags.FLAGS.sft_steps
    settings = dict(sft_steps=steps if steps >= 0 else None,
                    sft_batch=flags.FLAGS.sft_batch or None,
                    sft_lr=flags.FLAGS.sft_lr or None)
    result, _ = run_stages(config, **settings, sft_cache=flags.FLAGS.sft_cache,
                           log=lambda s: print(s, flush=True))
    result.pop("rl_history")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    from absl import flags
    from ml_collections import config_flags

    from experiments import cli

    config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                    lock_config=False, accept_new_attributes=True)
    flags.DEFINE_integer("sft_steps", -1,
                         "Behaviour-cloning steps before RL (-1: config.warm_start).")
    flags.DEFINE_integer("sft_batch", 0,
                         "Demonstrations per SFT step (0: config.warm_start, else the RL batch).")
    flags.DEFINE_float("sft_lr", 0.0,
                       "SFT learning rate (0: config.warm_start, else optim.learning_rate).")
    flags.DEFINE_string("sft_cache", "", "Pickle of the stage-1 params (read if present).")
    flags.mark_flags_as_required(["config"])
    cli.run(main)
