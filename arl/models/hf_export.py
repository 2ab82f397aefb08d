"""A trained policy as a complete Hugging Face directory, next to the one it came from.

    export_checkpoint(out_dir, params, config, source_dir)

writes what `transformers.AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load as they loaded `source_dir`:

* the weights (`hf_import.hf_state_dict`: exactly the tensors the config declares, LoRA
  adapters already merged by the caller), in the trained parameter dtype or `dtype`;
* the source's `config.json` with every field kept except what the run changed: the
  dtype field (`dtype` / `torch_dtype`, whichever the source writes; added if neither)
  when the weights' dtype differs from it. The architecture read back from the kept
  file must equal the trained one (`hf_import.config_from_hf`), else nothing is
  written;
* every other file of the source (tokenizer.json, tokenizer_config.json,
  chat_template.jinja, generation_config.json, special_tokens_map.json, vocab/merges
  files, ...) copied byte for byte; the source's weight files are not.

The directory is written under a temporary name beside `out_dir` and renamed into place
at the end, so an interrupted export leaves no half-written directory; an existing
non-empty `out_dir` is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import jax.numpy as jnp

from arl.models import hf_import
from arl.models.transformer_config import TransformerConfig

# Files of a checkpoint directory that hold weights (never copied from the source).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
DTYPE_FIELDS = ("dtype", "torch_dtype")  # transformers >= 4.56 writes "dtype"


def _is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name in WEIGHT_INDEXES


def exported_config(source: dict, config: TransformerConfig, dtype) -> dict:
    """The source's config.json dict with its dtype field set to `dtype` (the only field
    an RL run changes); ValueError if the source's architecture is not `config`'s."""
    read_back = hf_import.config_from_hf(source, max_len=config.max_len)
    trained = dataclasses.replace(config, value_head=False, token_vocab_size=0)
    fields = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
              "resolved_head_dim", "mlp_dim", "rope_theta", "norm_eps", "qkv_bias",
              "o_bias", "mlp_bias", "tie_embeddings", "qk_norm", "rope_scaling")
    differ = [f for f in fields if getattr(read_back, f) != getattr(trained, f)]
    if differ:
        raise ValueError(f"the trained model differs from the source config.json in "
                         f"{differ}: export it with hf_import.save_hf_checkpoint instead")
    out = dict(source)
    name = jnp.dtype(dtype).name
    present = [f for f in DTYPE_FIELDS if f in out]
    for field in present or ["torch_dtype"]:
        out[field] = name
    return out


def export_checkpoint(out_dir: str, params, config: TransformerConfig, source_dir: str, *,
                      dtype=None, max_shard_bytes: int | None = None) -> str:
    """Writes the complete directory (module docstring) and returns its path.

    params: the policy's plain parameters (LoRA merged; a value head is dropped).
    config: the trained `TransformerConfig`. source_dir: the checkpoint the run started
    from (`config.model.hf_checkpoint`). dtype: of the written weights (default: the
    parameters' own). max_shard_bytes: as in `hf_import.save_hf_checkpoint`."""
    source_dir = os.fspath(source_dir)
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir!r} exists and is not an empty directory")
    with open(os.path.join(source_dir, hf_import.CONFIG_NAME), encoding="utf-8") as f:
        source = json.load(f)
    params = {k: v for k, v in dict(params).items() if k != "value_head"}
    export_config = dataclasses.replace(config, value_head=False, token_vocab_size=0)
    tensors = hf_import.hf_state_dict(params, export_config)
    dtype = jnp.dtype(config.param_dtype if dtype is None else dtype)
    tensors = {name: value.astype(dtype) for name, value in tensors.items()}
    hf = exported_config(source, export_config, dtype)

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}-", dir=parent)
    try:
        for name in sorted(os.listdir(source_dir)):
            path = os.path.join(source_dir, name)
            if (os.path.isfile(path) and name != hf_import.CONFIG_NAME
                    and not _is_weight_file(name)):
                shutil.copy2(path, os.path.join(scratch, name))
        with open(os.path.join(scratch, hf_import.CONFIG_NAME), "w", encoding="utf-8") as f:
            json.dump(hf, f, indent=2)
            f.write("\n")
        hf_import.write_tensors(scratch, tensors, max_shard_bytes)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.replace(scratch, out_dir)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return out_dir


def changed_fields(source_dir: str, exported_dir: str) -> dict[str, tuple]:
    """{field: (source value, exported value)} of the config.json fields that differ."""
    def read(directory):
        with open(os.path.join(directory, hf_import.CONFIG_NAME), encoding="utf-8") as f:
            return json.load(f)
    a, b = read(source_dir), read(exported_dir)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
