"""Decoding on a per-layer KV cache vs the stacked cache, in arl's peers programs.

With every layer unrolled (the trainer's default `model.layer_unroll` 0), the rollout
decodes on one cache buffer per layer and on per-layer weight slices, both made once
before the turn loop (`arl.models.transformer_config.decodes_per_layer`). From the stacked
`[L, B, S, KV, d]` cache XLA:CPU copies each layer's keys and values out at every token
and layer, and each layer's weights too. Both sides here are arl's peers runners
(`benchmarks/peers.py`: the compiled GRPO step, and its rollout compiled alone) of one
setting, built in this process; the "stacked" side is traced with `decodes_per_layer`
patched to False, the previous path. Their rollouts from the same key must sample the
same tokens (checked). Rounds alternate the two sides' order.

    python benchmarks/per_layer_cache.py [--settings toy,modest,multiturn] [--rounds 15]
                                         [--append]
"""

from __future__ import annotations

import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402  pylint: disable=wrong-import-position
import peers  # noqa: E402  pylint: disable=wrong-import-position
from arl.models import sampling as sampling_lib  # noqa: E402
from arl.models import transformer as transformer_lib  # noqa: E402
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position



@contextlib.contextmanager
def stacked_decoding():
    """Traces with the previous path: the stacked cache and weights in every decode."""
    saved = transformer_lib.decodes_per_layer
    transformer_lib.decodes_per_layer = sampling_lib.decodes_per_layer = lambda config: False
    try:
        yield
    finally:
        transformer_lib.decodes_per_layer = sampling_lib.decodes_per_layer = saved


def compare_setting(name: str, rounds: int, cache_dir: str) -> list:
    setting = protocol.SETTINGS[name]
    checkpoint = peers.write_checkpoint(setting, cache_dir)
    with stacked_decoding():
        stacked = peers.ArlRunner(setting, checkpoint, warmup=2)
    per_layer = peers.ArlRunner(setting, checkpoint, warmup=2)
    key = jax.random.key(5)
    same_tokens = bool(np.array_equal(
        jax.device_get(stacked.rollout_program(stacked.params, key).tokens),
        jax.device_get(per_layer.rollout_program(per_layer.params, key).tokens)))
    median = peers.alternating_medians((("stacked", stacked), ("per_layer", per_layer)),
                                       rounds)
    old, new = median["stacked"], median["per_layer"]
    return [name, common.fmt_ms(old["step_s"]), common.fmt_ms(new["step_s"]),
            f"{old['step_s'] / new['step_s']:.2f}x", common.fmt_ms(old["rollout_s"]),
            common.fmt_ms(new["rollout_s"]), f"{old['rollout_s'] / new['rollout_s']:.2f}x",
            "yes" if same_tokens else "NO"]


def main(argv=None) -> list:
    args, names = peers.ab_arguments(__doc__.splitlines()[0], argv)
    common.host_settings_as_the_cli()
    start_load = common.load_average()
    rows = [compare_setting(name, args.rounds, args.cache_dir) for name in names]
    common.report(
        "per_layer_cache.py", "Per-layer KV cache",
        f"arl's peers programs (`peers.py` settings), stacked cache (previous path) vs "
        f"per-layer cache in decoding; median of {args.rounds} alternating rounds of the "
        f"step and of the rollout compiled alone; computations inline, freed memory kept "
        f"(as the CLI); load average {start_load:.1f} at the start, "
        f"{common.load_average():.1f} at the end.",
        ("setting", "step stacked (ms)", "step per-layer (ms)", "speedup",
         "rollout stacked (ms)", "rollout per-layer (ms)", "speedup", "same tokens"),
        rows, append=args.append)
    return rows


if __name__ == "__main__":
    main()
