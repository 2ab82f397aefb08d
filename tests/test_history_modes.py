"""History mode "as generated" under templates that rewrite earlier turns (Qwen3, thinking
on and off): the growing context equals `transformers`' `apply_chat_template` under the
keep-history variant arl derives (`arl.text.keep_history`), checked on full renders of
conversations with thinking contents and before every turn of multi-turn episodes (plain
and tool envs); the checkpoint's own template renders the same conversations otherwise;
a template without a derivable variant is refused in one line naming the mode; the
`rollout.history` key is checked early."""

from __future__ import annotations

import functools
import json
import os

import hypothesis
import jax
import ml_collections
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from arl import rollout as rollout_lib  # noqa: E402
from arl.envs import from_config  # noqa: E402
from arl.envs.tasks.dataset_task import DatasetTask  # noqa: E402
from arl.errors import ConfigError  # noqa: E402
from arl.text import chat_template, keep_history  # noqa: E402
from arl.text.hf_codec import HFCodec  # noqa: E402
from tests import hf_standins  # noqa: E402
from tests.tool_templates import QWEN3_TOOLS_TEMPLATE as QWEN3_TOOL_TEMPLATE  # noqa: E402
from tests.tool_templates import call_message, copy_with_template  # noqa: E402

SYSTEM = "Answer with a number."
OFF = {"enable_thinking": False}
# A conversation as a thinking model writes it: canonical, cramped, empty and no think
# blocks, numbers, a reply.
THINKING_TURNS = ("What is 12 + 30?", "<think>\nAdd them: 12 + 30 = 42.\n</think>\n\n42",
                  "wrong, try again", "<think>It may be 41.</think>41", "lower",
                  "<think>\n\n</think>\n\n40", "higher", "44", "correct?")


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    root = tmp_path_factory.mktemp("history")

    @functools.lru_cache(maxsize=None)
    def build(name):
        if name == "qwen3-tools":
            return copy_with_template(build("qwen3"), str(root / "qwen3_tools"), QWEN3_TOOL_TEMPLATE)
        return hf_standins.build_standin(str(root / name.replace(".", "_")), name)
    return build


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {a} plus {b}?",
                                        "answer": str(a + b)}) + "\n"
                            for a, b in [(1, 2), (30, 12), (7, 8), (100, 5), (3, 3),
                                         (9, 9), (11, 4), (5, 60), (2, 2), (4, 4)]))
    return str(path)


def _ids(tokenizer, messages, **kwargs):
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_the_variant_is_derived_only_from_qwen3s_branch():
    for template in (hf_standins.QWEN3_TEMPLATE, QWEN3_TOOL_TEMPLATE):
        variant = keep_history.keep_history_variant(template)
        assert "last_query_index %}" not in variant and "reasoning_content" not in variant
        # the rest of the template is kept: its generation prompt and tool branches
        assert variant.count("enable_thinking is false") == 2
        assert variant.count("<tool_call>") == template.count("<tool_call>")
    for template in (hf_standins.QWEN25_TEMPLATE, hf_standins.LLAMA3_TEMPLATE,
                     hf_standins.LLAMA31_TEMPLATE, _without_variant(hf_standins.QWEN3_TEMPLATE)):
        assert keep_history.keep_history_variant(template) is None


def _without_variant(template):
    """Qwen3's template with its position test written another way: a template that
    rewrites earlier turns and that arl derives no keep-history variant of."""
    changed = template.replace("loop.index0 > ns.last_query_index",
                               "ns.last_query_index < loop.index0")
    assert changed != template
    return changed


@pytest.mark.parametrize("name", ["qwen3", "qwen3-tools"])
@pytest.mark.parametrize("kwargs", [{}, OFF])
def test_keep_history_render_is_the_growing_context(standins, name, kwargs):
    """Full renders of conversations with thinking contents: under the variant, exactly
    the pieces around the turns as written (`ids_of_conversation`, what the rollout
    assembles); under the checkpoint's own template, earlier turns lose their <think>
    blocks (thinking on) or the generation prompt's empty one (off); where the template
    renders a turn as written (the latest one), both templates agree."""
    from transformers import AutoTokenizer

    directory = standins(name)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    codec = HFCodec.from_pretrained(directory, system_prompt=SYSTEM, template_kwargs=kwargs)
    chat = codec.chat
    assert chat.multi_turn_error is None and chat.history_template is not None
    turns = THINKING_TURNS if not kwargs else tuple(  # thinking off: no think blocks
        t.split("</think>")[-1].lstrip("\n") for t in THINKING_TURNS)
    for count in range(1, len(turns) + 1, 2):
        messages = chat_template.conversation(SYSTEM, turns[:count])
        variant = _ids(tokenizer, messages, add_generation_prompt=True,
                       chat_template=chat.history_template, **kwargs)
        assert variant == chat.ids_of_conversation(codec.encode, turns[:count]), count
        own = _ids(tokenizer, messages, add_generation_prompt=True, **kwargs)
        assert (own == variant) == (count == 1), count
    # the latest assistant turn, closed: the template renders it as written, and so does
    # the variant (thinking on: a canonical think block; off: after the empty one)
    closed = chat_template.conversation(SYSTEM, turns[:2])
    assert _ids(tokenizer, closed, chat_template=chat.history_template, **kwargs) == \
        _ids(tokenizer, closed, **kwargs)


