"""Python reward functions (`config.reward.functions`) against the in-graph verifier on
the same task: the train step's time with each, interleaved.

The task: `dataset_task` on the shipped word problems (GRPO, the default 2-layer
d_model-64 decoder, one attempt per problem). Three sides, compiled in this process and
stepped in round-robin rounds (`common.interleaved_median_times`):

* **in-graph**: the env's "numeric" verifier rewards (no Python);
* **+ callback**: the verifier's rewards plus one Python function returning 0 for every
  row (the same rewards, so the same update): the cost of the host round trip and of
  decoding the episodes;
* **Python verifier**: `reward.env_weight=0` and the env's reward computed in Python
  instead (`arl.text.verifiers.extract_number`, the host twin of the in-graph "numeric"
  check: 1 when the answer's number is the reference's, 0 when it is another, -0.1 when
  the turn holds none), so the rewards, the updates and the sampled tokens stay those of
  the in-graph side: the difference is what the callback and the functions cost;
* **two functions**: `reward.env_weight=0`, a regular-expression format function and a
  last-number correctness function (weights 0.2 and 1): other rewards, so the policy and
  its episodes drift from the other sides' (step times then differ by what the policy
  writes, not only by the rewards' cost).

"In the callback" is the mean wall time per step spent on the host inside the reward
callback (decoding the episodes and running the functions: what the device waits for),
measured by `PythonRewards.host_seconds`; less sensitive to other jobs' load than the
step's difference. The last column is the mean episode reward of each side's last step: equal on the first
three sides when the Python verifier agrees with the in-graph one.

Every side runs its update every step (`filters.skip_zero_advantage=False`: an untrained
policy's batch often has no reward spread, and a skipped update would be timed as a
faster step).

    python benchmarks/python_rewards.py [--rows 8,64] [--repeats 15] [--no-write]

Writes the "Python rewards" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def no_reward(prompts, completions, **columns):
    """0 for every row: what the callback itself costs."""
    return [0.0] * len(completions)


def correct(prompts, completions, answer, **columns):
    """The verifier's check in Python: the last number of the answer is the reference."""
    scores = []
    for completion, reference in zip(completions, answer):
        numbers = _NUMBER.findall(completion.replace(",", ""))
        scores.append(float(bool(numbers) and float(numbers[-1]) == float(reference)))
    return scores


def python_verifier(prompts, completions, answer, **columns):
    """The env's "numeric" reward in Python: 1 right, 0 wrong, -0.1 without a number."""
    from arl.text import verifiers  # pylint: disable=g-import-not-at-top

    scores = []
    for completion, reference in zip(completions, answer):
        number = verifiers.extract_number(completion)
        scores.append(-0.1 if number is None else float(
            number == verifiers.extract_number(reference)))
    return scores


def formatted(prompts, completions, **columns):
    """1 when the answer is a bare number."""
    return [1.0 if _NUMBER.fullmatch(c.strip()) else 0.0 for c in completions]


SIDES = {
    "in-graph verifier": {},
    "in-graph + Python callback": {"functions": ("python_rewards:no_reward",)},
    "Python verifier": {"functions": ("python_rewards:python_verifier",), "env_weight": 0.0},
    "Python: two functions": {"functions": ("python_rewards:correct", "python_rewards:formatted"),
                              "weights": (1.0, 0.2), "env_weight": 0.0},
}


def config_for(rows: int, reward: dict):
    from arl import config as config_lib  # pylint: disable=g-import-not-at-top
    from arl.data import word_problems  # pylint: disable=g-import-not-at-top

    c = config_lib.default_config()
    c.algorithm = "grpo"
    c.env.name = "dataset_task"
    c.env.kwargs.path = word_problems.SHIPPED_JSONL
    c.rollout.group_size = 8
    c.rollout.num_tasks = rows // 8
    c.filters.skip_zero_advantage = False  # every side updates every step
    for key, value in reward.items():
        c.reward[key] = value
    return c


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,64")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-write", dest="write", action="store_false")
    args = parser.parse_args(argv)
    import common  # pylint: disable=g-import-not-at-top,import-outside-toplevel

    from arl.trainers import TokenTrainer  # pylint: disable=g-import-not-at-top

    common.host_settings_as_the_cli()
    table = []
    for rows in [int(r) for r in args.rows.split(",")]:
        runners, compile_s, last_reward, trainers = {}, {}, {}, {}
        for name, reward in SIDES.items():
            trainer = trainers[name] = TokenTrainer(config_for(rows, reward))
            state = trainer.init_state()
            compiled, compile_s[name] = common.compile_jitted(trainer.train_step, state)
            record = lambda metrics, name=name: last_reward.__setitem__(
                name, float(metrics["reward_mean"]))
            runners[name] = common.donated_step_runner(compiled, state, on_metrics=record)
        medians = common.interleaved_median_times(runners, args.repeats)
        base = medians["in-graph verifier"]
        for name in SIDES:
            step = medians[name]
            rewards = trainers[name].python_rewards
            host = ("-" if rewards is None else
                    common.fmt_ms(rewards.host_seconds / max(rewards.host_calls, 1)))
            table.append([rows, name, common.fmt_ms(step), f"{1e3 * (step - base):+.1f}",
                          f"{100 * (step / base - 1):+.0f} %", host, f"{compile_s[name]:.1f}",
                          f"{last_reward[name]:+.4f}"])
        jax.clear_caches()
    text = common.heading("python_rewards.py") + (
        f"GRPO on `dataset_task` (shipped word problems, one attempt, 2-layer d_model-64 "
        f"decoder), median of {args.repeats} interleaved rounds:\n\n")
    text += common.markdown_table(
        ["rows", "reward", "step (ms)", "vs in-graph (ms)", "vs in-graph",
         "in the callback (ms / step)", "compile (s)",
         "reward_mean, last step"],
        table)
    common.publish("Python rewards", text + "\n", args.write)


if __name__ == "__main__":
    main()
