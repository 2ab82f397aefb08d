"""History mode "per turn" (`arl.rollout.per_turn`, `arl.trainers.per_turn`): before every
turn the context is exactly `transformers`' `apply_chat_template` of the conversation so
far (Qwen3 thinking on and off, Qwen2.5, Llama 3.1 stand-ins with real merges; an
in-graph env and a host env whose replies merge with the template's text; tool envs
with `tools=...`, their calls as structured `tool_calls` and one `tool` message per
result: a user's two-tool env with two calls in one turn, sql, code_interpreter, and
calculator and sql in their own tags); a history window's context is
`apply_chat_template` of the kept messages; each turn takes its episode's advantage
(NumPy reference); the config keys are checked in one line; every family trains every
env (guess_number, countdown, calculator, sql, code_interpreter, the two-tool env) in
both history modes through the CLI (two runs in the default suite, 46 with -m slow)."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from arl import algorithm_table  # noqa: E402
from arl.envs import from_config  # noqa: E402
from arl.envs.host import HostEnvironment, HostTurn  # noqa: E402
from arl.envs.tasks.guess_number import GuessNumber  # noqa: E402
from arl.errors import ConfigError  # noqa: E402
from arl.rollout import per_turn  # noqa: E402
from arl.text.chat_template import env_chat_format  # noqa: E402
from arl.text.hf_codec import HFCodec  # noqa: E402
from arl.text.render_turns import HistoryWindow, TurnRenderer  # noqa: E402
from arl.trainers.per_turn import turn_advantages, turn_sample_gae  # noqa: E402
from tests import hf_standins  # noqa: E402
from tests.tool_templates import QWEN3_TOOLS_TEMPLATE, call_message, copy_with_template  # noqa: E402
from tests.tool_user_envs import Warehouse  # noqa: E402  (registers "warehouse")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = "Be brief."
OFF = {"enable_thinking": False}
TASK = "Add 12 and 30 (then -7)."
# What the policy writes (think blocks a template drops later, spaces it trims, signs)
# and what the env replies (endings a BPE merges with the template's next text).
ANSWERS = ("<think>\nAdd: 12 + 30 = 42.\n</think>\n\n42", "  41 ", "<think>x</think>-7.",
           "40")
REPLIES = ("wrong: -162.", "no (no rows)", 'say "yes."', "lower")
FAMILIES = [("qwen3", {}), ("qwen3", OFF), ("qwen2", {}), ("llama3.1", {})]


class ScriptedConversation(HostEnvironment):
    """A host env whose prompt is TASK and whose turn k replies REPLIES[k]; its oracle
    writes ANSWERS[k]."""

    name = "scripted_conversation"

    def __init__(self, codec, max_turns=4):
        self.codec, self.max_turns = codec, max_turns
        self.prompt_len, self.obs_len, self.action_len = 24, 16, 40

    def default_params(self):
        return {"unused": jnp.zeros((), jnp.float32)}

    def reward_bounds(self, params):
        return jnp.zeros(()), jnp.ones(())

    def make_task(self, seed, params):
        return seed

    def prompt(self, task, params):
        return TASK

    def host_step(self, episode, action):
        return HostTurn(reply=REPLIES[episode.turn], reward=float(episode.turn == 1),
                        terminated=episode.turn == self.max_turns - 1)

    def host_oracle(self, episode):
        return ANSWERS[episode.turn]


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    root = tmp_path_factory.mktemp("per_turn")

    @functools.lru_cache(maxsize=None)
    def build(name):
        return hf_standins.build_standin(str(root / name.replace(".", "_")), name)
    return build


@functools.lru_cache(maxsize=None)
def _tokenizer(directory):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(directory)


def _reference(directory, messages, kwargs):
    ids = _tokenizer(directory).apply_chat_template(messages, tokenize=True,
                                                    add_generation_prompt=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _check_contexts(directory, kwargs, samples, task_of, reply_of, answer_of):
    """Every played turn's context equals apply_chat_template of the conversation so
    far (texts from the test's own sources); returns the turns checked."""
    checked = 0
    for b in range(samples.tokens.shape[0]):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": task_of(b)}]
        for k in range(int(samples.num_turns[b])):
            assert samples.active[b, k]
            start = int(samples.context_length[b, k])
            assert samples.tokens[b, k, :start].tolist() == _reference(
                directory, messages, kwargs), (b, k)
            checked += 1
            messages += [{"role": "assistant", "content": answer_of(b, k)},
                         {"role": "user", "content": reply_of(b, k)}]
    return checked


@pytest.mark.parametrize("family,kwargs", FAMILIES[:1] + [
    pytest.param(*f, marks=pytest.mark.slow) for f in FAMILIES[1:]])
def test_every_context_is_apply_chat_template_of_the_conversation(standin, family, kwargs):
    directory = standin(family)
    codec = HFCodec.from_pretrained(directory, system_prompt=SYSTEM, template_kwargs=kwargs)
    tokenizer = _tokenizer(directory)
    # A host env: the template's text around the env's text, replies that merge with it.
    env = ScriptedConversation(codec)
    samples = jax.device_get(per_turn.per_turn_rollout(
        env, jax.random.key(0), num_tasks=1, group_size=2, action_source="oracle"))
    assert _check_contexts(directory, kwargs, samples, lambda b: TASK,
                           lambda b, k: REPLIES[k], lambda b, k: ANSWERS[k]) == 8
    np.testing.assert_allclose(samples.episode_return, [1.0, 1.0])
    if family == "qwen3":  # earlier turns' reasoning is dropped, the latest is read
        last = codec.decode(samples.tokens[0, 3, :samples.context_length[0, 3]])
        assert "Add: 12" not in last and "-7." in last
    # An in-graph env (replies written inside jit), the policy's turns as written.
    env = GuessNumber(codec=codec, max_n=100, max_turns=4)
    samples = jax.device_get(per_turn.per_turn_rollout(
        env, jax.random.key(1), num_tasks=2, group_size=2, action_source="demonstrator"))
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)

    def answer(b, k):
        start, end = int(samples.context_length[b, k]), int(samples.length[b, k])
        ids = samples.tokens[b, k, start:end].tolist()
        assert ids[-1] == codec.eot_id
        return decode(ids[:-1])

    checked = _check_contexts(
        directory, kwargs, samples,
        lambda b: decode(samples.prompt[b, :samples.prompt_length[b]]),
        lambda b, k: decode(samples.replies[b, k, :samples.reply_length[b, k]]), answer)
    assert checked == int(samples.num_turns.sum()) >= 6


