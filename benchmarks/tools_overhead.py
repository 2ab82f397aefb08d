"""Cost of the host-side tool executors (`arl.tools`): the per-call overhead of
`run_python` on a trivial program (median of --repeats calls, each isolation layer
switched off in turn to show what it costs), of `run_sql` on a one-row query, and the
throughput of a `ToolPool` at several batch sizes. Prints a Markdown table; stdlib only.

    python -m benchmarks.tools_overhead [--repeats 20] [--batches 1,8,64]
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time

from arl.tools import ToolPool, run_sql, sandbox, sql


def _median_ms(call, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
        assert result.ok, result
    return 1000 * statistics.median(times), 1000 * min(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)

    python = os.path.realpath(sys.executable)
    capabilities = sandbox.sandbox_capabilities()
    limits = sandbox.SandboxLimits()
    variants = [
        ("run_python('pass'), all layers", capabilities, True),
        ("  without audit hooks", capabilities, False),
        ("  without mount namespace", dataclasses.replace(capabilities, mount_namespace=False),
         True),
        ("  without any namespace", sandbox.SandboxCapabilities(uid_drop=capabilities.uid_drop),
         True),
    ]
    print(f"capabilities: {capabilities}")
    print(f"cpus: {os.cpu_count()}, load average: {os.getloadavg()}\n")
    print("| call | median ms | min ms |\n|---|---:|---:|")
    for name, caps, hooks in variants:
        median, best = _median_ms(
            lambda: sandbox._execute("pass", limits, python, caps, hooks), args.repeats)
        print(f"| {name} | {median:.1f} | {best:.1f} |")
    data = sql.random_company_database(0).to_bytes()
    median, best = _median_ms(lambda: run_sql(data, "SELECT COUNT(*) FROM employees"),
                              args.repeats)
    print(f"| run_sql(COUNT(*)) | {median:.2f} | {best:.2f} |")

    print("\n| batch | workers | seconds | calls/s |\n|---:|---:|---:|---:|")
    with ToolPool(args.workers) as pool:
        for size in (int(s) for s in args.batches.split(",")):
            start = time.perf_counter()
            results = pool.map(sandbox.run_python, ["pass"] * size)
            elapsed = time.perf_counter() - start
            assert all(r.ok for r in results)
            print(f"| {size} | {pool.max_workers} | {elapsed:.2f} | {size / elapsed:.1f} |")


if __name__ == "__main__":
    main()
