"""A/B of one config option in arl's train step, at the settings of `benchmarks/peers.py`.

A is arl's side of `peers.py` (`harness.ArlRunner`: GRPO, the setting's shared
checkpoint, `harness.arl_config`); B is A with the given overrides. Both compiled in
this process and stepped in alternating rounds (the order reversed every other round), so load from other
jobs hits both alike; the step, its rollout compiled alone, and update = step - rollout
are medians. Their rollouts from one key are compared token for token ("same tokens": an
option that should not change what is sampled must say yes).

    python benchmarks/ab.py updates.reuse_rollout_activations=False [--settings toy,modest]
    python benchmarks/ab.py model.attention=blocked model.attention_block=32 --rounds 7

Options a user may choose and what they were measured to be worth are in
docs/performance.md. Process-wide settings (the host allocator) cannot be A/B'd in one
process: compare two runs of `peers.py --peers=arl` with `ARL_KEEP_FREED_MEMORY` set
and not.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402  pylint: disable=wrong-import-position
import harness  # noqa: E402  pylint: disable=wrong-import-position
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position


def alternating_medians(sides, rounds: int) -> dict[str, dict[str, float]]:
    """{name: median step_s and rollout_s} of `rounds` rounds of `step()` of each
    (name, runner) in `sides`, in reversed order every other round."""
    runs = {name: [] for name, _ in sides}
    for index in range(rounds):
        for name, runner in sides if index % 2 == 0 else sides[::-1]:
            runs[name].append(runner.step())
    return {name: {k: float(np.median([r[k] for r in records]))
                   for k in ("step_s", "rollout_s")} for name, records in runs.items()}


def compare_setting(name: str, overrides: dict, rounds: int, cache_dir: str) -> list:
    setting = protocol.SETTINGS[name]
    checkpoint = harness.write_checkpoint(setting, cache_dir)
    sides = (("A", harness.ArlRunner(setting, checkpoint, warmup=2)),
             ("B", harness.ArlRunner(setting, checkpoint, warmup=2, overrides=overrides)))
    key = jax.random.key(5)
    tokens = [jax.device_get(runner.rollout_program(runner.params, key).tokens)
              for _, runner in sides]
    median = alternating_medians(sides, rounds)
    a, b = median["A"], median["B"]
    update_a, update_b = (m["step_s"] - m["rollout_s"] for m in (a, b))
    return [name, common.fmt_ms(a["step_s"]), common.fmt_ms(b["step_s"]),
            f"{a['step_s'] / b['step_s']:.2f}x", common.fmt_ms(a["rollout_s"]),
            common.fmt_ms(b["rollout_s"]), common.fmt_ms(update_a), common.fmt_ms(update_b),
            "yes" if np.array_equal(*tokens) else "no"]


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="+", metavar="KEY=VALUE",
                        help="B's changes to arl's config, e.g. "
                             "updates.reuse_rollout_activations=False")
    parser.add_argument("--settings", default="toy,modest,multiturn",
                        help=f"comma-separated, from {sorted(protocol.SETTINGS)}")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cache_dir", "--cache-dir",
                        default=os.path.expanduser("~/.cache/arl-bench-peers"),
                        help="where the settings' checkpoints are written once")
    args = parser.parse_args(argv)
    names = protocol.setting_names(parser, args.settings)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    overrides = dict(harness.parse_override(text) for text in args.overrides)
    harness.arl_config(protocol.SETTINGS[names[0]], "", overrides)  # unknown keys: exit early
    common.host_settings_as_the_cli()
    start_load = common.load_average()
    rows = [compare_setting(name, overrides, args.rounds, args.cache_dir) for name in names]
    changes = ", ".join(f"`{k}={v!r}`" for k, v in overrides.items())
    print(f"### `benchmarks/ab.py` — {common.utc_now()}\n\n{common.machine_line()}\n\n"
          f"A: arl's side of `peers.py`; B: A with {changes}. Median of {args.rounds} "
          f"alternating rounds; update = step - rollout (compiled alone); load average "
          f"{start_load:.1f} at the start, {common.load_average():.1f} at the end. Command: "
          f"`python benchmarks/ab.py {' '.join(args.overrides)} --settings {args.settings} "
          f"--rounds {args.rounds}`.\n\n" + common.markdown_table(
              ("setting", "step A (ms)", "step B (ms)", "A / B", "rollout A (ms)",
               "rollout B (ms)", "update A (ms)", "update B (ms)", "same tokens"), rows))
    return rows


if __name__ == "__main__":
    main()
