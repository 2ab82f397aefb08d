"""Errors a user can act on. Kept apart so every layer can raise them without import
cycles (the config schema imports the environment registry and the algorithm table).

Every rejection of a user's setting is a `ConfigError` with a one-line message naming
the field (`config.<field>=<value>`), the bad value and what is allowed; the command-line
programs print that line and exit with status 2 instead of a traceback."""

from __future__ import annotations

import difflib
import logging
from typing import Iterable


class ConfigError(ValueError):
    """A configuration field has a value outside its allowed set."""


class RunStopped(RuntimeError):
    """A run ended on a fault it can name in one line (a checkpoint it could not write,
    a non-finite step); the command-line programs print that line and exit with
    status 1. Everything written before it (checkpoints, logs) is intact."""


class RewardFunctionError(RunStopped):
    """A user's Python reward function failed (raised, timed out, or returned something
    other than one finite number or None per row); the message is one line naming the
    function and the row (`arl.rewards.functions`)."""


def invalid_field(field: str, value, allowed: str) -> ConfigError:
    """The error for `config.<field>` = `value`, saying what is `allowed`."""
    return ConfigError(f"config.{field}={value!r} is invalid: {allowed}.")


def one_line(text) -> str:
    """`text` (a string or an exception) on one line: runs of whitespace, newlines
    included, become one space. A KeyError's message is its argument, not its repr."""
    if isinstance(text, KeyError) and text.args:
        text = text.args[0]
    return " ".join(str(text).split())


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like `name` (difflib's ratio >= 0.6), or None."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: Iterable[str], prefix: str = "") -> str:
    """" (did you mean <prefix><closest>?)" when a candidate is close to `name`, else ""."""
    match = closest(name, candidates)
    return f" (did you mean {prefix}{match}?)" if match is not None else ""


# The logger JAX reports an exception of a host callback with (`logger.exception(
# "jax.io_callback failed")`: the whole traceback) before re-raising it from the step.
_JAX_CALLBACK_LOGGER = "jax._src.callback"


class _OneLineCallbackFailures(logging.Filter):
    """Drops JAX's traceback record of a host callback that raised one of arl's one-line
    errors (`RunStopped`, `ConfigError`): the caller reports that line itself. Any other
    exception (a bug) keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, (RunStopped, ConfigError))


_CALLBACK_FILTER = _OneLineCallbackFailures()


def quiet_callback_failures() -> None:
    """Keeps JAX from logging a traceback for an arl one-line error raised inside a host
    callback (a failing Python reward function); idempotent."""
    logger = logging.getLogger(_JAX_CALLBACK_LOGGER)
    if _CALLBACK_FILTER not in logger.filters:
        logger.addFilter(_CALLBACK_FILTER)
