"""Real model sizes on paper and in the compiler: per-device memory of the full train step.

For each shape of `configs/real_sizes.py` (Qwen2.5-0.5B, Qwen2.5-1.5B, Llama-3-8B) and each
(data, fsdp, tensor) layout, the FULL GRPO train step (rollout with KV-cached decoding,
advantages, one optimizer step; `TokenTrainer.train_step`) is lowered and compiled for a
mesh of fake CPU devices, from the abstract state only (nothing is allocated, so the 8B
model compiles on a laptop), and XLA's per-device memory plan
(`compiled.memory_analysis()`: arguments, outputs, aliased, temporaries) is set against
the analytic estimate of `estimate()` (the formula is in its docstring). Each device
count runs in its own subprocess (`XLA_FLAGS=--xla_force_host_platform_device_count=N` must be set before JAX starts), one
compilation at a time.

The step is the config's: 8 tasks x group 8 = 64 Sokoban episodes of up to 15 turns, a
context of S = 1047 tokens, bfloat16 parameters and activations, float32 master weights
and Adam moments, every layer rematerialised, log-probs in chunks of 128 positions.

    python benchmarks/real_sizes.py                     # 3 shapes x 4 layouts (~45 min here)
    python benchmarks/real_sizes.py --shapes qwen2.5-0.5b --meshes "1,8,1" --no-write
    python benchmarks/real_sizes.py --shapes qwen2.5-0.5b --meshes "1,8,1" \
        --context-turns 15,30,60,120                    # memory against context, 1k-8k
    python benchmarks/real_sizes.py --tiny --no-write   # the smoke-test size

On a GPU/TPU host `--accelerator` compiles every shape for the accelerator itself (one
device, layout (1, 1, 1)) and runs real steps of those that fit
(`bash benchmarks/accelerator.sh --real-sizes`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
DEFAULT_SHAPES = "qwen2.5-0.5b,qwen2.5-1.5b,llama3-8b"
DEFAULT_MESHES = "1,8,1;1,4,2;1,64,1;1,16,4"
SLICES_GIB = (16, 95)  # per-chip memory: e.g. TPU v5e (16 GiB), TPU v5p / H100 NVL (95 GiB)
TOLERANCE = 0.20  # |compiler - estimate| / compiler
# The smoke-test shape: the 0.5B config's structure (tied, q/k/v biases, GQA) at toy size.
TINY_SHAPE = dict(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
                  vocab_size=1024, tie_embeddings=True, qkv_bias=True, rope_theta=1e6,
                  norm_eps=1e-6)


sys.path.insert(0, REPO_DIR)  # configs/ (a script's own directory is benchmarks/)
sys.path.insert(0, BENCH_DIR)
import common  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__" and common.force_host_devices(sys.argv[1:]):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# ---------------------------------------------------------------------------- configs
def make_config(shape: str, mesh=(1, 8, 1), *, num_tasks: int = 8, group_size: int = 8,
                max_turns: int = 15):
    """The `configs/real_sizes.py` config of `shape` ("tiny": the smoke-test size, on the
    two-turn bandit) on `mesh`, with `num_tasks x group_size` episodes of up to
    `max_turns` Sokoban turns."""
    from configs import real_sizes

    c = real_sizes.get_config("qwen2.5-0.5b" if shape == "tiny" else shape)
    if shape == "tiny":
        for key, value in TINY_SHAPE.items():
            c.model[key] = value
        c.env.name = "bandit"
        c.env.kwargs = {}
        c.model.logprob_chunk = 8
    else:
        c.env.kwargs.max_turns = max_turns
    c.rollout.num_tasks = num_tasks
    c.rollout.group_size = group_size
    c.mesh = tuple(mesh)
    return c


def make_trainer(config):
    from arl import sharding as sharding_lib
    from arl.trainers import TokenTrainer

    return TokenTrainer(config, mesh=sharding_lib.make_mesh(tuple(config.mesh)))


# ---------------------------------------------------------------------------- estimate
def _shard_elements(abstract_tree, shardings) -> int:
    """Elements per device of a pytree laid out with `shardings` (the largest shard)."""
    import jax

    sizes = jax.tree.map(lambda a, s: math.prod(s.shard_shape(a.shape)), abstract_tree,
                         shardings)
    return int(sum(jax.tree.leaves(sizes)))


def _split(dim: int, ways: int) -> int:
    """A dimension's size per device when split `ways` ways where that divides (the
    model's rule: an axis that does not divide stays whole)."""
    return dim // ways if dim % ways == 0 else dim


