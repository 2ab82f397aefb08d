"""A chat template's tool convention as static token pieces (calls and tool results).

An instruct checkpoint was tuned to call tools in its template's own format: the
`tools` list (JSON schemas) rendered into the system turn, a call written as JSON in
the model's markup, the result handed back as a `tool` message:

    Qwen2.5 / Hermes:  <tool_call>\\n{"name": "run_python", "arguments": {"code": "6*7"}}
                       \\n</tool_call><|im_end|>\\n<|im_start|>user\\n<tool_response>\\n42
                       \\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

A host tool env in this convention (`ToolEnvironment(tool_format="template")`) answers
EVERY agent turn with a `tool` message (the tool's output, or an error text such as
"invalid: no tool call"), so every later observation is wrapped in one static pair of
pieces: `derive_tool_chat_format` renders [system, user, assistant(call), tool(result)]
with the `tools` and cuts the text around the result into `reply_prefix` (after the
assistant's end-of-turn token) and `reply_suffix` (the tool turn's end and the
generation prompt). The call syntax (`ToolCallSyntax`: the markup around the JSON, the
keys of the name and the arguments) is read from the template's own render of a
structured `tool_calls` message, so the scripted policies write calls exactly as the
template would re-serialise them, and the host parses the model's calls from it.

The derivation is CHECKED on full renders of conversations with one to three tool
exchanges of real contents (numbers, tracebacks, quotes, newlines, a plain-text turn
answered with an error), with the assistant turns given both as the raw text the
model wrote and as structured `tool_calls`: the tokens must equal the pieces'.
A template that writes a tool result as a JSON string (Llama 3.1's `ipython` turn) keeps
the quotes in the pieces, and the host writes the escaped text between them
(`ToolCallSyntax.result_text`). A template whose tool turns cannot be cut this way (one
that re-serialises calls otherwise than it asks the model to write them, a result it
rewrites) is refused in one line naming what it does.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Mapping, Sequence

from arl.text.chat_template import (ChatFormat, ChatTemplateError, first_difference,
                                    derive_chat_format, render)

NO_CALL = "no tool call"  # `ToolCallSyntax.parse` of a turn that holds no call

# Placeholder contents (plain words, as `chat_template`'s).
_USER, _RESULT = "Alpha", "Hotel"
_NAME_MARK, _ARG_MARK, _VALUE_MARK = "Golf", "India", "Juliett"
# Real contents of the checked conversations: (arguments' value, tool result) pairs,
# and a plain-text agent turn (answered with an error text as the tool result).
_CHECK_EXCHANGES = (("sum(i*i for i in range(1,38))", "17575"),
                    ('print("a\\tb")\nx = 12 * 30\nx', 'a\tb\n360'),
                    ("1/0", "Traceback (most recent call last):\nZeroDivisionError: "
                            "division by zero"))
_PLAIN_TURN = ("I think it is 42.", "invalid: no tool call")


def function_schema(name: str, description: str, parameter: str,
                    parameter_description: str) -> dict[str, Any]:
    """The `tools` entry of a function of one string parameter (OpenAI / HF format)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object",
                       "properties": {parameter: {"type": "string",
                                                  "description": parameter_description}},
                       "required": [parameter]}}}


def _call_message(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}]}


@dataclasses.dataclass(frozen=True)
class ToolCallSyntax:
    """How the template writes one call: `prefix` + JSON object + `suffix`, the object
    holding the function's name under `name_key` and its arguments (an object) under
    `arguments_key` (Qwen: "<tool_call>\\n", "\\n</tool_call>", "name", "arguments";
    Llama 3.1: "", "", "name", "parameters")."""

    prefix: str
    suffix: str
    name_key: str
    arguments_key: str
    results_as_json: bool = False  # the template writes a result as a JSON string

    def result_text(self, text: str) -> str:
        """What the host writes between the result's pieces for the result `text`."""
        return json.dumps(text, ensure_ascii=False)[1:-1] if self.results_as_json else text

    def write(self, name: str, arguments: Mapping[str, Any]) -> str:
        """The call as the template renders a structured `tool_calls` message."""
        body = json.dumps({self.name_key: name, self.arguments_key: dict(arguments)},
                          ensure_ascii=False)
        return f"{self.prefix}{body}{self.suffix}"

    def parse(self, text: str) -> tuple[str, dict[str, Any]] | str:
        """(name, arguments) of the call `text` (surrounding whitespace ignored), or the
        error text the env answers with: "no tool call", "bad JSON in the tool call",
        "the tool call needs ..."."""
        text, prefix, suffix = text.strip(), self.prefix.strip(), self.suffix.strip()
        if not (text.startswith(prefix) and text.endswith(suffix)
                and len(text) >= len(prefix) + len(suffix) and "{" in text):
            return NO_CALL
        body = text[len(prefix):len(text) - len(suffix)]
        try:
            call = json.loads(body)
        except ValueError:
            return "bad JSON in the tool call"
        if not isinstance(call, dict) or not isinstance(call.get(self.name_key), str):
            return f'the tool call needs "{self.name_key}": a string'
        arguments = call.get(self.arguments_key)
        if not isinstance(arguments, dict):
            return f'the tool call needs "{self.arguments_key}": an object'
        return call[self.name_key], arguments