@pytest.mark.parametrize("family,kwargs", [FAMILIES[0], pytest.param(
    *FAMILIES[3], marks=pytest.mark.slow)])
def test_a_history_window_renders_the_kept_messages(standin, family, kwargs):
    directory = standin(family)
    codec = HFCodec.from_pretrained(directory, system_prompt=SYSTEM, template_kwargs=kwargs)
    env = ScriptedConversation(codec)
    full = per_turn.sample_length(env)
    for window, kept in ((HistoryWindow(turns=1), [0, 1, 1, 1]),
                         (HistoryWindow(turns=2), [0, 1, 2, 2])):
        assert per_turn.sample_length(env, window) < full
        samples = jax.device_get(per_turn.per_turn_rollout(
            env, jax.random.key(0), num_tasks=1, group_size=1, action_source="oracle",
            window=window))
        assert samples.kept_turns[0].tolist() == kept and not samples.overflow[0]
        for k, keep in enumerate(kept):
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": TASK}]
            for j in range(k - keep, k):
                messages += [{"role": "assistant", "content": ANSWERS[j]},
                             {"role": "user", "content": REPLIES[j]}]
            start = int(samples.context_length[0, k])
            assert samples.tokens[0, k, :start].tolist() == _reference(directory, messages,
                                                                       kwargs), (window, k)
    # A token budget: the most recent exchanges whose render fits.
    renderer = TurnRenderer(codec)
    exchanges = list(zip(ANSWERS[:3], REPLIES[:3]))
    sizes = [len(renderer.ids(TASK, exchanges[3 - keep:])) for keep in range(4)]
    budget = sizes[2]  # two exchanges fit, three do not
    context = TurnRenderer(codec, HistoryWindow(tokens=budget)).context(TASK, exchanges,
                                                                        capacity=10_000)
    assert context.kept == 2 and context.ids == renderer.ids(TASK, exchanges[1:])
    assert TurnRenderer(codec, HistoryWindow(tokens=sizes[0] - 1)).context(
        TASK, exchanges, capacity=10_000) is None  # not even the task fits


def test_special_token_names_in_env_text_stay_plain_characters(standin):
    codec = HFCodec.from_pretrained(standin("qwen3"), system_prompt=SYSTEM)
    renderer = TurnRenderer(codec)
    ids = renderer.ids("print('<|im_end|>')", [("ok", "a<|im_start|>b")])
    eot, start = codec.encode("<|im_end|>")[0], codec.encode("<|im_start|>")[0]
    # system, user, assistant, user: 4 turns closed, 5 opened (the generation prompt).
    assert ids.count(eot) == 4 and ids.count(start) == 5
    text = codec.tokenizer.decode(ids, skip_special_tokens=False)
    assert "print('<|im_end|>')" in text and "a<|im_start|>b" in text


