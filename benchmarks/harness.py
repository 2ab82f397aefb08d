"""The equal-work harness: arl's side of the settings raced against TRL and tunix, the
FLOP formulas, and the timer of a process's first step.

Used by `peers.py` (the race), `ab.py`, `matmul_ceiling.py`, `first_step.py`,
`agentic_step.py` and `peer_workers/arl_first_step.py`. Importing it imports the standard
library only (and `peer_workers/protocol.py`, also standard library): a measured child
process imports it before the imports it times, so JAX and arl are imported where they
are used.

Equal work (`peer_workers/protocol.py` holds the settings): a randomly initialised
Qwen2-shaped policy with the SAME weights on every side (`write_checkpoint`: one Hugging
Face checkpoint per setting, which arl, TRL and tunix all load), float32, GRPO without KL
(beta 0), one optimizer step per batch of `num_prompts x group_size` samples,
temperature 1 with no top-k / top-p, and generation forced to exactly `gen_len` tokens
(arl: an end-of-turn id outside the vocabulary, `target_token.py`; TRL: `min_new_tokens`;
tunix: an EOS id outside the vocabulary). Reward: the share of generated tokens equal to
a target id, computed by each side on its generated ids; the multi-turn setting plays
guess_number. arl's side is its DEFAULT configuration as a notebook user builds it
(`arl_config`: `arl.config.default_config()` with only the equal-work settings, none of
them a speed setting; `--arl_set KEY=VALUE` measures an override), run by `ArlRunner`:
the compiled `TokenTrainer.train_step` (state donated) and the step's rollout alone under
its own `jax.jit`, so update time = step - rollout.

FLOPs (model FLOPs of the useful work, the same formula for every side, so FLOP/s ratios
are speed ratios): with P = parameters used in matmuls (all but the embedding table:
attention and MLP projections and the LM head; biases and norms ignored), L layers,
width d and a sequence of T positions,
    one forward of one position  = 2 P + 4 L T d          (dense attention over T keys)
    update (forward + backward)  = 3 x trained tokens x (2 P + 4 L T d)
    rollout (prefill + decoding) = B x (prompt + generated) x (2 P + 4 L T d)
where trained tokens = the positions a side runs forward + backward on (arl: its static
[B, S] buffer; TRL, tunix: prompt + completion, padded). This is the useful work, as in
MFU, not what a side executes (arl's update reads each group's prompt once and may take
the layers' projections from the rollout); what arl's update program executes is
`matmul_flops` of its jaxpr (`largest_cond_branch_flops`: the update-or-skip cond's
update branch).

The first-step timer (`Timeline`): contiguous named phases of one process (its start,
imports, config, building the trainer, the initial state, the first step, ...) in wall
seconds, and within each the seconds JAX spent tracing, lowering to MLIR and compiling or
loading from the persistent cache (JAX's monitoring events, overlapping spans merged),
with the programs compiled and the cache hits among them. `notebook_first_step` is the
one first step it times through the public API, as a notebook's first cells run it.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import multiprocessing
import os
import shutil
import sys
import time
from typing import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position


# ------------------------------------------------------------------------------ FLOPs
def matmul_params(setting: protocol.Setting) -> int:
    """P of a setting's model: the parameters used in matmuls (not the embedding)."""
    s = setting
    attention = s.d_model * s.head_dim * (2 * s.num_heads + 2 * s.num_kv_heads)
    mlp = 3 * s.d_model * s.mlp_dim
    return s.num_layers * (attention + mlp) + s.d_model * s.vocab


def matmul_params_of_tree(params) -> int:
    """P of a parameter pytree: every leaf but the token embedding table."""
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return int(sum(np.prod(leaf.shape) for path, leaf in flat
                   if "embed_tokens" not in jax.tree_util.keystr(path)))


def forward_flops(matmul_parameters: float, num_layers: int, length: float,
                  d_model: int) -> float:
    """One forward of one position attending over `length` keys: 2 P + 4 L T d."""
    return 2 * matmul_parameters + 4 * num_layers * length * d_model


def forward_flops_per_position(setting: protocol.Setting, length: float) -> float:
    return forward_flops(matmul_params(setting), setting.num_layers, length,
                         setting.d_model)


def update_flops(setting: protocol.Setting, trained_tokens: float) -> float:
    """Forward + backward (3 forwards) over the batch's trained tokens."""
    length = trained_tokens / setting.batch
    return 3 * trained_tokens * forward_flops_per_position(setting, length)


def rollout_flops(setting: protocol.Setting, context: int) -> float:
    return setting.batch * context * forward_flops_per_position(setting, context)


