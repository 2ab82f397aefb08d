"""Equal-work GRPO step: arl's compiled step against TRL's GRPOTrainer and tunix's GRPOLearner.

Same work on every side: a randomly initialised Qwen2-shaped policy (the SAME weights:
arl writes one Hugging Face checkpoint per setting, which arl, TRL and tunix all load),
float32, GRPO without KL (beta 0), one optimizer step per batch of
`num_prompts x group_size` samples, temperature 1 with no top-k / top-p, and generation
forced to exactly `gen_len` tokens (arl: an end-of-turn id outside the vocabulary; TRL:
`min_new_tokens`; tunix: an EOS id outside the vocabulary). Reward: the share of
generated tokens equal to a target id, computed by each side on its generated ids.
Settings (`peer_workers/protocol.py`): toy, modest, multiturn (guess_number, 6 turns:
arl plays every turn inside its one compiled step; the peers pay a host round trip and a
`generate` call per turn: TRL through its `rollout_func`, one call per turn over the
unfinished episodes; tunix through its agentic learner, one call per episode per turn),
tiny (the smoke test's size).

Each peer runs in its own virtual environment under `--cache_dir` (created on first use
with `python -m venv` and pip: `torch==2.13.0` + `trl`, or `google-tunix`), as a worker
process (`peer_workers/*_worker.py`) that builds its trainer, warms up, then runs one
training step per "step" line on stdin and answers with its timings as a JSON line. All
workers stay alive, so rounds are INTERLEAVED (arl, trl, tunix, arl, ...) and load from
other jobs on this shared machine hits every side alike. A peer that cannot be installed
or crashes is reported in one line and the others carry on.

arl's side runs in this process: the compiled `TokenTrainer.train_step` (state donated)
and, as in `benchmarks/agentic_step.py`, the rollout alone under its own `jax.jit`
(`arl.rollout.rollout`, same sizes): update time = step - rollout. The peers time
their own generation (TRL: `GRPOTrainer._generate`; tunix: `RLCluster.generate`).

arl's row is its DEFAULT configuration built as a notebook user builds it:
`arl.config.default_config()` with only the equal-work settings above (`arl_config`:
the env and sizes, learning rate 1e-5, gradient clip 1, no KL, every update taken; none
of them a speed setting), passed to `TokenTrainer` through the public API, after
`arl.setup()` as a notebook's first cell calls it (the library's CPU host settings,
`arl.runs.process_settings`: computations run inline, glibc keeps freed memory), which
takes effect only as this process's first use of JAX: the checkpoints are written by a
child process, and nothing touches JAX before it. The peers get the same host settings from
their environment (GLIBC_TUNABLES; tunix's computations inline). There is no tuned row:
no setting beyond the defaults is known to make arl's step faster at these sizes (each
measured option of docs/performance.md is either the default or slower here, e.g.
`model.layer_unroll=1`, `model.attention=blocked`); `--arl_set KEY=VALUE` measures an
override, and then arl's row is no longer the default configuration.

Time to the first step from launch (the table's last column but one), measured the same
way for every side: the wall seconds from launching a fresh Python process until its
first training step has finished, as a user running a short script sees it, timed by
this script from just before the launch to reading the child's line that the step is
done (interpreter start, imports, building the trainer, loading the checkpoint,
compiling, the step). arl's child (`peer_workers/arl_first_step.py`) does what a
notebook's first cell does: `TokenTrainer(arl_config(...))`, `init_state()`, one
`train_step` compiled at its call, its reward read on the host; TRL's and tunix's are
their workers run up to the end of their first step (one warm-up step, then "quit").
Each side runs twice, interleaved with the others: a first run with arl's persistent
compilation cache in a fresh empty temporary directory (never the user's
~/.cache/arl), then a rerun with that directory as the first run left it (TRL and tunix
as their libraries come: no persistent compilation cache). The phase runs after each
setting's step rounds, when every process of the rounds has exited, so it cannot
disturb the step timings, the machine is otherwise idle, and every side's libraries
have just been read once: Python's bytecode and the OS's file cache are warm for all
sides alike, and a first run differs from its rerun only by the compilation cache. The
parts of each side's time (arl: imports, building the trainer, the initial state, the
first step and JAX's trace / lower / compile-or-load seconds in it; the peers: up to
the first step's start, and the first step) are a line of prose under the table.
`--first_step_runs N` takes N pairs (medians); 0 skips the phase.

FLOPs (model FLOPs of the useful work, the same formula for every side, so FLOP/s ratios
are speed ratios): with P = parameters used in matmuls (all but the embedding table:
attention and MLP projections and the LM head; biases and norms ignored), L layers,
width d and a sequence of T positions,
    one forward of one position  = 2 P + 4 L T d          (dense attention over T keys)
    update (forward + backward)  = 3 x trained tokens x (2 P + 4 L T d)
    rollout (prefill + decoding) = B x (prompt + generated) x (2 P + 4 L T d)
where trained tokens = B x T, the positions each side runs forward + backward on (arl:
its static [B, S] buffer; TRL, tunix: prompt + completion, padded). This is the useful
work, as in MFU, not what each side executes: arl's update reads each group's prompt
once (`updates.share_group_prompt`) and skips the LM head at the prompt, and its forward
pass takes the layers' projection outputs from the rollout instead of recomputing them
(`updates.reuse_rollout_activations`, on by default here; `--arl_set
updates.reuse_rollout_activations=False` turns it off). So arl's
FLOP/s is its speed on the counted work, not the hardware's utilisation; the column
"executed of peak" gives the latter for arl: the FLOPs of the matrix products its update
program contains (`common.matmul_flops` over the step's jaxpr: its update branch, with
the shared-prompt branch that these settings take) per second of update. The update's
FLOP/s is reported against the float32 matmul peak of a large `jnp.dot` measured in this run:
the best of its measurements once the first setting's sides are ready and after each
setting (one measurement alone read 222-383 GFLOP/s in three runs within ten minutes on
the 2-core machine).

    python benchmarks/peers.py [--settings=toy,modest,multiturn] [--peers=arl,trl,tunix]
        [--rounds=15] [--first_step_runs=1] [--cache_dir=~/.cache/arl-bench-peers]
        [--record]
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import multiprocessing
import os
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position

from arl import caches  # noqa: E402
from arl import config as config_lib  # noqa: E402
from arl import envs as envs_lib  # noqa: E402
from arl.runs import process_settings  # noqa: E402
from arl.models import hf_import  # noqa: E402
from arl.models import transformer as transformer_lib  # noqa: E402
from arl.trainers import TokenTrainer  # noqa: E402

PEERS = ("arl", "trl", "tunix")
WORKER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_workers")
# What each peer's virtual environment installs (pip arguments). torch is pinned to the
# CPU wheel kept on this machine's disk: a plain `torch` requirement pulls a CUDA build
# of several GB.
REQUIREMENTS = {
    "trl": ["torch==2.13.0", "trl"],
    "tunix": ["google-tunix"],
}
LOAD_WARNING = 1.5  # 1-minute load average above which timings are flagged
# A user's own JAX compilation cache settings (arl.caches leaves them alone when set):
# no part of a measured process's start.
JAX_CACHE_ENVS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                  "JAX_COMPILATION_CACHE_MAX_SIZE")
ARL_FIRST_STEP = os.path.join(WORKER_DIR, "arl_first_step.py")
FIRST_STEP_RUNS = ("first run", "rerun")


# ------------------------------------------------------------------ arl's single-turn env
class IdCodec(envs_lib.Codec):
    """Token ids as their own text ("t5 t17 ..."): the single-turn settings' vocabulary.
    The end-of-turn id is `vocab_size`, outside the sampled range, so a turn always runs
    its whole token budget."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.pad_id = protocol.PAD_ID
        self.bos_id = protocol.BOS_ID
        self.eot_id = self.vocab_size
        self.digit_ids = np.zeros((10,), np.int32)
        self.digit_value = np.full((self.vocab_size,), -1, np.int32)

    def encode(self, text: str) -> list[int]:
        return [int(word[1:]) for word in text.split()]

    def decode(self, ids, stop_at_pad: bool = True, show_special: bool = True) -> str:
        return " ".join(f"t{int(i)}" for i in ids)


