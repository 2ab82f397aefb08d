"""Hugging Face checkpoints <-> arl `Transformer` parameters, without PyTorch.

A checkpoint directory holds `config.json` and either `model.safetensors` or a sharded
set `model-0000i-of-0000n.safetensors` listed in `model.safetensors.index.json`. Tensors
are read with the `safetensors` package's NumPy API (bfloat16 via `ml_dtypes`, which
ships with JAX) and placed on the mesh one parameter at a time with that parameter's
sharding, so no host ever holds more than one stacked parameter in memory.

Name and layout map (HF `nn.Linear.weight` is [out, in]; arl kernels are [in, out] with
the head axes split out; layer i of HF is row i of arl's stacked "layers" axis):

    model.embed_tokens.weight                [V, D]       -> embed_tokens/embedding  [V, D]
    model.layers.i.input_layernorm.weight    [D]          -> layers/input_layernorm/scale[i]
    model.layers.i.self_attn.q_proj.weight   [H*Dh, D]    -> .../q_proj/kernel[i] = W.T.reshape(D, H, Dh)
    model.layers.i.self_attn.q_proj.bias     [H*Dh]       -> .../q_proj/bias[i]   = b.reshape(H, Dh)
    (k_proj, v_proj likewise with KV heads)
    model.layers.i.self_attn.o_proj.weight   [D, H*Dh]    -> .../o_proj/kernel[i] = W.T.reshape(H, Dh, D)
    model.layers.i.post_attention_layernorm.weight        -> layers/post_attention_layernorm/scale[i]
    model.layers.i.mlp.{gate,up}_proj.weight [F, D]       -> layers/mlp/{gate,up}_proj/kernel[i] = W.T
    model.layers.i.mlp.down_proj.weight      [D, F]       -> layers/mlp/down_proj/kernel[i] = W.T
    model.norm.weight                        [D]          -> norm/scale
    lm_head.weight                           [V, D]       -> lm_head [D, V] = W.T (untied only)

Every step is a transpose/reshape, so export(import(x)) reproduces x bit for bit.
Supported `model_type`s: "llama" and "qwen2" (default RoPE only, SiLU MLP, no sliding
window); anything else raises naming the offending config field.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from arl.models.transformer import (LOGICAL_AXIS_RULES, Transformer, TransformerConfig,
                                    abstract_params, param_shardings)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
CONFIG_NAME = "config.json"
SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"



# ------------------------------------------------------------------------------ config


def _rope_theta(hf: dict) -> float:
    """rope_theta from either the classic top-level field or transformers>=5's
    `rope_parameters` dict; non-default RoPE scaling is rejected."""
    scaling = hf.get("rope_scaling")
    params = hf.get("rope_parameters")
    for field, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value:
            kind = value.get("rope_type", value.get("type", "default"))
            if kind != "default":
                raise ValueError(f"config.json: {field}.rope_type={kind!r} is not supported "
                                 f"(allowed: 'default')")
    if params and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(hf.get("rope_theta", 10000.0))


def config_from_hf(hf: dict, *, dtype=jnp.float32, param_dtype=None,
                   max_len: int | None = None, **overrides) -> TransformerConfig:
    """`TransformerConfig` of a Hugging Face `config.json` dict (llama or qwen2).

    dtype/param_dtype: activation and parameter dtypes (param_dtype defaults to dtype).
    max_len: KV-cache capacity (default: max_position_embeddings, capped at 4096 so a
    32k-context checkpoint does not ask for a 32k cache by default).
    overrides: any other TransformerConfig field (e.g. value_head=True, remat=True).
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json: model_type={model_type!r} is not supported "
                         f"(allowed: {SUPPORTED_MODEL_TYPES})")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act={act!r} is not supported (allowed: 'silu')")
    if hf.get("mlp_bias", False):
        raise ValueError("config.json: mlp_bias=True is not supported (allowed: False)")
    if hf.get("use_sliding_window", False):
        raise ValueError("config.json: use_sliding_window=True is not supported (allowed: False)")
    num_heads = int(hf["num_attention_heads"])
    d_model = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or d_model // num_heads
    if model_type == "qwen2":
        qkv_bias = True
    else:
        qkv_bias = bool(hf.get("attention_bias", False))
    if max_len is None:
        max_len = min(int(hf.get("max_position_embeddings", 4096)), 4096)
    fields: dict[str, Any] = dict(
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        mlp_dim=int(hf["intermediate_size"]),
        max_len=int(max_len),
        rope_theta=_rope_theta(hf),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        dtype=dtype,
        param_dtype=dtype if param_dtype is None else param_dtype,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def config_to_hf(config: TransformerConfig, model_type: str = "llama") -> dict:
    """A `config.json` dict that transformers' LlamaForCausalLM / Qwen2ForCausalLM load."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
    if model_type == "qwen2" and not config.qkv_bias:
        raise ValueError("model_type='qwen2' requires config.qkv_bias=True (Qwen2 always has "
                         "q/k/v biases); use model_type='llama' with attention_bias instead")
    if config.value_head:
        raise ValueError("config.value_head=True has no Hugging Face equivalent; export the "
                         "policy without the value head")
    dtype_name = jnp.dtype(config.param_dtype).name
    hf = {
        "architectures": ["LlamaForCausalLM" if model_type == "llama" else "Qwen2ForCausalLM"],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.resolved_head_dim,
        "intermediate_size": config.mlp_dim,
        "max_position_embeddings": config.max_len,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "initializer_range": config.initializer_range,
        "torch_dtype": dtype_name,
    }
    if model_type == "llama":
        hf["attention_bias"] = config.qkv_bias
        hf["mlp_bias"] = False
    else:
        hf["use_sliding_window"] = False
    return hf


# ----------------------------------------------------------------------------- mapping


def _hf_layout(config: TransformerConfig):
    """[(arl path, hf name template, to_arl, to_hf)] for every parameter of `config`.

    Templates with "{i}" are per layer (stacked on arl's leading axis); to_arl maps one HF
    tensor (one layer) to the arl slice, to_hf is its exact inverse.
    """
    D, H, KV = config.d_model, config.num_heads, config.num_kv_heads
    Dh = config.resolved_head_dim
    prefix = "model.layers.{i}."

    def in_heads(n):  # [n*Dh, D] -> [D, n, Dh]
        return (lambda w: w.T.reshape(D, n, Dh), lambda k: k.reshape(D, n * Dh).T)

    def heads_bias(n):
        return (lambda b: b.reshape(n, Dh), lambda b: b.reshape(n * Dh))

    transpose = (lambda w: w.T, lambda k: k.T)
    same = (lambda x: x, lambda x: x)
    out_proj = (lambda w: w.T.reshape(H, Dh, D), lambda k: k.reshape(H * Dh, D).T)

    layout = [(("embed_tokens", "embedding"), "model.embed_tokens.weight", *same)]
    per_layer = [
        (("input_layernorm", "scale"), "input_layernorm.weight", *same),
        (("self_attn", "q_proj", "kernel"), "self_attn.q_proj.weight", *in_heads(H)),
        (("self_attn", "k_proj", "kernel"), "self_attn.k_proj.weight", *in_heads(KV)),
        (("self_attn", "v_proj", "kernel"), "self_attn.v_proj.weight", *in_heads(KV)),
        (("self_attn", "o_proj", "kernel"), "self_attn.o_proj.weight", *out_proj),
        (("post_attention_layernorm", "scale"), "post_attention_layernorm.weight", *same),
        (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", *transpose),
        (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", *transpose),
        (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", *transpose),
    ]
    if config.qkv_bias:
        per_layer += [
            (("self_attn", "q_proj", "bias"), "self_attn.q_proj.bias", *heads_bias(H)),
            (("self_attn", "k_proj", "bias"), "self_attn.k_proj.bias", *heads_bias(KV)),
            (("self_attn", "v_proj", "bias"), "self_attn.v_proj.bias", *heads_bias(KV)),
        ]
    layout += [(("layers",) + path, prefix + name, a, b) for path, name, a, b in per_layer]
    layout.append((("norm", "scale"), "model.norm.weight", *same))
    if not config.tie_embeddings:
        layout.append((("lm_head",), "lm_head.weight", *transpose))
    return layout


def _nested_set(tree: dict, path: tuple, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _nested_get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


# ------------------------------------------------------------------------------ reading


class _TensorReader:
    """name -> np.ndarray over one or several safetensors files (lazily opened)."""

    def __init__(self, directory: str):
        index_path = os.path.join(directory, INDEX_NAME)
        single_path = os.path.join(directory, SINGLE_FILE_NAME)
        if os.path.exists(index_path):
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            self._file_of = {name: os.path.join(directory, fname)
                             for name, fname in weight_map.items()}
        elif os.path.exists(single_path):
            with safe_open(single_path, framework="numpy") as f:
                self._file_of = {name: single_path for name in f.keys()}
        else:
            raise FileNotFoundError(f"directory {directory!r} has neither {SINGLE_FILE_NAME} "
                                    f"nor {INDEX_NAME}")
        self._handles: dict[str, Any] = {}

    def names(self):
        return set(self._file_of)

    def get(self, name: str) -> np.ndarray:
        if name not in self._file_of:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="numpy")
        return self._handles[path].get_tensor(name)


def load_hf_config(directory: str, **kwargs) -> TransformerConfig:
    """`config_from_hf` of `directory/config.json` (kwargs as in `config_from_hf`)."""
    with open(os.path.join(directory, CONFIG_NAME), encoding="utf-8") as f:
        return config_from_hf(json.load(f), **kwargs)


def load_hf_checkpoint(directory: str, config: TransformerConfig | None = None,
                       mesh: jax.sharding.Mesh | None = None,
                       rules=LOGICAL_AXIS_RULES, **config_kwargs):
    """(config, params) of a Hugging Face checkpoint directory.

    params are plain (unboxed) arrays in config.param_dtype. With `mesh`, every
    parameter is placed with `param_shardings(abstract_params(model), mesh, rules)`
    as soon as it is assembled; without, on the default device.
    config: use this TransformerConfig instead of reading config.json (it must agree
    with the tensors' shapes); config_kwargs go to `config_from_hf` otherwise.
    Unused checkpoint tensors (e.g. rotary inv_freq buffers) are ignored; a missing one
    raises KeyError naming it.
    """
    if config is None:
        config = load_hf_config(directory, **config_kwargs)
    elif config_kwargs:
        raise ValueError(f"pass either config or config kwargs, not both: {sorted(config_kwargs)}")
    reader = _TensorReader(directory)
    boxed = abstract_params(Transformer(config))
    shardings = param_shardings(boxed, mesh, rules) if mesh is not None else None
    shapes = nn.unbox(boxed)
    param_dtype = jnp.dtype(config.param_dtype)
    params: dict = {}
    for path, name, to_arl, _ in _hf_layout(config):
        expected = _nested_get(shapes, path).shape
        if "{i}" in name:
            value = np.stack([to_arl(reader.get(name.format(i=i)))
                              for i in range(config.num_layers)])
        else:
            value = to_arl(reader.get(name))
        if value.shape != expected:
            raise ValueError(f"tensor {name!r} maps to shape {value.shape} but the config "
                             f"expects {expected} at {'/'.join(path)}")
        value = np.ascontiguousarray(value.astype(param_dtype))
        if shardings is not None:
            array = jax.device_put(value, _nested_get(shardings, path))
        else:
            array = jnp.asarray(value)
        _nested_set(params, path, array)
    return config, params


# ------------------------------------------------------------------------------ writing


def hf_state_dict(params, config: TransformerConfig) -> dict[str, np.ndarray]:
    """The Hugging Face tensor dict (name -> host array, params' own dtype) of `params`."""
    params = nn.unbox(params)
    tensors = {}
    for path, name, _, to_hf in _hf_layout(config):
        value = np.asarray(jax.device_get(_nested_get(params, path)))
        if "{i}" in name:
            for i in range(config.num_layers):
                tensors[name.format(i=i)] = np.ascontiguousarray(to_hf(value[i]))
        else:
            tensors[name] = np.ascontiguousarray(to_hf(value))
    return tensors


def save_hf_checkpoint(directory: str, params, config: TransformerConfig,
                       model_type: str = "llama", max_shard_bytes: int | None = None) -> None:
    """Write `config.json` and safetensors that transformers (and `load_hf_checkpoint`)
    read. With `max_shard_bytes`, tensors are split over `model-0000i-of-0000n.safetensors`
    files of at most that many bytes each (a tensor larger than that gets its own file)
    plus `model.safetensors.index.json`; otherwise one `model.safetensors`."""
    hf = config_to_hf(config, model_type)
    tensors = hf_state_dict(params, config)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)
    metadata = {"format": "pt"}  # transformers refuses files without it
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(directory, SINGLE_FILE_NAME), metadata=metadata)
        return
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive int or None, got {max_shard_bytes}")
    shards: list[dict] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, fname), metadata=metadata)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": int(sum(v.nbytes for v in tensors.values()))},
             "weight_map": weight_map}
    with open(os.path.join(directory, INDEX_NAME), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
