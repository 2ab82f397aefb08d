"""`textarena:<game>` against the real package (the `textarena` extra; these tests skip,
saying so, without it): one TextArena game object per episode, drawn from the episode's
seed exactly as TextArena draws it alone, with its own `random` state; the game's action
format; a cut episode paid the game's completion reward; invalid moves as format errors;
the oracle and demonstrator; replay of evicted sessions; one-line refusals."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import arl
from arl import rollout as rollout_lib
from arl.envs.base import TokenChunk
from arl.envs.host import _seed_int
from arl.errors import ConfigError
from arl.text.codec import decode_action, encode_action

textarena = pytest.importorskip(
    "textarena", reason="textarena is not installed (pip install 'arl[textarena]')")

_SMALL = {"min_number": 1, "max_number": 8, "max_turns": 8}


def _env(**kwargs):
    return arl.make_env({"name": "textarena:GuessTheNumber-v0",
                         "kwargs": {"prompt_len": 24, "obs_len": 64, **kwargs}})


@pytest.fixture(scope="module")
def small():
    """One env (1..8, 8 turns) for the tests that go through JAX, its reset and step
    compiled once."""
    env = _env(game_kwargs=_SMALL)
    env.jitted = (jax.jit(jax.vmap(env.reset)), jax.jit(jax.vmap(env.step)))
    return env


def _session(env, seed):
    from arl.envs.sessions import EpisodeKey

    return env.open_session(EpisodeKey(seed=seed, session_id=seed), ())


def _number_alone(seed, **game_kwargs):
    """The number TextArena's own game draws for `seed` (the process's `random` kept)."""
    saved = random.getstate()
    try:
        game = textarena.make("GuessTheNumber-v0-raw", **game_kwargs)
        game.reset(num_players=1, seed=seed)
        return game.game_number
    finally:
        random.setstate(saved)


class _Rows:
    """A batch of rows played turn by turn with given texts; rows 2i and 2i + 1 share
    their reset key (a GRPO group of two: the same game)."""

    def __init__(self, env, rows=4, seed=0):
        self.env = env
        self.keys = jax.random.split(jax.random.key(seed), rows // 2)[
            np.arange(rows) // 2]
        self.params = arl.envs.broadcast_params(env.default_params(), rows)
        self.reset, self.step_fn = env.jitted
        self.state, _ = self.reset(self.keys, self.params)
        self.seeds = [_seed_int(self.state.seed[b]) for b in range(rows)]

    def step(self, texts):
        ids, lengths = zip(*(encode_action(self.env.codec, t, self.env.action_len)
                             for t in texts))
        chunk = TokenChunk(np.stack(ids), np.asarray(lengths, np.int32))
        self.state, ts = self.step_fn(self.keys, self.state, chunk, self.params)
        replies = [decode_action(self.env.codec, ts.observation.tokens[b],
                                 ts.observation.length[b]) for b in range(len(texts))]
        return jax.device_get(ts), replies


def test_each_episode_plays_textarenas_own_game_of_its_seed(small):
    env = small
    assert env.max_turns == 8 and env.resume_mode == "replay" and env.has_oracle
    process_random = random.getstate()
    rows = _Rows(env)
    numbers = [_number_alone(s, **_SMALL) for s in rows.seeds]
    assert rows.seeds[0] == rows.seeds[1] and rows.seeds[2] == rows.seeds[3]  # groups
    wrong = [1 if n != 1 else 2 for n in numbers]
    ts, replies = rows.step([str(numbers[0]), str(wrong[1]), str(numbers[2]),
                             str(wrong[3])])
    np.testing.assert_array_equal(ts.reward, [1.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(ts.info["success"], [True, False, True, False])
    np.testing.assert_array_equal(ts.terminated, [True, False, True, False])
    assert replies[0].startswith("Congratulations! You guessed the correct number.")
    for b in (1, 3):
        hint = "lower" if wrong[b] > numbers[b] else "higher"
        assert replies[b] == f"The target number is {hint}."
    assert random.getstate() == process_random  # the games drew from their own states


def test_moves_in_the_games_own_brackets_pass_as_written():
    """A codec with "[" "]" (a tokenizer) writes the game's format itself: the move
    in brackets is played as written; text with no bracket is wrapped in one pair."""
    env = _env()
    number = _number_alone(11)
    session, prompt = _session(env, 11)
    assert "Guess The Number" in prompt
    wrong = 1 if number != 1 else 2
    turn = env.session_step(session, f"I guess [{wrong}] now", random.Random(0))
    assert not turn.format_error and turn.reply.startswith("The target number is")
    turn = env.session_step(session, f" {number} ", random.Random(0))
    assert turn.terminated and turn.success and turn.reward == 1.0
    env.close_session(session)


def test_a_session_draws_what_the_game_alone_draws_whatever_else_runs(small):
    """Sessions opened and stepped in between, and the process's own draws, change no
    game: each hides the number TextArena's game alone draws for its seed."""
    env = small
    seeds = [101, 202, 303, 404]
    first = [_session(env, s)[0] for s in seeds[:2]]
    random.seed(99)
    random.random()
    others = [_session(env, s)[0] for s in seeds[2:]]
    for session in others:
        env.session_step(session, "4", random.Random(0))
    again = [_session(env, s)[0] for s in seeds[:2]]
    for seed, a, b in zip(seeds, first, again):
        expected = _number_alone(seed, **_SMALL)
        assert env.session_oracle(a) == env.session_oracle(b) == str(expected)
    for session in first + others + again:
        env.close_session(session)


