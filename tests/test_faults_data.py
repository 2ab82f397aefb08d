"""Faults a run meets, injected for real (docs/faults.md): NaN/inf rewards and
out-of-range token ids from a user env (tests/faulty_envs.py), a garbled newest
checkpoint under `evaluate`/`export`, a workdir of another model, a full disk. Each ends
in one clear line (or a skipped update) and nothing non-finite is checkpointed.

The guard's own logic and the in-graph counts are checked without compiling a trainer;
one token run per fault kind compiles (the NaN stop in the default suite, the rest
slow)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl import trainers
from arl.errors import ConfigError
from arl.runs import checkpoint, evaluation, experiment, run_guards, writers
from arl.trainers import guards
from tests import user_env_config

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ in-graph counts


def test_rollout_faults_count_per_env():
    rewards = jnp.array([[0.0, jnp.nan, 1.0], [jnp.inf, -jnp.inf, 0.0],
                         [1.0, 0.0, 0.0], [jnp.nan, 0.0, 0.0]])
    tokens = jnp.array([[1, 2, 3], [4, 99, -1], [7, 8, 100], [0, 0, 0]])
    faults = jax.jit(lambda r, t, e: guards.rollout_faults(
        r, ("calc", "chat"), env_ids=e, tokens=t, vocab_size=99))(
            rewards, tokens, jnp.array([0, 1, 1, 0]))
    assert jax.device_get(faults) == {
        "faults/nonfinite_rewards/calc": 2.0, "faults/nonfinite_rewards/chat": 2.0,
        "faults/token_ids_out_of_range/calc": 0.0,
        "faults/token_ids_out_of_range/chat": 3.0}
    assert not bool(guards.inputs_finite(faults))
    clean = guards.rollout_faults(jnp.zeros((2, 3)), ("one",), tokens=jnp.ones((2, 3), int),
                                  vocab_size=2)
    assert bool(guards.inputs_finite(clean))
    update = guards.update_faults(nonfinite_loss=jnp.float32(1.5),
                                  nonfinite_grads=jnp.float32(jnp.inf))
    assert jax.device_get(update) == {"faults/nonfinite_loss": 0.0,
                                      "faults/nonfinite_grads": 1.0}
    assert bool(guards.update_failed(update))
    kept = guards.keep_unless(jnp.bool_(True), {"w": jnp.full(2, jnp.nan)}, {"w": jnp.ones(2)})
    np.testing.assert_array_equal(kept["w"], [1.0, 1.0])


# ------------------------------------------------------------------ the host guard


def _metrics(**faults):
    return {"loss/total": jnp.float32(0.5), **{f"faults/{k}": jnp.float32(v)
                                               for k, v in faults.items()}}


def test_guard_stops_naming_env_step_and_quantity_and_logs_no_fault_keys():
    guard = run_guards.NonFiniteGuard("stop")
    clean = guard.step_done(1, _metrics(**{"nonfinite_rewards/calc": 0}))
    assert list(clean) == ["loss/total"]
    # Step 2's counts are read when step 3 is done (the device is not stalled) ...
    guard.step_done(2, _metrics(**{"nonfinite_rewards/calc": 0,
                                   "token_ids_out_of_range/chat": 3, "nonfinite_loss": 1}))
    with pytest.raises(run_guards.NonFiniteStep,
                       match=r"^step 2: env 'chat' replied with token ids outside the "
                             r"model's vocabulary \(3 tokens\); the loss was NaN or inf\. "
                             r"The run stopped before checkpointing step 2"):
        guard.step_done(3, _metrics())
    # ... or at once before a checkpoint or a logged record.
    guard = run_guards.NonFiniteGuard("stop")
    guard.step_done(5, _metrics(**{"nonfinite_rewards/calc": 4}))
    with pytest.raises(run_guards.NonFiniteStep,
                       match=r"step 5: env 'calc' returned non-finite rewards \(4 values\)"):
        guard.check()
    guard.check()  # reported once


def test_guard_under_skip_warns_once_per_skipped_step(caplog):
    guard = run_guards.NonFiniteGuard("skip")
    with caplog.at_level(logging.WARNING):
        guard.step_done(1, _metrics(nonfinite_grads=1))
        guard.step_done(2, _metrics(nonfinite_grads=0))
        guard.check()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["Step 1: the gradients were NaN or inf; its update was skipped "
                        "(on_non_finite='skip')."]


# ------------------------------------------------------------------ runs of a faulty env


def _faulty_config(fault, **overrides):
    c = user_env_config.get_config()
    c.imports = ("tests.faulty_envs",)
    c.env.name = "say_digit_faulty"
    c.env.kwargs = {"fault": fault, **overrides.pop("kwargs", {})}
    c.train_steps = 3
    for key, value in overrides.items():
        c[key] = value
    return c


def _saved_steps(workdir):
    directory = os.path.join(workdir, experiment.CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        return []
    with checkpoint.Checkpointer(directory, read_only=True) as ckpt:
        return ckpt.all_steps()


@pytest.mark.parametrize("fault, phrase", [
    ("nan", r"env 'say_digit_faulty' returned non-finite rewards \(\d+ values\)"),
    pytest.param("inf", r"env 'say_digit_faulty' returned non-finite rewards",
                 marks=pytest.mark.slow),
    pytest.param("token_id", r"env 'say_digit_faulty' replied with token ids outside",
                 marks=pytest.mark.slow),
])
def test_faulty_env_stops_the_run_before_any_checkpoint(tmp_path, fault, phrase):
    """Every task faulty: step 1 is named and nothing is checkpointed (before, the run
    ended with exit 0 and NaN weights in every checkpoint)."""
    with pytest.raises(run_guards.NonFiniteStep, match=f"^step 1: {phrase}"):
        experiment.run(_faulty_config(fault), str(tmp_path))
    assert _saved_steps(tmp_path) == []
    logged = (writers.read_metrics(tmp_path) if os.path.exists(tmp_path / "metrics.jsonl")
              else [])
    assert logged == []  # the NaN step's record is not written either


@pytest.mark.slow  # a second compile of the step (the skipping select)
@pytest.mark.parametrize("fault", ["nan", "token_id"])
def test_skip_keeps_the_parameters_of_faulty_steps(tmp_path, caplog, fault):
    """Under on_non_finite="skip", tasks with digit < 5 faulty: the steps with a faulty
    row keep their parameters, the run ends, and its checkpoints are finite."""
    config = _faulty_config(fault, kwargs={"faulty_below": 5}, on_non_finite="skip")
    with caplog.at_level(logging.WARNING):
        records = experiment.run(config, str(tmp_path))
    skipped = [r.getMessage() for r in caplog.records if "update was skipped" in r.getMessage()]
    assert skipped, "no faulty step in 3 steps of 4 tasks: pick another seed"
    assert len(records) == 3
    trainer = trainers.build(config)
    with checkpoint.Checkpointer(tmp_path / experiment.CHECKPOINT_DIR) as ckpt:
        _, state, _ = ckpt.restore_latest(trainer.abstract_state())
    assert all(np.all(np.isfinite(np.asarray(leaf, np.float32)))
               for leaf in jax.tree.leaves(state.params))


# ------------------------------------------------------------------ evaluate / export


def _flip_one_data_byte(step_dir):
    files = [os.path.join(root, name) for root, _, names in os.walk(step_dir / "state")
             for name in names if os.sep + "d" + os.sep in os.path.join(root, name)]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x10
        f.seek(0)
        f.write(data)


@pytest.fixture(scope="module")
def two_step_workdir(tmp_path_factory):
    """Steps 1 and 2 of the user env's config (initial parameters, then shifted)."""
    path = tmp_path_factory.mktemp("two_steps")
    config = user_env_config.get_config()
    trainer = trainers.build(config)
    state = trainer.init_state()
    with checkpoint.Checkpointer(path / experiment.CHECKPOINT_DIR) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state.replace(params=jax.tree.map(lambda p, s=step: p + s,
                                                              state.params)),
                      force=True, metadata={"config": experiment.config_json(config)})
    return path, trainer, state


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_evaluate_and_export_never_read_a_garbled_newest_step(two_step_workdir, tmp_path,
                                                              caplog):
    """evaluate's and export's restore (arl.runs.evaluation.restore_params) verifies the
    checksums: a flipped byte in step 2 (which tensorstore reads as a number) makes it
    fall back to step 1 with one warning, leaving the trainer's directory as it is; an
    explicit --step of the garbled one is an error, never its numbers."""
    source, trainer, state = two_step_workdir
    workdir = tmp_path / "run"
    shutil.copytree(source, workdir)
    _flip_one_data_byte(workdir / experiment.CHECKPOINT_DIR / "2")
    with caplog.at_level(logging.WARNING):
        step, params = evaluation.restore_params(trainer, str(workdir))
    assert step == 1
    expected = jax.tree.map(lambda p: p + 1, trainer.policy_params(state))
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # (orbax's own notes on read-only opening, which the CLI hides, aside)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "orbax" not in r.pathname]
    assert len(warnings) == 1 and "Checkpoint step 2" in warnings[0], warnings
    assert "checksum mismatch in params." in warnings[0]
    assert _saved_steps(workdir) == [1, 2]  # read-only: nothing moved
    with pytest.raises(checkpoint.CheckpointCorruptError, match="checksum mismatch"):
        evaluation.restore_params(trainer, str(workdir), 2)


