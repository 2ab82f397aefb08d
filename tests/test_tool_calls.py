"""Tool envs in the checkpoint's own tool-calling format (`tool_format="template"`):
the policy's context before every turn equals `apply_chat_template(messages, tools=...)`
with the calls as structured `tool_calls` and the replies as `tool` messages (Qwen2.5
stand-in, built with transformers); calls are parsed from the model's format, ill-formed
ones get an error text as the tool's result (declared tools, `arl.envs.tool_calling`:
schema checks, several calls per turn); templates whose tool turns cannot be cut into
static pieces, and bad option values, are refused in one line; the shipped config trains
through the CLI, and sql and code_interpreter train two steps on each family's stand-in
(Qwen2.5, Qwen3 thinking on and off, Llama 3.1; slow)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import ml_collections
import pytest

pytest.importorskip("transformers")

from arl import rollout as rollout_lib  # noqa: E402
from arl.config import ConfigError  # noqa: E402
from arl.envs import from_config  # noqa: E402
from arl.envs.host import HostEpisode  # noqa: E402
from arl.rewards.functions import episode_texts  # noqa: E402
from arl.text.chat_template import ChatTemplateError  # noqa: E402
from tests.hf_standins import build_standin  # noqa: E402
from tests.tool_templates import QWEN3_TOOLS_TEMPLATE, call_message, with_template  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = "Answer with the tool."


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    """Stand-in checkpoint directories by family; Qwen3's with its tool template."""
    root = tmp_path_factory.mktemp("families")

    def build(family):
        directory = build_standin(str(root / family.replace(".", "_")), family)
        return with_template(directory, QWEN3_TOOLS_TEMPLATE) if family == "qwen3" \
            else directory
    return functools.lru_cache(maxsize=None)(build)


@pytest.fixture(scope="module")
def qwen(standins):
    return standins("qwen2")


def _env(directory, name="sql", **kwargs):
    config = ml_collections.ConfigDict(dict(model=dict(hf_checkpoint=directory,
                                                       system_prompt=SYSTEM)))
    codec = from_config.checkpoint_codec(config)
    return from_config.make_env(dict(name=name, kwargs=dict(tool_format="template",
                                                             **kwargs)), codec)


@pytest.mark.parametrize("family,env_name,kwargs", [
    ("qwen2", "sql", dict(max_turns=3, action_len=256, obs_len=64)),
    ("qwen2", "code_interpreter", dict(max_turns=3, action_len=96, allow_weak_sandbox=True)),
    # Llama 3.1: the ipython turn, results written as JSON strings, replies cut short
    ("llama3.1", "sql", dict(max_turns=3, action_len=256, obs_len=12))])
