"""The update phase (forward + backward of the policy in the train step): time, achieved
FLOP/s and memory, with each optimisation measured against the path it replaced.

Sections (`--parts`, all by default), every one timed as interleaved rounds in one
process (`common.interleaved_median_times`), so machine load hits all variants alike:

* layers: the bare model's gradient (summed token log-probs over the peers settings'
  [B, S], `benchmarks/peer_workers/protocol.py`) with the decoder as of `--baseline` (a
  git revision, loaded from `git show REV:arl/models/transformer.py`: projections on
  [B, T, D] activations) against the current one (projections on tokens flattened to
  [B*T, D]). Same parameters; the max relative difference of the gradients is printed.
* update: `Learner.update` (loss gradient + AdamW step, 1 epoch x 1 minibatch) on a
  [B, S] batch laid out as the setting's rollouts are (prompt, then agent tokens; turns
  of agent tokens and replies for multiturn), scoring every position (bounds 0: the
  previous path) against scoring the agent tokens only (`Learner.agent_token_bound`),
  and the baseline decoder with every position scored (the state before this work).
* long: batch-1 gradient of the modest model at contexts 512 .. 8192 with dense and
  blocked attention: step time and the compiled program's memory
  (`memory_analysis()`: temp = XLA's scratch, the activations; peak = temp + arguments +
  outputs), and the slope d log(memory) / d log(context) from 1k to the longest.
* attention: the attention alone (forward + backward) at the head layout and context
  (1047) of configs/real_sizes.py, dense against blocked (`attention_part`).
* shipped: whether model.attention "auto" lowers to the same program as "dense" at the
  context of every shipped token config (`shipped_part`).
* ceiling: how close to the matmul peak the update can get with the matmul kernels it
  has. Every `dot` of the compiled update program (`Learner.update` as the trainer runs
  it: agent tokens scored) is taken from its optimized HLO with its operand shapes and
  dimension numbers, counted as many times as a profile of one call saw it run (loop
  trip counts in, a conditional's untaken branch out: `executed_thunks`), and timed
  alone as a jitted `lax.dot_general` of those shapes, less the time of calling a jitted
  program that does next to nothing; the sum is the update's time if everything but its
  matmuls were free. Reported against the update itself, both as a share of the peak
  (model FLOPs as counted below).
* step: the same for the whole train step as `peers.py` runs arl's side (rollout +
  update, the update reusing the rollout's activations) and for its rollout alone: how
  far the step is from the time its matmuls take on this machine's kernels, and the
  update's rate in the matmul FLOPs it executes (`--cache-dir`: where the settings'
  shared checkpoints are written, as `peers.py --cache_dir`).

FLOPs (executed matmul FLOPs, counted per row of the static [B, S] program): forward =
S x 2 x P_layers (q/k/v/o and MLP projections) + L x 4 x S^2 x H x head_dim (dense
attention computes the whole S x S; the blocked kernel skips the blocks above the
diagonal, about half of it at long contexts, so its count uses n (n + 1) / 2 c^2 with n
blocks of c, `attention.block_layout`) + (scored positions) x 2 x d x V (LM head); forward + backward = 3 x forward. The
peak is a 1024^2 float32 `jnp.dot` measured at the start and end of the run.

    python benchmarks/update_phase.py [--parts layers,update,long,attention,shipped,ceiling,step]
                                      [--baseline d07546c] [--cache-dir ~/.cache/arl-bench-peers]
                                      [--repeats 7] [--contexts 512,1024,2048,4096,8192]
                                      [--no-write]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the checkout this script belongs to, not an installed arl
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position


from arl import config as config_lib  # noqa: E402
from arl import sharding as sharding_lib  # noqa: E402
from arl.models import attention as attention_lib  # noqa: E402
from arl.models import transformer as transformer_lib  # noqa: E402
from arl.trainers.policy import Policy  # noqa: E402
from arl.trainers.update import Learner, UpdateBatch  # noqa: E402

SETTINGS = ("toy", "modest", "multiturn")
# main when this branch was merged with it: dense attention, projections on [B, T, D],
# every position scored.
BASELINE = "d07546c"


def load_baseline(revision: str):
    """`arl/models/transformer.py` as of `revision`, imported as its own module."""
    source = subprocess.check_output(
        ["git", "show", f"{revision}:arl/models/transformer.py"], cwd=REPO, text=True)
    name = f"baseline_transformer_{revision.replace('/', '_').replace('-', '_')}"
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:arl/models/transformer.py", "exec"), module.__dict__)
    return module


def model_config(module, setting, **overrides):
    s = setting
    fields = dict(vocab_size=s.vocab, d_model=s.d_model, num_layers=s.num_layers,
                  num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, mlp_dim=s.mlp_dim,
                  max_len=s.prompt_len + s.gen_len, rope_theta=s.rope_theta,
                  norm_eps=s.norm_eps, qkv_bias=True, layer_unroll=s.num_layers)
    fields.update(overrides)
    return module.TransformerConfig(**fields)


def context_length(setting) -> int:
    if setting.turns:
        return 1 + 10 + setting.turns * (setting.gen_len + 7)  # guess_number's layout
    return setting.prompt_len + setting.gen_len


def agent_mask(setting) -> np.ndarray:
    """[S] 1 on the positions the policy writes (every agent token slot)."""
    length = context_length(setting)
    mask = np.zeros(length, np.float32)
    if setting.turns:
        for turn in range(setting.turns):
            start = 11 + turn * (setting.gen_len + 7)
            mask[start:start + setting.gen_len] = 1
    else:
        mask[setting.prompt_len:] = 1
    return mask


def flops(config, batch: int, length: int, scored: int, attention: str = "dense",
          block: int = 512) -> float:
    """Executed matmul FLOPs of forward + backward (module docstring)."""
    c = config
    hd = c.resolved_head_dim
    layer_params = (c.d_model * hd * (2 * c.num_heads + 2 * c.num_kv_heads)
                    + 3 * c.d_model * c.mlp_dim)
    if attention == "dense":
        pairs = length * length
    else:  # the n (n + 1) / 2 blocks of c x c on and below the diagonal
        size, n = attention_lib.block_layout(length, block)
        pairs = n * (n + 1) / 2 * size * size
    forward = (length * 2 * c.num_layers * layer_params
               + c.num_layers * 4 * pairs * c.num_heads * hd
               + scored * 2 * c.d_model * c.vocab_size)
    return 3.0 * batch * forward


def gradient_program(module, config, tokens, params):
    model = module.Transformer(config)

    def loss(p):
        logp = jax.nn.log_softmax(model.apply({"params": p}, tokens).logits)
        return jnp.sum(jnp.take_along_axis(logp, tokens[..., None], -1))

    compiled, _ = common.compile_jitted(jax.jit(jax.grad(loss)), params)
    return compiled


def max_relative_difference(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(x)) + 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ------------------------------------------------------------------------------ layers
def layers_part(baseline, revision, repeats, peak, log):
    rows = []
    for name in SETTINGS:
        s = protocol.SETTINGS[name]
        length = context_length(s)
        config = model_config(transformer_lib, s)
        tokens = jax.random.randint(jax.random.key(0), (s.batch, length), 0, s.vocab)
        params = nn.unbox(transformer_lib.Transformer(config).init(
            jax.random.key(1), tokens[:1]))["params"]
        before = gradient_program(baseline, model_config(baseline, s), tokens, params)
        after = gradient_program(transformer_lib, config, tokens, params)
        difference = max_relative_difference(before(params), after(params))
        fns = {"before": lambda: jax.block_until_ready(before(params)),
               "after": lambda: jax.block_until_ready(after(params))}
        for fn in fns.values():
            fn()
        load0 = common.load_average()
        t = common.interleaved_median_times(fns, repeats)
        work = flops(config, s.batch, length, length)
        rows.append((name, f"{s.batch} x {length}", common.fmt_ms(t["before"]),
                     common.fmt_ms(t["after"]), f"{t['before'] / t['after']:.2f}x",
                     f"{work / t['after'] / 1e9:.0f} ({work / t['after'] / peak:.0%})",
                     f"{difference:.1e}", f"{load0:.1f} / {common.load_average():.1f}"))
        log(f"layers {name}: before {t['before']:.3f} s, after {t['after']:.3f} s")
    return common.markdown_table(
        ["setting", "B x S", f"before ({revision}) ms", "after ms", "speedup",
         "after GFLOP/s (of peak)", "max rel grad diff", "load start / end"], rows)


# ------------------------------------------------------------------------------ update
def loss_config():
    c = config_lib.default_config().loss
    c.kl_coef = 0.0
    return c


def compiled_update(policy, bound, batch, params, epochs=1):
    """(compiled `Learner.update`, a blocking call of it)."""
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5))
    learner = Learner(policy, optimizer, loss_config(), epochs=epochs, minibatches=1,
                      mesh=sharding_lib.make_mesh((1, 1, 1)),
                      context_length=batch.tokens.shape[1], agent_token_bound=bound)
    opt_state = optimizer.init(params)

    def run(params, opt_state, batch, key):
        return learner.update(params, opt_state, batch, key, 0)

    compiled, _ = common.compile_jitted(jax.jit(run), params, opt_state, batch,
                                        jax.random.key(0))
    return compiled, lambda: jax.block_until_ready(
        compiled(params, opt_state, batch, jax.random.key(0)))


def update_program(policy, bound, batch, params, epochs=1):
    return compiled_update(policy, bound, batch, params, epochs)[1]


def update_inputs(s):
    """(update batch laid out as the setting's rollouts, model config, params)."""
    length = context_length(s)
    mask = jnp.broadcast_to(jnp.asarray(agent_mask(s)), (s.batch, length))
    keys = jax.random.split(jax.random.key(2), 3)
    tokens = jax.random.randint(keys[0], (s.batch, length), 0, s.vocab)
    batch = UpdateBatch(
        tokens=tokens, mask=mask,
        old_logp=-jax.random.uniform(keys[1], mask.shape, minval=3, maxval=6) * mask,
        advantages=jax.random.normal(keys[2], mask.shape) * mask,
        observation_mask=jnp.zeros_like(mask))
    config = model_config(transformer_lib, s)
    params = nn.unbox(transformer_lib.Transformer(config).init(
        jax.random.key(1), tokens[:1]))["params"]
    return batch, config, params


def update_part(baseline, revision, repeats, peak, log):
    rows = []
    for name in SETTINGS:
        s = protocol.SETTINGS[name]
        length = context_length(s)
        batch, config, params = update_inputs(s)
        bound = int(agent_mask(s).sum())
        current = Policy(transformer_lib.Transformer(config))
        old = Policy(baseline.Transformer(model_config(baseline, s)))
        fns = {"baseline": update_program(old, 0, batch, params),
               "all": update_program(current, 0, batch, params),
               "scored": update_program(current, bound, batch, params)}
        for fn in fns.values():
            fn()
        load0 = common.load_average()
        t = common.interleaved_median_times(fns, repeats)
        work = {"baseline": flops(config, s.batch, length, length - 1),
                "all": flops(config, s.batch, length, length - 1),
                "scored": flops(config, s.batch, length, bound)}
        rate = {k: work[k] / t[k] for k in t}
        rows.append((name, f"{s.batch} x {length} ({bound} scored)",
                     common.fmt_ms(t["baseline"]), common.fmt_ms(t["all"]),
                     common.fmt_ms(t["scored"]), f"{t['baseline'] / t['scored']:.2f}x",
                     f"{t['all'] / t['scored']:.2f}x",
                     f"{rate['scored'] / 1e9:.0f} ({rate['scored'] / peak:.0%})",
                     f"{load0:.1f} / {common.load_average():.1f}"))
        log(f"update {name}: " + ", ".join(f"{k} {v:.3f} s" for k, v in t.items()))
    return common.markdown_table(
        ["setting", "B x S", f"baseline ({revision}) ms", "all positions ms",
         "agent tokens only ms", "total speedup", "from scoring", "GFLOP/s (of peak)",
         "load start / end"], rows)


# -------------------------------------------------------------------------------- long
def long_part(contexts, repeats, peak, log, max_run_gib=4.0):
    s = protocol.SETTINGS["modest"]
    rows, memory = [], {}
    for length in contexts:
        tokens = jax.random.randint(jax.random.key(0), (1, length), 0, s.vocab)
        entry = {}
        for attention in ("dense", "blocked"):
            config = model_config(transformer_lib, s, max_len=length, attention=attention,
                                  attention_block=512)
            params = nn.unbox(transformer_lib.Transformer(config).init(
                jax.random.key(1), tokens[:, :8]))["params"]
            compiled = gradient_program(transformer_lib, config, tokens, params)
            analysis = compiled.memory_analysis()
            temp = int(analysis.temp_size_in_bytes)
            peak_bytes = temp + int(analysis.argument_size_in_bytes) + int(
                analysis.output_size_in_bytes) - int(analysis.alias_size_in_bytes)
            seconds = None
            if peak_bytes < max_run_gib * 2**30:
                run = lambda: jax.block_until_ready(compiled(params))
                run()
                seconds = common.interleaved_median_times({"run": run}, repeats)["run"]
            entry[attention] = dict(temp=temp, peak=peak_bytes, seconds=seconds,
                                    flops=flops(config, 1, length, length, attention, 512))
            del compiled
        memory[length] = entry
        fmt_time = lambda e: "not run" if e["seconds"] is None else (
            f"{e['seconds']:.2f} s ({e['flops'] / e['seconds'] / peak:.0%})")
        rows.append((length, common.fmt_mib(entry["dense"]["temp"]),
                     common.fmt_mib(entry["blocked"]["temp"]),
                     common.fmt_mib(entry["dense"]["peak"]),
                     common.fmt_mib(entry["blocked"]["peak"]),
                     fmt_time(entry["dense"]), fmt_time(entry["blocked"]),
                     f"{common.load_average():.1f}"))
        log(f"long {length}: " + ", ".join(
            f"{k} temp {v['temp'] / 2**20:.0f} MiB, {v['seconds']} s" for k, v in entry.items()))
    slopes = []
    lo, hi = (1024 if 1024 in memory else min(memory)), max(memory)
    for attention in ("dense", "blocked"):
        for kind in ("temp", "peak"):
            slope = math.log(memory[hi][attention][kind] / memory[lo][attention][kind]) / (
                math.log(hi / lo))
            slopes.append(f"{attention} {kind} {slope:.2f}")
    table = common.markdown_table(
        ["context", "dense temp MiB", "blocked temp MiB", "dense peak MiB",
         "blocked peak MiB", "dense step (of peak)", "blocked step (of peak)", "load"], rows)
    return table + f"\n\nMemory slope d log(memory) / d log(context), {lo} -> {hi}: " + (
        "; ".join(slopes) + ".")


# --------------------------------------------------------------------------- attention
def dense_attention(q, k, v):
    """The decoder's dense cache-free attention (`Attention`'s formula): float32 scores
    [B, KV, G, T, T], causal mask, softmax, probabilities in v's dtype."""
    batch, length, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    q = q.reshape(batch, length, num_kv, num_heads // num_kv, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k,
                        preferred_element_type=jnp.float32) / math.sqrt(head_dim)
    order = jnp.arange(length)
    scores = jnp.where(order[None, :] <= order[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(q.shape[:2] + (num_heads, head_dim))


def attention_part(batch, repeats, peak, log, shape="qwen2.5-0.5b", length=1047):
    """Attention alone (forward + backward of sum(out * w)), dense against blocked, at the
    head layout of configs/real_sizes.py `shape` and its context (the one shipped config
    whose context exceeds attention_block, so "auto" runs blocked there)."""
    import importlib
    real = importlib.import_module("configs.real_sizes").get_config(shape).model
    heads, kv, head_dim = real.num_heads, real.num_kv_heads, real.d_model // real.num_heads
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, length, kv, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, length, kv, head_dim), jnp.float32)
    w = jax.random.normal(keys[3], q.shape, jnp.float32)
    block = real.attention_block
    fns, grads = {}, {}
    for name, fn in (("dense", dense_attention),
                     ("blocked", lambda q, k, v: attention_lib.causal_self_attention(
                         q, k, v, implementation="blocked", block_size=block))):
        grad = jax.jit(jax.grad(lambda q, k, v, f=fn: jnp.sum(f(q, k, v) * w), (0, 1, 2)))
        compiled, _ = common.compile_jitted(grad, q, k, v)
        grads[name] = compiled(q, k, v)
        fns[name] = lambda c=compiled: jax.block_until_ready(c(q, k, v))
        fns[name]()
    difference = max_relative_difference(grads["dense"], grads["blocked"])
    load0 = common.load_average()
    t = common.interleaved_median_times(fns, repeats)
    c, n = attention_lib.block_layout(length, block)
    work = {"dense": 3 * 4 * batch * heads * head_dim * length * length,
            "blocked": 3 * 4 * batch * heads * head_dim * n * (n + 1) / 2 * c * c}
    log(f"attention {shape} T={length}: " + ", ".join(f"{x} {y:.3f} s" for x, y in t.items()))
    row = (f"{shape}: {heads} heads / {kv} KV x {head_dim}", f"{batch} x {length}",
           f"{n} x {c}", common.fmt_ms(t["dense"]), common.fmt_ms(t["blocked"]),
           f"{t['dense'] / t['blocked']:.2f}x",
           f"{work['dense'] / t['dense'] / peak:.0%} / {work['blocked'] / t['blocked'] / peak:.0%}",
           f"{difference:.1e}", f"{load0:.1f} / {common.load_average():.1f}")
    return common.markdown_table(
        ["heads", "B x T", "blocks (n x c)", "dense ms", "blocked ms",
         "blocked speedup", "share of peak (dense / blocked)", "max rel grad diff",
         "load start / end"], [row])


# ----------------------------------------------------------------------------- shipped
SHIPPED = ("erpo_mixture", "grpo_bandit", "grpo_calculator", "grpo_code_interpreter",
           "grpo_guess_number", "grpo_sql", "grpo_word_problems", "llama_calculator",
           "ppo_guess_number", "vineppo_guess_number", "real_sizes")


def shipped_part(log):
    """model.attention "auto" against "dense" at each shipped token config's context: the
    implementation "auto" resolves to, and whether the lowered gradient programs of the
    config's decoder (two rows of the context) are the same text. Identical programs
    take identical time, so nothing is timed here."""
    import importlib

    from arl import envs as envs_lib
    from arl.rollout import context_length as rollout_context_length
    from arl.trainers.policy import build_model

    rows = []
    for name in SHIPPED:
        c = importlib.import_module(f"configs.{name}").get_config()
        config_lib.import_modules(c)
        env = envs_lib.make_env(c.env)
        length = rollout_context_length(env)
        resolved = attention_lib.resolve_implementation(
            c.model.attention, length, c.model.attention_block)
        texts = {}
        for attention in ("auto", "dense"):
            c.model.attention = attention
            model = build_model(c, vocab_size=env.codec.vocab_size, context_length=length,
                                value_head=False)
            tokens = jax.ShapeDtypeStruct((2, length), jnp.int32)
            params = jax.eval_shape(lambda t, m=model: nn.unbox(m.init(
                jax.random.key(0), t))["params"], tokens)

            def loss(p, t, m=model):
                return jnp.sum(m.apply({"params": p}, t).logits)

            texts[attention] = jax.jit(jax.grad(loss)).lower(params, tokens).as_text()
        same = texts["auto"] == texts["dense"]
        rows.append((name, length, c.model.attention_block, resolved,
                     "yes" if same else "no"))
        log(f"shipped {name}: context {length}, auto -> {resolved}, same program {same}")
    return common.markdown_table(
        ["config", "context", "attention_block", "auto resolves to",
         "auto and dense lower to the same program"], rows)


# ----------------------------------------------------------------------------- ceiling
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[[\d,]*\]\S* dot\(%([\w.\-]+), "
                  r"%([\w.\-]+)\)(.*)$")
_CALLEE = re.compile(r"(calls|body|to_apply|condition)=%([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")


def _dims(text: str, field: str) -> tuple[int, ...]:
    match = re.search(field + r"=\{([\d,]*)\}", text)
    return tuple(int(d) for d in match.group(1).split(",") if d) if match else ()


def hlo_dots(hlo_text: str, executed: collections.Counter | None = None) -> list[dict]:
    """Every `dot` of an optimized HLO module: dtype, operand shapes, dimension numbers and
    how many times it runs. Without `executed`, runs is the product of the known trip
    counts of the loops around it (computations reached from several places count once
    per caller; both branches of a conditional count once). With `executed` (the thunk
    runs of one call, `executed_thunks`), runs is how often the thunk holding the dot (the
    dot itself, or the fusion that calls its computation) ran: exact, branches not taken
    and dead code dropped."""
    shapes, lines_of, callers = {}, collections.defaultdict(list), collections.defaultdict(list)
    fused_by = {}  # fused computation -> the fusion instruction (the thunk) that calls it
    computation = None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            for name, dims in re.findall(r"%?([\w.\-]+): \w+\[([\d,]*)\]", line):
                shapes[name] = tuple(int(d) for d in dims.split(",") if d)
            continue
        match = _INSTRUCTION.match(line)
        if match:  # (tuple-shaped instructions, e.g. loops, have no array shape)
            shapes[match.group(1)] = tuple(int(d) for d in match.group(3).split(",") if d)
        lines_of[computation].append(line)
        trips, name = _TRIP_COUNT.search(line), _NAME.match(line)
        for kind, callee in _CALLEE.findall(line):
            count = int(trips.group(1)) if trips and kind == "body" else 1
            callers[callee].append((computation, count))
            if kind == "calls" and name:
                fused_by[callee] = name.group(1)

    def runs(name: str) -> int:
        if not callers.get(name):
            return 1
        return sum(count * runs(caller) for caller, count in callers[name])

    dots = []
    for computation, lines in lines_of.items():
        for line in lines:
            match = _DOT.match(line)
            if not match:
                continue
            name, dtype, lhs, rhs, rest = match.groups()
            thunk = fused_by.get(computation, name)
            count = runs(computation) if executed is None else executed.get(thunk, 0)
            if not count:
                continue
            dots.append(dict(
                dtype=dtype, lhs=shapes[lhs], rhs=shapes[rhs], runs=count,
                numbers=((_dims(rest, "lhs_contracting_dims"),
                          _dims(rest, "rhs_contracting_dims")),
                         (_dims(rest, "lhs_batch_dims"), _dims(rest, "rhs_batch_dims")))))
    return dots


def executed_thunks(run: Callable[[], object], calls: int = 1) -> collections.Counter:
    """How many times each thunk (HLO instruction XLA runs as one unit: a fusion, a dot, a
    loop...) of the programs `run` executes ran per call (the mean over `calls` calls), from
    a `jax.profiler` trace (`run` must block until its results are ready)."""
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for _ in range(calls):
                run()
        paths = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True)
        if not paths:
            raise RuntimeError(f"jax.profiler wrote no trace under {directory}")
        with gzip.open(paths[0], "rt", encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
    counts = collections.Counter(event["name"] for event in events
                                 if event.get("ph") == "X" and not event["name"].startswith("$"))
    return collections.Counter({name: count / calls for name, count in counts.items()})


def dot_flops(dot: dict) -> float:
    """2 x (batch x M x K) x N."""
    (_, rhs_contract), (_, rhs_batch) = dot["numbers"]
    rhs_free = [d for i, d in enumerate(dot["rhs"]) if i not in rhs_contract + rhs_batch]
    return 2.0 * math.prod(dot["lhs"]) * math.prod(rhs_free)


def dispatch_seconds(repeats: int) -> float:
    """Median seconds of calling a jitted program that does next to nothing: the part of
    a dot's time alone that the same dot inside the update does not pay."""
    scalar = jnp.ones((), jnp.float32)
    program = jax.jit(lambda a: a + 1.0)
    return common.interleaved_median_times(
        {"call": lambda: jax.block_until_ready(program(scalar))}, repeats)["call"]


def dot_seconds(dot: dict, repeats: int) -> float:
    """Median seconds of the dot alone (random operands of its shapes), call included."""
    dtype = jnp.dtype(dot["dtype"].replace("f32", "float32").replace("bf16", "bfloat16"))
    lhs = jax.random.normal(jax.random.key(0), dot["lhs"], dtype)
    rhs = jax.random.normal(jax.random.key(1), dot["rhs"], dtype)
    program = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dot["numbers"]))
    return common.interleaved_median_times(
        {"dot": lambda: jax.block_until_ready(program(lhs, rhs))}, repeats)["dot"]


