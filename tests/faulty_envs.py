"""User envs with the faults users' code produces, registered on import
(`config.imports = ("tests.faulty_envs",)`): tests/test_faults_data.py trains them.

`say_digit_faulty` is tests/user_envs.py's `say_digit` whose transition reward or reply
goes wrong on tasks whose digit is below `faulty_below` (10: every task):
`fault="nan"` / `"inf"` rewards, or `"token_id"`: a reply holding a token id past any
vocabulary (an env that encodes with the wrong tokenizer).
"""

from __future__ import annotations

import jax.numpy as jnp

from arl import envs
from tests.user_envs import SayDigit

FAULTS = ("nan", "inf", "token_id")
BAD_TOKEN_ID = 1_000_000


class SayDigitFaulty(SayDigit):
    name = "say_digit_faulty"

    def __init__(self, codec=None, max_turns: int = 2, fault: str = "nan",
                 faulty_below: int = 10):
        super().__init__(codec, max_turns)
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self.fault, self.faulty_below = fault, faulty_below

    def _transition(self, key, state, content, params):
        state, reply, reward, format_error = super()._transition(key, state, content, params)
        faulty = state.digit < self.faulty_below
        if self.fault == "token_id":
            reply = reply.replace(tokens=reply.tokens.at[0].set(
                jnp.where(faulty, BAD_TOKEN_ID, reply.tokens[0])))
        else:
            bad = jnp.nan if self.fault == "nan" else jnp.inf
            reward = jnp.where(faulty, bad, reward)
        return state, reply, reward, format_error


envs.register("say_digit_faulty", SayDigitFaulty)