def test_context_is_the_template_with_tools_before_every_turn(standins, family, env_name,
                                                              kwargs):
    from transformers import AutoTokenizer

    directory = standins(family)
    env = _env(directory, env_name, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    as_json = env.call_syntax.results_as_json
    assert as_json == (family == "llama3.1")
    name, description, parameter, parameter_description = env.tool_function
    tools = [{"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {parameter: {
            "type": "string", "description": parameter_description}},
                       "required": [parameter]}}}]
    traj = jax.device_get(rollout_lib.scripted_rollout(
        env, jax.random.key(3), num_tasks=3, group_size=1, action_source="oracle"))
    # The pieces the rollout wraps in: the host writes the template's text next to the
    # prompt and replies with them as one text (`arl.text.seams`, `reply_around`).
    chat, checked, results = rollout_lib.chat_format(env), 0, []
    inside = lambda text, around: text[len(around[0]):len(text) - len(around[1])]
    for b in range(3):
        tokens = traj.tokens[b].tolist()
        starts = [int(traj.turn_starts[b, t]) for t in range(int(traj.num_turns[b]))]
        assert len(starts) == 2  # a call, then the answer
        prompt = tokens[len(chat.prompt_prefix):starts[0] - len(chat.turn_suffix)]
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": inside(tokenizer.decode(prompt),
                                                       chat.prompt_around)}]
        for t, start in enumerate(starts):
            expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                                     add_generation_prompt=True)
            expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
            assert tokens[:start] == expected, (b, t)
            checked += 1
            end = start
            while traj.agent_mask[b, end] > 0:
                end += 1
            assert tokens[end - 1] == env.codec.eot_id
            text = tokenizer.decode(tokens[start:end - 1])
            call = env.call_syntax.parse(text)
            if t == 0:  # the call, given to the template as structured tool_calls
                assert call[0] == name and set(call[1]) == {parameter}
                assert text.startswith(f'{{"name": "{name}", "parameters": ' if as_json else
                                       f'<tool_call>\n{{"name": "{name}", "arguments": ')
                messages.append(call_message("", [call]))
            else:
                assert text.startswith("<answer>")
                messages.append({"role": "assistant", "content": text})
            reply = end + len(chat.reply_prefix)
            reply_end = reply
            while traj.observation_mask[b, reply_end] > 0 and \
                    tokens[reply_end:reply_end + len(chat.reply_suffix)] != list(
                        chat.reply_suffix):
                reply_end += 1
            written = inside(tokenizer.decode(tokens[reply:reply_end]), chat.reply_around)
            messages.append({"role": "tool", "content": json.loads(f'"{written}"')
                             if as_json else written})
            assert len(tokens[reply:reply_end]) <= env.obs_len
        assert messages[-1]["content"] == "correct"
        results += [m["content"] for m in messages if m["role"] == "tool"]
        # Python reward functions read the same conversation, replies as tool messages
        prompt_text, turns = episode_texts(env, traj.tokens[b], traj.agent_mask[b],
                                           traj.length[b])
        assert prompt_text == messages[1]["content"]
        assert [role for role, _ in turns] == ["assistant", "tool", "assistant", "tool"]
        assert [content for role, content in turns if role == "tool"] == [
            json.dumps(m["content"])[1:-1] if as_json else m["content"]
            for m in messages if m["role"] == "tool"]
    assert checked == 6
    # results with newlines (escaped for Llama 3.1), and (obs_len=12) cut before escaping
    assert any("\n" in r for r in results) == (env_name == "sql")  # a column header
    assert any(r.endswith("..") for r in results) == (family == "llama3.1"), results


@pytest.mark.parametrize("action,reply", [
    ("SELECT 1", "error: no tool call or answer"),
    ("<tool_call>\n{\"name\": \"run_sql\", \"arguments\": {\"query\": \"SELECT 1\"\n"
     "</tool_call>", "error: bad JSON in the tool call"),
    ('<tool_call>{"name": "rm", "arguments": {"query": "x"}}</tool_call>',
     "error: unknown tool 'rm' (the tools are 'run_sql')"),
    ('<tool_call>{"name": "run_sql", "arguments": {"sql": "x"}}</tool_call>',
     "error: run_sql: missing argument 'query'"),
    ('<tool_call>{"name": "run_sql", "arguments": {"query": 7}}</tool_call>',
     "error: run_sql: query must be a string, got the number 7"),
    ('<tool_call>{"name": "run_sql", "arguments": [1]}</tool_call>',
     'error: the tool call needs "arguments": an object'),
    ('<tool_call>\n{"name": "run_sql", "arguments": {"query": "SELECT 6*7"}}\n</tool_call>',
     "6*7\n42"),
    # two calls in one turn (Qwen renders them): one reply of both results, one turn cost
    ('<tool_call>\n{"name": "run_sql", "arguments": {"query": "SELECT 6*7"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "run_sql", "arguments": {"query": "SELECT 2"}}\n</tool_call>',
     "6*7\n42\n</tool_response>\n<tool_response>\n2\n2"),
    # the valid call of a turn with an invalid one still runs; the turn is a format error
    ('<tool_call>\n{"name": "run_sql", "arguments": {"query": "SELECT 6*7"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "run_sq", "arguments": {"query": "SELECT 2"}}\n</tool_call>',
     "6*7\n42\n</tool_response>\n<tool_response>\nerror: unknown tool 'run_sq' (the tools "
     "are 'run_sql')"),
    ("<answer>nope</answer>", "wrong"),
])
def test_calls_are_parsed_from_the_model_format(qwen, action, reply):
    """Template tool calls are declared tools' (`arl.envs.tool_calling`): checked against
    the schema, errors answered as the tool's result; the rewards are the env's own
    (success_reward, turn_cost and format_penalty of its params, one turn cost a turn)."""
    env = _env(qwen, obs_len=96)
    task = env.make_task(5, None)
    params = env.default_params().replace(turn_cost=jax.numpy.float32(0.25))
    turn = env.host_step(HostEpisode(task=task, params=params, turn=0, memory={}, seed=5),
                         action)
    assert turn.reply == reply
    assert turn.format_error == ("error" in reply)
    assert turn.reward == pytest.approx(-0.25 - (0.1 if turn.format_error else 0.0))


