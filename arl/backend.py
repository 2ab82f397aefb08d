"""Every choice of arl's code that depends on the JAX backend, with the measurement behind it.

The default path on every backend is plain JAX; a switch below replaces one operation by
another plain-JAX form (same results) where XLA:CPU runs the usual form slowly, and each
is kept only for an end-to-end gain measured on the CPU (docs/performance.md, the named
sections). Accelerators keep the usual form; none of these was measured there.

Forms chosen for XLA:CPU that are plain JAX and the same program on every backend (no
switch, so they are not here), each measured where it is written: `VectorPPO`'s update
on one raveled parameter vector (-10 % per update at 4 envs, -7 % at 2048 x 16) with its
metrics packed into one vector per minibatch (`arl/trainers/vector_ppo.py`); the loss
diagnostics as separate plain reductions rather than one variadic reduction, and a first
index as a min over positions rather than an argmax (`arl/algorithms/losses.py`:
`policy_loss` forward + backward 2.9-3.5x from 65k to 1M tokens).

Process-wide host settings for the CPU are not switches of a program and live with
their measurements in `arl.runs.process_settings`: glibc keeping freed memory mapped, and
JAX's CPU computations run on the calling thread (steps 1.2-1.3x faster on the peers'
settings); `arl.setup()` applies them on the CPU (the CLI and `experiment.run` call it;
`ARL_KEEP_FREED_MEMORY=0` opts out).

Imports jax only, so the kernels (`arl.algorithms`) may ask it too.
"""

from __future__ import annotations

import jax


def on_cpu() -> bool:
    """Whether the default backend is XLA:CPU (decided at trace time)."""
    return jax.default_backend() == "cpu"


def argmax_as_two_reductions() -> bool:
    """Sampling's argmax (`arl.models.sampling.first_argmax`) as a row maximum and the
    smallest index holding it.

    XLA:CPU runs `argmax`'s variadic (value, index) reduction as a scalar loop, ~30 us
    per decoded token at [64, 64] logits; two plain reductions vectorise. Measured
    (docs/performance.md, "Sampling"): 32 draws 1.8-3.9x
    faster from [64, 64] to [8, 151936] logits; `generate` of 32 tokens 1.14x (8 rows,
    32k vocabulary) to 1.98x (64 rows, 32k). Same tokens and log-probs.
    """
    return on_cpu()


def decode_attention_over_head_pairs(q_len: int) -> bool:
    """A decoded token (one query per row) attends through products over every
    (query head, key/value head) pair, reading the KV cache as stored
    (`arl.models.attention_kernels.uses_head_pairs`).

    XLA:CPU puts a batched product's batch dimensions first, so the grouped einsum
    copies each cache layer transposed for every decoded token. Measured
    (docs/performance.md, "Attention and the update"): one cached call 1.1-1.9x faster from the toy shape to Llama-3-8B's heads;
    the peers' rollouts 1.11-1.19x, a train step 1.03-1.08x. Same tokens. Prefill and
    training (more than one query) keep the grouped products.
    """
    return q_len == 1 and on_cpu()


def gae_method() -> str:
    """The form of `arl.algorithms.gae` that `method="auto"` runs: the sequential scan on
    the CPU (3-5x the associative scan there, `benchmarks/kernels.py`), the associative
    scan elsewhere for its O(log T) depth (unmeasured: no accelerator was available)."""
    return "scan" if on_cpu() else "associative"
