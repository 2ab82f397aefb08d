"""TextArena single-player games as arl environments: `config.env.name = "textarena:<id>"`.

    python -m experiments.train --config=configs/grpo_textarena.py --workdir=/tmp/ta \
        --config.env.name=textarena:GuessTheNumber-v0

TextArena (`pip install 'arl[textarena]'`, tested with 0.7.4) holds each game as a
Python object with hidden state, so every episode is one session of a
`SessionEnvironment` (`arl.envs.sessions`): the game is made and reset with the
episode's task seed when its row is reset, stepped with each of the agent's turns and
dropped when the episode ends. What maps to what:

* game: `textarena.make(<id>, **game_kwargs)` with TextArena's observation and action
  wrappers taken off (the adapter does their job, below); only single-player games
  (a `SinglePlayerState`) are accepted.
* prompt: the messages the game shows at reset, joined by newlines; a reply: the
  messages the game adds after a turn (the agent's own action, which the context already
  holds, left out), and at the end of the game its reason ("Congratulations! ...").
  Text longer than `prompt_len` / `obs_len` tokens is cut and ends in "..".
* action: the game's format: moves in square brackets ("[5]", "[up]"). An action with no
  bracket at all is wrapped in one pair, as TextArena's own `ActionFormattingWrapper`
  does, so a codec without "[" "]" (the character codec) can still play ("5" plays
  "[5]").
* reward: the game's reward when it ends (TextArena's single-player games give 1 for a
  win and their completion fraction otherwise), 0 on earlier turns. A turn the game
  calls invalid is a format error (the game forgives one in a row, then ends).
* turn limits: `max_turns` defaults to the game's own limit (20 for a game without one).
  arl counts every turn, the game only valid ones, so arl's limit can come first: the
  episode is then cut (truncated) with the game's own completion reward for the
  unfinished game (`_get_percentage_completion()`, which it pays at its own limit and on
  invalid moves; 0 for a game without one), never with nothing.
* success: the game ended with a reward of 1 (a win) and not on an invalid move.
* oracle and demonstrator, where the game's hidden state allows: GuessTheNumber (the
  number; the demonstrator guesses in the range the hints leave, half the time its
  midpoint), Mastermind (the code).

Randomness. TextArena seeds and draws from Python's global `random` (its `State` calls
`random.seed(seed)`; games call `random.randint`), which the pool's threads share. Each
session keeps its own `random` state: every call into a game (make, reset, step, oracle)
runs under one process-wide lock with the global state swapped for the session's and
back (`_isolated`). So a session's draws do not depend on the other sessions, the game is
deterministic given its seed and actions (`deterministic=True`: resume and Monte Carlo
branching replay the recorded actions), and the process's own `random` is left as it
was. A game that draws from another generator is not covered: give it
`deterministic=False` (resume mode "restart"). The cost: the games' own Python runs one
row at a time (the pool still overlaps everything outside the lock), plus the swaps (a
Mersenne Twister state of 625 words saved and set twice per call); docs/environments.md
has the measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import random
import sys
import tempfile
import threading
from typing import Any, Callable

import jax.numpy as jnp

from arl.envs.host import HostTurn
from arl.envs.sessions import EpisodeKey, SessionEnvironment
from arl.errors import did_you_mean, one_line
from arl.text.codec import CharCodec, Codec, encode_reply

PREFIX = "textarena"
DEFAULT_MAX_TURNS = 20  # for a game with no turn limit of its own
_RANDOM_LOCK = threading.Lock()  # one game call at a time touches the global `random`


def _library():
    try:
        import textarena  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        raise ValueError("env 'textarena:<game>' needs the textarena package: "
                         "pip install 'arl[textarena]'") from error
    return textarena


def _registry() -> dict:
    _library()
    from textarena.envs.registration import ENV_REGISTRY  # pylint: disable=import-outside-toplevel
    return ENV_REGISTRY


@dataclasses.dataclass
class _Game:
    """One session: the game object, its own `random` state and its progress."""

    game: Any
    rng_state: Any = None
    turns: int = 0  # the agent's turns played (arl's count, valid or not)
    done: bool = False


@contextlib.contextmanager
def _isolated(session: _Game):
    """Runs a game call with the global `random` holding the session's state, then puts
    the process's state back."""
    with _RANDOM_LOCK:
        saved = random.getstate()
        try:
            if session is not None:
                random.setstate(session.rng_state)
            yield
        finally:
            session.rng_state = random.getstate()
            random.setstate(saved)


