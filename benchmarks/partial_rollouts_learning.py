"""Partial rollouts: learning parity. Success curves at equal trained episodes, lockstep
rollouts against slots with partial rollouts (`rollout.carried_groups`,
`rollout.max_staleness`; `arl.rollout.partial_rollouts.partial_slot_rollout`).

    python benchmarks/partial_rollouts_learning.py [--envs bandit,guess_number]
        [--seeds 3] [--steps N] [--tiny] [--no-write]

Envs: the shipped `configs/grpo_bandit.py` and `configs/grpo_guess_number.py` as they
are (their train_steps, warm start and model; `--steps` overrides train_steps for every
arm alike). Arms:

    lockstep    the shipped config as is (lockstep rollouts, no off-policy correction);
    partial s1  rollout.schedule="slots", num_slots = half of num_tasks * group_size,
                carried_groups = half of num_tasks, max_staleness = 1,
                loss.off_policy_correction = "tis";
    partial s2  the same with max_staleness = 2.

Every step trains num_tasks * group_size episodes in every arm, so equal steps are equal
trained episodes. Seeds: config.seed = 0 .. --seeds - 1, every arm each. Per env and arm
the table gives the rollouts' success_rate over the first and the last 10 RL steps (mean
over seeds, and the min-max across seeds), the partial arms' mean token staleness
(`off_policy/token_staleness_mean`), carried and restarted episodes per step, and wall
seconds per run (warm start and compilation included). "Within noise": an arm's
seed-mean last-10 success lies inside the [min, max] of the lockstep seeds' last-10
success. Runs are in-process, one after another (`arl.trainers.build`, `init_state`,
`warm_start`, `train_step`), no checkpoints.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs
import common  # noqa: E402  pylint: disable=wrong-import-position

import numpy as np  # noqa: E402  pylint: disable=wrong-import-position

SECTION = "Partial rollouts: learning parity"
ENVS = {"bandit": "grpo_bandit", "guess_number": "grpo_guess_number"}
ARMS = ("lockstep", "partial s1", "partial s2")
WINDOW = 10
PARTIAL_KEYS = ("off_policy/token_staleness_mean", "off_policy/token_staleness_max",
                "rollout/carried_episodes", "rollout/restarted_episodes")


def arm_config(env: str, arm: str, seed: int, steps: int | None, tiny: bool):
    """The shipped config of `env`, changed for `arm` and `seed`."""
    c = importlib.import_module(f"configs.{ENVS[env]}").get_config()
    c.seed = seed
    if tiny:
        c.train_steps = 3
        c.warm_start.sft_steps = min(c.warm_start.sft_steps, 2)
    elif steps:
        c.train_steps = steps
    if arm != "lockstep":
        r = c.rollout
        r.schedule = "slots"
        r.num_slots = max(1, r.num_tasks * r.group_size // 2)
        r.carried_groups = max(1, r.num_tasks // 2)
        r.max_staleness = {"partial s1": 1, "partial s2": 2}[arm]
        c.loss.off_policy_correction = "tis"
    return c


def run_one(config, log) -> dict:
    """One training run: per-step success_rate and the partial-rollout metrics, seconds."""
    import jax  # pylint: disable=import-outside-toplevel
    from arl import config as config_lib  # pylint: disable=import-outside-toplevel
    from arl import trainers  # pylint: disable=import-outside-toplevel

    start = time.perf_counter()
    config_lib.validate(config, num_devices=jax.device_count())
    trainer = trainers.build(config)
    state = trainer.init_state()
    if config.warm_start.sft_steps > 0:
        state = trainer.warm_start(state, log=lambda s: None)
    history = []
    for step in range(1, config.train_steps + 1):
        state, metrics = trainer.train_step(state)
        wanted = {k: v for k, v in metrics.items()
                  if k == "success_rate" or k in PARTIAL_KEYS or k.startswith("off_policy/")}
        history.append({k: float(v) for k, v in jax.device_get(wanted).items()})
        if step % 10 == 0 or step == config.train_steps:
            recent = [h["success_rate"] for h in history[-10:]]
            log(f"    step {step}/{config.train_steps} ({time.perf_counter() - start:.0f} s): "
                f"success (last 10) "
                f"{np.mean(recent):.3f}" + "".join(
                    f", {k.split('/')[1]} {history[-1][k]:.3g}"
                    for k in PARTIAL_KEYS[:1] + PARTIAL_KEYS[2:] if k in history[-1]))
    jax.block_until_ready(state)
    return {"history": history, "seconds": time.perf_counter() - start}


def summarize(runs: list[dict], window: int) -> dict:
    success = np.array([[h["success_rate"] for h in r["history"]] for r in runs])
    first = success[:, :window].mean(axis=1)
    last = success[:, -window:].mean(axis=1)

    def mean_of(key):
        values = [np.mean([h[key] for h in r["history"]]) for r in runs
                  if key in r["history"][0]]
        return float(np.mean(values)) if values else None

    def max_of(key):
        values = [max(h[key] for h in r["history"]) for r in runs if key in r["history"][0]]
        return float(max(values)) if values else None

    off_policy = sorted({k for r in runs for k in r["history"][0]
                         if k.startswith("off_policy/") and k not in PARTIAL_KEYS})
    return {"first": first, "last": last, "seconds": [r["seconds"] for r in runs],
            "staleness": mean_of(PARTIAL_KEYS[0]), "staleness_max": max_of(PARTIAL_KEYS[1]),
            "carried": mean_of(PARTIAL_KEYS[2]), "restarted": mean_of(PARTIAL_KEYS[3]),
            "off_policy": {k: mean_of(k) for k in off_policy}}


def spread(values: np.ndarray) -> str:
    return f"{values.mean():.3f} ({values.min():.3f}–{values.max():.3f})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", default=",".join(ENVS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0,
                        help="train_steps of every run (0: the shipped config's)")
    parser.add_argument("--tiny", action="store_true",
                        help="3 RL steps, 2 warm-start steps, one seed (a script check)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    envs = args.envs.split(",")
    unknown = [e for e in envs if e not in ENVS]
    if unknown:
        raise SystemExit(f"--envs: unknown {unknown}; choose from {list(ENVS)}")
    seeds = list(range(1 if args.tiny else args.seeds))
    window = 1 if args.tiny else WINDOW

    from arl.runs import process_settings  # pylint: disable=import-outside-toplevel
    process_settings.setup()  # as a run: compilation cache, CPU host settings
    load_before = common.load_average()
    rows, verdicts, verdicts_extra, details, steps_of = [], [], [], [], {}
    for env in envs:
        summaries, histories = {}, {}
        for arm in ARMS:
            runs = []
            for seed in seeds:
                config = arm_config(env, arm, seed, args.steps, args.tiny)
                steps_of[env] = config.train_steps
                print(f"{env} / {arm} / seed {seed}: {config.train_steps} steps, warm start "
                      f"{config.warm_start.sft_steps}", flush=True)
                runs.append(run_one(config, log=lambda s: print(s, flush=True)))
                print(f"    {runs[-1]['seconds']:.0f} s", flush=True)
            summaries[arm] = summarize(runs, window)
            histories[arm] = [r["history"] for r in runs]
        if histories["partial s2"] == histories["partial s1"]:
            verdicts_extra.append(
                f"- {env}: partial s2 ran bit for bit as partial s1 (every seed, every "
                "metric): no group was carried past a second step (token staleness max "
                f"{summaries['partial s2']['staleness_max']:.0f}, restarts "
                f"{summaries['partial s2']['restarted']:.0f}), so max_staleness 2 never "
                "acted differently from 1 at these sizes.")
        lock_last = summaries["lockstep"]["last"]
        low, high = float(lock_last.min()), float(lock_last.max())
        for arm in ARMS:
            s = summaries[arm]
            partial = arm != "lockstep"
            rows.append([env, arm, spread(s["first"]), spread(s["last"]),
                         f"{s['staleness']:.2f} (max {s['staleness_max']:.0f})"
                         if partial else "–",
                         f"{s['carried']:.1f}" if partial else "–",
                         f"{s['restarted']:.1f}" if partial else "–",
                         f"{np.mean(s['seconds']):.0f}"])
            if partial:
                mean_last = float(s["last"].mean())
                inside = low <= mean_last <= high
                verdicts.append(
                    f"- {env}, {arm}: last-{window} success {mean_last:.3f} "
                    f"{'inside' if inside else 'outside'} the lockstep seeds' "
                    f"[{low:.3f}, {high:.3f}] ({'within noise' if inside else 'NOT within noise'}"
                    f"; lockstep mean {lock_last.mean():.3f}, difference "
                    f"{mean_last - lock_last.mean():+.3f}).")
            if s["off_policy"]:
                details.append(f"- {env}, {arm}: " + ", ".join(
                    f"{k.split('/', 1)[1]} {v:.3g}" for k, v in s["off_policy"].items()
                    if v is not None))
    load_after = common.load_average()

    table = common.markdown_table(
        ["env", "arm", f"success, first {window} steps (seed min–max)",
         f"success, last {window} steps (seed min–max)", "token staleness mean (max)",
         "carried episodes / step", "restarted episodes / step", "s / run"], rows)
    steps_text = ", ".join(f"{env} {n} RL steps" for env, n in steps_of.items())
    text = (common.heading("partial_rollouts_learning.py")
            + f"Shipped configs (`configs/grpo_bandit.py`, `configs/grpo_guess_number.py`) "
            f"with their warm starts; {steps_text}; seeds {seeds}, every arm each. "
            "`lockstep`: the shipped config as is (lockstep rollouts, no off-policy "
            "correction). `partial sK`: rollout.schedule=\"slots\", num_slots = half of "
            "num_tasks*group_size, carried_groups = num_tasks/2, max_staleness K, "
            "loss.off_policy_correction=\"tis\". Every step trains num_tasks*group_size "
            "episodes in every arm (equal steps = equal trained episodes). Success: the "
            f"rollouts' success_rate, mean over the first/last {window} RL steps of each "
            "seed, then mean over seeds (min–max across seeds in brackets). Staleness: "
            "versions between an agent token's sampling parameters and the trained ones, "
            "mean over steps and seeds (max over all). Seconds per run include the warm "
            f"start and compilation, runs one after another; load average {load_before:.1f} "
            f"before, {load_after:.1f} after.\n\n"
            + table + "\n\nWithin noise = the partial arm's seed-mean last-"
            f"{window} success lies inside the lockstep seeds' [min, max]:\n\n"
            + "\n".join(verdicts + verdicts_extra)
            + "\n\nOff-policy metrics of the update (mean over steps and seeds):\n\n"
            + "\n".join(details) + "\n")
    common.publish(SECTION, text, write=not args.no_write and not args.tiny)


if __name__ == "__main__":
    main()
