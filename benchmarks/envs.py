"""Environment throughput: env steps per second at batch 1024 under jit.

Each token environment runs `steps` turns in one `lax.scan` inside one `jax.jit`,
vmapped over the batch, wrapped in `AutoReset` so every row stays live, with either
uniformly random token actions (drawn before the timed program: ids in the vocabulary,
lengths in [0, action_len]) or the oracle's actions (the oracle's own cost is then
included). Beside them, in the same run: gymnax CartPole-v1's raw auto-resetting
`step` with random actions, the same way. Compile time is excluded (one warm-up call).

    python benchmarks/envs.py [--batch 1024] [--steps 64] [--repeats 5] [--no-write]

Prints a table and appends it, with machine / versions / date, under
"## Environments" in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import jax
import jax.numpy as jnp

import arl.envs as E
from arl.envs.base import TokenChunk

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def token_env_program(env, batch: int, steps: int, policy: str):
    """A jitted program(key, random_actions) running `steps` batched turns. Random
    actions are drawn BEFORE the program (passed in), so their RNG cost is not timed."""
    wrapped = E.AutoReset(env)
    params = env.default_params()

    def run(key, random_actions):
        keys = jax.random.split(key, batch)
        state, _ = jax.vmap(wrapped.reset, in_axes=(0, None))(keys, params)

        def body(carry, xs):
            state, total = carry
            key, random_action = xs
            k_act, k_step = jax.random.split(key)
            if policy == "oracle":
                action = jax.vmap(env.oracle_action, in_axes=(0, 0, None))(
                    jax.random.split(k_act, batch), state, params)
            else:
                action = random_action
            state, ts = jax.vmap(wrapped.step, in_axes=(0, 0, 0, None))(
                jax.random.split(k_step, batch), state, action, params)
            return (state, total + ts.reward), None

        xs = (jax.random.split(key, steps), random_actions)
        (_, total), _ = jax.lax.scan(body, (state, jnp.zeros(batch)), xs)
        return total

    program = jax.jit(run)
    k_tok, k_len = jax.random.split(jax.random.key(123))
    random_actions = TokenChunk(
        jax.random.randint(k_tok, (steps, batch, env.action_len), 0, env.codec.vocab_size),
        jax.random.randint(k_len, (steps, batch), 0, env.action_len + 1))
    return lambda key: program(key, random_actions)


def cartpole_program(batch: int, steps: int):
    import gymnax
    env, params = gymnax.make("CartPole-v1")

    def run(key, actions):
        keys = jax.random.split(key, batch)
        _, state = jax.vmap(env.reset, in_axes=(0, None))(keys, params)

        def body(carry, xs):
            state, total = carry
            key, action = xs
            _, state, reward, _, _, _ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(key, batch), state, action, params)
            return (state, total + reward), None

        xs = (jax.random.split(key, steps), actions)
        (_, total), _ = jax.lax.scan(body, (state, jnp.zeros(batch)), xs)
        return total

    program = jax.jit(run)
    actions = jax.random.randint(jax.random.key(123), (steps, batch), 0, 2)
    return lambda key: program(key, actions)


def time_program(program, batch: int, steps: int, repeats: int) -> tuple[float, float]:
    """(best env steps / second over `repeats`, compile + first call seconds)."""
    start = time.perf_counter()
    jax.block_until_ready(program(jax.random.key(0)))
    compile_s = time.perf_counter() - start
    best = float("inf")
    for r in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(jax.random.key(r + 1)))
        best = min(best, time.perf_counter() - start)
    return batch * steps / best, compile_s


def machine_line() -> str:
    from importlib.metadata import version
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    device = jax.devices()[0]
    return (f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores "
            f"(load average {load:.1f} at start), JAX {jax.__version__} on "
            f"{device.platform} ({device.device_kind}), gymnax {version('gymnax')}, "
            f"Python {platform.python_version()}")


def append_results(table: str, header: str) -> None:
    # Re-read right before writing: another benchmark may have appended meanwhile.
    existing = ""
    if os.path.exists(RESULTS):
        with open(RESULTS, encoding="utf-8") as f:
            existing = f.read()
    parts = []
    if not existing:
        parts.append("# Benchmark results\n")
    if "## Environments" not in existing:
        parts.append("\n## Environments\n")
    parts.append(f"\n{header}\n\n{table}\n")
    with open(RESULTS, "a", encoding="utf-8") as f:
        f.write("".join(parts))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    machine = machine_line()
    rows = []
    for name in E.registered_names():
        env = E.make(name)
        if E.is_host_environment(env):  # tools on the host: benchmarks/host_envs.py
            continue
        for policy in ("random", "oracle"):
            rate, compile_s = time_program(token_env_program(env, args.batch, args.steps, policy),
                                           args.batch, args.steps, args.repeats)
            rows.append((name, policy, rate, compile_s))
            print(f"{name:14s} {policy:7s} {rate:14,.0f} steps/s  (compile {compile_s:.1f}s)",
                  flush=True)
    rate, compile_s = time_program(cartpole_program(args.batch, args.steps),
                                   args.batch, args.steps, args.repeats)
    rows.append(("gymnax CartPole-v1 (raw step)", "random", rate, compile_s))
    print(f"CartPole-v1    random  {rate:14,.0f} steps/s  (compile {compile_s:.1f}s)")

    lines = ["| environment | actions | env steps / s | compile + first call (s) |",
             "|---|---|---:|---:|"]
    lines += [f"| {n} | {p} | {r:,.0f} | {c:.1f} |" for n, p, r, c in rows]
    table = "\n".join(lines)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"### `benchmarks/envs.py` — {date}\n\nbatch {args.batch}, {args.steps} turns per "
              f"jitted `lax.scan`, best of {args.repeats}; token envs under `AutoReset`.\n"
              f"Machine: {machine}.")
    print()
    print(header)
    print(table)
    if not args.no_write:
        append_results(table, header)


if __name__ == "__main__":
    main()
