"""The train step against its own matmuls: how close to the matmul peak arl's step gets
with the matmul kernels this backend has.

Every `dot` of the compiled program (arl's side of `benchmarks/peers.py`: the GRPO train
step, the update reusing the rollout's activations, and its rollout compiled alone) is
taken from its optimized HLO with its operand shapes and dimension numbers, counted as
many times as a `jax.profiler` trace of one call saw it run (loop trip counts in, a
conditional's untaken branch out: `executed_thunks`), and timed alone as a jitted
`lax.dot_general` of those shapes, less the time of calling a jitted program that does
next to nothing. The sum is the time the program would take if everything but its
matmuls were free; update = step - rollout. Rates are against the best float32
`jnp.dot` peak (`--peak-size`^2) measured in the run.

    python benchmarks/matmul_ceiling.py [--settings toy,modest,multiturn] [--repeats 7]
                                        [--cache-dir ~/.cache/arl-bench-peers] [--record]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import re
import sys
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[[\d,]*\]\S* dot\(%([\w.\-]+), "
                  r"%([\w.\-]+)\)(.*)$")
_CALLEE = re.compile(r"(calls|body|to_apply|condition)=%([\w.\-]+)")
_NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")


def _dims(text: str, field: str) -> tuple[int, ...]:
    match = re.search(field + r"=\{([\d,]*)\}", text)
    return tuple(int(d) for d in match.group(1).split(",") if d) if match else ()


def hlo_dots(hlo_text: str, executed: collections.Counter) -> list[dict]:
    """Every `dot` of an optimized HLO module that ran: dtype, operand shapes, dimension
    numbers and how many times it ran, that is how often `executed` (the thunk runs of
    one call, `executed_thunks`) saw the thunk holding it (the dot itself, or the fusion
    that calls its computation) run: loop trips counted, branches not taken and dead code
    dropped."""
    shapes, lines_of = {}, collections.defaultdict(list)
    fused_by = {}  # fused computation -> the fusion instruction (the thunk) that calls it
    computation = None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            for name, dims in re.findall(r"%?([\w.\-]+): \w+\[([\d,]*)\]", line):
                shapes[name] = tuple(int(d) for d in dims.split(",") if d)
            continue
        match = _INSTRUCTION.match(line)
        if match:  # (tuple-shaped instructions, e.g. loops, have no array shape)
            shapes[match.group(1)] = tuple(int(d) for d in match.group(3).split(",") if d)
        lines_of[computation].append(line)
        name = _NAME.match(line)
        for kind, callee in _CALLEE.findall(line):
            if kind == "calls" and name:
                fused_by[callee] = name.group(1)

    dots = []
    for computation, lines in lines_of.items():
        for line in lines:
            match = _DOT.match(line)
            if not match:
                continue
            name, dtype, lhs, rhs, rest = match.groups()
            count = executed.get(fused_by.get(computation, name), 0)
            if not count:
                continue
            dots.append(dict(
                dtype=dtype, lhs=shapes[lhs], rhs=shapes[rhs], runs=count,
                numbers=((_dims(rest, "lhs_contracting_dims"),
                          _dims(rest, "rhs_contracting_dims")),
                         (_dims(rest, "lhs_batch_dims"), _dims(rest, "rhs_batch_dims")))))
    return dots


def executed_thunks(run: Callable[[], object], calls: int = 1) -> collections.Counter:
    """How many times each thunk (HLO instruction XLA runs as one unit: a fusion, a dot, a
    loop...) of the programs `run` executes ran per call (the mean over `calls` calls), from
    a `jax.profiler` trace (`run` must block until its results are ready)."""
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for _ in range(calls):
                run()
        paths = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True)
        if not paths:
            raise RuntimeError(f"jax.profiler wrote no trace under {directory}")
        with gzip.open(paths[0], "rt", encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
    counts = collections.Counter(event["name"] for event in events
                                 if event.get("ph") == "X" and not event["name"].startswith("$"))
    return collections.Counter({name: count / calls for name, count in counts.items()})


def dot_flops(dot: dict) -> float:
    """2 x (batch x M x K) x N."""
    (_, rhs_contract), (_, rhs_batch) = dot["numbers"]
    rhs_free = [d for i, d in enumerate(dot["rhs"]) if i not in rhs_contract + rhs_batch]
    return 2.0 * math.prod(dot["lhs"]) * math.prod(rhs_free)


def dispatch_seconds(repeats: int) -> float:
    """Median seconds of calling a jitted program that does next to nothing: the part of
    a dot's time alone that the same dot inside the update does not pay."""
    scalar = jnp.ones((), jnp.float32)
    program = jax.jit(lambda a: a + 1.0)
    return common.interleaved_median_times(
        {"call": lambda: jax.block_until_ready(program(scalar))}, repeats)["call"]


def dot_seconds(dot: dict, repeats: int) -> float:
    """Median seconds of the dot alone (random operands of its shapes), call included."""
    dtype = jnp.dtype(dot["dtype"].replace("f32", "float32").replace("bf16", "bfloat16"))
    lhs = jax.random.normal(jax.random.key(0), dot["lhs"], dtype)
    rhs = jax.random.normal(jax.random.key(1), dot["rhs"], dtype)
    program = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dot["numbers"]))
    return common.interleaved_median_times(
        {"dot": lambda: jax.block_until_ready(program(lhs, rhs))}, repeats)["dot"]


