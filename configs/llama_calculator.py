r"""RL + alpha*SFT with GRPO on `calculator`, spoken in a freshly trained BPE tokenizer.

The whole real-model path on CPU: a small Llama-architecture decoder (RoPE, RMSNorm,
SwiGLU, grouped-query attention with 2 KV heads for 4 query heads) whose vocabulary is a
byte-level BPE trained with `tokenizers` on the environment's own strings
(`configs.tokenizer_corpus.env_corpus`); the env gets it as `env.kwargs.codec`, the path of
the `tokenizer.json`, which `arl.envs.make` wraps in an `HFCodec`. Prompts and replies
are subword ids; the agent's turns are parsed from ids inside the compiled step, and
the training log-probs are computed in chunks from the hidden states
(`model.logprob_chunk`).

    python -m experiments.train --config=configs/llama_calculator.py --workdir=/tmp/llama_calc
    python -m experiments.learning_stages --config=configs/llama_calculator.py  # + baselines

Measured (seed 0, shared 2-core CPU, ~5 minutes): sampled success 0.44 after the SFT
stage (greedy 0.07: it imitates the demonstrator's tool skipping), 0.96 after SFT + 80
GRPO steps (greedy 1.0, always two turns: tool call, then answer); the demonstrator
0.75, the oracle 1.0, the untrained model 0.0 (docs/learning.md, "Measured results").

To start from a pretrained checkpoint instead, load it with
`arl.models.hf_import.load_hf_checkpoint` and point `env.kwargs.codec` at the
checkpoint's own `tokenizer.json` (its digits must be single tokens, as in Llama 2 and
Qwen2; see `HFCodec`).
"""

import os
import tempfile

from arl import config as config_lib
from configs import recipes

VOCAB_SIZE = 320


def tokenizer_path(vocab_size: int = VOCAB_SIZE) -> str:
    """Trains (once; the result is deterministic) and caches the BPE tokenizer.json."""
    from configs.tokenizer_corpus import env_corpus
    from arl.text.hf_codec import train_bpe_tokenizer

    directory = os.path.join(tempfile.gettempdir(), "arl_tokenizers")
    path = os.path.join(directory, f"calculator_bpe_{vocab_size}.json")
    if not os.path.exists(path):
        os.makedirs(directory, exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        train_bpe_tokenizer(env_corpus(), vocab_size=vocab_size).save(partial)
        os.replace(partial, path)  # atomic: concurrent runs never read half a file
    return path


def get_config():
    c = config_lib.default_config()
    c.algorithm = "grpo"
    c.env.name = "calculator"
    c.env.kwargs.max_digits = 1
    c.env.kwargs.max_turns = 3
    c.env.kwargs.codec = tokenizer_path()
    c.train_steps = 80
    c.sample_every = 20
    c.checkpoint_every = 40
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    c.model.num_kv_heads = 2  # grouped-query attention: 2 KV heads for 4 query heads
    c.model.mlp_dim = 192
    c.model.logprob_chunk = 32  # training log-probs from hidden states, 32 positions at a time
    recipes.warm_start(c, steps=300)  # stage 1: clone the weak demonstrator
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=5)  # stage 2: GRPO ...
    c.loss.sft_coef = 0.05  # ... with a small constant SFT floor
    c.loss.sft_source = "demonstrator"
    return c