_WORDS = ("42", "Add them", "12 + 30 = 42.", "lower", "maybe 7", "x", "<tool_call>")
_SEPARATORS = ("", "\n", "\n\n", " ")


@hypothesis.strategies.composite
def _assistant_turns(draw):
    """What a thinking model may write: an answer, behind a think block or not, with any
    spacing inside (never leading whitespace: the policy's first token follows the
    generation prompt, a seam of its own)."""
    answer = draw(hypothesis.strategies.sampled_from(_WORDS))
    if not draw(hypothesis.strategies.booleans()):
        return answer
    separator = lambda: draw(hypothesis.strategies.sampled_from(_SEPARATORS))
    reasoning = draw(hypothesis.strategies.sampled_from(("",) + _WORDS))
    return ("<think>" + separator() + reasoning + separator() + "</think>" + separator()
            + answer)


@pytest.mark.parametrize("kwargs", [{}, OFF])
def test_any_thinking_conversation_renders_as_generated(standins, kwargs):
    from transformers import AutoTokenizer

    directory = standins("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    codec = HFCodec.from_pretrained(directory, system_prompt=SYSTEM, template_kwargs=kwargs)

    @hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
    @hypothesis.given(hypothesis.strategies.lists(_assistant_turns(), min_size=1, max_size=4))
    def check(answers):
        turns = ["What is 12 + 30?"]
        for answer in answers:
            turns += [answer, "wrong, try again"]
        messages = chat_template.conversation(SYSTEM, turns)
        assert _ids(tokenizer, messages, add_generation_prompt=True,
                    chat_template=codec.chat.history_template, **kwargs) == \
            codec.chat.ids_of_conversation(codec.encode, turns)

    check()


@pytest.mark.parametrize("kwargs", [{}, OFF])
def test_qwen3_multi_turn_context_is_the_keep_history_render_every_turn(standins, jsonl,
                                                                        kwargs):
    from transformers import AutoTokenizer

    directory = standins("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    codec = HFCodec.from_pretrained(directory, system_prompt=SYSTEM, template_kwargs=kwargs)
    env = DatasetTask(jsonl, codec=codec, max_turns=3)
    keys, params = env.split_tasks(group_size=2)
    params = params.replace(demonstrator_accuracy=params.demonstrator_accuracy * 0 + 0.3)
    traj = jax.device_get(rollout_lib.scripted_rollout(
        env, jax.random.key(1), num_tasks=env.num_rows, group_size=2,
        action_source="demonstrator"))
    turns_seen = set()
    for b in range(2 * env.num_rows):
        tokens = traj.tokens[b].tolist()
        first = len(codec.chat.prompt_prefix)
        starts = [int(traj.turn_starts[b, t]) for t in range(int(traj.num_turns[b]))]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content":
                    tokenizer.decode(tokens[first:starts[0] - len(codec.chat.turn_suffix)])}]
        for t, start in enumerate(starts):
            assert tokens[:start] == _ids(tokenizer, messages, add_generation_prompt=True,
                                          chat_template=codec.chat.history_template,
                                          **kwargs), (b, t)
            end = start + int(np.argmin(traj.agent_mask[b, start:] > 0))
            assert tokens[end - 1] == codec.eot_id
            messages.append({"role": "assistant", "content": tokenizer.decode(
                tokens[start:end - 1])})
            reply = end + len(codec.chat.reply_prefix)
            reply_end = reply + int(np.argmax(np.asarray(tokens[reply:]) == codec.eot_id))
            messages.append({"role": "user", "content": tokenizer.decode(
                tokens[reply:reply_end])})
            turns_seen.add(t)
    assert turns_seen == {0, 1, 2}