@struct.dataclass
class TargetTokenParams:
    target: jax.Array  # int32: the rewarded token id


class TargetToken(envs_lib.TokenEnvironment):
    """One turn: the prompt is `prompt_len` uniformly random ids in
    [FIRST_PROMPT_ID, vocab); the agent writes `gen_len` tokens; reward = the share of
    them equal to `params.target`. Registered as "peers_target_token"."""

    name = "peers_target_token"

    def __init__(self, vocab: int = 64, prompt_len: int = 7, gen_len: int = 16):
        self.codec = IdCodec(vocab)
        self.max_turns = 1
        self.prompt_len = int(prompt_len)
        self.obs_len = 0  # no reply after the single turn
        self.action_len = int(gen_len)

    def default_params(self) -> TargetTokenParams:
        return TargetTokenParams(target=jnp.asarray(protocol.TARGET_ID, jnp.int32))

    def reward_bounds(self, params):
        return jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32)

    def _reset(self, key, params):
        false = jnp.zeros((), bool)
        state = envs_lib.TokenEnvState(turn=jnp.zeros((), jnp.int32), terminated=false,
                                       truncated=false, success=false)
        tokens = jax.random.randint(key, (self.prompt_len,), protocol.FIRST_PROMPT_ID,
                                    self.codec.vocab_size, jnp.int32)
        return state, envs_lib.TokenChunk(tokens, jnp.asarray(self.prompt_len, jnp.int32))

    def _transition(self, key, state, content, params):
        del key
        valid = jnp.arange(content.tokens.shape[-1]) < content.length
        hits = jnp.sum((content.tokens == params.target) & valid)
        reward = hits / jnp.maximum(content.length, 1)
        state = state.replace(terminated=jnp.ones((), bool), success=reward > 0.5)
        return state, self.empty_observation(), reward.astype(jnp.float32), jnp.zeros((), bool)

    def oracle_action(self, key, state, params):
        return envs_lib.TokenChunk(jnp.full((self.action_len,), params.target, jnp.int32),
                                   jnp.asarray(self.action_len, jnp.int32))


