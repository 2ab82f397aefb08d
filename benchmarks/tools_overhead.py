"""Cost of the host-side tool executors (`arl.tools`): the per-call overhead of
`run_python` on a trivial program (median of --repeats calls, each isolation layer
switched off in turn to show what it costs), of `run_sql` on a one-row query, and the
throughput of a `ToolPool` at several batch sizes. Prints Markdown tables.

With `--baseline REF` the sandbox of git revision REF (its arl/tools/sandbox.py and
_sandbox_child.py, loaded side by side) runs interleaved with today's, call by call, and
`--train-steps N` times N `code_interpreter` train steps (configs/grpo_code_interpreter.py,
result cache off so that every cell is a sandboxed call) with each, alternating:

    python -m benchmarks.tools_overhead [--repeats 20] [--batches 1,8,64]
        [--baseline b780f82 --train-steps 4]
"""

import argparse
import dataclasses
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

from arl.tools import ToolPool, run_sql, sandbox, sql

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_baseline(ref: str):
    """The `arl.tools.sandbox` module of git revision `ref`, importable next to today's."""
    directory = tempfile.mkdtemp(prefix="arl-sandbox-baseline-")
    for name in ("sandbox.py", "_sandbox_child.py"):
        source = subprocess.run(["git", "show", f"{ref}:arl/tools/{name}"], cwd=_REPO,
                                capture_output=True, check=True).stdout
        with open(os.path.join(directory, name), "wb") as f:
            f.write(source)
    spec = importlib.util.spec_from_file_location("arl_sandbox_baseline",
                                                  os.path.join(directory, "sandbox.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _interleaved_ms(calls: dict, repeats: int) -> dict:
    """name -> (median ms, min ms), the calls taken in turn, one of each per round."""
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            result = call()
            times[name].append(time.perf_counter() - start)
            assert result.ok, (name, result)
    return {name: (1000 * statistics.median(t), 1000 * min(t)) for name, t in times.items()}


def _per_call_table(args, baseline) -> None:
    python = os.path.realpath(sys.executable)
    capabilities = sandbox.sandbox_capabilities()
    limits = sandbox.SandboxLimits()
    calls = {}
    if baseline is not None:
        old_caps = baseline.sandbox_capabilities()
        calls[f"before ({args.baseline}): run_python('pass')"] = lambda: baseline.run_python(
            "pass", limits=baseline.SandboxLimits())
        calls["  before, without namespaces"] = lambda: baseline._execute(
            "pass", baseline.SandboxLimits(), python,
            baseline.SandboxCapabilities(uid_drop=old_caps.uid_drop), True)
    variants = {
        "now: run_python('pass'), all layers": (capabilities, True),
        "  without audit hooks": (capabilities, False),
        "  without seccomp": (dataclasses.replace(capabilities, seccomp=False), True),
        "  without minimal root": (dataclasses.replace(capabilities, mount_namespace=False),
                                   True),
        "  without any namespace": (sandbox.SandboxCapabilities(
            uid_drop=capabilities.uid_drop, seccomp=capabilities.seccomp), True),
    }
    for name, (caps, hooks) in variants.items():
        calls[name] = (lambda caps=caps, hooks=hooks:
                       sandbox._execute("pass", limits, python, caps, hooks))
    data = sql.random_company_database(0).to_bytes()
    calls["run_sql(COUNT(*))"] = lambda: run_sql(data, "SELECT COUNT(*) FROM employees")
    print("| call | median ms | min ms |\n|---|---:|---:|")
    for name, (median, best) in _interleaved_ms(calls, args.repeats).items():
        print(f"| {name} | {median:.1f} | {best:.1f} |")


def _pool_table(args) -> None:
    print("\n| batch | workers | seconds | calls/s |\n|---:|---:|---:|---:|")
    with ToolPool(args.workers) as pool:
        for size in (int(s) for s in args.batches.split(",")):
            start = time.perf_counter()
            results = pool.map(sandbox.run_python, ["pass"] * size)
            elapsed = time.perf_counter() - start
            assert all(r.ok for r in results)
            print(f"| {size} | {pool.max_workers} | {elapsed:.2f} | {size / elapsed:.1f} |")


def _train_step_table(args, baseline) -> None:
    import jax  # pylint: disable=import-outside-toplevel
    from arl.trainers import TokenTrainer  # pylint: disable=import-outside-toplevel
    from configs import grpo_code_interpreter  # pylint: disable=import-outside-toplevel

    config = grpo_code_interpreter.get_config()
    config.env.kwargs.cache_size = 0  # every cell a sandboxed call
    runs, counts = {}, {"before": 0, "now": 0}
    for name in ("before", "now"):
        trainer = TokenTrainer(config)
        inner = trainer.env.executor
        if name == "before":
            inner = lambda code, limits: baseline.run_python(
                code, limits=baseline.SandboxLimits(**dataclasses.asdict(limits)))

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
    print(f"\nnow / before: {medians['now'] / medians['before']:.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--baseline", default=None,
                        help="git revision whose sandbox runs interleaved with today's")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="code_interpreter train steps per sandbox (needs --baseline)")
    args = parser.parse_args(argv)
    if args.train_steps and not args.baseline:
        parser.error("--train-steps needs --baseline")
    baseline = load_baseline(args.baseline) if args.baseline else None
    print(f"capabilities: {sandbox.sandbox_capabilities().describe()}")
    print(f"cpus: {os.cpu_count()}, load average: {os.getloadavg()}\n")
    _per_call_table(args, baseline)
    _pool_table(args)
    if args.train_steps:
        _train_step_table(args, baseline)
    print(f"\nload average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