def derive_tool_chat_format(template: str, *, encode: Callable[[str], list[int]],
                            special_texts: Sequence[str], special_tokens: Mapping[str, str],
                            pad_id: int, tools: Sequence[Mapping[str, Any]],
                            system_prompt: str | None = None,
                            template_kwargs: Mapping | None = None
                            ) -> tuple[ChatFormat, ToolCallSyntax]:
    """The `ChatFormat` of `template` in its tool convention with `tools` (module
    docstring) and its `ToolCallSyntax`; arguments as `derive_chat_format`'s. Raises
    ChatTemplateError naming what the template does that static pieces cannot hold."""
    kwargs = dict(template_kwargs or {}, tools=[dict(t) for t in tools])
    base = derive_chat_format(template, encode=encode, special_texts=special_texts,
                              special_tokens=special_tokens, pad_id=pad_id,
                              system_prompt=system_prompt, template_kwargs=kwargs)
    head = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    # A template that rewrites earlier turns (Qwen3) is followed through its keep-history
    # variant, the one the growing context equals (`arl.text.keep_history`).
    reference = base.history_template or template

    def text_of(messages, add_generation_prompt=True):
        try:
            return render(reference, head + list(messages),
                          add_generation_prompt=add_generation_prompt,
                          special_tokens=special_tokens, template_kwargs=kwargs)
        except Exception as error:  # jinja2's TemplateError and the template's own raises
            raise ChatTemplateError(f"chat template: rendering a conversation with tool "
                                    f"calls failed: {error}") from error

    eot_text = next((t for t in special_texts if t and encode(t) == [base.eot_id]), None)
    user = {"role": "user", "content": _USER}
    opened = text_of([user])
    arguments = {_ARG_MARK: _VALUE_MARK}
    called = text_of([user, _call_message(_NAME_MARK, arguments)], add_generation_prompt=False)
    if not called.startswith(opened) or eot_text is None or eot_text not in called[len(opened):]:
        raise ChatTemplateError(f"chat template: a structured tool call renders as {called!r}, "
                                f"not as an assistant turn after the generation prompt "
                                f"{opened!r} ended by the end-of-turn token")
    call_text = called[len(opened):called.index(eot_text, len(opened))]
    syntax = _syntax_of(call_text, _NAME_MARK, arguments)

    result = text_of([user, {"role": "assistant", "content": call_text},
                      {"role": "tool", "content": _RESULT}])
    expected_head = opened + call_text + eot_text
    at_result = result.find(_RESULT, len(expected_head))
    if not result.startswith(expected_head) or at_result < 0:
        raise ChatTemplateError(f"chat template: a tool result does not appear verbatim in "
                                f"{result!r}, so it cannot be wrapped in static pieces")
    # Llama 3.1 writes a result as a JSON string: the quotes are part of the pieces, the
    # host writes the escaped text between them (`ToolCallSyntax.result_text`).
    quoted = result.find(json.dumps(_RESULT), len(expected_head)) == at_result - 1
    syntax = dataclasses.replace(syntax, results_as_json=quoted)
    chat = dataclasses.replace(
        base, multi_turn_error=None, reply_role="tool",
        reply_prefix=tuple(encode(result[len(expected_head):at_result])),
        reply_suffix=tuple(encode(result[at_result + len(_RESULT):])))
    _check(chat, syntax, text_of, encode)
    return chat, syntax


def _syntax_of(call_text: str, name: str, arguments: Mapping[str, Any]) -> ToolCallSyntax:
    """The `ToolCallSyntax` of `call_text`, the template's render of a call of `name`
    with `arguments`."""
    start = call_text.find("{")
    try:
        call, end = json.JSONDecoder().raw_decode(call_text, max(start, 0))
    except ValueError:
        call, end = None, 0
    name_key = next((k for k, v in (call or {}).items() if v == name), None) \
        if isinstance(call, dict) else None
    arguments_key = next((k for k, v in call.items() if v == dict(arguments)), None) \
        if isinstance(call, dict) else None
    if start < 0 or name_key is None or arguments_key is None:
        raise ChatTemplateError(f"chat template: a tool call renders as {call_text!r}, not as "
                                "one JSON object holding the function's name and arguments")
    return ToolCallSyntax(prefix=call_text[:start], suffix=call_text[end:], name_key=name_key,
                          arguments_key=arguments_key)


def _check(chat: ChatFormat, syntax: ToolCallSyntax, text_of, encode) -> None:
    """Full renders of 1-3 tool exchanges (and a plain-text turn) == the pieces."""
    name, key = "run_python", "code"
    for count in (1, 2, 3):
        exchanges = [_PLAIN_TURN] if count == 2 else []
        exchanges += [(syntax.write(name, {key: value}), result)
                      for value, result in _CHECK_EXCHANGES[:count]]
        ids = list(chat.prompt_prefix) + encode(_USER) + list(chat.turn_suffix)
        for turn, result in exchanges:
            ids += encode(turn) + [chat.eot_id] + list(chat.reply_prefix) + \
                encode(syntax.result_text(result)) + list(chat.reply_suffix)
        for structured in (False, True):
            messages = [{"role": "user", "content": _USER}]
            for turn, result in exchanges:
                parsed = syntax.parse(turn)
                if structured and not isinstance(parsed, str):
                    messages.append(_call_message(*parsed))
                else:
                    messages.append({"role": "assistant", "content": turn})
                messages.append({"role": "tool", "content": result})
            expected = encode(text_of(messages))
            if ids != expected:
                first = first_difference(ids, expected)
                raise ChatTemplateError(
                    f"chat template: {count} tool exchange(s) "
                    f"{'as structured tool_calls ' if structured else ''}tokenize to "
                    f"{expected[first:first + 8]} at position {first} when rendered in full, "
                    f"but the pieces give {ids[first:first + 8]}; the template's tool turns "
                    "cannot be split into static token pieces")
