"""Per-turn contexts: the conversation so far, rendered afresh with the checkpoint's own
chat template before every turn (history mode "per turn", docs/checkpoints.md).

Before turn k the policy reads

    apply_chat_template([system,] user: task, assistant: a_0, user: r_0, ...,
                        assistant: a_{k-1}, user: r_{k-1}, add_generation_prompt=True)

tokenized as `transformers` tokenizes a rendered chat: exactly what the template renders,
so Qwen3 drops the `<think>` blocks of earlier turns, Llama 3.1 trims their contents.
`TurnRenderer.context` builds it on the host from the texts of the episode so far:

* the task and the env's replies are env text: special-token names in them are written
  as plain characters (as every env text in arl, `arl.text.codec.encode_text`); each is
  marked with a private-use character while the template renders, so the rendered text
  is cut at the template's own special tokens only, and every run of text between two
  of them is tokenized as one text (a BPE merges across the seams as in the full render);
* the assistant turns are the ids the policy wrote, decoded as `transformers` decodes
  them (`skip_special_tokens=False`), without the stop id that ended them: the template
  writes the end of turn.

A tool env in the template's tool convention (`arl.envs.tool_calling`: `tools` and a
`ToolCallSyntax`) is rendered as the template renders tool use:

    apply_chat_template([system,] user: task, assistant: {content, tool_calls}, tool: r,
                        tool: r', ..., tools=tools, add_generation_prompt=True)

each assistant turn given as the calls `ToolCallSyntax.parse_calls` reads from it (the
text before them as its content; a turn that does not parse is plain content), each
reply as one `tool` message per result of the turn's calls (`split_results`; one for a
turn without valid calls).

A history window (`HistoryWindow`) keeps the system prompt, the task and the last
`turns` exchanges (assistant turn + reply) only, and within a token budget the most
recent exchanges whose render fits: the context is then `apply_chat_template` of the
kept messages.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from arl.text import chat_template as chat_lib

# Private-use code points that stand for the special-token names inside env text while
# the template renders it (Unicode's private use area; no template writes them).
_MARK_BASE = 0xF0000


@dataclasses.dataclass(frozen=True)
class HistoryWindow:
    """What of the conversation a per-turn context keeps: `turns` > 0 keeps only the last
    `turns` exchanges (0: all); `tokens` > 0 drops the oldest exchanges until the
    rendered context has at most `tokens` tokens (0: no budget). The system prompt and
    the task are always kept."""

    turns: int = 0
    tokens: int = 0

    def __post_init__(self):
        if self.turns < 0 or self.tokens < 0:
            raise ValueError(f"HistoryWindow: turns and tokens must be >= 0, got {self}")


@dataclasses.dataclass(frozen=True)
class RenderedContext:
    """One turn's context: its ids, and the exchanges of the conversation it kept."""

    ids: list[int]
    kept: int


