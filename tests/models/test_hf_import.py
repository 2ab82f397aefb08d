"""Hugging Face import/export: tiny random Llama and Qwen2 models built with transformers
(CPU torch, test-only) give the same logits under arl; export round trips bit for bit."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from safetensors import safe_open

from arl.models import Transformer
from arl.models.hf_import import (config_from_hf, config_to_hf, hf_state_dict,
                                  load_hf_checkpoint, save_hf_checkpoint)
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


def _llama(tie=False):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=tie)
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


@pytest.mark.parametrize("build, model_type, shard", [
    (_llama, "llama", None),
    (lambda: _llama(tie=True), "llama", "20KB"),
    (_qwen2, "qwen2", "30KB"),
])
def test_logits_match_transformers_and_round_trip_is_exact(tmp_path, build, model_type, shard):
    hf_model = build()
    src = tmp_path / "hf"
    kwargs = {} if shard is None else {"max_shard_size": shard}
    hf_model.save_pretrained(src, safe_serialization=True, **kwargs)
    assert os.path.exists(src / "model.safetensors.index.json") == (shard is not None)

    config, params = load_hf_checkpoint(str(src))
    assert config.qkv_bias == (model_type == "qwen2")
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
    # ... and transformers itself loads the export to the same logits.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), _hf_logits(hf_model, TOKENS))
    again_config, again = load_hf_checkpoint(str(dst))
    assert again_config == config
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_load_onto_a_mesh_with_the_parameter_shardings(tmp_path):
    hf_model = _llama()
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    config, params = load_hf_checkpoint(str(tmp_path), mesh=mesh)
    q = params["layers"]["self_attn"]["q_proj"]["kernel"]  # [L, D, H, Dh]
    assert q.sharding == NamedSharding(mesh, P(None, "fsdp", "tensor", None))
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


def test_config_mapping_and_rejections():
    base = dict(model_type="qwen2", vocab_size=10, hidden_size=16, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, intermediate_size=8,
                max_position_embeddings=32768, rope_parameters={"rope_type": "default",
                                                                "rope_theta": 1e6},
                rms_norm_eps=1e-6, tie_word_embeddings=True)
    config = config_from_hf(base)
    assert (config.rope_theta, config.num_kv_heads, config.head_dim, config.max_len) == (
        1e6, 2, 4, 4096)
    assert config.qkv_bias and config.tie_embeddings
    assert config_from_hf(config_to_hf(config, "qwen2"), max_len=4096) == config
    for field, value, match in [("model_type", "gpt2", "model_type"),
                                ("hidden_act", "gelu", "hidden_act"),
                                ("rope_scaling", {"rope_type": "yarn"}, "rope_scaling"),
                                ("use_sliding_window", True, "use_sliding_window")]:
        with pytest.raises(ValueError, match=match):
            config_from_hf({**base, field: value})
    with pytest.raises(ValueError, match="qkv_bias"):
        config_to_hf(config_from_hf({**base, "model_type": "llama"}), "qwen2")


def test_shape_mismatch_names_the_tensor(tmp_path):
    _llama().save_pretrained(tmp_path, safe_serialization=True)
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    config = config_from_hf({**hf, "intermediate_size": 40})
    with pytest.raises(ValueError, match="gate_proj"):
        load_hf_checkpoint(str(tmp_path), config=config)
    assert "model.norm.weight" in hf_state_dict(load_hf_checkpoint(str(tmp_path))[1],
                                                config_from_hf(hf))


def test_trainer_starts_from_an_hf_checkpoint(tmp_path):
    """config.model.hf_checkpoint: the train state holds the checkpoint's weights (the
    config's own architecture fields are ignored) in float32, sharded on the mesh."""
    from arl import config as config_lib
    from arl.models import TransformerConfig
    from arl.trainers import TokenTrainer

    hf_model = _llama()
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    c = config_lib.default_config()
    c.env.name, c.env.kwargs = "guess_number", {"max_n": 8}
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