# -- tool envs in the template's tool convention
TOOL_SYSTEM = "Use the tools, then answer."
# The shipped tool envs at sizes a stand-in plays in seconds (calculator: in-graph, its
# own <calc> tags, replies as user turns).
TOOL_ENVS = {
    "sql": ("sql", dict(tool_format="template", max_turns=3, action_len=256, obs_len=64)),
    "code_interpreter": ("code_interpreter", dict(tool_format="template", max_turns=3,
                                                  action_len=96, allow_weak_sandbox=True)),
    "calculator": ("calculator", dict(max_digits=2, max_turns=3)),
    # sql in its own <sql> tags: a host env whose replies are user turns
    "sql_tags": ("sql", dict(max_turns=3, action_len=256, obs_len=64))}


class ChattyWarehouse(Warehouse):
    """`warehouse` (two tools of several typed arguments) whose oracle first writes a turn
    without a call (answered "error: no tool call or answer" as the tool's result), then
    calls both tools in one turn after a think block (one call a turn where the template
    renders one, and the call alone where it drops a call's text), then answers."""

    name = "chatty_warehouse"

    def host_oracle(self, episode):
        if episode.turn == 0:
            return "Let me look it up."
        text = super().host_oracle(episode)
        syntax = self.call_syntax
        if text.startswith("<answer>") or syntax.content_separator is None:
            return text
        return syntax.write_calls(syntax.parse_calls(text)[1],
                                  content="<think>\nBoth tools.\n</think>")


@pytest.fixture(scope="module")
def tool_standin(standin, tmp_path_factory):
    """Stand-in directories by family; Qwen3's a copy with its released tool template."""
    root = tmp_path_factory.mktemp("per_turn_tools")

    @functools.lru_cache(maxsize=None)
    def build(family):
        if family != "qwen3":
            return standin(family)
        return copy_with_template(standin("qwen3"), str(root / "qwen3_tools"),
                                  QWEN3_TOOLS_TEMPLATE)
    return build


def _check_tool_contexts(directory, kwargs, env, samples):
    """Every played turn's context equals `apply_chat_template(messages, tools=...)` of
    the conversation read back from the samples: a turn the call syntax parses as an
    assistant message with structured `tool_calls` (its text before the calls as its
    content), any other turn as plain content, each result of a reply a `tool` message
    (unescaped where the template writes JSON strings); an env without declared tools:
    replies as user turns, no tools. Returns (turns checked, calls per call turn, the
    tool results)."""
    tokenizer = _tokenizer(directory)
    chat = env_chat_format(env)
    syntax = getattr(env, "call_syntax", None)
    tools = env.tool_schemas if syntax is not None else None
    decode = lambda ids: tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
    inside = lambda text, around: text[len(around[0]):len(text) - len(around[1])]
    checked, calls_per_turn, results_seen = 0, [], []
    for b in range(samples.tokens.shape[0]):
        task = inside(decode(samples.prompt[b, :samples.prompt_length[b]]), chat.prompt_around)
        messages = [{"role": "system", "content": TOOL_SYSTEM},
                    {"role": "user", "content": task}]
        for k in range(int(samples.num_turns[b])):
            assert samples.active[b, k]
            start, end = int(samples.context_length[b, k]), int(samples.length[b, k])
            expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                                     add_generation_prompt=True, **kwargs)
            expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
            assert samples.tokens[b, k, :start].tolist() == expected, (b, k)
            checked += 1
            turn = samples.tokens[b, k, start:end].tolist()
            assert turn[-1] == env.codec.eot_id
            text = decode(turn[:-1])
            reply = inside(decode(samples.replies[b, k, :samples.reply_length[b, k]]),
                           chat.reply_around)
            if syntax is None:
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": reply}]
                continue
            parsed = syntax.parse_calls(text)
            if isinstance(parsed, str):
                messages.append({"role": "assistant", "content": text})
                results = [reply]
            else:
                content, calls = parsed
                calls_per_turn.append(len(calls))
                messages.append(call_message(content, calls))
                results = reply.split(syntax.result_separator) if len(calls) > 1 else [reply]
                assert len(results) == len(calls)
            if syntax.results_as_json:
                results = [json.loads(f'"{r}"') for r in results]
            messages += [{"role": "tool", "content": r} for r in results]
            results_seen += results
    return checked, calls_per_turn, results_seen


@pytest.mark.parametrize("family,kwargs", [FAMILIES[2]] + [
    pytest.param(*f, marks=pytest.mark.slow) for f in (FAMILIES[0], FAMILIES[1], FAMILIES[3])])