def estimate(trainer) -> dict[str, int]:
    """Per-device bytes of the train step, term by term, from the shapes alone.

    Notation: mesh (d, f, t); B rows per step, b = B / (d f) per device; S the context;
    L layers, D = d_model, H / K query / KV heads of width Dh, F the MLP width, V the
    vocabulary, c the log-prob chunk; p and a the parameter and activation bytes (2 for
    bfloat16); P the parameter elements per device under the layout's shardings (counted
    from the PartitionSpecs: matrices split over fsdp x tensor, norms and biases as
    sharded as their axes divide); x/t means x split over "tensor" where it divides.

      state      = P (p + 12)                 parameters + float32 master, mu, nu
                   (P * 12 with float32 parameters: no master copy); donated, so the
                   outputs alias it
      gradients  = P (p + 4)                  in the parameter dtype, and float32 for
                                              clipping and Adam
      vocabulary = (V/t) D (2p + 8)           the [V, D] matrices gathered over fsdp
                   like every FSDP weight: the lookup's and the log-probs' copies (2p),
                   the float32 gradient the chunked log-probs accumulate over chunks (4;
                   they read the matrix in the activation dtype, no float32 copy) and the
                   float32 scatter-add gradient of the lookup (4); the same bytes whether
                   the embedding and the output matrix are one (tied) or two; alive from
                   the loss head's backward pass to the embedding's
      residuals  = L b S D (a + 4)            the residual stream saved at each layer
                   (remat), and the float32 copy XLA:CPU keeps for the RMSNorm
      layer      = attention                  the backward pass of one (recomputed)
                 + 2 W_layer/t (p + 4)        layer: its attention's working set; the
                   layer's gathered weights and their float32 gradient, twice (this
                   iteration's and the next one's). Dense attention (the model's
                   `attention` resolves to "dense" up to one block of
                   `attention_block` tokens): attention = 3 b (H/t) S^2 4, the scores,
                   probabilities and their gradient in float32. Blocked attention
                   (beyond one block; blocks of c, `attention.block_layout`):
                   attention = 3 b (H/t) c^2 4 + b (H/t) S Dh 4, one block pair's
                   scores, probabilities and their gradient, and the float32 dq the
                   backward pass accumulates over the key blocks
      logits     = 2 b c (V/t) 4              the loss head's backward pass: one chunk's
                                              float32 logits and their gradient
      rollout    = 2 L b S (K/t) Dh a         the KV cache, one decode step's logits
                 + b (V/t) 4 + m (V/t) D p    and the gathered vocabulary matrices
                                              (m = 1 tied, 2 untied)

      update     = vocabulary + residuals + max(layer, logits)
      total      = state + gradients + max(update, rollout)

    The rollout ends before the update starts, and the loss head's working set is gone
    before the layers' backward passes start, so each pair counts as its larger member.
    """
    import jax.numpy as jnp

    from arl.models import attention as attention_lib

    cfg = trainer.model.config
    mesh = trainer.mesh
    data, fsdp, tensor = (mesh.shape[a] for a in ("data", "fsdp", "tensor"))
    rows = trainer.batch_size // (data * fsdp)
    seq = trainer.context_length
    p = jnp.dtype(cfg.param_dtype).itemsize
    a = jnp.dtype(cfg.dtype).itemsize
    params_per_device = _shard_elements(trainer.layout.unsharded_shape().params,
                                        trainer.layout.param_shardings)
    master = 4 if p < 4 else 0
    heads = _split(cfg.num_heads, tensor)
    kv_heads = _split(cfg.num_kv_heads, tensor)
    vocab = _split(cfg.vocab_size, tensor)
    matrices = 1 if cfg.tie_embeddings else 2
    layer_weights = (cfg.d_model * cfg.resolved_head_dim * (2 * cfg.num_heads
                                                            + 2 * cfg.num_kv_heads)
                     + 3 * cfg.d_model * cfg.mlp_dim)
    layer_weights //= tensor
    chunk = min(trainer.policy.logprob_chunk or seq, seq)
    if attention_lib.resolve_implementation(cfg.attention, seq, cfg.attention_block) == "dense":
        attention_bytes = 3 * rows * heads * seq * seq * 4
    else:
        block, _ = attention_lib.block_layout(seq, cfg.attention_block)
        attention_bytes = (3 * rows * heads * block * block * 4
                           + rows * heads * seq * cfg.resolved_head_dim * 4)
    terms = {
        "state": params_per_device * (p + master + 8),
        "gradients": params_per_device * (p + 4),
        "vocabulary": vocab * cfg.d_model * (2 * p + 8),
        "residuals": cfg.num_layers * rows * seq * cfg.d_model * (a + 4),
        "layer": attention_bytes + 2 * layer_weights * (p + 4),
        "logits": 2 * rows * chunk * vocab * 4,
        "rollout": (2 * cfg.num_layers * rows * seq * kv_heads * cfg.resolved_head_dim * a
                    + rows * vocab * 4 + matrices * vocab * cfg.d_model * p),
    }
    terms["update"] = (terms["vocabulary"] + terms["residuals"]
                       + max(terms["layer"], terms["logits"]))
    terms["total"] = (terms["state"] + terms["gradients"]
                      + max(terms["update"], terms["rollout"]))
    terms["params_per_device"] = params_per_device
    return terms