class TurnRenderer:
    """Renders per-turn contexts of a checkpoint's codec (`HFCodec.from_pretrained`):
    its chat template, special tokens, system prompt and template arguments; with
    `call_syntax` (a tool env's `ToolCallSyntax`), the conversation in the template's
    tool convention with `tools` (function schemas) declared to it."""

    def __init__(self, codec, window: HistoryWindow = HistoryWindow(), *,
                 tools: Sequence[dict] = (), call_syntax=None):
        template = getattr(codec, "chat_template", None)
        if template is None:
            raise ValueError("per-turn contexts need a checkpoint's chat template "
                             "(HFCodec.from_pretrained of a directory with one)")
        self.codec = codec
        self.template = template
        self.window = window
        self.system_prompt = codec.chat.system_prompt
        self.call_syntax = call_syntax
        self.template_kwargs = codec.template_kwargs
        if call_syntax is not None:  # as `arl.text.tool_calls` declares them
            self.template_kwargs = dict(codec.template_kwargs or {},
                                        tools=[dict(t) for t in tools])
        tokenizer = codec.tokenizer
        self.specials = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values()
                                if t.special), key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, self.specials)))
        self._mark_of = {name: chr(_MARK_BASE + k) for k, name in enumerate(self.specials)}
        self._name_of = {mark: name for name, mark in self._mark_of.items()}
        self._mark_re = re.compile("|".join(map(re.escape, self._name_of)))
        self._tokenizer_vocab = tokenizer.get_vocab_size(with_added_tokens=True)

    # -- texts of the episode
    def assistant_text(self, ids: Sequence[int], stop_ids: Sequence[int]) -> str:
        """The text of an assistant turn the policy wrote as `ids`: decoded as
        `transformers` decodes (special tokens as their names) without the stop id that
        ended it; ids past the tokenizer's vocabulary (a padded embedding) are skipped."""
        ids = [int(i) for i in ids]
        if ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        ids = [i for i in ids if 0 <= i < self._tokenizer_vocab]
        return self.codec.tokenizer.decode(ids, skip_special_tokens=False)

    def env_text(self, ids: Sequence[int], around: tuple[str, str] = ("", "")) -> str:
        """The text of an env's prompt or reply chunk: decoded, without the template's
        text `around` it that a host env writes together with it (`arl.text.seams`)."""
        text = self.codec.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
        head, tail = around
        if head and text.startswith(head):
            text = text[len(head):]
        if tail and text.endswith(tail):
            text = text[:len(text) - len(tail)]
        return text

    # -- messages and their ids
    def messages(self, task: str, exchanges: Sequence[tuple[str, str]]) -> list[dict]:
        """[system,] user task, then assistant / user for each (assistant, reply); with a
        call syntax, each assistant turn with its parsed `tool_calls` and its reply as
        `tool` messages (module docstring)."""
        messages = ([] if self.system_prompt is None
                    else [{"role": "system", "content": self.system_prompt}])
        messages.append({"role": "user", "content": task})
        syntax = self.call_syntax
        for assistant, reply in exchanges:
            if syntax is None:
                messages += [{"role": "assistant", "content": assistant},
                             {"role": "user", "content": reply}]
                continue
            message = syntax.assistant_message(assistant)
            results = syntax.split_results(reply, len(message.get("tool_calls", ())))
            messages.append(message)
            messages += [{"role": "tool", "content": result} for result in results]
        return messages

    def ids(self, task: str, exchanges: Sequence[tuple[str, str]]) -> list[int]:
        """The ids of `apply_chat_template(messages(task, exchanges),
        add_generation_prompt=True[, tools=tools])`, env text in plain characters
        (module docstring)."""
        marked = lambda text: self._special_re.sub(lambda m: self._mark_of[m.group(0)], text)
        text = chat_lib.render(
            self.template, self.messages(marked(task), [(a, marked(r)) for a, r in exchanges]),
            add_generation_prompt=True, special_tokens=self.codec.template_tokens,
            template_kwargs=self.template_kwargs)
        ids, start = [], 0
        for match in self._special_re.finditer(text):
            ids += self._plain(text[start:match.start()])
            ids += self.codec.encode(match.group(0))
            start = match.end()
        return ids + self._plain(text[start:])

    def _plain(self, run: str) -> list[int]:
        if not run:
            return []
        if not self._name_of:
            return self.codec.encode_plain(run)
        return self.codec.encode_plain(self._mark_re.sub(lambda m: self._name_of[m.group(0)],
                                                         run))

    def context(self, task: str, exchanges: Sequence[tuple[str, str]],
                capacity: int) -> RenderedContext | None:
        """The context before the next turn under the window: the most recent exchanges
        (at most `window.turns` of them) whose render has at most `window.tokens` and
        `capacity` tokens; None when not even the task alone fits."""
        budget = min(capacity, self.window.tokens or capacity)
        keep = len(exchanges) if not self.window.turns else min(self.window.turns,
                                                                len(exchanges))
        while keep >= 0:
            ids = self.ids(task, exchanges[len(exchanges) - keep:])
            if len(ids) <= budget:
                return RenderedContext(ids=ids, kept=keep)
            keep -= 1
        return None
