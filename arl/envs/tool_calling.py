"""Host environments with tools as users declare them, called in the model's own format.

A `ToolCallingEnvironment` is a `HostEnvironment` whose agent calls the env's tools the
way the checkpoint was tuned to (the chat template's convention, `arl.text.tool_calls`):
the tools are in the template's `tools` list, a turn holds one or more calls (Qwen's
parallel `<tool_call>` blocks; Llama 3.1 renders one per turn), and every reply is a
`tool` message holding each call's result in order. A turn without a call (the final
answer) goes to the subclass's `host_answer`. A subclass declares its tools in either
form (or both):

    class Shop(ToolCallingEnvironment):
        @tool
        def price(self, episode, item: str, quantity: int,
                  currency: Literal["EUR", "USD"] = "EUR") -> str:
            '''Price of an order.

            Args:
              item: the item's name.
              quantity: how many units.
            '''
            return f"{...}"

        tools = ({"type": "function", "function": {"name": ..., "parameters": ...}},)
        def call(self, episode, name, arguments):  # the schema-declared tools
            ...

A decorated method's schema comes from its signature and docstring
(`arl.text.tool_schemas.schema_of_function`); a schema in `tools` is checked at
construction and its calls go to `call(episode, name, arguments)`. A tool returns the
result text, or a `HostTurn` whose `reply` is the text and whose reward, memory changes,
`terminated`, `success` and `process_reward` count for the turn (rewards summed; later
calls of the turn see earlier calls' memory).

Every call is checked against its schema before it runs (`tool_schemas.call_error`:
unknown tool, missing, unknown or mistyped argument, a value outside its enum); what
does not hold, and a turn that cannot be parsed (bad JSON, a call not closed, more
calls than `max_calls_per_turn`, several calls where the template renders one), is
answered as the tool's result "error: ..." (never an exception), and the turn is
invalid: a format error whose reward `turn_reward` gives (default: the tools' rewards
less `invalid_call_penalty`). The valid calls of a turn
with an invalid one still run. A tool that raises answers "error: <type>: <message>"
(the tool failed; the call was valid). `max_invalid_calls` invalid turns in a row end
the episode (0: no cap); `tool_stats` counts calls, invalid calls and the episodes
the cap ended on the host, and `episode_stats` reports them per episode from the state,
so a run's metrics.jsonl logs `tools/calls_mean`, `tools/invalid_calls_mean` (per
episode) and `tools/invalid_call_cap_episodes` (the fraction the cap ended).

Replies are fitted on the host: each result is written as the template writes it
(JSON-escaped for Llama 3.1), the results of a turn joined by the template's own
separator, and results cut (ending "..") to one common length so the whole reply fits
`obs_len` tokens and every separator survives. Memory fields `tool_calls` (valid calls
run), `invalid_streak` and `invalid_calls` are the env's own, after the subclass's
`memory_fields`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, Mapping, Sequence

import jax.numpy as jnp

from arl.envs.host import HostEnvironment, HostEpisode, HostTurn
from arl.text.codec import TRUNCATION_MARK, encode_text
from arl.text.tool_calls import NO_CALL, derive_tool_chat_format
from arl.text.tool_schemas import call_error, check_tool_schema, schema_of_function

_log = logging.getLogger(__name__)
OWN_MEMORY = ("tool_calls", "invalid_streak", "invalid_calls")
# The per-episode statistics `episode_stats` reports (their means reach metrics.jsonl,
# `arl.trainers.credit_assignment.rollout_metrics`; `eval/...` for evaluation episodes).
CALLS_METRIC = "tools/calls_mean"  # valid calls run per episode
INVALID_CALLS_METRIC = "tools/invalid_calls_mean"  # invalid calls per episode
CAPPED_METRIC = "tools/invalid_call_cap_episodes"  # fraction ended by the invalid-call cap
_TOOL_ATTRIBUTE = "_arl_tool_name"


def tool(function: Callable | None = None, *, name: str | None = None):
    """Marks a method `(self, episode, <arguments>) -> str | HostTurn` of a
    `ToolCallingEnvironment` as a tool; its signature (type-annotated arguments) and
    docstring give the schema. `@tool` or `@tool(name="other_name")`."""
    def mark(f):
        setattr(f, _TOOL_ATTRIBUTE, name or f.__name__)
        return f
    return mark(function) if function is not None else mark


@dataclasses.dataclass
class ToolStats:
    """Counts of `ToolCallingEnvironment.tool_stats`: turns with calls, calls run,
    invalid calls (each call, and each turn that could not be parsed, counts one),
    invalid turns, and episodes the invalid-call cap ended."""

    call_turns: int = 0
    calls: int = 0
    invalid_calls: int = 0
    invalid_turns: int = 0
    capped_episodes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class ToolCallingEnvironment(HostEnvironment):
    """A host env with declared tools in the template's tool convention (module doc).

    Constructor (a subclass passes its values on): codec (a checkpoint's, with a chat
    template), max_turns, prompt_len, obs_len, action_len as every token env;
    max_invalid_calls: invalid turns in a row that end the episode (0: never);
    max_calls_per_turn: calls one turn may hold (>1 needs a template that renders
    several; None: 4 where it does, else 1); invalid_call_penalty: the (non-negative)
    cost of an invalid turn, which `reward_bounds` must cover; max_workers,
    step_timeout_s: as `HostEnvironment`'s.

    Subclass hooks: `make_task`, `prompt`, `host_answer(episode, text) -> HostTurn` (a
    turn without a call), `host_oracle(episode) -> str` (write calls with
    `calls_text`), `default_params`, `reward_bounds`, `turn_reward`, and the tools. A
    subclass with a call format of its own (`arl.envs.tool_use`'s tags) returns (None,
    None) from `_template_convention` and plays such turns itself.
    """

    tools: tuple = ()  # function schemas (their calls go to `call`)
    memory_fields: tuple[str, ...] = ()  # the subclass's own; OWN_MEMORY are appended

    def __init__(self, *, codec, max_turns: int, prompt_len: int, obs_len: int,
                 action_len: int, max_invalid_calls: int = 3,
                 max_calls_per_turn: int | None = None,
                 invalid_call_penalty: float = 0.1, max_workers: int | None = None,
                 step_timeout_s: float | None = 60.0):
        for key, value, low in (("max_turns", max_turns, 1), ("prompt_len", prompt_len, 1),
                                ("obs_len", obs_len, 1), ("action_len", action_len, 1),
                                ("max_invalid_calls", max_invalid_calls, 0),
                                ("max_calls_per_turn", max_calls_per_turn, 1)):
            if key == "max_calls_per_turn" and value is None:
                continue  # as the template renders (below)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key} must be an int >= {low}, got {value!r}")
        if isinstance(invalid_call_penalty, bool) or not isinstance(
                invalid_call_penalty, (int, float)) or not invalid_call_penalty >= 0:
            raise ValueError(f"invalid_call_penalty must be a number >= 0, got "
                             f"{invalid_call_penalty!r}")
        clash = sorted(set(type(self).memory_fields) & set(OWN_MEMORY))
        if clash:
            raise ValueError(f"memory_fields {clash} are the env's own ({OWN_MEMORY}); "
                             "rename them")
        self.codec = codec
        self.max_turns, self.prompt_len, self.obs_len = max_turns, prompt_len, obs_len
        self.action_len = action_len
        self.max_invalid_calls, self.max_calls_per_turn = max_invalid_calls, max_calls_per_turn
        self.invalid_call_penalty = float(invalid_call_penalty)
        self.max_workers, self.step_timeout_s = max_workers, step_timeout_s
        self.memory_fields = (*type(self).memory_fields, *OWN_MEMORY)
        self.tool_schemas, self._methods = self._declared_tools()
        # (None, None): a subclass's own call format (ToolEnvironment's tags), which
        # plays its turns itself.
        self.chat, self.call_syntax = self._template_convention(codec)
        several = self.call_syntax is not None and self.call_syntax.several_calls
        if max_calls_per_turn is None:
            max_calls_per_turn = self.max_calls_per_turn = 4 if several else 1
        if max_calls_per_turn > 1 and not several:
            raise ValueError(f"max_calls_per_turn={max_calls_per_turn}, but this chat "
                             "template renders one tool call per turn; set it to 1")
        self._tool_stats, self._tool_stats_lock = ToolStats(), threading.Lock()
        self._host_init()

    # -- declaration
    def _declared_tools(self) -> tuple[tuple[dict, ...], dict[str, Callable]]:
        schemas, methods = [check_tool_schema(s) for s in self.tools], {}
        marked = {}  # attribute -> function, in definition order (a subclass's override wins)
        for klass in reversed(type(self).__mro__):
            marked.update({a: m for a, m in vars(klass).items()
                           if getattr(m, _TOOL_ATTRIBUTE, None) is not None})
        for attribute, member in marked.items():
            name = getattr(member, _TOOL_ATTRIBUTE)
            schemas.append(schema_of_function(member, skip=2, name=name))
            methods[name] = getattr(self, attribute)
        names = [s["function"]["name"] for s in schemas]
        if not names:
            raise ValueError(f"{type(self).__name__} declares no tools (a `tools` schema or a "
                             "method decorated with @tool)")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tools {repeated} are declared more than once")
        return tuple(schemas), methods

    def _template_convention(self, codec):
        template = getattr(codec, "chat_template", None)
        if template is None:
            raise ValueError(f"{type(self).__name__} calls its tools in the chat template's "
                             "convention: it needs a checkpoint's codec with a chat template "
                             "(config.model.hf_checkpoint)")
        return derive_tool_chat_format(
            template, encode=codec.encode,
            special_texts=[codec.tokenizer.id_to_token(i) for i in sorted(codec.special_ids)],
            special_tokens=codec.template_tokens, pad_id=codec.pad_id, tools=self.tool_schemas,
            system_prompt=codec.chat.system_prompt, template_kwargs=codec.template_kwargs)

    # -- subclass hooks
    def call(self, episode: HostEpisode, name: str, arguments: dict[str, Any]) -> str | HostTurn:
        """Runs the schema-declared tool `name` with checked `arguments` (the decorated
        methods are dispatched before this)."""
        raise NotImplementedError(f"{type(self).__name__} declares tool {name!r} in `tools` "
                                  "but does not implement call(episode, name, arguments)")

    def host_answer(self, episode: HostEpisode, text: str) -> HostTurn:
        """A turn without a tool call (default: a format error, "error: no tool call")."""
        del episode, text
        return HostTurn(reply="error: no tool call", reward=-self.invalid_call_penalty,
                        format_error=True)

    def turn_reward(self, episode: HostEpisode, outcomes: Sequence[HostTurn],
                    invalid: bool) -> float:
        """The reward of a turn of calls: the tools' `HostTurn` rewards summed, less
        `invalid_call_penalty` when a call was invalid (`outcomes`: the valid calls'
        HostTurns; a tool that returned text counts 0)."""
        del episode
        return sum(float(o.reward) for o in outcomes) - (
            self.invalid_call_penalty if invalid else 0.0)

    def calls_text(self, *calls: tuple[str, Mapping[str, Any]], content: str = "") -> str:
        """A turn of `content` then `calls` ((name, arguments) pairs) as the template
        writes it: what a scripted policy returns."""
        return self.call_syntax.write_calls(list(calls), content=content)

    @property
    def tool_stats(self) -> ToolStats:
        """A copy of the counts of calls, invalid calls and capped episodes."""
        with self._tool_stats_lock:
            return dataclasses.replace(self._tool_stats)

    def episode_stats(self, state) -> dict:
        """Per-episode statistics of one row's final state (traced): valid calls run,
        invalid calls, and whether the invalid-call cap ended the episode (its streak
        reached the cap, which always ends the episode); `rollout_metrics` logs their
        means as `tools/calls_mean`, `tools/invalid_calls_mean` and
        `tools/invalid_call_cap_episodes`."""
        field = lambda name: state.memory[self.memory_fields.index(name)]
        capped = (field("invalid_streak") >= self.max_invalid_calls) \
            if self.max_invalid_calls > 0 else jnp.zeros((), bool)
        return {CALLS_METRIC: field("tool_calls").astype(jnp.float32),
                INVALID_CALLS_METRIC: field("invalid_calls").astype(jnp.float32),
                CAPPED_METRIC: capped.astype(jnp.float32)}

    # -- one turn
    def host_step(self, episode: HostEpisode, action: str) -> HostTurn:
        streak = int(episode.memory.get("invalid_streak", 0))
        parsed = self.call_syntax.parse_calls(action)
        if parsed == NO_CALL:
            turn = self.host_answer(episode, action)
            if not isinstance(turn, HostTurn):
                raise TypeError(f"host_answer returned {type(turn).__name__}, not HostTurn")
            return dataclasses.replace(turn, reply=self.fit_reply([str(turn.reply)]),
                                       memory={**(turn.memory or {}), "invalid_streak": 0})
        if isinstance(parsed, str):
            return self._finish(episode, [f"error: {parsed}"], invalid=1, streak=streak)
        _, calls = parsed
        if len(calls) > self.max_calls_per_turn:
            return self._finish(episode, [f"error: {len(calls)} tool calls in one turn; at "
                                          f"most {self.max_calls_per_turn}"],
                                invalid=1, streak=streak)
        schemas = {s["function"]["name"]: s for s in self.tool_schemas}
        results, invalid, ran, outcomes = [], 0, 0, []
        for name, arguments in calls:
            schema = schemas.get(name)
            error = (f"unknown tool {name!r} (the tools are "
                     f"{', '.join(repr(n) for n in schemas)})" if schema is None
                     else call_error(schema, arguments))
            if error is not None:
                results.append(f"error: {error}")
                invalid += 1
                continue
            ran += 1
            outcome = self._run(episode, name, _coerced(schema, arguments), outcomes)
            results.append(outcome if isinstance(outcome, str) else str(outcome.reply))
            if isinstance(outcome, HostTurn):
                outcomes.append(outcome)
        return self._finish(episode, results, invalid=invalid, streak=streak, ran=ran,
                            outcomes=outcomes)

    def _run(self, episode, name, arguments, outcomes) -> str | HostTurn:
        memory = dict(episode.memory)
        for outcome in outcomes:
            memory.update(outcome.memory or {})
        episode = dataclasses.replace(episode, memory=memory)
        try:
            if name in self._methods:
                outcome = self._methods[name](episode, **arguments)
            else:
                outcome = self.call(episode, name, arguments)
        except Exception as error:  # pylint: disable=broad-except
            _log.info("%s: tool %s raised %s: %s", self.name, name, type(error).__name__, error)
            return f"error: {type(error).__name__}: {error}"
        if not isinstance(outcome, (str, HostTurn)):
            return f"error: tool {name!r} returned {type(outcome).__name__}, not text"
        return outcome

    def _finish(self, episode, results, *, invalid: int, streak: int, ran: int = 0,
                outcomes: Sequence[HostTurn] = ()) -> HostTurn:
        streak = streak + 1 if invalid else 0
        capped = bool(invalid) and 0 < self.max_invalid_calls <= streak
        memory = {}
        for outcome in outcomes:
            memory.update(outcome.memory or {})
        memory.update(tool_calls=int(episode.memory.get("tool_calls", 0)) + ran,
                      invalid_streak=streak,
                      invalid_calls=int(episode.memory.get("invalid_calls", 0)) + invalid)
        with self._tool_stats_lock:
            self._tool_stats.call_turns += 1
            self._tool_stats.calls += ran
            self._tool_stats.invalid_calls += invalid
            self._tool_stats.invalid_turns += int(bool(invalid))
            self._tool_stats.capped_episodes += int(capped)
        return HostTurn(
            reply=self.fit_reply(results),
            reward=self.turn_reward(episode, outcomes, bool(invalid)),
            terminated=capped or any(o.terminated for o in outcomes),
            success=any(o.success for o in outcomes), format_error=bool(invalid),
            process_reward=sum(float(o.process_reward) for o in outcomes), memory=memory)

    # -- replies
    def fit_reply(self, results: Sequence[str]) -> str:
        """The reply text of one turn's `results`, as the template writes them between
        its pieces (escaped where it writes JSON strings, joined by its separator), each
        result cut to one common length (ending "..") so the whole fits the reply budget
        (`obs_len` as set)."""
        syntax = self.call_syntax
        results = [str(r) for r in results]
        if len(results) > 1 and not syntax.several_calls:
            results = [results[0]]
        fits = lambda texts: len(encode_text(self.codec, syntax.result_texts(texts))) \
            <= self.reply_budget
        if fits(results):
            return syntax.result_texts(results)
        cut = lambda limit: [r if len(r) <= limit else r[:limit] + TRUNCATION_MARK
                             for r in results]
        short, long = 0, max(len(r) for r in results)  # fits(cut(short)) or short == 0
        while long - short > 1:
            middle = (short + long) // 2
            short, long = (middle, long) if fits(cut(middle)) else (short, middle)
        return syntax.result_texts(cut(short))


def _coerced(schema: Mapping[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """`arguments` with whole floats of "integer" parameters as ints (JSON's 2.0 is an
    integer; a Python tool annotated `int` gets an int)."""
    properties = schema["function"].get("parameters", {}).get("properties", {})
    return {key: int(value) if isinstance(value, float) and properties.get(key, {}).get(
        "type") == "integer" else value for key, value in arguments.items()}