@contextlib.contextmanager
def _quiet():
    """Drops what the code inside prints, to file descriptors 1 and 2 too: a game module
    that fails may print first (NLTK's download attempts when Wordle's or Hangman's
    module is imported, written to the `sys.stderr` NLTK bound at its import), and a
    failure is one line. Used once, when the env is built (a short window in which
    other threads' output is dropped too)."""
    sink = tempfile.TemporaryFile()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        with contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for descriptor in saved:
            os.close(descriptor)
        sink.close()


def _unwrapped(game):
    """The game under TextArena's wrappers (the adapter formats observations and actions
    itself)."""
    while hasattr(game, "env") and not hasattr(game, "state"):
        game = game.env
    return game


def _text(messages, drop_actions: bool) -> str:
    """The texts of TextArena observation messages `(from_id, text, type)`, one a line;
    the player's own actions left out with `drop_actions`."""
    out = []
    for message in messages:
        sender, text = message[0], message[1]
        if drop_actions and sender == 0:
            continue
        out.append(str(text))
    return "\n".join(out)


# Scripted players, by game class: (oracle, demonstrator or None); each reads the game.
def _guess_oracle(game) -> str:
    return str(game.state.game_state["game_number"])


def _guess_demonstrator(game, rng: random.Random) -> str:
    """A weaker teacher than the oracle: a number of the range the hints leave, the
    midpoint half the time and a uniform draw from it otherwise."""
    low, high = game.min_number, game.max_number
    for guess, hint in game.state.game_state["guess_history"]:
        if hint == "higher":
            low = max(low, guess + 1)
        else:
            high = min(high, guess - 1)
    high = max(high, low)
    return str((low + high) // 2 if rng.random() < 0.5 else rng.randint(low, high))


def _mastermind_oracle(game) -> str:
    return " ".join(str(n) for n in game.state.game_state["secret_code"])


_SCRIPTS: dict[str, tuple[Callable, Callable | None]] = {
    "GuessTheNumberEnv": (_guess_oracle, _guess_demonstrator),
    "MastermindEnv": (_mastermind_oracle, None),
}


class TextArenaGame(SessionEnvironment):
    """One TextArena single-player game, a session per episode (module docstring)."""

    deterministic = True

    def __init__(self, game: str, game_kwargs: dict | None = None,
                 codec: Codec | None = None, max_turns: int | None = None,
                 action_len: int = 16, prompt_len: int | None = None, obs_len: int = 64,
                 max_sessions: int = 1024, step_timeout_s: float | None = 60.0,
                 deterministic: bool = True):
        self.textarena = _library()
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic={deterministic!r} must be True or False")
        self.deterministic = deterministic
        _checked_game(game)
        self.game_id = game
        self.name = f"{PREFIX}:{game}"
        self.game_kwargs = dict(game_kwargs or {})
        self.codec = codec if codec is not None else CharCodec()
        for field, value in (("action_len", action_len), ("obs_len", obs_len),
                             ("max_sessions", max_sessions)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}={value!r} must be an int >= 1")
        probing = _Game(None, random.Random(0).getstate())
        with _isolated(probing), _quiet():
            probe = probing.game = self._make()
            try:
                probe.reset(num_players=1, seed=0)
            except AssertionError as error:  # SinglePlayerState asserts num_players == 1
                raise ValueError(f"TextArena game {game!r} is not a single-player game "
                                 f"({one_line(error)}); only single-player games are "
                                 "adapted") from error
            except Exception as error:  # pylint: disable=broad-except
                raise ValueError(f"TextArena game {game!r} failed to reset: "
                                 f"{type(error).__name__}: {one_line(error)}") from error
        if not isinstance(probe.state, self.textarena.SinglePlayerState):
            raise ValueError(f"TextArena game {game!r} is not a single-player game (its "
                             f"state is {type(probe.state).__name__}); only single-player "
                             "games are adapted")
        own_limit = probe.state.max_turns
        if max_turns is None:
            max_turns = own_limit if isinstance(own_limit, int) and own_limit > 0 \
                else DEFAULT_MAX_TURNS
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} must be an int >= 1 (None: the "
                             f"game's own limit, {own_limit!r})")
        self.game_max_turns = own_limit
        self.max_turns = max_turns
        self.action_len = action_len
        self.max_sessions = max_sessions
        self.step_timeout_s = step_timeout_s
        self._scripts = _SCRIPTS.get(type(probe).__name__, (None, None))
        first_prompt = _text(probe.get_observation()[1], drop_actions=False)
        self.prompt_len = int(prompt_len) if prompt_len is not None else \
            _width(self.codec, first_prompt) + 16  # other seeds' prompts may be longer
        self.obs_len = obs_len

    def _make(self):
        try:
            return _unwrapped(self.textarena.make(self.game_id, **self.game_kwargs))
        except Exception as error:  # pylint: disable=broad-except
            # A game's module may fail in any way (0.7.4's Chess does not even compile
            # under Python < 3.12): one line, never its traceback.
            raise ValueError(f"TextArena refused game {self.game_id!r} with "
                             f"game_kwargs={self.game_kwargs!r}: {type(error).__name__}: "
                             f"{one_line(error)}") from error

    # -- the static side
    def default_params(self):
        return ()

    def reward_bounds(self, params):
        return jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32)

    @property
    def has_oracle(self) -> bool:
        return self._scripts[0] is not None

    @property
    def has_demonstrator(self) -> bool:
        return self.has_oracle

    # -- sessions
    def open_session(self, key: EpisodeKey, params) -> tuple[_Game, str]:
        session = _Game(None, random.Random(key.seed).getstate())
        with _isolated(session):
            session.game = self._make()
            session.game.reset(num_players=1, seed=int(key.seed))
            messages = session.game.get_observation()[1]
        return session, _text(messages, drop_actions=False)

    def session_step(self, session: _Game, action: str, rng: random.Random) -> HostTurn:
        del rng  # the game draws from its session's own `random` state
        move = action.strip()
        if "[" not in move and "]" not in move:
            move = f"[{move}]"  # TextArena's ActionFormattingWrapper
        game = session.game
        with _isolated(session):
            done, _ = game.step(move)
            messages = game.get_observation()[1]
            session.turns += 1
            state = game.state
            invalid = state.error_count > 0 or bool(state.game_info[0].get("invalid_move"))
            reply = _text(messages, drop_actions=True)
            if done:
                session.done = True
                reward = float((state.rewards or {}).get(0, 0.0))
                reason = state.game_info[0].get("reason")
                reply = "\n".join(t for t in (reply, reason and str(reason)) if t)
                return HostTurn(reply=reply, reward=reward, terminated=True,
                                success=reward >= 1.0 and not invalid, format_error=invalid)
            if session.turns >= self.max_turns:  # arl's limit first: cut, paid as the game
                completion = getattr(game, "_get_percentage_completion", None)
                reward = float(completion()) if completion is not None else 0.0
                reply = "\n".join(t for t in (reply, f"Turn limit ({self.max_turns}) "
                                              "reached.") if t)
                return HostTurn(reply=reply, reward=reward, format_error=invalid)
        return HostTurn(reply=reply, format_error=invalid)

    def close_session(self, session: _Game) -> None:
        with _isolated(session):
            session.game.close()

    def session_oracle(self, session: _Game) -> str:
        oracle = self._scripts[0]
        if oracle is None:
            raise NotImplementedError(f"{self.name} has no oracle")
        with _isolated(session):
            return oracle(session.game)

    def session_demonstrator(self, session: _Game, rng: random.Random) -> str:
        demonstrator = self._scripts[1]
        if demonstrator is None:
            return self.session_oracle(session)
        with _isolated(session):
            return demonstrator(session.game, rng)


def _width(codec: Codec, text: str) -> int:
    """Tokens of `text` as the host writes it (characters the codec lacks as "?")."""
    return int(encode_reply(codec, text, 4 * len(text) + 8)[1])


def _checked_game(game: str) -> None:
    """ValueError naming the closest registered game when `game` is not one."""
    registry = _registry()
    if game not in registry:
        single = sorted(name for name in registry if not name.endswith(("-raw", "-train")))
        raise ValueError(f"TextArena has no game {game!r}"
                         f"{did_you_mean(game, single, PREFIX + ':')}; see "
                         "textarena.envs.registration.ENV_REGISTRY for its games")


def factory(game: str):
    """What "textarena:<game>" builds (ValueError: no such game, or no library)."""
    _checked_game(game)
    return functools.partial(TextArenaGame, game)