envs_lib.register(TargetToken.name, TargetToken)


# ------------------------------------------------------------------ model and checkpoint
def model_config(setting: protocol.Setting, max_len: int) -> transformer_lib.TransformerConfig:
    return transformer_lib.TransformerConfig(
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
    path = checkpoint_path(setting, cache_dir, seed)
    if checkpoint_written(path):
        return path
    config = model_config(setting, max_len=512)
    model = transformer_lib.Transformer(config)
    params = jax.jit(lambda k: model.init(k, jnp.zeros((1, 8), jnp.int32)))(
        jax.random.key(seed))["params"]
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    hf_import.save_hf_checkpoint(tmp, params, config, model_type="qwen2")
    os.replace(tmp, path)
    return path


def matmul_params(setting: protocol.Setting) -> int:
    s = setting
    attention = s.d_model * s.head_dim * (2 * s.num_heads + 2 * s.num_kv_heads)
    mlp = 3 * s.d_model * s.mlp_dim
    return s.num_layers * (attention + mlp) + s.d_model * s.vocab


def forward_flops_per_position(setting: protocol.Setting, length: float) -> float:
    return 2 * matmul_params(setting) + 4 * setting.num_layers * length * setting.d_model


def update_flops(setting: protocol.Setting, trained_tokens: float) -> float:
    length = trained_tokens / setting.batch
    return 3 * trained_tokens * forward_flops_per_position(setting, length)


def rollout_flops(setting: protocol.Setting, context: int) -> float:
    return setting.batch * context * forward_flops_per_position(setting, context)


# ------------------------------------------------------------------------- arl runner
def arl_config(setting: protocol.Setting, checkpoint: str, overrides=None):
    """arl's config of `setting`: `default_config()` with the equal-work settings (the
    setting's env, sizes and checkpoint; GRPO without KL, one epoch of one minibatch,
    learning rate, gradient clip, every update taken) and nothing tuned for speed (the
    defaults reuse the rollout's activations, `updates.reuse_rollout_activations`
    "auto"); then `overrides` ({"section.key": value}, as on the training CLI's command
    line)."""
    c = config_lib.default_config()
    c.algorithm = "grpo"
    if setting.turns:
        c.env.name = "guess_number"
        c.env.kwargs.max_n = 16
        c.env.kwargs.max_turns = setting.turns
        # The checkpoint is weights only: the env's character codec, named explicitly.
        c.env.kwargs.codec = envs_lib.CharCodec()
    else:
        c.env.name = TargetToken.name
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


class ArlRunner:
    """arl's compiled step and its rollout alone, behind the workers' step() face."""

    name = "arl"

    def __init__(self, setting: protocol.Setting, checkpoint: str, warmup: int,
                 overrides=None):
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
        executed_update_flops = common.largest_cond_branch_flops(
            jax.make_jaxpr(self.trainer.train_step)(state), choose_inner=min)
        self.step_program, step_compile = common.compile_jitted(self.trainer.train_step,
                                                                state)
        roll = self._rollout_program()
        self.rollout_program, rollout_compile = common.compile_jitted(
            roll, self.params, jax.random.key(1))
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

    def _rollout_program(self):
        """The step's own rollout (`TokenTrainer.rollout`: the group's prompt prefilled
        once), compiled on its own."""
        trainer = self.trainer
        return jax.jit(lambda params, key: trainer.rollout(params, key, trainer.horizon(0)))

    def _run_rollout(self):
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
                    reward_mean=float(m.get("reward_mean", np.nan)))

    def close(self):
        pass


# ------------------------------------------------------------------- peer environments
def peer_python(peer: str, cache_dir: str, log) -> tuple[str | None, str]:
    """(python of the peer's virtual environment, note), creating it on first use; None
    and the reason when it cannot be installed."""
    venv = os.path.join(cache_dir, peer, "venv")
    python = os.path.join(venv, "bin", "python")
    marker = os.path.join(venv, ".arl-bench-installed")
    wanted = " ".join(REQUIREMENTS[peer])
    if os.path.isfile(marker) and open(marker, encoding="utf-8").read() == wanted:
        return python, "cached"
    log(f"[{peer}] installing {wanted} into {venv} (first use; a few minutes) ...")
    start = time.perf_counter()
    install_log = os.path.join(cache_dir, peer, "install.log")
    os.makedirs(os.path.dirname(install_log), exist_ok=True)
    with open(install_log, "w", encoding="utf-8") as f:
        for cmd in ([sys.executable, "-m", "venv", "--clear", venv],
                    [python, "-m", "pip", "install", "--quiet", *REQUIREMENTS[peer]]):
            result = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
            if result.returncode:
                return None, (f"install failed (`{' '.join(cmd[-3:])}` exit "
                              f"{result.returncode}; see {install_log})")
    with open(marker, "w", encoding="utf-8") as f:
        f.write(wanted)
    seconds = time.perf_counter() - start
    log(f"[{peer}] installed in {seconds:.0f} s")
    return python, f"installed in {seconds:.0f} s"


