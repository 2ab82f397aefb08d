"""Does the policy read, before every turn, what the tokenizer makes of the rendered
conversation? The reference every multi-turn test and `python -m tests.seam_reference`
(the table of docs/checkpoints.md's "Seams") compare rollouts with.

Reference (the "as generated" history): before the first turn,
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` itself; before each
later turn, the reference before the previous turn, then the policy's turn as it wrote it
(its ids: a sampled turn is not re-tokenized in this mode), then the tokenizer's ids of
the text the template renders after the turn's content (the end-of-turn token, the
env's reply as a user or tool message, the generation prompt). That text starts with a
special token, so tokenizing it apart is what `transformers` does to the whole render;
for a policy that writes its turns as the tokenizer would (the scripted policies of
host envs) the reference is `apply_chat_template` of the whole conversation. The env's
replies are read back from the context (decoded between the template's texts), so an
env that spells its reply with other ids than the tokenizer's shows up as a difference.
"""

from __future__ import annotations

import json

import numpy as np

_MARK = "Zulu"  # a placeholder content: finds the template's text around a message


def _ids(value):
    return list(value["input_ids"] if hasattr(value, "keys") else value)


class Reference:
    """Renders and tokenizes conversations with `transformers` (the checkpoint's own
    tokenizer and template) for the env `env` (its codec from that checkpoint)."""

    def __init__(self, directory, env, system_prompt=None, template_kwargs=None, tools=None):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.env = env
        self.head = [] if system_prompt is None else [{"role": "system",
                                                       "content": system_prompt}]
        self.kwargs = dict(template_kwargs or {})
        if tools is not None:
            self.kwargs["tools"] = tools
        syntax = getattr(env, "call_syntax", None)
        self.reply_role = "tool" if syntax is not None else "user"
        self.results_as_json = bool(syntax is not None and syntax.results_as_json)

    def text(self, messages, add_generation_prompt=True) -> str:
        return self.tokenizer.apply_chat_template(
            self.head + messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return _ids(self.tokenizer(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _around(self, messages, role):
        """(text before, text after) a message of `role` appended to `messages`, up to
        and including the generation prompt, with everything before `messages`' render
        cut off."""
        before = self.text(messages, add_generation_prompt=False) if messages else ""
        full = self.text(messages + [{"role": role, "content": _MARK}])
        at = full.index(_MARK, len(before))
        return full[len(before):at], full[at + len(_MARK):]

    def _content(self, written: str, role: str) -> str:
        if role == "tool" and self.results_as_json:
            return json.loads(f'"{written}"')
        return written

    def check_row(self, tokens, agent_mask, turn_starts, num_turns) -> list[bool]:
        """For each turn of one rollout row: does the context before it equal the
        reference (module docstring)?"""
        tokens = [int(t) for t in np.asarray(tokens)]
        starts = [int(s) for s in np.asarray(turn_starts)[:int(num_turns)]]
        agent = np.asarray(agent_mask) > 0
        eot = self.env.codec.eot_id
        results = []
        # The first turn: the prompt read back between the template's texts.
        opening, closing = self._around([], "user")
        first_text = self.decode(tokens[:starts[0]])
        messages = None
        if first_text.startswith(opening) and first_text.endswith(closing):
            prompt = first_text[len(opening):len(first_text) - len(closing)]
            messages = [{"role": "user", "content": prompt}]
            reference = _ids(self.tokenizer.apply_chat_template(
                self.head + messages, add_generation_prompt=True, tokenize=True,
                **self.kwargs))
        for t, start in enumerate(starts):
            results.append(messages is not None and tokens[:start] == reference)
            if t + 1 == len(starts) or messages is None or not results[-1]:
                # a difference: later turns are compared with nothing (counted unequal)
                results += [False] * (len(starts) - len(results))
                break
            end = start
            while end < len(tokens) and agent[end]:
                end += 1
            action = tokens[start:end]
            if action and action[-1] == eot:
                action = action[:-1]
            content = self.decode(action)
            rendered = self.text(messages, add_generation_prompt=True)
            opening, closing = self._around(
                messages + [{"role": "assistant", "content": content}], self.reply_role)
            after_text = self.decode(tokens[start + len(action):starts[t + 1]])
            with_turn = self.text(messages + [{"role": "assistant", "content": content}],
                                  add_generation_prompt=False)
            if not (with_turn.startswith(rendered + content) and after_text.startswith(
                    with_turn[len(rendered + content):] + opening)
                    and after_text.endswith(closing)):
                messages = None
                continue
            cut = with_turn[len(rendered + content):] + opening
            written = after_text[len(cut):len(after_text) - len(closing)]
            messages = messages + [{"role": "assistant", "content": content},
                                   {"role": self.reply_role,
                                    "content": self._content(written, self.reply_role)}]
            after = self.text(messages)[len(rendered + content):]
            reference = reference + action + self.encode(after)
        return results

    def check(self, traj) -> list[bool]:
        """`check_row` of every row of a (host) trajectory, concatenated."""
        out = []
        for b in range(traj.tokens.shape[0]):
            out += self.check_row(traj.tokens[b], traj.agent_mask[b], traj.turn_starts[b],
                                  traj.num_turns[b])
        return out


# Envs of more than one turn (name, make kwargs): the games, the in-graph tools, the
# dataset task, and the host tool envs with their tags and in the template's convention.
MULTI_TURN_ENVS = (
    ("countdown", {}), ("guess_number", {"max_n": 1000, "max_turns": 6}),
    ("calculator", {}), ("frozen_lake", {}), ("sokoban", {}),
    ("sql", {"max_turns": 3, "action_len": 256, "obs_len": 64}),
    ("sql", {"tool_format": "template", "max_turns": 3, "action_len": 256, "obs_len": 64}),
    ("sql", {"tool_format": "template", "max_turns": 3, "action_len": 256, "obs_len": 12}),
    ("code_interpreter", {"max_turns": 3, "action_len": 96, "allow_weak_sandbox": True}),
    ("code_interpreter", {"tool_format": "template", "max_turns": 3, "action_len": 96,
                          "allow_weak_sandbox": True}),
)
FAMILIES = ("qwen2", "llama3", "llama3.1")
SYSTEM = "Answer briefly."


def measure(directory, name, kwargs, *, num_tasks=6, seed=0, sources=("oracle",
                                                                      "demonstrator")):
    """(turns whose context equals the reference, turns) of scripted episodes of env
    `name` on the checkpoint `directory`'s codec."""
    import jax

    from arl import envs
    from arl import rollout as rollout_lib
    from arl.text.hf_codec import HFCodec

    codec = HFCodec.from_pretrained(directory, system_prompt=SYSTEM)
    env = envs.make(name, codec=codec, **kwargs)
    tools = None
    if getattr(env, "call_syntax", None) is not None:
        from arl.text.tool_calls import function_schema
        tools = [function_schema(*env.tool_function)]
    reference = Reference(directory, env, system_prompt=SYSTEM, tools=tools)
    equal = []
    for k, source in enumerate(sources):
        traj = jax.device_get(rollout_lib.scripted_rollout(
            env, jax.random.key(seed + k), num_tasks=num_tasks, group_size=1,
            action_source=source))
        equal += reference.check(traj)
    if hasattr(env, "close"):
        env.close()
    return sum(equal), len(equal)


def main():
    import os
    import sys
    import tempfile

    from tests.hf_standins import build_standin

    root = tempfile.mkdtemp()
    rows = []
    # python -m tests.seam_reference [families] [-- env labels' names]: a subset.
    args = sys.argv[1:]
    names = args[args.index("--") + 1:] if "--" in args else []
    families = (args[:args.index("--")] if "--" in args else args) or FAMILIES
    sources = tuple(os.environ.get("SEAM_SOURCES", "oracle,demonstrator").split(","))
    for family in families:
        directory = build_standin(f"{root}/{family}", family)
        for name, kwargs in MULTI_TURN_ENVS:
            label = name + "".join(f" {k}={v}" for k, v in kwargs.items()
                                   if k in ("tool_format", "obs_len"))
            if names and not any(n in label for n in names):
                continue
            try:
                equal, total = measure(directory, name, kwargs, sources=sources)
                cell = f"{equal}/{total}"
            except Exception as error:  # pylint: disable=broad-except
                cell = f"error: {str(error).splitlines()[0][:80]}"
            rows.append((family, label, cell))
            print(f"| {family} | {label} | {cell} |", flush=True)


if __name__ == "__main__":
    main()