def dots_alone(hlo_text: str, repeats: int, log, top: int = 6,
               executed: collections.Counter | None = None):
    """(seconds, FLOPs, dots, distinct shapes) of every dot of an optimized HLO module
    (`hlo_dots`: as often as `executed` says the program ran it, else loop trip counts
    included) timed alone at its shapes, less the cost of calling a jitted program; logs
    the `top` costliest shapes."""
    dots = hlo_dots(hlo_text, executed)
    signatures = collections.Counter()
    for dot in dots:
        signatures[(dot["dtype"], dot["lhs"], dot["rhs"], dot["numbers"])] += dot["runs"]
    call = dispatch_seconds(5 * repeats)
    timed = []  # (seconds of all its runs, GFLOP/s, signature, runs, FLOPs of one run)
    for signature, runs in signatures.items():
        dot = dict(zip(("dtype", "lhs", "rhs", "numbers"), signature))
        seconds = max(1e-9, dot_seconds(dot, repeats) - call)
        work_once = dot_flops(dot)
        timed.append((runs * seconds, work_once / seconds / 1e9, signature, runs, work_once))
    for seconds, rate, (dtype, lhs, rhs, numbers), runs, _ in sorted(timed,
                                                                     reverse=True)[:top]:
        log(f"dot {dtype} {lhs} x {rhs} {numbers} x{runs}: {1e3 * seconds:.1f} ms, "
            f"{rate:.0f} GFLOP/s")
    return (sum(t[0] for t in timed), sum(t[3] * t[4] for t in timed), dots,
            len(signatures))


