"""Decode attention on the CPU: products over every head pair vs the grouped products.

A decoded token attends over one layer of the KV cache, stored [B, S, KV, d]. The grouped
einsums ("btkgd,bskd->bkgts" and "bkgts,bskd->btkgd") have batch dimensions B and KV,
which XLA:CPU wants leading, so it copies the layer's keys and values transposed at every
token and layer. `arl.models.attention.scores_every_head_pair` and
`mix_every_head_pair` read the layer as stored, compute every (query head, key/value
head) pair and keep the matching ones (KV times the attention's FLOPs, no copy); the
model uses them for single-token cached calls on the CPU (`uses_head_pairs`), in the
dense cached path and in each block of `cached_attention`. Both sides here run the same
programs except for that choice (the "grouped" side is traced with `uses_head_pairs`
patched to False, the previous path) and must agree (checked).

* attention: one layer read out of a stacked two-layer cache, scores, softmax and mix,
  for one query token per row at the head shapes of the peers' settings and of
  Qwen2.5-0.5B / 1.5B and Llama-3-8B (cache filled to S - 3 slots);
* blocked: `cached_attention` (the path of caches longer than one attention block) over
  a 4096-slot cache in blocks of 512, filled to a quarter and to the end;
* generate: `generate` of 32 new tokens by a 2-layer model after an 8-token prompt
  (vocabulary 512), at the peers' toy and modest head shapes.

    python benchmarks/decode_attention.py [--repeats 15] [--append]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402  pylint: disable=wrong-import-position
from arl.models import TransformerConfig  # noqa: E402
from arl.models import attention_kernels as attention_lib  # noqa: E402

# name: (rows B, cache slots S, key/value heads KV, query heads per key/value head G, d)
ATTENTION_SHAPES = {
    "peers toy": (64, 24, 2, 2, 32),
    "peers modest": (128, 72, 4, 2, 32),
    "Qwen2.5-0.5B heads": (16, 512, 2, 7, 64),
    "Qwen2.5-1.5B heads": (16, 512, 2, 6, 128),
    "Llama-3-8B heads": (8, 512, 8, 4, 128),
    "multi-head, 16 heads": (16, 256, 16, 1, 64),
}
# name: (rows B, key/value heads KV, query heads per key/value head G, d)
BLOCKED_SHAPES = {
    "Qwen2.5-0.5B heads": (8, 2, 7, 64),
    "Qwen2.5-1.5B heads": (8, 2, 6, 128),
    "Llama-3-8B heads": (4, 8, 4, 128),
}
BLOCKED_CAPACITY, BLOCK = 4096, 512
# name: (rows, d_model, heads, key/value heads)
GENERATE_SHAPES = {"peers toy": (64, 128, 4, 2), "peers modest": (128, 256, 8, 4)}
STEPS = 32


@contextlib.contextmanager
def grouped_products():
    """Traces inside the block take the previous path (grouped products) everywhere."""
    previous = attention_lib.uses_head_pairs
    attention_lib.uses_head_pairs = lambda q_len: False
    try:
        yield
    finally:
        attention_lib.uses_head_pairs = previous


def attention_program(rows, slots, num_kv, groups, head_dim):
    """One decode attention call as the model makes it: a layer read out of the stacked
    cache, then scores, softmax and mix (the functions looked up when traced)."""
    rng = np.random.default_rng(0)
    cache = [jnp.asarray(rng.normal(size=(2, rows, slots, num_kv, head_dim)), jnp.float32)
             for _ in range(2)]
    q = jnp.asarray(rng.normal(size=(rows, 1, num_kv, groups, head_dim)), jnp.float32)

    def run(all_keys, all_values, q, layer, last_slot):
        keys = jax.lax.dynamic_index_in_dim(all_keys, layer, 0, keepdims=False)
        values = jax.lax.dynamic_index_in_dim(all_values, layer, 0, keepdims=False)
        head_pairs = attention_lib.uses_head_pairs(1)
        scores = attention_lib.grouped_scores(q, keys, head_pairs=head_pairs)
        allowed = jnp.arange(slots) <= last_slot
        probs = jax.nn.softmax(jnp.where(allowed, scores / math.sqrt(head_dim),
                                         jnp.finfo(jnp.float32).min), -1)
        return attention_lib.grouped_mix(probs, values, head_pairs=head_pairs)

    args = (*cache, q, jnp.int32(1), jnp.int32(slots - 3))
    compiled = jax.jit(run).lower(*args).compile()
    return lambda: compiled(*args)


def blocked_program(rows, num_kv, groups, head_dim, last_slot):
    rng = np.random.default_rng(0)
    cache = [jnp.asarray(rng.normal(size=(2, rows, BLOCKED_CAPACITY, num_kv, head_dim)),
                         jnp.float32) for _ in range(2)]
    q = jnp.asarray(rng.normal(size=(rows, 1, num_kv * groups, head_dim)), jnp.float32)
    slots = jnp.full((rows, 1), last_slot, jnp.int32)

    def run(q, all_keys, all_values, slots):
        return attention_lib.cached_attention(q, all_keys, all_values, 1, slots,
                                              block_size=BLOCK)

    args = (q, *cache, slots)
    compiled = jax.jit(run).lower(*args).compile()
    return lambda: compiled(*args)


def generate_program(rows, d_model, heads, kv_heads):
    config = TransformerConfig(vocab_size=512, d_model=d_model, num_layers=2, num_heads=heads,
                               num_kv_heads=kv_heads, mlp_dim=4 * d_model,
                               max_len=8 + STEPS)
    return common.compiled_generate(config, rows, prompt_len=8, steps=STEPS)


def compare_outputs(name, dimensions, make_program, repeats):
    """A table row: both sides' ms, the speedup and their largest output difference."""
    with grouped_products():
        before = make_program()
    after = make_program()
    gap = float(jnp.max(jnp.abs(before() - after())))
    times = common.interleaved_median_times(
        {"grouped": lambda: jax.block_until_ready(before()),
         "pairs": lambda: jax.block_until_ready(after())}, repeats)
    row = (name, dimensions, f"{times['grouped'] * 1e3:.3f}", f"{times['pairs'] * 1e3:.3f}",
           f"{times['grouped'] / times['pairs']:.2f}x", f"{gap:.1e}")
    print(row, flush=True)
    return row


