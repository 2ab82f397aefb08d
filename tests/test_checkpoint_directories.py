"""Bad checkpoint directories, through the command line: each is refused with one line
naming the field and the file, exit status 2, before anything is written to the workdir
(the checks are `arl.config.validate`'s: they run before the experiment loop, so these
runs end before anything is compiled).

The directories are copies of a Qwen2.5-style stand-in (tests/hf_standins.py) with one
thing broken each, as users' directories arrive: the tokenizer files left behind, a
download cut short, a header overwritten, a config.json from another model size.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from arl import config as config_lib  # noqa: E402
from arl.models import hf_import  # noqa: E402
from tests.hf_standins import build_standin  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = "configs/grpo_hf_checkpoint.py"


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return build_standin(str(tmp_path_factory.mktemp("source") / "qwen"), "qwen2")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {a} plus {b}?",
                                        "answer": str(a + b)}) + "\n"
                            for a in range(1, 9) for b in (2, 5)))
    return str(path)


def _broken_copy(standin, tmp_path, breakage):
    directory = str(tmp_path / "checkpoint")
    shutil.copytree(standin, directory)
    breakage(directory)
    return directory


def _train(directory, tasks, workdir, *extra):
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", f"--config={_CONFIG}:{directory}",
         f"--config.env.kwargs.path={tasks}", f"--workdir={workdir}", *extra],
        cwd=_ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300,
        check=False)


def _no_tokenizer(directory):
    os.remove(os.path.join(directory, "tokenizer.json"))


def _truncated(directory):
    path = os.path.join(directory, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)  # a download cut short


def _garbled_header(directory):
    with open(os.path.join(directory, "model.safetensors"), "r+b") as f:
        f.seek(8)  # the JSON header starts after its 8-byte length
        f.write(b"\x00garbage\xff" * 4)


def _wrong_hidden_size(directory):
    path = os.path.join(directory, "config.json")
    with open(path, encoding="utf-8") as f:
        fields = json.load(f)
    fields["hidden_size"] = 48  # the weights are 32 wide
    with open(path, "w", encoding="utf-8") as f:
        json.dump(fields, f)


def _config_not_json(directory):
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        f.write('{"model_type": "qwen2",')


def _missing_shard(directory):
    """A sharded checkpoint whose index names a file that was never downloaded."""
    _, params = hf_import.load_hf_checkpoint(directory)
    os.remove(os.path.join(directory, "model.safetensors"))
    config = hf_import.load_hf_config(directory)
    hf_import.write_tensors(directory, hf_import.hf_state_dict(params, config),
                            max_shard_bytes=40_000)
    shards = sorted(f for f in os.listdir(directory) if f.startswith("model-0"))
    assert len(shards) > 2, shards
    os.remove(os.path.join(directory, shards[1]))


@pytest.mark.parametrize("breakage, says", [
    (_no_tokenizer, ["has no tokenizer.json", "config.env ('dataset_task')",
                     "config.env.kwargs.codec"]),
    (_truncated, ["model.safetensors' is unreadable", "file not fully covered"]),
    (_garbled_header, ["model.safetensors' is unreadable", "deserializing header"]),
    (_wrong_hidden_size, ["'model.embed_tokens.weight' has shape (384, 32) but the config "
                          "expects (384, 48)"]),
    (_config_not_json, ["config.json' is not JSON"]),
    (_missing_shard, ["/model-00002-of-0000", ".safetensors' is unreadable",
                      "No such file"]),
], ids=lambda x: getattr(x, "__name__", "")[1:] if callable(x) else "")
def test_bad_directory_is_one_line_and_writes_nothing(standin, tasks, tmp_path, breakage,
                                                      says):
    directory = _broken_copy(standin, tmp_path, breakage)
    workdir = tmp_path / "run"
    result = _train(directory, tasks, workdir)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(
        f"experiments.train: error: config.model.hf_checkpoint={directory!r} is invalid: "), \
        lines[0]
    for words in says:
        assert words in lines[0], lines[0]
    assert not workdir.exists()  # not even an empty checkpoints/


def test_a_weights_only_directory_takes_an_explicit_codec(standin, tasks, tmp_path):
    """Without tokenizer.json the env may name the model's tokenizer itself; the envs
    that take no codec (vector envs) never needed one."""
    directory = _broken_copy(standin, tmp_path, _no_tokenizer)
    config = __import__("configs.grpo_hf_checkpoint", fromlist=["x"]).get_config(directory)
    config.env.kwargs.path = tasks
    with pytest.raises(config_lib.ConfigError, match="has no tokenizer.json"):
        config_lib.validate(config)
    tokenizer_dir = str(tmp_path / "tokenizer")  # e.g. the base model's tokenizer files
    shutil.copytree(standin, tokenizer_dir,
                    ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
    config.env.kwargs.codec = tokenizer_dir
    config_lib.validate(config)  # accepted
    from arl import envs  # pylint: disable=g-import-not-at-top
    env = envs.make_env(config.env, codec=envs.checkpoint_codec(config))
    import tokenizers  # pylint: disable=g-import-not-at-top
    want = tokenizers.Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    # the stand-in's tokenizer (360 learned tokens plus its seam merges), not a character codec
    assert env.codec.vocab_size == want.get_vocab_size() > 256


def test_garbled_weights_are_one_error_naming_the_file_and_tensor(standin, tmp_path):
    """Bytes overwritten inside the data (the header intact) are found as the tensor is
    read: NaN/inf, which no trained checkpoint stores."""
    directory = _broken_copy(standin, tmp_path, lambda d: None)
    path = os.path.join(directory, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 1024)
        f.write(b"\xff" * 256)  # float32 0xffffffff is a NaN
    hf_import.check_hf_checkpoint(directory)  # the headers are fine
    with pytest.raises(hf_import.CheckpointFileError,
                       match=rf"'{path}' is garbled: tensor '\S+' holds 64 non-finite"):
        hf_import.load_hf_checkpoint(directory)
    _, params = hf_import.load_hf_checkpoint(standin)  # the source reads clean
    assert all(np.isfinite(np.asarray(x, np.float32)).all()
               for x in __import__("jax").tree.leaves(params))
