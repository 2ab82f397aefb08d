"""A stateful host environment for tests (`arl.envs.sessions`), registered as
"digit_game" when imported (`config.imports = ("tests.session_envs",)`).

Each episode is a `DigitGame` object held on the host: a hidden digit drawn from the
episode's seed; the agent guesses, the game answers "higher" / "lower" and counts the
tries in its own state (no memory field), and a guess that is not one digit is a format
error. The `deterministic` class attribute picks the resume mode; `fail_open_on` /
`fail_step_on` make opening or stepping fail for given hidden digits (per-row errors).
Every opened, stepped and closed session is recorded in `DigitGames.log`.
"""

from __future__ import annotations

import random

import jax.numpy as jnp

from arl import envs
from arl.envs.host import HostTurn
from arl.envs.sessions import SessionEnvironment
from arl.text.codec import CharCodec


class DigitGame:
    def __init__(self, seed: int):
        self.digit = random.Random(seed).randint(0, 9)
        self.tries = 0
        self.closed = False


class DigitGames(SessionEnvironment):
    name = "digit_game"
    deterministic = True

    def __init__(self, max_turns: int = 3, max_sessions: int = 1024,
                 deterministic: bool | None = None, fail_open_on=(), fail_step_on=()):
        self.codec = CharCodec()
        self.max_turns = max_turns
        self.prompt_len, self.obs_len, self.action_len = 16, 24, 4
        self.max_sessions = max_sessions
        self.max_workers = 4
        if deterministic is not None:
            self.deterministic = deterministic
        self.fail_open_on, self.fail_step_on = tuple(fail_open_on), tuple(fail_step_on)
        self.log = []  # ("open", key) / ("step", session_id, action) / ("close", id)

    def default_params(self):
        return ()

    def reward_bounds(self, params):
        return jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32)

    def open_session(self, key, params):
        game = DigitGame(key.seed)
        if game.digit in self.fail_open_on:
            raise ConnectionError(f"cannot open a game for digit {game.digit}")
        game.session_id = key.session_id
        self.log.append(("open", key))
        return game, "guess a digit"

    def session_step(self, game, action, rng):
        assert not game.closed, "a closed session was stepped"
        self.log.append(("step", game.session_id, action))
        if game.digit in self.fail_step_on:
            raise RuntimeError("the game crashed")
        game.tries += 1
        if len(action) != 1 or not action.isdigit():
            return HostTurn(reply=f"one digit (try {game.tries})", format_error=True)
        guess = int(action)
        if guess == game.digit:
            return HostTurn(reply="yes", reward=1.0, terminated=True, success=True)
        return HostTurn(reply=f"{'higher' if guess < game.digit else 'lower'} "
                              f"(try {game.tries})")

    def close_session(self, game):
        game.closed = True
        self.log.append(("close", game.session_id))

    def session_oracle(self, game):
        return str(game.digit)

    def session_demonstrator(self, game, rng):
        """Wrong on the first try (one above the digit), right after."""
        return str((game.digit + 1) % 10) if game.tries == 0 else str(game.digit)


envs.register("digit_game", DigitGames)
