"""`code_interpreter`: tasks, the notebook cell, turns by hand, scripted policies,
one-turn mode, branching (the sandbox itself is tested in tests/tools)."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arl
from arl import rollout as rollout_lib
from arl.text import codec as codec_lib
from arl.envs import host
from arl.envs.base import TokenChunk
from arl.envs.tasks.code_interpreter import FAMILIES, CodeInterpreter, notebook_cell
from arl.rollout import branching
from tests.envs.codecs import CODEC_NAMES, codec
from arl.tools import SandboxLimits, run_python


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_answers_are_what_the_reference_programs_compute(family):
    """The answers come from closed forms; the reference programs, run as plain Python,
    agree; the demonstrator's buggy twins do not."""
    env = CodeInterpreter(families=(family,))
    for seed in range(300):
        task = env.make_task(seed, None)
        assert eval(task.solution) == int(task.answer), task  # pylint: disable=eval-used
        assert eval(task.buggy) != int(task.answer), task  # pylint: disable=eval-used
        assert len(task.prompt) <= env.prompt_len
        assert len(f"<py>{task.solution}</py>") + 1 <= env.action_len
        assert len(f"<answer>{task.answer}</answer>") + 1 <= env.action_len
        assert -2 ** 31 <= int(task.answer) < 2 ** 31
        guess = env.guess(task, random.Random(seed))
        assert guess != task.answer
        assert abs(int(guess) - int(task.answer)) <= 0.35 * int(task.answer) + 1


def test_notebook_cell_prints_the_final_expression():
    limits = SandboxLimits(wall_time_s=5)
    cases = {"sum(i*i for i in range(1,37+1))": "17575\n", "x = 3\nx * 2": "6\n",
             "print('a')\nNone": "a\n", "'s'": "'s'\n", "x = 1": "(no output)",
             "1/0": "ZeroDivisionError: division by zero",
             "sum(": "SyntaxError: '(' was never closed"}
    for source, expected in cases.items():
        assert run_python(notebook_cell(source), limits=limits).observation == expected


def _state_after_reset(env, num_rows, seed=0):
    keys = jax.random.split(jax.random.key(seed), num_rows)
    params = arl.envs.broadcast_params(env.default_params(), num_rows)
    state, ts = jax.jit(jax.vmap(env.reset))(keys, params)
    return state, ts, params


def _actions(env, texts):
    ids = np.full((len(texts), env.action_len), env.codec.pad_id, np.int32)
    lengths = np.zeros((len(texts),), np.int32)
    for row, text in enumerate(texts):
        encoded = env.codec.encode(text)[:env.action_len]
        ids[row, :len(encoded)] = encoded
        lengths[row] = len(encoded)
    return TokenChunk(jnp.asarray(ids), jnp.asarray(lengths))


