r"""Evaluates the newest checkpoint of a run: greedy and sampled success, transcripts.

    python -m experiments.evaluate --workdir=/tmp/run --num_tasks=128

The config is read from the checkpoint's metadata, its `imports` (modules registering
the run's own environments or algorithms) imported first. Prints a success table (one
line per environment for mixtures, plus baselines: the environment's demonstrator and
oracle, where it defines them) and a few sampled transcripts. Bad input is one line on
stderr and exit status 2 (experiments/cli.py).
"""

from __future__ import annotations

from absl import app, flags

from experiments import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by experiments.train.")
_NUM_TASKS = flags.DEFINE_integer("num_tasks", 64, "Fresh tasks per policy (one sample each).")
_NUM_TRANSCRIPTS = flags.DEFINE_integer("num_transcripts", 3, "Sampled transcripts shown.")
_SEED = flags.DEFINE_integer("seed", 12345, "Seed of the evaluation tasks.")
_BASELINES = flags.DEFINE_bool("baselines", True, "Also evaluate demonstrator and oracle.")

flags.mark_flags_as_required(["workdir"])


def main(argv):
    del argv
    import jax

    from arl import algorithm_table, rollout, trainers
    from arl import config as config_lib
    from arl.runs import evaluation

    if _NUM_TASKS.value < 1 or _NUM_TRANSCRIPTS.value < 0:
        raise app.UsageError(f"--num_tasks={_NUM_TASKS.value} must be >= 1 and "
                             f"--num_transcripts={_NUM_TRANSCRIPTS.value} >= 0")
    try:
        step, config = evaluation.checkpoint_config(_WORKDIR.value)
    except FileNotFoundError as error:
        raise app.UsageError(f"--workdir={_WORKDIR.value!r}: {error}") from error
    config_lib.import_modules(config)
    if algorithm_table.get_algorithm(config.algorithm).trainer == "vector":
        raise app.UsageError("evaluate.py evaluates token-environment policies; vector-env "
                             "runs log episode_return in metrics.jsonl during training.")
    if jax.device_count() < config.mesh[0] * config.mesh[1] * config.mesh[2]:
        config.mesh = (1, 1, 1)  # evaluation needs no particular layout
    trainer = trainers.build(config)
    step, params = evaluation.restore_params(trainer, _WORKDIR.value)
    key = jax.random.key(_SEED.value)  # the same tasks for every policy
    tables, sampled = {}, None
    for name, kwargs in [("greedy", dict(greedy=True)), ("sampled", dict(greedy=False))]:
        traj = evaluation.evaluate_policy(trainer, params, key, num_tasks=_NUM_TASKS.value,
                                          **kwargs)
        tables[name] = evaluation.success_table(trainer.env_names, traj)
        sampled = traj if name == "sampled" else sampled
    missing = []
    if _BASELINES.value:
        for source in ("demonstrator", "oracle"):
            if not trainer.env.supports_action_source(source):
                missing.append(source)
                continue
            traj = evaluation.evaluate_policy(trainer, None, key, num_tasks=_NUM_TASKS.value,
                                              greedy=False, action_source=source)
            tables[source] = evaluation.success_table(trainer.env_names, traj)
    print(f"Checkpoint step {step} of {_WORKDIR.value} ({config.algorithm} on "
          f"{config.env.name}), {_NUM_TASKS.value} tasks per policy:")
    print(evaluation.format_table(tables))
    for source in missing:
        print(f"(no {source} baseline: env {config.env.name!r} defines no {source}_action)")
    for row in range(min(_NUM_TRANSCRIPTS.value, _NUM_TASKS.value)):
        print(f"\n--- sampled transcript {row} ---")
        print(rollout.render_trajectory(trainer.env, sampled, row))


if __name__ == "__main__":
    cli.run(main)
