"""A chat template's tool convention as static token pieces (calls and tool results).

An instruct checkpoint was tuned to call tools in its template's own format: the
`tools` list (JSON schemas) rendered into the system turn, a call written as JSON in
the model's markup, the result handed back as a `tool` message:

    Qwen2.5 / Hermes:  <tool_call>\\n{"name": "run_python", "arguments": {"code": "6*7"}}
                       \\n</tool_call><|im_end|>\\n<|im_start|>user\\n<tool_response>\\n42
                       \\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

A host tool env in this convention (`arl.envs.tool_calling.ToolCallingEnvironment`, and
`sql` / `code_interpreter` with `tool_format="template"`) answers EVERY agent turn with a
`tool` message (the tools' output, or an error text such as "error: no tool call or
answer"), so every later observation is wrapped in one static pair of pieces: `derive_tool_chat_format` renders [system, user, assistant(call), tool(result)]
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
Several calls in one turn (`ToolCallSyntax.write_calls` / `parse_calls`, for
`arl.envs.tool_calling`): the text between two calls, between their two results in the
one reply, and between a turn's text and its first call are read from renders of a
message with two `tool_calls`, of two `tool` messages in a row and of a message with
content and a call; where the template raises (Llama 3.1: one call per turn) or writes
results apart with special tokens, one call per turn. The check then also renders a
turn with two calls and a call after text, raw and structured. A call is always
rendered before its result, never as the conversation's last turn, which Qwen3 renders
with a think block.
Read back (history "per_turn", `arl.text.render_turns`): `ToolCallSyntax.assistant_message`
gives a turn as the message a template takes (its calls as structured `tool_calls`) and
`split_results` a reply as the results of its calls, one `tool` message each.
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
    # Several calls in one turn (`write_calls`, `parse_calls`): the text between two
    # calls (Qwen: "\n") and between their two results in the one reply (Qwen:
    # "\n</tool_response>\n<tool_response>\n"); None where the template renders one
    # call per turn (Llama 3.1 raises) or writes results apart with special tokens.
    call_separator: str | None = None
    result_separator: str | None = None
    # The text between an assistant's content and its first call (Qwen: "\n"); None
    # where the template drops the content of a turn with calls (Llama 3.1).
    content_separator: str | None = None

    @property
    def several_calls(self) -> bool:
        """Whether one turn can hold several calls (and its reply their results)."""
        return self.call_separator is not None and self.result_separator is not None

    def result_text(self, text: str) -> str:
        """What the host writes between the result's pieces for the result `text`."""
        return json.dumps(text, ensure_ascii=False)[1:-1] if self.results_as_json else text

    def write(self, name: str, arguments: Mapping[str, Any]) -> str:
        """The call as the template renders a structured `tool_calls` message."""
        body = json.dumps({self.name_key: name, self.arguments_key: dict(arguments)},
                          ensure_ascii=False)
        return f"{self.prefix}{body}{self.suffix}"

    def write_calls(self, calls: Sequence[tuple[str, Mapping[str, Any]]],
                    content: str = "") -> str:
        """A turn of `content` then the `calls` ((name, arguments) pairs), as the template
        renders an assistant message {"content": content, "tool_calls": calls}."""
        if len(calls) > 1 and not self.several_calls:
            raise ValueError(f"this template renders one tool call per turn, got {len(calls)}")
        if content and self.content_separator is None:
            raise ValueError("this template drops the text of a turn with a tool call")
        text = (self.call_separator or "").join(self.write(n, a) for n, a in calls)
        return f"{content}{self.content_separator}{text}" if content else text

    def result_texts(self, results: Sequence[str]) -> str:
        """What the host writes between the result pieces for the results of one turn's
        calls (each escaped where the template writes JSON strings)."""
        if len(results) > 1 and not self.several_calls:
            raise ValueError(f"this template renders one tool result per turn, got "
                             f"{len(results)}")
        return (self.result_separator or "").join(self.result_text(r) for r in results)

    def parse_calls(self, text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]] | str:
        """(content, [(name, arguments), ...]) of the turn `text`: the text before the
        first call (where the template renders one) and every call, separated by
        whitespace; "no tool call" when the turn holds none, or the error text the env
        answers with ("bad JSON in the tool call", "one tool call per turn", ...)."""
        marker, closing = self.prefix.strip(), self.suffix.strip()
        start = text.find(marker) if marker else len(text) - len(text.lstrip())
        if start < 0 or (not marker and not text[start:].startswith("{")):
            return NO_CALL
        content = text[:start].rstrip()
        if content and self.content_separator is None:
            return "text before the tool call (write the call alone)"
        decoder, calls, position = json.JSONDecoder(), [], start
        while True:
            position += len(marker)
            position += len(text[position:]) - len(text[position:].lstrip())
            try:
                call, position = decoder.raw_decode(text, position)
            except ValueError:
                return "bad JSON in the tool call"
            if not isinstance(call, dict) or not isinstance(call.get(self.name_key), str):
                return f'the tool call needs "{self.name_key}": a string'
            if not isinstance(call.get(self.arguments_key), dict):
                return f'the tool call needs "{self.arguments_key}": an object'
            calls.append((call[self.name_key], call[self.arguments_key]))
            rest = text[position:].lstrip()
            if closing:
                if not rest.startswith(closing):
                    return f"the tool call is not closed with {closing!r}"
                rest = rest[len(closing):].lstrip()
            position = len(text) - len(rest)
            if not rest:
                return content, calls
            if not rest.startswith(marker or "{"):
                return "text after the tool call"
            if not self.several_calls:
                return "one tool call per turn (this model's template renders one)"

    def assistant_message(self, text: str) -> dict[str, Any]:
        """The assistant message of the turn `text` as a chat template takes it: its
        content and its calls as structured `tool_calls` where `parse_calls` reads them,
        else `text` as plain content."""
        parsed = self.parse_calls(text)
        if isinstance(parsed, str):
            return {"role": "assistant", "content": text}
        content, calls = parsed
        return {"role": "assistant", "content": content,
                "tool_calls": [_call_message(n, a)["tool_calls"][0] for n, a in calls]}

    def split_results(self, text: str, count: int) -> list[str]:
        """The inverse of `result_texts`: the (at most `count`) results of one reply
        `text`, unescaped where the template writes JSON strings. A result that holds the
        separator text itself is read as ending there (the reply alone cannot tell)."""
        pieces = (text.split(self.result_separator, max(count, 1) - 1)
                  if self.several_calls and count > 1 else [text])
        if not self.results_as_json:
            return pieces
        unescaped = []
        for piece in pieces:
            try:
                unescaped.append(json.loads(f'"{piece}"'))
            except ValueError:  # a reply `result_texts` did not write: kept as it is
                unescaped.append(piece)
        return unescaped

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
    # The call is followed by its result: a template may render the LAST assistant turn
    # otherwise (Qwen3 gives it a think block), and a call is never the last turn here.
    called = text_of([user, _call_message(_NAME_MARK, arguments),
                      {"role": "tool", "content": _RESULT}], add_generation_prompt=False)
    if eot_text is not None and not called.startswith(opened):
        common = next((i for i, (a, b) in enumerate(zip(called, opened)) if a != b),
                      min(len(called), len(opened)))
        common = opened.rfind("\n", 0, common) + 1
        raise ChatTemplateError(
            f"chat template: the generation prompt ends {opened[common:]!r}, but an earlier "
            f"assistant turn with a tool call re-renders as {called[common:common + 40]!r}...: "
            "the template rewrites earlier turns (e.g. drops the empty think block its "
            "generation prompt ends with) and arl derives no keep-history variant of it, "
            "so the context would not be what it renders")
    if eot_text is None or eot_text not in called[len(opened):]:
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
    syntax = _several_calls(syntax, text_of, opened, eot_text, special_texts,
                            result[len(expected_head):at_result])
    chat = dataclasses.replace(
        base, multi_turn_error=None, reply_role="tool",
        reply_prefix=tuple(encode(result[len(expected_head):at_result])),
        reply_suffix=tuple(encode(result[at_result + len(_RESULT):])))
    _check(chat, syntax, text_of, encode)
    return chat, syntax


