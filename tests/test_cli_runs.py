"""Runs through the real command line: the quickstart's log stays short, and an
environment defined outside `arl` (tests/user_envs.py, loaded by `config.imports`) is
trained, resumed and evaluated by `experiments.train` / `experiments.evaluate`.

The subprocesses share the test run's persistent compilation cache (tests/conftest.py),
so the resumed run reads the programs the first one compiled.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from arl.runs import process_settings
from arl.runs import writers

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# An absl log line: level, date, time, thread, file:line]
_LOG_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ ([\w.]+):\d+\] ")
_OWN_FILES = {"experiment.py", "writers.py"}  # the experiment loop's start/resume and progress


def _run(program, *args, platforms_unset=False, host_defaults=False):
    env = dict(os.environ)
    if platforms_unset:  # as a user runs it: JAX probes the TPU/GPU backends
        env.pop("JAX_PLATFORMS", None)
    if host_defaults:  # as a user runs it: steps inline, freed memory kept (the suite's
        env.pop(process_settings.ENV_VAR, None)  # conftest turns both off)
    return subprocess.run([sys.executable, "-m", program, *args], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def _source(line):
    """The source file of an absl log line; a line of any other shape as itself."""
    match = _LOG_LINE.match(line)
    return match.group(1) if match else line


def _foreign_lines(stderr):
    return [line for line in stderr.splitlines() if _source(line) not in _OWN_FILES]


def test_quickstart_log_is_progress_warnings_and_errors_only(tmp_path):
    """The quickstart (configs/grpo_bandit.py, 100 steps, log_every 5) at reduced sizes:
    10 steps, two checkpoints and two evaluations. Before, orbax logged ~40 INFO lines
    per checkpoint and JAX its backend probe; now the log is one line to start and one
    progress line per `log_every` steps, so the full quickstart prints ~21 lines. Run
    with the CLI's host settings: a backend started before `main` would make
    `run_computations_inline` warn here."""
    steps, log_every = 10, 5
    result = _run(
        "experiments.train", "--config=configs/grpo_bandit.py", f"--workdir={tmp_path}",
        f"--config.train_steps={steps}", f"--config.log_every={log_every}",
        "--config.checkpoint_every=5", "--config.sample_every=5",
        "--config.rollout.num_tasks=2", "--config.rollout.group_size=2",
        "--config.model.d_model=16", "--config.model.num_layers=1",
        "--config.model.num_heads=2", "--config.model.num_kv_heads=2",
        "--config.model.mlp_dim=32", platforms_unset=True, host_defaults=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not _foreign_lines(result.stderr), _foreign_lines(result.stderr)[:10]
    lines = result.stderr.splitlines()
    progress = [line for line in result.stderr.splitlines()
                if re.search(r"writers.py:\d+\] step \d+/10 \(.* steps/s, ETA \d+s\) "
                             r"reward_mean=\S+ success_rate=\S+", line)]
    assert len(progress) == steps // log_every, result.stderr
    assert "Starting a fresh run" in result.stderr
    overhead = len(lines) - len(progress)
    assert overhead <= 2, result.stderr
    assert overhead + 100 // 5 < 40  # the full quickstart's line count
    assert [r["step"] for r in writers.read_metrics(tmp_path)] == [5, 10]


@pytest.mark.slow  # three CLI runs, two of them compiling: ~50 s on the 2-core host
def test_user_env_trains_resumes_and_evaluates_through_the_cli(tmp_path):
    config = "--config=tests/user_env_config.py"  # imports tests.user_envs
    workdir = f"--workdir={tmp_path}"
    first = _run("experiments.train", config, workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Starting a fresh run" in first.stderr

    # The checkpointed config carries `imports`: a resume (and evaluate) finds the env.
    # --verbosity brings the libraries' INFO lines back.
    resumed = _run("experiments.train", config, workdir, "--config.train_steps=3",
                   "--verbosity=0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from step 2" in resumed.stderr
    assert "checkpoint_manager.py" in resumed.stderr  # orbax's INFO, shown on request
    records = writers.read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(-0.2 - 1e-6 <= r["reward_mean"] <= 1.0 for r in records)

    evaluated = _run("experiments.evaluate", workdir, "--num_tasks=4", "--num_transcripts=1")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    out = evaluated.stdout
    assert "Checkpoint step 3" in out and "(grpo on say_digit)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split()[:2] in (["greedy", "all"], ["sampled", "all"], ["oracle", "all"])}
    assert set(rows) == {"greedy", "sampled", "oracle"}
    assert float(rows["oracle"][3]) == 1.0 and float(rows["oracle"][5]) == 1.0  # turns
    assert "(no demonstrator baseline: env 'say_digit' defines no demonstrator_action)" in out
    assert "[env]   say " in out
    assert not _foreign_lines(evaluated.stderr), _foreign_lines(evaluated.stderr)[:10]
