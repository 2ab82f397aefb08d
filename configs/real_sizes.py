r"""GRPO on Sokoban with policies of real model sizes: Qwen2.5-0.5B, Qwen2.5-1.5B, Llama-3-8B.

Randomly initialised decoders with the published architectures (no download): the
numbers below are those of the models' Hugging Face config.json files, and the
parameter counts match the published ones (`PUBLISHED_PARAMETERS`, checked by
tests/test_real_sizes.py without allocating anything):

| shape          | layers | d_model | heads / KV | MLP   | vocab  | embeddings | biases | RoPE theta | RMSNorm eps |
|----------------|-------:|--------:|-----------:|------:|-------:|------------|--------|-----------:|------------:|
| qwen2.5-0.5b   | 24     | 896     | 14 / 2     | 4864  | 151936 | tied       | q/k/v  | 1e6        | 1e-6        |
| qwen2.5-1.5b   | 28     | 1536    | 12 / 2     | 8960  | 151936 | tied       | q/k/v  | 1e6        | 1e-6        |
| llama3-8b      | 32     | 4096    | 32 / 8     | 14336 | 128256 | untied     | none   | 500000     | 1e-5        |

What a real run needs, set here: bfloat16 parameters and activations with float32
master weights and Adam moments (`model.param_dtype`, `arl.optim.float32_master_weights`),
each layer rematerialised in the backward pass (`model.remat`), the layers as one
scanned body (`model.layer_unroll=1`: the compile time does not grow with the depth),
training log-probs from the hidden states in chunks of 128 positions
(`model.logprob_chunk`: never the [B, S, vocab] logits), FSDP over 8 devices
(`mesh=(1, 8, 1)`; parameters, gradients and optimizer state split over "fsdp", the
batch over data x fsdp; the model's activation sharding rules keep the residual stream
batch-sharded).

The environment is RAGEN's Sokoban (6x6, 2 boxes) with 15 turns, a context of 1047
tokens, in the character codec: its ids are a subset of the model's vocabulary, which
has the real size (the embedding and logits cost what they cost in the real model);
ids the codec does not know are unparseable agent output to the environment. 8 tasks x
group 8 = 64 episodes per step, one optimizer step on all of them, no KL reference
(DAPO-style).

    python -m experiments.train --config=configs/real_sizes.py:qwen2.5-0.5b --workdir=/tmp/q05
    python benchmarks/real_sizes.py        # per-device memory of every shape and layout

benchmarks/real_sizes.py compiles the full train step of each shape on fake meshes of 8
and 64 CPU devices and compares XLA's per-device memory with an analytic estimate
(docs/sharding.md). The 8B shape needs a multi-chip slice; on this repository's CPU only
its compilation is checked.
"""

from arl import config as config_lib

SHAPES = {
    "qwen2.5-0.5b": dict(num_layers=24, d_model=896, num_heads=14, num_kv_heads=2,
                         mlp_dim=4864, vocab_size=151936, tie_embeddings=True,
                         qkv_bias=True, rope_theta=1e6, norm_eps=1e-6),
    "qwen2.5-1.5b": dict(num_layers=28, d_model=1536, num_heads=12, num_kv_heads=2,
                         mlp_dim=8960, vocab_size=151936, tie_embeddings=True,
                         qkv_bias=True, rope_theta=1e6, norm_eps=1e-6),
    "llama3-8b": dict(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                      mlp_dim=14336, vocab_size=128256, tie_embeddings=False,
                      qkv_bias=False, rope_theta=500000.0, norm_eps=1e-5),
}

# Parameter counts of the published checkpoints (Qwen2.5 model cards: 0.49B and 1.54B;
# Llama 3 8B: 8.03B), exactly.
PUBLISHED_PARAMETERS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "llama3-8b": 8_030_261_248,
}


def get_config(shape: str = "qwen2.5-0.5b"):
    if shape not in SHAPES:
        raise ValueError(f"configs/real_sizes.py: unknown shape {shape!r}; allowed values "
                         f"are {tuple(SHAPES)}")
    c = config_lib.default_config()
    c.algorithm = "grpo"
    c.env.name = "sokoban"
    c.env.kwargs.max_turns = 15
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    c.mesh = (1, 8, 1)
    c.activation_sharding = True
    for key, value in SHAPES[shape].items():
        c.model[key] = value
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.remat = True
    c.model.layer_unroll = 1
    c.model.logprob_chunk = 128
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 10
    c.train_steps = 200
    c.log_every = 1
    c.sample_every = 10
    c.checkpoint_every = 25
    return c