def test_tool_calls_render_as_the_template_renders_tool_use(tool_standin, family, kwargs):
    """A user's env with two tools: a turn without a call, two calls in one turn after a
    think block (Llama 3.1: one call a turn, the call alone), the answer; every context
    is the template's render with the tools, and the tools' counts reach the samples."""
    directory = tool_standin(family)
    codec = HFCodec.from_pretrained(directory, system_prompt=TOOL_SYSTEM,
                                    template_kwargs=kwargs)
    env = ChattyWarehouse(codec=codec, max_turns=4)
    assert per_turn.per_turn_error(env) is None
    several = family != "llama3.1"
    assert env.call_syntax.several_calls == several
    samples = jax.device_get(per_turn.per_turn_rollout(
        env, jax.random.key(0), num_tasks=2, group_size=1, action_source="oracle"))
    checked, calls, results = _check_tool_contexts(directory, kwargs, env, samples)
    assert checked == (6 if several else 8)
    assert calls == ([2, 2] if several else [1, 1, 1, 1])
    assert samples.success.all() and not samples.overflow.any()
    assert results[0] == "error: no tool call or answer" and results[-1] == "correct"
    assert sum(r.isdigit() for r in results) == 4, results
    np.testing.assert_allclose(samples.episode_stats["tools/calls_mean"], [2.0, 2.0])
    if several:  # the think block of the call turn is read back in the next context
        context = codec.decode(samples.tokens[0, 2, :samples.context_length[0, 2]])
        assert "Both tools." in context
        assert '</tool_call>\n<tool_call>\n{"name": "price", "arguments": {"item": ' in context
    # A window of one exchange keeps the latest call turn and all its tool messages.
    syntax = env.call_syntax
    calls = [("stock", {"item": "widget", "warehouse": 2}),
             ("price", {"item": "widget", "quantity": 3, "currency": "EUR"})][:2 if several
                                                                               else 1]
    results = ["112", "7"][:len(calls)]
    exchanges = [("Let me look it up.", syntax.result_texts(["error: no tool call"])),
                 (syntax.write_calls(calls), syntax.result_texts(results))]
    context = TurnRenderer(codec, HistoryWindow(turns=1), tools=env.tool_schemas,
                           call_syntax=syntax).context(TASK, exchanges, capacity=10_000)
    messages = [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": TASK},
                call_message("", calls)] + [{"role": "tool", "content": r} for r in results]
    assert context.kept == 1
    assert context.ids == _reference(directory, messages, dict(kwargs, tools=env.tool_schemas))


@pytest.mark.parametrize("env_name,family,kwargs", [("sql", *FAMILIES[3])] + [
    pytest.param(env_name, *f, marks=pytest.mark.slow)
    for env_name in TOOL_ENVS for f in FAMILIES if (env_name, f[0]) != ("sql", "llama3.1")])
def test_tool_env_contexts_are_apply_chat_template_with_tools(tool_standin, env_name,
                                                             family, kwargs):
    """sql and code_interpreter (a call, then the answer; Llama 3.1's results JSON
    strings), and calculator and sql in their own tags (replies as user turns), per turn."""
    directory = tool_standin(family)
    codec = HFCodec.from_pretrained(directory, system_prompt=TOOL_SYSTEM,
                                    template_kwargs=kwargs)
    name, env_kwargs = TOOL_ENVS[env_name]
    env = from_config.make_env(dict(name=name, kwargs=env_kwargs), codec)
    samples = jax.device_get(per_turn.per_turn_rollout(
        env, jax.random.key(3), num_tasks=2, group_size=1, action_source="oracle"))
    checked, calls, results = _check_tool_contexts(directory, kwargs, env, samples)
    assert checked == int(samples.num_turns.sum()) == 4
    assert samples.success.all() and not samples.overflow.any()
    if env_name in ("sql", "code_interpreter"):
        assert calls == [1, 1] and results[1::2] == ["correct", "correct"]
    else:
        assert getattr(env, "call_syntax", None) is None and (calls, results) == ([], [])
    if env_name == "sql":  # a column header: a newline in the result (escaped by Llama)
        assert all("\n" in r for r in results[::2]), results


@pytest.mark.parametrize("family", ["qwen2", "llama3.1"])
def test_a_turn_and_its_reply_read_back_as_the_messages_a_template_takes(tool_standin,
                                                                        family):
    """`ToolCallSyntax.assistant_message` / `split_results`, the inverses of what the env
    writes: calls (with their text where the template keeps it) as structured
    `tool_calls`, a turn that does not parse as plain content, a reply as its results
    (Llama 3.1's JSON-escaped ones unescaped)."""
    codec = HFCodec.from_pretrained(tool_standin(family), system_prompt=TOOL_SYSTEM)
    env = Warehouse(codec=codec, obs_len=96)
    syntax = env.call_syntax
    stock = ("stock", {"item": "widget", "warehouse": 2})
    price = ("price", {"item": "widget", "quantity": 3, "currency": "EUR", "gift_wrap": True})
    broken = '<tool_call>\n{"name": "stock", "arguments": {"item": "widget"' if \
        family == "qwen2" else '{"name": "stock", "parameters": {"item": '
    assert syntax.assistant_message(broken) == {"role": "assistant", "content": broken}
    assert syntax.assistant_message("<answer>7;30</answer>") == {
        "role": "assistant", "content": "<answer>7;30</answer>"}
    results = ["112", 'error: KeyError: "no \'x\'"\nthen\ta tab']
    if family == "qwen2":
        text = syntax.write_calls([stock, price], content="Both.")
        assert syntax.assistant_message(text) == call_message("Both.", [stock, price])
        reply = env.fit_reply(results)
        assert syntax.split_results(reply, 2) == results
        assert syntax.split_results(reply, 1) == [reply]  # one error for too many calls
    else:  # one call a turn, alone; results written as JSON strings
        assert syntax.assistant_message(syntax.write_calls([stock])) == call_message(
            "", [stock])
        reply = env.fit_reply(results[1:])
        assert reply != results[1] and syntax.split_results(reply, 1) == results[1:]
        assert syntax.split_results('a "b', 1) == ['a "b']  # not escaped: kept as written


