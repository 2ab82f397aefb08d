"""Hugging Face import/export: tiny random Llama (plain, attention_bias, mlp_bias) and
Qwen2 models built with transformers (CPU torch, test-only) give the same logits under
arl; export round trips bit for bit and transformers loads it with no missing or
unexpected keys; checkpoints that do not match their config are refused by name."""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from safetensors import safe_open

from arl.models import Transformer
from arl.models.hf_import import (CheckpointMismatchError, config_from_hf, config_to_hf,
                                  hf_state_dict, load_hf_checkpoint, save_hf_checkpoint)
from tests.models.helpers import jitted_forward

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 96


def _randomise(model, seed):
    """Replace every HF parameter (norm scales and biases included) by N(0, 0.3^2) + c so
    a mis-mapped tensor cannot hide behind an init of ones or zeros."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            offset = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(offset + 0.3 * torch.randn(p.shape, generator=gen))
    return model


def _llama(tie=False, attention_bias=False, mlp_bias=False):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=tie,
        attention_bias=attention_bias, mlp_bias=mlp_bias)
    return _randomise(transformers.LlamaForCausalLM(cfg).eval(), 0)


def _qwen2():
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
    return _randomise(transformers.Qwen2ForCausalLM(cfg).eval(), 1)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def _arl_logits(config, params, tokens):
    return np.asarray(jitted_forward(config)(params, tokens).logits)


def _tensors(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="numpy") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 11)).astype(np.int32)


@pytest.mark.parametrize("build, model_type, shard, biases", [
    (_llama, "llama", None, (False, False, False)),
    (lambda: _llama(tie=True), "llama", "20KB", (False, False, False)),
    (lambda: _llama(attention_bias=True), "llama", None, (True, True, False)),
    (lambda: _llama(attention_bias=True, mlp_bias=True), "llama", "20KB", (True, True, True)),
    (_qwen2, "qwen2", "30KB", (True, False, False)),
], ids=["llama", "llama-tied-sharded", "llama-attention-bias", "llama-attention-mlp-bias",
        "qwen2-qkv-bias"])
def test_logits_match_transformers_and_round_trip_is_exact(tmp_path, build, model_type, shard,
                                                           biases):
    hf_model = build()
    src = tmp_path / "hf"
    kwargs = {} if shard is None else {"max_shard_size": shard}
    hf_model.save_pretrained(src, safe_serialization=True, **kwargs)
    assert os.path.exists(src / "model.safetensors.index.json") == (shard is not None)

    config, params = load_hf_checkpoint(str(src))
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == biases
    assert ("bias" in params["layers"]["self_attn"]["o_proj"]) == biases[1]
    assert ("bias" in params["layers"]["mlp"]["up_proj"]) == biases[2]
    assert config.tie_embeddings == hf_model.config.tie_word_embeddings
    assert ("lm_head" in params) != config.tie_embeddings
    np.testing.assert_allclose(_arl_logits(config, params, TOKENS), _hf_logits(hf_model, TOKENS),
                               atol=1e-4, rtol=1e-4)

    # Export: every HF tensor reproduced exactly (same names, dtypes, bits).
    dst = tmp_path / "arl"
    save_hf_checkpoint(str(dst), params, config, model_type=model_type,
                       max_shard_bytes=None if shard is None else 8_000)
    original, exported = _tensors(src), _tensors(dst)
    assert set(exported) == set(original)
    for name, value in original.items():
        assert exported[name].dtype == value.dtype, name
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    # ... and transformers itself loads the export, every parameter from the file, to the
    # same logits.
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        dst, output_loading_info=True)
    reloaded.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info["error_msgs"], info
    assert set(dict(reloaded.named_parameters())) == set(dict(hf_model.named_parameters()))
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), _hf_logits(hf_model, TOKENS))
    again_config, again = load_hf_checkpoint(str(dst))
    assert again_config == config
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_load_onto_a_mesh_with_the_parameter_shardings(tmp_path):
    hf_model = _llama(attention_bias=True, mlp_bias=True)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    config, params = load_hf_checkpoint(str(tmp_path), mesh=mesh)
    q = params["layers"]["self_attn"]["q_proj"]["kernel"]  # [L, D, H, Dh]
    assert q.sharding == NamedSharding(mesh, P(None, "fsdp", "tensor", None))
    up_bias = params["layers"]["mlp"]["up_proj"]["bias"]  # [L, F]
    assert up_bias.sharding == NamedSharding(mesh, P(None, "tensor"))
    o_bias = params["layers"]["self_attn"]["o_proj"]["bias"]  # [L, D]
    assert o_bias.sharding == NamedSharding(mesh, P(None, "fsdp"))
    assert params["embed_tokens"]["embedding"].sharding == NamedSharding(mesh, P("tensor", "fsdp"))
    logits = jax.jit(lambda p, t: Transformer(config).apply({"params": p}, t).logits)(
        params, TOKENS)
    np.testing.assert_allclose(logits, _hf_logits(hf_model, TOKENS), atol=1e-4, rtol=1e-4)


def test_bfloat16_checkpoint_loads_in_bfloat16_and_exports_exactly(tmp_path):
    hf_model = _qwen2().to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    config, params = load_hf_checkpoint(str(tmp_path / "hf"), dtype=jnp.bfloat16)
    assert config.param_dtype == jnp.bfloat16
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    logits = _arl_logits(config, params, TOKENS)
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    # Activations in bfloat16: close to the float32 forward of the same weights.
    f32_config, f32_params = load_hf_checkpoint(str(tmp_path / "hf"))
    reference = _arl_logits(f32_config, f32_params, TOKENS)
    assert np.max(np.abs(logits - reference)) < 0.1 * np.max(np.abs(reference))
    save_hf_checkpoint(str(tmp_path / "out"), params, config, model_type="qwen2")
    original, exported = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert set(original) == set(exported)
    for name, value in original.items():
        assert exported[name].dtype == value.dtype
        np.testing.assert_array_equal(exported[name].view(np.uint16), value.view(np.uint16))


QWEN2_BASE = dict(model_type="qwen2", vocab_size=10, hidden_size=16, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=8,
                  max_position_embeddings=32768,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
LLAMA_BASE = {**QWEN2_BASE, "model_type": "llama", "rope_parameters": None, "rope_theta": 5e5}


def test_config_mapping():
    config = config_from_hf(QWEN2_BASE)
    assert (config.rope_theta, config.num_kv_heads, config.head_dim, config.max_len) == (
        1e6, 2, 4, 4096)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (True, False, False)
    assert config.tie_embeddings
    assert config_from_hf(config_to_hf(config, "qwen2"), max_len=4096) == config
    # Qwen2 has no bias flags: transformers ignores these fields, so does the import.
    assert config_from_hf({**QWEN2_BASE, "attention_bias": False, "mlp_bias": True}) == config
    llama = config_from_hf(LLAMA_BASE)
    assert llama.rope_theta == 5e5
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (False, False, False)
    for flags, biases in [(dict(attention_bias=True), (True, True, False)),
                          (dict(mlp_bias=True), (False, False, True)),
                          (dict(attention_bias=True, mlp_bias=True), (True, True, True))]:
        config = config_from_hf({**LLAMA_BASE, **flags})
        assert (config.qkv_bias, config.o_bias, config.mlp_bias) == biases
        hf = config_to_hf(config, "llama")
        assert (hf["attention_bias"], hf["mlp_bias"]) == (biases[0], biases[2])
        assert config_from_hf(hf, max_len=4096) == config
    # Fields that do not change the function are accepted.
    assert config_from_hf({**LLAMA_BASE, "attention_dropout": 0.1, "pretraining_tp": 2,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                               "partial_rotary_factor": 1.0}}) == llama
    # A Qwen2 sliding window that no layer uses (transformers: layers i >=
    # max_window_layers, default 28; or sliding_window null) changes nothing.
    for fields in [dict(use_sliding_window=True),
                   dict(use_sliding_window=True, max_window_layers=1, num_hidden_layers=1),
                   dict(use_sliding_window=True, sliding_window=None, max_window_layers=0),
                   dict(use_sliding_window=False, max_window_layers=0),
                   dict(use_sliding_window=True, layer_types=["full_attention"],
                        max_window_layers=0)]:
        assert config_from_hf({**QWEN2_BASE, **fields}).num_layers == 1


@pytest.mark.parametrize("fields, match", [
    (dict(model_type="gpt2"), "model_type='gpt2'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type='yarn'"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.rope_type='linear'"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 5e5}),
     "rope_parameters.rope_type='dynamic'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}),
     "rope_parameters of rope_type 'llama3' lacks"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "factor": 2.0}),
     "rope_parameters.factor=2.0"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                           "partial_rotary_factor": 0.5}), "partial_rotary_factor=0.5"),
    (dict(rope_theta=1e4), "rope_theta=10000.0 disagrees"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    (dict(use_sliding_window=True, max_window_layers=0), r"sliding_window=4096 .*layers \[0\]"),
    (dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"]),
     r"sliding_window=8 .*layers \[0\] \(from layer_types\)"),
    (dict(intermediate_size=None), "'intermediate_size' is missing"),
])
def test_config_rejections_name_the_field_and_value(fields, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**QWEN2_BASE, **fields})


def test_export_config_rejections():
    qwen2 = config_from_hf(QWEN2_BASE)
    with pytest.raises(ValueError, match="qkv_bias == config.o_bias.*model_type='qwen2'"):
        config_to_hf(qwen2, "llama")  # q/k/v biases without o_proj: not a Llama
    plain_llama = config_from_hf(LLAMA_BASE)
    with pytest.raises(ValueError, match="qwen2.*qkv_bias=True, o_bias=False"):
        config_to_hf(plain_llama, "qwen2")
    biased_llama = config_from_hf({**LLAMA_BASE, "attention_bias": True})
    with pytest.raises(ValueError, match="o_bias=True"):
        config_to_hf(biased_llama, "qwen2")
    with pytest.raises(ValueError, match="value_head"):
        config_to_hf(dataclasses.replace(plain_llama, value_head=True), "llama")


def test_shape_mismatch_names_the_tensor(tmp_path):
    _llama().save_pretrained(tmp_path, safe_serialization=True)
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    config = config_from_hf({**hf, "intermediate_size": 40})
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape "
                                         r"\(48, 32\) but the config expects \(40, 32\)"):
        load_hf_checkpoint(str(tmp_path), config=config)
    assert "model.norm.weight" in hf_state_dict(load_hf_checkpoint(str(tmp_path))[1],
                                                config_from_hf(hf))


def test_export_refuses_parameters_the_config_does_not_declare(saved_checkpoints):
    config, params = load_hf_checkpoint(str(saved_checkpoints / "biased"))
    plain = dataclasses.replace(config, qkv_bias=False, o_bias=False)
    with pytest.raises(ValueError, match=r"does not export .*'layers/self_attn/k_proj/bias', "
                                         r"'layers/self_attn/o_proj/bias'"):
        hf_state_dict(params, plain)
    with pytest.raises(ValueError, match=r"lacks .*\['layers/mlp/down_proj/bias', "
                                         r"'layers/mlp/gate_proj/bias', 'layers/mlp/up_proj/bias'\]"):
        hf_state_dict(params, dataclasses.replace(config, mlp_bias=True))


def _rewrite(src, dst, tensors=None, config=None):
    """Copy checkpoint `src` to `dst` as one safetensors file, with `tensors(dict)` and
    `config(dict)` edits applied in place."""
    out = _tensors(src)
    with open(src / "config.json") as f:
        hf = json.load(f)
    if tensors is not None:
        tensors(out)
    if config is not None:
        config(hf)
    os.makedirs(dst)
    from safetensors.numpy import save_file
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with open(dst / "config.json", "w") as f:
        json.dump(hf, f)
    return dst


@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    _llama().save_pretrained(root / "plain", safe_serialization=True)
    _llama(attention_bias=True).save_pretrained(root / "biased", safe_serialization=True)
    _llama(tie=True).save_pretrained(root / "tied", safe_serialization=True)
    return root


def _set(name, value_fn):
    return lambda t: t.__setitem__(name, value_fn(t))


# The first five names (natural order) and the count are what the message shows.
BIAS_NAMES = ", ".join(repr(f"model.layers.{i}.self_attn.{p}_proj.bias")
                       for i in (0, 1) for p in "koqv")
MISMATCHES = [
    # The original bug: a Llama with attention_bias=True read as a plain Llama dropped
    # its biases (o_proj silently) and produced wrong logits.
    ("biased", None, lambda hf: hf.update(attention_bias=False),
     re.escape("unexpected (the model would not use them) 8 tensors: "
               + BIAS_NAMES[:BIAS_NAMES.index(", 'model.layers.1.self_attn.o")]
               + " (and 3 more)")),
    ("plain", None, lambda hf: hf.update(attention_bias=True),
     re.escape("missing 8 tensors: "
               + BIAS_NAMES[:BIAS_NAMES.index(", 'model.layers.1.self_attn.o")])),
    ("plain", _set("model.layers.0.self_attn.q_norm.weight", lambda t: np.ones(8, np.float32)),
     None, "unexpected .*1 tensor: 'model.layers.0.self_attn.q_norm.weight'"),
    ("plain", lambda t: t.pop("model.layers.1.mlp.down_proj.weight"), None,
     "missing 1 tensor: 'model.layers.1.mlp.down_proj.weight'"),
    ("plain", _set("model.layers.1.self_attn.rotary_emb.inv_freq",
                   lambda t: np.full(4, 0.5, np.float32)), None,
     "'model.layers.1.self_attn.rotary_emb.inv_freq' .*does not match rope_theta=5000.0"),
    ("tied", _set("lm_head.weight", lambda t: t["model.embed_tokens.weight"] + 1), None,
     "lm_head.weight differs from model.embed_tokens.weight"),
]


@pytest.mark.parametrize("source, tensors, config, match", MISMATCHES,
                         ids=["biased-as-plain", "plain-as-biased", "unknown-tensor",
                              "missing-tensor", "wrong-inv-freq", "untied-lm-head"])
def test_tensors_not_matching_the_config_are_refused_by_name(saved_checkpoints, tmp_path,
                                                             source, tensors, config, match):
    bad = _rewrite(saved_checkpoints / source, tmp_path / "bad", tensors, config)
    with pytest.raises(CheckpointMismatchError, match=match):
        load_hf_checkpoint(str(bad))


def test_qkv_only_config_refuses_the_o_proj_biases(saved_checkpoints):
    config = config_from_hf({**transformers.LlamaConfig.from_pretrained(
        saved_checkpoints / "biased").to_dict(), "attention_bias": False})
    config = dataclasses.replace(config, qkv_bias=True)  # Qwen2's layout on a Llama
    with pytest.raises(CheckpointMismatchError,
                       match=r"o_bias=False.*unexpected .*2 tensors: "
                             r"'model.layers.0.self_attn.o_proj.bias', "
                             r"'model.layers.1.self_attn.o_proj.bias'\."):
        load_hf_checkpoint(str(saved_checkpoints / "biased"), config=config)


def test_redundant_buffers_that_agree_are_accepted(saved_checkpoints, tmp_path):
    """Older checkpoints carry rotary inv_freq buffers (transformers computes them in
    float32), and some tied checkpoints a copy of the embedding as lm_head.weight: both
    equal what the config implies, so they are checked and dropped."""
    inv_freq = (1.0 / 5000.0 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8)).numpy()

    def add(t):
        for i in range(2):
            t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = inv_freq
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()

    extra = _rewrite(saved_checkpoints / "tied", tmp_path / "extra", add)
    config, params = load_hf_checkpoint(str(extra))
    _, reference = load_hf_checkpoint(str(saved_checkpoints / "tied"))
    jax.tree.map(np.testing.assert_array_equal, params, reference)


def test_trainer_starts_from_an_hf_checkpoint(tmp_path):
    """config.model.hf_checkpoint: the train state holds the checkpoint's weights (the
    config's own architecture fields are ignored) in float32, sharded on the mesh."""
    from arl import config as config_lib
    from arl.envs import CharCodec
    from arl.models import TransformerConfig
    from arl.trainers import TokenTrainer

    hf_model = _llama()
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    c = config_lib.default_config()
    # Weights only (no tokenizer.json): the env names its codec explicitly.
    c.env.name, c.env.kwargs = "guess_number", {"max_n": 8, "codec": CharCodec()}
    c.rollout.num_tasks, c.rollout.group_size = 2, 2
    c.model.hf_checkpoint = str(tmp_path)
    trainer = TokenTrainer(c)
    assert isinstance(trainer.model.config, TransformerConfig)
    assert (trainer.model.config.d_model, trainer.model.config.num_kv_heads) == (32, 2)
    state = trainer.init_state()
    _, loaded = load_hf_checkpoint(str(tmp_path))
    jax.tree.map(np.testing.assert_array_equal, state.params, loaded)

    c.model.hf_checkpoint = str(tmp_path / "missing")
    with pytest.raises(config_lib.ConfigError, match="model.hf_checkpoint"):
        TokenTrainer(c)
