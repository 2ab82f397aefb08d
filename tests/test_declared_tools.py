"""Tools as users declare them (`arl.envs.tool_calling`, `arl.text.tool_schemas`): a
user's own env (tests/tool_user_envs.py, two tools of several typed arguments) whose
oracle makes two calls in one turn; the policy's context before every turn equals
`apply_chat_template(messages, tools=...)` with the calls as structured `tool_calls`
and each result a `tool` message (Qwen2.5, Qwen3, Llama 3.1 stand-ins, built with
transformers); calls are checked against their schemas and every error goes back as
the tool's result; the invalid-call cap ends episodes and is counted; the env trains
through the CLI."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Literal

import jax
import ml_collections
import numpy as np
import pytest

pytest.importorskip("transformers")

from arl import rollout as rollout_lib  # noqa: E402
from arl.trainers import credit_assignment  # noqa: E402
from arl.config import ConfigError  # noqa: E402
from arl.envs import from_config  # noqa: E402
from arl.envs.host import HostEpisode, HostTurn  # noqa: E402
from arl.envs.tool_calling import ToolCallingEnvironment, tool  # noqa: E402
from arl.text.tool_schemas import (ToolSchemaError, call_error, check_tool_schema,  # noqa: E402
                                   schema_of_function)
from tests import tool_user_envs  # noqa: E402  (registers "warehouse")
from tests.hf_standins import build_standin  # noqa: E402
from tests.tool_templates import QWEN3_TOOLS_TEMPLATE, call_message, with_template  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = "Use the tools, then answer."


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_families")

    def build(family):
        directory = build_standin(str(root / family.replace(".", "_")),
                                  "qwen3" if family.startswith("qwen3") else family)
        return with_template(directory, QWEN3_TOOLS_TEMPLATE) if family.startswith(
            "qwen3") else directory
    return functools.lru_cache(maxsize=None)(build)


def _codec(directory, **template_kwargs):
    config = ml_collections.ConfigDict(dict(model=dict(
        hf_checkpoint=directory, system_prompt=SYSTEM,
        chat_template_kwargs=dict(template_kwargs))))
    return from_config.checkpoint_codec(config)


def _warehouse(directory, **kwargs):
    return from_config.make_env(dict(name="warehouse", kwargs=kwargs), _codec(directory))


def _template_ids(tokenizer, messages, tools, **template_kwargs):
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                        add_generation_prompt=True, **template_kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def contexts_against_template(env, directory, *, num_tasks=3, seed=3, variant=True,
                              **template_kwargs):
    """(turns whose context equals the template's render, turns, calls per call turn,
    the tool results) over the oracle's episodes; the render is under the keep-history
    variant where the env follows one (`env.chat.history_template`: Qwen3) unless
    `variant` is False."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    syntax, chat = env.call_syntax, env.chat
    if variant and chat.history_template is not None:
        template_kwargs = dict(template_kwargs, chat_template=chat.history_template)
    traj = jax.device_get(rollout_lib.scripted_rollout(
        env, jax.random.key(seed), num_tasks=num_tasks, group_size=1, action_source="oracle"))
    equal = total = 0
    calls_per_turn, results_seen = [], []
    for b in range(num_tasks):
        tokens = traj.tokens[b].tolist()
        starts = [int(traj.turn_starts[b, t]) for t in range(int(traj.num_turns[b]))]
        prompt = tokens[len(chat.prompt_prefix):starts[0] - len(chat.turn_suffix)]
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": tokenizer.decode(prompt)}]
        for start in starts:
            total += 1
            equal += tokens[:start] == _template_ids(tokenizer, messages, env.tool_schemas,
                                                     **template_kwargs)
            end = start
            while traj.agent_mask[b, end] > 0:
                end += 1
            assert tokens[end - 1] == env.codec.eot_id
            text = tokenizer.decode(tokens[start:end - 1])
            parsed = syntax.parse_calls(text)
            if isinstance(parsed, str):  # the answer
                messages.append({"role": "assistant", "content": text})
                results = [tokenizer.decode(tokens[end + len(chat.reply_prefix):_reply_end(
                    traj, b, end + len(chat.reply_prefix), chat)])]
            else:
                content, calls = parsed
                calls_per_turn.append(len(calls))
                messages.append(call_message(content, calls))
                reply = tokenizer.decode(tokens[end + len(chat.reply_prefix):_reply_end(
                    traj, b, end + len(chat.reply_prefix), chat)])
                results = reply.split(syntax.result_separator) if len(calls) > 1 else [reply]
                assert len(results) == len(calls)
            if syntax.results_as_json:
                results = [json.loads(f'"{r}"') for r in results]
            messages += [{"role": "tool", "content": r} for r in results]
            results_seen += results
        assert messages[-1]["content"] == "correct", messages
    return equal, total, calls_per_turn, results_seen