def compare_attention(repeats):
    return [compare_outputs(name, "B {} S {} KV {} G {} d {}".format(*shape),
                            lambda shape=shape: attention_program(*shape), repeats)
            for name, shape in ATTENTION_SHAPES.items()]


def compare_blocked(repeats):
    rows = []
    for name, shape in BLOCKED_SHAPES.items():
        for filled in (BLOCKED_CAPACITY // 4, BLOCKED_CAPACITY):
            rows.append(compare_outputs(
                name, "B {} KV {} G {} d {}, {} of {} slots".format(*shape, filled,
                                                                  BLOCKED_CAPACITY),
                lambda shape=shape, filled=filled: blocked_program(*shape, filled - 1),
                repeats))
    return rows


def compare_generate(repeats):
    rows = []
    for name, shape in GENERATE_SHAPES.items():
        with grouped_products():
            before = generate_program(*shape)
        after = generate_program(*shape)
        rows.append((name, "rows {} d_model {} heads {} / {}".format(*shape))
                    + common.sampling_ab({"grouped": before, "pairs": after}, repeats))
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> tuple[list, list, list]:
    """Runs the three parts; returns their table rows (attention, blocked, generate)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--append", action="store_true", help="append to RESULTS.md")
    args = parser.parse_args(argv)
    common.host_settings_as_the_cli()
    start_load = common.load_average()
    section = "Decode attention: products over every head pair"
    description = (f"median of {args.repeats} interleaved rounds; computations inline, "
                   f"freed memory kept (as the CLI)")
    attention = compare_attention(args.repeats)
    common.report("decode_attention.py", section,
                  f"**attention** (one layer, one query token per row; {description}; load "
                  f"average {start_load:.1f} at the start).",
                  ("shape", "dimensions", "grouped (ms)", "head pairs (ms)", "speedup",
                   "max |diff|"), attention, append=args.append)
    blocked = compare_blocked(args.repeats)
    common.report("decode_attention.py", section,
                  f"**blocked** (`cached_attention`, blocks of {BLOCK}; {description}).",
                  ("shape", "dimensions", "grouped (ms)", "head pairs (ms)", "speedup",
                   "max |diff|"), blocked, append=args.append)
    decode = compare_generate(args.repeats)
    common.report("decode_attention.py", section,
                  f"**generate**: {STEPS} tokens, 2-layer model, MLP 4 x d_model, vocabulary "
                  f"512, 8 prompt tokens ({description}; load average "
                  f"{common.load_average():.1f} at the end).",
                  ("setting", "model", "grouped (ms)", "head pairs (ms)", "speedup",
                   "same tokens", "max |logp diff|"), decode, append=args.append)
    return attention, blocked, decode


if __name__ == "__main__":
    main()