def dots_alone(hlo_text: str, executed: collections.Counter, repeats: int, log,
               top: int = 6):
    """(seconds, FLOPs, dots, distinct shapes) of every dot of an optimized HLO module
    (`hlo_dots`: as often as `executed` says the program ran it) timed alone at its
    shapes, less the cost of calling a jitted program; logs the `top` costliest shapes."""
    dots = hlo_dots(hlo_text, executed)
    signatures = collections.Counter()
    for dot in dots:
        signatures[(dot["dtype"], dot["lhs"], dot["rhs"], dot["numbers"])] += dot["runs"]
    call = dispatch_seconds(5 * repeats)
    timed = []  # (seconds of all its runs, GFLOP/s, signature, runs, FLOPs of one run)
    for signature, runs in signatures.items():
        dot = dict(zip(("dtype", "lhs", "rhs", "numbers"), signature))
        seconds = max(1e-9, dot_seconds(dot, repeats) - call)
        work_once = dot_flops(dot)
        timed.append((runs * seconds, work_once / seconds / 1e9, signature, runs, work_once))
    for seconds, rate, (dtype, lhs, rhs, numbers), runs, _ in sorted(timed,
                                                                     reverse=True)[:top]:
        log(f"dot {dtype} {lhs} x {rhs} {numbers} x{runs}: {1e3 * seconds:.1f} ms, "
            f"{rate:.0f} GFLOP/s")
    return (sum(t[0] for t in timed), sum(t[3] * t[4] for t in timed), dots,
            len(signatures))


def step_part(names, repeats, peak, log, peak_size, cache_dir):
    """The whole train step of `peers.py` (rollout + update, arl's side exactly as that
    benchmark compiles and runs it) and its rollout alone, each against the sum of its
    own dots timed alone: the time the step would take on this machine's matmul kernels
    if nothing else in it cost anything."""
    import harness  # pylint: disable=import-outside-toplevel

    rows, peaks = [], [peak]
    for name in names:
        peaks.append(common.matmul_peak_flops(peak_size))
        setting = protocol.SETTINGS[name]
        runner = harness.ArlRunner(setting, harness.write_checkpoint(setting, cache_dir),
                                   warmup=2)
        step_dots, step_flops, _, _ = dots_alone(
            runner.step_program.as_text(), executed_thunks(runner._run_step),  # pylint: disable=protected-access
            repeats, lambda line: log(f"  {name} step {line}"))
        rollout_dots, rollout_flops, _, _ = dots_alone(
            runner.rollout_program.as_text(), executed_thunks(runner._run_rollout),  # pylint: disable=protected-access
            repeats, lambda line: log(f"  {name} rollout {line}"))
        times = common.interleaved_median_times(
            {"step": runner._run_step, "rollout": runner._run_rollout}, repeats)  # pylint: disable=protected-access
        update, update_dots = times["step"] - times["rollout"], step_dots - rollout_dots
        update_flops = step_flops - rollout_flops
        rows.append([name, common.fmt_ms(times["step"]), common.fmt_ms(step_dots),
                     f"{step_dots / times['step']:.0%}", f"{step_flops / 1e9:.1f}",
                     step_flops / step_dots, common.fmt_ms(times["rollout"]),
                     common.fmt_ms(rollout_dots), f"{rollout_dots / times['rollout']:.0%}",
                     common.fmt_ms(update), common.fmt_ms(update_dots),
                     f"{update_dots / update:.0%}", f"{update_flops / 1e9:.1f}",
                     update_flops / update, update_flops / update_dots])
        log(f"step {name}: step {times['step']:.3f} s, its dots alone {step_dots:.3f} s; "
            f"rollout {times['rollout']:.3f} s, its dots alone {rollout_dots:.3f} s")
    best = max(peaks)
    for row in rows:
        for column in (5, 13, 14):
            row[column] = f"{row[column] / 1e9:.0f} ({row[column] / best:.0%})"
    return (f"arl's side of `peers.py` (`TokenTrainer.train_step`, state donated; the "
            f"rollout compiled alone); update = step - rollout. Dots alone: every dot the "
            f"compiled program ran in one call (`executed_thunks`: counted from a profile, "
            f"so a conditional's untaken branch is not counted), at its shapes, timed alone. "
            f"Rate of the dots alone against the best float32 matmul peak measured in this "
            f"part, {best / 1e9:.1f} GFLOP/s (readings: "
            f"{', '.join(f'{p / 1e9:.0f}' for p in peaks)}).\n\n" + common.markdown_table(
                ["setting", "step ms", "its dots alone ms", "dots / step",
                 "dot GFLOP executed", "dots alone GFLOP/s (of peak)", "rollout ms",
                 "its dots alone ms", "dots / rollout", "update ms", "its dots alone ms",
                 "dots / update", "update dot GFLOP", "update GFLOP/s (of peak)",
                 "update's dots alone GFLOP/s (of peak)"], rows))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="toy,modest,multiturn",
                        help=f"comma-separated, from {sorted(protocol.SETTINGS)}")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/arl-bench-peers"),
                        help="where the peers' shared checkpoints are written")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--peak-size", type=int, default=1024)
    parser.add_argument("--record", action="store_true",
                        help="write the table as the Matmul ceiling section of RESULTS.md")
    args = parser.parse_args(argv)
    names = protocol.setting_names(parser, args.settings)
    common.host_settings_as_the_cli()
    log = lambda line: print(line, flush=True)
    load_start = common.load_average()
    peak = common.matmul_peak_flops(args.peak_size)
    log(f"float32 matmul peak ({args.peak_size}^2): {peak / 1e9:.1f} GFLOP/s")
    table = step_part(names, args.repeats, peak, log, args.peak_size, args.cache_dir)
    common.publish("Matmul ceiling", common.heading("matmul_ceiling.py") + (
        f"Load average {load_start:.1f} at the start. Median of {args.repeats} interleaved "
        f"rounds.\n\n{table}\n"), args.record)


if __name__ == "__main__":
    main()
