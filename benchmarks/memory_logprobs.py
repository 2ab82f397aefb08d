"""Peak temporary memory of next-token log-probs + entropy: full logits vs chunked.

Both paths compute, from final hidden states h [B, T, D] and the unembedding W [D, V],
the float32 log-probability of the target token and the entropy at every position, and
(second column) the gradient of a weighted sum of both with respect to h and W, as one
`jax.jit` program. The memory is XLA's own accounting of the compiled program
(`compiled.memory_analysis().temp_size_in_bytes`: buffers live inside the program,
excluding its arguments and outputs), so nothing is executed and the numbers do not
depend on how busy the machine is.

    python benchmarks/memory_logprobs.py              # print the table
    python benchmarks/memory_logprobs.py --append     # also append it to RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import os

import jax
import jax.numpy as jnp

from arl.models.logprobs import chunked_token_logprobs

VOCAB, LENGTH, BATCH, WIDTH = 32_000, 2_048, 1, 1_024
CHUNKS = (128, 256, 512)


def naive(hidden, unembed, targets):
    logits = jnp.einsum("btd,dv->btv", hidden, unembed, preferred_element_type=jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return logp, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def temp_bytes(fn, with_grad, dtype):
    hidden = jax.ShapeDtypeStruct((BATCH, LENGTH, WIDTH), dtype)
    unembed = jax.ShapeDtypeStruct((WIDTH, VOCAB), dtype)
    targets = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)

    def objective(h, w, t):
        logp, ent = fn(h, w, t)
        return jnp.sum(logp) + 0.01 * jnp.sum(ent)

    program = jax.grad(objective, argnums=(0, 1)) if with_grad else fn
    compiled = jax.jit(program).lower(hidden, unembed, targets).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def table(dtype) -> str:
    candidates = [("full logits (naive)", naive)] + [
        (f"chunked, {c} positions", lambda h, w, t, c=c: chunked_token_logprobs(h, w, t, c))
        for c in CHUNKS]
    rows = []
    base = None
    for name, fn in candidates:
        fwd = temp_bytes(fn, False, dtype)
        bwd = temp_bytes(fn, True, dtype)
        base = base or (fwd, bwd)
        rows.append(f"| {name} | {fwd / 2**20:,.1f} | {bwd / 2**20:,.1f} | "
                    f"{base[1] / max(bwd, 1):.1f}x |")
    header = (f"B={BATCH}, T={LENGTH}, V={VOCAB}, D={WIDTH}, {jnp.dtype(dtype).name} hidden and "
              f"W (float32 math). [B, T, V] float32 logits alone are "
              f"{BATCH * LENGTH * VOCAB * 4 / 2**20:,.0f} MiB.\n\n"
              "| computation | temp MiB, forward | temp MiB, forward + grad | grad saving |\n"
              "| --- | ---: | ---: | ---: |")
    return header + "\n" + "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--append", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"\n## Chunked log-probs\n\n{stamp}, jax {jax.__version__}, backend "
            f"{jax.default_backend()}; `python benchmarks/memory_logprobs.py`. Peak temporary "
            "buffer bytes of the compiled program (XLA memory_analysis), not timings.\n\n"
            + table(jnp.float32) + "\n\n" + table(jnp.bfloat16) + "\n")
    print(text)
    if args.append:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
