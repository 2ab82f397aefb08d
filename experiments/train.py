r"""Trains an agent from a config file; resumes automatically from --workdir.

    python -m experiments.train --config=configs/grpo_guess_number.py --workdir=/tmp/run \
        --config.train_steps=200 --config.rollout.group_size=8

Writes to the workdir: metrics.jsonl, TensorBoard event files, rendered sample
trajectories (samples/), orbax checkpoints (checkpoints/), and curves.png at the end.
`--export_to=DIR` then writes the trained policy as a Hugging Face directory (runs that
start from `config.model.hf_checkpoint`; `experiments.export`).
Multi-host: pass --coordinator_address, --num_processes and --process_id on every host.

A bad flag or config value ends the program before anything is compiled with one line
on stderr naming the field, the value and what is allowed (exit status 2; see
experiments/cli.py); so does a workdir another run is training in. SIGTERM or SIGINT
(Ctrl-C) stops the run after the step in progress, writes its checkpoint and ends with
one line saying so and exit status 143 or 130 (128 + the signal's number); running the
same command again resumes (docs/faults.md). Environments of your own: `--config.imports=my_pkg.my_envs` (or
`config.imports` in the config file) imports the module that registers them. The log
shows progress, warnings and errors; `--verbosity=0` adds the libraries' INFO lines.
"""

from __future__ import annotations

import sys

from absl import flags
from ml_collections import config_flags

from experiments import cli

# Unlocked, accepting new keys: `env.kwargs` / `env.params` take any of the env's
# arguments from the command line, and `arl.config.validate` rejects (with the closest
# valid key) every key that is not in the schema.
_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=False, accept_new_attributes=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (resumed if it exists).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 for jax.distributed.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-host run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_EXPORT_TO = flags.DEFINE_string(
    "export_to", None, "After training, export the policy as a Hugging Face directory here "
    "(runs from config.model.hf_checkpoint; as `python -m experiments.export`).")
_KILL_AFTER = flags.DEFINE_integer(
    "debug_kill_after_step", None,
    "Testing aid: SIGKILL this process right after the checkpoint of this step "
    "(nothing else flushed first).")

flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    config = cli.loaded_config(_CONFIG)
    import jax

    import arl
    from arl import config as config_lib

    if _COORDINATOR.value is not None:
        jax.distributed.initialize(
            coordinator_address=_COORDINATOR.value,
            num_processes=_NUM_PROCESSES.value,
            process_id=_PROCESS_ID.value)
    # Before anything runs on a device: the compilation cache and the CPU host settings
    # (arl/runs/process_settings.py; `experiment.run` calls it again, a no-op then).
    arl.setup(config)

    # Before the experiment loop's imports (orbax, tensorboardX): a bad config fails fast.
    config_lib.validate(config, num_devices=jax.device_count(), workdir=_WORKDIR.value)
    if _EXPORT_TO.value is not None:
        from absl import app  # pylint: disable=g-import-not-at-top

        from arl.runs import export  # pylint: disable=g-import-not-at-top
        if not config.model.get("hf_checkpoint", ""):
            raise app.UsageError(f"--export_to={_EXPORT_TO.value!r} exports next to "
                                 "config.model.hf_checkpoint, which this config does not set")
        export.check_target(_EXPORT_TO.value, "--export_to")
    from arl.runs import experiment, preemption, workdir_lock

    try:
        experiment.run(config, _WORKDIR.value, kill_after_step=_KILL_AFTER.value)
    except workdir_lock.WorkdirInUseError as error:
        cli.fail(error)
    except preemption.Preempted as stopped:
        sys.stderr.write(f"{cli.program_name()}: {stopped}\n")
        sys.stderr.flush()
        sys.exit(stopped.exit_code)
    if _EXPORT_TO.value is not None and jax.process_index() == 0:
        step, path, changed = export.export_run(_WORKDIR.value, _EXPORT_TO.value)
        print(f"Exported step {step} of {_WORKDIR.value} to {path}"
              + (f" (config.json changed: {sorted(changed)})" if changed else ""))


if __name__ == "__main__":
    cli.run(main)
