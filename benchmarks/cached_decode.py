"""Decoding with a KV cache larger than what is filled: dense attention over every slot vs
`model.attention = "auto"`, which reads only the cache blocks up to the last query
(`arl.models.attention.cached_attention`).

A multi-turn rollout sizes its static cache for the longest context an episode can
reach, so early turns decode against a mostly empty buffer. Each point prefills
`prompt` tokens into a cache of `capacity` slots (once, not timed) and times decoding
`new` tokens (`generate`, full budget); both sides run the same model and weights and
sample the same tokens (the script checks it). Times are medians of interleaved rounds.

    python benchmarks/cached_decode.py            # table; --append adds it to RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from arl.models import Transformer, TransformerConfig, generate, init_cache  # noqa: E402
import common  # noqa: E402  pylint: disable=wrong-import-position

POINTS = ((1024, 64), (2048, 64), (4096, 64), (4096, 1024), (4096, 2048), (4096, 3968))


def make_decoder(config: TransformerConfig, params, prompt, capacity: int, new_tokens: int):
    """(prefilled cache, last logits), computed once, and the timed part: `generate`."""
    model = Transformer(config)
    batch = prompt.shape[0]
    prefill = jax.jit(lambda params, prompt: model.apply(
        {"params": params}, prompt, init_cache(config, batch, capacity), method="decode"))
    out = jax.block_until_ready(prefill(params, prompt))

    @jax.jit
    def decode(params, cache, last_logits, key):
        return generate(model, params, cache, last_logits, key, max_new_tokens=new_tokens,
                        eot_id=-1, pad_id=0, temperature=1.0)
    return lambda key: decode(params, out.cache, out.logits[:, -1], key)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new", type=int, default=64, help="decoded tokens per row")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--points", default=",".join(f"{c}:{p}" for c, p in POINTS),
                        help="capacity:prompt pairs")
    parser.add_argument("--append", action="store_true", help="append to RESULTS.md")
    args = parser.parse_args(argv)
    points = common.int_pairs(args.points)

    base = TransformerConfig(vocab_size=512, d_model=256, num_layers=4, num_heads=8,
                             num_kv_heads=2, mlp_dim=1024, max_len=max(c for c, _ in points))
    configs = {"dense": dataclasses.replace(base, attention="dense"),
               "filled blocks": dataclasses.replace(base, attention="auto",
                                                    attention_block=512)}
    params = jax.jit(Transformer(base).init)(jax.random.key(0),
                                             jnp.zeros((1, 1), jnp.int32))["params"]
    start_load = common.load_average()
    rows = []
    for capacity, prompt_len in points:
        prompt = jax.random.randint(jax.random.key(1), (args.batch, prompt_len), 0,
                                    base.vocab_size)
        key = jax.random.key(2)
        runs = {name: functools.partial(make_decoder(config, params, prompt, capacity,
                                                     args.new), key)
                for name, config in configs.items()}
        rows.append((capacity, prompt_len) + common.sampling_ab(runs, args.repeats))
        print(rows[-1], flush=True)

    header = ("cache capacity", "prompt", "dense (ms)", "filled blocks (ms)", "speedup",
              "same tokens", "max |logp diff|")
    common.report(
        "cached_decode.py", "Cached decoding",
        f"{args.new} sampled tokens per row after the prefill (not timed), {args.batch} rows; model d_model 256, "
        f"4 layers, 8 query / 2 key-value heads, MLP 1024, vocab 512, float32; "
        f"median of {args.repeats} interleaved rounds (load average {start_load:.1f} at the "
        f"start, {common.load_average():.1f} at the end). \"filled blocks\": "
        f"`attention=\"auto\"`, blocks of 512 slots.",
        header, rows, append=args.append)


if __name__ == "__main__":
    main()