def test_replies_in_a_role_it_cannot_render_are_refused_in_one_line(standin):
    """Tool-role replies without a call syntax to read the turns' calls with."""
    import dataclasses

    codec = HFCodec.from_pretrained(standin("qwen3"), system_prompt=SYSTEM)
    env = ScriptedConversation(codec)
    assert per_turn.per_turn_error(env) is None
    env.chat = dataclasses.replace(codec.chat, reply_role="tool")
    with pytest.raises(ValueError, match=r"^env 'scripted_conversation' cannot be played "
                       r"with rollout.history='per_turn': its replies are 'tool' messages, "
                       r"and per-turn contexts render replies as user turns, or as tool "
                       r"results of a ToolCallingEnvironment's declared tools \(`call_syntax`, "
                       r"`tool_schemas`\)$"):
        per_turn.per_turn_rollout(env, jax.random.key(0), num_tasks=1, group_size=1,
                                  action_source="oracle")


def _grpo_reference(returns, group_size, eps=1e-6):
    groups = returns.reshape(-1, group_size)
    mean, std = groups.mean(axis=1, keepdims=True), groups.std(axis=1, ddof=1, keepdims=True)
    return ((groups - mean) / (std + eps)).reshape(-1)


def test_each_turn_takes_its_episodes_advantage():
    rng = np.random.default_rng(0)
    batch, turns, length, group = 6, 3, 7, 3
    returns = rng.normal(size=batch).astype(np.float32)
    mask = (rng.random((batch, turns, length)) < 0.4).astype(np.float32)
    mask[1, 2] = 0  # an unplayed turn
    grpo = algorithm_table.get_algorithm("grpo")
    import arl
    outcome = algorithm_table.OutcomeBatch(
        scores=jnp.asarray(returns), group_ids=jnp.repeat(jnp.arange(2), group),
        env_ids=jnp.zeros(batch, jnp.int32), valid=jnp.ones(batch, bool), num_groups=2,
        num_envs=1)
    episode = np.asarray(grpo.outcome_advantages(outcome, arl.default_config().advantage))
    reference = _grpo_reference(returns, group)
    np.testing.assert_allclose(episode, reference, rtol=1e-4, atol=1e-5)
    got = np.asarray(jax.jit(turn_advantages)(jnp.asarray(episode), jnp.asarray(mask)))
    expected = np.einsum("b,bkl->bkl", reference, mask)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert np.all(got[1, 2] == 0)
    # Rows of the update batch: episode-major, turn k of episode b at row b*K + k.
    rows = got.reshape(batch * turns, length)
    np.testing.assert_allclose(rows[4 * turns + 1], reference[4] * mask[4, 1], rtol=1e-4)


def test_gae_runs_over_the_episodes_turns_with_each_tokens_value_from_its_sample():
    rng = np.random.default_rng(1)
    batch, turns, length, action_len, gamma, lam = 3, 3, 12, 4, 0.9, 0.8
    context = rng.integers(1, length - action_len, size=(batch, turns))
    played = rng.integers(0, action_len + 1, size=(batch, turns))
    played[0] = [2, 4, 1]
    played[2, 2] = 0  # a turn not played
    values = rng.normal(size=(batch, turns, length)).astype(np.float32)
    turn_rewards = rng.normal(size=(batch, turns)).astype(np.float32)
    advantages, returns = jax.jit(functools.partial(
        turn_sample_gae, action_len=action_len, gamma=gamma, lam=lam))(
        jnp.asarray(turn_rewards), jnp.asarray(values), jnp.asarray(context),
        jnp.asarray(context + played))
    expected_adv = np.zeros((batch, turns, length), np.float32)
    expected_ret = np.zeros((batch, turns, length), np.float32)
    for b in range(batch):
        # The episode's agent tokens in order: (turn, position, V before it, reward).
        tokens = [(k, context[b, k] + j, values[b, k, context[b, k] + j - 1],
                   turn_rewards[b, k] if j == played[b, k] - 1 else 0.0)
                  for k in range(turns) for j in range(played[b, k])]
        next_value, next_adv = 0.0, 0.0
        for k, position, value, reward in reversed(tokens):
            adv = reward + gamma * next_value - value + gamma * lam * next_adv
            expected_adv[b, k, position], expected_ret[b, k, position] = adv, adv + value
            next_value, next_adv = value, adv
    np.testing.assert_allclose(np.asarray(advantages), expected_adv, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(returns), expected_ret, rtol=1e-4, atol=1e-5)