def ceiling_part(repeats, peak, log, peak_size):
    """The shares use the best peak measured (the run's first one and one before each
    setting): on this shared machine single readings of the same matmul vary 2x."""
    rows, peaks = [], [peak]
    for name in SETTINGS:
        peaks.append(common.matmul_peak_flops(peak_size))
        s = protocol.SETTINGS[name]
        length = context_length(s)
        batch, config, params = update_inputs(s)
        bound = int(agent_mask(s).sum())
        compiled, run = compiled_update(Policy(transformer_lib.Transformer(config)), bound,
                                        batch, params)
        matmul_seconds, executed, dots, distinct = dots_alone(
            compiled.as_text(), repeats, lambda line: log(f"  {name} {line}"),
            executed=executed_thunks(run))
        update_seconds = common.interleaved_median_times({"update": run}, repeats)["update"]
        work = flops(config, s.batch, length, bound)
        rows.append([name, f"{s.batch} x {length}", sum(d["runs"] for d in dots),
                     distinct, f"{executed / 1e9:.1f} / {work / 1e9:.1f}",
                     common.fmt_ms(update_seconds), common.fmt_ms(matmul_seconds),
                     work / update_seconds, work / matmul_seconds,
                     f"{update_seconds / matmul_seconds:.2f}x"])
        log(f"ceiling {name}: update {update_seconds:.3f} s, its {len(dots)} dots alone "
            f"{matmul_seconds:.3f} s")
    best = max(peaks)
    for row in rows:
        row[7:9] = [f"{rate / best:.0%}" for rate in row[7:9]]
    log(f"ceiling: float32 matmul peak readings {', '.join(f'{p / 1e9:.0f}' for p in peaks)} "
        f"GFLOP/s, shares against the best")
    return (f"Shares of the best float32 matmul peak measured in this part, "
            f"{best / 1e9:.1f} GFLOP/s (readings: "
            f"{', '.join(f'{p / 1e9:.0f}' for p in peaks)}).\n\n" + common.markdown_table(
                ["setting", "B x S", "dots executed", "distinct shapes",
                 "dot GFLOP executed / model count", "update ms", "its dots alone ms",
                 "update of peak", "dots alone of peak", "update / dots"], rows))


