"""Plots the RL curves of `experiments.learning_stages --curve_csv` runs.

    python -m benchmarks.plot_learning_curves --out=benchmarks/learning_curves.png \
        benchmarks/learning_curves/ppo_sokoban_seed0.csv ...

One panel per CSV: the rollouts' success per RL step (grey) and its 10-step moving mean
(black); for a mixture also each member's 10-step mean (`success_rate/<i>_<name>`).
"""

from __future__ import annotations

import argparse
import csv
import os

import numpy as np


def read_curve(path: str) -> dict[str, np.ndarray]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return {name: np.array([float(r[name]) for r in rows]) for name in rows[0]}


def moving_mean(values: np.ndarray, window: int = 10) -> np.ndarray:
    """Mean of the last `window` values at every step (fewer at the start)."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def main():
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cols = min(3, len(args.csv))
    rows = -(-len(args.csv) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, path in zip(axes.flat, args.csv):
        curve = read_curve(path)
        steps = curve["step"]
        ax.plot(steps, curve["success_rate"], color="black", alpha=0.2, lw=0.8)
        ax.plot(steps, moving_mean(curve["success_rate"]), color="black", lw=1.8,
                label="all")
        for name in sorted(k for k in curve if k.startswith("success_rate/")):
            ax.plot(steps, moving_mean(curve[name]), lw=1.2, label=name.split("/", 1)[1])
        ax.set_title(os.path.basename(path)[:-4], fontsize=9)
        ax.set_ylim(0, 1)
        ax.set_xlabel("RL step")
        ax.set_ylabel("rollout success")
        ax.grid(alpha=0.3)
        if len(curve) and any(k.startswith("success_rate/") for k in curve):
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(args.csv):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
