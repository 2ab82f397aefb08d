"""Shared group prefill: the rollout reads each GRPO group's prompt once and copies its KV
cache to the group's rows (`rollout(..., share_group_prefill=True)`, what the token
trainer does), against prefilling the same prompt once per row.

Each point times one jitted single-turn rollout (`num_tasks` prompts x `group_size` rows,
`prompt` random tokens each, `new` sampled tokens per row) of `peers.TargetToken`, the
same model and weights on both sides, interleaved rounds, medians. The script checks
that both sides sample the same tokens and reports the largest behaviour log-prob gap.

    python benchmarks/group_prefill.py            # table; --append adds it to RESULTS.md
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from arl import rollout as rollout_lib  # noqa: E402
from arl.models import Transformer, TransformerConfig  # noqa: E402
from arl.rollout.trajectory import SamplingConfig  # noqa: E402
import common  # noqa: E402  pylint: disable=wrong-import-position
from peers import TargetToken  # noqa: E402  pylint: disable=wrong-import-position

POINTS = ((128, 8), (512, 8), (1024, 8), (1024, 4), (2048, 8))  # (prompt, group_size)


def make_rollout(env, model, num_tasks: int, group_size: int, share: bool):
    @jax.jit
    def play(params, key):
        return rollout_lib.rollout(env, key, num_tasks=num_tasks, group_size=group_size,
                                   model=model, params=params, sampling=SamplingConfig(),
                                   share_group_prefill=share)
    return play


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tasks", type=int, default=2)
    parser.add_argument("--new", type=int, default=16, help="sampled tokens per row")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--points", default=",".join(f"{p}:{g}" for p, g in POINTS),
                        help="prompt:group_size pairs")
    parser.add_argument("--append", action="store_true", help="append to RESULTS.md")
    args = parser.parse_args(argv)
    points = common.int_pairs(args.points)

    vocab = 512
    config = TransformerConfig(vocab_size=vocab + 1, d_model=256, num_layers=4, num_heads=8,
                               num_kv_heads=2, mlp_dim=1024,
                               max_len=max(p for p, _ in points) + args.new + 1)
    model = Transformer(config)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    start_load = common.load_average()
    rows = []
    for prompt_len, group_size in points:
        env = TargetToken(vocab=vocab, prompt_len=prompt_len, gen_len=args.new)
        key = jax.random.key(1)
        runs = {name: functools.partial(
                    make_rollout(env, model, args.num_tasks, group_size, share), params, key)
                for name, share in (("per row", False), ("shared", True))}
        rows.append((prompt_len, group_size)
                    + common.sampling_ab(runs, args.repeats, logp_field="behaviour_logp"))
        print(rows[-1], flush=True)

    header = ("prompt", "group size", "prefill per row (ms)", "shared prefill (ms)",
              "speedup", "same tokens", "max |logp diff|")
    common.report(
        "group_prefill.py", "Shared group prefill",
        f"One single-turn rollout: {args.num_tasks} prompts x group size rows, {args.new} "
        f"sampled tokens per row; model d_model 256, 4 layers, 8 query / 2 key-value heads, "
        f"MLP 1024, vocab {vocab + 1}, float32, dense attention below 512 cache slots and "
        f"filled blocks above; median of {args.repeats} interleaved rounds (load average "
        f"{start_load:.1f} at the start, {common.load_average():.1f} at the end).",
        header, rows, append=args.append)


if __name__ == "__main__":
    main()