def child_environment(*dropped: str) -> dict:
    """A measured child process's environment: this one's without `dropped` and a
    user's JAX compilation cache settings, its output unbuffered, JAX on the CPU."""
    env = dict(os.environ)
    for name in (*dropped, *JAX_CACHE_ENVS):
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def peer_environment() -> dict:
    """A peer worker's environment: this one's, less what belongs to arl's process (its
    path, the tests' fake devices, a JAX compilation cache: a peer runs with its
    library's defaults), plus the host settings every side gets."""
    env = child_environment("PYTHONPATH", "XLA_FLAGS")
    # arl's host settings (`arl.runs.process_settings`) for every side: freed memory kept
    # mapped (mallopt, set before the worker starts) and, for a JAX peer, computations
    # inline (torch runs every op on the calling thread anyway).
    env["GLIBC_TUNABLES"] = process_settings.GLIBC_TUNABLES
    env["ARL_PEERS_INLINE_DISPATCH"] = "1"
    return env


class WorkerRunner:
    """A peer's worker process; `step()` asks for one training step and returns its
    timings. Raises RuntimeError (with the worker's one-line reason) when it fails."""

    def __init__(self, peer: str, python: str, setting: protocol.Setting, checkpoint: str,
                 warmup: int, log_path: str, timeout: float, script: str | None = None,
                 env: dict | None = None):
        self.name = peer
        self.timeout = timeout
        self._log = open(log_path, "w", encoding="utf-8")
        command = [python, script or os.path.join(WORKER_DIR, f"{peer}_worker.py"),
                   "--setting", setting.to_json(), "--checkpoint", checkpoint,
                   "--warmup", str(warmup)]
        env = peer_environment() if env is None else env
        self.launched = time.perf_counter()  # `ready_s` counts from here
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True, bufsize=1, env=env)
        self.log_path = log_path
        self.ready = None
        self.ready_s = None  # seconds from the launch to reading the "ready" line

    def wait_ready(self, timeout: float) -> dict:
        self.ready = self._expect("ready", timeout)
        self.ready_s = self._received - self.launched
        return self.ready

    def _expect(self, event: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise RuntimeError(f"no '{event}' within {timeout:.0f} s (log: {self.log_path})")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5.0))
            if not ready:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited with code {self.proc.returncode} "
                                       f"(log: {self.log_path})")
                continue
            line = self.proc.stdout.readline()
            self._received = time.perf_counter()
            if not line:
                self.proc.wait()
                raise RuntimeError(f"worker exited with code {self.proc.returncode} "
                                   f"(log: {self.log_path})")
            message = protocol.parse_event(line)
            if message is None:
                continue
            if message["event"] == "error":
                self.close()
                raise RuntimeError(f"{message['message']} (log: {self.log_path})")
            if message["event"] == event:
                return message

    def step(self) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": "step"}) + "\n")
        self.proc.stdin.flush()
        return self._expect("step", self.timeout)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# --------------------------------------------------------------------------- measuring
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


