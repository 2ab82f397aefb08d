"""`sql`: tasks, turns by hand (read-only queries, answer matching), scripted policies
(the SQL executor itself is tested in tests/tools)."""

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
from arl.envs.tasks.sql_query import SqlQuery, single_cell
from arl.tools import make_sql_task, run_sql
from arl.tools.sql import answers_match
from tests.envs.codecs import CODEC_NAMES, codec


def test_tasks_fit_and_guesses_are_wrong():
    env = SqlQuery()
    for seed in range(200):
        task = env.make_task(seed, None)
        db, reference = make_sql_task(seed)
        assert (task.prompt, task.answer, task.solution) == (
            reference.question, reference.answer, reference.reference_sql)
        assert task.data.to_bytes() == db.to_bytes() and task.data_id == seed
        assert len(task.prompt) <= env.prompt_len
        assert len(f"<sql>{task.solution}</sql>") + 1 <= env.action_len
        result = run_sql(task.data.to_bytes(), task.solution)
        assert env.shows_answer(task, result)
        assert not answers_match(env.guess(task, random.Random(seed)), task.answer)


def test_single_cell():
    db, _ = make_sql_task(0)
    assert single_cell(run_sql(db.to_bytes(), "SELECT COUNT(*) FROM employees")) == "12"
    assert single_cell(run_sql(db.to_bytes(), "SELECT 1, 2")) is None
    assert single_cell(run_sql(db.to_bytes(), "SELECT name FROM employees")) is None
    assert single_cell(run_sql(db.to_bytes(), "SELEC 1")) is None


def _chunks(env, texts):
    ids = np.full((len(texts), env.action_len), env.codec.pad_id, np.int32)
    lengths = np.zeros((len(texts),), np.int32)
    for row, text in enumerate(texts):
        encoded = env.codec.encode(text)
        ids[row, :len(encoded)] = encoded
        lengths[row] = len(encoded)
    return TokenChunk(jnp.asarray(ids), jnp.asarray(lengths))


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_turns_by_hand(codec_name):
    env = SqlQuery(codec=codec(codec_name))
    rows = 6
    keys = jax.random.split(jax.random.key(0), rows)
    params = arl.envs.broadcast_params(env.default_params(), rows)
    state, _ = jax.jit(jax.vmap(env.reset))(keys, params)
    tasks = [env.task(host._seed_int(state.seed[b]), None) for b in range(rows)]
    texts = [f"<sql>{tasks[0].solution}</sql>", "<sql>DELETE FROM employees</sql>",
             "<sql>SELECT nope FROM employees</sql>",
             f"<answer> {tasks[3].answer.upper()}. </answer>", "<answer>-1</answer>",
             "<sql>SELECT 1"]
    state, ts = jax.jit(jax.vmap(env.step))(jax.random.split(keys[0], rows), state,
                                            _chunks(env, texts), params)
    replies = [env.codec.decode(np.asarray(ts.observation.tokens[b])[
        :int(ts.observation.length[b])], stop_at_pad=False) for b in range(rows)]
    expected = run_sql(tasks[0].data.to_bytes(), tasks[0].solution).observation
    assert replies[0] == codec_lib.decode_action(env.codec, *codec_lib.encode_reply(
        env.codec, expected, env.obs_len))
    assert replies[1].startswith("error: only read-only queries")
    assert replies[2] == "error: no such column: nope"
    assert replies[3:] == ["correct", "wrong", "invalid"]
    np.testing.assert_allclose(ts.reward, [0, 0, 0, 1, 0, -0.1], atol=1e-7)
    np.testing.assert_array_equal(ts.info["process_reward"], [1, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(ts.info["tool_calls"], [1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(ts.terminated, [False] * 3 + [True, True, False])


def test_oracle_solves_and_the_demonstrator_is_weaker():
    env = SqlQuery()
    oracle = rollout_lib.scripted_rollout(env, jax.random.key(1), num_tasks=16,
                                          group_size=1, action_source="oracle")
    assert bool(oracle.success.all()) and (np.asarray(oracle.num_turns) == 2).all()
    demo = rollout_lib.scripted_rollout(env, jax.random.key(1), num_tasks=48, group_size=1,
                                        action_source="demonstrator")
    success, turns = np.asarray(demo.success), np.asarray(demo.num_turns)
    # It fails exactly when it skipped the query (1 - 0.3 = 0.7 expected).
    np.testing.assert_array_equal(success, turns == 2)
    assert 0.5 <= success.mean() <= 0.9, success.mean()