def step_part(repeats, peak, log, peak_size, cache_dir):
    """The whole train step of `peers.py` (rollout + update, arl's side exactly as that
    benchmark compiles and runs it) and its rollout alone, each against the sum of its
    own dots timed alone: the time the step would take on this machine's matmul kernels
    if nothing else in it cost anything."""
    import peers  # pylint: disable=import-outside-toplevel  (TRL/tunix not needed)

    rows, peaks = [], [peak]
    for name in SETTINGS:
        peaks.append(common.matmul_peak_flops(peak_size))
        setting = protocol.SETTINGS[name]
        runner = peers.ArlRunner(setting, peers.write_checkpoint(setting, cache_dir),
                                 warmup=2)
        step_dots, step_flops, _, _ = dots_alone(
            runner.step_program.as_text(), repeats, lambda line: log(f"  {name} step {line}"),
            executed=executed_thunks(runner._run_step))  # pylint: disable=protected-access
        rollout_dots, rollout_flops, _, _ = dots_alone(
            runner.rollout_program.as_text(), repeats,
            lambda line: log(f"  {name} rollout {line}"),
            executed=executed_thunks(runner._run_rollout))  # pylint: disable=protected-access
        times = common.interleaved_median_times(
            {"step": runner._run_step, "rollout": runner._run_rollout}, repeats)  # pylint: disable=protected-access
        update, update_dots = times["step"] - times["rollout"], step_dots - rollout_dots
        update_flops = step_flops - rollout_flops
        rows.append([name, common.fmt_ms(times["step"]), common.fmt_ms(step_dots),
                     f"{step_dots / times['step']:.0%}", f"{step_flops / 1e9:.1f}",
                     step_flops / step_dots, common.fmt_ms(times["rollout"]),
                     common.fmt_ms(rollout_dots), f"{rollout_dots / times['rollout']:.0%}",
                     common.fmt_ms(update), common.fmt_ms(update_dots),
                     f"{update_dots / update:.0%}", f"{update_flops / 1e9:.1f}",
                     update_flops / update, update_flops / update_dots])
        log(f"step {name}: step {times['step']:.3f} s, its dots alone {step_dots:.3f} s; "
            f"rollout {times['rollout']:.3f} s, its dots alone {rollout_dots:.3f} s")
    best = max(peaks)
    for row in rows:
        for column in (5, 13, 14):
            row[column] = f"{row[column] / 1e9:.0f} ({row[column] / best:.0%})"
    return (f"arl's side of `peers.py` (`TokenTrainer.train_step`, state donated; the "
            f"rollout compiled alone); update = step - rollout. Dots alone: every dot the "
            f"compiled program ran in one call (`executed_thunks`: counted from a profile, "
            f"so a conditional's untaken branch is not counted), at its shapes, timed alone. "
            f"Rate of the dots alone against the best float32 matmul peak measured in this "
            f"part, {best / 1e9:.1f} GFLOP/s (readings: "
            f"{', '.join(f'{p / 1e9:.0f}' for p in peaks)}).\n\n" + common.markdown_table(
                ["setting", "step ms", "its dots alone ms", "dots / step",
                 "dot GFLOP executed", "dots alone GFLOP/s (of peak)", "rollout ms",
                 "its dots alone ms", "dots / rollout", "update ms", "its dots alone ms",
                 "dots / update", "update dot GFLOP", "update GFLOP/s (of peak)",
                 "update's dots alone GFLOP/s (of peak)"], rows))


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True,
                          check=False).stdout.strip()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts",
                        default="layers,update,long,attention,shipped,ceiling,step")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/arl-bench-peers"),
                        help="where `step` writes the peers' shared checkpoints")
    parser.add_argument("--attention-batch", type=int, default=2)
    parser.add_argument("--baseline", default=BASELINE,
                        help="git revision of the decoder to compare against")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--contexts", default="512,1024,2048,4096,8192")
    parser.add_argument("--peak-size", type=int, default=1024)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    common.host_settings_as_the_cli()
    log = lambda line: print(line, flush=True)
    uptime_start = uptime()
    log(f"uptime: {uptime_start}")

    peak = common.matmul_peak_flops(args.peak_size)
    log(f"float32 matmul peak ({args.peak_size}^2): {peak / 1e9:.1f} GFLOP/s")
    baseline = load_baseline(args.baseline) if {"layers", "update"} & set(parts) else None
    sections = []
    if "layers" in parts:
        sections.append(("Model gradient: projections on flattened tokens",
                         layers_part(baseline, args.baseline, args.repeats, peak, log)))
    if "update" in parts:
        sections.append(("Update phase: scoring the agent tokens only",
                         update_part(baseline, args.baseline, args.repeats, peak, log)))
    if "long" in parts:
        contexts = [int(x) for x in args.contexts.split(",")]
        sections.append(("Long contexts: dense vs blocked attention (modest model, batch 1)",
                         long_part(contexts, max(1, args.repeats // 3), peak, log)))
    if "attention" in parts:
        sections.append(("Attention alone at configs/real_sizes.py's context: dense vs blocked",
                         attention_part(args.attention_batch, args.repeats, peak, log)))
    if "shipped" in parts:
        sections.append(("Shipped configs: model.attention 'auto' against 'dense'",
                         shipped_part(log)))
    if "ceiling" in parts:
        sections.append(("The update against its own matmuls run alone",
                         ceiling_part(args.repeats, peak, log, args.peak_size)))
    if "step" in parts:
        sections.append(("The train step against its own matmuls run alone",
                         step_part(args.repeats, peak, log, args.peak_size, args.cache_dir)))
    peak_after = common.matmul_peak_flops(args.peak_size)
    uptime_end = uptime()
    text = (f"### `benchmarks/update_phase.py` — {common.utc_now()}\n\n"
            f"Machine: {common.machine_line()}.\n\n"
            f"`uptime` at the start: `{uptime_start}`; at the end: `{uptime_end}`.\n\n"
            f"Float32 matmul peak ({args.peak_size}^2 `jnp.dot`): {peak / 1e9:.1f} GFLOP/s "
            f"before, {peak_after / 1e9:.1f} after (shares use the first). Median of "
            f"{args.repeats} interleaved rounds (long contexts: {max(1, args.repeats // 3)}). "
            f"FLOPs: executed matmul FLOPs (see the script's docstring).\n")
    for title, table in sections:
        text += f"\n#### {title}\n\n{table}\n"
    print(text)
    if not args.no_write:
        common.append_section("Update phase", text)


if __name__ == "__main__":
    main()
