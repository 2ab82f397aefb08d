"""A checkpoint's chat template as static token pieces around the env's turns.

A Hugging Face chat template (Jinja, `tokenizer_config.json`'s "chat_template") turns a
conversation into text:

    render([system, user u1, assistant a1, user u2], add_generation_prompt=True)
    Qwen2.5:  <|im_start|>system\\n{S}<|im_end|>\\n<|im_start|>user\\n{u1}<|im_end|>\\n
              <|im_start|>assistant\\n{a1}<|im_end|>\\n<|im_start|>user\\n{u2}<|im_end|>\\n
              <|im_start|>assistant\\n

A token env's episode is exactly such a conversation: its prompt is the first user
turn, each agent action an assistant turn, each reply a user turn. The env produces its
observations inside `jit`, so the template cannot be run per episode; instead
`derive_chat_format` renders conversations of placeholder contents on the host and cuts
the text into the static pieces every turn is wrapped in:

    first observation:   prompt_prefix + prompt + turn_suffix
    agent turn:          action ... eot                      (the model writes eot)
    later observation:   reply_prefix + reply + reply_suffix     (reply_suffix = turn_suffix,
                                                              or a tool result's end:
                                                              `arl.text.tool_calls`)

`prompt_prefix` holds what precedes the first user content (a BOS the template writes,
the system block, the user header), `turn_suffix` the end of a user turn and the
generation prompt, `reply_prefix` what follows the assistant's end-of-turn token up to
the next user content. The end-of-turn token `eot` is the special token the template
closes an assistant turn with (`<|im_end|>`, `<|eot_id|>`). An action cut by the token
budget before its eot gets the eot written in front of the reply (as an observation
token: the template closes every assistant turn).

The derivation is then CHECKED: conversations of one to three exchanges with ordinary
contents are rendered in full, tokenized as `transformers` does (`add_special_tokens=
False`) and compared with the assembled pieces; a template whose turns cannot be split
this way (contents it rewrites, pieces that depend on the turn's position, a turn end
that is not one special token, tokens that merge across a turn boundary) is refused
with the first difference. Rendering follows `transformers.apply_chat_template`: a
sandboxed Jinja environment with `trim_blocks`, `lstrip_blocks`, the loop controls,
`raise_exception`, `strftime_now` and a `tojson` that does not escape HTML, and the
tokenizer's special tokens (bos_token, eos_token, ...) as variables; `transformers` is
not needed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from datetime import datetime
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from arl.text import keep_history
from arl.text.chunks import TokenChunk

# Placeholder contents: plain words, so no template rewrites them and no tokenizer
# merges them with what surrounds them differently from ordinary text.
_PLACEHOLDERS = ("Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf")
# Contents of the conversations the derivation is checked on: user turns (even
# positions) as envs write them, assistant turns (odd) as models write them: reasoning
# in <think> blocks, numbers a tokenizer merges, tool-call markup.
_CHECK_CONTENTS = ("What is 12 + 30?", "<think>\nAdd them: 12 + 30 = 42.\n</think>\n\n42",
                   "wrong, try again", "The answer is 1234.", "guess 0-999",
                   '<tool_call>\n{"name": "python", "arguments": {"code": "6*7"}}\n'
                   '</tool_call>', "lower")
# Assistant turns as thinking models write them (a canonical think block, one without its
# newlines, an empty one, none), on which a keep-history variant is checked.
_THINKING_CONTENTS = ("What is 12 + 30?", "<think>\nAdd them: 12 + 30 = 42.\n</think>\n\n42",
                      "wrong, try again", "<think>Maybe 41.</think>41", "lower",
                      "<think>\n\n</think>\n\n40", "guess 0-999", "500", "higher")
_FIRST_TURNS = ("What is 12 + 30?", "guess 0-1000", "numbers 3 7 25 target 1234",
                "Reply with one word: yes or no.")


class ChatTemplateError(ValueError):
    """The chat template cannot be split into static pieces around the turns."""


@functools.lru_cache(maxsize=32)
def _compile(template: str):
    """The compiled template (cached: per-turn contexts render it every turn)."""
    import jinja2  # pylint: disable=g-import-not-at-top
    from jinja2 import ext, nodes  # pylint: disable=g-import-not-at-top
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=g-import-not-at-top

    class Generation(ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers marks
        the assistant's tokens with it; the text is the same)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(template: str, messages: Sequence[Mapping[str, str]], *,
           add_generation_prompt: bool, special_tokens: Mapping[str, str] | None = None,
           template_kwargs: Mapping | None = None) -> str:
    """The text `transformers.apply_chat_template(messages, tokenize=False,
    add_generation_prompt=..., **template_kwargs)` renders with this template and these
    special tokens ({"bos_token": ..., "eos_token": ...}, as the tokenizer's
    special_tokens_map); `template_kwargs` are the template's own arguments
    (`enable_thinking`, `tools`, `date_string`, ...)."""
    variables = dict(tools=None, documents=None)
    variables.update(special_tokens or {})
    variables.update(template_kwargs or {})
    return _compile(template).render(messages=[dict(m) for m in messages],
                                     add_generation_prompt=add_generation_prompt,
                                     **variables)


def conversation(system_prompt: str | None, turns: Sequence[str]) -> list[dict[str, str]]:
    """[system,] user turns[0], assistant turns[1], user turns[2], ... as messages."""
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    for k, content in enumerate(turns):
        messages.append({"role": "user" if k % 2 == 0 else "assistant", "content": content})
    return messages


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """The static token pieces of a chat template around an env's turns (module doc).

    `prompt_prefix`, `turn_suffix`, `reply_prefix`: token ids (tuples); `eot_id`: the
    end-of-turn token the model writes; `system_prompt`: the system message the pieces
    hold (None: none, i.e. the template's own default if it has one);
    `multi_turn_error`: None, or why the pieces hold for the first turn only (the
    template rewrites earlier turns, e.g. Qwen3 drops their <think> blocks): an env
    with more than one turn is then refused (`check_turns`); `reply_suffix`: what
    closes a later observation (default `turn_suffix`); `reply_role`: the role the
    template renders a later observation as ("user", or "tool" for a tool env in the
    template's tool convention, `arl.text.tool_calls`); `history_template`: None when the
    checkpoint's own template renders the context as generated, else the keep-history
    variant of it (Jinja text) whose `apply_chat_template` the context equals."""

    prompt_prefix: tuple[int, ...]
    turn_suffix: tuple[int, ...]
    reply_prefix: tuple[int, ...]
    eot_id: int
    pad_id: int
    system_prompt: str | None = None
    multi_turn_error: str | None = None
    # None: `turn_suffix`; a tool result's own end (Qwen: "\n</tool_response><|im_end|>\n...").
    reply_suffix: tuple[int, ...] | None = None
    reply_role: str = "user"  # the role the template renders a later observation as
    # The template's text next to the env's prompt / replies (before, after) that the env
    # writes together with its own text as one text (`arl.text.seams.framed`); the
    # pieces then end and start at special tokens. ("", ""): the pieces hold all of it.
    prompt_around: tuple[str, str] = ("", "")
    reply_around: tuple[str, str] = ("", "")
    # None: the checkpoint's own template renders the growing context; else the
    # keep-history variant of it that does (`arl.text.keep_history`, e.g. Qwen3's).
    history_template: str | None = None

    def __post_init__(self):
        if self.reply_suffix is None:
            object.__setattr__(self, "reply_suffix", self.turn_suffix)

    def check_turns(self, max_turns: int, what: str = "the env") -> None:
        """Raises ChatTemplateError when `max_turns` > 1 and the template cannot be cut
        into pieces past the first turn."""
        if max_turns > 1 and self.multi_turn_error is not None:
            raise ChatTemplateError(
                f"{what} has max_turns={max_turns}, but {self.multi_turn_error}; with "
                "rollout.history='as_generated' (and 'per_turn', whose env is built the "
                "same way) only one-turn episodes read what the template renders: set "
                "max_turns=1")

    def first_length(self, prompt_len: int) -> int:
        """Static length of the wrapped first observation."""
        return len(self.prompt_prefix) + prompt_len + len(self.turn_suffix)

    def reply_length(self, obs_len: int) -> int:
        """Static length of a wrapped later observation (eot of a cut action included)."""
        return 1 + len(self.reply_prefix) + obs_len + len(self.reply_suffix)

    def ids_of_conversation(self, encode: Callable[[str], list[int]],
                            turns: Sequence[str]) -> list[int]:
        """The ids the pieces give for a conversation of `turns` (user, assistant, ...,
        ending on a user turn) followed by the generation prompt."""
        ids = list(self.prompt_prefix)
        for k, content in enumerate(turns):
            if k % 2 == 0:
                head, tail = self.reply_around if k else self.prompt_around
                ids += (list(self.reply_prefix) if k else []) + encode(
                    head + content + tail) + list(self.reply_suffix if k else self.turn_suffix)
            else:
                ids += encode(content) + [self.eot_id]
        return ids

    def _wrap(self, head: jax.Array, head_length, body: TokenChunk, size: int,
              tail: tuple[int, ...]) -> TokenChunk:
        """head[:head_length] + body + tail, padded to `size` (one row)."""
        suffix = jnp.asarray(tail, jnp.int32)
        pos = jnp.arange(size)
        body_start = head_length
        suffix_start = body_start + body.length
        length = suffix_start + len(tail)
        take = lambda arr, i: jnp.take(arr, jnp.clip(i, 0, arr.shape[-1] - 1))
        tokens = jnp.where(pos < body_start, take(head, pos),
                           jnp.where(pos < suffix_start, take(body.tokens, pos - body_start),
                                     take(suffix, pos - suffix_start) if len(tail)
                                     else self.pad_id))
        tokens = jnp.where(pos < length, tokens, self.pad_id)
        return TokenChunk(tokens.astype(jnp.int32), jnp.asarray(length, jnp.int32))

    def wrap_prompt(self, prompt: TokenChunk) -> TokenChunk:
        """prompt_prefix + prompt + turn_suffix of one row (traceable), padded to
        `first_length(prompt_len)`."""
        head = jnp.asarray(self.prompt_prefix or (self.pad_id,), jnp.int32)
        return self._wrap(head, len(self.prompt_prefix), prompt,
                          self.first_length(prompt.tokens.shape[-1]), self.turn_suffix)

    def wrap_reply(self, reply: TokenChunk, action_ended: jax.Array) -> TokenChunk:
        """[eot unless the action ended with it] + reply_prefix + reply + reply_suffix of
        one row (traceable), padded to `reply_length(obs_len)`."""
        head = jnp.asarray((self.eot_id,) + self.reply_prefix, jnp.int32)
        skip = jnp.asarray(action_ended, jnp.int32)  # drop the eot: the action wrote it
        head = jnp.roll(head, -skip)
        return self._wrap(head, 1 + len(self.reply_prefix) - skip, reply,
                          self.reply_length(reply.tokens.shape[-1]), self.reply_suffix)


def env_chat_format(env) -> ChatFormat | None:
    """The pieces `env`'s turns are wrapped in: the env's own (`env.chat`, e.g. a tool
    env speaking the template's tool convention), else its codec's, else None; cut at
    the special tokens nearest to the env's text for an env that writes the template's
    text around its own (`writes_template_text`: host envs, `arl.text.seams`)."""
    chat = getattr(env, "chat", None) or getattr(env.codec, "chat", None)
    if chat is not None and getattr(env, "writes_template_text", False):
        from arl.text import seams  # pylint: disable=g-import-not-at-top
        chat = seams.framed(chat, env.codec)
    return chat


def _find(text: str, needle: str, start: int, what: str) -> int:
    at = text.find(needle, start)
    if at < 0:
        raise ChatTemplateError(f"chat template: the {what} content {needle!r} does not appear "
                                f"verbatim in the rendered text {text!r}; the template "
                                "rewrites message contents, so its turns cannot be wrapped "
                                "in static pieces")
    return at


def first_difference(got: list[int], expected: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                min(len(got), len(expected)))


def derive_chat_format(template: str, *, encode: Callable[[str], list[int]],
                       special_texts: Sequence[str], special_tokens: Mapping[str, str],
                       pad_id: int, system_prompt: str | None = None,
                       template_kwargs: Mapping | None = None) -> ChatFormat:
    """The `ChatFormat` of `template` (module docstring), checked against full renders.

    encode: text -> ids as `transformers` tokenizes a rendered chat (special tokens in
    the text become their ids, nothing added). special_texts: the tokenizer's special
    tokens (added tokens marked special). special_tokens: the template's variables
    (bos_token, eos_token, ...). template_kwargs: the template's own arguments
    (`enable_thinking`, `tools`, ...). Raises ChatTemplateError naming what does not
    hold for the first turn; what fails only past it is kept as `multi_turn_error`."""
    def renderer(source: str, which: str = ""):
        def text_of(turns, add_generation_prompt=True):
            try:
                return render(source, conversation(system_prompt, turns),
                              add_generation_prompt=add_generation_prompt,
                              special_tokens=special_tokens, template_kwargs=template_kwargs)
            except Exception as error:  # jinja2's TemplateError and the template's own raises
                raise ChatTemplateError(f"chat template: rendering a {len(turns)}-turn "
                                        f"conversation{which} failed: {error}") from error
        return text_of

    text_of = renderer(template)

    u1, a1, u2 = _PLACEHOLDERS[:3]
    one = text_of([u1])
    at_u1 = _find(one, u1, 0, "first user")
    head, turn_suffix = one[:at_u1], one[at_u1 + len(u1):]
    # The end of turn: what follows an assistant turn that closes the conversation.
    closed = text_of([u1, a1], add_generation_prompt=False)
    at_a1 = _find(closed, a1, at_u1 + len(u1), "assistant")
    after = closed[at_a1 + len(a1):]
    eot_text = max((t for t in special_texts if t and after.startswith(t)), key=len,
                   default=None)
    if eot_text is None or len(encode(eot_text)) != 1:
        raise ChatTemplateError(f"chat template: an assistant turn ends with {after!r}, "
                                "which does not start with one special token (the model's "
                                "end-of-turn token)")
    eot_id = encode(eot_text)[0]
    prefix, suffix = tuple(encode(head)), tuple(encode(turn_suffix))
    for content in _FIRST_TURNS:  # the first turn, with real contents
        expected = encode(text_of([content]))
        got = list(prefix) + encode(content) + list(suffix)
        if got != expected:
            first = first_difference(got, expected)
            raise ChatTemplateError(
                f"chat template: the first turn {content!r} tokenizes to "
                f"{expected[first:first + 8]} at position {first} when rendered in full, but "
                f"the pieces give {got[first:first + 8]}; the template's first turn cannot be "
                "split into static token pieces")
    reply_prefix, multi_turn_error = _later_turns(text_of, encode, one, at_u1, turn_suffix,
                                                  eot_text, prefix, suffix, eot_id)
    history_template = None
    if multi_turn_error is not None:
        variant = keep_history.keep_history_variant(template)
        if variant is None:
            multi_turn_error += "; arl derives no keep-history variant of this template"
        else:
            variant_text_of = renderer(variant, " with its keep-history variant")
            trouble = keep_history.check_keep_history(
                text_of, variant_text_of, _THINKING_CONTENTS[1::2] + _CHECK_CONTENTS[1::2],
                eot_text)
            if trouble is None:
                variant_prefix, trouble = _later_turns(
                    variant_text_of, encode, one, at_u1, turn_suffix, eot_text, prefix, suffix,
                    eot_id, contents=(_CHECK_CONTENTS, _THINKING_CONTENTS))
            if trouble is None:
                reply_prefix, multi_turn_error, history_template = variant_prefix, None, variant
            else:
                multi_turn_error += f"; its keep-history variant does not hold: {trouble}"
    return ChatFormat(prompt_prefix=prefix, turn_suffix=suffix, reply_prefix=reply_prefix,
                      eot_id=int(eot_id), pad_id=int(pad_id), system_prompt=system_prompt,
                      multi_turn_error=multi_turn_error, history_template=history_template)


def _later_turns(text_of, encode, one, at_u1, turn_suffix, eot_text, prefix, suffix,
                 eot_id, contents=(_CHECK_CONTENTS,)) -> tuple[tuple[int, ...], str | None]:
    """(reply_prefix, None) when every later turn is `eot + reply_prefix + reply +
    turn_suffix` around the assistant's turns as written, checked on the first 3, 5, 7
    ... turns of each of `contents` (conversations of real contents); else ((), what the
    template does instead)."""
    u1, a1, u2 = _PLACEHOLDERS[:3]
    two = text_of([u1, a1, u2])
    if not two.startswith(one[:at_u1 + len(u1)]):
        return (), ("the chat template changes the text before the first user turn when "
                    f"more turns follow ({one!r} vs {two!r})")
    at_a1 = two.find(a1, at_u1 + len(u1))
    at_u2 = two.find(u2, max(at_a1, 0) + len(a1))
    if at_a1 < 0 or at_u2 < 0:
        return (), f"the chat template rewrites earlier turns' contents ({two!r})"
    if two[at_u1 + len(u1):at_a1] != turn_suffix:
        return (), ("the chat template renders an earlier assistant turn's opening as "
                    f"{two[at_u1 + len(u1):at_a1]!r}, not as the generation prompt "
                    f"{turn_suffix!r} the policy wrote it after (e.g. Qwen3 with "
                    "enable_thinking=False drops the empty <think> block)")
    between = two[at_a1 + len(a1):at_u2]
    if not between.startswith(eot_text):
        return (), f"the chat template ends an earlier assistant turn with {between!r}"
    if two[at_u2 + len(u2):] != turn_suffix:
        return (), (f"the chat template's generation prompt after the second user turn "
                    f"({two[at_u2 + len(u2):]!r}) differs from the first ({turn_suffix!r})")
    chat = ChatFormat(prompt_prefix=prefix, turn_suffix=suffix,
                      reply_prefix=tuple(encode(between[len(eot_text):])), eot_id=int(eot_id),
                      pad_id=-1)
    for turns in (list(c[:count]) for c in contents for count in range(3, len(c) + 1, 2)):
        count = len(turns)
        rendered = text_of(turns)
        expected = encode(rendered)
        got = chat.ids_of_conversation(encode, turns)
        if got != expected:
            lost = next((c for c in turns[1::2] if c not in rendered), None)
            if lost is not None:
                return (), ("the chat template rewrites earlier assistant turns: "
                            f"{lost!r} is not in the rendered conversation (e.g. Qwen3 drops "
                            "their <think> reasoning)")
            first = first_difference(got, expected)
            return (), (f"a {count}-turn conversation tokenizes to "
                        f"{expected[first:first + 8]} at position {first} when rendered in "
                        f"full, but the per-turn pieces give {got[first:first + 8]}")
    return chat.reply_prefix, None
