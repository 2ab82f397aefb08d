"""The update reusing the rollout's activations vs recomputing its forward pass, in arl's
peers programs.

With `updates.reuse_rollout_activations` the rollout records every layer's projection
outputs while it decodes, and the update's projections take them as their forward values
(`arl.models.projections.stored_linear`): the update skips the forward matmuls (a third
of its matmul FLOPs) and the rollout pays for writing the records. Both sides here are
arl's peers runners (`benchmarks/peers.py`: the compiled GRPO step, and its rollout
compiled alone) of one setting, built in this process, differing only in that option;
their rollouts from the same key must sample the same tokens (checked). Rounds alternate
the two sides' order.

    python benchmarks/reuse_activations.py [--settings toy,modest,multiturn] [--rounds 15]
                                           [--append]
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402  pylint: disable=wrong-import-position
import peers  # noqa: E402  pylint: disable=wrong-import-position
from arl.models.transformer import projection_features  # noqa: E402
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position



def recorded_bytes(runner) -> int:
    """Bytes of the rollout's recorded projections (0 when it records none)."""
    trainer = runner.trainer
    if not trainer.learner.reuse_activations:
        return 0
    config = trainer.model.config
    per_position = sum(math.prod(f) for f in projection_features(config).values())
    return (config.num_layers * trainer.batch_size * trainer.context_length * per_position
            * jax.numpy.dtype(config.dtype).itemsize)


def compare_setting(name: str, rounds: int, cache_dir: str) -> list:
    setting = protocol.SETTINGS[name]
    checkpoint = peers.write_checkpoint(setting, cache_dir)
    sides = (("recompute", peers.ArlRunner(setting, checkpoint, warmup=2,
                                           reuse_activations=False)),
             ("reuse", peers.ArlRunner(setting, checkpoint, warmup=2,
                                       reuse_activations=True)))
    key = jax.random.key(5)
    recompute, reuse = (jax.device_get(runner.rollout_program(runner.params, key).tokens)
                        for _, runner in sides)
    same_tokens = bool(np.array_equal(recompute, reuse))
    median = peers.alternating_medians(sides, rounds)
    old, new = median["recompute"], median["reuse"]
    old_update, new_update = (m["step_s"] - m["rollout_s"] for m in (old, new))
    return [name, common.fmt_ms(old["step_s"]), common.fmt_ms(new["step_s"]),
            f"{old['step_s'] / new['step_s']:.2f}x", common.fmt_ms(old["rollout_s"]),
            common.fmt_ms(new["rollout_s"]), common.fmt_ms(old_update),
            common.fmt_ms(new_update), common.fmt_mib(recorded_bytes(sides[1][1])),
            "yes" if same_tokens else "NO"]


def main(argv=None) -> list:
    args, names = peers.ab_arguments(__doc__.splitlines()[0], argv)
    common.host_settings_as_the_cli()
    start_load = common.load_average()
    rows = [compare_setting(name, args.rounds, args.cache_dir) for name in names]
    common.report(
        "reuse_activations.py", "Reusing the rollout's activations",
        f"arl's peers programs (`peers.py` settings), the update recomputing its forward "
        f"pass vs taking the layers' projection outputs from the rollout "
        f"(`updates.reuse_rollout_activations`); median of {args.rounds} alternating "
        f"rounds of the step and of the rollout compiled alone (update = step - rollout); "
        f"computations inline, freed memory kept (as the CLI); load average "
        f"{start_load:.1f} at the start, {common.load_average():.1f} at the end.",
        ("setting", "step recompute (ms)", "step reuse (ms)", "speedup",
         "rollout recompute (ms)", "rollout reuse (ms)", "update recompute (ms)",
         "update reuse (ms)", "recorded (MiB)", "same tokens"),
        rows, append=args.append)
    return rows


if __name__ == "__main__":
    main()
