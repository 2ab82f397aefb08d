"""Stand-ins of the checkpoint families users bring (Qwen2.5, Qwen3 with thinking on and
off, Llama 3.1 with merged digits, BOS and its date header) train through the CLI on a
multi-turn game and a tool env and export; the conversation the policy reads before every
turn of that run's env is `apply_chat_template`'s (checked on the oracle's episodes with
the codec the run built). Qwen3 on multi-turn envs: tests/test_recipes_on_checkpoints.py."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

pytest.importorskip("transformers")

from arl import rollout as rollout_lib  # noqa: E402
from arl.envs import from_config  # noqa: E402
from tests.hf_standins import build_standin  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = "Be brief."
ENV_KWARGS = {"guess_number": dict(max_n=100, max_turns=4),
              "calculator": dict(max_digits=2, max_turns=3),
              "dataset_task": dict(max_turns=1, action_len=8)}
CONFIG = textwrap.dedent('''
    """A tiny run of a stand-in checkpoint: argument "DIR,ENV,KWARGS_JSON"."""
    import json

    import ml_collections

    from configs import grpo_hf_checkpoint


    def get_config(argument=""):
        directory, env, env_kwargs = argument.split(",", 2)
        c = grpo_hf_checkpoint.get_config(directory)
        c.model.system_prompt = "Be brief."
        c.model.dtype = c.model.param_dtype = "float32"
        c.model.remat = False
        c.model.logprob_chunk = 0
        c.env.name = env
        c.env.kwargs = ml_collections.ConfigDict(json.loads(env_kwargs))
        c.rollout.num_tasks = 2
        c.rollout.group_size = 2
        c.train_steps = 1
        c.checkpoint_every = 1
        c.sample_every = 1
        return c
''')


@functools.lru_cache(maxsize=None)
def _standin(root, family):
    return build_standin(os.path.join(root, family.replace(".", "_")), family)


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("families"))
    config = os.path.join(root, "tiny_run.py")
    with open(config, "w", encoding="utf-8") as f:
        f.write(CONFIG)
    return config, lambda family: _standin(root, family)


def _train(config_file, directory, env, env_kwargs, workdir, *flags):
    return subprocess.run(
        [sys.executable, "-m", "experiments.train",
         f"--config={config_file}:{directory},{env},{json.dumps(env_kwargs)}",
         f"--workdir={workdir}", *flags], cwd=_ROOT, env=dict(os.environ),
        capture_output=True, text=True, timeout=900, check=False)


def _context_is_the_template_every_turn(directory, env_name, env_kwargs, template_kwargs):
    """The env of the run's config, with the codec the run built, played by its oracle:
    the tokens before every turn are apply_chat_template of the conversation so far."""
    import ml_collections
    from transformers import AutoTokenizer

    config = ml_collections.ConfigDict(dict(model=dict(
        hf_checkpoint=directory, system_prompt=SYSTEM,
        chat_template_kwargs=template_kwargs)))
    codec = from_config.checkpoint_codec(config)
    env = from_config.make_env(dict(name=env_name, kwargs=env_kwargs), codec)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    traj = jax.device_get(rollout_lib.scripted_rollout(
        env, jax.random.key(2), num_tasks=4, group_size=1, action_source="oracle"))
    chat, checked = codec.chat, 0
    for b in range(4):
        tokens = traj.tokens[b].tolist()
        starts = [int(traj.turn_starts[b, t]) for t in range(int(traj.num_turns[b]))]
        first = len(chat.prompt_prefix)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content":
                    tokenizer.decode(tokens[first:starts[0] - len(chat.turn_suffix)])}]
        for t, start in enumerate(starts):
            # Qwen3: the keep-history variant of its template (history "as generated")
            reference = {} if chat.history_template is None else dict(
                chat_template=chat.history_template)
            expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, **reference,
                                                     **template_kwargs)
            expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
            assert tokens[:start] == expected, (directory, env_name, b, t)
            checked += 1
            end = start
            while traj.agent_mask[b, end] > 0:
                end += 1
            assert tokens[end - 1] == codec.eot_id
            messages.append({"role": "assistant", "content": tokenizer.decode(
                tokens[start:end - 1])})
            reply = end + len(chat.reply_prefix)
            reply_end = reply
            while traj.observation_mask[b, reply_end] > 0 and tokens[reply_end] != \
                    codec.eot_id:
                reply_end += 1
            messages.append({"role": "user",
                             "content": tokenizer.decode(tokens[reply:reply_end])})
    return checked


def _train_and_export(standins, tmp_path, family, env_name, template_kwargs=None,
                      jsonl=None):
    config_file, standin = standins
    directory = standin(family)
    template_kwargs = dict(template_kwargs or {})
    env_kwargs = dict(ENV_KWARGS[env_name])
    if jsonl is not None:
        env_kwargs["path"] = jsonl
    flags = [f"--export_to={tmp_path / 'hf'}"]
    if template_kwargs:
        flags.append(f"--config.model.chat_template_kwargs={template_kwargs!r}")
    run = _train(config_file, directory, env_name, env_kwargs, tmp_path / "run", *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(os.listdir(directory))
    with open(tmp_path / "hf" / "generation_config.json", encoding="utf-8") as f:
        assert f.read() == open(os.path.join(directory, "generation_config.json"),
                                encoding="utf-8").read()
    turns = _context_is_the_template_every_turn(directory, env_name, env_kwargs,
                                                template_kwargs)
    max_turns = env_kwargs["max_turns"]
    assert turns >= 4 * min(max_turns, 2)  # later turns were checked where there are some


def test_llama31_trains_a_tool_env_through_the_cli_and_exports(standins, tmp_path):
    _train_and_export(standins, tmp_path, "llama3.1", "calculator")


@pytest.mark.slow
@pytest.mark.parametrize("family,env_name", [("qwen2", "guess_number"),
                                             ("qwen2", "calculator"),
                                             ("llama3.1", "guess_number")])
def test_families_train_multi_turn_and_tool_envs_through_the_cli(standins, tmp_path, family,
                                                                 env_name):
    _train_and_export(standins, tmp_path, family, env_name)


@pytest.mark.slow
@pytest.mark.parametrize("template_kwargs", [{}, {"enable_thinking": False}])
def test_qwen3_trains_one_turn_episodes_thinking_on_and_off(standins, tmp_path,
                                                           template_kwargs):
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"What is {a} plus {b}?",
                                         "answer": str(a + b)}) + "\n"
                             for a in range(1, 9) for b in (2, 5)))
    _train_and_export(standins, tmp_path, "qwen3", "dataset_task", template_kwargs,
                      jsonl=str(jsonl))
