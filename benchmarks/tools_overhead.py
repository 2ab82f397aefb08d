"""Cost of the host-side tool executors (`arl.tools`): the per-call overhead of
`run_python` on a trivial program (median of --repeats calls, each isolation layer
switched off in turn to show what it costs), of `run_sql` on a one-row query, and the
throughput of a `ToolPool` at several batch sizes. Prints Markdown tables.

`--baseline DIR` adds another revision's sandbox, e.g. main's before a change
(`git archive REV | tar -x -C DIR`): a child process imports `arl.tools` from DIR and
times its own `run_python` calls, taken in turn with this tree's, call by call.

`--train-steps N` times N `code_interpreter` train steps (configs/grpo_code_interpreter.py,
result cache off so that every cell is a sandboxed call) with every layer on and with the
kernel layers (namespaces, minimal root, seccomp) off, alternating:

    python -m benchmarks.tools_overhead [--repeats 20] [--batches 1,8,64] [--train-steps 4]
        [--baseline DIR]
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs

from arl.tools import ToolPool, run_sql, sandbox, sql  # noqa: E402

# A typical code_interpreter cell (the `squares` family's program).
CELL = "total = 0\nfor i in range(1, 48):\n    total += i * i\nprint(total)"

_BASELINE_SERVER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from arl.tools import sandbox
assert sandbox.__file__.startswith(sys.argv[1]), sandbox.__file__
print(json.dumps(sandbox.sandbox_capabilities().describe()), flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    result = sandbox.run_python(json.loads(line))
    print(json.dumps([time.perf_counter() - start, result.ok, result.observation]), flush=True)
"""


class Baseline:
    """Another revision's `run_python`, in a child process that times its own calls."""

    def __init__(self, directory: str):
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BASELINE_SERVER, os.path.abspath(directory)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=directory)
        self.capabilities = json.loads(self.process.stdout.readline())

    def __call__(self, code: str):
        self.process.stdin.write(json.dumps(code) + "\n")
        self.process.stdin.flush()
        seconds, ok, observation = json.loads(self.process.stdout.readline())
        assert ok, observation
        return seconds

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def _start_up_seconds(python: str) -> float:
    start = time.perf_counter()
    subprocess.run([python, "-I", "-S", "-c", "pass"], check=True)
    return time.perf_counter() - start


def _timed(call):
    start = time.perf_counter()
    result = call()
    if isinstance(result, float):  # a baseline call, timed in its own process
        return result
    assert result.ok, result
    return time.perf_counter() - start


def _interleaved_ms(calls: dict, repeats: int) -> dict:
    """name -> (median ms, min ms), the calls taken in turn, one of each per round."""
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(_timed(call))
    return {name: (1000 * statistics.median(t), 1000 * min(t)) for name, t in times.items()}


def _without_kernel_layers(capabilities):
    """The same sandbox with only the layers that need no kernel support: uid drop,
    rlimits and audit hooks."""
    return sandbox.SandboxCapabilities(uid_drop=capabilities.uid_drop)


def _per_call_table(args) -> None:
    python = os.path.realpath(sys.executable)
    capabilities = sandbox.sandbox_capabilities()
    limits = sandbox.SandboxLimits()
    calls = {}
    baseline = Baseline(args.baseline) if args.baseline else None
    # What one more interpreter costs here (the worker is an executed interpreter now).
    calls["python -I -S -c pass (start-up alone)"] = lambda: float(_start_up_seconds(python))
    if baseline:
        print(f"baseline {args.baseline}: {baseline.capabilities}")
        calls["baseline: run_python('pass')"] = lambda: baseline("pass")
        calls["now: run_python('pass')"] = lambda: sandbox.run_python("pass")
        calls["baseline: run_python(cell)"] = lambda: baseline(CELL)
        calls["now: run_python(cell)"] = lambda: sandbox.run_python(CELL)
    variants = {
        "now: run_python('pass'), all layers": (capabilities, True),
        "  without audit hooks": (capabilities, False),
        "  without seccomp": (dataclasses.replace(capabilities, seccomp=False), True),
        "  without minimal root": (dataclasses.replace(capabilities, mount_namespace=False),
                                   True),
        "  without any namespace": (sandbox.SandboxCapabilities(
            uid_drop=capabilities.uid_drop, seccomp=capabilities.seccomp), True),
        "  without the kernel layers": (_without_kernel_layers(capabilities), True),
    }
    for name, (caps, hooks) in variants.items():
        calls[name] = (lambda caps=caps, hooks=hooks:
                       sandbox.execute("pass", limits, python, caps, hooks))
    data = sql.random_company_database(0).to_bytes()
    calls["run_sql(COUNT(*))"] = lambda: run_sql(data, "SELECT COUNT(*) FROM employees")
    for name, call in list(calls.items()):
        result = call()
        if not isinstance(result, float) and not result.ok:  # e.g. an interpreter under a
            print(f"skipped {name!r}: {result.observation}")  # 0700 home, no minimal root
            del calls[name]
    print("| call | median ms | min ms |\n|---|---:|---:|")
    try:
        for name, (median, best) in _interleaved_ms(calls, args.repeats).items():
            print(f"| {name} | {median:.1f} | {best:.1f} |")
    finally:
        if baseline:
            baseline.close()


