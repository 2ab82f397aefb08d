"""Hugging Face `config.json` <-> `TransformerConfig` (llama, qwen2, qwen3).

`config_from_hf` reads the architecture and refuses, with one line naming the field and
its value, what would change the model's function and is not implemented (the list is in
`arl.models.hf_import`'s docstring); `config_to_hf` writes a config.json that
transformers' LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM load with exactly
the parameters of a `TransformerConfig`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from arl.models.rope import Llama3RopeScaling
from arl.models.transformer_config import TransformerConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}
# The parameters of the "llama3" RoPE scaling (Llama 3.1+), as config.json names them.
LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor",
                      "original_max_position_embeddings")
# transformers' Qwen2Config defaults: with use_sliding_window, the layers
# i >= max_window_layers attend within a window of sliding_window tokens.
QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28
QWEN2_DEFAULT_SLIDING_WINDOW = 4096


def _required(hf: dict, field: str):
    if hf.get(field) is None:
        raise ValueError(f"config.json: required field {field!r} is missing")
    return hf[field]


def _rope_theta(hf: dict) -> float:
    """rope_theta from either the classic top-level field or transformers>=5's
    `rope_parameters` dict (the RoPE type is checked by `_rope_scaling`)."""
    params = hf.get("rope_parameters")
    _rope_scaling(hf)
    top = hf.get("rope_theta")
    nested = params.get("rope_theta") if params else None
    if top is not None and nested is not None and float(top) != float(nested):
        raise ValueError(f"config.json: rope_theta={top!r} disagrees with "
                         f"rope_parameters.rope_theta={nested!r}")
    if nested is not None:
        return float(nested)
    return float(10000.0 if top is None else top)


def _rope_scaling(hf: dict) -> Llama3RopeScaling | None:
    """The RoPE frequency scaling of `rope_scaling` / transformers>=5's `rope_parameters`:
    None for rope_type "default", a `Llama3RopeScaling` for "llama3" (Llama 3.1+). Any
    other rope_type, and any parameter the type does not take, is refused."""
    found = None
    for field in ("rope_scaling", "rope_parameters"):
        value = hf.get(field)
        if not value:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"config.json: {field}={value!r} is not supported (allowed: a "
                             f"dict with rope_type 'default' or 'llama3')")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"config.json: {field}.rope_type={kind!r} is not supported "
                             f"(allowed: 'default', 'llama3')")
        takes = ("rope_type", "type", "rope_theta") + (
            LLAMA3_ROPE_FIELDS if kind == "llama3" else ())
        for key, item in value.items():
            if key in takes or item is None:
                continue
            if key == "partial_rotary_factor" and item == 1.0:
                continue
            raise ValueError(f"config.json: {field}.{key}={item!r} is not supported (RoPE "
                             f"type {kind!r} takes {', '.join(takes[2:])})")
        if kind == "llama3":
            missing = [k for k in LLAMA3_ROPE_FIELDS if value.get(k) is None]
            if missing:
                raise ValueError(f"config.json: {field} of rope_type 'llama3' lacks {missing}")
            scaling = Llama3RopeScaling(
                factor=float(value["factor"]), low_freq_factor=float(value["low_freq_factor"]),
                high_freq_factor=float(value["high_freq_factor"]),
                original_max_position_embeddings=int(
                    value["original_max_position_embeddings"]))
            if found is not None and found != scaling:
                raise ValueError("config.json: rope_scaling and rope_parameters disagree")
            found = scaling
    return found


def _qwen2_sliding_layers(hf: dict, num_layers: int) -> list[int]:
    """Layers where transformers' Qwen2 applies its sliding window: none unless
    use_sliding_window is set and sliding_window is not null (absent means 4096); then
    the layers `layer_types` marks "sliding_attention", or by default the layers
    i >= max_window_layers."""
    if not hf.get("use_sliding_window", False) or \
            hf.get("sliding_window", QWEN2_DEFAULT_SLIDING_WINDOW) is None:
        return []
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    first = hf.get("max_window_layers", QWEN2_DEFAULT_MAX_WINDOW_LAYERS)
    return list(range(first, num_layers))


def config_from_hf(hf: dict, *, dtype=jnp.float32, param_dtype=None,
                   max_len: int | None = None, **overrides) -> TransformerConfig:
    """`TransformerConfig` of a Hugging Face `config.json` dict (llama, qwen2 or qwen3).

    dtype/param_dtype: activation and parameter dtypes (param_dtype defaults to dtype).
    max_len: KV-cache capacity (default: max_position_embeddings, capped at 4096 so a
    32k-context checkpoint does not ask for a 32k cache by default).
    overrides: any other TransformerConfig field (e.g. value_head=True, remat=True).
    Raises ValueError naming the field for config fields that change the model's
    function and are not implemented (see the module docstring).
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json: model_type={model_type!r} is not supported "
                         f"(allowed: {SUPPORTED_MODEL_TYPES})")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act={act!r} is not supported (allowed: 'silu')")
    if hf.get("quantization_config"):
        raise ValueError(f"config.json: quantization_config={hf['quantization_config']!r} "
                         f"is not supported (import an unquantized checkpoint)")
    num_layers = int(_required(hf, "num_hidden_layers"))
    num_heads = int(_required(hf, "num_attention_heads"))
    d_model = int(_required(hf, "hidden_size"))
    head_dim = hf.get("head_dim") or d_model // num_heads
    if model_type in ("qwen2", "qwen3"):
        sliding = _qwen2_sliding_layers(hf, num_layers)
        if sliding:
            raise ValueError(
                f"config.json: use_sliding_window=True with sliding_window="
                f"{hf.get('sliding_window', QWEN2_DEFAULT_SLIDING_WINDOW)!r} applies to "
                f"layers {sliding} (from "
                f"{'layer_types' if hf.get('layer_types') is not None else 'max_window_layers'}"
                f"); sliding-window attention is not supported")
    if model_type == "qwen2":
        # transformers' Qwen2Attention: q/k/v always biased, o_proj and the MLP never
        # (Qwen2 has no attention_bias / mlp_bias fields).
        qkv_bias, o_bias, mlp_bias = True, False, False
    elif model_type == "qwen3":
        # Qwen3Attention: one attention_bias flag (q/k/v and o_proj), an unbiased MLP, and
        # RMSNorm over every query / key head (q_norm, k_norm).
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        mlp_bias = False
    else:
        # LlamaAttention: one attention_bias flag for q, k, v and o_proj.
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
    if max_len is None:
        max_len = min(int(hf.get("max_position_embeddings", 4096)), 4096)
    fields: dict[str, Any] = dict(
        vocab_size=int(_required(hf, "vocab_size")),
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        mlp_dim=int(_required(hf, "intermediate_size")),
        max_len=int(max_len),
        rope_theta=_rope_theta(hf),
        rope_scaling=_rope_scaling(hf),
        qk_norm=model_type == "qwen3",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        dtype=dtype,
        param_dtype=dtype if param_dtype is None else param_dtype,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def config_to_hf(config: TransformerConfig, model_type: str = "llama") -> dict:
    """A `config.json` dict that transformers' LlamaForCausalLM / Qwen2ForCausalLM load
    with exactly the parameters of `config`.

    llama: qkv_bias and o_bias must be equal (Llama's single attention_bias flag);
    mlp_bias maps to mlp_bias. qwen2: requires qkv_bias=True, o_bias=False,
    mlp_bias=False (the only Qwen2 layout). Anything else raises ValueError naming the
    fields and the model_type that would fit.
    """
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
    flags = (f"qkv_bias={config.qkv_bias}, o_bias={config.o_bias}, "
             f"mlp_bias={config.mlp_bias}")
    if model_type == "qwen2" and not (config.qkv_bias and not config.o_bias
                                      and not config.mlp_bias):
        raise ValueError(f"model_type='qwen2' requires config.qkv_bias=True, o_bias=False, "
                         f"mlp_bias=False (Qwen2's fixed layout), got {flags}; use "
                         f"model_type='llama' when qkv_bias == o_bias")
    if model_type in ("llama", "qwen3") and config.qkv_bias != config.o_bias:
        raise ValueError(f"model_type={model_type!r} has one attention_bias flag for q/k/v and "
                         f"o_proj, so it requires config.qkv_bias == config.o_bias, got "
                         f"{flags}" + ("; use model_type='qwen2'" if config.qkv_bias
                                      and not config.mlp_bias else ""))
    if model_type == "qwen3" and config.mlp_bias:
        raise ValueError(f"model_type='qwen3' has no MLP biases, got {flags}")
    if config.qk_norm != (model_type == "qwen3"):
        raise ValueError(f"config.qk_norm={config.qk_norm} needs model_type='qwen3' (the only "
                         f"family with q/k norms), got model_type={model_type!r}")
    if config.value_head:
        raise ValueError("config.value_head=True has no Hugging Face equivalent; export the "
                         "policy without the value head")
    dtype_name = jnp.dtype(config.param_dtype).name
    hf = {
        "architectures": [_ARCHITECTURES[model_type]],
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
        hf["mlp_bias"] = config.mlp_bias
    else:
        hf["use_sliding_window"] = False
    if model_type == "qwen3":
        hf["attention_bias"] = config.qkv_bias
    if config.rope_scaling is not None:
        hf["rope_scaling"] = {"rope_type": "llama3",
                              **{k: getattr(config.rope_scaling, k) for k in LLAMA3_ROPE_FIELDS}}
    return hf