# ------------------------------------------------------------------ another run's workdir


def test_workdir_of_another_model_is_one_line_naming_the_fields(two_step_workdir,
                                                                tmp_path):
    """Before: a 62-line CheckpointStructureError traceback."""
    source, _, _ = two_step_workdir
    shutil.copytree(source, tmp_path / "run")
    config = user_env_config.get_config()
    config.model.d_model = 32
    with pytest.raises(ConfigError) as raised:
        experiment.run(config, str(tmp_path / "run"))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"the workdir's checkpoint 2 in {tmp_path / 'run'}")
    assert "its config differs in model.d_model (16 -> 32); arrays: params." in message
    assert _saved_steps(tmp_path / "run") == [1, 2]  # nothing set aside

    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config=tests/user_env_config.py",
         f"--workdir={tmp_path / 'run'}", "--config.model.d_model=32"],
        cwd=_ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    error_lines = [line for line in result.stderr.splitlines()
                   if line.startswith("experiments.train: error:")]
    assert len(error_lines) == 1 and "model.d_model (16 -> 32)" in error_lines[0]
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------ a full disk


@pytest.mark.slow  # a CLI run that compiles the step
def test_full_disk_during_a_run_is_one_line_and_the_last_checkpoint_restores(tmp_path):
    """A workdir on a small tmpfs (root only) that holds the first checkpoints but not
    all: one line naming the workdir, exit status 1, and the newest committed step
    restores and resumes once space is freed."""
    mount = tmp_path / "disk"
    os.makedirs(mount)
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(mount)],
            capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "experiments.train", "--config=tests/user_env_config.py",
             f"--workdir={mount / 'run'}", "--config.train_steps=40",
             "--config.keep_checkpoints=40"],
            cwd=_ROOT, capture_output=True, text=True, timeout=600, check=False)
        assert result.returncode == 1, result.stderr[-3000:]
        error_lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
        assert len(error_lines) == 1, result.stderr[-3000:]
        assert error_lines[0].startswith(
            f"experiments.train: error: could not write checkpoint step ")
        assert f"to {mount / 'run' / 'checkpoints'} (" in error_lines[0]
        assert "is intact" in error_lines[0]
        steps = _saved_steps(mount / "run")
        assert steps and not [name for name in os.listdir(mount / "run" / "checkpoints")
                              if "tmp" in name]
        config = user_env_config.get_config()
        with checkpoint.Checkpointer(mount / "run" / "checkpoints") as ckpt:
            assert ckpt.restore_latest(trainers.build(config).abstract_state())[0] == \
                steps[-1]
    finally:
        subprocess.run(["umount", str(mount)], check=False)