def _reply_end(traj, b, position, chat):
    tokens = traj.tokens[b].tolist()
    while traj.observation_mask[b, position] > 0 and \
            tokens[position:position + len(chat.reply_suffix)] != list(chat.reply_suffix):
        position += 1
    return position


def test_two_calls_in_one_turn_read_as_the_template_renders_them(standins):
    """Qwen2.5: the oracle calls both tools in its first turn; every context equals
    apply_chat_template with structured tool_calls and one tool message per result."""
    env = _warehouse(standins("qwen2"))
    assert env.call_syntax.several_calls and env.max_calls_per_turn == 4
    equal, total, calls_per_turn, results = contexts_against_template(env, standins("qwen2"))
    assert (equal, total) == (6, 6)
    assert calls_per_turn == [2, 2, 2]
    assert all(r.isdigit() for r in results if r != "correct"), results
    names = [s["function"]["name"] for s in env.tool_schemas]
    assert names == ["stock", "price"]  # in definition order


@pytest.mark.slow
@pytest.mark.parametrize("family,template_kwargs,calls_per_turn", [
    ("qwen3", {}, [2, 2, 2]),  # thinking on (the oracle writes no think block)
    # thinking off: the generation prompt's empty think block stays in earlier turns,
    # as the keep-history variant renders them (the template itself drops it)
    ("qwen3", {"enable_thinking": False}, [2, 2, 2]),
    ("llama3.1", {}, [1, 1, 1, 1, 1, 1])])  # one call per turn: stock, price, answer
def test_contexts_equal_the_template_qwen3_and_llama31(standins, family, template_kwargs,
                                                      calls_per_turn):
    directory = standins(family)
    env = from_config.make_env(dict(name="warehouse", kwargs=dict(max_turns=3)),
                               _codec(directory, **template_kwargs))
    equal, total, per_turn, _ = contexts_against_template(env, directory, **template_kwargs)
    assert (equal, total) == (total, 6 if family == "qwen3" else 9)
    assert per_turn == calls_per_turn
    if template_kwargs:  # the template's own render drops the think block: only the first
        equal, _, _, _ = contexts_against_template(env, directory, variant=False,
                                                   **template_kwargs)
        assert equal == 3


def _episode(env, memory=None, seed=5):
    return HostEpisode(task=env.make_task(seed, None), params=env.default_params(), turn=0,
                       memory={"looked_up": 0, "tool_calls": 0, "invalid_streak": 0,
                               "invalid_calls": 0,
                               **(memory or {})}, seed=seed)


def _call(name, **arguments):
    return (name, arguments)