def _reply(env, ts, row):
    chunk = ts.observation
    return env.codec.decode(np.asarray(chunk.tokens[row])[:int(chunk.length[row])],
                            stop_at_pad=False)


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_turns_by_hand(codec_name):
    env = CodeInterpreter(families=("squares",), wall_time_s=1.0, codec=codec(codec_name))
    state, ts, params = _state_after_reset(env, 7)
    tasks = [env.task(host._seed_int(state.seed[b]), None) for b in range(7)]
    assert [_reply(env, ts, b) for b in range(7)] == [t.prompt for t in tasks]
    texts = [f"<py>{tasks[0].solution}</py>", f"<py>{tasks[1].buggy}</py>",
             f"<answer>{tasks[2].answer}</answer>", "<answer>12</answer>", "hello",
             "<py>1/0</py>", "<py>print(chr(60) + 'eot>')</py>"]
    step = jax.jit(jax.vmap(env.step))
    state, ts = step(jax.random.split(jax.random.key(1), 7), state, _actions(env, texts),
                     params)
    replies = [_reply(env, ts, b) for b in range(7)]
    assert replies[0] == tasks[0].answer
    assert replies[1] == str(eval(tasks[1].buggy))  # pylint: disable=eval-used
    assert replies[2:5] == ["correct", "wrong", "invalid"]
    expected_error, _ = codec_lib.encode_reply(env.codec, "ZeroDivisionError: division by zero",
                                          env.obs_len)
    np.testing.assert_array_equal(ts.observation.tokens[5], expected_error)
    assert replies[5].endswith("..")
    if codec_name == "char":
        assert len(replies[5]) == env.obs_len
        assert replies[6] == "<eot>"  # spelled in characters: no end-of-turn id in a reply
    assert env.codec.eot_id not in np.asarray(ts.observation.tokens[6])
    np.testing.assert_allclose(ts.reward, [0, 0, 1, 0, -0.1, 0, 0], atol=1e-7)
    np.testing.assert_array_equal(ts.terminated, [False, False, True, True, False, False,
                                                  False])
    np.testing.assert_array_equal(ts.info["success"], [False, False, True] + [False] * 4)
    np.testing.assert_array_equal(ts.info["format_error"], [False] * 4 + [True, False, False])
    np.testing.assert_array_equal(ts.info["process_reward"], [1, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(ts.info["tool_calls"], [1, 1, 0, 0, 0, 1, 1])
    # memory: answer_seen, last_value, has_value, then the declared tools' tool_calls,
    # invalid_streak, invalid_calls (tags: never invalid)
    assert env.memory_fields == ("answer_seen", "last_value", "has_value", "tool_calls",
                                 "invalid_streak", "invalid_calls")
    np.testing.assert_array_equal(state.memory[0], [1, int(tasks[0].answer), 1, 1, 0, 0])
    np.testing.assert_array_equal(state.memory[5], [0, 0, 0, 1, 0, 0])
    # Answering what the tool printed: correct after the right program only.
    texts = [f"<answer>{tasks[0].answer}</answer>",
             f"<answer>{eval(tasks[1].buggy)}</answer>"] + ["x"] * 5  # pylint: disable=eval-used
    state, ts = step(jax.random.split(jax.random.key(2), 7), state, _actions(env, texts),
                     params)
    assert [_reply(env, ts, b) for b in range(2)] == ["correct", "wrong"]
    # The process reward was collected when the tool showed the answer, not again.
    np.testing.assert_array_equal(ts.info["process_reward"][:2], [0, 0])
    np.testing.assert_array_equal(ts.reward[:2], [1, 0])


def test_oracle_solves_and_the_demonstrator_is_weaker():
    env = CodeInterpreter()
    oracle = rollout_lib.scripted_rollout(env, jax.random.key(3), num_tasks=16, group_size=1,
                                          action_source="oracle")
    assert bool(oracle.success.all()) and (np.asarray(oracle.num_turns) == 2).all()
    demo = rollout_lib.scripted_rollout(env, jax.random.key(3), num_tasks=48, group_size=1,
                                        action_source="demonstrator")
    success = np.asarray(demo.success)
    turns = np.asarray(demo.num_turns)
    # (1 - 0.3) * (1 - 0.2) = 0.56 expected; one turn exactly when it skipped the tool.
    assert 0.35 <= success.mean() <= 0.8, success.mean()
    assert not success[turns == 1].any() and (turns[~success] >= 1).all()
    assert 0.1 <= (turns == 1).mean() <= 0.5
    for row in np.flatnonzero(turns == 2)[:8]:
        text = rollout_lib.render_trajectory(env, demo, int(row))
        lines = text.split("\n")
        printed, answered = lines[2].removeprefix("[env]   "), lines[3]
        assert f"<answer>{printed}</answer>" in answered  # it answers what it read


def test_one_turn_mode_and_branching_carry_the_memory():
    env = CodeInterpreter(final_output=True, max_turns=1)
    oracle = rollout_lib.scripted_rollout(env, jax.random.key(4), num_tasks=4, group_size=1,
                                          action_source="oracle")
    assert bool(oracle.success.all()) and (np.asarray(oracle.num_turns) == 1).all()

    # Continuations forked before turn 1 read the forked memory: the demonstrator
    # answers what its (maybe buggy) program printed, so the outcome repeats.
    env = CodeInterpreter(skip_tool=0.0, buggy_program=0.5)
    traj = jax.jit(lambda k: rollout_lib.rollout(
        env, k, num_tasks=8, group_size=1, action_source="demonstrator",
        record_turn_states=True))(jax.random.key(5))
    success = np.asarray(traj.success)
    assert 0 < success.mean() < 1
    values = jax.jit(lambda k: branching.branch_values(
        env, k, traj, branch_turns=(1,), num_samples=2, action_source="demonstrator",
        estimate="soft"))(jax.random.key(6))
    assert bool(values.known[:, 1].all())
    np.testing.assert_array_equal(values.values[:, 1], success.astype(np.float32))