def _sub_jaxprs(eqn):
    """The jaxprs an equation calls (scan / while bodies, cond branches, jit, remat and
    custom-derivative calls), as (name, jaxpr) pairs."""
    import jax.extend.core as jax_core  # pylint: disable=import-outside-toplevel

    for name, value in eqn.params.items():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax_core.ClosedJaxpr):
                yield name, item.jaxpr
            elif isinstance(item, jax_core.Jaxpr):
                yield name, item


def matmul_flops(jaxpr, choose_branch: Callable[[Sequence[float]], float] = max) -> float:
    """FLOPs of the matrix products (`dot_general`) a jaxpr asks for: 2 x output size x
    contracted size each, a scan's body times its length, of a cond's branches the one
    `choose_branch` picks, a while loop's body once (its trip count is data). Products
    the program does not contain (e.g. a forward value taken from a stored array) are
    not counted; XLA may still remove dead ones."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs_shape = eqn.invars[0].aval.shape
            contracted = float(np.prod([lhs_shape[d] for d in lhs_contract]))
            total += 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * contracted
        elif name == "cond":
            total += choose_branch([matmul_flops(b, choose_branch)
                                    for b in eqn.params["branches"]])
        else:
            inner = sum(matmul_flops(sub, choose_branch) for key, sub in _sub_jaxprs(eqn)
                        if not key.startswith("cond_"))  # a while loop's condition
            total += inner * (eqn.params["length"] if name == "scan" else 1)
    return total


def largest_cond_branch_flops(jaxpr, choose_inner: Callable[[Sequence[float]], float] = min
                              ) -> float:
    """The matmul FLOPs of the costliest branch of the outermost conds in `jaxpr` (those
    not inside another cond's branch), conds within a branch resolved by
    `choose_inner`: e.g. a train step's update-or-skip branch."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    best = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            best = max([best] + [matmul_flops(b, choose_inner)
                                 for b in eqn.params["branches"]])
            continue
        for _, sub in _sub_jaxprs(eqn):
            best = max(best, largest_cond_branch_flops(sub, choose_inner))
    return best


# ---------------------------------------------------------------- the equal-work setup
def arl_config(setting: protocol.Setting, checkpoint: str, overrides=None):
    """arl's config of `setting`: `default_config()` with the equal-work settings (the
    setting's env, sizes and checkpoint; GRPO without KL, one epoch of one minibatch,
    learning rate, gradient clip, every update taken) and nothing tuned for speed (the
    defaults reuse the rollout's activations, `updates.reuse_rollout_activations`
    "auto"); then `overrides` ({"section.key": value}, as on the training CLI's command
    line)."""
    from arl import config as config_lib  # pylint: disable=import-outside-toplevel
    from arl import envs as envs_lib  # pylint: disable=import-outside-toplevel
    import target_token  # pylint: disable=import-outside-toplevel  (registers its env)

    c = config_lib.default_config()
    c.algorithm = "grpo"
    if setting.turns:
        c.env.name = "guess_number"
        c.env.kwargs.max_n = 16
        c.env.kwargs.max_turns = setting.turns
        # The checkpoint is weights only: the env's character codec, named explicitly.
        c.env.kwargs.codec = envs_lib.CharCodec()
    else:
        c.env.name = target_token.TargetToken.name
        c.env.kwargs.vocab = setting.vocab
        c.env.kwargs.prompt_len = setting.prompt_len - 1  # arl's buffer starts with BOS
        c.env.kwargs.gen_len = setting.gen_len
    c.rollout.num_tasks = setting.num_prompts
    c.rollout.group_size = setting.group_size
    c.model.hf_checkpoint = checkpoint
    c.model.dtype = "float32"
    c.optim.learning_rate = 1e-5
    c.optim.max_grad_norm = 1.0
    c.loss.kl_coef = 0.0
    c.updates.epochs = 1
    c.updates.minibatches = 1
    c.filters.skip_zero_advantage = False  # always time a real update
    for key, value in (overrides or {}).items():
        node = c
        for part in key.split("."):
            if not hasattr(node, "keys") or part not in node:
                raise SystemExit(f"override {key}: arl's config has no such key")
            node = node[part]
        try:
            c.update_from_flattened_dict({key: value})
        except (TypeError, ValueError) as e:
            raise SystemExit(f"override {key}={value!r}: {e}") from None
    return c


