"""Export to a complete Hugging Face directory: `transformers` loads the result as it
loaded the source (Qwen2.5-style stand-in: tokenizer, chat template, generation config),
its logits equal arl's to 1e-4 in float32, `generate()` stops at `<|im_end|>`, and
config.json differs from the source's only in what the run changed (the dtype)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from arl.models import hf_export, hf_import  # noqa: E402
from arl.models import lora as lora_lib  # noqa: E402
from arl.models.transformer import Transformer  # noqa: E402
from tests.hf_standins import build_standin  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_standin(str(tmp_path_factory.mktemp("source") / "qwen"), "qwen2")


def _trained(source):
    """The source's weights after a (simulated) run: LoRA adapters with random B merged in,
    as `Policy.merge` does, plus a nudge of every parameter."""
    config, params = hf_import.load_hf_checkpoint(source)
    lora = lora_lib.LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj"))
    adapters = lora_lib.init_lora(jax.random.key(0), params, lora)
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape),
                            adapters)
    merged = lora_lib.merge_lora(params, adapters, lora)
    leaves, tree = jax.tree.flatten(merged)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    merged = jax.tree.unflatten(tree, [x + 0.01 * jax.random.normal(k, x.shape, x.dtype)
                                       for x, k in zip(leaves, keys)])
    return config, jax.device_get(merged)


def _im_end_at(step):
    """A logits processor that forces <|im_end|> as the `step`-th new token."""
    class Force(transformers.LogitsProcessor):
        def __init__(self, prompt_len, token):
            self.prompt_len, self.token = prompt_len, token

        def __call__(self, input_ids, scores):
            if input_ids.shape[1] - self.prompt_len == step:
                scores = torch.full_like(scores, -float("inf"))
                scores[:, self.token] = 0.0
            return scores
    return Force


def test_exported_directory_loads_in_transformers_with_logit_parity(source, tmp_path):
    config, params = _trained(source)
    out = hf_export.export_checkpoint(str(tmp_path / "out"), params, config, source)
    # Everything but the weights is the source's, byte for byte; config.json unchanged
    # (a float32 run of a float32 source changes nothing).
    names = sorted(os.listdir(out))
    assert names == sorted(os.listdir(source))
    for name in names:
        if name not in ("model.safetensors", "config.json"):
            with open(os.path.join(source, name), "rb") as a, open(os.path.join(out, name),
                                                                   "rb") as b:
                assert a.read() == b.read(), name
    assert hf_export.changed_fields(source, out) == {}

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    source_tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    messages = [{"role": "user", "content": "What is 12 plus 30?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expected_ids = source_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                        tokenize=True)
    assert ids == list(expected_ids["input_ids"] if hasattr(expected_ids, "keys")
                       else expected_ids)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    ours = np.asarray(Transformer(config).apply({"params": params}, jnp.asarray([ids])).logits[0])
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    # The weights are the trained ones, not the source's.
    _, source_params = hf_import.load_hf_checkpoint(source)
    assert not np.allclose(np.asarray(source_params["norm"]["scale"]),
                           np.asarray(params["norm"]["scale"]))

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in model.generation_config.eos_token_id
    prompt = torch.tensor([ids])
    generated = model.generate(prompt, max_new_tokens=12, do_sample=False,
                               logits_processor=[_im_end_at(3)(len(ids), im_end)])
    new = generated[0, len(ids):].tolist()
    assert new[:4][-1] == im_end and len(new) == 4  # stopped at the end-of-turn token


def test_export_in_another_dtype_changes_only_the_dtype_field(source, tmp_path):
    config, params = _trained(source)
    out = hf_export.export_checkpoint(str(tmp_path / "bf16"), params, config, source,
                                      dtype=jnp.bfloat16)
    changed = hf_export.changed_fields(source, out)
    assert set(changed) <= set(hf_export.DTYPE_FIELDS) and changed
    assert all(new == "bfloat16" for _, new in changed.values())
    reloaded, reloaded_params = hf_import.load_hf_checkpoint(out)
    assert reloaded == config
    np.testing.assert_array_equal(
        np.asarray(reloaded_params["norm"]["scale"]),
        np.asarray(jnp.asarray(params["norm"]["scale"]).astype(jnp.bfloat16)).astype(np.float32))


def test_export_refuses_a_non_empty_target_and_writes_nothing_on_failure(source, tmp_path):
    config, params = _trained(source)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        hf_export.export_checkpoint(str(taken), params, config, source)
    assert os.listdir(taken) == ["keep.txt"]
    wrong = dict(params)
    wrong.pop("norm")
    with pytest.raises(ValueError, match="lacks parameters"):
        hf_export.export_checkpoint(str(tmp_path / "never"), wrong, config, source)
    assert not [n for n in os.listdir(tmp_path) if n.startswith((".never", "never"))]


def _cli(program, *args):
    return subprocess.run([sys.executable, "-m", program, *args], cwd=_ROOT,
                          env=dict(os.environ), capture_output=True, text=True, timeout=900,
                          check=False)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3"])
def test_one_command_from_a_checkpoint_and_jsonl_to_an_exported_directory(family, tmp_path):
    """The README recipe through the CLI at stand-in sizes (Qwen2.5-, Qwen3- and
    Llama-3-style directories): GRPO for 2 steps from the directory and a JSONL file,
    evaluate the held-out split (every row once), export, load with transformers."""
    source = build_standin(str(tmp_path / "source"), family)
    user_turn = {"llama3": "<|start_header_id|>user<|end_header_id|>\n\nWhat is"}.get(
        family, "<|im_start|>user\nWhat is")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"What is {a} plus {b}?",
                                         "answer": str(a + b)}) + "\n"
                             for a in range(1, 9) for b in (2, 5)))
    workdir, out = tmp_path / "run", tmp_path / "hf"
    train = _cli("experiments.train", f"--config=configs/grpo_hf_checkpoint.py:{source}",
                 f"--config.env.kwargs.path={tasks}", f"--workdir={workdir}",
                 "--config.train_steps=2", "--config.checkpoint_every=2",
                 "--config.rollout.num_tasks=2", "--config.rollout.group_size=2",
                 "--config.env.kwargs.action_len=6", "--config.model.dtype=float32",
                 "--config.model.param_dtype=float32", "--config.model.remat=False",
                 "--config.model.logprob_chunk=0", "--config.sample_every=2",
                 f"--export_to={tmp_path / 'hf_final'}",
                 # Qwen3's template drops earlier turns' <think>: one-turn episodes only.
                 *(["--config.env.kwargs.max_turns=1"] if family == "qwen3" else []))
    assert train.returncode == 0, train.stderr[-3000:]
    sample = (workdir / "samples" / "step_000002.txt").read_text()
    assert user_turn in sample and "<bos>" not in sample
    evaluate = _cli("experiments.evaluate", f"--workdir={workdir}", "--split=eval",
                    "--num_transcripts=1")
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    # 16 rows, 10% held out: both eval rows, each once, per policy.
    assert "every row of the 'eval' split once (2 rows)" in evaluate.stdout
    assert [line.split()[2] for line in evaluate.stdout.splitlines()
            if line.startswith(("greedy", "sampled", "oracle"))] == ["2", "2", "2"]
    export = _cli("experiments.export", f"--workdir={workdir}", f"--out={out}", "--step=2")
    assert export.returncode == 0, export.stderr[-3000:]
    # train --export_to wrote the same directory (the newest step is 2).
    for name in os.listdir(out):
        assert (tmp_path / "hf_final" / name).read_bytes() == (out / name).read_bytes(), name
    assert hf_export.changed_fields(source, str(out)) == {}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                    "llama3": "LlamaForCausalLM"}[family]
    _, params = hf_import.load_hf_checkpoint(str(out))
    config = hf_import.load_hf_config(str(out))
    ids = [[1, 5, 9, 40, 41, 2]]
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits[0].numpy()
    ours = np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(ids)).logits[0])
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


def test_train_export_to_needs_a_checkpoint_run(tmp_path):
    result = _cli("experiments.train", "--config=configs/grpo_bandit.py",
                  f"--workdir={tmp_path / 'run'}", f"--export_to={tmp_path / 'hf'}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "exports next to config.model.hf_checkpoint" in lines[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "hf").exists()
