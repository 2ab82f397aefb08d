"""The shipped recipes as shipped on stand-ins of the checkpoint families (Qwen3 with
thinking on and off, Qwen2.5, Llama 3.1), through the CLI: `grpo_hf_checkpoint` (two
attempts), `grpo_sql_hf` (Qwen3 with its tool template), and the multi-turn game
`grpo_guess_number` on the checkpoint; and the token envs guess_number, countdown,
calculator, sql and code_interpreter on each family. Before every turn of each run's env
(played by its oracle with the codec the run builds) the context equals the reference
render of history mode "as generated": `apply_chat_template` under the checkpoint's
template, or under its keep-history variant where the template rewrites earlier turns
(Qwen3). One run is in the default suite; the matrix is `slow` (each CLI run costs about
80 s of CPU at these sizes)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

pytest.importorskip("transformers")

from arl import rollout as rollout_lib  # noqa: E402
from arl.envs import from_config  # noqa: E402
from tests import hf_standins  # noqa: E402
from tests.tool_templates import QWEN3_TOOLS_TEMPLATE as QWEN3_TOOL_TEMPLATE  # noqa: E402
from tests.tool_templates import call_message, copy_with_template  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFF = {"enable_thinking": False}
# (stand-in, chat_template_kwargs): the families and Qwen3's two thinking modes. Qwen3's
# stand-in carries its tool branches, so its tool envs speak its own convention.
FAMILIES = {"qwen3": ("qwen3-tools", {}), "qwen3-no-thinking": ("qwen3-tools", OFF),
            "qwen2.5": ("qwen2", {}), "llama3.1": ("llama3.1", {})}
TINY = ["--config.train_steps=1", "--config.rollout.num_tasks=2",
        "--config.rollout.group_size=2", "--config.model.dtype=float32",
        "--config.model.param_dtype=float32", "--config.model.remat=False",
        "--config.model.logprob_chunk=0", "--config.log_every=1", "--config.sample_every=1",
        "--config.checkpoint_every=1"]
ENVS = {"guess_number": dict(max_n=100, max_turns=4),
        "countdown": dict(max_numbers=3, max_number=9, max_target=100, max_turns=2),
        "calculator": dict(max_digits=2, max_turns=3),
        "sql": dict(tool_format="template", max_turns=3, obs_len=64, action_len=256),
        "code_interpreter": dict(tool_format="template", max_turns=3, action_len=96,
                                 allow_weak_sandbox=True)}


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")

    @functools.lru_cache(maxsize=None)
    def build(name):
        if name == "qwen3-tools":
            return copy_with_template(build("qwen3"), str(root / "qwen3_tools"), QWEN3_TOOL_TEMPLATE)
        return hf_standins.build_standin(str(root / name.replace(".", "_")), name)
    return build


# A run of grpo_hf_checkpoint on another env: argument "DIR,ENV,KWARGS_JSON".
ENV_CONFIG = '''
import json

import ml_collections

from configs import grpo_hf_checkpoint


def get_config(argument=""):
    directory, env, env_kwargs = argument.split(",", 2)
    c = grpo_hf_checkpoint.get_config(directory)
    c.model.system_prompt = "Be brief."
    c.env.name = env
    c.env.kwargs = ml_collections.ConfigDict(json.loads(env_kwargs))
    return c
'''


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {a} plus {b}?",
                                        "answer": str(a + b)}) + "\n"
                            for a in range(1, 9) for b in (2, 5)))
    return str(path)


def _train(config_argument, workdir, template_kwargs, *flags):
    flags = list(flags)
    if template_kwargs:
        flags.append(f"--config.model.chat_template_kwargs={template_kwargs!r}")
    run = subprocess.run(
        [sys.executable, "-m", "experiments.train", f"--config={config_argument}",
         f"--workdir={workdir}", *TINY, *flags], cwd=_ROOT, env=dict(os.environ),
        capture_output=True, text=True, timeout=1200, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        metrics = next(m for m in map(json.loads, f) if m.get("step") == 1)
    with open(os.path.join(workdir, "samples", "step_000001.txt"), encoding="utf-8") as f:
        return f.read(), metrics


def _ids(tokenizer, messages, **kwargs):
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def contexts_are_the_reference_render(directory, system, template_kwargs, env_name,
                                      env_kwargs, rows=3, action_source="oracle"):
    """The env as a run builds it (checkpoint codec, system prompt, template arguments),
    played by its oracle (or `action_source`): the tokens before every turn are apply_chat_template of the
    conversation so far under the reference template of history mode "as generated"
    (the keep-history variant where the checkpoint's template rewrites earlier turns),
    with the tools and structured calls of a tool env. Returns the turns checked."""
    from transformers import AutoTokenizer

    config = ml_collections.ConfigDict(dict(model=dict(
        hf_checkpoint=directory, system_prompt=system, chat_template_kwargs=template_kwargs)))
    env = from_config.make_env(dict(name=env_name, kwargs=env_kwargs),
                               from_config.checkpoint_codec(config))
    chat, codec = env.chat if getattr(env, "chat", None) else env.codec.chat, env.codec
    tokenizer = AutoTokenizer.from_pretrained(directory)
    render = dict(template_kwargs, add_generation_prompt=True)
    if chat.history_template is not None:
        render["chat_template"] = chat.history_template
    tool_env = chat.reply_role == "tool"
    if tool_env:
        name, description, parameter, parameter_description = env.tool_function
        render["tools"] = [{"type": "function", "function": {
            "name": name, "description": description,
            "parameters": {"type": "object", "properties": {parameter: {
                "type": "string", "description": parameter_description}},
                           "required": [parameter]}}}]
    as_json = tool_env and env.call_syntax.results_as_json
    traj = jax.device_get(rollout_lib.scripted_rollout(
        env, jax.random.key(2), num_tasks=rows, group_size=1, action_source=action_source))
    checked = 0
    for b in range(rows):
        tokens = traj.tokens[b].tolist()
        starts = [int(traj.turn_starts[b, t]) for t in range(int(traj.num_turns[b]))]
        prompt = tokens[len(chat.prompt_prefix):starts[0] - len(chat.turn_suffix)]
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": tokenizer.decode(prompt)}]
        for t, start in enumerate(starts):
            assert tokens[:start] == _ids(tokenizer, messages, **render), (env_name, b, t)
            checked += 1
            end = start + int(np.argmin(traj.agent_mask[b, start:] > 0))
            assert tokens[end - 1] == codec.eot_id
            text = tokenizer.decode(tokens[start:end - 1])
            call = env.call_syntax.parse(text) if tool_env else None
            if tool_env and not isinstance(call, str):
                messages.append(call_message("", [call]))
            else:
                messages.append({"role": "assistant", "content": text})
            reply = end + len(chat.reply_prefix)
            reply_end = reply
            while traj.observation_mask[b, reply_end] > 0 and tokens[
                    reply_end:reply_end + len(chat.reply_suffix)] != list(chat.reply_suffix):
                reply_end += 1
            written = tokenizer.decode(tokens[reply:reply_end])
            messages.append({"role": chat.reply_role,
                             "content": json.loads(f'"{written}"') if as_json else written})
    return checked


def test_grpo_hf_checkpoint_as_shipped_runs_two_attempts_on_qwen3(standins, tasks, tmp_path):
    """The recipe as shipped (max_turns=2, the model's own template) on Qwen3, thinking
    on: it trains, and its second attempts read the keep-history render."""
    directory = standins("qwen3")
    sample, metrics = _train(f"configs/grpo_hf_checkpoint.py:{directory}", tmp_path / "run",
                             {}, f"--config.env.kwargs.path={tasks}",
                             "--config.env.kwargs.action_len=24")
    assert sample.startswith("== samples/sampled ==\n[env]   <|im_start|>user\nWhat is")
    assert metrics["turns_mean"] > 1  # second attempts were played
    checked = contexts_are_the_reference_render(
        directory, None, {}, "dataset_task", dict(path=tasks, max_turns=2), rows=6,
        action_source="demonstrator")  # right half the time: second attempts
    assert 6 < checked <= 12


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3-no-thinking", "qwen2.5", "llama3.1"])
def test_grpo_hf_checkpoint_as_shipped_on_each_family(standins, tasks, tmp_path, family):
    name, template_kwargs = FAMILIES[family]
    _train(f"configs/grpo_hf_checkpoint.py:{standins(name)}", tmp_path / "run",
           template_kwargs, f"--config.env.kwargs.path={tasks}",
           "--config.env.kwargs.action_len=24")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3-no-thinking"])
def test_grpo_sql_hf_as_shipped_on_qwen3(standins, tmp_path, family):
    """Qwen2.5 and Llama 3.1: tests/test_tool_calls.py."""
    name, template_kwargs = FAMILIES[family]
    sample, _ = _train(f"configs/grpo_sql_hf.py:{standins(name)}", tmp_path / "run",
                       template_kwargs, "--config.env.kwargs.action_len=96")
    assert '<tools>\n{"type": "function", "function": {"name": "run_sql"' in sample


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_guess_number_game_config_on_each_family(standins, tmp_path, family):
    name, template_kwargs = FAMILIES[family]
    _train("configs/grpo_guess_number.py", tmp_path / "run", template_kwargs,
           f"--config.model.hf_checkpoint={standins(name)}",
           "--config.warm_start.sft_steps=2", "--config.warm_start.sft_batch=4")


@pytest.mark.parametrize("family", ["qwen3", "qwen3-no-thinking"])
def test_qwen3_multi_turn_contexts_are_the_keep_history_render(standins, family):
    name, template_kwargs = FAMILIES[family]
    assert contexts_are_the_reference_render(
        standins(name), "Be brief.", template_kwargs, "guess_number",
        ENVS["guess_number"]) >= 6


@pytest.mark.slow
@pytest.mark.parametrize("env_name", list(ENVS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_token_envs_train_on_each_family_and_read_the_reference(standins, tmp_path, family,
                                                                env_name):
    name, template_kwargs = FAMILIES[family]
    directory = standins(name)
    env_kwargs = ENVS[env_name]
    config = tmp_path / "env_run.py"
    config.write_text(ENV_CONFIG)
    _train(f"{config}:{directory},{env_name},{json.dumps(env_kwargs)}", tmp_path / "run",
           template_kwargs)
    assert contexts_are_the_reference_render(directory, "Be brief.", template_kwargs,
                                             env_name, env_kwargs) >= 3