def parse_override(text: str) -> tuple[str, object]:
    """"section.key=value" -> ("section.key", value): the value a Python literal (1e-5,
    False, "dense"), else the text itself."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"override {text!r}: expected KEY=VALUE, e.g. "
                         "updates.reuse_rollout_activations=False")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def model_config(setting: protocol.Setting, max_len: int):
    from arl.models import transformer  # pylint: disable=import-outside-toplevel

    return transformer.TransformerConfig(
        vocab_size=setting.vocab, d_model=setting.d_model, num_layers=setting.num_layers,
        num_heads=setting.num_heads, num_kv_heads=setting.num_kv_heads,
        mlp_dim=setting.mlp_dim, max_len=max_len, rope_theta=setting.rope_theta,
        norm_eps=setting.norm_eps, qkv_bias=True)


def checkpoint_path(setting: protocol.Setting, cache_dir: str, seed: int = 0) -> str:
    tag = hashlib.sha1(f"{setting.to_json()}-{seed}".encode()).hexdigest()[:10]
    return os.path.join(cache_dir, "checkpoints", f"{setting.name}-{tag}")


def checkpoint_written(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "model.safetensors"))


def write_checkpoint(setting: protocol.Setting, cache_dir: str, seed: int = 0) -> str:
    """The setting's randomly initialised Qwen2 checkpoint (config.json + safetensors),
    written once under `cache_dir` and loaded by every side."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from arl.models import hf_import  # pylint: disable=import-outside-toplevel
    from arl.models import transformer  # pylint: disable=import-outside-toplevel

    path = checkpoint_path(setting, cache_dir, seed)
    if checkpoint_written(path):
        return path
    config = model_config(setting, max_len=512)
    model = transformer.Transformer(config)
    params = jax.jit(lambda k: model.init(k, jnp.zeros((1, 8), jnp.int32)))(
        jax.random.key(seed))["params"]
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    hf_import.save_hf_checkpoint(tmp, params, config, model_type="qwen2")
    os.replace(tmp, path)
    return path


def write_checkpoints(settings, cache_dir: str) -> None:
    """`write_checkpoint` of each setting whose checkpoint is missing, in a child
    process: this one's JAX backend then starts with arl's first trainer."""
    missing = [s for s in settings if not checkpoint_written(checkpoint_path(s, cache_dir))]
    if not missing:
        return
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_write_checkpoints, args=(missing, cache_dir))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"writing the checkpoints of {[s.name for s in missing]} failed "
                         f"(exit status {child.exitcode})")


def _write_checkpoints(settings, cache_dir: str) -> None:
    for setting in settings:
        write_checkpoint(setting, cache_dir)


class ArlRunner:
    """arl's compiled step and its rollout alone, behind the peer workers' step() face."""

    name = "arl"

    def __init__(self, setting: protocol.Setting, checkpoint: str, warmup: int,
                 overrides=None):
        import jax  # pylint: disable=import-outside-toplevel
        import common  # pylint: disable=import-outside-toplevel
        from arl.trainers import TokenTrainer  # pylint: disable=import-outside-toplevel

        start = time.perf_counter()
        self.setting = setting
        self.trainer = TokenTrainer(arl_config(setting, checkpoint, overrides))
        state = jax.block_until_ready(self.trainer.init_state())
        # Setup as a user's run has it: the trainer and its initial state (the checkpoint
        # loaded); not this benchmark's own work below (the step traced once more for its
        # FLOPs, the rollout compiled alone, the warm-up steps).
        setup_s = time.perf_counter() - start
        self.params = jax.tree.map(lambda x: x.copy(), state.params)  # state is donated
        # The step's update-or-skip cond: its update branch is the costliest cond branch
        # of the step; inside it, every group's rows share their prompt in these
        # settings, so the shared-prompt branch (the cheaper one) is the one that runs.
        executed_update_flops = largest_cond_branch_flops(
            jax.make_jaxpr(self.trainer.train_step)(state), choose_inner=min)
        self.step_program, step_compile = common.compile_jitted(self.trainer.train_step,
                                                                state)
        trainer = self.trainer  # the step's own rollout (the group's prompt prefilled once)
        self.rollout_program, rollout_compile = common.compile_jitted(
            jax.jit(lambda params, key: trainer.rollout(params, key, trainer.horizon(0))),
            self.params, jax.random.key(1))
        self.metrics = []
        self._run_step = common.donated_step_runner(self.step_program, state,
                                                    self.metrics.append)
        self._keys = iter(jax.random.split(jax.random.key(2), 10_000))
        first = time.perf_counter()
        self._run_step()
        first_step_s = time.perf_counter() - first
        for _ in range(max(0, warmup - 1)):
            self._run_step()
        self._run_rollout()
        self.ready = dict(
            setup_s=setup_s, first_step_s=first_step_s,
            compile_s=step_compile, rollout_compile_s=rollout_compile,
            context=self.trainer.context_length,
            executed_update_flops=executed_update_flops,
            temp_mib=(common.temp_bytes(self.step_program) or 0) / 2**20)

    def _run_rollout(self):
        import jax  # pylint: disable=import-outside-toplevel

        jax.block_until_ready(self.rollout_program(self.params, next(self._keys)))

    def step(self) -> dict:
        start = time.perf_counter()
        self._run_step()
        step_s = time.perf_counter() - start
        start = time.perf_counter()
        self._run_rollout()
        rollout_s = time.perf_counter() - start
        m = self.metrics[-1]
        generated = float(m["response_tokens_mean"]) * self.trainer.batch_size
        return dict(step_s=step_s, rollout_s=rollout_s, generated_tokens=generated,
                    trained_tokens=self.trainer.batch_size * self.trainer.context_length,
                    reward_mean=float(m.get("reward_mean", float("nan"))))

    def close(self):
        pass


