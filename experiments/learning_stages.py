r"""Two-stage learning demonstration (docs/learning.md): SFT on the environment's
*weaker* demonstrator alone, then RL (+ a small alpha*SFT floor) from the SFT weights.

Reports, on the same fresh tasks: the random (untrained) policy, the demonstrator, the
oracle, the policy after SFT alone and after SFT + RL, sampled (temperature 1) and greedy;
for a mixture (`env.name = "mixture"`) also each member's success (`*_members`). The RL
stage's per-step metrics are the curve (`--curve_csv`).

    python -m experiments.learning_stages --config=configs/grpo_guess_number.py \
        --sft_steps=200 --config.train_steps=200

Stage 1 is `arl.trainers.warm_start.sft_warm_start` with the config's `warm_start` section
(behaviour cloning of the trainer's model, AdamW at `warm_start.sft_lr`, batches of
`warm_start.sft_batch` demonstrations generated on the fly; the flags override it), the
same stage `experiments.train` runs before RL; stage 2 is `TokenTrainer.train_step` with the
config as given, starting from the stage-1 parameters (`arl.trainers.warm_start.start_state`:
fresh optimizer state, KL reference = the SFT weights). With `--config.model.lora_rank=8`
stage 1 still trains all weights and they become stage 2's frozen base (and KL
reference), on which the adapters are trained. `--sft_cache` keeps stage 1's weights
with a fingerprint of everything they depend on (`stage1_fingerprint`) and refuses a
cache written for another stage 1.
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

# Per-step metrics kept in `run_stages`'s "rl_curve" besides success (overall and per
# member): the rollouts' and, where the algorithm logs them, the update's.
CURVE_METRICS = ("reward_mean", "turns_mean", "entropy", "format_error_rate",
                 "response_tokens_mean", "loss/policy", "loss/value", "grad_norm")


def evaluation_metrics(trainer: TokenTrainer, params, *, greedy: bool, rounds: int = 4,
                       seed: int = 12345) -> dict[str, float]:
    """Every `trainer.evaluate` metric (success_rate, turns_mean, and for a mixture
    success_rate/<i>_<name> ...) averaged over `rounds` x (num_tasks * group_size) fresh
    tasks. The rounds have equal sizes and every member the same share of the rows
    (row b runs member b % members), so the per-member means are exact too."""
    totals: dict[str, float] = {}
    for r in range(rounds):
        metrics, _ = trainer.evaluate(params, jax.random.key(seed + r), greedy=greedy)
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + float(value) / rounds
    return totals


def evaluate(trainer: TokenTrainer, params, *, greedy: bool, rounds: int = 4, seed: int = 12345):
    """Success rate and mean turns over `rounds` x (num_tasks * group_size) fresh tasks."""
    metrics = evaluation_metrics(trainer, params, greedy=greedy, rounds=rounds, seed=seed)
    return metrics["success_rate"], metrics["turns_mean"]


def member_success(trainer: TokenTrainer, metrics) -> dict[str, float]:
    """{"<i>_<name>": success} of a mixture's members from `metrics` (the trainer's
    `success_rate/<i>_<name>` entries); {} for a single environment."""
    if trainer.num_envs < 2:
        return {}
    return {name: float(metrics[f"success_rate/{name}"]) for name in trainer.env_names}


def scripted_rollout(trainer: TokenTrainer, source: str, num_tasks: int = 1024,
                     seed: int = 7):
    """`num_tasks` episodes of the env's scripted `source` ("demonstrator" or "oracle")."""
    return rollout_lib.rollout(
        trainer.env, jax.random.key(seed), num_tasks=num_tasks, group_size=1,
        action_source=source, env_params=trainer.task_params(num_tasks, 1))


def scripted(trainer: TokenTrainer, source: str, num_tasks: int = 1024, seed: int = 7):
    """(success rate, mean turns) of `num_tasks` scripted episodes of `source`."""
    traj = scripted_rollout(trainer, source, num_tasks, seed)
    return (float(np.mean(np.asarray(traj.success))),
            float(np.mean(np.asarray(traj.num_turns))))


