"""Shared helpers of the benchmark scripts: timing, machine description, tables, RESULTS.md.

`interleaved_median_times` runs candidates round-robin, each timed call preceded by an
untimed one, so that ratios measured in one run on a shared machine stay meaningful;
`record_section` keeps one current section per benchmark in RESULTS.md.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import statistics
import sys
import time
from importlib import metadata
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def results_path() -> str:
    """RESULTS.md under $OUT when set (accelerator runs), else benchmarks/RESULTS.md."""
    out = os.environ.get("OUT")
    return os.path.join(out, "RESULTS.md") if out else os.path.join(BENCH_DIR, "RESULTS.md")


def output_dir() -> str:
    """Where figures go: $OUT when set, else benchmarks/."""
    return os.environ.get("OUT") or BENCH_DIR


def force_host_devices(argv: Sequence[str], default: int = 0) -> int:
    """Makes the CPU backend offer the `--devices N` of `argv` (else `default`) fake devices,
    replacing any device count already in XLA_FLAGS; returns N (0: nothing set). Must run
    before JAX starts its backend (importing JAX does not start it)."""
    count = default
    for i, arg in enumerate(argv):
        if arg == "--devices" and i + 1 < len(argv):
            count = int(argv[i + 1])
        elif arg.startswith("--devices="):
            count = int(arg.split("=", 1)[1])
    if count:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                       os.environ.get("XLA_FLAGS", ""))
        os.environ["XLA_FLAGS"] = (f"{flags.strip()} "
                                   f"--xla_force_host_platform_device_count={count}").strip()
    return count


def interleaved_median_times(fns: Mapping[str, Callable[[], object]], repeats: int
                             ) -> dict[str, float]:
    """Median wall seconds of each blocking `fn()` over `repeats` round-robin rounds.

    Round-robin spreads the load of other processes over every candidate alike; each timed
    call follows an untimed call of the same candidate (warm caches and thread pool).
    """
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def compile_jitted(jitted, *args):
    """(compiled executable, lower + compile seconds) of a `jax.jit` function."""
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    return compiled, time.perf_counter() - start


def donated_step_runner(compiled, state, on_metrics=None) -> Callable[[], None]:
    """A blocking `run()` that advances `state` by one call of a compiled, state-donating
    `step(state) -> (state, metrics)`: each call feeds the previous call's output (the
    donated input is gone). `on_metrics`, if given, receives every call's metrics."""
    box = [state]

    def run():
        box[0], metrics = compiled(box[0])
        jax.block_until_ready(box[0])
        if on_metrics is not None:
            on_metrics(metrics)

    return run


def temp_bytes(compiled) -> int | None:
    """Peak scratch memory XLA planned for the program (`memory_analysis` temp bytes)."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - some backends do not report it
        return None


def matmul_peak_flops(size: int, repeats: int = 5, dtype=jnp.float32) -> float:
    """Measured matmul throughput (FLOP/s) of a square `size` jnp.dot on the default device:
    the peak against which model FLOPs utilisation is reported."""
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    b = jax.random.normal(jax.random.key(1), (size, size), dtype)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, b))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(dot(a, b))
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def host_settings_as_the_cli() -> None:
    """The training CLI's host settings, before this process's first computation: JAX
    computations run inline on the calling thread and freed memory stays mapped (a fresh
    mapping per step costs large matmuls up to 2x in page faults; `arl.runs.process_settings`)."""
    from arl.runs import process_settings  # pylint: disable=import-outside-toplevel
    process_settings.run_computations_inline()
    process_settings.keep_freed_memory()


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    device = jax.devices()[0]
    versions = []
    for package in ("flax", "optax", "rlax", "gymnax"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            pass
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores "
            f"({cpu_name()}), load average {load_average():.1f}; JAX {jax.__version__} on "
            f"{jax.device_count()} x {device.platform} ({device.device_kind}); "
            f"{', '.join(versions)}; Python {platform.python_version()}")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def parse_meshes(text: str) -> list[tuple[int, int, int]]:
    """ "8,1,1;2,4,1" -> [(8, 1, 1), (2, 4, 1)]: `--meshes` of a benchmark."""
    meshes = []
    for item in text.split(";"):
        try:
            sizes = tuple(int(x) for x in item.split(","))
        except ValueError:
            sizes = ()
        if len(sizes) != 3 or min(sizes) < 1:
            raise SystemExit(f"--meshes: {item!r} is not three positive sizes "
                             "(data, fsdp, tensor)")
        meshes.append(sizes)
    return meshes


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]],
                   align_right: bool = True) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if align_right and i else "---"
                            for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def record_section(section: str, text: str, path: str | None = None) -> str:
    """Writes `text` as the body of the `## {section}` section of RESULTS.md, replacing
    the section's previous body (the file holds the current table of each benchmark; the
    earlier ones stay in git history), or as a new section at the end.

    Re-reads the file right before writing: other benchmarks may have written meanwhile.
    Returns the path written.
    """
    path = path or results_path()
    existing = "# Benchmark results\n"
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            existing = f.read()
    lines = existing.splitlines(keepends=True)
    heading = f"## {section}"
    body = f"{heading}\n\n{text.strip()}\n"
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        updated = existing.rstrip("\n") + "\n\n" + body
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")),
                   len(lines))
        updated = "".join(lines[:start]) + body + ("\n" + "".join(lines[end:])
                                                   if end < len(lines) else "")
    with open(path, "w", encoding="utf-8") as f:
        f.write(updated)
    return path


def heading(script: str) -> str:
    """A record's first lines: the script, the date, the machine (with its load average)
    and the command that ran it."""
    command = shlex.join(["python", f"benchmarks/{script}", *sys.argv[1:]])
    return (f"### `benchmarks/{script}` — {utc_now()}\n\nMachine: {machine_line()}. "
            f"Command: `{command}`.\n\n")


def publish(section: str, text: str, write: bool) -> None:
    """Prints a benchmark's record and, when `write`, makes it `section` of RESULTS.md."""
    print(text)
    if write:
        print(f"recorded in {record_section(section, text)}")


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def fmt_ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def fmt_mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f}"
