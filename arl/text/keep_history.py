"""The keep-history variant of a chat template that rewrites earlier assistant turns.

A policy trained "as generated" reads one growing token sequence: the generation prompt,
what it wrote, the env's reply, the next generation prompt, ... A template such as
Qwen3's renders an assistant turn that way only while it is the latest one: once a later
user turn exists, the turn is rendered without its `<think>` block (thinking on), or
without the empty `<think>\\n\\n</think>\\n\\n` the generation prompt put before it
(`enable_thinking=False`). The growing sequence is then what a *keep-history* variant of
the template renders, one whose assistant turns are always

    generation prompt + the assistant's content as written + end of turn

(TRL's Qwen3 training template and SkyRL's `qwen3_acc_thinking` make the same change).
`keep_history_variant` derives it from the template's own text: in Qwen3's assistant
branch, the part that splits `reasoning_content` from the content and decides by
position whether to show it (from `{%- set reasoning_content = '' %}` to the end of
`{%- if loop.index0 > ns.last_query_index %} ... {%- endif %}`) is replaced by the body
of the template's own `{%- if add_generation_prompt %}` block followed by the content as
written; everything else (the system turn, user and tool turns, the tool calls an
assistant turn carries, the end of turn) is the template's. Templates without that
branch have no derived variant (None).

The variant is only a candidate: `check_keep_history` renders it against the template
(they must agree wherever the template itself renders a turn as it was written: the
first turn's generation prompt, a last assistant turn in the template's own form), and
`arl.text.chat_template` checks that its full renders of multi-turn conversations with
thinking contents equal the growing sequence token for token.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

# A Jinja statement tag `{%- ... -%}` (group 1: the statement).
_STATEMENT = re.compile(r"\{%[-+]?\s*(.*?)\s*[-+]?%\}", re.S)
_SPLIT_START = re.compile(r"set\s+reasoning_content\s*=\s*(''|\"\")$")
_POSITION_TEST = re.compile(r"if\s+loop\.index0\s*>\s*ns\.last_query_index$")
_GENERATION_PROMPT = re.compile(r"if\s+add_generation_prompt$")


def _statements(template: str) -> list[tuple[int, int, str]]:
    return [(m.start(), m.end(), m.group(1)) for m in _STATEMENT.finditer(template)]


def _matching_endif(statements, index: int) -> int | None:
    """The index of the `endif` closing the `if` statement at `index`."""
    depth = 0
    for k in range(index, len(statements)):
        word = statements[k][2].split(None, 1)[0] if statements[k][2] else ""
        if word == "if":
            depth += 1
        elif word == "endif":
            depth -= 1
            if depth == 0:
                return k
    return None


def keep_history_variant(template: str) -> str | None:
    """The keep-history variant of `template` (module docstring), or None where the
    template has no branch that rewrites earlier assistant turns the way this derivation
    knows (Qwen3's `reasoning_content` / `last_query_index` branch) or no generation
    prompt block."""
    statements = _statements(template)
    starts = [k for k, s in enumerate(statements) if _SPLIT_START.match(s[2])]
    tests = [k for k, s in enumerate(statements) if _POSITION_TEST.match(s[2])]
    prompts = [k for k, s in enumerate(statements) if _GENERATION_PROMPT.match(s[2])]
    if len(starts) != 1 or len(tests) != 1 or not prompts or tests[0] < starts[0]:
        return None
    test_end = _matching_endif(statements, tests[0])
    prompt_end = _matching_endif(statements, prompts[-1])
    if test_end is None or prompt_end is None or prompts[-1] < test_end:
        return None
    # Nothing but the reasoning split may stand between the split's start and the
    # position test: the replaced span must be exactly that branch.
    between = [s[2].split(None, 1)[0] for s in statements[starts[0] + 1:tests[0]]]
    if any(word not in ("if", "elif", "else", "endif", "set") for word in between):
        return None
    generation_prompt = template[statements[prompts[-1]][1]:statements[prompt_end][0]]
    replacement = generation_prompt + "{{- content }}"
    return (template[:statements[starts[0]][0]] + replacement
            + template[statements[test_end][1]:])


def check_keep_history(text_of: Callable[..., str], variant_text_of: Callable[..., str],
                       contents: Sequence[str], eot_text: str) -> str | None:
    """None when the variant agrees with the template wherever the template renders a
    turn as the model wrote it: the first user turn with its generation prompt, and a
    conversation closed by an assistant turn that the template renders as the generation
    prompt + the content + `eot_text` (at least one of `contents` must be one); else
    what differs. `text_of(turns, add_generation_prompt=True)` renders with the
    template, `variant_text_of` with the variant."""
    user = "Alpha"
    opened, variant_opened = text_of([user]), variant_text_of([user])
    if opened != variant_opened:
        return (f"its keep-history variant renders the first turn as {variant_opened!r}, "
                f"the template as {opened!r}")
    agreed = 0
    for content in contents:
        closed = text_of([user, content], add_generation_prompt=False)
        if not closed.startswith(opened + content + eot_text):
            continue  # the template itself rewrites this turn
        variant_closed = variant_text_of([user, content], add_generation_prompt=False)
        if variant_closed != closed:
            return (f"its keep-history variant renders the assistant turn {content!r} as "
                    f"{variant_closed!r}, the template as {closed!r}")
        agreed += 1
    if not agreed:
        return ("the template renders none of the checked assistant turns as the generation "
                "prompt followed by the text the model wrote")
    return None
