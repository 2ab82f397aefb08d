"""Reward functions written in plain Python, scored on the host for a batch of episodes.

    def correctness(prompts, completions, answer, **columns) -> list[float | None]: ...

    scorer = RewardFunctions(["my_rewards:correctness", "my_rewards:formatted"],
                             weights=[1.0, 0.2])
    scores, errors = scorer.score(scorer.episodes(env, tokens, agent_mask, length, rows))

A reward function is called once per step with the whole batch, as keyword arguments
(the convention of TRL's `reward_funcs`):

* ``prompts``: each row's prompt as its dataset holds it (a string, or a list of
  ``{"role", "content"}`` messages); for an env without a dataset, the prompt text;
* ``completions``: the text of each row's last agent turn (its end-of-turn token
  dropped);
* ``messages``: each row's whole episode as messages (the prompt's, then the agent's turns
  as "assistant" and the env's replies as "user", or as "tool" for a tool env in the
  template's tool convention);
* the env's columns (`reward_columns`): for ``dataset_task``, ``answer`` (the reference
  answer text) and every other column of the dataset's rows, one value per row.

It returns one number per row, or None for a row it does not score (that row gets 0
from it, and is left out of its logged mean and std). Functions must accept ``**kwargs``
(columns they do not read). The functions of one step run at once on a thread pool, each
call under a time limit (`timeout_s`).

Failures: a function that raises, runs past `timeout_s`, returns something that is not
one number (or None) per row, or a non-finite number, is a `RewardFunctionError` with
one line naming the function and the first bad row (an exception on the batch is
located by calling the function on each row alone); with ``on_error="zero"`` the bad
rows score 0 instead and are counted (`score`'s error counts, logged as
``reward/<name>/errors``). A timed-out call is abandoned, not killed (Python threads
cannot be): its worker stays busy until the function returns.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import math
import numbers
import threading
from typing import Any, Callable, Sequence

import numpy as np

from arl.errors import RewardFunctionError, one_line
from arl.text.chat_template import env_chat_format
from arl.text.codec import stop_ids
from arl.tools.daemon_pool import DaemonPool

ON_ERROR = ("raise", "zero")
# Keyword arguments every function gets; a column of the env with one of these names
# would be shadowed, so it is refused.
RESERVED_ARGUMENTS = ("prompts", "completions", "messages")
_SHOWN_CHARS = 60  # of a row's completion, in an error line


def resolve(spec: str) -> Callable:
    """The function named by "module:function" (the module imported, e.g. one of
    `config.imports`); ValueError naming what is missing."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{spec!r} is not a reward function name: expected "
                         "'module:function', e.g. 'my_rewards:correctness'")
    module_name, attribute = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{spec!r}: importing {module_name!r} failed: {one_line(error)} "
                         "(the module must be installed or on PYTHONPATH)") from error
    function = module
    for part in attribute.split("."):
        function = getattr(function, part, None)
        if function is None:
            raise ValueError(f"{spec!r}: module {module_name!r} has no {attribute!r}")
    if not callable(function):
        raise ValueError(f"{spec!r} is a {type(function).__name__}, not a function")
    return function


def function_name(spec: str) -> str:
    """The name a function's metrics are logged under: its last dotted part."""
    return spec.split(":")[-1].split(".")[-1]


@dataclasses.dataclass(frozen=True)
class Episodes:
    """A batch of finished episodes as text, the arguments of every reward function."""

    prompts: list
    completions: list[str]
    messages: list[list[dict]]
    columns: dict[str, list]
    # The rows of the env's dataset the episodes played (None: an env without one);
    # error lines name them.
    dataset_rows: list[int] | None = None

    def __len__(self) -> int:
        return len(self.completions)

    def describe(self, row: int) -> str:
        """Batch row `row` as an error line names it: its dataset row (where the env has
        a dataset), its prompt and completion (each cut to 60 characters) and where it
        sits in the batch."""
        prompt = self.prompts[row]
        if isinstance(prompt, (list, tuple)):  # messages: the last one's content
            prompt = prompt[-1].get("content", "") if prompt else ""
        where = "" if self.dataset_rows is None else f"dataset row {self.dataset_rows[row]}, "
        return (f"{where}prompt {_shown(str(prompt))}, completion "
                f"{_shown(self.completions[row])} (batch row {row} of {len(self)})")

    def arguments(self, rows: Sequence[int] | None = None) -> dict[str, list]:
        """The keyword arguments of a call (for `rows` only, if given)."""
        arguments = dict(prompts=self.prompts, completions=self.completions,
                         messages=self.messages, **self.columns)
        if rows is None:
            return arguments
        return {k: [v[r] for r in rows] for k, v in arguments.items()}


def _segments(agent: np.ndarray, length: int) -> list[tuple[bool, int, int]]:
    """(is_agent, start, end) runs of the first `length` positions."""
    runs, start = [], 0
    while start < length:
        end = start
        while end < length and agent[end] == agent[start]:
            end += 1
        runs.append((bool(agent[start]), start, end))
        start = end
    return runs