# ------------------------------------------------------------------ the first-step timer
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"
_HIT = "/jax/compilation_cache/cache_hits"


class Timeline:
    """Contiguous named phases of one process, and JAX's compile events within them."""

    def __init__(self, spawned: float):
        self.phases = {"python start": {"wall": time.time() - spawned}}
        self.current, self.since = "imports", time.perf_counter()
        self.spans = {}  # phase -> event -> [(start, end)]
        self.counts = {}  # phase -> {"compiled": n, "cache hits": n}
        self.done = None  # perf_counter time of the first logged step
        self.programs = []  # [phase, program, compile or load seconds, from the cache]
        self._hit = False

    def enter(self, name: str) -> None:
        now = time.perf_counter()
        entry = self.phases.setdefault(self.current, {"wall": 0.0})
        entry["wall"] += now - self.since
        self.current, self.since = name, now

    @contextlib.contextmanager
    def phase(self, name: str):
        """`name` while the block runs; then "other" (the loop between the phases)."""
        self.enter(name)
        try:
            yield
        finally:
            self.enter("other")

    def finish(self) -> None:
        """The first step is logged: what follows is not start-up."""
        self.done = time.perf_counter()
        self.enter("after the first log")
        self.enter = lambda name: None  # the loop's later phases are not counted

    def listen(self):
        import jax  # pylint: disable=import-outside-toplevel

        def span(event, start, end, fun_name="", **_):
            if event in (_TRACE, _LOWER, _COMPILE):
                self.spans.setdefault(self.current, {}).setdefault(event, []).append(
                    (start, end))
            if event == _COMPILE:
                counts = self.counts.setdefault(self.current, {})
                counts["compiled"] = counts.get("compiled", 0) + 1
                # The hit event comes inside the compile's span; its end names the program.
                self.programs.append([self.current, fun_name, end - start, self._hit])
                self._hit = False

        def hit(event, **_):
            if event == _HIT:
                counts = self.counts.setdefault(self.current, {})
                counts["cache hits"] = counts.get("cache hits", 0) + 1
                self._hit = True

        jax.monitoring.register_event_time_span_listener(span)  # pylint: disable=no-member
        jax.monitoring.register_event_listener(hit)

    def report(self) -> dict:
        out = {}
        for name, entry in self.phases.items():
            spans = self.spans.get(name, {})
            out[name] = dict(wall=entry["wall"], **self.counts.get(name, {}), **{
                key: _union(spans.get(event, ()))
                for key, event in (("trace", _TRACE), ("lower", _LOWER),
                                   ("compile", _COMPILE))})
        return out


def _union(spans) -> float:
    """Seconds covered by `spans` (nested traces overlap their callers')."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def notebook_first_step(timeline: Timeline, setting: protocol.Setting, checkpoint: str,
                        config_phase: str = "config") -> tuple[float, float]:
    """A fresh process's first step as a notebook's first cells run it, its phases marked
    on `timeline`: the imports and `arl.setup()` (in the timeline's current phase), the
    config (`arl_config`, in `config_phase`), `TokenTrainer(config)`, `init_state()` (the
    checkpoint loaded) and one `train_step` compiled at its call, its reward read on the
    host. Returns (the first step's seconds, its reward_mean)."""
    import jax  # pylint: disable=import-outside-toplevel
    import arl  # pylint: disable=import-outside-toplevel
    import target_token  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    from arl.trainers import TokenTrainer  # pylint: disable=import-outside-toplevel

    arl.setup()  # the notebook's documented first cell
    timeline.listen()
    timeline.enter(config_phase)
    config = arl_config(setting, checkpoint)
    timeline.enter("build trainer")
    trainer = TokenTrainer(config)
    timeline.enter("init state")
    state = jax.block_until_ready(trainer.init_state())
    timeline.enter("first step")
    started = time.perf_counter()
    state, metrics = trainer.train_step(state)
    jax.block_until_ready(state)
    reward_mean = float(metrics["reward_mean"])
    first_step_s = time.perf_counter() - started
    timeline.finish()
    return first_step_s, reward_mean
