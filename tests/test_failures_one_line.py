"""Failures of user code end a command-line run with exactly one line on stderr (all of
stderr is read, not its last line) and a sensible exit status: a Python reward function
that raises, returns NaN, returns the wrong number of scores or never returns
(`experiments.train`, status 1), and `experiments.evaluate` on a workdir whose newest
checkpoint is truncated (one warning line, status 0, the previous step evaluated).

The only other stderr lines allowed are arl's own progress INFO lines from the
experiment loop ("Starting a fresh run ..."); no library traceback, no JAX
"jax.io_callback failed", no tfds "no dataset_info.json" warning for the new dataset.
Each run compiles a train step (a program with host callbacks is not in the persistent
compilation cache), so only the never-returning function runs in the default suite.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROGRESS = re.compile(r"^I\d{4} [\d:.]+ +\d+ experiment\.py:\d+\] ")
_TINY = ["--config.warm_start.sft_steps=0", "--config.loss.sft_coef=0",
         "--config.model.num_layers=1", "--config.rollout.num_tasks=2",
         "--config.rollout.group_size=2", "--config.sample_every=0"]


def _run(program, *args, cache_dir=None, timeout=600):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": _ROOT}
    if cache_dir is not None:  # a fresh cache: the dataset is built anew
        env["ARL_CACHE_DIR"] = str(cache_dir)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", program, *args], cwd=_ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout, check=False)
    return result, time.monotonic() - start


def _failure_lines(stderr: str) -> list[str]:
    """Every stderr line but the experiment loop's progress INFO lines."""
    return [line for line in stderr.splitlines() if not _PROGRESS.match(line)]


def _train(tmp_path, config, *args, cache_dir=None):
    return _run("experiments.train", f"--config=configs/{config}.py",
                f"--workdir={tmp_path / 'run'}", "--config.train_steps=2", *_TINY, *args,
                cache_dir=cache_dir)


def test_a_reward_function_that_never_returns_ends_in_one_line(tmp_path):
    result, seconds = _train(tmp_path, "grpo_guess_number",
                             "--config.reward.functions=tests.user_rewards:never_returns",
                             "--config.reward.timeout_s=1")
    lines = _failure_lines(result.stderr)
    assert result.returncode == 1, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(
        "experiments.train: error: reward function 'tests.user_rewards:never_returns' did "
        "not return within timeout_s=1 s on a batch of 4 rows; set reward.on_error='zero'")
    # The hung thread did not keep the process alive (the subprocess timeout is 600 s).
    assert seconds < 590


@pytest.mark.slow
@pytest.mark.parametrize("function,message", [
    ("raises_always", "raised RuntimeError: the scoring service is down on dataset row "),
    ("nan_on_every_row", "returned the non-finite value nan on dataset row "),
    ("too_few", "returned list of length 3, not one number (or None) per row for 4 rows;"),
])
def test_a_failing_reward_function_ends_in_one_line(tmp_path, function, message):
    result, _ = _train(tmp_path, "grpo_word_problems",
                       f"--config.reward.functions=tests.user_rewards:{function}",
                       cache_dir=tmp_path / "cache")
    lines = _failure_lines(result.stderr)
    assert result.returncode == 1, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"experiments.train: error: reward function "
                               f"'tests.user_rewards:{function}' {message}"), lines
    if "dataset row" in message:  # the row of the dataset and its prompt are named
        assert re.search(r"dataset row \d+, prompt '.+', completion '.*' \(batch row \d+ "
                         r"of 4\); set reward.on_error='zero'", lines[0]), lines


@pytest.mark.slow
def test_evaluate_a_truncated_newest_checkpoint_warns_in_one_line(tmp_path):
    result, _ = _train(tmp_path, "grpo_guess_number", "--config.checkpoint_every=1",
                       "--config.keep_checkpoints=3")
    assert result.returncode == 0, result.stderr[-3000:]
    workdir = tmp_path / "run"
    for path in glob.glob(str(workdir / "checkpoints" / "2" / "state" / "**" / "d" / "*"),
                          recursive=True):
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    for _ in range(3):  # the late-callback tracebacks came in most runs, not all
        result, _ = _run("experiments.evaluate", f"--workdir={workdir}", "--num_tasks=2",
                         "--num_transcripts=0", "--nobaselines")
        assert result.returncode == 0, result.stderr[-3000:]
        lines = _failure_lines(result.stderr)
        assert len(lines) == 1, result.stderr[-3000:]
        assert re.match(r"^W\d{4} .* checkpoint\.py:\d+\] Checkpoint step 2 in .* is corrupt "
                        r"or incomplete \(.*\); falling back to the previous checkpoint\.$",
                        lines[0]), lines
        assert "Checkpoint step 1 of" in result.stdout