def test_rows_reset_in_between_change_no_rows_game(small):
    """Rows reset in between, and the process's own draws, change no row's game: the
    number the game alone draws wins both times."""
    env = small
    first = _Rows(env, rows=2, seed=5)
    random.seed(99)
    random.random()
    _Rows(env, rows=2, seed=6)
    again = _Rows(env, rows=2, seed=5)
    assert first.seeds == again.seeds
    expected = _number_alone(first.seeds[0], **_SMALL)
    ts, _ = first.step([str(expected)] * 2)
    np.testing.assert_array_equal(ts.reward, [1.0, 1.0])
    ts, _ = again.step([str(expected)] * 2)
    np.testing.assert_array_equal(ts.reward, [1.0, 1.0])


def test_a_cut_episode_is_paid_the_games_completion_reward():
    """arl's limit (2) before the game's (10): the last turn gets the game's completion
    reward 1 - |guess - number| / (max - min), not a success, and is not terminated (the
    base class truncates it)."""
    env = _env(max_turns=2)
    assert env.game_max_turns == 10
    number = _number_alone(4)
    guesses = [n for n in range(1, 21) if n != number][:2]
    session, _ = _session(env, 4)
    turn = env.session_step(session, str(guesses[0]), random.Random(0))
    assert (turn.reward, turn.terminated) == (0.0, False)
    turn = env.session_step(session, str(guesses[1]), random.Random(0))
    assert turn.reward == pytest.approx(1 - abs(guesses[1] - number) / 19)
    assert not turn.terminated and not turn.success
    assert turn.reply.endswith("Turn limit (2) reached.")


def test_invalid_moves_are_format_errors_and_the_second_in_a_row_ends_the_game():
    env = _env()
    for second in ("x", "0"):  # "[0]": outside 1..20, also invalid
        session, _ = _session(env, 3)
        turn = env.session_step(session, "x", random.Random(0))
        assert turn.format_error and not turn.terminated
        assert turn.reply.startswith("You attempted an invalid move.")
        turn = env.session_step(session, second, random.Random(0))
        assert turn.format_error and turn.terminated and not turn.success
        assert turn.reward == 0.0  # no guess yet: completion 0
        assert turn.reply.startswith("Invalid Move: Invalid move")


def test_the_oracle_wins_at_once_and_the_demonstrator_within_the_range(small):
    env = small
    session, _ = _session(env, 21)
    assert env.session_oracle(session) == str(_number_alone(21, **_SMALL))
    live = env.live_sessions()
    demo = rollout_lib.scripted_rollout(env, jax.random.key(0), num_tasks=4, group_size=2,
                                        action_source="demonstrator")
    # It guesses only numbers the hints leave, so it wins within the 8 numbers.
    assert bool(demo.success.all()) and float(np.mean(demo.num_turns)) > 1.0
    assert env.live_sessions() == live  # every episode's session closed