def test_per_turn_keys_are_checked_in_one_line():
    import arl

    def error(**changes):
        config = arl.default_config()
        config.model.hf_checkpoint = ""
        for key, value in changes.items():
            section, field = key.split("__")
            config[section][field] = value
        with pytest.raises(ConfigError) as caught:
            arl.validate(config)
        message = str(caught.value)
        assert "\n" not in message
        return message

    assert error(rollout__history="per_turns") == (
        "config.rollout.history='per_turns' is invalid: allowed values are "
        "('as_generated', 'per_turn').")
    assert error(rollout__history_window_turns=2).startswith(
        "config.rollout.history_window_turns=2 is invalid: a history window needs "
        "rollout.history='per_turn'")
    assert error(rollout__history="per_turn").endswith("set model.hf_checkpoint.")
    config = arl.default_config()
    config.algorithm, config.rollout.history = "vineppo", "per_turn"
    config.process.mc_samples = 2
    with pytest.raises(ConfigError, match=r"^config.rollout.history='per_turn' is invalid: "
                       r"per_turn trains outcome-credit algorithms .* has credit "
                       r"'monte_carlo'"):
        arl.validate(config)
    config = arl.default_config()
    config.model.hf_checkpoint = _ROOT  # any directory: checked later
    config.rollout.history, config.loss.echo_coef = "per_turn", 0.1
    with pytest.raises(ConfigError, match=r"^config.loss.echo_coef=0.1 is invalid: not "
                       r"available with rollout.history='per_turn'"):
        from arl.config import history
        history.validate(config, algorithm_table.get_algorithm("grpo"))
    config = arl.default_config()
    config.rollout.history, config.rollout.history_window_tokens = "per_turn", -1
    with pytest.raises(ConfigError, match="history_window_tokens=-1 is invalid: must be >= 0"):
        arl.validate(config)


CONFIG = textwrap.dedent('''
    """A tiny run of a stand-in checkpoint: argument
    "DIR|ENV|ENV_KWARGS_JSON|TEMPLATE_KWARGS_JSON|HISTORY"."""
    import json

    import ml_collections

    from configs import grpo_hf_checkpoint


    def get_config(argument=""):
        directory, env, env_kwargs, template_kwargs, history = argument.split("|")
        c = grpo_hf_checkpoint.get_config(directory)
        c.imports = ("tests.tool_user_envs",)  # registers "warehouse"
        c.model.system_prompt = "Be brief."
        c.model.dtype = c.model.param_dtype = "float32"
        c.model.remat = False
        c.model.logprob_chunk = 0
        c.env.name = env
        c.env.kwargs = ml_collections.ConfigDict(json.loads(env_kwargs))
        c.model.chat_template_kwargs = ml_collections.ConfigDict(json.loads(template_kwargs))
        c.rollout.num_tasks = 2
        c.rollout.group_size = 2
        c.rollout.history = history
        c.filters.skip_zero_advantage = False  # the update runs: its ratio is checked
        c.train_steps = 1
        c.log_every = 1
        c.sample_every = 1
        return c
''')


def _train_through_the_cli(directory, tmp_path, template_kwargs=None, env="guess_number",
                    env_kwargs=dict(max_n=16, max_turns=3), history="per_turn"):
    """The last metrics record of a one-step CLI run (and the step's sample text)."""
    config = tmp_path / "per_turn_config.py"
    config.write_text(CONFIG)
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train",
         f"--config={config}:{directory}|{env}|{json.dumps(env_kwargs)}|"
         f"{json.dumps(template_kwargs or {})}|{history}", f"--workdir={workdir}"],
        cwd=_ROOT, env={**os.environ, "PYTHONPATH": _ROOT}, capture_output=True, text=True,
        timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in lines if "loss/total" in m]
    assert metrics and np.isfinite(metrics[-1]["loss/total"])
    if history == "per_turn":
        assert metrics[-1]["per_turn/samples"] >= 4
    # The update scores each turn sample as the rollout sampled it: the ratio is 1.
    assert metrics[-1]["update_skipped"] == 0.0
    assert abs(metrics[-1]["policy/ratio_mean"] - 1.0) < 1e-4, metrics[-1]
    return metrics[-1], (workdir / "samples" / "step_000001.txt").read_text()




