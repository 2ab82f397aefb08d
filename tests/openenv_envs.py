"""A small OpenEnv environment served by the tests (`openenv:tests.openenv_envs:app`):
find a hidden digit 0-9 from "higher" / "lower" replies. Its action is typed (an int
field `guess`), so the agent's text reaches it through a declared parser
(`guess_action`); a guess of 13 makes the server's environment raise (a server error)."""

from __future__ import annotations

import random
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    message: str = ""


class DigitGuess(Environment):
    """The hidden digit is drawn from the reset's seed."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.digit = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              **kwargs: Any) -> GuessObservation:
        self.digit = random.Random(seed).randrange(10)
        self._state = State(step_count=0)
        return GuessObservation(message="guess a digit", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None,
             **kwargs: Any) -> GuessObservation:
        if action.guess == 13:
            raise RuntimeError("the digit service is down")
        self._state.step_count += 1
        if action.guess == self.digit:
            return GuessObservation(message="right", done=True, reward=1.0)
        hint = "higher" if action.guess < self.digit else "lower"
        return GuessObservation(message=hint, done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def digit_of(seed: int) -> int:
    """The digit an episode of task seed `seed` hides (the adapter resets with
    seed mod 2**31)."""
    return random.Random(seed % 2 ** 31).randrange(10)


def guess_action(text: str) -> dict:
    """The agent's text as the env's action: an integer (ValueError otherwise)."""
    return {"guess": int(text.strip())}


app = create_app(DigitGuess, GuessAction, GuessObservation, env_name="digit_guess",
                 max_concurrent_envs=64)