def stage1_fingerprint(config, *, steps: int, batch_size, learning_rate, source) -> str:
    """Everything stage 1's weights depend on, as canonical JSON: the environment
    section, the model, the seed, the optimizer's fields other than the RL learning-rate
    schedule, and the SFT steps, batch, learning rate and source as resolved. Not the
    algorithm (a PPO value head is added or dropped on loading, see
    `arl.trainers.warm_start.match_value_head`) nor anything of stage 2."""
    optim = {k: v for k, v in config.optim.to_dict().items()
             if k not in ("learning_rate", "schedule", "warmup_steps")}
    return json.dumps({
        "env": config.env.to_dict(), "model": config.model.to_dict(),
        "seed": int(config.seed), "optim": optim,
        "sft": {"steps": int(steps), "batch_size": batch_size,
                "learning_rate": learning_rate,
                "source": source or config.loss.sft_source},
    }, sort_keys=True, default=repr)


def read_stage1_cache(path: str, fingerprint: str, log=print):
    """The params of a stage-1 cache written by `write_stage1_cache`. Raises ValueError
    naming `sft_cache` when the cache was written for another stage 1 (see
    `stage1_fingerprint`); a bare params pickle (the format before the fingerprint) is
    read with a warning that it cannot be checked."""
    with open(path, "rb") as f:
        stored = pickle.load(f)
    if isinstance(stored, dict) and set(stored) == {"stage1", "params"}:
        if stored["stage1"] != fingerprint:
            ours, theirs = json.loads(fingerprint), json.loads(stored["stage1"])
            differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
            raise ValueError(
                f"sft_cache={path!r} holds the weights of another stage 1 (it differs in "
                f"{differ}); delete it or name another file.")
        params = stored["params"]
    else:
        log(f"warning: sft_cache={path!r} has no stage-1 fingerprint (an older cache): "
            "it is used unchecked")
        params = stored
    return jax.tree.map(jnp.asarray, params)


def write_stage1_cache(path: str, fingerprint: str, params) -> None:
    with open(path, "wb") as f:
        pickle.dump({"stage1": fingerprint, "params": jax.tree.map(np.asarray, params)}, f)


def write_curve_csv(path: str, curve: list[dict[str, float]]) -> None:
    """The RL stage's per-step metrics (`run_stages`'s "rl_curve"), one row per step
    (columns: step, then the metric names of the first row)."""
    names = list(curve[0]) if curve else []
    with open(path, "w") as f:
        f.write(",".join(["step"] + names) + "\n")
        for i, row in enumerate(curve):
            f.write(",".join([str(i + 1)] + [f"{row[n]:.6g}" for n in names]) + "\n")


