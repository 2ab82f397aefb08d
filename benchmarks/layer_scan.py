"""Layer scan vs unrolled layers: the transformer's gradient, its KV-cached decoding, and
the whole agentic train step (GRPO on guess_number), with `model.layer_unroll` 1 (one
compiled layer in a loop) against 0 (all layers unrolled), measured in the same run.

Why it matters: `nn.scan` over the layers stacks each layer's residuals for the backward
pass into `[num_layers, ...]` buffers; unrolled, XLA addresses each layer's buffers
directly, at a compile time that grows with the depth. `layer_unroll` applies to
cache-free calls only (KV-cached calls always run one layer per iteration and update the
whole cache in place), so the decode and rollout rows compare the same cached programs
and show the run's noise.

    python benchmarks/layer_scan.py [--layers 2] [--d-model 64] [--repeats 11] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import agentic_step  # noqa: E402  pylint: disable=wrong-import-position
import common  # noqa: E402  pylint: disable=wrong-import-position

from arl.models import transformer as transformer_lib  # noqa: E402
from arl.trainers import TokenTrainer  # noqa: E402

DECODE_STEPS = 32


def model_programs(config: transformer_lib.TransformerConfig, batch: int, seq_len: int):
    """(gradient of the summed token log-probs over [batch, seq_len], `DECODE_STEPS` greedy
    KV-cached decoding steps), compiled, with their arguments and compile seconds."""
    model = transformer_lib.Transformer(config)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq_len), 0, config.vocab_size)
    params = nn.unbox(model.init(jax.random.key(1), tokens[:1]))["params"]

    def loss(p):
        logp = jax.nn.log_softmax(model.apply({"params": p}, tokens).logits)
        return jnp.sum(jnp.take_along_axis(logp, tokens[..., None], -1))

    def decode(p, cache):
        def step(carry, _):
            cache, token = carry
            out = model.apply({"params": p}, token, cache, method="decode")
            return (out.cache, jnp.argmax(out.logits, -1).astype(jnp.int32)), None

        (_, token), _ = jax.lax.scan(step, (cache, tokens[:, :1]), None, length=DECODE_STEPS)
        return token

    cache = transformer_lib.init_cache(config, batch, seq_len + DECODE_STEPS)
    grad, grad_compile = common.compile_jitted(jax.jit(jax.grad(loss)), params)
    dec, dec_compile = common.compile_jitted(jax.jit(decode), params, cache)
    return dict(grad=lambda: jax.block_until_ready(grad(params)),
                decode=lambda: jax.block_until_ready(dec(params, cache)),
                grad_compile=grad_compile, decode_compile=dec_compile)


def step_programs(layers: int, d_model: int, layer_unroll: int):
    """The TokenTrainer's compiled GRPO step and its rollout alone (agentic_step's sizes)."""
    config = agentic_step.make_config("grpo", 8, 4, d_model, layers)
    config.model.layer_unroll = layer_unroll
    trainer = TokenTrainer(config)
    state = trainer.init_state()
    params = jax.tree.map(lambda x: x.copy(), state.params)  # the step donates its state
    step, step_compile = common.compile_jitted(trainer.train_step, state)
    roll, roll_compile = common.compile_jitted(agentic_step.rollout_program(trainer), params,
                                               jax.random.key(1))
    return dict(step=common.donated_step_runner(step, state),
                rollout=lambda: jax.block_until_ready(roll(params, jax.random.key(2))),
                step_compile=step_compile, rollout_compile=roll_compile,
                context=trainer.context_length, model_config=trainer.model.config)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)

    variants = {"scan": 1, "unrolled": 0}
    steps = {name: step_programs(args.layers, args.d_model, u) for name, u in variants.items()}
    # The micro-programs use the trainer's own architecture (and its resolved unroll).
    models = {name: model_programs(steps[name]["model_config"], args.batch,
                                   steps[name]["context"]) for name in variants}
    arch = steps["scan"]["model_config"]
    fns = {}
    for name in variants:
        fns[f"{name}/grad"] = models[name]["grad"]
        fns[f"{name}/decode"] = models[name]["decode"]
        fns[f"{name}/step"] = steps[name]["step"]
        fns[f"{name}/rollout"] = steps[name]["rollout"]
    for fn in fns.values():  # first executions outside the timing
        fn()
    t = common.interleaved_median_times(fns, args.repeats)

    rows = []
    for program, key, source in (
            ("model gradient", "grad", models), ("decode", "decode", models),
            ("train step (rollout + update)", "step", steps),
            ("rollout alone", "rollout", steps)):
        compile_key = f"{key}_compile"
        scan_s, unrolled_s = t[f"scan/{key}"], t[f"unrolled/{key}"]
        rows.append((program, common.fmt_ms(scan_s), common.fmt_ms(unrolled_s),
                     f"{scan_s / unrolled_s:.2f}x",
                     f"{source['scan'][compile_key]:.1f} / "
                     f"{source['unrolled'][compile_key]:.1f}"))
        print(f"{program}: scan {common.fmt_ms(scan_s)} ms, unrolled "
              f"{common.fmt_ms(unrolled_s)} ms ({scan_s / unrolled_s:.2f}x)", flush=True)
    table = common.markdown_table(
        ["program", "scan (ms)", "unrolled (ms)", "speedup", "compile scan / unrolled (s)"],
        rows)
    text = (f"### `benchmarks/layer_scan.py` — {common.utc_now()}\n\n"
            f"Machine: {common.machine_line()}.\n\n"
            f"Transformer d_model {arch.d_model}, {arch.num_layers} layers, "
            f"{arch.num_heads} heads, MLP {arch.mlp_dim}, vocabulary {arch.vocab_size}. "
            f"Model gradient: "
            f"summed token log-probs over [{args.batch}, {steps['scan']['context']}]; "
            f"decode: {DECODE_STEPS} greedy KV-cached steps of {args.batch} rows; train "
            f"step: GRPO on guess_number, 8 tasks x group 4 (agentic_step's sizes). Median "
            f"of {args.repeats} interleaved rounds; scan = `model.layer_unroll=1`, "
            f"unrolled = 0.\n\n{table}\n")
    print(text)
    if not args.no_write:
        common.append_section("Layer scan vs unrolled layers", text)
    return rows


if __name__ == "__main__":
    main()
