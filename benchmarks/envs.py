"""Environment throughput: env steps per second at batch 1024 under jit.

Each token environment runs `steps` turns in one `lax.scan` inside one `jax.jit`,
vmapped over the batch, wrapped in `AutoReset` so every row stays live, with either
uniformly random token actions (drawn before the timed program: ids in the vocabulary,
lengths in [0, action_len]) or the oracle's actions (the oracle's own cost is then
included). Beside them, in the same run: gymnax CartPole-v1's raw auto-resetting
`step` with random actions, the same way. Compile time is excluded (one warm-up call).

    python benchmarks/envs.py [--batch 1024] [--steps 64] [--repeats 5] [--no-write]

Prints a table and writes it, with machine / versions / date, as the "Environments"
section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import arl.envs as E
from arl.envs.base import TokenChunk

import common  # noqa: E402  (benchmarks/, the script's own directory)


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

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

    table = common.markdown_table(
        ["environment", "actions", "env steps / s", "compile + first call (s)"],
        [(n, p, f"{r:,.0f}", f"{c:.1f}") for n, p, r, c in rows])
    common.publish("Environments", common.heading("envs.py") + (
        f"Batch {args.batch}, {args.steps} turns per jitted `lax.scan`, best of "
        f"{args.repeats}; token envs under `AutoReset`.\n\n{table}\n"), not args.no_write)


if __name__ == "__main__":
    main()