@pytest.mark.parametrize("kwargs", [{}, OFF])
def test_qwen3_tool_env_context_is_the_keep_history_render_every_turn(standins, kwargs):
    """sql in Qwen3's own tool convention: before every turn, apply_chat_template(messages,
    tools=...) under the keep-history variant, the call as structured tool_calls and
    the replies as tool messages."""
    from transformers import AutoTokenizer

    directory = standins("qwen3-tools")
    config = ml_collections.ConfigDict(dict(model=dict(
        hf_checkpoint=directory, system_prompt=SYSTEM, chat_template_kwargs=kwargs)))
    env = from_config.make_env(dict(name="sql", kwargs=dict(
        tool_format="template", max_turns=3, action_len=256, obs_len=64)),
        from_config.checkpoint_codec(config))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    chat = env.chat
    assert chat.history_template is not None and chat.reply_role == "tool"
    name, description, parameter, parameter_description = env.tool_function
    tools = [{"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {parameter: {
            "type": "string", "description": parameter_description}},
                       "required": [parameter]}}}]
    traj = jax.device_get(rollout_lib.scripted_rollout(
        env, jax.random.key(3), num_tasks=3, group_size=1, action_source="oracle"))
    checked = 0
    for b in range(3):
        tokens = traj.tokens[b].tolist()
        starts = [int(traj.turn_starts[b, t]) for t in range(int(traj.num_turns[b]))]
        prompt = tokens[len(chat.prompt_prefix):starts[0] - len(chat.turn_suffix)]
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": tokenizer.decode(prompt)}]
        for t, start in enumerate(starts):
            assert tokens[:start] == _ids(tokenizer, messages, tools=tools,
                                          add_generation_prompt=True,
                                          chat_template=chat.history_template, **kwargs), (b, t)
            checked += 1
            end = start + int(np.argmin(traj.agent_mask[b, start:] > 0))
            text = tokenizer.decode(tokens[start:end - 1])
            call = env.call_syntax.parse(text)
            if t == 0:
                messages.append(call_message("", [call]))
            else:
                messages.append({"role": "assistant", "content": text})
            reply = end + len(chat.reply_prefix)
            reply_end = reply
            while traj.observation_mask[b, reply_end] > 0 and tokens[
                    reply_end:reply_end + len(chat.reply_suffix)] != list(chat.reply_suffix):
                reply_end += 1
            messages.append({"role": "tool", "content": tokenizer.decode(
                tokens[reply:reply_end])})
        assert messages[-1]["content"] == "correct"
    assert checked == 6


def test_a_template_without_a_keep_history_variant_is_refused_in_one_line(standins, jsonl,
                                                                          tmp_path):
    directory = copy_with_template(standins("qwen3"), str(tmp_path / "qwen3_other"),
                              _without_variant(hf_standins.QWEN3_TEMPLATE))
    codec = HFCodec.from_pretrained(directory)
    assert "arl derives no keep-history variant" in codec.chat.multi_turn_error
    DatasetTask(jsonl, codec=codec, max_turns=1)
    env = DatasetTask(jsonl, codec=codec, max_turns=2)
    with pytest.raises(chat_template.ChatTemplateError) as error:
        rollout_lib.scripted_rollout(env, jax.random.key(0), num_tasks=2, group_size=1,
                                     action_source="demonstrator")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("env 'dataset_task' has max_turns=2, but the chat template "
                              "rewrites earlier assistant turns")
    assert message.endswith("with rollout.history='as_generated' (and 'per_turn', whose env "
                            "is built the same way) only one-turn episodes read what the "
                            "template renders: set max_turns=1")
    config = ml_collections.ConfigDict(dict(model=dict(hf_checkpoint=directory,
                                                       system_prompt="")))
    with pytest.raises(ConfigError, match="max_turns=2, but the chat template"):
        from_config.make_env(dict(name="dataset_task", kwargs=dict(path=jsonl, max_turns=2)),
                             from_config.checkpoint_codec(config))


def test_templates_that_keep_history_need_no_variant(standins):
    for name in ("qwen2", "llama3.1"):
        chat = HFCodec.from_pretrained(standins(name)).chat
        assert chat.multi_turn_error is None and chat.history_template is None


def test_history_key_is_checked_in_one_line():
    import arl

    config = arl.default_config()
    assert config.rollout.history == "as_generated"
    arl.validate(config)
    config.rollout.history = "per_turns"
    with pytest.raises(ConfigError) as error:
        arl.validate(config)
    assert str(error.value) == ("config.rollout.history='per_turns' is invalid: allowed values "
                                "are ('as_generated', 'per_turn').")