# ---------------------------------------------------------------------------- compile
def measure(shape: str, mesh, *, num_tasks=8, group_size=8, max_turns=15) -> dict:
    """Compiles one point and returns XLA's per-device memory next to the estimate."""
    config = make_config(shape, mesh, num_tasks=num_tasks, group_size=group_size,
                         max_turns=max_turns)
    start = time.perf_counter()
    trainer = make_trainer(config)
    lowered = trainer.train_step.lower(trainer.abstract_state())
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    stats = compiled.memory_analysis()
    compiler = {
        "arguments": int(stats.argument_size_in_bytes),
        "outputs": int(stats.output_size_in_bytes),
        "aliased": int(stats.alias_size_in_bytes),
        "temps": int(stats.temp_size_in_bytes),
    }
    compiler["total"] = (compiler["arguments"] + compiler["outputs"] - compiler["aliased"]
                         + compiler["temps"])
    return {
        "shape": shape, "mesh": list(mesh), "batch": trainer.batch_size,
        "max_turns": max_turns,
        "context": trainer.context_length, "compiler": compiler,
        "estimate": estimate(trainer),
        "lower_s": lowered_at - start, "compile_s": compiled_at - lowered_at,
        "platform": trainer.mesh.devices.flat[0].platform,
    }


def run_worker(args) -> None:
    """Compiles every point of this process's device count; one JSON line per point."""
    for shape in args.shapes.split(","):
        for mesh in common.parse_meshes(args.meshes):
            result = measure(shape, mesh, num_tasks=args.num_tasks,
                             group_size=args.group_size, max_turns=args.max_turns)
            print("RESULT " + json.dumps(result), flush=True)


def compile_in_subprocesses(args) -> list[dict]:
    """One subprocess per point (shape, layout), one compilation at a time. With
    `args.json`, each result is appended to that JSON-lines file as soon as it is known,
    and points already in it are not compiled again (a long sweep can be resumed)."""
    done = load_results(args.json) if args.json and os.path.exists(args.json) else []
    results = list(done)
    points = [(shape, mesh, turns) for shape in args.shapes.split(",")
              for mesh in common.parse_meshes(args.meshes) for turns in parse_turns(args)]
    for shape, mesh, turns in points:
        if any(r["shape"] == shape and tuple(r["mesh"]) == mesh
               and r.get("max_turns", 15) == turns for r in done):
            continue
        devices = math.prod(mesh)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker",
               "--devices", str(devices), "--shapes", shape,
               "--meshes", ",".join(map(str, mesh)),
               "--num-tasks", str(args.num_tasks), "--group-size", str(args.group_size),
               "--max-turns", str(turns)]
        print(f"[real_sizes] {shape} {mesh}, {turns} turns, on {devices} devices",
              flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_DIR,
                              check=False)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"worker for {shape} {mesh} failed (exit {proc.returncode})")
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                result["remat_warnings"] = proc.stderr.count(
                    "Involuntary full rematerialization")
                print(f"[real_sizes]   {summary_line(result)}", flush=True)
                results.append(result)
                if args.json:
                    with open(args.json, "a", encoding="utf-8") as f:
                        f.write(json.dumps(result) + "\n")
    return results


