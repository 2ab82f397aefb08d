"""Tool-use tasks on the host: call a tool, read its output, answer.

`ToolEnvironment` is the shared part of the host tool environments (`code_interpreter`,
`sql`): a `ToolCallingEnvironment` with one tool, whose agent turns with its own tags
(`tool_format="tags"`, the default) are exactly one of

    "<TAG>input</TAG>"      runs the tool on `input` (e.g. TAG = py: a Python cell);
                            the tool's output (or error) is the next observation;
    "<answer>text</answer>" ends the episode: reply "correct" or "wrong";

anything else is a format error with the reply "invalid".

With `tool_format="template"` (a checkpoint's codec, `model.hf_checkpoint`) the env
is a `ToolCallingEnvironment` (`arl.envs.tool_calling`): its tool is declared (the
schema of `tool_function`, e.g. `run_sql(query: str)`) and in the template's `tools`
list, the policy calls it in the model's own format (Qwen:
`<tool_call>{"name": "run_sql", "arguments": {"query": ...}}</tool_call>`, several calls
in one turn where the template renders them; Llama 3.1: one bare JSON call with
"parameters") and every call is checked against the schema, the answer is still
"<answer>text</answer>", and EVERY reply is a `tool` message: the results of the turn's
calls, "correct" / "wrong", or an error text ("error: no tool call or answer",
"error: bad JSON in the tool call", "error: unknown tool 'x' ...", "error: run_sql:
missing argument 'query'", ...). A turn holding an invalid call is a format error (its
valid calls still run); `max_invalid_calls` such turns in a row end the episode (0, the
default: never), and the run's metrics count calls, invalid calls and capped episodes
(`tools/...`). The env then carries its own `chat` (`ChatFormat`), which the rollout
wraps turns in.

With `final_output=True` the
first tool call ends the episode instead, and its output is the answer (a one-turn task).
This is the calculator's protocol (`arl.envs.tasks.calculator`) with a real tool behind the tag.

Reward per turn: success_reward * [correct] - turn_cost - format_penalty * [malformed],
in [-(turn_cost + format_penalty), success_reward - turn_cost] (a turn of several calls
pays one turn cost). A wrong answer ends the episode with -turn_cost.

Process reward (`info["process_reward"]`, not part of the reward): 1 on the turn the
task's answer first appears, either as a tool output that states it or as a correct
answer given without one; 0 otherwise (as the calculator's).

Memory (`memory_fields`, int32 per episode): `answer_seen`; `last_value` and
`has_value`, the last tool output as an integer when it is one (what the demonstrator
reads back before answering); then `ToolCallingEnvironment`'s `tool_calls`,
`invalid_streak` and `invalid_calls`.

Scripted policies: the oracle calls the tool with the task's reference input, then
answers the task's answer. The demonstrator is weaker (docs/learning.md): on its first
turn it skips the tool with probability `skip_tool` and answers a guess (`guess`, never
the answer); otherwise it calls the tool with `demonstrator_input` (a subclass may make
that input sometimes wrong), and then answers what the tool printed.

Subclasses implement `make_task(seed, params) -> ToolTask`, `run_tool(task, source) ->
ExecutionResult` and `guess(task, rng)`; optionally `tool_value`, `shows_answer`,
`is_correct` and `demonstrator_input`.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections import OrderedDict
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from arl.envs.base import NON_NEGATIVE
from arl.envs.host import HostEpisode, HostTurn
from arl.envs.tool_calling import ToolCallingEnvironment
from arl.text.tool_calls import function_schema
from arl.tools.results import ExecutionResult, Status
from arl.tools.sql import answers_match

CORRECT, WRONG, INVALID = "correct", "wrong", "invalid"
TOOL_FORMATS = ("tags", "template")
_INT32 = (-(2 ** 31), 2 ** 31 - 1)


@struct.dataclass
class ToolParams:
    success_reward: jax.Array  # float32 []
    format_penalty: jax.Array  # float32 []
    turn_cost: jax.Array  # float32 []


@dataclasses.dataclass(frozen=True)
class ToolTask:
    """One task: the prompt, the answer (checked with `ToolEnvironment.is_correct`),
    the reference tool input (`solution`, the oracle's) and any data the tool needs."""

    prompt: str
    answer: str
    solution: str
    data: Any = None
    data_id: Any = None  # identifies `data` in the result cache (None: no data)


def parse_int(text: str) -> int | None:
    """`text` (surrounding whitespace ignored) as an int32, or None."""
    text = text.strip()
    if not text or len(text) > 12:
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if _INT32[0] <= value <= _INT32[1] else None


class ToolEnvironment(ToolCallingEnvironment):
    """A host environment with one tool behind `<tool_tag>...</tool_tag>`, or declared
    and called in the template's convention (module docstring). Constructor arguments
    shared by the subclasses:

    codec, max_turns, prompt_len, obs_len, action_len: as every token env.
    final_output: the first tool call ends the episode and its output is the answer.
    skip_tool: the demonstrator's probability of answering without the tool.
    cache_size: tool results kept by input (0: none). A repeated input gets the first
      run's result without running again: exact for deterministic tools (a Python cell
      that reads no clock or randomness, a SQL query), and it makes the demonstrations
      of a warm start cheap. Internal errors of the tool are never cached.
    max_workers, step_timeout_s: the worker pool and its per-row backstop (a tool
      bounds its own time; this catches a tool that does not).
    tool_format: "tags" (`<TAG>input</TAG>`) or "template" (the checkpoint's own tool
      convention, module docstring).
    max_invalid_calls, max_calls_per_turn: "template" only, as `ToolCallingEnvironment`'s
      (defaults: no cap; several calls per turn where the template renders them).
    The cost of a malformed turn is the params' `format_penalty`.
    """

    tool_tag = "tool"
    # (name, description, parameter, parameter description) of the tool in the
    # template's `tools` list.
    tool_function = ("run_tool", "Runs the tool on its input.", "input", "The input.")
    memory_fields = ("answer_seen", "last_value", "has_value")

    def __init__(self, *, codec, max_turns: int, prompt_len: int, obs_len: int,
                 action_len: int, final_output: bool = False, skip_tool: float = 0.3,
                 cache_size: int = 4096, max_workers: int | None = None,
                 step_timeout_s: float | None = 60.0, tool_format: str = "tags",
                 max_invalid_calls: int = 0, max_calls_per_turn: int | None = None):
        if not 0.0 <= skip_tool <= 1.0:
            raise ValueError(f"skip_tool must be in [0, 1], got {skip_tool!r}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
            raise ValueError(f"cache_size must be an int >= 0, got {cache_size!r}")
        if step_timeout_s is not None and not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be None or > 0, got {step_timeout_s!r}")
        if max_workers is not None and (isinstance(max_workers, bool) or not isinstance(
                max_workers, int) or max_workers < 1):
            raise ValueError(f"max_workers must be None or an int >= 1, got {max_workers!r}")
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
        if tool_format == "tags" and (max_invalid_calls != 0 or max_calls_per_turn not in (
                None, 1)):
            raise ValueError("max_invalid_calls and max_calls_per_turn count tool calls in "
                             "the template's convention: set tool_format='template', or "
                             "leave them out")
        self.tool_format = tool_format
        self.final_output = bool(final_output)
        self.skip_tool = float(skip_tool)
        self.cache_size = cache_size
        self._open, self._close = f"<{self.tool_tag}>", f"</{self.tool_tag}>"
        self._results: OrderedDict = OrderedDict()
        self._results_lock = threading.Lock()
        self.tools = (function_schema(*self.tool_function),)
        super().__init__(codec=codec, max_turns=max_turns, prompt_len=prompt_len,
                         obs_len=obs_len, action_len=action_len,
                         max_invalid_calls=max_invalid_calls,
                         max_calls_per_turn=max_calls_per_turn, invalid_call_penalty=0.0,
                         max_workers=max_workers, step_timeout_s=step_timeout_s)

    def _template_convention(self, codec):
        """(ChatFormat, ToolCallSyntax) of the codec's chat template with this env's
        tool; (None, None) with tags (the env's own call format)."""
        if self.tool_format == "tags":
            return None, None
        if getattr(codec, "chat_template", None) is None:
            raise ValueError("tool_format='template' needs a checkpoint's codec with a chat "
                             "template (config.model.hf_checkpoint); use tool_format='tags' "
                             "with arl's own codecs")
        return super()._template_convention(codec)

    # -- params
    def default_params(self) -> ToolParams:
        return ToolParams(success_reward=jnp.asarray(1.0, jnp.float32),
                          format_penalty=jnp.asarray(0.1, jnp.float32),
                          turn_cost=jnp.asarray(0.0, jnp.float32))

    def param_ranges(self):
        """Rewards and costs >= 0: the reward bounds read them with those signs."""
        return dict(success_reward=NON_NEGATIVE, format_penalty=NON_NEGATIVE,
                    turn_cost=NON_NEGATIVE)

    def reward_bounds(self, params: ToolParams):
        return (-(params.turn_cost + params.format_penalty),
                params.success_reward - params.turn_cost)

    def _info(self, state, format_error):
        info = super()._info(state, format_error)
        info["tool_calls"] = state.memory[self.memory_fields.index("tool_calls")]
        return info

    def episode_stats(self, state) -> dict:
        """The declared tools' per-episode statistics (`tools/...`) in the template's
        convention; none with tags (their runs log what they always did)."""
        return {} if self.call_syntax is None else super().episode_stats(state)

    # -- subclass hooks
    def run_tool(self, task: ToolTask, source: str) -> ExecutionResult:
        raise NotImplementedError

    def guess(self, task: ToolTask, rng: random.Random) -> str:
        """The demonstrator's answer without the tool (must not be the answer)."""
        raise NotImplementedError

    def demonstrator_input(self, task: ToolTask, rng: random.Random) -> str:
        """The demonstrator's tool input (default: the reference input)."""
        del rng
        return task.solution

    def literal_input(self, value: str) -> str:
        """A tool input whose output is `value` (the demonstrator's guess when
        `final_output`; default: `value` itself, e.g. a Python literal)."""
        return value

    def tool_value(self, result: ExecutionResult) -> int | None:
        """The tool's output as an int32, if it is one (default: the whole stdout)."""
        return parse_int(result.stdout) if result.ok else None

    def shows_answer(self, task: ToolTask, result: ExecutionResult) -> bool:
        """The tool's output states the task's answer (default: stdout matches it)."""
        return result.ok and self.is_correct(task, result.stdout)

    def is_correct(self, task: ToolTask, answer: str) -> bool:
        return answers_match(answer, task.answer)

    def prompt(self, task: ToolTask, params) -> str:
        del params
        return task.prompt

    # -- running the tool (through the result cache)
    def call_tool(self, task: ToolTask, source: str) -> ExecutionResult:
        """`run_tool(task, source)`, cached by (`task.data_id`, source)."""
        if not self.cache_size:
            return self.run_tool(task, source)
        key = (task.data_id, source)
        with self._results_lock:
            if key in self._results:
                self._results.move_to_end(key)
                return self._results[key]
        result = self.run_tool(task, source)
        if result.status is not Status.INTERNAL_ERROR:
            with self._results_lock:
                self._results[key] = result
                while len(self._results) > self.cache_size:
                    self._results.popitem(last=False)
        return result

    # -- one turn
    def _body(self, action: str, open_tag: str, close_tag: str) -> str | None:
        if (len(action) >= len(open_tag) + len(close_tag) and action.startswith(open_tag)
                and action.endswith(close_tag)):
            return action[len(open_tag):len(action) - len(close_tag)]
        return None

    def _tool_turn(self, episode: HostEpisode, source: str) -> HostTurn:
        """The tool run on `source`: its reply, process reward and memory changes;
        with `final_output` the episode ends, successful when the output is the answer
        (the turn's reward is `turn_reward`'s)."""
        task, memory = episode.task, episode.memory
        seen_before = bool(memory.get("answer_seen", 0))
        result = self.call_tool(task, source)
        shows = self.shows_answer(task, result)
        value = self.tool_value(result)
        changes = {"answer_seen": int(seen_before or shows),
                   "last_value": 0 if value is None else value,
                   "has_value": int(value is not None)}
        return HostTurn(reply=result.observation.rstrip("\n") or "(no output)",
                        terminated=self.final_output, success=self.final_output and shows,
                        process_reward=float(shows and not seen_before), memory=changes)

    def turn_reward(self, episode: HostEpisode, outcomes: Sequence[HostTurn],
                    invalid: bool) -> float:
        """success_reward * [a call's output is the answer, with `final_output`] -
        turn_cost - format_penalty * [an invalid call]: one turn cost per turn."""
        params = episode.params
        return (float(params.success_reward) * any(o.success for o in outcomes)
                - float(params.turn_cost) - float(params.format_penalty) * invalid)

    def call(self, episode: HostEpisode, name: str, arguments: dict[str, Any]) -> HostTurn:
        """The declared tool (`tool_function`), on its checked string argument."""
        del name
        return self._tool_turn(episode, arguments[self.tool_function[2]])

    def host_answer(self, episode: HostEpisode, text: str) -> HostTurn:
        """A turn without a tool call: "<answer>text</answer>" ends the episode ("correct"
        / "wrong"); anything else is a format error."""
        task, params, memory = episode.task, episode.params, episode.memory
        success_reward = float(params.success_reward)
        turn_cost, format_penalty = float(params.turn_cost), float(params.format_penalty)
        answer = self._body(text, "<answer>", "</answer>")
        if answer is None:
            reply = INVALID if self.call_syntax is None else "error: no tool call or answer"
            return HostTurn(reply=reply, reward=-turn_cost - format_penalty,
                            format_error=True)
        seen_before = bool(memory.get("answer_seen", 0))
        correct = self.is_correct(task, answer)
        return HostTurn(reply=CORRECT if correct else WRONG,
                        reward=success_reward * correct - turn_cost, terminated=True,
                        success=correct, process_reward=float(correct and not seen_before),
                        memory={"answer_seen": int(seen_before or correct)})

    def host_step(self, episode: HostEpisode, action: str) -> HostTurn:
        if self.call_syntax is not None:  # the template's convention: declared tools
            return super().host_step(episode, action)
        source = self._body(action, self._open, self._close)
        if source is None:
            return self.host_answer(episode, action)
        turn = self._tool_turn(episode, source)
        memory = dict(turn.memory, tool_calls=episode.memory.get("tool_calls", 0) + 1)
        return dataclasses.replace(turn, reward=self.turn_reward(episode, [turn], False),
                                   memory=memory)

    # -- scripted policies
    def _tool_text(self, source: str) -> str:
        if self.call_syntax is not None:
            function, _, parameter, _ = self.tool_function
            return self.call_syntax.write(function, {parameter: source})
        return f"{self._open}{source}{self._close}"

    def host_oracle(self, episode: HostEpisode) -> str:
        """Call the tool with the reference input, then answer the task's answer."""
        if self.final_output or episode.memory.get("tool_calls", 0) == 0:
            return self._tool_text(episode.task.solution)
        return f"<answer>{episode.task.answer}</answer>"

    def host_demonstrator(self, episode: HostEpisode, rng: random.Random) -> str:
        """Skip the tool with probability `skip_tool` (answer a guess); else call it with
        `demonstrator_input` and answer what it printed (module docstring)."""
        task, memory = episode.task, episode.memory
        if memory.get("tool_calls", 0) == 0:
            if rng.random() < self.skip_tool:
                guess = self.guess(task, rng)
                if self.final_output:
                    return self._tool_text(self.literal_input(guess))
                return f"<answer>{guess}</answer>"
            return self._tool_text(self.demonstrator_input(task, rng))
        if memory.get("has_value", 0):
            return f"<answer>{memory['last_value']}</answer>"
        return f"<answer>{task.answer}</answer>"
