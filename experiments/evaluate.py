r"""Evaluates the newest checkpoint of a run: greedy and sampled success, transcripts.

    python -m experiments.evaluate --workdir=/tmp/run --num_tasks=128
    python -m experiments.evaluate --workdir=/tmp/run --split=eval   # dataset_task runs

The config is read from the checkpoint's metadata, its `imports` (modules registering
the run's own environments or algorithms) imported first. Prints a success table (one
line per environment for mixtures, plus baselines: the environment's demonstrator and
oracle, where it defines them) and a few sampled transcripts. With `--split` (runs of
`dataset_task`), every row of that split of the run's dataset is played exactly once, in
row order (`DatasetTask.split_tasks()`), instead of `--num_tasks` fresh tasks: "eval"
scores the held-out rows. The newest checkpoint whose checksums verify is evaluated (a
corrupt one is skipped with one warning; docs/faults.md). Bad input is one line on
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
_SPLIT = flags.DEFINE_enum("split", None, ["train", "eval"],
                           "dataset_task runs: play every row of this split once (default: "
                           "--num_tasks fresh tasks of the run's env).")

flags.mark_flags_as_required(["workdir"])


def main(argv):
    del argv
    import jax

    import arl
    from arl import algorithm_table
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
    if _SPLIT.value is not None and config.env.name != "dataset_task":
        raise app.UsageError(f"--split={_SPLIT.value!r} plays the rows of a dataset; the run's "
                             f"env is {config.env.name!r}, not 'dataset_task'")
    arl.setup(config)  # the compilation cache and the CPU host settings
    trainer = evaluation.trainer_for_checkpoint(config)
    try:
        step, params = evaluation.restore_params(trainer, _WORKDIR.value)
    except FileNotFoundError as error:  # every step corrupt (each warned about)
        raise app.UsageError(f"--workdir={_WORKDIR.value!r}: {error}") from error
    key = jax.random.key(_SEED.value)  # the same tasks for every policy
    env, play = trainer.env, None
    num_tasks = _NUM_TASKS.value
    if _SPLIT.value is not None:
        env, play = _split_player(trainer, config, _SPLIT.value)
        num_tasks = env.num_rows
    tables, sampled = {}, None
    for name, greedy in [("greedy", True), ("sampled", False)]:
        if play is None:
            traj = evaluation.evaluate_policy(trainer, params, key, num_tasks=num_tasks,
                                              greedy=greedy)
        else:
            traj = play(params, key, greedy=greedy)
        tables[name] = evaluation.success_table(trainer.env_names, traj)
        sampled = traj if name == "sampled" else sampled
    missing = []
    if _BASELINES.value:
        for source in ("demonstrator", "oracle"):
            if not env.supports_action_source(source):
                missing.append(source)
                continue
            if play is None:
                traj = evaluation.evaluate_policy(trainer, None, key, num_tasks=num_tasks,
                                                  greedy=False, action_source=source)
            else:
                traj = play(None, key, greedy=False, action_source=source)
            tables[source] = evaluation.success_table(trainer.env_names, traj)
    what = (f"{num_tasks} tasks per policy" if play is None else
            f"every row of the {_SPLIT.value!r} split once ({num_tasks} rows) per policy")
    print(f"Checkpoint step {step} of {_WORKDIR.value} ({config.algorithm} on "
          f"{config.env.name}), {what}:")
    print(evaluation.format_table(tables))
    for source in missing:
        print(f"(no {source} baseline: env {config.env.name!r} defines no {source}_action)")
    for row in range(min(_NUM_TRANSCRIPTS.value, num_tasks)):
        print(f"\n--- sampled transcript {row} ---")
        print(evaluation.render_episode(env, sampled, row, evaluation.history_window(trainer)))


def _split_player(trainer, config, split: str):
    """(the run's dataset_task on `split`, play(params, key, greedy, action_source)):
    a rollout of every row of the split once, in row order, with the run's env params."""
    import functools

    import jax

    from arl import envs, rollout
    from arl.errors import ConfigError
    from arl.runs import evaluation

    env_config = config.env.to_dict() if hasattr(config.env, "to_dict") else dict(config.env)
    env_config["kwargs"] = {**dict(env_config.get("kwargs") or {}), "split": split}
    env = envs.make_env(env_config, codec=envs.checkpoint_codec(config))
    if rollout.context_length(env) > trainer.context_length:
        raise ConfigError(f"--split={split!r}: its rows need a context of "
                          f"{rollout.context_length(env)} tokens, more than the run's "
                          f"{trainer.context_length}")
    run_params = jax.tree.map(lambda x: x[0], trainer.task_params(1, 1))
    keys, env_params = env.split_tasks(params=run_params)

    @functools.partial(jax.jit, static_argnames=("greedy", "action_source"))
    def rows(params, key, greedy, action_source):
        model = trainer.model if action_source == "model" else None
        play = evaluation.player(evaluation.history_window(trainer))  # as the run played
        return play(env, key, num_tasks=env.num_rows, group_size=1, model=model,
                    params=params, sampling=trainer.sampling.replace(greedy=greedy),
                    action_source=action_source, reset_keys=keys, env_params=env_params)

    def play(params, key, greedy, action_source="model"):
        return jax.device_get(rows(params, key, greedy=greedy, action_source=action_source))

    return env, play


if __name__ == "__main__":
    cli.run(main)