def test_bad_tool_format_and_codecs_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^config\.env\.kwargs.*tool_format must be one of "
                       r"\('tags', 'template'\), got 'json'$"):
        from_config.make_env(dict(name="sql", kwargs=dict(tool_format="json")))
    with pytest.raises(ConfigError, match="tool_format='template' needs a checkpoint's codec"):
        from_config.make_env(dict(name="sql", kwargs=dict(tool_format="template")))


@pytest.mark.parametrize("family,template_kwargs", [
    ("qwen2", {}), pytest.param("llama3.1", {}, marks=pytest.mark.slow)])
def test_shipped_config_trains_through_the_cli(standins, family, template_kwargs, tmp_path):
    run = _train(f"configs/grpo_sql_hf.py:{standins(family)}", tmp_path / "run",
                 template_kwargs, "--config.env.kwargs.action_len=96",
                 "--config.train_steps=1")  # one compiled step is the check; the suite is tight
    sample = (tmp_path / "run" / "samples" / "step_000001.txt").read_text()
    # the tools in the system (Llama 3.1: first user) turn; every reply a tool message
    if family == "qwen2":
        assert '<tools>\n{"type": "function", "function": {"name": "run_sql"' in sample
        assert "<|im_start|>user\n<tool_response>\n" in sample
    else:
        assert '"name": "run_sql",' in sample
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n"' in sample
    assert [r["step"] for r in run] == [1]
    for record in run:  # the declared tools' counts of the policy's episodes
        assert 0.0 <= record["tools/invalid_call_cap_episodes"] <= 1.0
        assert record["tools/calls_mean"] >= 0.0 and record["tools/invalid_calls_mean"] >= 0.0


@pytest.mark.slow
@pytest.mark.parametrize("env_name", ["sql", "code_interpreter"])
@pytest.mark.parametrize("family,template_kwargs", [
    ("qwen2", {}), ("qwen3", {}), ("qwen3", {"enable_thinking": False}), ("llama3.1", {})])
def test_tool_envs_train_two_steps_on_each_family(standins, family, template_kwargs,
                                                  env_name, tmp_path):
    """sql and code_interpreter with template tool calls, two steps through the CLI with
    the SFT term on the oracle's calls: every logged record counts the policy's calls,
    invalid calls and capped episodes (training and evaluation), and the oracle's
    episodes in the compiled step solve their tasks."""
    records = _train(f"tests/template_tools_config.py:{standins(family)},{env_name}",
                     tmp_path / "run", template_kwargs)
    assert [r["step"] for r in records] == [1, 2]
    assert [r["demo_success_rate"] for r in records] == [1.0, 1.0]
    for record in records:
        for name in ("tools/calls_mean", "tools/invalid_calls_mean",
                     "tools/invalid_call_cap_episodes"):
            assert record[name] >= 0.0, (name, record)
        assert record["tools/invalid_call_cap_episodes"] <= 1.0
    assert "eval/tools/calls_mean" in records[1]
    tool = "run_sql" if env_name == "sql" else "run_python"
    sample = (tmp_path / "run" / "samples" / "step_000002.txt").read_text()
    assert f'"name": "{tool}"' in sample