def load_results(path: str) -> list[dict]:
    """Results stored by `--json` (JSON lines)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------- report
def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def relative_error(result: dict) -> float:
    return (result["estimate"]["total"] - result["compiler"]["total"]) / result["compiler"]["total"]


def fits(result: dict, slice_gib: float) -> bool:
    return result["compiler"]["total"] <= slice_gib * 2**30


def summary_line(r: dict) -> str:
    return (f"{r['shape']} {tuple(r['mesh'])}: compiler {gib(r['compiler']['total'])} GiB "
            f"(temps {gib(r['compiler']['temps'])}), estimate {gib(r['estimate']['total'])} "
            f"GiB ({100 * relative_error(r):+.0f}%), compile {r['compile_s']:.0f}s")


def table(results: list[dict]) -> str:
    header = ["shape", "mesh (d, f, t)", "context", "rows / device", "arguments", "outputs",
              "aliased", "temps", "compiler total", "estimate", "error"]
    header += [f"fits {s} GiB" for s in SLICES_GIB]
    header += ["lower + compile (s)"]
    rows = []
    for r in results:
        c, d, f = r["compiler"], r["mesh"][0], r["mesh"][1]
        rows.append([r["shape"], str(tuple(r["mesh"])), r["context"], r["batch"] // (d * f),
                     gib(c["arguments"]), gib(c["outputs"]), gib(c["aliased"]),
                     gib(c["temps"]), gib(c["total"]), gib(r["estimate"]["total"]),
                     f"{100 * relative_error(r):+.0f}%"]
                    + ["yes" if fits(r, s) else "no" for s in SLICES_GIB]
                    + [f"{r['lower_s'] + r['compile_s']:.0f}"])
    return common.markdown_table(header, rows)


def context_slopes(results: list[dict]) -> str:
    """d log(memory) / d log(context) of each (shape, layout) compiled at several
    contexts, from the shortest context of at least 1k tokens to the longest: the whole
    step's per-device total and its temporaries (activations, KV cache and working sets;
    the total also holds the parameters and optimizer state, which do not grow)."""
    lines = []
    for key in dict.fromkeys((r["shape"], tuple(r["mesh"])) for r in results):
        points = sorted((r for r in results if (r["shape"], tuple(r["mesh"])) == key),
                        key=lambda r: r["context"])
        long_enough = [r for r in points if r["context"] >= 1000] or points
        lo, hi = long_enough[0], long_enough[-1]
        if hi["context"] == lo["context"]:
            continue
        span = math.log(hi["context"] / lo["context"])
        slope = {kind: math.log(hi["compiler"][kind] / lo["compiler"][kind]) / span
                 for kind in ("total", "temps")}
        lines.append(f"- {key[0]} {key[1]}, context {lo['context']} -> {hi['context']}: "
                     f"slope of the total {slope['total']:.2f}, of the temporaries "
                     f"{slope['temps']:.2f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- one chip
def run_accelerator(args) -> list[dict]:
    """Every shape compiled for the default backend's first device (layout (1, 1, 1),
    the config's batch and context), its memory set against the estimate and the device's
    memory; the shapes that fit also run `args.steps` real train steps (the first
    includes nothing but the step: the program is compiled before)."""
    import jax

    device = jax.devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit") if hasattr(
        device, "memory_stats") else None
    results = []
    for shape in args.shapes.split(","):
        result = measure(shape, (1, 1, 1), num_tasks=args.num_tasks,
                         group_size=args.group_size, max_turns=args.max_turns)
        result["device"] = f"{device.platform} {device.device_kind}"
        result["bytes_limit"] = limit
        print(f"[real_sizes] {summary_line(result)}", flush=True)
        if args.steps and limit and result["compiler"]["total"] < 0.95 * limit:
            config = make_config(shape, (1, 1, 1), num_tasks=args.num_tasks,
                                 group_size=args.group_size, max_turns=args.max_turns)
            trainer = make_trainer(config)
            state = trainer.init_state()
            compiled = trainer.train_step.lower(state).compile()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                state, metrics = compiled(state)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
            result["step_s"] = times
            result["reward_mean"] = float(metrics["reward_mean"])
            print(f"[real_sizes]   {shape}: steps {[round(t, 2) for t in times]} s",
                  flush=True)
            del state, compiled, trainer
        results.append(result)
    return results


def accelerator_report(results: list[dict], args) -> str:
    limit = results[0].get("bytes_limit")
    rows = [[r["shape"], gib(r["compiler"]["temps"]), gib(r["compiler"]["total"]),
             gib(r["estimate"]["total"]), f"{100 * relative_error(r):+.0f}%",
             "yes" if limit and r["compiler"]["total"] <= limit else "no",
             f"{r['lower_s'] + r['compile_s']:.0f}",
             " / ".join(f"{t:.2f}" for t in r.get("step_s", [])) or "-"]
            for r in results]
    table_text = common.markdown_table(
        ["shape", "temps", "compiler total", "estimate", "error",
         f"fits this device ({gib(limit) if limit else '?'} GiB)", "lower + compile (s)",
         "step (s)"], rows)
    return (common.heading("real_sizes.py")
            + f"One device, layout (1, 1, 1): the full GRPO train step of each shape, "
            f"{args.num_tasks} tasks x group {args.group_size}, context "
            f"{results[0]['context']}, compiled for {results[0]['device']}; GiB. Shapes "
            f"that fit ran {args.steps} real steps.\n\n{table_text}\n")


# ---------------------------------------------------------------------------- main
def parse_turns(args) -> list[int]:
    """The episode lengths to compile: `--context-turns` (a context sweep) or
    `--max-turns`."""
    if not args.context_turns:
        return [args.max_turns]
    try:
        turns = [int(x) for x in args.context_turns.split(",")]
    except ValueError:
        turns = []
    if not turns or min(turns) < 1:
        raise SystemExit(f"--context-turns: {args.context_turns!r} is not a comma-separated "
                         "list of positive turn counts")
    return turns


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--meshes", default=DEFAULT_MESHES)
    parser.add_argument("--num-tasks", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=15)
    parser.add_argument("--context-turns", default="",
                        help="a context sweep: compile each shape and layout at each of "
                             "these episode lengths (e.g. 15,30,60,120: contexts ~1k-8k) "
                             "and report the memory slopes")
    parser.add_argument("--tiny", action="store_true", help="the smoke-test shape")
    parser.add_argument("--accelerator", action="store_true",
                        help="compile (and, where they fit, run) every shape on the default "
                             "backend's first device")
    parser.add_argument("--steps", type=int, default=2,
                        help="real steps per shape that fits, with --accelerator")
    parser.add_argument("--devices", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default="",
                        help="append each result to this JSON-lines file; resume from it")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.tiny:
        args.shapes = "tiny"
    if args.worker:
        return run_worker(args)
    if args.accelerator:
        results = run_accelerator(args)
        common.publish("Real sizes on one accelerator", accelerator_report(results, args),
                       not args.no_write)
        return results
    results = compile_in_subprocesses(args)
    common.publish("Real sizes: memory against context" if args.context_turns
                   else "Real sizes", report(results, args), not args.no_write)
    return results


def report(results: list[dict], args) -> str:
    first = results[0]
    within = sum(abs(relative_error(r)) <= TOLERANCE for r in results)
    warnings = sum(r.get("remat_warnings", 0) for r in results)
    contexts = ", ".join(str(c) for c in sorted({r["context"] for r in results}))
    slopes = context_slopes(results)
    slopes = f"\n\nMemory against context (log-log):\n\n{slopes}" if slopes else ""
    return (common.heading("real_sizes.py")
            + f"Full GRPO train step (rollout + update), {args.num_tasks} tasks x group "
            f"{args.group_size} = {first['batch']} episodes, context {contexts}; "
            f"fake CPU devices, lowered and compiled from the abstract state (nothing "
            f"allocated). GiB per device; compiler total = arguments + outputs - aliased + "
            f"temps; error = (estimate - compiler) / compiler. {within} of {len(results)} "
            f"within {100 * TOLERANCE:.0f}%; XLA \"involuntary full rematerialization\" "
            f"warnings: {warnings}.\n\n{table(results)}{slopes}\n")


if __name__ == "__main__":
    main()
