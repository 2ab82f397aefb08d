"""Every in-graph token env means the same under the three codecs of tests/envs/codecs.py:
the oracle's episodes read the same texts and earn the same rewards, the numbers an env
writes are spelled as the codec spells them, and an agent's turn is read as text, however
its ids split it ("11" as one Llama-3 id or as two digits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arl.envs as E
from arl.data import word_problems
from arl.envs.base import TokenChunk
from tests.envs.codecs import CODEC_NAMES, codec

BATCH = 8
# Envs whose texts hold numbers: every chunk they write is the codec's own spelling.
NUMBER_WRITERS = ("guess_number", "calculator", "countdown", "bandit", "dataset_task")
KWARGS = {"guess_number": dict(max_n=1000), "calculator": dict(max_digits=3),
          "dataset_task": dict(path=word_problems.SHIPPED_JSONL, max_turns=2)}
DEFAULT_ENVS = ("guess_number", "calculator", "bandit")
SLOW_ENVS = ("countdown", "frozen_lake", "sokoban", "dataset_task")


def make_env(name, codec_name):
    return E.make(name, codec=codec(codec_name), **KWARGS.get(name, {}))


def oracle_episode(env):
    """Per turn: (observation texts, rewards, successes, format errors) of the oracle on
    BATCH rows with fixed keys, and the prompt texts and oracle turns' ids."""
    params = E.broadcast_params(env.default_params(), BATCH)
    reset = jax.jit(jax.vmap(env.reset))
    step = jax.jit(jax.vmap(env.step))
    oracle = jax.jit(jax.vmap(env.oracle_action))
    state, first = reset(jax.random.split(jax.random.key(3), BATCH), params)
    chunks = [first.observation]
    turns, actions = [], []
    key = jax.random.key(4)
    for _ in range(env.max_turns):
        key, key_act, key_step = jax.random.split(key, 3)
        action = oracle(jax.random.split(key_act, BATCH), state, params)
        state, ts = step(jax.random.split(key_step, BATCH), state, action, params)
        chunks.append(ts.observation)
        actions.append(action)
        turns.append((np.asarray(ts.reward), np.asarray(ts.info["success"]),
                      np.asarray(ts.info["format_error"])))
    texts = [[env.render_chunk(TokenChunk(c.tokens[i], c.length[i])) for i in range(BATCH)]
             for c in chunks]
    return texts, turns, chunks, actions


def check_env_means_the_same(name):
    reference_texts, reference_turns, _, _ = oracle_episode(make_env(name, "char"))
    assert any(np.any(success) for _, success, _ in reference_turns), name
    for codec_name in CODEC_NAMES[1:]:
        env = make_env(name, codec_name)
        texts, turns, chunks, actions = oracle_episode(env)
        assert texts == reference_texts, (name, codec_name)
        for (reward, success, error), (ref_reward, ref_success, ref_error) in zip(
                turns, reference_turns):
            np.testing.assert_array_equal(reward, ref_reward)
            np.testing.assert_array_equal(success, ref_success)
            np.testing.assert_array_equal(error, ref_error)
        if name not in NUMBER_WRITERS:
            continue
        for chunk, row_texts in zip(chunks, texts):  # the codec's own spelling
            for i, text in enumerate(row_texts):
                assert list(np.asarray(chunk.tokens[i, :chunk.length[i]])) == \
                    env.codec.encode(text), (name, codec_name, text)
        for action in actions:  # the oracle writes as the tokenizer does, then eot
            for i in range(BATCH):
                ids = list(np.asarray(action.tokens[i, :action.length[i]]))
                text = env.codec.decode(ids[:-1], stop_at_pad=False)
                assert ids == env.codec.encode(text) + [env.codec.eot_id], (name, text)


@pytest.mark.parametrize("name", DEFAULT_ENVS)
def test_env_means_the_same_under_every_codec(name):
    check_env_means_the_same(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_ENVS)
def test_env_means_the_same_under_every_codec_slow(name):
    check_env_means_the_same(name)


def _step_texts(env, state, id_lists, params):
    """Replies of `env` to one state, one action per list of ids."""
    size = max(len(ids) for ids in id_lists)
    tokens = np.full((len(id_lists), size), env.codec.pad_id, np.int32)
    for i, ids in enumerate(id_lists):
        tokens[i, :len(ids)] = ids
    actions = TokenChunk(jnp.asarray(tokens), jnp.asarray([len(i) for i in id_lists]))
    states = jax.tree.map(lambda x: jnp.broadcast_to(x, (len(id_lists),) + x.shape), state)
    keys = jax.random.split(jax.random.key(0), len(id_lists))
    _, ts = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))(keys, states, actions, params)
    return [env.render_chunk(TokenChunk(ts.observation.tokens[i], ts.observation.length[i]))
            for i in range(len(id_lists))]


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_turns_are_read_as_text_however_the_ids_split_it(codec_name):
    """guess_number and calculator answer the same to the tokenizer's own spelling of a
    turn and to the same text written one character per id."""
    env = E.GuessNumber(codec=codec(codec_name), max_n=1000)
    params = env.default_params()
    state, _ = env.reset(jax.random.key(0), params)
    state = state.replace(hidden=jnp.asarray(115))
    enc = env.codec.encode
    by_char = lambda text: [i for ch in text for i in enc(ch)]
    eot = [env.codec.eot_id]
    cases = {"11": "higher", "115": "correct", "999": "lower", "1150": "invalid",
             "1a": "invalid"}
    actions = [enc(t) + eot for t in cases] + [by_char(t) + eot for t in cases]
    assert _step_texts(env, state, actions, params) == list(cases.values()) * 2
    if codec_name == "llama3_bpe":
        assert len(enc("115")) == 1 and len(by_char("115")) == 3

    calc = E.make("calculator", codec=codec(codec_name), max_digits=3)
    params = calc.default_params()
    state, _ = calc.reset(jax.random.key(0), params)
    state = state.replace(answer=jnp.asarray(357))
    cases = {"<calc>12+345</calc>": "357", "<calc>-12*345</calc>": "-4140",
             "<answer>357</answer>": "correct", "<answer>35 7</answer>": "bad answer"}
    enc = calc.codec.encode
    actions = [enc(t) + eot for t in cases] + [by_char(t) + eot for t in cases]
    assert _step_texts(calc, state, actions, params) == list(cases.values()) * 2
