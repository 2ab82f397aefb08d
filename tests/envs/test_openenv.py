"""`openenv:<url or module>` against the real package (the `openenv` extra; these tests
skip, saying so, without it) and a real OpenEnv server started by the test
(`tests.openenv_envs`: create_app served by uvicorn in this process): a client session
per row, the agent's text through a declared parser to the env's typed action, server
errors per row, one-line refusals."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import arl
from arl.envs.base import TokenChunk
from arl.envs.host import _seed_int
from arl.errors import ConfigError
from arl.text.codec import decode_action, encode_action

pytest.importorskip("openenv.core",
                    reason="openenv-core is not installed (pip install 'arl[openenv]')")

from tests import openenv_envs  # pylint: disable=wrong-import-position

_NAME = "openenv:tests.openenv_envs:app"
_KWARGS = {"action_parser": "tests.openenv_envs:guess_action", "observation_key": "message",
           "max_turns": 4, "action_len": 4, "prompt_len": 16, "obs_len": 64}


@pytest.fixture(scope="module")
def env():
    made = arl.make_env({"name": _NAME, "kwargs": _KWARGS})
    made.jitted = (jax.jit(jax.vmap(made.reset)), jax.jit(jax.vmap(made.step)))
    yield made
    made.close()


def _play(env, turns, seed=0):
    """Rows 2i and 2i + 1 share a reset key (one task); turns[t][b] is row b's text at
    turn t (a callable of the row's digit). Returns (digits, [(timestep, replies)])."""
    rows = len(turns[0])
    keys = jax.random.split(jax.random.key(seed), rows // 2)[np.arange(rows) // 2]
    params = arl.envs.broadcast_params(env.default_params(), rows)
    reset, step = env.jitted
    state, first = reset(keys, params)
    digits = [openenv_envs.digit_of(_seed_int(state.seed[b])) for b in range(rows)]
    out = []
    for texts in turns:
        texts = [t(d) if callable(t) else t for t, d in zip(texts, digits)]
        ids, lengths = zip(*(encode_action(env.codec, t, env.action_len) for t in texts))
        state, ts = step(keys, state, TokenChunk(np.stack(ids), np.asarray(lengths)), params)
        ts = jax.device_get(ts)
        out.append((ts, [decode_action(env.codec, ts.observation.tokens[b],
                                       ts.observation.length[b]) for b in range(rows)]))
    prompts = [decode_action(env.codec, first.observation.tokens[b],
                             first.observation.length[b]) for b in range(rows)]
    return digits, prompts, out


def test_each_row_plays_its_own_server_session_through_the_parser(env):
    assert env.resume_mode == "restart" and not env.has_oracle
    right = lambda d: str(d)
    wrong = lambda d: str((d + 1) % 10)
    digits, prompts, out = _play(env, [[wrong, right, "x", wrong], [right, right, right,
                                                                    right]])
    assert prompts == ["guess a digit"] * 4
    assert digits[0] == digits[1] and digits[2] == digits[3]  # a group shares its task
    (ts1, replies1), (ts2, replies2) = out
    np.testing.assert_array_equal(ts1.reward, [0.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(ts1.terminated, [False, True, False, False])
    np.testing.assert_array_equal(ts1.info["format_error"], [False, False, True, False])
    hint = lambda d: "lower" if (d + 1) % 10 > d else "higher"
    assert replies1 == [hint(digits[0]), "right",
                        "invalid action: invalid literal for int() with base 10: 'x'",
                        hint(digits[3])]
    # Turn 2: the finished row stays finished (reward 0); the others find the digit.
    np.testing.assert_array_equal(ts2.reward, [1.0, 0.0, 1.0, 1.0])
    np.testing.assert_array_equal(ts2.info["success"], [True, True, True, True])
    assert env.live_sessions() == 0  # every session closed when its episode ended


def test_a_server_error_ends_only_its_row_in_one_log_line(env, caplog):
    right = lambda d: str(d)
    with caplog.at_level(logging.ERROR):
        _, _, out = _play(env, [["13", right, right, right]], seed=1)
    ts, replies = out[0]
    np.testing.assert_array_equal(ts.info["host_error"], [True, False, False, False])
    np.testing.assert_array_equal(ts.reward, [0.0, 1.0, 1.0, 1.0])
    assert replies[0] == "host error" and ts.terminated[0]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert "Server error: the digit service is down (code: EXECUTION_ERROR)" in errors[0]
    assert env.live_sessions() == 0


@pytest.mark.parametrize("name,kwargs,message", [
    ("openenv:http://127.0.0.1:9", {}, r"the OpenEnv server at 'http://127.0.0.1:9' cannot "
                                       r"be reached: URLError: "),
    ("openenv:tests.no_such_module", {}, r"OpenEnv app 'tests.no_such_module': cannot "
                                         r"import 'tests.no_such_module': "
                                         r"ModuleNotFoundError: "),
    (_NAME, {"action_parser": "tests.openenv_envs:no_parser"},
     r"action_parser 'tests.openenv_envs:no_parser': module 'tests.openenv_envs' has no "
     r"'no_parser'"),
])
def test_what_cannot_be_served_or_parsed_is_one_line(name, kwargs, message):
    with pytest.raises(ConfigError, match=message) as raised:
        arl.make_env({"name": name, "kwargs": kwargs})
    assert "\n" not in str(raised.value)


def test_without_the_package_the_name_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    monkeypatch.setitem(sys.modules, "openenv", None)
    with pytest.raises(ConfigError, match=r"env 'openenv:<url or module>' needs the "
                                          r"openenv-core package: pip install "
                                          r"'arl\[openenv\]'"):
        arl.make_env({"name": _NAME})


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROGRESS = re.compile(r"^I\d{4} [\d:.]+ +\d+ experiment\.py:\d+\] ")


def _train(tmp_path, name):
    config = tmp_path / "openenv_config.py"
    config.write_text(textwrap.dedent(f"""
        from arl import config as config_lib

        def get_config():
            c = config_lib.default_config()
            c.algorithm = "grpo"
            c.env.name = {name!r}
            c.env.kwargs = {_KWARGS!r}
            c.warm_start.sft_steps = 0
            c.loss.sft_coef = 0.0
            return c
        """))
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", f"--config={config}",
         f"--workdir={tmp_path / 'run'}", "--config.train_steps=2",
         "--config.model.num_layers=1", "--config.rollout.num_tasks=2",
         "--config.rollout.group_size=2", "--config.sample_every=0"],
        cwd=_ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": _ROOT})


def test_trains_through_the_command_line_from_one_config_line(tmp_path):
    result = _train(tmp_path, _NAME)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if not _PROGRESS.match(line)]
    # No spurious warnings or server tracebacks on the normal path.
    assert not [line for line in lines if "Warning" in line or "Traceback" in line
                or "Exception" in line], lines
    from arl.runs import writers

    records = writers.read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in records][-1] == 2
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in records)


@pytest.mark.slow
def test_an_unreachable_server_ends_the_command_line_in_one_line(tmp_path):
    result = _train(tmp_path, "openenv:http://127.0.0.1:9")
    lines = [line for line in result.stderr.splitlines() if not _PROGRESS.match(line)]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("experiments.train: error: config.env.kwargs=")
    assert "the OpenEnv server at 'http://127.0.0.1:9' cannot be reached" in lines[0]