def episode_texts(env, tokens, agent_mask, length) -> tuple[str, list[tuple[str, str]]]:
    """(prompt text, [(role, content), ...] of the turns) of one rollout row, the chat
    template's pieces (or arl's <bos>) cut off: the agent's turns without the token that
    ended them (`arl.text.codec.stop_ids`), the env's replies as it wrote them."""
    codec = env.codec
    chat = env_chat_format(env)
    tokens = np.asarray(tokens)
    runs = _segments(np.asarray(agent_mask) > 0, int(length))
    decode = lambda ids: codec.decode(ids, stop_at_pad=False)
    stops = set(stop_ids(codec))
    prompt, turns, agent_ended = "", [], True
    for k, (is_agent, start, end) in enumerate(runs):
        ids = tokens[start:end]
        if is_agent:
            last = int(ids[-1]) if len(ids) else None
            # The rollout closes a turn that did not end on eot_id with an eot in front
            # of the reply (`ChatFormat.wrap_reply`); any stop id ends the agent's text.
            agent_ended = last == codec.eot_id
            turns.append(("assistant", decode(ids[:-1] if last in stops else ids)))
        elif k == 0:
            if chat is None:
                ids = ids[1:]  # <bos>
            else:
                ids = ids[len(chat.prompt_prefix):len(ids) - len(chat.turn_suffix)]
            prompt = decode(ids) if chat is None else _inside(decode(ids), chat.prompt_around)
        else:
            if chat is not None:
                head = len(chat.reply_prefix) + (0 if agent_ended else 1)
                ids = ids[head:len(ids) - len(chat.reply_suffix)]
            text = decode(ids) if chat is None else _inside(decode(ids), chat.reply_around)
            turns.append(("user" if chat is None else chat.reply_role, text))
    return prompt, turns


def _inside(text: str, around: tuple[str, str]) -> str:
    """`text` without the template's text the env wrote around it (`arl.text.seams`)."""
    head, tail = around
    if text.startswith(head) and text.endswith(tail) and len(text) >= len(head) + len(tail):
        return text[len(head):len(text) - len(tail)]
    return text


def episodes(env, tokens, agent_mask, length, task_rows=None) -> Episodes:
    """The `Episodes` of a rollout's rows (host arrays [B, S], [B, S], [B]); `task_rows`
    [B] (or None) the rows of the env's dataset, for its `reward_prompts` and
    `reward_columns` (envs without them give the decoded prompt and no columns)."""
    tokens, agent_mask, length = map(np.asarray, (tokens, agent_mask, length))
    batch = tokens.shape[0]
    prompts, completions, messages = [], [], []
    for b in range(batch):
        prompt, turns = episode_texts(env, tokens[b], agent_mask[b], length[b])
        prompts.append(prompt)
        completions.append(next((c for role, c in reversed(turns) if role == "assistant"),
                                ""))
        messages.append([{"role": role, "content": content} for role, content in turns])
    columns, rows = {}, None
    if task_rows is not None and hasattr(env, "reward_columns"):
        rows = [int(r) for r in np.asarray(task_rows).reshape(-1)]
        source = env.reward_prompts(rows)
        prompts = [p if s is None else s for p, s in zip(prompts, source)]
        columns = env.reward_columns(rows)
    for b in range(batch):
        head = (list(prompts[b]) if isinstance(prompts[b], (list, tuple))
                else [{"role": "user", "content": prompts[b]}])
        messages[b] = [dict(m) for m in head] + messages[b]
    clash = sorted(set(columns) & set(RESERVED_ARGUMENTS))
    if clash:
        raise RewardFunctionError(f"the env's column {clash[0]!r} has the name of a reward "
                                  f"function argument ({', '.join(RESERVED_ARGUMENTS)}): "
                                  "rename it")
    return Episodes(prompts, completions, messages, columns, rows)