def run_setting(setting: protocol.Setting, peers, args, log, pythons, failures,
                on_ready=None) -> dict:
    """Builds every side for one setting, then interleaves `args.rounds` rounds;
    `on_ready()` runs once every side is ready, before the rounds."""
    checkpoint = write_checkpoint(setting, args.cache_dir)
    runners = []
    for peer in peers:
        if peer != "arl" and pythons.get(peer) is None:
            continue
        start = time.perf_counter()
        try:
            if peer == "arl":
                runner = ArlRunner(setting, checkpoint, args.warmup, dict(
                    [parse_override(text) for text in args.arl_set]))
            else:
                log_path = os.path.join(args.cache_dir, peer, f"worker-{setting.name}.log")
                runner = WorkerRunner(peer, pythons[peer], setting, checkpoint, args.warmup,
                                      log_path, args.step_timeout)
            runners.append(runner)
        except Exception as e:  # noqa: BLE001 - one side's failure must not stop the rest
            failures.append((setting.name, peer, f"{type(e).__name__}: {e}".splitlines()[0]))
            log(f"[{setting.name}] {peer}: could not start: {failures[-1][2]}")
            continue
        log(f"[{setting.name}] {peer}: started ({time.perf_counter() - start:.0f} s)")
    alive = []
    for runner in runners:
        if isinstance(runner, WorkerRunner):
            try:
                runner.wait_ready(args.ready_timeout)
            except RuntimeError as e:
                failures.append((setting.name, runner.name, str(e)))
                log(f"[{setting.name}] {runner.name}: failed before its first timed step: {e}")
                continue
        alive.append(runner)
        log(f"[{setting.name}] {runner.name}: ready {json.dumps(runner.ready, default=str)}")

    if on_ready is not None:
        on_ready()
    records = {r.name: [] for r in alive}
    load = {"before": common.load_average()}
    for round_index in range(args.rounds):
        for runner in list(alive):
            try:
                records[runner.name].append(runner.step())
            except Exception as e:  # noqa: BLE001 - one side's crash must not stop the rest
                failures.append((setting.name, runner.name, f"crashed in round "
                                 f"{round_index + 1}: {e}"))
                log(f"[{setting.name}] {runner.name}: {failures[-1][2]}")
                alive.remove(runner)
                runner.close()
        log(f"[{setting.name}] round {round_index + 1}/{args.rounds}: " + ", ".join(
            f"{name} {recs[-1]['step_s']:.3f} s" for name, recs in records.items() if recs))
    load["after"] = common.load_average()
    for runner in runners:
        runner.close()
    results = {}
    for runner in runners:
        recs = records.get(runner.name)
        if recs:
            results[runner.name] = summarise(setting, recs, runner.ready)
    return dict(setting=dataclasses.asdict(setting), load=load, results=results,
                checkpoint=checkpoint)


def summarise(setting: protocol.Setting, recs, ready) -> dict:
    steps = [r["step_s"] for r in recs]
    rollouts = [r["rollout_s"] for r in recs]
    step_s = statistics.median(steps)
    rollout_s = statistics.median(rollouts)
    generated = statistics.mean(r["generated_tokens"] for r in recs)
    trained = statistics.mean(r["trained_tokens"] for r in recs)
    update_s = max(step_s - rollout_s, 1e-9)
    rewards = [r["reward_mean"] for r in recs if r.get("reward_mean") is not None]
    return dict(reward_mean=statistics.mean(rewards) if rewards else float("nan"),
        step_s=step_s, step_min=min(steps), step_max=max(steps), rollout_s=rollout_s,
        update_s=update_s, generated_tokens=generated, trained_tokens=trained,
        generated_per_s=generated / step_s, trained_per_s=trained / step_s,
        update_flops=update_flops(setting, trained),
        update_flops_per_s=update_flops(setting, trained) / update_s,
        executed_flops_per_s=(ready["executed_update_flops"] / update_s
                              if ready.get("executed_update_flops") else None),
        ready=ready, rounds=recs)


# ---------------------------------------------------------- first step from launch
def arl_first_step_environment(cache: str) -> dict:
    """The arl child's environment: this process's (arl's path, the XLA flags arl's
    in-process side runs under), with arl's caches in `cache` and no JAX cache setting
    of the user's, so the trainer's `arl.caches` picks `cache`/jax as it picks the
    default cache for a user who set none (and ~/.cache/arl is never touched)."""
    env = child_environment()
    env[caches.CACHE_ENV] = cache
    env[caches.COMPILATION_CACHE_ENV] = os.path.join(cache, "jax")
    return env


def time_first_step(side: str, python: str, setting: protocol.Setting, checkpoint: str,
                    env: dict, log_path: str, timeout: float) -> dict:
    """One fresh process of `side` run up to the end of its first training step (a
    peer's worker with one warm-up step; arl's `peer_workers/arl_first_step.py`):
    `total_s`, the seconds from just before its launch to reading its "ready" line, and
    its parts (`parts`: seconds, and for arl the programs compiled and loaded)."""
    runner = WorkerRunner(side, python, setting, checkpoint, 1, log_path, timeout,
                          script=ARL_FIRST_STEP if side == "arl" else None, env=env)
    try:
        ready = runner.wait_ready(timeout)
    finally:
        runner.close()
    total = runner.ready_s
    if side != "arl":
        parts = {"to the step's start": total - ready["first_step_s"],
                 "of it building the trainer (imports included)": ready["setup_s"],
                 "first step": ready["first_step_s"]}
        return dict(total_s=total, parts=parts)
    phases = ready["phases"]
    step = phases["first step"]
    parts = {"python start": total - sum(p["wall"] for p in phases.values())}
    parts.update((name, phases[name]["wall"]) for name in
                 ("imports", "build trainer", "init state", "first step") if name in phases)
    parts.update({"trace": step["trace"], "lower": step["lower"],
                  "XLA compile or cache load": step["compile"],
                  "programs": sum(p.get("compiled", 0) for p in phases.values()),
                  "from the cache": sum(p.get("cache hits", 0) for p in phases.values())})
    return dict(total_s=total, parts=parts, reward_mean=ready["reward_mean"])


