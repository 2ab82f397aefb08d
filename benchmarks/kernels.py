"""Benchmark of the arl.algorithms kernels against rlax and plain NumPy/Python.

Times are medians over `--repeats` runs after compilation (`block_until_ready`), all
measured in the same process so the ratios are comparable on a shared machine, with the
host allocator set as arl's command line sets it (`arl.setup()`; every candidate
shares the process, so every candidate gets it; ARL_KEEP_FREED_MEMORY=0 turns it off).

    python benchmarks/kernels.py              # print the table
    python benchmarks/kernels.py --record     # also make it the "Kernels" section of RESULTS.md
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np
import rlax

import arl
from arl import algorithms as alg
from arl.runs import process_settings

import common  # noqa: E402  (benchmarks/, the script's own directory)

GAE_SHAPES = ((256, 512), (1024, 1024), (64, 8192))
GROUP_SIZES = (4096, 65536)
GROUP_SIZE = 16
POLICY_SHAPE = (1024, 1024)
GAMMA, LAM = 0.99, 0.95


def numpy_masked_gae(rewards, values, mask, gamma, lam):
    """Reference loop over time (vectorised over the batch), with the agent mask."""
    batch, length = rewards.shape
    advantages = np.zeros_like(rewards)
    next_value = np.zeros(batch, rewards.dtype)
    next_adv = np.zeros(batch, rewards.dtype)
    for t in reversed(range(length)):
        m = mask[:, t]
        adv = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        advantages[:, t] = np.where(m, adv, 0.0)
        next_value = np.where(m, values[:, t], next_value)
        next_adv = np.where(m, adv, next_adv)
    return advantages


def gae_methods():
    """Every GAE method."""
    return list(alg.GAE_METHODS[1:])


def bench_gae(repeats, rng):
    rows = []
    rlax_gae = jax.jit(jax.vmap(rlax.truncated_generalized_advantage_estimation,
                                in_axes=(0, 0, None, 0)))
    ours = {method: jax.jit(lambda r, val, m, method=method: alg.gae(
        r, val, m, gamma=GAMMA, lam=LAM, method=method)[0])
            for method in gae_methods()}
    for batch, length in GAE_SHAPES:
        rewards = rng.normal(size=(batch, length)).astype(np.float32)
        values = rng.normal(size=(batch, length)).astype(np.float32)
        mask = rng.random((batch, length)) < 0.7
        r, val, m = map(jnp.asarray, (rewards, values, mask))
        discounts = jnp.full((batch, length), GAMMA, jnp.float32)
        values_tp1 = jnp.concatenate([val, jnp.zeros((batch, 1))], axis=1)
        for method, f in ours.items():
            np.testing.assert_allclose(f(r, val, m), numpy_masked_gae(
                rewards, values, mask, GAMMA, LAM), rtol=1e-3, atol=1e-3, err_msg=method)
        fns = {"rlax": lambda: rlax_gae(r, discounts, LAM, values_tp1).block_until_ready()}
        fns.update({k: lambda f=f: f(r, val, m).block_until_ready() for k, f in ours.items()})
        t = common.interleaved_median_times(fns, repeats)
        t_rlax = t.pop("rlax")
        t_ours = t
        t_numpy = common.interleaved_median_times({"numpy": lambda: numpy_masked_gae(
            rewards, values, mask, GAMMA, LAM)}, max(1, repeats // 3))["numpy"]
        rows.append((f"GAE masked, B={batch} T={length}", t_ours, t_rlax, t_numpy))
    return rows


def python_loop_group_advantages(scores, group_ids, eps=1e-6):
    """Per-group Python loop in the style of host-side GRPO implementations."""
    members = collections.defaultdict(list)
    for i, g in enumerate(group_ids):
        members[int(g)].append(i)
    advantages = np.zeros_like(scores)
    for indices in members.values():
        group = scores[indices]
        if len(indices) < 2 or group.max() == group.min():
            continue
        advantages[indices] = (group - group.mean()) / (group.std(ddof=1) + eps)
    return advantages


def numpy_reshape_group_advantages(scores, group_size, eps=1e-6):
    groups = scores.reshape(-1, group_size)
    mean = groups.mean(axis=1, keepdims=True)
    std = groups.std(axis=1, ddof=1, keepdims=True)
    adv = np.where(std > 0, (groups - mean) / (std + eps), 0.0)
    return adv.reshape(-1)


def bench_groups(repeats, rng):
    rows = []
    for n in GROUP_SIZES:
        num_groups = n // GROUP_SIZE
        scores = (rng.random(n) < 0.4).astype(np.float32)
        group_ids = rng.permutation(np.repeat(np.arange(num_groups), GROUP_SIZE)).astype(
            np.int32)
        s, g = jnp.asarray(scores), jnp.asarray(group_ids)
        ours = jax.jit(lambda s, g, num_groups=num_groups: alg.group_advantages(
            s, g, num_groups=num_groups))
        np.testing.assert_allclose(ours(s, g), python_loop_group_advantages(scores,
                                                                            group_ids),
                                   rtol=1e-4, atol=1e-4)
        # The reshape baseline needs contiguous equal-size groups (a layout our ids do not
        # require); the cost of sorting into that layout is excluded.
        contiguous = scores[np.argsort(group_ids, kind="stable")]
        t = common.interleaved_median_times({
            "ours": lambda: ours(s, g).block_until_ready(),
            "loop": lambda: python_loop_group_advantages(scores, group_ids),
            "reshape": lambda: numpy_reshape_group_advantages(contiguous, GROUP_SIZE),
        }, repeats)
        t_ours, t_loop, t_reshape = t["ours"], t["loop"], t["reshape"]
        rows.append((n, t_ours, t_loop, t_reshape))
    return rows


def bench_policy_loss(repeats, rng):
    batch, length = POLICY_SHAPE
    logp = jnp.asarray(rng.normal(size=POLICY_SHAPE).astype(np.float32) - 2.0)
    old = logp + jnp.asarray(0.1 * rng.normal(size=POLICY_SHAPE).astype(np.float32))
    adv = jnp.asarray(rng.normal(size=batch).astype(np.float32))
    mask = jnp.asarray(rng.random(POLICY_SHAPE) < 0.7)

    # Everything is an argument: closed-over arrays would be constant-folded by XLA.
    def ours(lp, old, adv, mask):
        return alg.policy_loss(lp, old, adv, mask, dual_clip=3.0)

    def bare(lp, old, adv, mask):  # the formula alone: no metrics, sanitising, dual clip
        ratio = jnp.exp(lp - old)
        a = adv[:, None]
        per = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 0.8, 1.2))
        return jnp.sum(per * mask) / jnp.sum(mask)

    f_ours = jax.jit(jax.value_and_grad(ours, has_aux=True))
    f_bare = jax.jit(jax.value_and_grad(bare))
    args = (logp, old, adv, mask)
    t = common.interleaved_median_times({"ours": lambda: jax.block_until_ready(f_ours(*args)),
                      "bare": lambda: jax.block_until_ready(f_bare(*args))}, repeats)
    return t["ours"], t["bare"]


def ms(t):
    return f"{1e3 * t:.2f}"


def table(gae_rows, group_rows, policy):
    methods = gae_methods()
    lines = ["#### GAE (gamma=0.99, lambda=0.95; ours with a 70% agent mask, rlax unmasked)",
             "",
             "| shape | " + " | ".join(f"ours {m} (ms)" for m in methods)
             + " | rlax vmapped (ms) | NumPy loop (ms) | rlax / ours-auto | "
             "NumPy / ours-auto |",
             "|---|" + "---|" * (len(methods) + 4)]
    auto = alg.advantages._resolve_method("auto")
    for name, t_ours, t_rlax, t_numpy in gae_rows:
        best = t_ours[auto]
        lines.append(f"| {name} | " + " | ".join(ms(t_ours[m]) for m in methods)
                     + f" | {ms(t_rlax)} | {ms(t_numpy)} | {t_rlax / best:.2f}x | "
                     f"{t_numpy / best:.1f}x |")
    lines += ["", f"`method='auto'` resolves to `{auto}` on this backend "
              f"({jax.default_backend()}).", "",
              "#### Group advantages (GRPO, groups of 16, shuffled ids)", "",
              "| N | ours jit (ms) | per-group Python loop (ms) | NumPy reshape (ms) | "
              "loop / ours | reshape / ours |", "|---|---|---|---|---|---|"]
    for n, t_ours, t_loop, t_reshape in group_rows:
        lines.append(f"| {n} | {ms(t_ours)} | {ms(t_loop)} | {ms(t_reshape)} | "
                     f"{t_loop / t_ours:.0f}x | {t_reshape / t_ours:.2f}x |")
    t_ours, t_bare = policy
    lines += ["", "#### Policy loss forward + backward (B=1024, T=1024, [B] advantages)", "",
              "| ours: policy_loss + metrics, dual clip (ms) | bare clipped formula (ms) | "
              "ours / bare |", "|---|---|---|",
              f"| {ms(t_ours)} | {ms(t_bare)} | {t_ours / t_bare:.2f}x |"]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--record", action="store_true",
                        help="write the table as the Kernels section of benchmarks/RESULTS.md")
    args = parser.parse_args()
    settings = process_settings.setup()
    inline, kept = settings.computations_inline, settings.freed_memory_kept
    rng = np.random.default_rng(0)
    gae_rows = bench_gae(args.repeats, rng)
    group_rows = bench_groups(args.repeats, rng)
    policy = bench_policy_loss(args.repeats, rng)
    header = (common.heading("kernels.py") + f"Versions: arl "
              f"{arl.__version__}, rlax {rlax.__version__}, numpy {np.__version__}. Median of "
              f"{args.repeats} runs after compilation; host allocator "
              f"{'inline + kept heap' if inline and kept else 'default'}.")
    common.publish("Kernels", header + "\n\n" + table(gae_rows, group_rows, policy),
                   args.record)


if __name__ == "__main__":
    main()