def _pool_table(args) -> None:
    print("\n| batch | workers | seconds | calls/s |\n|---:|---:|---:|---:|")
    with ToolPool(args.workers) as pool:
        for size in (int(s) for s in args.batches.split(",")):
            start = time.perf_counter()
            results = pool.map(sandbox.run_python, ["pass"] * size)
            elapsed = time.perf_counter() - start
            assert all(r.ok for r in results)
            print(f"| {size} | {pool.max_workers} | {elapsed:.2f} | {size / elapsed:.1f} |")


def _train_step_table(args) -> None:
    import jax  # pylint: disable=import-outside-toplevel
    from arl.trainers import TokenTrainer  # pylint: disable=import-outside-toplevel
    from configs import grpo_code_interpreter  # pylint: disable=import-outside-toplevel

    config = grpo_code_interpreter.get_config()
    config.env.kwargs.cache_size = 0  # every cell a sandboxed call
    python = os.path.realpath(sys.executable)
    weak = _without_kernel_layers(sandbox.sandbox_capabilities())
    runs, counts = {}, {"without kernel layers": 0, "every layer": 0}
    for name in counts:
        trainer = TokenTrainer(config)
        inner = trainer.env.executor
        if name == "without kernel layers":
            inner = lambda code, limits: sandbox.execute(code, limits, python, weak, True)

        def counted(code, limits, name=name, inner=inner):
            counts[name] += 1
            return inner(code, limits)

        trainer.env.executor = counted
        state = trainer.init_state()
        state, metrics = trainer.train_step(state)  # compiles
        jax.block_until_ready(metrics)
        runs[name] = [trainer, state, []]
    for _ in range(args.train_steps):
        for name, run in runs.items():
            trainer, state, times = run
            calls_before = counts[name]
            start = time.perf_counter()
            state, metrics = trainer.train_step(state)
            jax.block_until_ready(metrics)
            times.append((time.perf_counter() - start, counts[name] - calls_before))
            run[1] = state
    print("\n| code_interpreter train step (8 x 8, cache off) | median s | min s | "
          "tool calls / step |\n|---|---:|---:|---:|")
    medians = {}
    for name, (_, _, times) in runs.items():
        seconds = [t for t, _ in times]
        medians[name] = statistics.median(seconds)
        print(f"| {name} | {medians[name]:.2f} | {min(seconds):.2f} | "
              f"{statistics.median(c for _, c in times):.0f} |")
    print(f"\nevery layer / without kernel layers: "
          f"{medians['every layer'] / medians['without kernel layers']:.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--train-steps", type=int, default=0,
                        help="code_interpreter train steps per sandbox variant")
    parser.add_argument("--baseline", default=None,
                        help="a directory holding another revision's arl (git archive)")
    args = parser.parse_args(argv)
    print(f"capabilities: {sandbox.sandbox_capabilities().describe()}")
    print(f"cpus: {os.cpu_count()}, load average: {os.getloadavg()}\n")
    _per_call_table(args)
    _pool_table(args)
    if args.train_steps:
        _train_step_table(args)
    print(f"\nload average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