def first_step_phase(setting: protocol.Setting, sides, args, log, pythons,
                     failures) -> dict:
    """Time to the first step from launch: `args.first_step_runs` pairs of fresh
    processes per side (`time_first_step`), the sides interleaved: first run (arl's
    compilation cache an empty temporary directory), then rerun (the same directory,
    as the first run left it). {side: {"first run": s, "rerun": s (medians over the
    pairs), "parts": {run: {part: median}}, "runs": [records]}}; a side that fails is
    reported in `failures` and left out."""
    checkpoint = checkpoint_path(setting, args.cache_dir)
    sides = [side for side in sides if side == "arl" or pythons.get(side) is not None]
    records = {side: [] for side in sides}
    failed = set()
    for pair in range(args.first_step_runs):
        cache = tempfile.mkdtemp(prefix="arl-peers-first-step-")
        try:
            for run in FIRST_STEP_RUNS:
                for side in sides:
                    if side in failed:
                        continue
                    log_dir = os.path.join(args.cache_dir, side)
                    os.makedirs(log_dir, exist_ok=True)
                    log_path = os.path.join(
                        log_dir, f"first-step-{setting.name}-{run.replace(' ', '-')}.log")
                    arl = side == "arl"
                    try:
                        record = time_first_step(
                            side, sys.executable if arl else pythons[side], setting,
                            checkpoint, arl_first_step_environment(cache) if arl
                            else peer_environment(), log_path, args.ready_timeout)
                    except (RuntimeError, KeyError) as e:
                        failed.add(side)
                        failures.append((setting.name, side,
                                         f"first step from launch ({run}): {e}"))
                        log(f"[{setting.name}] {side}: {failures[-1][2]}")
                        continue
                    record.update(run=run, pair=pair, load=common.load_average())
                    if arl:  # the cache the rerun finds
                        record["cache_files"] = sum(
                            len(files) for _, _, files in os.walk(os.path.join(cache, "jax")))
                    records[side].append(record)
                    log(f"[{setting.name}] first step from launch, {run}: {side} "
                        f"{record['total_s']:.1f} s " + json.dumps(
                            {k: round(v, 2) for k, v in record["parts"].items()}))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    out = {}
    for side, recs in records.items():
        if side in failed or not recs:
            continue
        out[side] = {"runs": recs, "parts": {}}
        for run in FIRST_STEP_RUNS:
            mine = [r for r in recs if r["run"] == run]
            out[side][run] = statistics.median(r["total_s"] for r in mine)
            out[side]["parts"][run] = {key: statistics.median(r["parts"][key] for r in mine)
                                       for key in mine[0]["parts"]}
    return out


FIRST_STEP_PROSE = (
    "First step from launch: wall seconds from launching a fresh Python process to the "
    "end of its first training step, timed by this script around the process (so the "
    "interpreter's start, every import, building the trainer and loading the checkpoint "
    "count on every side): arl as a notebook's first cell (`TokenTrainer(arl_config(...))"
    "`, `init_state()`, one `train_step` compiled at its call, its reward read on the "
    "host), TRL and tunix their workers up to the end of their first step. Run after "
    "the setting's rounds with nothing else running, the sides interleaved: first run "
    "with arl's persistent compilation cache in an empty directory, then a rerun with "
    "that directory as the first run left it (TRL and tunix as their libraries come: no "
    "persistent compilation cache). Python's bytecode and the OS's file cache are warm "
    "on every side (each side's libraries were just loaded for the rounds).")


def first_step_cell(first_steps, name: str) -> str:
    if first_steps is None:
        return "not run"
    side = first_steps.get(name)
    return "n/a" if side is None else f"{side['first run']:.1f} / {side['rerun']:.1f}"


def first_step_details(first_steps) -> str:
    """The parts of each side's time to the first step, first run / rerun, as prose."""
    if not first_steps:
        return ""

    def pair(part, values, digits):
        return f"{part} " + " / ".join(f"{values[run][part]:.{digits}f}"
                                      for run in FIRST_STEP_RUNS)

    sides = []
    for name, side in first_steps.items():
        values = side["parts"]
        if name == "arl":
            steps = ", ".join(pair(p, values, 1) for p in (
                "trace", "lower", "XLA compile or cache load"))
            main = ", ".join(pair(p, values, 1) for p in (
                "python start", "imports", "build trainer", "init state", "first step")
                if p in values[FIRST_STEP_RUNS[0]])
            text = (f"{main} (of it {steps}); {pair('programs', values, 0)}, "
                    f"{pair('from the cache', values, 0)}")
        else:
            text = ", ".join(pair(p, values, 1) for p in values[FIRST_STEP_RUNS[0]])
        sides.append(f"{name}: {text}")
    return ("First step from launch, its parts (s, first run / rerun; medians over "
            f"{len(next(iter(first_steps.values()))['runs']) // len(FIRST_STEP_RUNS)} "
            "pair(s) of runs): " + "; ".join(sides) + ".")