def test_invalid_calls_are_answered_as_tool_errors_and_capped(standins):
    env = _warehouse(standins("qwen2"), max_invalid_calls=2, obs_len=96)
    episode = _episode(env)
    task = episode.task
    good_stock = _call("stock", item=task["item"], warehouse=task["warehouse"])
    step = lambda text, **memory: env.host_step(_episode(env, memory), text)
    separator = env.call_syntax.result_separator
    cases = [
        (env.calls_text(_call("restock", item="widget")),
         ["error: unknown tool 'restock' (the tools are 'stock', 'price')"]),
        (env.calls_text(_call("stock", item="widget")),
         ["error: stock: missing argument 'warehouse'"]),
        (env.calls_text(_call("stock", item="widget", warehouse="2")),
         ["error: stock: warehouse must be an integer, got the string '2'"]),
        (env.calls_text(_call("stock", item="widget", warehouse=True)),
         ["error: stock: warehouse must be an integer, got the boolean true"]),
        (env.calls_text(_call("price", item="widget", quantity=2, currency="GBP")),
         ["error: price: currency must be one of ['EUR', 'USD'], got 'GBP'"]),
        (env.calls_text(_call("stock", item="widget", warehouse=2, shelf=1)),
         ["error: stock: unknown argument 'shelf' (the arguments are 'item', 'warehouse')"]),
        ('<tool_call>\n{"name": "stock", "arguments": {"item": "widget"\n</tool_call>',
         ["error: bad JSON in the tool call"]),
        ('<tool_call>\n{"name": "stock", "arguments": {}}', [
            "error: the tool call is not closed with '</tool_call>'"]),
        (env.calls_text(*[good_stock] * 5), ["error: 5 tool calls in one turn; at most 4"]),
        # the valid call of a turn with an invalid one still runs
        (env.calls_text(good_stock, _call("price", item="widget", quantity=2.5,
                                          currency="EUR")),
         [str(tool_user_envs._units(5, task["item"], task["warehouse"])),
          "error: price: quantity must be an integer, got the number 2.5"]),
    ]
    for text, results in cases:
        turn = step(text)
        assert turn.reply == separator.join(results), text
        assert turn.format_error and turn.reward == pytest.approx(-0.1) and not turn.terminated
        assert turn.memory["invalid_streak"] == 1
    # a tool that raises: the call was valid, the tool failed
    turn = step(env.calls_text(_call("stock", item="anvil", warehouse=1)))
    assert turn.reply == "error: KeyError: \"no 'anvil' in warehouse 1\""
    assert not turn.format_error and turn.memory == {"tool_calls": 1, "invalid_streak": 0,
                                                     "invalid_calls": 0}
    # whole floats are integers (as JSON has them) and reach the tool as ints
    turn = step(env.calls_text(_call("price", item="widget", quantity=2.0, currency="USD")))
    assert turn.reply == "6" and not turn.format_error  # 2 * 2.50 EUR * 1.25 = 6.25 USD
    # the cap: a second invalid turn in a row ends the episode; a valid one resets
    assert step(env.calls_text(_call("nope")), invalid_streak=1).terminated
    assert not step(env.calls_text(_call("nope")), invalid_streak=0).terminated
    assert step(env.calls_text(good_stock), invalid_streak=1).memory["invalid_streak"] == 0
    assert step("<answer>1;2</answer>", invalid_streak=1).memory["invalid_streak"] == 0
    stats = env.tool_stats
    assert (stats.call_turns, stats.invalid_turns, stats.capped_episodes) == (15, 12, 1)


def test_invalid_call_cap_ends_episodes_and_is_counted(standins):
    """In the rollout: a looping row (a valid and an unknown call every turn) ends at the
    cap's turn, a row that recovers does not; per episode the state reports valid calls,
    invalid calls (each call of a turn counts) and the cap, and `rollout_metrics` logs
    their means (what metrics.jsonl gets)."""
    class Mixed(tool_user_envs.Warehouse):
        def host_oracle(self, episode):  # by the task seed: a looping or a recovering row
            task, turn = episode.task, episode.turn
            good = ("stock", {"item": task["item"], "warehouse": task["warehouse"]})
            if episode.seed % 2 or turn == 1:
                return self.calls_text(good, ("nope", {}))
            return self.calls_text(good) if turn == 0 else "<answer>0;0</answer>"

    env = Mixed(codec=_codec(standins("qwen2")), max_turns=4, max_invalid_calls=2)
    traj = jax.device_get(rollout_lib.scripted_rollout(
        env, jax.random.key(1), num_tasks=6, group_size=1, action_source="oracle"))
    looping = traj.num_turns == 2  # capped at its second invalid turn
    assert 0 < looping.sum() < 6
    # recovering rows: valid, (valid + invalid), a wrong answer: 3 turns, not capped
    np.testing.assert_array_equal(traj.num_turns, np.where(looping, 2, 3))
    np.testing.assert_array_equal(traj.format_errors, np.where(looping, 2, 1))
    assert traj.terminated.all() and not traj.success.any()
    np.testing.assert_allclose(traj.episode_return, np.where(looping, -0.2, -0.1), rtol=1e-6)
    stats = traj.episode_stats
    np.testing.assert_array_equal(stats["tools/calls_mean"], 2.0)
    np.testing.assert_array_equal(stats["tools/invalid_calls_mean"],
                                  np.where(looping, 2.0, 1.0))
    np.testing.assert_array_equal(stats["tools/invalid_call_cap_episodes"], looping * 1.0)
    assert env.tool_stats.capped_episodes == looping.sum()
    assert env.tool_stats.invalid_calls == 2 * looping.sum() + (~looping).sum()
    metrics = jax.device_get(credit_assignment.rollout_metrics(traj, ("warehouse",)))
    assert metrics["tools/invalid_call_cap_episodes"] == pytest.approx(looping.mean())
    assert metrics["tools/invalid_calls_mean"] == pytest.approx(1.0 + looping.mean())
    assert metrics["tools/calls_mean"] == 2.0
    # without a cap (0) no episode is counted as capped, whatever its streak
    uncapped = Mixed(codec=env.codec, max_turns=4, max_invalid_calls=0)
    memory = np.zeros((len(uncapped.memory_fields),), np.int32)
    memory[uncapped.memory_fields.index("invalid_streak")] = 7
    fake = type("State", (), {"memory": jax.numpy.asarray(memory)})()
    assert uncapped.episode_stats(fake)["tools/invalid_call_cap_episodes"] == 0.0
    assert env.episode_stats(fake)["tools/invalid_call_cap_episodes"] == 1.0