def _several_calls(syntax: ToolCallSyntax, text_of, opened: str, eot_text: str,
                   special_texts: Sequence[str], reply_head: str) -> ToolCallSyntax:
    """`syntax` with the separators of several calls in one turn, of their results and
    of a turn's content, read from renders (each None where the template does not
    render it as plain text between the pieces; module docstring)."""
    user = {"role": "user", "content": _USER}
    first, second = (_NAME_MARK, {_ARG_MARK: _VALUE_MARK}), ("Kilo", {"Lima": "Mike"})

    def assistant_text(message) -> str | None:
        try:
            called = text_of([user, message, {"role": "tool", "content": _RESULT}],
                             add_generation_prompt=False)
        except ChatTemplateError:  # Llama 3.1: "This model only supports single tool-calls"
            return None
        if not called.startswith(opened) or eot_text not in called[len(opened):]:
            return None
        return called[len(opened):called.index(eot_text, len(opened))]

    def between(text, left, right) -> str | None:
        if text is None or not (text.startswith(left) and text.endswith(right)) or len(
                text) < len(left) + len(right):
            return None
        middle = text[len(left):len(text) - len(right)]
        return None if any(t and t in middle for t in special_texts) else middle

    two = {"role": "assistant", "content": "", "tool_calls": [
        _call_message(*first)["tool_calls"][0], _call_message(*second)["tool_calls"][0]]}
    call_separator = between(assistant_text(two), syntax.write(*first), syntax.write(*second))
    content = dict(_call_message(*first), content="November")
    content_separator = between(assistant_text(content), "November", syntax.write(*first))
    result_separator = None
    if call_separator is not None:
        two_text = syntax.write(*first) + call_separator + syntax.write(*second)
        try:
            results = text_of([user, {"role": "assistant", "content": two_text},
                               {"role": "tool", "content": _RESULT},
                               {"role": "tool", "content": "Oscar"}])
        except ChatTemplateError:
            results = None
        head = opened + two_text + eot_text + reply_head
        if results is not None and results.startswith(head):
            tail = results[len(head):]
            left, right = syntax.result_text(_RESULT), syntax.result_text("Oscar")
            at = tail.find(right, len(left))
            result_separator = between(tail[:at + len(right)], left, right) if at > 0 else None
    return dataclasses.replace(syntax, call_separator=call_separator,
                               result_separator=result_separator,
                               content_separator=content_separator)


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
    conversations = []
    for count in (1, 2, 3):
        exchanges = [(_PLAIN_TURN[0], [_PLAIN_TURN[1]])] if count == 2 else []
        exchanges += [(syntax.write(name, {key: value}), [result])
                      for value, result in _CHECK_EXCHANGES[:count]]
        conversations.append((f"{count} tool exchange(s)", exchanges))
    if syntax.several_calls:  # two calls in one turn, then one
        calls = [(name, {key: value}) for value, _ in _CHECK_EXCHANGES]
        results = [result for _, result in _CHECK_EXCHANGES]
        conversations.append(("two calls in one turn", [
            (syntax.write_calls(calls[:2]), results[:2]),
            (syntax.write_calls(calls[2:]), results[2:])]))
    if syntax.content_separator is not None:
        conversations.append(("a call after text", [
            (syntax.write_calls([(name, {key: "6*7"})], content="I will compute it."),
             ["42"])]))
    for what, exchanges in conversations:
        ids = list(chat.prompt_prefix) + encode(_USER) + list(chat.turn_suffix)
        for turn, results in exchanges:
            ids += encode(turn) + [chat.eot_id] + list(chat.reply_prefix) + \
                encode(syntax.result_texts(results)) + list(chat.reply_suffix)
        for structured in (False, True):
            messages = [{"role": "user", "content": _USER}]
            for turn, results in exchanges:
                messages.append(syntax.assistant_message(turn) if structured
                                else {"role": "assistant", "content": turn})
                messages += [{"role": "tool", "content": result} for result in results]
            expected = encode(text_of(messages))
            if ids != expected:
                first = first_difference(ids, expected)
                raise ChatTemplateError(
                    f"chat template: {what} "
                    f"{'as structured tool_calls ' if structured else ''}tokenize to "
                    f"{expected[first:first + 8]} at position {first} when rendered in full, "
                    f"but the pieces give {ids[first:first + 8]}; the template's tool turns "
                    "cannot be split into static token pieces")