def _train(config_argument, workdir, template_kwargs, *flags):
    """The metric records of a CLI run of `config_argument` (float32, tiny rollouts for
    the shipped config; the config's own sizes otherwise)."""
    defaults = []
    if config_argument.startswith("configs/"):
        defaults = ["--config.train_steps=2", "--config.rollout.num_tasks=2",
                  "--config.rollout.group_size=2", "--config.model.dtype=float32",
                  "--config.model.param_dtype=float32", "--config.model.remat=False",
                  "--config.model.logprob_chunk=0", "--config.log_every=1",
                  "--config.sample_every=1"]
    flags = defaults + list(flags)  # the caller's flags win
    if template_kwargs:
        flags.append(f"--config.model.chat_template_kwargs={template_kwargs!r}")
    run = subprocess.run(
        [sys.executable, "-m", "experiments.train", f"--config={config_argument}",
         f"--workdir={workdir}", *flags],
        cwd=_ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=900,
        check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_a_template_that_reserialises_calls_differently_is_refused(qwen):
    """A template that writes a structured call's arguments indented (not as the compact
    JSON it renders them from) cannot hold the context check for the model's calls."""
    from arl.text.hf_codec import HFCodec
    from arl.text.tool_calls import derive_tool_chat_format, function_schema
    from tests.hf_standins import QWEN25_TEMPLATE

    codec = HFCodec.from_pretrained(qwen)
    indented = QWEN25_TEMPLATE.replace("tool_call.arguments | tojson",
                                       "tool_call.arguments | tojson(indent=2)")
    assert indented != QWEN25_TEMPLATE
    with pytest.raises(ChatTemplateError, match=r"^chat template: 1 tool exchange\(s\) as "
                       r"structured tool_calls tokenize to .* cannot be split"):
        derive_tool_chat_format(
            indented, encode=codec.encode,
            special_texts=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            special_tokens=codec.template_tokens, pad_id=codec.pad_id,
            tools=[function_schema("run_python", "Runs.", "code", "A cell.")])


def test_llama31_calls_and_json_string_results(standins):
    """Llama 3.1: a call is the bare JSON object with "parameters"; replies are written
    JSON-escaped between the pieces' quotes (`fit_reply`), cut before escaping."""
    wide = _env(standins("llama3.1"), obs_len=48)
    episode = HostEpisode(task=wide.make_task(5, None), params=wide.default_params(),
                          turn=0, memory={}, seed=5)
    step = lambda action: wide.host_step(episode, action).reply
    assert step('{"name": "run_sql", "parameters": {"query": "SELECT 6*7"}}') == "6*7\\n42"
    assert step('{"name": "run_sql", "arguments": {"query": "SELECT 1"}}') == \
        'error: the tool call needs \\"parameters\\": an object'  # JSON-escaped
    assert step('{"name": "run_sql", "parameters": {') == "error: bad JSON in the tool call"
    assert step("SELECT 1") == "error: no tool call or answer"
    env = _env(standins("llama3.1"), obs_len=16)
    # The host writes the result with the template's text around it ('\n\n"', '"').
    head, tail = rollout_lib.chat_format(env).reply_around
    assert tail == '"' and head.endswith('"')
    written = lambda ids, length: env.codec.decode(ids[:length])[len(head):-len(tail)]
    ids, length = env.reply_ids(env.fit_reply(['say "hi"\n']))
    assert written(ids, length) == 'say \\"hi\\"\\n'
    ids, length = env.reply_ids(env.fit_reply(["\n" * 40]))  # escapes never split by the cut
    text = written(ids, length)
    assert length <= env.obs_len and text.endswith("..") and json.loads(f'"{text}"') == \
        "\n" * ((len(text) - 2) // 2) + ".."