def test_results_are_cut_to_fit_obs_len_with_every_separator_kept(standins):
    env = _warehouse(standins("qwen2"))
    separator = env.call_syntax.result_separator
    env_separator_tokens = len(env.codec.encode(separator))
    obs_len = 2 * env_separator_tokens + 30
    env = _warehouse(standins("qwen2"), obs_len=obs_len)
    reply = env.fit_reply(["x" * 200, "short", "y" * 300])
    parts = reply.split(env.call_syntax.result_separator)
    assert len(parts) == 3 and parts[1] == "short"
    assert parts[0].endswith("..") and parts[2].endswith("..")
    assert len(parts[0]) == len(parts[2])  # one common length
    assert obs_len - 4 <= len(env.codec.encode(reply)) <= obs_len
    assert env.fit_reply(["12", "34"]) == "12" + separator + "34"


def test_schemas_from_functions_and_their_checks():
    def book(self, episode, city: str, nights: int, rate: float,
             room: Literal["single", "double"] = "single", breakfast: bool = False,
             guests: list[str] | None = None) -> str:
        """Books a room.

        More text.

        Args:
          city: where.
          nights: how many nights,
            at least one.
        Returns:
          the booking.
        """
    schema = schema_of_function(book, skip=2)
    assert schema == {"type": "function", "function": {
        "name": "book", "description": "Books a room.", "parameters": {
            "type": "object", "properties": {
                "city": {"type": "string", "description": "where."},
                "nights": {"type": "integer",
                           "description": "how many nights, at least one."},
                "rate": {"type": "number"},
                "room": {"type": "string", "enum": ["single", "double"]},
                "breakfast": {"type": "boolean"},
                "guests": {"type": ["array", "null"], "items": {"type": "string"}}},
            "required": ["city", "nights", "rate"]}}}
    ok = dict(city="Oslo", nights=2, rate=99)  # an integer is a number
    assert call_error(schema, ok) is None
    assert call_error(schema, {**ok, "guests": None}) is None
    assert call_error(schema, {**ok, "guests": ["a", 3]}) == \
        "book: guests[1] must be a string, got the number 3"
    assert call_error(schema, {**ok, "rate": True}) == \
        "book: rate must be a number, got the boolean true"
    assert call_error(schema, {**ok, "breakfast": "yes"}) == \
        "book: breakfast must be a boolean, got the string 'yes'"
    assert call_error(schema, [1]) == "book: the arguments must be an object, got an array"
    open_schema = check_tool_schema({"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {},
                                    "additionalProperties": {"type": "integer"}}}})
    assert call_error(open_schema, {"a": 1}) is None
    assert call_error(open_schema, {"a": "1"}) == "f: a must be an integer, got the string '1'"


@pytest.mark.parametrize("schema,message", [
    ({"name": "f"}, r"^a tool must be \{'type': 'function'"),
    ({"type": "function", "function": {"name": "two words"}}, r"^tool name 'two words'"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}},
     r"^tool 'f': parameters must be an object schema"),
    ({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "int"}}}}},
     r"^tool 'f': parameters\.x: type 'int' is not one of \('string', 'number'"),
    ({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": ["x"]}}},
     r"^tool 'f': required \['x'\] are not in its properties$"),
])
def test_bad_schemas_are_refused_in_one_line(schema, message):
    with pytest.raises(ToolSchemaError, match=message):
        check_tool_schema(schema)