def table(result: dict, peak: float) -> str:
    rows = []
    for name, r in result["results"].items():
        rows.append((
            name, f"{r['step_s']:.3f}", f"{r['step_min']:.3f}-{r['step_max']:.3f}",
            f"{r['rollout_s']:.3f}", f"{r['update_s']:.3f}",
            common.fmt_rate(r["generated_per_s"]), common.fmt_rate(r["trained_per_s"]),
            f"{r['update_flops_per_s'] / 1e9:.2f}",
            f"{100 * r['update_flops_per_s'] / peak:.1f}%",
            ("n/a" if r.get("executed_flops_per_s") is None
             else f"{100 * r['executed_flops_per_s'] / peak:.1f}%"),
            first_step_cell(result.get("first_step"), name),
            f"{r['reward_mean']:.3f}"))
    return common.markdown_table(
        ["side", "s/step (median)", "min-max", "rollout s", "update s", "generated tok/s",
         "trained tok/s", "update GFLOP/s", "of peak", "executed of peak",
         "first step from launch (s): first run / rerun",
         "reward mean"],
        rows)


def setting_line(s: protocol.Setting) -> str:
    model = (f"{s.num_layers} layers, d {s.d_model}, MLP {s.mlp_dim}, vocab {s.vocab}, "
             f"{s.num_heads} heads / {s.num_kv_heads} KV heads, q/k/v biases")
    if s.turns:
        work = (f"guess_number (max_n 16), {s.turns} turns of up to {s.gen_len} tokens; "
                f"{s.num_prompts} prompts x {s.group_size} samples")
    else:
        work = (f"{s.num_prompts} prompts x {s.group_size} samples, {s.prompt_len} prompt + "
                f"{s.gen_len} generated tokens")
    return f"**{s.name}**: {model}; {work}"