class RewardFunctions:
    """Named Python reward functions with weights, called for a batch (module docstring).

    Args:
      specs: "module:function" names (or the functions themselves).
      weights: one per function (None: 1 each); the total is sum_i w_i f_i.
      timeout_s: time limit of each function's call per batch.
      on_error: "raise" (a `RewardFunctionError`, one line) or "zero" (the bad rows
        score 0 and are counted).
      max_workers: threads running the calls (None: one per function, at least 4).
    """

    def __init__(self, specs: Sequence[str | Callable], weights: Sequence[float] | None = None,
                 *, timeout_s: float = 60.0, on_error: str = "raise",
                 max_workers: int | None = None):
        if not specs:
            raise ValueError("RewardFunctions needs at least one function")
        self.functions = [resolve(s) if isinstance(s, str) else s for s in specs]
        self.specs = [s if isinstance(s, str) else getattr(s, "__name__", repr(s))
                      for s in specs]
        self.names = [function_name(s) for s in self.specs]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"reward functions {self.specs} share a name; their metrics "
                             "(reward/<name>) would collide")
        weights = [1.0] * len(specs) if weights is None or len(weights) == 0 else list(weights)
        if len(weights) != len(specs) or not all(
                isinstance(w, numbers.Real) and math.isfinite(w) for w in weights):
            raise ValueError(f"weights must be {len(specs)} finite numbers (one per "
                             f"function), got {weights!r}")
        self.weights = np.asarray(weights, np.float32)
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if not (isinstance(timeout_s, numbers.Real) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
        self.on_error = on_error
        self.timeout_s = float(timeout_s)
        # Daemon workers: a function that never returns cannot keep the process alive
        # after the run has ended on its error line.
        self._executor = DaemonPool(max_workers or max(4, len(self.functions)),
                                    name="arl-reward")
        self._lock = threading.Lock()
        self.failure: str | None = None  # the last RewardFunctionError's line

    def __repr__(self) -> str:
        return f"RewardFunctions({self.specs}, weights={self.weights.tolist()})"

    def score(self, batch: Episodes) -> tuple[np.ndarray, np.ndarray]:
        """(scores float32 [B, F], NaN where a function returned None or failed; errors
        int32 [F]: rows that failed, with on_error="zero", which score 0 and stay out of
        the function's mean and std like unscored rows). Raises `RewardFunctionError`
        with on_error="raise"."""
        futures = [self._executor.submit(fn, **batch.arguments()) for fn in self.functions]
        done, _ = concurrent.futures.wait(futures, timeout=self.timeout_s)
        scores = np.zeros((len(batch), len(self.functions)), np.float32)
        errors = np.zeros((len(self.functions),), np.int32)
        for i, future in enumerate(futures):
            if future not in done:
                future.cancel()
                self._fail(i, f"did not return within timeout_s={self.timeout_s:g} s on a "
                           f"batch of {len(batch)} rows")
                scores[:, i] = np.nan
                errors[i] = len(batch)
                continue
            values, bad = self._checked(i, future, batch)
            values[bad] = np.nan
            scores[:, i] = values
            errors[i] = len(bad)
        return scores, errors

    def _checked(self, i: int, future, batch: Episodes) -> tuple[np.ndarray, list[int]]:
        """Row values of function i (NaN: None) and the rows scored 0 after a failure."""
        try:
            returned = future.result()
        except Exception as error:  # pylint: disable=broad-except
            return self._locate_exception(i, batch, error)
        if isinstance(returned, (str, bytes)) or not hasattr(returned, "__len__") or \
                len(returned) != len(batch):
            size = len(returned) if hasattr(returned, "__len__") else None
            self._fail(i, f"returned {type(returned).__name__}"
                       + (f" of length {size}" if size is not None else "")
                       + f", not one number (or None) per row for {len(batch)} rows")
            return np.zeros((len(batch),), np.float32), list(range(len(batch)))
        values = np.zeros((len(batch),), np.float32)
        bad = []
        for row, value in enumerate(returned):
            number = _number(value)
            if number is None:
                values[row] = np.nan
            elif isinstance(number, str):
                self._fail(i, f"returned {number}", batch, row)
                bad.append(row)
            else:
                values[row] = number
        return values, bad

    def _locate_exception(self, i, batch: Episodes, error) -> tuple[np.ndarray, list[int]]:
        """After an exception on the batch: each row alone (at once on the pool, under the
        same time limit), to name (or zero) the rows that fail; rows that score alone
        keep their values."""
        futures = [self._executor.submit(self.functions[i], **batch.arguments([row]))
                   for row in range(len(batch))]
        done, _ = concurrent.futures.wait(futures, timeout=self.timeout_s)
        values = np.zeros((len(batch),), np.float32)
        bad = []
        for row, future in enumerate(futures):
            if future not in done:
                future.cancel()
                self._fail(i, f"did not return within timeout_s={self.timeout_s:g} s",
                           batch, row)
                bad.append(row)
                continue
            try:
                value = _number(list(future.result())[0])
            except Exception as row_error:  # pylint: disable=broad-except
                self._fail(i, f"raised {type(row_error).__name__}: {one_line(row_error)}",
                           batch, row)
                bad.append(row)
                continue
            if isinstance(value, str):
                self._fail(i, f"returned {value}", batch, row)
                bad.append(row)
            else:
                values[row] = np.nan if value is None else value
        if not bad:  # only the batch call raises
            self._fail(i, f"raised {type(error).__name__}: {one_line(error)} on the batch "
                       "(each row alone scores)")
            bad = list(range(len(batch)))
        return values, bad

    def _fail(self, i: int, what: str, batch: Episodes | None = None,
              row: int | None = None) -> None:
        where = f" on {batch.describe(row)}" if row is not None else ""
        message = (f"reward function {self.specs[i]!r} {what}{where}; set "
                   "reward.on_error='zero' to score such rows 0 and count them")
        with self._lock:
            self.failure = one_line(message)
        if self.on_error == "raise":
            raise RewardFunctionError(self.failure)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _shown(text: str) -> str:
    """`text` quoted, on one line, cut to `_SHOWN_CHARS` characters."""
    text = " ".join(text.split())
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


def _number(value) -> float | str | None:
    """A finite float, None, or the description of a bad value."""
    if value is None:
        return None
    if not isinstance(value, (numbers.Real, np.number, np.bool_)):
        return f"{type(value).__name__} {value!r} (expected a number or None)"
    number = float(value)
    if not math.isfinite(number):
        return f"the non-finite value {number!r}"
    return number