def test_bad_declarations_are_refused_at_construction(standins):
    codec = _codec(standins("qwen2"))

    class Untyped(tool_user_envs.Warehouse):
        @tool
        def stock(self, episode, item, warehouse: int) -> str:  # noqa: D102
            return ""

    with pytest.raises(ToolSchemaError, match=r"^tool 'stock': argument 'item' needs a type "
                                              "annotation$"):
        Untyped(codec=codec)

    class Twice(tool_user_envs.Warehouse):
        tools = (schema_of_function(tool_user_envs.Warehouse.price, skip=2),)

    with pytest.raises(ValueError, match=r"^tools \['price'\] are declared more than once$"):
        Twice(codec=codec)

    class NoTools(ToolCallingEnvironment):
        pass

    with pytest.raises(ValueError, match="NoTools declares no tools"):
        NoTools(codec=codec, max_turns=1, prompt_len=8, obs_len=8, action_len=8)
    with pytest.raises(ConfigError, match=r"^config\.env\.kwargs=.*max_invalid_calls must be "
                                          r"an int >= 0, got -1$"):
        from_config.make_env(dict(name="warehouse", kwargs=dict(max_invalid_calls=-1)), codec)
    with pytest.raises(ConfigError, match="needs a checkpoint's codec with a chat template"):
        from_config.make_env(dict(name="warehouse", kwargs={}))


def test_several_calls_are_refused_where_the_template_renders_one(standins):
    """Llama 3.1's template raises on two calls in a message: max_calls_per_turn > 1 is
    refused at construction, and a turn with two calls is answered with an error."""
    directory = standins("llama3.1")
    with pytest.raises(ConfigError, match="max_calls_per_turn=2, but this chat template "
                                          "renders one tool call per turn; set it to 1"):
        from_config.make_env(dict(name="warehouse", kwargs=dict(max_calls_per_turn=2)),
                             _codec(directory))
    env = _warehouse(directory, obs_len=96)
    assert env.max_calls_per_turn == 1 and not env.call_syntax.several_calls
    call = env.calls_text(("stock", {"item": "widget", "warehouse": 1}))
    turn = env.host_step(_episode(env), call + call)
    assert turn.reply == "error: one tool call per turn (this model's template renders one)"
    assert turn.format_error
    with pytest.raises(ValueError, match="renders one tool call per turn, got 2"):
        env.calls_text(("stock", {}), ("price", {}))


def test_a_tool_may_return_a_host_turn(standins):
    """`stock` returns a HostTurn: its memory change is kept and a later call of the same
    turn sees it (here an overriding `price` that reports it), rewards are summed."""
    class Seeing(tool_user_envs.Warehouse):
        @tool
        def price(self, episode, item: str) -> HostTurn:
            return HostTurn(reply=f"looked up: {episode.memory['looked_up']}", reward=0.25)

    env = Seeing(codec=_codec(standins("qwen2")), obs_len=96)
    assert [s["function"]["name"] for s in env.tool_schemas] == ["stock", "price"]
    assert list(env.tool_schemas[1]["function"]["parameters"]["properties"]) == ["item"]
    task = _episode(env).task
    stock = ("stock", {"item": task["item"], "warehouse": task["warehouse"]})
    turn = env.host_step(_episode(env), env.calls_text(("price", {"item": "x"}), stock,
                                                       ("price", {"item": "x"})))
    assert turn.reply.split(env.call_syntax.result_separator) == [
        "looked up: 0", str(tool_user_envs._units(5, task["item"], task["warehouse"])),
        "looked up: 1"]
    assert turn.memory == {"looked_up": 1, "tool_calls": 3, "invalid_streak": 0,
                           "invalid_calls": 0}
    assert turn.reward == pytest.approx(0.5) and not turn.format_error
    with pytest.raises(ValueError, match=r"^max_calls_per_turn must be an int >= 1, got 0$"):
        Seeing(codec=env.codec, max_calls_per_turn=0)


@pytest.mark.slow
def test_user_tool_env_trains_through_the_cli(standins, tmp_path):
    directory = standins("qwen2")
    run = subprocess.run(
        [sys.executable, "-m", "experiments.train",
         f"--config=tests/tool_env_config.py:{directory}",
         f"--workdir={tmp_path / 'run'}", "--config.sample_every=1"],
        cwd=_ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=900,
        check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text(
        ).splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # the SFT term's oracle episodes (both calls in one turn, then the answer) ran in the
    # compiled step and solved every task
    assert [m["demo_success_rate"] for m in metrics] == [1.0, 1.0]
    for m in metrics:  # the policy's episodes' tool statistics, training and evaluation
        for name in ("tools/calls_mean", "tools/invalid_calls_mean",
                     "tools/invalid_call_cap_episodes"):
            assert 0.0 <= m[name] and 0.0 <= m[f"eval/{name}"], (name, m)
        assert m["tools/invalid_call_cap_episodes"] <= 1.0
    sample = (tmp_path / "run" / "samples" / "step_000001.txt").read_text()
    assert '"name": "stock"' in sample and '"name": "price"' in sample
    assert "<|im_start|>user\n<tool_response>\n" in sample
