"""`config.model`: the transformer policy (architecture of a fresh model, dtypes,
attention kernel, memory-saving options), a Hugging Face checkpoint to start from, and
LoRA adapters."""

from __future__ import annotations

import json
import os

import jax
import ml_collections

from arl.config.checks import check_bool, check_choice, check_range, fail
from arl.errors import one_line
from arl.models import lora as lora_lib
from arl.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS

FLOAT_DTYPES = ("float32", "bfloat16")  # model.dtype and model.param_dtype


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.d_model = 64
    c.num_layers = 2
    c.num_heads = 4
    c.num_kv_heads = 4
    c.mlp_dim = 256
    c.rope_theta = 10000.0
    c.tie_embeddings = False
    # Projection biases of a fresh model: q/k/v (Qwen2), o_proj (with qkv_bias: HF Llama's
    # attention_bias), the MLP's (HF Llama's mlp_bias). A checkpoint brings its own.
    c.qkv_bias = False
    c.o_bias = False
    c.mlp_bias = False
    # Layers per iteration of the layer loop of the training forward and backward passes
    # (KV-cached decoding always loops over one layer at a time); 0 = all of them (no
    # loop). Unrolled, the default 2-layer model's gradient ran about 1.2x faster on CPU;
    # at 8 layers it gained little and compiled slower (docs/performance.md, "Attention
    # and the update"), so set 1 for deep checkpoints.
    c.layer_unroll = 0
    # Activation dtype, "float32" or "bfloat16" (attention softmax, log-probs and losses
    # stay float32).
    c.dtype = "float32"
    # Parameter dtype, "float32" or "bfloat16" (a checkpoint is cast to it). With
    # bfloat16 parameters the optimizer keeps float32 master weights and float32 Adam
    # moments (arl.optim.float32_master_weights): an RL-sized update is far below half a
    # bfloat16 ulp of a weight and would otherwise round away.
    c.param_dtype = "float32"
    # Rematerialise each decoder layer in the backward pass: only the residual stream
    # between layers is kept, the rest of a layer is recomputed (real model sizes).
    c.remat = False
    # Vocabulary of a fresh model; 0 = the env codec's. Larger than the codec's (e.g. a
    # real model's 151936) gives the real embedding and logits sizes: the codec's ids are
    # a subset, and ids it does not know are unparseable agent output to the env.
    c.vocab_size = 0
    c.norm_eps = 1e-6  # RMSNorm epsilon of a fresh model (Llama 3: 1e-5)
    # > 0: training log-probs/entropies come from the final hidden states in chunks of
    # this many positions (arl.models.chunked_logprobs), never the full [B, T, V] logits.
    c.logprob_chunk = 0
    # Self-attention: "dense" ([B, H, T, T] scores), "blocked" (FlashAttention-style
    # tiling in JAX, memory linear in the context, any backend), "cudnn" (cuDNN's fused
    # kernel, NVIDIA GPUs; cached decoding stays dense), "auto" = dense up to
    # attention_block tokens and blocked beyond (docs/performance.md, "Attention and the
    # update"). For KV-cached decoding the length is the cache's capacity: blocked
    # decoding reads only the cache blocks up to the last query (same section).
    c.attention = "auto"
    c.attention_block = 512
    # Path of a Hugging Face Llama/Qwen2/Qwen3 checkpoint directory (config.json,
    # safetensors, tokenizer.json, tokenizer_config.json with its chat template,
    # generation_config.json) to start from, as one unit: its config.json replaces the
    # architecture fields above (d_model, num_layers, num_heads, num_kv_heads, mlp_dim,
    # rope_theta, tie_embeddings), its tokenizer and chat template (when it has a
    # tokenizer.json) become the token envs' codec (arl.envs.checkpoint_codec), ids past
    # the tokenizer's vocabulary are never sampled. "" = a randomly initialised model.
    c.hf_checkpoint = ""
    # With hf_checkpoint: the system message every episode's conversation starts with,
    # rendered by the checkpoint's chat template ("" = none, i.e. the template's own
    # default). Token envs read the checkpoint's tokenizer and template unless
    # env.kwargs.codec names another codec.
    c.system_prompt = ""
    # With hf_checkpoint: the chat template's own arguments, as apply_chat_template's
    # keyword arguments, e.g. {'enable_thinking': False} (Qwen3) or {'tools': [...]}
    # (on the command line: --config.model.chat_template_kwargs="{'enable_thinking':
    # False}"). Empty: the template's defaults.
    c.chat_template_kwargs = ml_collections.ConfigDict()
    # LoRA (arl.models.lora): rank > 0 trains low-rank adapters W + (alpha/rank) A B on
    # the `lora_targets` projections of a frozen base (the checkpoint's or the fresh
    # init's weights); the KL reference is the base itself. 0 = full fine-tuning.
    c.lora_rank = 0
    c.lora_alpha = 16.0
    c.lora_targets = ("q_proj", "v_proj")
    return c