@pytest.mark.slow
def test_ppo_trains_per_turn_with_turn_level_gae_and_a_window(standin):
    import arl
    from configs import grpo_hf_checkpoint

    c = grpo_hf_checkpoint.get_config(standin("qwen3"))
    c.algorithm, c.advantage.turn_level = "ppo", True
    c.model.system_prompt = SYSTEM
    c.model.dtype = c.model.param_dtype = "float32"
    c.model.remat, c.model.logprob_chunk = False, 0
    c.env.name, c.env.kwargs = "guess_number", dict(max_n=16, max_turns=3)
    c.rollout.num_tasks, c.rollout.group_size, c.rollout.history = 2, 2, "per_turn"
    c.rollout.history_window_turns = 1  # and a window: turn 3 reads the task and turn 2
    trainer = arl.build(c)
    assert trainer.sample_length < trainer.context_length
    state, metrics = trainer.train_step(trainer.init_state())
    metrics = jax.device_get(metrics)
    assert metrics["update_skipped"] == 0 and metrics["per_turn/samples"] == 12
    # Turn 3 leaves turn 1 out at least (more where re-encoding the untrained policy's
    # bytes lengthened turn 2 past the window's room: the window then keeps less).
    assert 1 / 3 - 1e-6 <= metrics["per_turn/dropped_turns_mean"] <= 1.0
    assert metrics["per_turn/context_overflow_rate"] == 0
    assert abs(metrics["policy/ratio_mean"] - 1.0) < 1e-4
    assert np.isfinite(metrics["loss/value"]) and metrics["loss/value"] > 0


# Every family x env x history mode through the CLI, one step each: the multi-turn
# games, the shipped tool envs and a user's two-tool env (template tool calls).
MATRIX_ENVS = {
    "guess_number": dict(max_n=16, max_turns=3),
    "countdown": dict(max_numbers=3, max_number=9, max_target=99, max_turns=2),
    "calculator": dict(max_digits=1, max_turns=3),
    "sql": dict(tool_format="template", max_turns=2, obs_len=32, action_len=64),
    "code_interpreter": dict(tool_format="template", max_turns=2, obs_len=24,
                             action_len=48, allow_weak_sandbox=True),
    "warehouse": dict(max_turns=2, obs_len=32, action_len=64)}
TOOL_NAMES = {"sql": "run_sql", "code_interpreter": "run_python", "warehouse": "stock"}
HISTORIES = ("as_generated", "per_turn")
MATRIX_DEFAULT = [("qwen3", {}, "guess_number", "per_turn"), ("qwen2", {}, "warehouse", "per_turn")]
MATRIX = [(family, kwargs, env, history) for family, kwargs in FAMILIES
          for env in MATRIX_ENVS for history in HISTORIES]


def _case_id(family, kwargs, env, history):
    return f"{family}{'-thinking_off' if kwargs else ''}-{env}-{history}"


def _evaluates_per_turn(workdir):
    """`experiments.evaluate` on a per-turn run: the policy, the demonstrator and the
    oracle played per turn (the transcripts are `render_samples`' last-turn contexts,
    which an as-generated evaluation does not print) in one table."""
    result = subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", f"--workdir={workdir}",
         "--num_tasks=4", "--num_transcripts=1"],
        cwd=_ROOT, env={**os.environ, "PYTHONPATH": _ROOT}, capture_output=True, text=True,
        timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "Checkpoint step 1 of" in out and "4 tasks per policy" in out, out
    assert "[context of turn " in out and "--- sampled transcript 0 ---" in out, out
    assert "greedy" in out and "sampled" in out, out


@pytest.mark.parametrize("family,kwargs,env,history", [
    pytest.param(*case, id=_case_id(*case)) for case in MATRIX_DEFAULT] + [
    pytest.param(*case, id=_case_id(*case), marks=pytest.mark.slow) for case in MATRIX
    if case not in MATRIX_DEFAULT])
def test_families_train_every_env_in_both_history_modes_through_the_cli(
        standin, tool_standin, tmp_path, family, kwargs, env, history):
    """Qwen2.5, Qwen3 (thinking on and off) and Llama 3.1 stand-ins train one step through
    the CLI on guess_number, countdown, calculator, sql, code_interpreter and `warehouse`
    in both history modes (48 runs, 9-54 s each, 17.5 min in all on two shared CPU cores:
    the default suite runs two, the rest run with -m slow). Tool envs declare their tools
    to the template (the sample shows them) and log the tools' counts in either mode,
    training and evaluation. A per-turn run's checkpoint is evaluated per turn by
    `experiments.evaluate` (its transcripts show the last turn's rendered context)."""
    tools = env in TOOL_NAMES
    directory = tool_standin(family) if tools else standin(family)
    record, sample = _train_through_the_cli(directory, tmp_path, kwargs, env,
                                            MATRIX_ENVS[env], history)
    if history == "per_turn":
        _evaluates_per_turn(tmp_path / "run")
    if tools:
        assert f'"name": "{TOOL_NAMES[env]}"' in sample
        assert record["tools/calls_mean"] >= 0.0 and record["tools/invalid_calls_mean"] >= 0.0
        assert record["eval/tools/invalid_call_cap_episodes"] <= 1.0  # the evaluation's too


