"""A run on a stateful host environment (`arl.envs.sessions`, tests/session_envs.py:
one game object per episode on the host) SIGKILLed at random moments, from outside,
with no flush hooks, resumes as docs/host_environments.md says for its mode: the
sessions die with the process, the resumed run restarts from its newest checkpoint and
replays the steps after it, episodes in flight included (new sessions of the same seeds,
the same turns), so every step is logged once with the uninterrupted run's values, bit
for bit."""

from __future__ import annotations

import random
import time

import pytest

from arl.runs import experiment, writers
from tests.test_faults_interrupts import _finish, _logged_lines, _start, _wait_for

_FLAGS = ("--config=tests/session_env_config.py",)


@pytest.mark.slow  # a reference run and three command-line runs
def test_a_killed_session_env_run_resumes_exactly(tmp_path):
    from tests import session_env_config

    config = session_env_config.get_config()
    reference = experiment.run(config, str(tmp_path / "reference"))
    workdir = str(tmp_path / "run")
    rng = random.Random(0)
    kills = 0
    while kills < 2:
        process = _start(workdir, _FLAGS)
        lines = _logged_lines(workdir) + rng.randint(1, 3)
        try:
            _wait_for(process, lambda: _logged_lines(workdir) >= min(lines, 5),
                      f"{lines} logged lines")
        except AssertionError:
            if process.returncode == 0:
                continue
            raise
        time.sleep(rng.uniform(0, 0.2))
        process.kill()
        process.wait()
        kills += 1
    returncode, output = _finish(_start(workdir, _FLAGS))
    assert returncode == 0, output[-3000:]
    history = writers.read_metrics(workdir)
    assert [r["step"] for r in history] == [r["step"] for r in reference]
    for got, want in zip(history, reference):
        for name in ("reward_mean", "success_rate", "loss/total"):
            assert got[name] == want[name], (got["step"], name)