def test_evicted_sessions_are_replayed_from_their_recorded_actions(small):
    """A pool of 2 sessions for 4 rows: the first two are evicted at reset and replayed
    (same seed, same actions) when stepped; the rows play as in a pool that kept them."""
    outcomes = []
    env = small
    for max_sessions in (2, 64):
        env.max_sessions = max_sessions
        replayed = env.session_counts["replayed"] if hasattr(env, "session_counts") else 0
        rows = _Rows(env, seed=7)
        numbers = [_number_alone(s, **_SMALL) for s in rows.seeds]
        first = [1 if n != 1 else 2 for n in numbers]
        _, replies1 = rows.step([str(g) for g in first])
        ts, replies2 = rows.step([str(n) for n in numbers])
        outcomes.append((replies1, replies2, ts.reward.tolist(),
                         env.session_counts["replayed"] - replayed))
    env.max_sessions = 1024
    assert outcomes[0][:3] == outcomes[1][:3]
    np.testing.assert_array_equal(outcomes[0][2], [1.0] * 4)
    assert outcomes[0][3] >= 2 and outcomes[1][3] == 0


@pytest.mark.parametrize("name,message", [
    ("textarena:GuessTheNumbr-v0", r"^config.env.name='textarena:GuessTheNumbr-v0' is "
                                   r"invalid: TextArena has no game 'GuessTheNumbr-v0' "
                                   r"\(did you mean textarena:GuessTheNumber-v0\?\)"),
    ("textarena:TicTacToe-v0", r"^config.env.kwargs=\{\} is invalid: env "
                               r"'textarena:TicTacToe-v0' refused them: TextArena game "
                               r"'TicTacToe-v0' is not a single-player game"),
])
def test_unknown_and_multi_player_games_are_one_line(name, message):
    c = arl.default_config()
    c.env.name = name
    with pytest.raises(ConfigError, match=message) as raised:
        arl.validate(c)
    assert "\n" not in str(raised.value)


def test_game_kwargs_the_game_refuses_are_one_line():
    with pytest.raises(ConfigError, match=r"refused them: TextArena refused game "
                                          r"'GuessTheNumber-v0' with game_kwargs=\{'size': 3\}: "
                                          r"TypeError: "):
        arl.make_env({"name": "textarena:GuessTheNumber-v0",
                      "kwargs": {"game_kwargs": {"size": 3}}})


def test_without_the_package_the_name_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "textarena", None)  # import textarena fails
    with pytest.raises(ConfigError, match=r"env 'textarena:<game>' needs the textarena "
                                          r"package: pip install 'arl\[textarena\]'"):
        arl.make_env({"name": "textarena:GuessTheNumber-v0"})


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROGRESS = re.compile(r"^I\d{4} [\d:.]+ +\d+ experiment\.py:\d+\] ")


def _train(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config=configs/grpo_textarena.py",
         f"--workdir={tmp_path / 'run'}", "--config.train_steps=2",
         "--config.warm_start.sft_steps=2", "--config.warm_start.sft_batch=4",
         "--config.model.num_layers=1", "--config.rollout.num_tasks=2",
         "--config.rollout.group_size=2", "--config.sample_every=0", *args],
        cwd=_ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": _ROOT})


def test_trains_through_the_command_line_from_one_config_line(tmp_path):
    result = _train(tmp_path, "--config.env.name=textarena:GuessTheNumber-v0")
    assert result.returncode == 0, result.stderr[-3000:]
    from arl.runs import writers

    records = writers.read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in records][-1] == 2
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in records)


@pytest.mark.slow
@pytest.mark.parametrize("game,status,message", [
    ("GuessTheNumbr-v0", 2, "config.env.name='textarena:GuessTheNumbr-v0' is invalid: "
                            "TextArena has no game 'GuessTheNumbr-v0' (did you mean "),
    ("TicTacToe-v0", 2, "config.env.kwargs="),
    # 0.7.4's Chess module does not compile under Python < 3.12: still one line.
    ("Chess-v0", 2, "config.env.kwargs="),
    # Without NLTK's corpora (and network), NLTK prints its download errors first.
    ("Wordle-v0", 2, "config.env.kwargs="),
])
def test_a_bad_game_ends_the_command_line_in_one_line(tmp_path, game, status, message):
    result = _train(tmp_path, f"--config.env.name=textarena:{game}")
    lines = [line for line in result.stderr.splitlines() if not _PROGRESS.match(line)]
    assert result.returncode == status, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"experiments.train: error: {message}"), lines[0]
