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
    model.layers.i.self_attn.o_proj.bias     [D]          -> .../o_proj/bias[i]
    model.layers.i.post_attention_layernorm.weight        -> layers/post_attention_layernorm/scale[i]
    model.layers.i.mlp.{gate,up}_proj.weight [F, D]       -> layers/mlp/{gate,up}_proj/kernel[i] = W.T
    model.layers.i.mlp.down_proj.weight      [D, F]       -> layers/mlp/down_proj/kernel[i] = W.T
    model.layers.i.mlp.{gate,up,down}_proj.bias           -> layers/mlp/{...}/bias[i]
    model.norm.weight                        [D]          -> norm/scale
    lm_head.weight                           [V, D]       -> lm_head [D, V] = W.T (untied only)
    model.layers.i.self_attn.{q,k}_norm.weight [Dh]       -> .../{q,k}_norm/scale[i] (qwen3)

Which biases exist follows the architecture, as in transformers' modeling code:

    model_type  config.json               q/k/v bias   o_proj bias   MLP biases
    qwen2       (always)                  yes          no            no
    llama       attention_bias=True       yes          yes           -
    llama       mlp_bias=True             -            -             yes
    qwen3       attention_bias=True       yes          yes           no (+ q/k norms)

i.e. `TransformerConfig(qkv_bias, o_bias, mlp_bias)`.

Strictness. Import is all-or-nothing:
  * every tensor the model needs must be in the checkpoint, and every tensor in the
    checkpoint must be used, else `CheckpointMismatchError` naming them (first few and
    the count). Two kinds of extra tensors are checked rather than used: rotary
    `inv_freq` buffers (older checkpoints) must equal theta^(-2i/head_dim), and a
    `lm_head.weight` next to tied embeddings must equal the embedding bit for bit;
  * every tensor's shape is checked against the config before anything is read;
  * config.json fields that change the function and are not implemented raise
    ValueError naming the field and its value: model_type other than llama / qwen2 /
    qwen3 (dense), hidden_act other than silu, RoPE scaling of any type but "default"
    and "llama3" (and parameters the type does not take), a Qwen2 / Qwen3 sliding
    window that some layer actually uses, and
    quantization_config. Fields that leave the function unchanged are ignored:
    attention_dropout (dropout is off in evaluation; arl never applies it),
    pretraining_tp (a different summation order of the same products), token ids,
    use_cache, dtype.
The config.json <-> TransformerConfig mapping is `arl.models.hf_config` (re-exported
here); a complete directory next to a source checkpoint is `arl.models.hf_export`.
Export writes exactly the tensors the config declares, and a config.json whose flags
declare exactly those, so `transformers` loads it with no missing or unexpected keys.
Every step is a transpose/reshape, so export(import(x)) reproduces x bit for bit.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

# The config.json <-> TransformerConfig mapping lives in hf_config; its names are part
# of this module's interface.
from arl.models.hf_config import (LLAMA3_ROPE_FIELDS, QWEN2_DEFAULT_MAX_WINDOW_LAYERS,  # noqa: F401
                                  QWEN2_DEFAULT_SLIDING_WINDOW, SUPPORTED_MODEL_TYPES,
                                  config_from_hf, config_to_hf)
from arl.models.rope import scaled_inverse_frequencies
from arl.models.transformer import (LOGICAL_AXIS_RULES, Transformer, TransformerConfig,
                                    abstract_params, param_shardings)