@pytest.mark.slow
def test_a_sharded_per_turn_step_equals_one_device(standin):
    """Per-turn GRPO on a 2x2x2 mesh (batch over data and FSDP, parameters over FSDP and
    tensor) gives one device's metrics and parameters after two steps: the host renders
    each context from rows gathered across the devices and the prefills, samples and
    update run sharded. Tolerances as tests/test_train.py's sharded step."""
    import arl
    from configs import grpo_hf_checkpoint

    def two_steps(mesh):
        c = grpo_hf_checkpoint.get_config(standin("qwen2"))
        c.model.system_prompt = SYSTEM
        c.model.dtype = c.model.param_dtype = "float32"
        c.model.remat, c.model.logprob_chunk = False, 0
        c.env.name, c.env.kwargs = "guess_number", dict(max_n=16, max_turns=2)
        c.rollout.num_tasks, c.rollout.group_size, c.rollout.history = 4, 2, "per_turn"
        c.filters.skip_zero_advantage = False
        c.mesh = mesh
        trainer = arl.build(c)
        state, history = trainer.init_state(), []
        devices = {len(x.sharding.device_set) for x in jax.tree.leaves(state.params)}
        assert devices == {math.prod(mesh)}, devices  # the state lives on the whole mesh
        for _ in range(2):
            state, metrics = trainer.train_step(state)
            history.append(jax.device_get(metrics))
        return jax.device_get(trainer.policy_params(state)), history

    params, single = two_steps((1, 1, 1))
    sharded_params, sharded = two_steps((2, 2, 2))
    assert single[0]["per_turn/samples"] >= 8
    for got, want in zip(sharded, single):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)
    for got, want in zip(jax.tree.leaves(sharded_params), jax.tree.leaves(params)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_warm_start_clones_the_oracle_per_turn_with_two_calls_in_a_turn(tool_standin):
    """`warm_start.sft_steps` in per-turn mode: the demonstrations are the per-turn samples
    of the oracle (every turn its own context, rendered with the tools), among them the
    warehouse oracle's turn of two calls, and cloning them lowers their loss."""
    import arl
    from arl.trainers import warm_start as warm_start_lib
    from configs import grpo_hf_checkpoint

    c = grpo_hf_checkpoint.get_config(tool_standin("qwen2"))
    c.imports = ("tests.tool_user_envs",)
    c.model.system_prompt = SYSTEM
    c.model.dtype = c.model.param_dtype = "float32"
    c.model.remat, c.model.logprob_chunk = False, 0
    c.env.name, c.env.kwargs = "warehouse", dict(max_turns=3)  # room for two calls
    c.rollout.num_tasks, c.rollout.group_size, c.rollout.history = 2, 2, "per_turn"
    c.warm_start.sft_steps, c.warm_start.sft_batch, c.warm_start.sft_lr = 20, 4, 3e-3
    c.warm_start.sft_source = "oracle"
    trainer = arl.build(c)
    tokens, mask = jax.device_get(trainer.scripted_demonstrations(
        jax.random.key(0), 4, "oracle", trainer.task_params(4, 1)))
    assert tokens.shape == (4 * trainer.turns, trainer.sample_length) == mask.shape
    codec = trainer.env.codec
    turns = [codec.decode(row[m.astype(bool)], stop_at_pad=False)
             for row, m in zip(tokens, mask) if m.any()]
    assert any(turn.count("<tool_call>") == 2 for turn in turns), turns
    # A turn after the first reads the tools' results as tool messages of its context.
    later = [codec.decode(row, stop_at_pad=False) for row, m in zip(tokens, mask)
             if m.any() and "<tool_response>" in codec.decode(row, stop_at_pad=False)]
    assert later and '"name": "stock"' in later[0]
    state = trainer.init_state()
    key = jax.random.key(7)
    before = warm_start_lib.demonstration_loss(trainer, trainer.policy_params(state), key,
                                               num_tasks=8, source="oracle")
    state = trainer.warm_start(state, log=lambda _: None)
    after = warm_start_lib.demonstration_loss(trainer, trainer.policy_params(state), key,
                                              num_tasks=8, source="oracle")
    assert after < 0.7 * before, (before, after)
    state, metrics = trainer.train_step(state)  # and RL goes on from there
    assert np.isfinite(float(metrics["loss/total"]))
