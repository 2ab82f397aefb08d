"""Page faults and step time of arl's train step under three host-allocator settings.

XLA on the CPU mallocs each step's buffers and frees them at the end of the step; glibc
serves large blocks as fresh mappings, so every step faults its scratch in again
(`arl/runs/allocator.py` explains it). Variants, each in its own process (the settings
are process-wide), alternated round by round:

* default: glibc as it comes (ARL_KEEP_FREED_MEMORY=0);
* keep: `arl.runs.allocator.keep_freed_memory()` alone (steps dispatched to JAX's worker
  thread, as the training CLI ran them before it ran them inline);
* keep + inline: what the training CLI does: also `run_computations_inline()` before
  JAX starts, so the step runs (and allocates) on the main thread, whose heap keeps
  blocks of any size;
* keep + 1 arena: `keep` with GLIBC_TUNABLES=glibc.malloc.arena_max=1 set before the
  process starts (every thread allocates from the main heap, so blocks above a thread
  arena's 64 MiB stop being mapped afresh too; the threads then share one lock).

The steps are the peers-benchmark settings (`benchmarks/peers.py`: same model, same
GRPO step). Reported: which settings took effect in each process, median step time,
minor page faults per step (getrusage).

    python benchmarks/host_allocator.py                  # toy, multiturn, modest; 3 rounds
    python benchmarks/host_allocator.py --record         # + RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position

VARIANTS = {
    "default": {"ARL_KEEP_FREED_MEMORY": "0"},
    "keep": {"ARL_KEEP_FREED_MEMORY": "1"},
    "keep + inline": {"ARL_KEEP_FREED_MEMORY": "1", "ARL_BENCH_INLINE": "1"},
    "keep + 1 arena": {"ARL_KEEP_FREED_MEMORY": "1",
                       "GLIBC_TUNABLES": "glibc.malloc.arena_max=1"},
}


def child(setting_name: str, steps: int, cache_dir: str) -> dict:
    """Runs in the variant's own process: builds the step, times `steps` steps."""
    from arl.runs import allocator  # pylint: disable=import-outside-toplevel
    import peers  # pylint: disable=import-outside-toplevel

    inline = os.environ.get("ARL_BENCH_INLINE") == "1" and allocator.run_computations_inline()
    applied = allocator.keep_freed_memory_unless_disabled()
    setting = protocol.SETTINGS[setting_name]
    runner = peers.ArlRunner(setting, peers.write_checkpoint(setting, cache_dir), warmup=2)
    times, faults = [], []
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        runner._run_step()  # pylint: disable=protected-access
        times.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return dict(applied=applied, inline=inline, step_s=times, faults=faults)


def run_variant(variant: str, setting: str, steps: int, cache_dir: str) -> dict:
    env = dict(os.environ, **VARIANTS[variant])
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", setting,
                          "--steps", str(steps), "--cache_dir", cache_dir],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def applied_settings(results: list[dict]) -> str:
    """What the variant's processes report they applied (the same in every process, or
    each process's report)."""
    reports = {" + ".join(name for name, on in (("kept heap", r["applied"]),
                                                 ("inline", r["inline"])) if on) or "none"
               for r in results}
    return " / ".join(sorted(reports))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="toy,multiturn,modest")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per process")
    parser.add_argument("--cache_dir", default=os.path.expanduser("~/.cache/arl-bench-peers"))
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.cache_dir)))
        return None
    settings = [s for s in args.settings.split(",") if s]
    unknown = [s for s in settings if s not in protocol.SETTINGS]
    if unknown or not settings:
        parser.error(f"--settings: unknown {unknown}; allowed values are "
                     f"{sorted(protocol.SETTINGS)}")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be >= 1")
    load_start = common.load_average()
    rows = []
    for name in settings:
        runs = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for variant in VARIANTS:
                runs[variant].append(run_variant(variant, name, args.steps, args.cache_dir))
        base = statistics.median(statistics.median(r["step_s"]) for r in runs["default"])
        for variant, results in runs.items():
            per_process = [statistics.median(r["step_s"]) for r in results]
            step = statistics.median(per_process)
            faults = statistics.median(f for r in results for f in r["faults"])
            rows.append([name, variant, applied_settings(results), f"{step * 1e3:.1f}",
                         " / ".join(f"{t * 1e3:.1f}" for t in per_process),
                         f"{faults:,.0f}", f"{base / step:.2f}x"])
            print(" | ".join(rows[-1]), flush=True)
    load_end = common.load_average()
    table = common.markdown_table(
        ["setting", "allocator", "took effect", "step ms (median)", "per process",
         "page faults / step",
         "speedup vs default"], rows)
    text = (f"### `benchmarks/host_allocator.py` — {common.utc_now()}\n\n"
            f"Machine: {common.machine_line()}. 1-minute load average {load_start:.2f} at the "
            f"start, {load_end:.2f} at the end. {args.rounds} processes per variant, "
            f"alternated; each times {args.steps} steps after 2 warm-up steps (median per "
            f"process, then the median of the processes).\n\n{table}\n")
    print(text)
    if args.record:
        common.append_section("Host allocator", text)
    return rows


if __name__ == "__main__":
    main()
