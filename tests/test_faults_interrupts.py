"""Faults through the command line, as machines and users produce them (docs/faults.md):
SIGKILL at random moments, one found inside a checkpoint write by watching the
checkpoint directory; SIGTERM and SIGINT; a second run on a workdir in use.

Nothing here helps the code under test: the kills come from outside, at moments the
test picks by watching the files, and `--debug_kill_after_step` is not used. Each run
ends in a resumable state; the resumed run's raw metrics.jsonl and TensorBoard events
hold every step once, equal bit for bit to an uninterrupted run's."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from arl.runs import experiment, workdir_lock, writers
from tests.test_writers import _read_events, _scalars

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TMP_MARK = "orbax-checkpoint-tmp"

# PPO on CartPole at the smallest sizes: steps of milliseconds, so a run is mostly its
# start-up and the kills land at every phase of the loop.
_VECTOR_FLAGS = (
    "--config=configs/ppo_cartpole.py", "--config.log_every=1",
    "--config.vector.num_envs=2", "--config.vector.num_steps=8",
    "--config.vector.hidden_sizes=(8,8)", "--config.updates.minibatches=1",
    "--config.updates.epochs=1", "--config.optim.schedule=constant",
)


def _vector_config(**changes):
    from configs import ppo_cartpole

    c = ppo_cartpole.get_config()
    c.log_every = 1
    c.vector.num_envs, c.vector.num_steps, c.vector.hidden_sizes = 2, 8, (8, 8)
    c.updates.minibatches, c.updates.epochs = 1, 1
    c.optim.schedule = "constant"
    for key, value in changes.items():
        setattr(c, key, value)
    return c


def _start(workdir, flags, *extra):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(workdir), "cache"))
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *flags, *extra],
        cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process, timeout=600):
    try:
        output = process.communicate(timeout=timeout)[0]
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, output


def _logged_lines(workdir) -> int:
    try:
        with open(os.path.join(workdir, writers.METRICS_FILE), "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def _wait_for(process, condition, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {process.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.0005)


def _temporary_checkpoints(workdir):
    directory = os.path.join(workdir, experiment.CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        return []
    return [name for name in os.listdir(directory) if _TMP_MARK in name]


def _committed_steps(workdir):
    directory = os.path.join(workdir, experiment.CHECKPOINT_DIR)
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def _raw_steps(workdir):
    lines = open(os.path.join(workdir, writers.METRICS_FILE)).read().splitlines()
    return [json.loads(line)["step"] for line in lines]


def _check_logged_once(workdir, reference, metrics=("loss/total", "episode_return")):
    """Each step once in the raw metrics.jsonl and in the TensorBoard events, with the
    uninterrupted run's values, bit for bit."""
    steps = [r["step"] for r in reference]
    assert _raw_steps(workdir) == steps
    assert writers.read_metrics(workdir) == reference
    scalars = _scalars(_read_events(os.path.join(workdir, writers.TENSORBOARD_DIR)))
    for name in metrics:
        assert scalars[name] == [(r["step"], np.float32(r[name]).item()) for r in reference], name
    assert not _temporary_checkpoints(workdir)


def _kill_inside_a_checkpoint_write(workdir, flags):
    """Starts (or resumes) a run and SIGKILLs it while it writes a checkpoint after a
    committed one (the step's orbax temporary directory exists); returns whether the
    kill landed inside the write (the directory outlived the process)."""
    committed = _committed_steps(workdir) if os.path.isdir(
        os.path.join(workdir, experiment.CHECKPOINT_DIR)) else []
    after = committed[-1] if committed else 2  # 2 is committed when 4 is written
    process = _start(workdir, flags)
    _wait_for(process, lambda: any(
        int(name.split(".")[0]) > after for name in _temporary_checkpoints(workdir)),
        f"a checkpoint write after step {after}")
    process.kill()
    process.wait()
    return bool(_temporary_checkpoints(workdir))