CONFIG_NAME = "config.json"
SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# How many tensor names an error message lists before "(and N more)".
NAMES_SHOWN = 5


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors are not exactly the ones the model config declares."""


class CheckpointFileError(ValueError):
    """A weights file (or the shard index) cannot be read as what it claims to be:
    missing, truncated, a garbled header, or non-finite values. The message names the
    file."""


def _unreadable(path: str, error: BaseException) -> CheckpointFileError:
    reason = " ".join(str(error).split()) or type(error).__name__
    return CheckpointFileError(f"checkpoint file {path!r} is unreadable (truncated, garbled "
                               f"or not safetensors): {reason}")


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
    if config.o_bias:
        per_layer.append((("self_attn", "o_proj", "bias"), "self_attn.o_proj.bias", *same))
    if config.qk_norm:
        per_layer += [(("self_attn", "q_norm", "scale"), "self_attn.q_norm.weight", *same),
                      (("self_attn", "k_norm", "scale"), "self_attn.k_norm.weight", *same)]
    if config.mlp_bias:
        per_layer += [(("mlp", proj, "bias"), f"mlp.{proj}.bias", *same)
                      for proj in ("gate_proj", "up_proj", "down_proj")]
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
    """name -> np.ndarray over one or several safetensors files (lazily opened).

    Every file is opened (its header parsed and checked against the file's length by
    `safe_open`) when the reader is made, so a truncated or garbled file is reported,
    as `CheckpointFileError` naming it, before any tensor is read."""

    def __init__(self, directory: str):
        index_path = os.path.join(directory, INDEX_NAME)
        single_path = os.path.join(directory, SINGLE_FILE_NAME)
        if os.path.exists(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                self._file_of = {name: os.path.join(directory, fname)
                                 for name, fname in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                raise _unreadable(index_path, error) from error
        elif os.path.exists(single_path):
            self._file_of = {name: single_path
                             for name in self._open(single_path).keys()}
        else:
            raise FileNotFoundError(f"directory {directory!r} has neither {SINGLE_FILE_NAME} "
                                    f"nor {INDEX_NAME}")
        self._handles: dict[str, Any] = {}
        for path in sorted(set(self._file_of.values())):
            self._handles[path] = self._open(path)
        for path, handle in self._handles.items():
            listed = {n for n, p in self._file_of.items() if p == path}
            absent = listed - set(handle.keys())
            if absent:
                raise _unreadable(path, ValueError(
                    f"{INDEX_NAME} places {_listing(absent)} in it, which it does not hold"))

    @staticmethod
    def _open(path: str):
        try:
            return safe_open(path, framework="numpy")
        except (SafetensorError, OSError) as error:
            raise _unreadable(path, error) from error

    def names(self):
        return set(self._file_of)

    def file(self, name: str) -> str:
        if name not in self._file_of:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape from the file header, without reading the data."""
        return tuple(self._handles[self.file(name)].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """The tensor, read from its file; `CheckpointFileError` naming the file when
        it cannot be read or holds inf or NaN (garbled bytes: no checkpoint stores
        them)."""
        path = self.file(name)
        try:
            value = self._handles[path].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as error:
            raise _unreadable(path, error) from error
        if value.dtype.kind == "f" or value.dtype == jnp.bfloat16:
            finite = np.isfinite(value.astype(np.float32) if value.dtype.itemsize < 4
                                 else value)
            if not finite.all():
                raise CheckpointFileError(
                    f"checkpoint file {path!r} is garbled: tensor {name!r} holds "
                    f"{int(finite.size - finite.sum())} non-finite values (inf or NaN)")
        return value


def _natural_key(name: str):
    """Sort "layers.2" before "layers.10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _listing(names) -> str:
    """'N tensors: 'a', 'b', ... (and M more)' for an error message."""
    names = sorted(names, key=_natural_key)
    shown = ", ".join(repr(n) for n in names[:NAMES_SHOWN])
    more = f" (and {len(names) - NAMES_SHOWN} more)" if len(names) > NAMES_SHOWN else ""
    return f"{len(names)} tensor{'s' if len(names) != 1 else ''}: {shown}{more}"


def _expected_names(config: TransformerConfig) -> list[str]:
    names = []
    for _, name, _, _ in _hf_layout(config):
        if "{i}" in name:
            names += [name.format(i=i) for i in range(config.num_layers)]
        else:
            names.append(name)
    return names


_INV_FREQ = re.compile(r"(model\.layers\.(\d+)\.self_attn\.|model\.)rotary_emb\.inv_freq")


def _checked_extras(reader: _TensorReader, extra: set, config: TransformerConfig) -> set:
    """The extra checkpoint tensors that are redundant copies of what the config already
    says (removed from `extra` when they agree, an error when they do not):
    rotary inv_freq buffers must equal theta^(-2i/head_dim) (to a few ulps of their
    dtype: transformers computes them in float32), and lm_head.weight next to tied
    embeddings must equal model.embed_tokens.weight exactly."""
    extra = set(extra)
    dh = config.resolved_head_dim
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh)
    if config.rope_scaling is not None:
        inv_freq = scaled_inverse_frequencies(dh, config.rope_theta,
                                              config.rope_scaling).astype(np.float64)
    for name in sorted(extra, key=_natural_key):
        match = _INV_FREQ.fullmatch(name)
        if match and (match.group(2) is None or int(match.group(2)) < config.num_layers):
            stored = reader.get(name)
            tolerance = max(1e-5, 4 * float(jnp.finfo(stored.dtype).eps))
            if stored.shape != inv_freq.shape or not np.allclose(
                    stored.astype(np.float64), inv_freq, rtol=tolerance, atol=0):
                raise CheckpointMismatchError(
                    f"checkpoint tensor {name!r} (RoPE inverse frequencies) does not match "
                    f"rope_theta={config.rope_theta}, head_dim={dh}: got "
                    f"{np.asarray(stored).ravel()[:4]}..., expected {inv_freq[:4]}...")
            extra.discard(name)
    if config.tie_embeddings and "lm_head.weight" in extra \
            and "model.embed_tokens.weight" in reader.names():
        if not np.array_equal(reader.get("lm_head.weight"),
                              reader.get("model.embed_tokens.weight")):
            raise CheckpointMismatchError(
                "checkpoint has tie_word_embeddings=True but its lm_head.weight differs "
                "from model.embed_tokens.weight; load it with tie_word_embeddings=False")
        extra.discard("lm_head.weight")
    return extra


def _check_names_and_shapes(reader: _TensorReader, config: TransformerConfig,
                            shapes, directory: str, head_tensors=()) -> None:
    """CheckpointMismatchError unless the checkpoint holds exactly the config's tensors
    (up to `_checked_extras`, and `head_tensors`, which the caller reads itself) with the
    shapes the config implies."""
    expected = _expected_names(config)
    present = reader.names() - set(head_tensors)
    missing = [n for n in expected if n not in present]
    unexpected = _checked_extras(reader, present - set(expected), config)
    if missing or unexpected:
        flags = (f"qkv_bias={config.qkv_bias}, o_bias={config.o_bias}, "
                 f"mlp_bias={config.mlp_bias}, tie_embeddings={config.tie_embeddings}, "
                 f"num_layers={config.num_layers}")
        parts = []
        if missing:
            parts.append(f"missing {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected (the model would not use them) {_listing(unexpected)}")
        raise CheckpointMismatchError(
            f"checkpoint {directory!r} does not match the model config ({flags}): "
            + "; ".join(parts) + ". Biases follow config.json's attention_bias / mlp_bias "
            "(llama) or are q/k/v only (qwen2); nothing is dropped or zero-filled silently.")
    for path, name, _, to_hf in _hf_layout(config):
        arl_shape = _nested_get(shapes, path).shape
        per_layer = "{i}" in name
        hf_shape = jax.eval_shape(
            to_hf, jax.ShapeDtypeStruct(arl_shape[1:] if per_layer else arl_shape,
                                        jnp.float32)).shape
        for tensor in ([name.format(i=i) for i in range(config.num_layers)] if per_layer
                       else [name]):
            if reader.shape(tensor) != hf_shape:
                raise ValueError(f"tensor {tensor!r} has shape {reader.shape(tensor)} but the "
                                 f"config expects {hf_shape} (for {'/'.join(path)} "
                                 f"{arl_shape})")


def check_hf_checkpoint(directory: str, config: TransformerConfig | None = None) -> None:
    """What `load_hf_checkpoint` checks before it reads a tensor, without reading one:
    config.json is supported (`config` None: read from it), every weights file opens
    (header intact, length as the header says), the tensors are exactly the config's,
    with its shapes. Raises what `load_hf_checkpoint` would (`CheckpointFileError`,
    `CheckpointMismatchError`, ValueError, OSError); cheap enough to run before a run
    writes anything."""
    if config is None:
        config = load_hf_config(directory)
    _check_names_and_shapes(_TensorReader(directory), config,
                            nn.unbox(abstract_params(Transformer(config))), directory)


def load_hf_config(directory: str, **kwargs) -> TransformerConfig:
    """`config_from_hf` of `directory/config.json` (kwargs as in `config_from_hf`)."""
    path = os.path.join(directory, CONFIG_NAME)
    with open(path, encoding="utf-8") as f:
        try:
            fields = json.load(f)
        except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path!r} is not JSON: {error}") from error
    if not isinstance(fields, dict):
        raise ValueError(f"{path!r} holds {type(fields).__name__}, not a JSON object")
    return config_from_hf(fields, **kwargs)


def load_hf_checkpoint(directory: str, config: TransformerConfig | None = None,
                       mesh: jax.sharding.Mesh | None = None,
                       rules=LOGICAL_AXIS_RULES, head_tensors=(), **config_kwargs):
    """(config, params) of a Hugging Face checkpoint directory.

    params are plain (unboxed) arrays in config.param_dtype. With `mesh`, every
    parameter is placed with `param_shardings(abstract_params(model), mesh, rules)`
    as soon as it is assembled; without, on the default device.
    config: use this TransformerConfig instead of reading config.json (it must agree
    with the tensors); config_kwargs go to `config_from_hf` otherwise.

    Strict (checked from the file headers before any tensor is read): a tensor the
    config needs but the checkpoint lacks, or a checkpoint tensor the config does not
    use, raises `CheckpointMismatchError` naming them (the first few and the count);
    rotary `inv_freq` buffers and a tied model's duplicate `lm_head.weight` are
    accepted only when they agree with the config. A tensor of the wrong shape raises
    ValueError naming it. head_tensors: names of tensors of a head on top of the decoder
    (e.g. a sequence classifier's "score.weight") that the caller reads itself; the
    strictness check leaves them out.
    """
    if config is None:
        config = load_hf_config(directory, **config_kwargs)
    elif config_kwargs:
        raise ValueError(f"pass either config or config kwargs, not both: {sorted(config_kwargs)}")
    reader = _TensorReader(directory)
    boxed = abstract_params(Transformer(config))
    shapes = nn.unbox(boxed)
    _check_names_and_shapes(reader, config, shapes, directory, head_tensors)
    shardings = param_shardings(boxed, mesh, rules) if mesh is not None else None
    param_dtype = jnp.dtype(config.param_dtype)
    params: dict = {}
    for path, name, to_arl, _ in _hf_layout(config):
        expected = _nested_get(shapes, path).shape
        if "{i}" in name:
            value = np.stack([to_arl(reader.get(name.format(i=i)))
                              for i in range(config.num_layers)])
        else:
            value = to_arl(reader.get(name))
        assert value.shape == expected, (name, value.shape, expected)  # shapes checked above
        value = np.ascontiguousarray(value.astype(param_dtype))
        if shardings is not None:
            array = jax.device_put(value, _nested_get(shardings, path))
        else:
            array = jnp.asarray(value)
        _nested_set(params, path, array)
    return config, params


# ------------------------------------------------------------------------------ writing


def hf_state_dict(params, config: TransformerConfig) -> dict[str, np.ndarray]:
    """The Hugging Face tensor dict (name -> host array, params' own dtype) of `params`.

    `params` must hold exactly the parameters `config` declares: a leaf the config does
    not export (e.g. an o_proj bias under a config with o_bias=False, or a value head)
    or a missing one raises ValueError naming it, so nothing is dropped silently."""
    params = nn.unbox(params)
    declared = {path for path, _, _, _ in _hf_layout(config)}
    present = {tuple(getattr(k, "key", k) for k in path)
               for path, _ in jax.tree_util.tree_leaves_with_path(params)}
    for kind, paths in (("has parameters the config does not export", present - declared),
                        ("lacks parameters the config declares", declared - present)):
        if paths:
            names = sorted("/".join(map(str, p)) for p in paths)
            raise ValueError(f"hf_state_dict: params {kind} (qkv_bias={config.qkv_bias}, "
                             f"o_bias={config.o_bias}, mlp_bias={config.mlp_bias}, "
                             f"tie_embeddings={config.tie_embeddings}): {names[:NAMES_SHOWN]}"
                             + (f" (and {len(names) - NAMES_SHOWN} more)"
                                if len(names) > NAMES_SHOWN else ""))
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
    write_tensors(directory, tensors, max_shard_bytes)


def write_tensors(directory: str, tensors: dict[str, np.ndarray],
                  max_shard_bytes: int | None = None) -> None:
    """`tensors` as `model.safetensors`, or with `max_shard_bytes` as
    `model-0000i-of-0000n.safetensors` files of at most that many bytes each (a larger
    tensor gets its own file) plus `model.safetensors.index.json`."""
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