def stage1_params(trainer: TokenTrainer, init_params, *, steps: int, batch_size,
                  learning_rate, source, sft_cache: str = "", log=print):
    """Stage 1's policy params: read from `sft_cache` when it exists (and was written for
    this stage 1), else `steps` SFT steps from the trainer's initial params (written to
    `sft_cache` if named). The value head is then made to match `init_params` (the
    trainer's: a critic-free run's cache serves PPO, whose head starts as initialised)."""
    config = trainer.config
    fingerprint = stage1_fingerprint(config, steps=steps, batch_size=batch_size,
                                     learning_rate=learning_rate, source=source)
    if sft_cache and os.path.exists(sft_cache):  # a tuning aid: reuse stage 1
        params = read_stage1_cache(sft_cache, fingerprint, log=log)
    else:
        params = warm_start_lib.sft_warm_start(
            trainer, steps, seed=config.seed, batch_size=batch_size,
            learning_rate=learning_rate, source=source, log=log)
        if sft_cache:
            write_stage1_cache(sft_cache, fingerprint, params)
    return warm_start_lib.match_value_head(params, init_params)


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
    demo = scripted_rollout(trainer, "demonstrator")
    out["demonstrator"] = (float(np.mean(np.asarray(demo.success))),
                           float(np.mean(np.asarray(demo.num_turns))))
    out["oracle"] = scripted(trainer, "oracle")
    if trainer.num_envs > 1:
        env_ids, success = np.asarray(demo.env_ids), np.asarray(demo.success)
        out["demonstrator_members"] = {
            name: float(np.mean(success[env_ids == i]))
            for i, name in enumerate(trainer.env_names)}
    del demo
    init = trainer.init_state()
    init_params = trainer.policy_params(init)
    random_metrics = evaluation_metrics(trainer, init_params, greedy=False,
                                        rounds=eval_rounds)
    out["random_sampled"] = (random_metrics["success_rate"], random_metrics["turns_mean"])
    log(f"baselines {json.dumps(out)}")

    t0 = time.time()
    params = stage1_params(trainer, init_params, steps=sft_steps, batch_size=sft_batch,
                           learning_rate=sft_lr, source=ws["source"], sft_cache=sft_cache,
                           log=log)
    del init, init_params
    out["sft_wall_s"] = time.time() - t0
    for mode in ("sampled", "greedy"):
        metrics = evaluation_metrics(trainer, params, greedy=mode == "greedy",
                                     rounds=eval_rounds)
        out[f"sft_{mode}"] = (metrics["success_rate"], metrics["turns_mean"])
        if trainer.num_envs > 1:
            out[f"sft_{mode}_members"] = member_success(trainer, metrics)
    log(f"after SFT ({out['sft_wall_s']:.0f}s): sampled {out['sft_sampled']} "
        f"greedy {out['sft_greedy']}")

    # The SFT weights become the policy and KL reference (under LoRA the frozen base).
    state = warm_start_lib.start_state(trainer, params)
    t0 = time.time()
    history, curve = [], []
    for i in range(rl_steps):
        state, metrics = trainer.train_step(state)
        history.append(float(metrics["success_rate"]))
        row = {"success_rate": history[-1],
               **{f"success_rate/{k}": v for k, v in member_success(trainer, metrics).items()}}
        row.update({k: float(metrics[k]) for k in CURVE_METRICS if k in metrics})
        curve.append(row)
        if (i + 1) % 10 == 0:
            members = "".join(
                f" {k} {np.mean([r[f'success_rate/{k}'] for r in curve[-10:]]):.3f}"
                for k in member_success(trainer, metrics))
            log(f"rl step {i + 1} success {np.mean(history[-10:]):.3f}{members} "
                f"turns {float(metrics['turns_mean']):.2f} "
                f"entropy {float(metrics['entropy']):.3f} "
                f"({time.time() - t0:.0f}s)")
    out["rl_wall_s"] = time.time() - t0
    out["rl_history"] = history
    out["rl_curve"] = curve
    out["rl_last10_sampled"] = float(np.mean(history[-10:])) if history else None
    policy = trainer.policy_params(state)
    for mode in ("sampled", "greedy"):
        metrics = evaluation_metrics(trainer, policy, greedy=mode == "greedy",
                                     rounds=eval_rounds)
        out[f"rl_{mode}"] = (metrics["success_rate"], metrics["turns_mean"])
        if trainer.num_envs > 1:
            out[f"rl_{mode}_members"] = member_success(trainer, metrics)
    log(f"after SFT+RL ({out['rl_wall_s']:.0f}s): sampled {out['rl_sampled']} "
        f"greedy {out['rl_greedy']}")
    return out, state


def main(argv):
    del argv
    from absl import flags  # pylint: disable=g-import-not-at-top

    from experiments import cli  # pylint: disable=g-import-not-at-top

    config = cli.loaded_config(flags.FLAGS["config"])
    import arl  # pylint: disable=g-import-not-at-top

    arl.setup(config)  # the compilation cache and the CPU host settings
    steps = flags.FLAGS.sft_steps
    settings = dict(sft_steps=steps if steps >= 0 else None,
                    sft_batch=flags.FLAGS.sft_batch or None,
                    sft_lr=flags.FLAGS.sft_lr or None)
    result, _ = run_stages(config, **settings, sft_cache=flags.FLAGS.sft_cache,
                           log=lambda s: print(s, flush=True))
    result.pop("rl_history")
    curve = result.pop("rl_curve")
    if flags.FLAGS.curve_csv:
        write_curve_csv(flags.FLAGS.curve_csv, curve)
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
    flags.DEFINE_string("sft_cache", "", "Pickle of the stage-1 params (read if present and "
                        "written for the same stage 1, written otherwise).")
    flags.DEFINE_string("curve_csv", "", "Write the RL stage's per-step metrics (rollout "
                        "success, per mixture member too; losses) to this CSV.")
    flags.mark_flags_as_required(["config"])
    cli.run(main)