def test_sigkill_inside_a_checkpoint_write_loses_and_repeats_nothing(tmp_path):
    """A run SIGKILLed while it writes its second checkpoint (or a later one): the
    resumed run clears the half-written step away, restarts from the last committed
    one, drops the records logged after it and ends where an uninterrupted run ends,
    every step logged once (raw metrics.jsonl and TensorBoard), bit for bit."""
    steps = 30
    flags = (*_VECTOR_FLAGS, f"--config.train_steps={steps}", "--config.checkpoint_every=2")
    reference = experiment.run(_vector_config(train_steps=steps, checkpoint_every=2),
                               str(tmp_path / "reference"))
    workdir = str(tmp_path / "run")
    inside = False
    for _ in range(5):  # the write may commit between the sighting and the kill
        inside = _kill_inside_a_checkpoint_write(workdir, flags)
        if inside:
            break
    assert inside, "no kill landed inside a checkpoint write in 5 tries"
    committed = _committed_steps(workdir)
    assert committed and int(_temporary_checkpoints(workdir)[0].split(".")[0]) > committed[-1]
    # The records the committed checkpoints cover are on disk (read_metrics skips a
    # line the kill cut off).
    assert [r["step"] for r in writers.read_metrics(workdir)][:committed[-1]] == list(
        range(1, committed[-1] + 1))
    returncode, output = _finish(_start(workdir, flags))
    assert returncode == 0, output[-3000:]
    assert f"Resumed from step {committed[-1]}" in output
    _check_logged_once(workdir, reference)


def _stop_with(signum, workdir, flags, after_lines=3):
    """A run sent `signum` once it has logged `after_lines` steps; its exit status and
    output."""
    process = _start(workdir, flags)
    _wait_for(process, lambda: _logged_lines(workdir) >= after_lines,
              f"{after_lines} logged steps")
    process.send_signal(signum)
    return _finish(process)


def _check_stopped(workdir, returncode, output, signum):
    """The run ended after a step s with a checkpoint of s, exit status 128 + signum,
    one line saying so; logged steps 1..s, once; no temporary directory."""
    assert returncode == 128 + signum, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    lines = [line for line in output.splitlines() if "stopped by" in line]
    assert len(lines) == 1, output[-3000:]
    step = _committed_steps(workdir)[-1]
    name = signal.Signals(signum).name
    assert lines[0] == (
        f"experiments.train: stopped by {name} after step {step} (checkpoint {step} saved "
        f"in {os.path.join(workdir, experiment.CHECKPOINT_DIR)}); run the same command "
        f"again to resume (exit status {128 + signum})")
    assert output.rstrip().endswith(lines[0])  # the last line
    assert _raw_steps(workdir) == list(range(1, step + 1))
    assert not _temporary_checkpoints(workdir)
    return step


def test_sigterm_stops_at_a_step_with_a_checkpoint(tmp_path):
    """SIGTERM (preemption) mid-run: the step in progress ends, its checkpoint is
    written (none was due), the logs hold steps 1..s once; exit status 143."""
    workdir = str(tmp_path / "run")
    flags = (*_VECTOR_FLAGS, "--config.train_steps=100000", "--config.checkpoint_every=1000")
    returncode, output = _stop_with(signal.SIGTERM, workdir, flags)
    step = _check_stopped(workdir, returncode, output, signal.SIGTERM)
    assert _committed_steps(workdir) == [step] and step >= 3


@pytest.mark.slow  # three more runs
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stopped_runs_resume_exactly(tmp_path, signum):
    """Stopped twice by `signum` and resumed: the same records and final state as an
    uninterrupted run."""
    steps = 40
    reference = experiment.run(_vector_config(train_steps=steps, checkpoint_every=1000),
                               str(tmp_path / "reference"))
    workdir = str(tmp_path / "run")
    flags = (*_VECTOR_FLAGS, f"--config.train_steps={steps}", "--config.checkpoint_every=1000")
    first = _check_stopped(workdir, *_stop_with(signum, workdir, flags), signum)
    second = _check_stopped(workdir, *_stop_with(signum, workdir, flags, first + 2), signum)
    assert first < second < steps
    returncode, output = _finish(_start(workdir, flags))
    assert returncode == 0 and f"Resumed from step {second}" in output, output[-3000:]
    _check_logged_once(workdir, reference)