def validate(config) -> None:
    m = config.model
    for field in ("d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"):
        check_range(config, f"model.{field}", 1, integer=True)
    if m.d_model % m.num_heads:
        fail("model.num_heads", m.num_heads, f"must divide model.d_model={m.d_model}")
    if m.num_heads % m.num_kv_heads:
        fail("model.num_kv_heads", m.num_kv_heads,
             f"must divide model.num_heads={m.num_heads}")
    for field in ("tie_embeddings", "qkv_bias", "o_bias", "mlp_bias"):
        check_bool(config, f"model.{field}")
    for field in ("dtype", "param_dtype"):
        if m[field] not in FLOAT_DTYPES:
            fail(f"model.{field}", m[field], f"allowed values are {FLOAT_DTYPES}")
    check_bool(config, "model.remat")
    kwargs = m.chat_template_kwargs
    kwargs = kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs)
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as error:
        fail("model.chat_template_kwargs", kwargs,
             f"must be a dict of JSON values (the template's arguments): {error}")
    check_range(config, "model.vocab_size", 0, integer=True)
    check_range(config, "model.norm_eps", 0.0, low_open=True)
    check_range(config, "model.rope_theta", 0.0, low_open=True)
    check_range(config, "model.logprob_chunk", 0, integer=True)
    check_range(config, "model.layer_unroll", 0, integer=True)
    check_choice(config, "model.attention", ATTENTION_IMPLEMENTATIONS)
    if m.attention == "cudnn" and jax.default_backend() != "gpu":
        # Caught here: otherwise the first compiled train step fails with a traceback.
        fail("model.attention", m.attention,
             f"cuDNN's kernel needs an NVIDIA GPU, this backend is "
             f"{jax.default_backend()!r}: use 'auto', 'dense' or 'blocked'")
    check_range(config, "model.attention_block", 1, integer=True)
    if m.hf_checkpoint and not os.path.isfile(os.path.join(m.hf_checkpoint, "config.json")):
        fail("model.hf_checkpoint", m.hf_checkpoint,
             "must be a directory holding a Hugging Face config.json and safetensors")
    if m.hf_checkpoint:
        check_checkpoint_directory(m.hf_checkpoint)
    _validate_lora(config)


def check_checkpoint_directory(directory: str) -> None:
    """`model.hf_checkpoint` holds a supported config.json and weights files that open
    and hold exactly its tensors, with its shapes (`hf_import.check_hf_checkpoint`: the
    file headers only, no tensor is read). Run by `arl.config.validate`, so a bad
    directory is one line before a run writes anything to its workdir."""
    from arl.models import hf_import  # pylint: disable=g-import-not-at-top
    try:
        hf_import.check_hf_checkpoint(directory)
    except (ValueError, KeyError, OSError) as error:
        fail("model.hf_checkpoint", directory, one_line(error).rstrip("."))


def _validate_lora(config) -> None:
    check_range(config, "model.lora_rank", 0, integer=True)
    check_range(config, "model.lora_alpha", 0.0, low_open=True)
    targets = config.model.lora_targets
    if isinstance(targets, str) or not isinstance(targets, (tuple, list)) or not targets \
            or any(t not in lora_lib.ALL_TARGETS for t in targets) \
            or len(set(targets)) != len(targets):
        fail("model.lora_targets", targets,
             f"expected distinct names from {lora_lib.ALL_TARGETS}")
