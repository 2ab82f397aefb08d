"""Token sampling: the argmax of the Gumbel-max draw as two reductions vs `jnp.argmax`.

`sample_from_logits` draws token = argmax(logits / temperature + Gumbel noise) (what
`jax.random.categorical` does), and greedy decoding takes argmax(logits). On XLA:CPU
`jnp.argmax` lowers to one (value, index) reduction that runs as a scalar loop;
`arl.models.sampling.first_argmax` computes the same index as a row maximum followed by
the smallest index that holds it, two reductions that vectorise. Both sides here run
the same programs except for that function (the previous one is patched back in for the
"jnp.argmax" side) and must draw the same tokens (checked).

* draw: 32 draws from [rows, vocabulary] logits in a `lax.scan` (one per decoded token,
  as decoding does), Gumbel noise drawn per step;
* generate: `generate` of 32 new tokens by a 2-layer model (d_model 256, 8 / 2 heads,
  MLP 1024) after an 8-token prompt, its vocabulary projection included.

    python benchmarks/sampling.py [--draw-points 64:64,...] [--generate-points 8:32000,...]
                                  [--repeats 9] [--append]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import common  # noqa: E402  pylint: disable=wrong-import-position
from arl.models import TransformerConfig  # noqa: E402
from arl.models import sampling  # noqa: E402

DRAW_POINTS = ((64, 64), (128, 512), (64, 32000), (8, 151936), (64, 151936))
GENERATE_POINTS = ((8, 32000), (64, 32000), (8, 151936))
STEPS = 32


class Draws(NamedTuple):
    tokens: jax.Array
    logp: jax.Array


@contextlib.contextmanager
def argmax_as(function):
    """Traces inside the block use `function` as the sampler's argmax."""
    previous = sampling.first_argmax
    sampling.first_argmax = function
    try:
        yield
    finally:
        sampling.first_argmax = previous


def jnp_argmax(x):
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def draw_program(rows: int, vocab: int):
    logits = jax.random.normal(jax.random.key(0), (rows, vocab)) * 2.0

    def run(key):
        def step(_, k):
            return None, sampling.sample_from_logits(k, logits, temperature=0.9)
        _, (tokens, logp) = jax.lax.scan(step, None, jax.random.split(key, STEPS))
        return Draws(tokens, logp)

    compiled = jax.jit(run).lower(jax.random.key(1)).compile()
    return lambda: compiled(jax.random.key(1))


def generate_program(rows: int, vocab: int):
    config = TransformerConfig(vocab_size=vocab, d_model=256, num_layers=2, num_heads=8,
                               num_kv_heads=2, mlp_dim=1024, max_len=8 + STEPS)
    return common.compiled_generate(config, rows, prompt_len=8, steps=STEPS)


def compare(make_program, points, repeats):
    rows = []
    for batch, vocab in points:
        with argmax_as(jnp_argmax):
            before = make_program(batch, vocab)
        after = make_program(batch, vocab)
        rows.append((batch, f"{vocab:,}") + common.sampling_ab(
            {"jnp.argmax": before, "two reductions": after}, repeats))
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> tuple[list, list]:
    """Runs both parts; returns their table rows (draw, generate)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draw-points", default=",".join(f"{r}:{v}" for r, v in DRAW_POINTS),
                        help="rows:vocabulary pairs of the draw part")
    parser.add_argument("--generate-points",
                        default=",".join(f"{r}:{v}" for r, v in GENERATE_POINTS),
                        help="rows:vocabulary pairs of the generate part")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--append", action="store_true", help="append to RESULTS.md")
    args = parser.parse_args(argv)
    common.host_settings_as_the_cli()
    start_load = common.load_average()
    header = ("rows", "vocabulary", "jnp.argmax (ms)", "two reductions (ms)", "speedup",
              "same tokens", "max |logp diff|")
    description = (f"{STEPS} draws per call, temperature 0.9; median of {args.repeats} "
                   f"interleaved rounds; computations inline, freed memory kept (as the CLI)")
    draw = compare(draw_program, common.int_pairs(args.draw_points), args.repeats)
    common.report("sampling.py", "Sampling: argmax as two reductions",
                  f"**draw** ({description}; load average {start_load:.1f} at the start).",
                  header, draw, append=args.append)
    decode = compare(generate_program, common.int_pairs(args.generate_points), args.repeats)
    common.report("sampling.py", "Sampling: argmax as two reductions",
                  f"**generate**: 2-layer model, d_model 256, 8 prompt tokens ({description}; "
                  f"load average {common.load_average():.1f} at the end).",
                  header, decode, append=args.append)
    return draw, decode


if __name__ == "__main__":
    main()