def _bandit_at_lag_two(steps, checkpoint_every):
    """The tiny bandit of tests/test_async.py at policy lag 2 (two programs), as a config
    and as flags."""
    from tests import test_async

    c = test_async._experiment_config()  # pylint: disable=protected-access
    c.train_steps, c.checkpoint_every, c.sample_every = steps, checkpoint_every, 5
    flags = tuple(f for f in test_async._EXPERIMENT_FLAGS  # pylint: disable=protected-access
                  if not f.startswith(("--config.train_steps", "--config.checkpoint_every",
                                       "--config.sample_every")))
    return c, (*flags, f"--config.train_steps={steps}",
               f"--config.checkpoint_every={checkpoint_every}", "--config.sample_every=5")


def _vector(steps, checkpoint_every):
    return (_vector_config(train_steps=steps, checkpoint_every=checkpoint_every),
            (*_VECTOR_FLAGS, f"--config.train_steps={steps}",
             f"--config.checkpoint_every={checkpoint_every}"))


@pytest.mark.slow  # a dozen runs
@pytest.mark.parametrize("setting,steps,kills,seed,metric", [
    (_vector, 60, 6, 0, "episode_return"),
    (_vector, 60, 6, 1, "episode_return"),
    (_bandit_at_lag_two, 16, 3, 2, "reward_mean"),
], ids=["vector-seed0", "vector-seed1", "bandit-lag2"])
def test_sigkill_at_random_moments_loses_and_repeats_nothing(tmp_path, setting, steps, kills,
                                                             seed, metric):
    """SIGKILL at random moments (start-up, steps, checkpoint writes, the resume's
    clean-up), then a run to the end: every step logged once, the uninterrupted run's
    records bit for bit; also at policy lag 2, whose checkpoints hold the behaviour
    versions of the rollouts in flight."""
    config, flags = setting(steps, checkpoint_every=4)
    reference = experiment.run(config, str(tmp_path / "reference"))
    workdir = str(tmp_path / "run")
    rng = random.Random(seed)
    done = 0
    while done < kills:
        process = _start(workdir, flags)
        # Past a random number of logged lines (the resumed run's first ones included),
        # then a random delay of up to a few steps.
        lines = _logged_lines(workdir) + rng.randint(0, 8)
        try:
            _wait_for(process, lambda: _logged_lines(workdir) >= min(lines, steps - 1),
                      f"{lines} logged lines")
        except AssertionError:
            if process.returncode == 0:  # finished first: start over
                continue
            raise
        time.sleep(rng.uniform(0, 0.05))
        process.kill()
        process.wait()
        done += 1
    returncode, output = _finish(_start(workdir, flags))
    assert returncode == 0, output[-3000:]
    _check_logged_once(workdir, reference, ("loss/total", metric))


def test_a_second_run_on_a_workdir_in_use_is_refused(tmp_path):
    """One writer per workdir: while a process holds the workdir's lock, `run` refuses
    before touching the workdir and the CLI says so in one line (exit status 2); the
    kernel drops the lock when the holder is SIGKILLed."""
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom arl.runs import workdir_lock\n"
         f"with workdir_lock.hold({workdir!r}):\n    print('held', flush=True)\n"
         "    time.sleep(600)\n"],
        cwd=_ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
        text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(workdir_lock.WorkdirInUseError,
                           match=rf"^workdir '{workdir}' is in use by another run \(process "
                                 rf"{holder.pid} on .* UTC\); wait for it to end or use "
                                 "another workdir$"):
            experiment.run(_vector_config(train_steps=2), workdir)
        assert os.listdir(workdir) == [workdir_lock.LOCK_FILE]

        returncode, output = _finish(_start(workdir, (*_VECTOR_FLAGS, "--config.train_steps=2")))
        assert returncode == 2, output[-3000:]
        errors = [line for line in output.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith(
            f"experiments.train: error: workdir '{workdir}' is in use by another run "
            f"(process {holder.pid} on "), output[-3000:]
        assert "Traceback" not in output
    finally:
        holder.kill()
        holder.wait()
    with workdir_lock.hold(workdir):  # released by the kernel
        pass