def versions_line(results) -> str:
    parts = [f"JAX {jax.__version__} (arl)"]
    for run in results:
        for name, r in run["results"].items():
            v = r["ready"].get("versions")
            if v:
                parts.append(f"{name}: " + ", ".join(f"{k} {x}" for k, x in v.items()))
    return "; ".join(dict.fromkeys(parts))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="toy,modest,multiturn",
                        help=f"comma-separated, from {sorted(protocol.SETTINGS)}")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated, from {PEERS}")
    # 15: the records of 2026-12-02 used 15; a median of 5 moves with one or two slow
    # rounds (the machine's speed also drifts between runs, which no round count removes).
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps on every side before the rounds (>= 1)")
    parser.add_argument("--cache_dir", "--cache-dir",
                        default=os.path.expanduser("~/.cache/arl-bench-peers"),
                        help="where the peers' virtual environments, the shared "
                             "checkpoints and the workers' logs live")
    parser.add_argument("--peak_size", "--peak-size", type=int, default=1024,
                        help="side of the square float32 matmul that measures the peak")
    parser.add_argument("--ready_timeout", "--ready-timeout", type=float, default=900.0,
                        help="seconds a worker may take to build and warm up")
    parser.add_argument("--step_timeout", "--step-timeout", type=float, default=600.0,
                        help="seconds one timed step may take")
    parser.add_argument("--arl_set", "--arl-set", action="append", default=[],
                        metavar="KEY=VALUE", help="a config override of arl's side, e.g. "
                        "updates.reuse_rollout_activations=False (repeatable)")
    parser.add_argument("--first_step_runs", "--first-step-runs", type=int, default=1,
                        help="pairs of fresh processes per side and setting timed from "
                             "launch to the end of their first step (first run with an "
                             "empty arl compilation cache, rerun with it filled), after "
                             "the setting's rounds; 0 skips them")
    parser.add_argument("--record", action="store_true",
                        help="write the tables as the Peers section of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    settings = protocol.setting_names(parser, args.settings)
    peers = [p for p in args.peers.split(",") if p]
    if not peers or any(p not in PEERS for p in peers):
        parser.error(f"--peers: {args.peers!r}; allowed values are {PEERS}")
    if args.rounds < 1 or args.warmup < 1:
        parser.error("--rounds and --warmup must be >= 1")
    if args.first_step_runs < 0:
        parser.error(f"--first_step_runs: {args.first_step_runs}; must be >= 0 (0 skips "
                     "the time to the first step)")
    args.cache_dir = os.path.abspath(os.path.expanduser(args.cache_dir))
    os.makedirs(args.cache_dir, exist_ok=True)

    def log(text):
        print(text, flush=True)

    # arl's side is built as a notebook builds it: `arl.setup()` first, before any use
    # of JAX in this process (the library's host settings, `arl.runs.process_settings`);
    # the checkpoints are written by a child process, and the machine line and the
    # first peak measurement wait for the first setting's trainers. The peers get the
    # same settings from their environment (WorkerRunner).
    process_settings.setup()
    write_checkpoints([protocol.SETTINGS[name] for name in settings], args.cache_dir)
    load_start = common.load_average()
    if load_start > LOAD_WARNING:
        log(f"WARNING: 1-minute load average {load_start:.2f} > {LOAD_WARNING}: other jobs "
            "share this machine; read the ratios of the interleaved rounds, not the times")
    failures = []
    pythons = {}
    install_notes = {}
    for peer in peers:
        if peer == "arl":
            continue
        pythons[peer], install_notes[peer] = peer_python(peer, args.cache_dir, log)
        if pythons[peer] is None:
            failures.append(("all", peer, install_notes[peer]))
            log(f"[{peer}] skipped: {install_notes[peer]}")

    peaks = []

    def measure_peak():
        peaks.append(common.matmul_peak_flops(args.peak_size, repeats=10))
        log(f"float32 matmul peak ({args.peak_size}^2 jnp.dot): {peaks[-1] / 1e9:.1f} GFLOP/s"
            f" (best so far {max(peaks) / 1e9:.1f})")

    def first_ready():
        log(f"machine: {common.machine_line()}")
        measure_peak()

    results = []
    for name in settings:
        setting = protocol.SETTINGS[name]
        log(f"== {setting_line(setting)}")
        result = run_setting(setting, peers, args, log, pythons, failures,
                             on_ready=None if results else first_ready)
        results.append(result)
        measure_peak()
        if args.first_step_runs:
            load = common.load_average()
            result["first_step"] = first_step_phase(setting, peers, args, log, pythons,
                                                    failures)
            result["first_step_load"] = (load, common.load_average())
        else:
            result["first_step"] = None
        log(table(result, max(peaks)))
        if result["first_step"]:
            log(first_step_details(result["first_step"]))
    peak = max(peaks)
    load_end = common.load_average()
    inline, kept = process_settings.applied()
    allocator_line = (
        f"arl: the library's defaults as `arl.setup()` applies them (`arl.runs.process_settings`"
        f": computations {'inline' if inline else 'dispatched asynchronously'}, freed "
        f"memory {'kept mapped' if kept else 'returned (glibc defaults)'}); the peers: "
        f"freed memory kept mapped (GLIBC_TUNABLES={process_settings.GLIBC_TUNABLES}) and JAX "
        f"computations inline (tunix; torch runs inline)")
    log(f"allocator: {allocator_line}")
    arl_line = ("`default_config()` with the equal-work settings only (`arl_config`), "
                "built by `TokenTrainer` as in a notebook")
    if args.arl_set:
        arl_line += f", overridden by {', '.join(args.arl_set)} (not the defaults)"

    blocks = []
    for result in results:
        details = first_step_details(result["first_step"])
        if details:
            before, after = result["first_step_load"]
            details = f"\n{details} Load {before:.2f} -> {after:.2f}.\n"
        blocks.append(f"{setting_line(protocol.SETTINGS[result['setting']['name']])} "
                      f"(load {result['load']['before']:.2f} -> {result['load']['after']:.2f})"
                      f"\n\n{table(result, peak)}\n{details}")
    def without_log(reason):  # the recorded text names no machine paths
        return re.sub(r" [(]log: [^)]*[)]", "", reason)

    failure_lines = "".join(f"- {setting} / {peer}: {without_log(reason)}\n"
                            for setting, peer, reason in failures)
    loaded = max(load_start, load_end) > LOAD_WARNING
    environments = ", ".join(f"{k} {v}" for k, v in install_notes.items()) or "none"
    text = (common.heading("peers.py")
            + f"1-minute load average {load_start:.2f} at the "
            f"start, {load_end:.2f} at the end"
            f"{f' (ABOVE {LOAD_WARNING}: other jobs were running)' if loaded else ''}. "
            f"Versions: {versions_line(results)}. Peer environments: {environments}.\n\n"
            f"arl's configuration: {arl_line}.\n\n"
            f"Median of {args.rounds} interleaved rounds after {args.warmup} warm-up steps per "
            f"side; TRL's torch threads: one per core; host allocator: {allocator_line}; "
            f"rollout = generation alone (arl: its "
            f"rollout compiled on its own), update = step - rollout. FLOP/s: model FLOPs of "
            f"the update (3 x trained tokens x (2 x matmul params + 4 x layers x length x d)) "
            f"/ update time, against the float32 matmul peak of {peak / 1e9:.1f} GFLOP/s, "
            f"the best of {len(peaks)} measurements in this run (once the first setting's "
            f"sides were ready and after each setting: "
            f"{min(peaks) / 1e9:.0f}-{peak / 1e9:.0f}); executed of peak (arl): the "
            f"matmul FLOPs its update program contains (the reused forward products and the "
            f"groups' repeated prompts are not in it) / update time. {FIRST_STEP_PROSE}\n\n"
            + "\n".join(blocks)
            + (f"\nNot compared:\n\n{failure_lines}" if failures else ""))
    common.publish("Peers: arl vs TRL vs tunix, equal-work GRPO step", text, args.record)
    return dict(results=results, failures=failures, peak=peak, load=(load_start, load_end),
                text=text)


if __name__ == "__main__":
    main()
