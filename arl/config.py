"""The experiment configuration: defaults for every key, and validation before tracing.

A config is an `ml_collections.ConfigDict`. `configs/<experiment>.py` files start from
`default_config()` and override what they need; `validate(config)` rejects inconsistent
settings with a one-line error naming the field and the allowed values, before anything
is compiled: keys that are not in `default_config()` (with the closest valid key),
numbers that are not finite or out of range, names that are not registered, environment
constructor arguments and params the environment refuses, and settings the environment
cannot serve (a horizon beyond its `max_turns`, demonstrations it has no demonstrator
for).

`config.imports` names modules imported first (by `validate` and by everything that
builds from a config), so environments and algorithms registered by a user's own module
work in configs, on resume and in `experiments.evaluate`: the key is stored with every
checkpoint's config.
"""

from __future__ import annotations

import importlib
import math
import os
from typing import Any

import jax
import ml_collections

from arl import algorithms as alg
from arl import envs as envs_lib
from arl.envs.registry import GYMNAX_PREFIX
from arl.errors import ConfigError, closest, did_you_mean, invalid_field, one_line
from arl.models import lora as lora_lib
from arl.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from arl.models.mlp import ACTIVATIONS
from arl.optim import LR_SCHEDULES
from arl.rollout.branching import ESTIMATES as MC_ESTIMATES
from arl.rollout.turns import SCRIPTED_SOURCES as SFT_SOURCES
from arl.sharding import MESH_AXES

FLOAT_DTYPES = ("float32", "bfloat16")  # model.dtype and model.param_dtype
MINIBATCH_SHUFFLES = ("rows", "groups")  # updates.shuffle


def default_config() -> ml_collections.ConfigDict:
    """Every key a token-environment experiment reads, with its default."""
    c = ml_collections.ConfigDict()
    c.algorithm = "grpo"
    c.seed = 0
    c.train_steps = 100
    c.log_every = 5
    c.checkpoint_every = 50
    c.keep_checkpoints = 3
    c.sample_every = 25  # write rendered sample trajectories every N steps
    c.mesh = (1, 1, 1)  # (data, fsdp, tensor); product must not exceed the device count
    # Modules imported before the config is validated or used, e.g. ("my_pkg.my_envs",):
    # one that calls `arl.envs.register` (or `arl.algorithms.register_algorithm`) makes
    # its names valid in `env.name` / `algorithm`. Stored with the checkpoints' config, so
    # resuming and `experiments.evaluate` import them too. Must be importable (installed,
    # or on PYTHONPATH / the working directory).
    c.imports = ()
    # Constrain the model's activations to the mesh (arl.models.partitioning
    # ACTIVATION_AXIS_RULES: batch over data x fsdp, heads and MLP width over tensor):
    # FSDP and tensor-parallel layouts then compile without XLA resharding the residual
    # stream ("involuntary full rematerialization"). No effect on a one-device mesh; on
    # larger meshes the numbers move at float rounding level (another partitioning).
    c.activation_sharding = False

    c.env = ml_collections.ConfigDict()
    c.env.name = "guess_number"
    c.env.kwargs = ml_collections.ConfigDict()
    # Overrides of the environment's default params (data, e.g. bandit high_prob); not
    # for mixtures, whose members take constructor kwargs.
    c.env.params = ml_collections.ConfigDict()
    # For name == "mixture": a list of {"name": ..., "kwargs": {...}} members.
    c.env.members = ()

    c.rollout = ml_collections.ConfigDict()
    c.rollout.num_tasks = 16  # distinct tasks per step
    c.rollout.group_size = 8  # samples per task (GRPO group)
    c.rollout.temperature = 1.0
    c.rollout.top_k = 0
    c.rollout.top_p = 1.0
    # ScalingInter-RL horizon curriculum: h = rounds[min(step // every, len - 1)];
    # empty rounds means the environment's max_turns throughout.
    c.rollout.horizon_rounds = ()
    c.rollout.horizon_every = 100
    # Asynchronous rollouts (docs/async.md): rollout t+1 runs while update t trains, on
    # parameters policy_lag versions old (0 with an empty mesh: the fused one-program
    # step). mesh: () = on config.mesh's devices; else (data, fsdp, tensor) over the next
    # devices after the training mesh's (disaggregated).
    c.rollout.policy_lag = 0
    c.rollout.mesh = ()

    c.model = ml_collections.ConfigDict()
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 4
    c.model.mlp_dim = 256
    c.model.rope_theta = 10000.0
    c.model.tie_embeddings = False
    # Projection biases of a fresh model: q/k/v (Qwen2), o_proj (with qkv_bias: HF Llama's
    # attention_bias), the MLP's (HF Llama's mlp_bias). A checkpoint brings its own.
    c.model.qkv_bias = False
    c.model.o_bias = False
    c.model.mlp_bias = False
    # Layers per iteration of the layer loop of the training forward and backward passes
    # (KV-cached decoding always loops over one layer at a time); 0 = all of them (no
    # loop). Unrolled, the default 2-layer model's gradient ran about 1.2x faster on CPU;
    # at 8 layers it gained little and compiled slower (docs/performance.md, "Attention
    # and the update"), so set 1 for deep checkpoints.
    c.model.layer_unroll = 0
    # Activation dtype, "float32" or "bfloat16" (attention softmax, log-probs and losses
    # stay float32).
    c.model.dtype = "float32"
    # Parameter dtype, "float32" or "bfloat16" (a checkpoint is cast to it). With
    # bfloat16 parameters the optimizer keeps float32 master weights and float32 Adam
    # moments (arl.optim.float32_master_weights): an RL-sized update is far below half a
    # bfloat16 ulp of a weight and would otherwise round away.
    c.model.param_dtype = "float32"
    # Rematerialise each decoder layer in the backward pass: only the residual stream
    # between layers is kept, the rest of a layer is recomputed (real model sizes).
    c.model.remat = False
    # Vocabulary of a fresh model; 0 = the env codec's. Larger than the codec's (e.g. a
    # real model's 151936) gives the real embedding and logits sizes: the codec's ids are
    # a subset, and ids it does not know are unparseable agent output to the env.
    c.model.vocab_size = 0
    c.model.norm_eps = 1e-6  # RMSNorm epsilon of a fresh model (Llama 3: 1e-5)
    # > 0: training log-probs/entropies come from the final hidden states in chunks of
    # this many positions (arl.models.logprobs), never the full [B, T, V] logits.
    c.model.logprob_chunk = 0
    # Self-attention: "dense" ([B, H, T, T] scores), "blocked" (FlashAttention-style
    # tiling in JAX, memory linear in the context, any backend), "cudnn" (cuDNN's fused
    # kernel, NVIDIA GPUs; cached decoding stays dense), "auto" = dense up to
    # attention_block tokens and blocked beyond (docs/performance.md, "Attention and the
    # update"). For KV-cached decoding the length is the cache's capacity: blocked
    # decoding reads only the cache blocks up to the last query (same section).
    c.model.attention = "auto"
    c.model.attention_block = 512
    # Path of a Hugging Face Llama/Qwen2 checkpoint directory (config.json + safetensors)
    # to start from; its config.json then replaces the architecture fields above (d_model,
    # num_layers, num_heads, num_kv_heads, mlp_dim, rope_theta, tie_embeddings). "" = a
    # randomly initialised model. Its vocabulary must cover the env codec's ids.
    c.model.hf_checkpoint = ""
    # LoRA (arl.models.lora): rank > 0 trains low-rank adapters W + (alpha/rank) A B on
    # the `lora_targets` projections of a frozen base (the checkpoint's or the fresh
    # init's weights); the KL reference is the base itself. 0 = full fine-tuning.
    c.model.lora_rank = 0
    c.model.lora_alpha = 16.0
    c.model.lora_targets = ("q_proj", "v_proj")

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-3
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.99
    c.optim.eps = 1e-8  # Adam's epsilon
    c.optim.weight_decay = 0.0
    c.optim.max_grad_norm = 1.0

    c.updates = ml_collections.ConfigDict()
    c.updates.epochs = 1
    c.updates.minibatches = 1
    # Token trainer: read each group's shared prompt once in the update (with one
    # minibatch, or with minibatches of whole groups).
    c.updates.share_group_prompt = True
    # How an epoch deals rows into minibatches: "rows" shuffles the rows; "groups" (token
    # trainer) shuffles whole groups, so each minibatch holds complete groups.
    c.updates.shuffle = "rows"
    # Token trainer: the update's forward pass takes every layer's projection outputs
    # from the rollout (recorded while decoding at the same parameters) instead of
    # recomputing them; needs epochs = minibatches = 1 (the only update step at the
    # rollout's parameters). Memory: layers x rows x context x the projections' widths.
    c.updates.reuse_rollout_activations = False

    c.advantage = ml_collections.ConfigDict()
    c.advantage.gamma = 1.0
    c.advantage.lam = 1.0
    c.advantage.turn_level = False  # PPO: bi-level (turn, then token) GAE
    c.advantage.turn_gamma = 1.0
    c.advantage.eps = 1e-6
    c.advantage.whiten = False  # PPO: whiten GAE advantages over agent tokens
    c.advantage.erpo_centre_on_env_mean = False

    c.loss = ml_collections.ConfigDict()
    c.loss.clip_low = 0.2
    c.loss.clip_high = 0.2
    c.loss.dual_clip = 0.0  # 0 disables; e.g. 3.0
    c.loss.agg = "token-mean"
    c.loss.norm = 0.0  # constant N for seq-mean-token-sum-norm; 0 = the context length
    c.loss.value_coef = 0.5
    c.loss.value_clip = 0.0  # 0 disables
    c.loss.entropy_coef = 0.0
    c.loss.kl_coef = 0.0
    c.loss.kl_kind = "k3"
    c.loss.kl_in_reward = False
    c.loss.echo_coef = 0.0  # ECHO: cross-entropy on environment observation tokens
    c.loss.sft_coef = 0.0  # RL + alpha * SFT on demonstrations
    c.loss.sft_coef_final = -1.0  # < 0: constant sft_coef; else linear decay to this value
    c.loss.sft_hold_steps = 0
    c.loss.sft_decay_steps = 100
    c.loss.sft_source = "demonstrator"
    # Path of a demonstration set written by `arl.data.build_demonstrations`; empty
    # means demonstrations are generated on the fly by `sft_source` inside the step.
    c.loss.sft_dataset = ""
    # Off-policy correction (arl.algorithms.off_policy): "none" (synchronous), "bypass",
    # "tis", "icepop", "decoupled"; the weight's level (decoupled), cap C (tis,
    # decoupled) and icepop's [low, high].
    c.loss.off_policy_correction = "none"
    c.loss.off_policy_level = "token"
    c.loss.off_policy_cap = 2.0
    c.loss.off_policy_low = 0.5
    c.loss.off_policy_high = 2.0

    # Behaviour-cloning warm start (arl.trainers.warm_start): before RL, a fresh run trains the
    # model for sft_steps on scripted demonstrations from sft_source ("" = loss.sft_source;
    # "demonstrator": the env's weaker demonstrator), sft_batch fresh ones per step (0 =
    # the RL batch num_tasks*group_size), AdamW at sft_lr (0 = optim.learning_rate). RL
    # then starts from those weights (the KL reference too; under LoRA they are the
    # frozen base). 0 steps = RL from the initial model. Token environments only.
    c.warm_start = ml_collections.ConfigDict()
    c.warm_start.sft_steps = 0
    c.warm_start.sft_batch = 0
    c.warm_start.sft_lr = 0.0
    c.warm_start.sft_source = ""

    # Vector environments (algorithm "ppo_vector", e.g. env.name "gymnax:CartPole-v1").
    c.vector = ml_collections.ConfigDict()
    c.vector.num_envs = 4
    c.vector.num_steps = 128
    c.vector.hidden_sizes = (64, 64)
    c.vector.activation = "tanh"
    # Per-minibatch diagnostics besides the losses and the entropy: policy clip fractions,
    # approximate KL, ratio range, value clip fraction, explained variance, gradient norm.
    # False logs only the losses and the entropy (as PureJaxRL does), which makes a small
    # update a few percent cheaper on CPU.
    c.vector.diagnostics = True

    # Credit assignment inside an episode (arl.algorithms.process, arl.rollout.branching).
    c.process = ml_collections.ConfigDict()
    c.process.outcome_weight = 1.0  # weight of the environment's reward
    c.process.reward_weight = 0.0  # weight of the env's per-turn `info["process_reward"]`
    c.process.turn_gamma = 1.0  # per-turn discount of process returns and MC values
    # Monte Carlo values by forking the env state (algorithm "vineppo", and the labels of
    # the process reward model): continuations per branch point, the turns to branch
    # before (() = every turn 1 .. max_turns-1; turn 0's value is the group's
    # leave-one-out mean return when group_size >= 2) and the estimate.
    c.process.mc_samples = 0
    c.process.branch_turns = ()
    c.process.mc_estimate = "mean_return"
    # A learned process reward model (PRM): a value-head transformer trained by binary
    # cross-entropy on the Monte Carlo success fractions (needs mc_samples >= 1); with
    # prm_weight > 0 its score differences phi(s_k+1) - phi(s_k) are a dense turn reward.
    c.process.train_prm = False
    c.process.prm_weight = 0.0
    c.process.prm_learning_rate = 1e-3
    # PRIME implicit process rewards r_t = beta * log(pi_phi / pi_ref) per token, from an
    # implicit PRM pi_phi trained on the outcome (success) with cross-entropy; 0 = off.
    c.process.implicit_coef = 0.0
    c.process.implicit_weight = 1.0

    c.filters = ml_collections.ConfigDict()
    c.filters.starpo_keep_fraction = 1.0  # < 1 keeps the top fraction of groups by std
    c.filters.dapo_zero_variance = False
    c.filters.skip_zero_advantage = True
    return c


# Sections whose keys the schema does not fix: the environment's constructor arguments
# and params (checked against the environment itself) and the mixture members.
FREE_FORM_SECTIONS = ("env.kwargs", "env.params", "env.members")


def _fail(field: str, value: Any, allowed: str) -> None:
    raise invalid_field(field, value, allowed)


def import_modules(config: ml_collections.ConfigDict) -> None:
    """Imports the modules of `config.imports` (idempotent), so the names they register
    are known; a module that cannot be imported is a `ConfigError`."""
    modules = config.get("imports", ()) or ()
    if isinstance(modules, str) or not isinstance(modules, (tuple, list)) or any(
            not isinstance(m, str) or not m for m in modules):
        _fail("imports", modules, "expected a tuple of module names, e.g. ('my_pkg.my_envs',)")
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as error:
            _fail("imports", tuple(modules), f"importing {name!r} failed: {one_line(error)} "
                  "(the module must be installed or on PYTHONPATH)")


def check_known_keys(config: ml_collections.ConfigDict) -> None:
    """Every key of `config` must be a key of `default_config()` (a misspelt key would
    otherwise be silently ignored), except inside `FREE_FORM_SECTIONS`; every number must
    be finite. The error names the closest valid key."""
    _check_section(config, default_config(), "")


def unknown_key_error(path: str, value: Any = None) -> ConfigError:
    """The `ConfigError` for `config.<path>`, which is not a config key."""
    shown = "" if value is None or isinstance(value, ml_collections.ConfigDict) \
        else f"={value!r}"
    suggestion = _closest_key(path, default_config())
    hint = f" (did you mean config.{suggestion}?)" if suggestion else ""
    return ConfigError(f"config.{path}{shown} is invalid: not a config key{hint}; every key "
                       "and its default is in arl.config.default_config().")


def check_key_path(path: str) -> None:
    """`ConfigError` unless `config.<path>` can exist: a key of the schema or a key inside
    a free-form section (`env.kwargs.<name>`, `env.params.<name>`)."""
    node, parts = default_config(), path.split(".")
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i + 1])
        if prefix in FREE_FORM_SECTIONS:
            return
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            raise unknown_key_error(path)
        node = node[part]


def _check_section(section, schema, prefix: str) -> None:
    for key in section.keys():
        path, value = prefix + key, section[key]
        if key not in schema:
            while isinstance(value, ml_collections.ConfigDict) and len(value):
                inner = next(iter(value.keys()))  # name a whole leaf path: optimm.lr
                path, value = f"{path}.{inner}", value[inner]
            raise unknown_key_error(path, value)
        if path in FREE_FORM_SECTIONS:
            continue
        expected = schema[key]
        if isinstance(expected, ml_collections.ConfigDict):
            if not isinstance(value, ml_collections.ConfigDict):
                _fail(path, value, "expected a section of keys (a ConfigDict)")
            _check_section(value, expected, path + ".")
        else:
            _check_finite(path, value)


def _check_finite(path: str, value: Any) -> None:
    """inf and NaN, alone or inside a tuple, are never a valid setting."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    if any(isinstance(v, float) and not math.isfinite(v) for v in items):
        _fail(path, value, "expected a finite number")


def _key_paths(schema, prefix: str = "") -> list[str]:
    out = []
    for key in schema.keys():
        out.append(prefix + key)
        if isinstance(schema[key], ml_collections.ConfigDict):
            out.extend(_key_paths(schema[key], f"{prefix}{key}."))
    return out


def _closest_key(path: str, schema) -> str | None:
    """The valid key a misspelt `path` most likely meant: a close sibling
    (trian_steps -> train_steps), the same name in another section (learning_rate ->
    optim.learning_rate), or the closest whole path."""
    paths = _key_paths(schema)
    parent, _, leaf = path.rpartition(".")
    node = schema
    for part in parent.split(".") if parent else ():
        node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
    if isinstance(node, ml_collections.ConfigDict):
        match = closest(leaf, node.keys())
        if match:
            return f"{parent}.{match}" if parent else match
    same_name = [p for p in paths if p.rpartition(".")[2] == leaf]
    if same_name:
        return same_name[0]
    return closest(path, paths)


def _check_range(config, field, low=None, high=None, *, low_open=False, integer=False):
    node = config
    for part in field.split("."):
        node = node[part]
    value = node
    if integer and (not isinstance(value, int) or isinstance(value, bool)):
        _fail(field, value, "expected an integer")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        _fail(field, value, "expected a number")
    if not math.isfinite(value):
        _fail(field, value, "expected a finite number")
    if low is not None and (value <= low if low_open else value < low):
        _fail(field, value, f"must be {'>' if low_open else '>='} {low}")
    if high is not None and value > high:
        _fail(field, value, f"must be <= {high}")


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None,
             workdir: str | None = None) -> None:
    """Rejects inconsistent settings with a `ConfigError` naming the field.

    Imports `config.imports` first (so the names they register are valid). Builds the
    token environment (cheap, no compilation) to check its constructor arguments,
    params overrides, `max_turns` and scripted policies against the config."""
    import_modules(config)
    check_known_keys(config)
    algorithm = alg.get_algorithm(config.algorithm)
    _check_range(config, "train_steps", 1, integer=True)
    _check_range(config, "log_every", 1, integer=True)
    _check_range(config, "checkpoint_every", 1, integer=True)
    _check_range(config, "keep_checkpoints", 1, integer=True)
    _check_range(config, "seed", 0, integer=True)
    _check_range(config, "sample_every", 0, integer=True)

    mesh = tuple(config.mesh)
    if not isinstance(config.get("activation_sharding", False), bool):
        _fail("activation_sharding", config.get("activation_sharding"),
              "allowed values are (True, False)")
    if len(mesh) != 3 or any(not isinstance(m, int) or m < 1 for m in mesh):
        _fail("mesh", mesh, f"expected three positive integers for axes {MESH_AXES}")
    if num_devices is not None and math.prod(mesh) > num_devices:
        _fail("mesh", mesh, f"needs {math.prod(mesh)} devices but only {num_devices} exist")

    _check_range(config, "optim.learning_rate", 0.0, low_open=True)
    if config.optim.schedule not in LR_SCHEDULES:
        _fail("optim.schedule", config.optim.schedule, f"allowed values are {LR_SCHEDULES}")
    _check_range(config, "optim.warmup_steps", 0, integer=True)
    _check_range(config, "optim.max_grad_norm", 0.0)
    _check_range(config, "optim.b1", 0.0, 1.0)
    _check_range(config, "optim.b2", 0.0, 1.0)
    _check_range(config, "optim.eps", 0.0, low_open=True)
    _check_range(config, "optim.weight_decay", 0.0)

    _check_range(config, "loss.clip_low", 0.0, 1.0, low_open=True)
    _check_range(config, "loss.clip_high", 0.0, low_open=True)
    if config.loss.dual_clip != 0.0:
        _check_range(config, "loss.dual_clip", 1.0, low_open=True)
    if config.loss.agg not in alg.AGGREGATIONS:
        _fail("loss.agg", config.loss.agg, f"allowed values are {alg.AGGREGATIONS}")
    if config.loss.norm and config.loss.agg != "seq-mean-token-sum-norm":
        _fail("loss.norm", config.loss.norm,
              "a constant normaliser only applies to loss.agg='seq-mean-token-sum-norm'")
    if config.loss.kl_kind not in alg.KL_KINDS:
        _fail("loss.kl_kind", config.loss.kl_kind, f"allowed values are {alg.KL_KINDS}")
    for field in ("value_coef", "value_clip", "entropy_coef", "kl_coef", "echo_coef",
                  "sft_coef", "norm"):
        _check_range(config, f"loss.{field}", 0.0)
    if config.loss.sft_source not in SFT_SOURCES:
        _fail("loss.sft_source", config.loss.sft_source, f"allowed values are {SFT_SOURCES}")
    sft_dataset = config.loss.get("sft_dataset", "")
    if not isinstance(sft_dataset, str):
        _fail("loss.sft_dataset", sft_dataset, "expected a path (str); empty = on the fly")
    if sft_dataset and not os.path.isdir(sft_dataset):
        _fail("loss.sft_dataset", sft_dataset,
              "no such directory; write one with arl.data.build_demonstrations")

    _validate_warm_start(config, algorithm)

    _check_range(config, "loss.sft_hold_steps", 0, integer=True)
    _check_range(config, "loss.sft_decay_steps", 1, integer=True)
    _check_range(config, "advantage.gamma", 0.0, 1.0)
    _check_range(config, "advantage.lam", 0.0, 1.0)
    _check_range(config, "advantage.turn_gamma", 0.0, 1.0)
    _check_range(config, "advantage.eps", 0.0, low_open=True)
    _check_range(config, "filters.starpo_keep_fraction", 0.0, 1.0, low_open=True)

    _check_range(config, "updates.epochs", 1, integer=True)
    _check_range(config, "updates.minibatches", 1, integer=True)
    if not isinstance(config.updates.get("share_group_prompt", True), bool):
        _fail("updates.share_group_prompt", config.updates.get("share_group_prompt"),
              "allowed values are (True, False)")
    if config.updates.get("shuffle", "rows") not in MINIBATCH_SHUFFLES:
        _fail("updates.shuffle", config.updates.get("shuffle"),
              f"allowed values are {MINIBATCH_SHUFFLES}")
    reuse = config.updates.get("reuse_rollout_activations", False)
    if not isinstance(reuse, bool):
        _fail("updates.reuse_rollout_activations", reuse, "allowed values are (True, False)")
    if reuse and (config.updates.epochs != 1 or config.updates.minibatches != 1):
        _fail("updates.reuse_rollout_activations", reuse,
              f"needs updates.epochs = 1 and updates.minibatches = 1 (the one update step "
              f"at the rollout's parameters), got epochs={config.updates.epochs}, "
              f"minibatches={config.updates.minibatches}")

    _validate_off_policy(config, mesh, num_devices, algorithm)
    if algorithm.trainer == "vector":
        _validate_vector(config)
    else:
        _validate_token_rollout(config, mesh, algorithm)
        _validate_process(config)
        if algorithm.validate is not None:
            algorithm.validate(config)
    if workdir is not None:
        _validate_workdir(workdir)


def _validate_warm_start(config, algorithm: alg.Algorithm) -> None:
    ws = config.get("warm_start")
    if ws is None:
        return
    _check_range(config, "warm_start.sft_steps", 0, integer=True)
    _check_range(config, "warm_start.sft_batch", 0, integer=True)
    _check_range(config, "warm_start.sft_lr", 0.0)
    if ws.sft_source not in SFT_SOURCES + ("",):
        _fail("warm_start.sft_source", ws.sft_source,
              f"allowed values are {SFT_SOURCES} or '' (= loss.sft_source)")
    if ws.sft_steps and algorithm.trainer == "vector":
        _fail("warm_start.sft_steps", ws.sft_steps,
              "the warm start clones token-environment demonstrations; "
              f"algorithm {algorithm.name!r} has none: set 0")


def _validate_token_rollout(config, mesh, algorithm: alg.Algorithm) -> None:
    r = config.rollout
    _check_range(config, "rollout.num_tasks", 1, integer=True)
    _check_range(config, "rollout.group_size", 1, integer=True)
    if r.group_size < algorithm.min_group_size:
        _fail("rollout.group_size", r.group_size,
              f"algorithm {config.algorithm!r} compares samples within a group: need >= "
              f"{algorithm.min_group_size}")
    _check_range(config, "rollout.temperature", 0.0)
    _check_range(config, "rollout.top_k", 0, integer=True)
    _check_range(config, "rollout.top_p", 0.0, 1.0, low_open=True)
    _check_range(config, "rollout.horizon_every", 1, integer=True)
    if any(not isinstance(h, int) or h < 1 for h in r.horizon_rounds):
        _fail("rollout.horizon_rounds", r.horizon_rounds, "expected positive integers")
    batch = r.num_tasks * r.group_size
    data_shards = mesh[0] * mesh[1]
    if batch % data_shards:
        _fail("rollout.num_tasks", r.num_tasks,
              f"batch num_tasks*group_size={batch} must be divisible by the mesh's "
              f"data*fsdp={data_shards}")
    if batch % config.updates.minibatches:
        _fail("updates.minibatches", config.updates.minibatches,
              f"must divide the batch num_tasks*group_size={batch}")
    if (config.updates.get("shuffle", "rows") == "groups"
            and r.num_tasks % config.updates.minibatches):
        _fail("updates.minibatches", config.updates.minibatches,
              f"with updates.shuffle='groups' it must divide rollout.num_tasks={r.num_tasks} "
              f"(each minibatch holds whole groups)")
    if (batch // config.updates.minibatches) % data_shards:
        _fail("updates.minibatches", config.updates.minibatches,
              f"minibatch size {batch // config.updates.minibatches} must be divisible by "
              f"the mesh's data*fsdp={data_shards}")
    m = config.model
    for field in ("d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"):
        _check_range(config, f"model.{field}", 1, integer=True)
    if m.d_model % m.num_heads:
        _fail("model.num_heads", m.num_heads, f"must divide model.d_model={m.d_model}")
    if m.num_heads % m.num_kv_heads:
        _fail("model.num_kv_heads", m.num_kv_heads,
              f"must divide model.num_heads={m.num_heads}")
    for field in ("tie_embeddings", "qkv_bias", "o_bias", "mlp_bias"):
        if not isinstance(m.get(field, False), bool):
            _fail(f"model.{field}", m.get(field), "allowed values are (True, False)")
    for field in ("dtype", "param_dtype"):
        if m.get(field, "float32") not in FLOAT_DTYPES:
            _fail(f"model.{field}", m.get(field), f"allowed values are {FLOAT_DTYPES}")
    if not isinstance(m.get("remat", False), bool):
        _fail("model.remat", m.get("remat"), "allowed values are (True, False)")
    if m.get("vocab_size") is not None:
        _check_range(config, "model.vocab_size", 0, integer=True)
    if m.get("norm_eps") is not None:
        _check_range(config, "model.norm_eps", 0.0, low_open=True)
    _check_range(config, "model.rope_theta", 0.0, low_open=True)
    _check_range(config, "model.logprob_chunk", 0, integer=True)
    _check_range(config, "model.layer_unroll", 0, integer=True)
    attention = m.get("attention", "auto")
    if not isinstance(attention, str) or attention not in ATTENTION_IMPLEMENTATIONS:
        _fail("model.attention", attention, f"allowed values are {ATTENTION_IMPLEMENTATIONS}")
    if attention == "cudnn" and jax.default_backend() != "gpu":
        # Caught here: otherwise the first compiled train step fails with a traceback.
        _fail("model.attention", attention,
              f"cuDNN's kernel needs an NVIDIA GPU, this backend is "
              f"{jax.default_backend()!r}: use 'auto', 'dense' or 'blocked'")
    if m.get("attention_block") is not None:
        _check_range(config, "model.attention_block", 1, integer=True)
    if m.get("hf_checkpoint", "") and not os.path.isfile(
            os.path.join(m.hf_checkpoint, "config.json")):
        _fail("model.hf_checkpoint", m.hf_checkpoint,
              "must be a directory holding a Hugging Face config.json and safetensors")
    _validate_lora(config)
    _validate_token_env(config)


def _validate_lora(config) -> None:
    m = config.model
    if m.get("lora_rank") is None:
        return
    _check_range(config, "model.lora_rank", 0, integer=True)
    _check_range(config, "model.lora_alpha", 0.0, low_open=True)
    targets = m.lora_targets
    if isinstance(targets, str) or not isinstance(targets, (tuple, list)) or not targets \
            or any(t not in lora_lib.ALL_TARGETS for t in targets) \
            or len(set(targets)) != len(targets):
        _fail("model.lora_targets", targets,
              f"expected distinct names from {lora_lib.ALL_TARGETS}")


def _validate_process(config) -> None:
    p = config.get("process")
    if p is None:
        return
    for field in ("outcome_weight", "reward_weight", "prm_weight", "implicit_coef",
                  "implicit_weight"):
        _check_range(config, f"process.{field}", 0.0)
    _check_range(config, "process.turn_gamma", 0.0, 1.0)
    _check_range(config, "process.mc_samples", 0, integer=True)
    _check_range(config, "process.prm_learning_rate", 0.0, low_open=True)
    if p.mc_estimate not in MC_ESTIMATES:
        _fail("process.mc_estimate", p.mc_estimate, f"allowed values are {MC_ESTIMATES}")
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in p.branch_turns):
        _fail("process.branch_turns", p.branch_turns, "expected distinct turn indices >= 0")
    if p.train_prm and p.mc_samples < 1:
        _fail("process.train_prm", p.train_prm,
              "the PRM learns from Monte Carlo labels: set process.mc_samples >= 1")
    if p.prm_weight > 0 and not p.train_prm:
        _fail("process.prm_weight", p.prm_weight,
              "a PRM reward needs a trained PRM: set process.train_prm=True")


def _validate_token_env(config) -> None:
    known = envs_lib.registered_names()
    name = config.env.name
    if name == "mixture":
        if len(config.env.members) < 1:
            _fail("env.members", config.env.members, "a mixture needs at least one member")
        for i, member in enumerate(config.env.members):
            if not hasattr(member, "get") or member.get("name") not in known:
                _fail(f"env.members[{i}].name",
                      member.get("name") if hasattr(member, "get") else member,
                      f"allowed values are {known}")
    elif name not in known:
        hint = (" (gymnax environments are vector envs: use algorithm='ppo_vector')"
                if str(name).startswith("gymnax:") else
                " (an env of your own: register it in a module named in config.imports)")
        _fail("env.name", name, f"allowed values for token algorithms are {known + ['mixture']}"
              f"{hint}")
    # Python only, nothing compiled: the constructors' and the params' checks.
    env = envs_lib.make_env(config.env)
    envs_lib.task_params(env, config.env, envs_lib.member_of_task(env, 1))
    rounds = tuple(config.rollout.horizon_rounds)
    if any(h > env.max_turns for h in rounds):
        _fail("rollout.horizon_rounds", rounds,
              f"env {name!r} truncates every episode at max_turns={env.max_turns}: use "
              f"rounds in [1, {env.max_turns}]")
    _validate_scripted_sources(config, env)


def _validate_scripted_sources(config, env) -> None:
    """The demonstrations a config asks for must be playable: the warm start and the SFT
    term (without a stored `loss.sft_dataset`) run the env's `<source>_action`."""
    ws, loss = config.get("warm_start"), config.loss
    uses = []
    if ws is not None and ws.sft_steps > 0:
        field = "warm_start.sft_source" if ws.sft_source else "loss.sft_source"
        uses.append((field, ws.sft_source or loss.sft_source, "the warm start"))
    if loss.sft_coef > 0 and not loss.get("sft_dataset", ""):
        uses.append(("loss.sft_source", loss.sft_source, "the SFT term (loss.sft_coef > 0)"))
    members = getattr(env, "envs", (env,))
    for field, source, user in uses:
        lacking = [getattr(m, "name", type(m).__name__) for m in members
                   if not m.supports_action_source(source)]
        if lacking:
            others = [s for s in SFT_SOURCES if s != source
                      and all(m.supports_action_source(s) for m in members)]
            _fail(field, source,
                  f"{user} plays the env's {source}_action, which env {lacking[0]!r} does not "
                  f"define: implement it" + (f" or use {others[0]!r}" if others else ""))


def _validate_vector(config) -> None:
    name = str(config.env.name)
    if not name.startswith(GYMNAX_PREFIX):
        _fail("env.name", config.env.name,
              "algorithm 'ppo_vector' needs a vector env such as 'gymnax:CartPole-v1'")
    params = dict(config.env.get("params", {}) or {})
    if params:
        _fail("env.params", params, "algorithm 'ppo_vector' runs the gymnax env's default "
              "params and does not apply config.env.params: leave it empty")
    _check_range(config, "vector.num_envs", 1, integer=True)
    _check_range(config, "vector.num_steps", 1, integer=True)
    if config.vector.activation not in ACTIVATIONS:
        _fail("vector.activation", config.vector.activation,
              f"allowed values are {ACTIVATIONS}")
    if not isinstance(config.vector.diagnostics, bool):
        _fail("vector.diagnostics", config.vector.diagnostics,
              "allowed values are (True, False)")
    if config.updates.get("shuffle", "rows") != "rows":
        _fail("updates.shuffle", config.updates.shuffle,
              "the vector trainer has no groups: allowed value is 'rows'")
    if config.updates.get("reuse_rollout_activations", False):
        _fail("updates.reuse_rollout_activations", True,
              "the vector trainer's MLP keeps no rollout activations: allowed value is "
              "False")
    batch = config.vector.num_envs * config.vector.num_steps
    if batch % config.updates.minibatches:
        _fail("updates.minibatches", config.updates.minibatches,
              f"must divide vector.num_envs*vector.num_steps={batch}")
    try:
        import gymnax  # pylint: disable=g-import-not-at-top
    except ImportError:
        gymnax = None
    if gymnax is not None:
        env_id = name[len(GYMNAX_PREFIX):]
        if env_id not in gymnax.registered_envs:
            _fail("env.name", name, "not a gymnax environment"
                  f"{did_you_mean(env_id, gymnax.registered_envs, 'gymnax:')}")
        envs_lib.make_env(config.env)  # constructor arguments, as a ConfigError


def _validate_workdir(workdir: str) -> None:
    path = os.path.abspath(workdir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--workdir={workdir!r} is a file, not a directory: pass a "
                          "directory (created if missing).")
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"--workdir={workdir!r} cannot be created: {probe!r} is a file, "
                          "not a directory.")
    if not os.access(probe, os.W_OK):
        raise ConfigError(f"--workdir={workdir!r} is not writable (checked {probe!r}).")


def uses_two_programs(config: ml_collections.ConfigDict) -> bool:
    """Whether the token trainer runs rollout and update as two programs
    (`arl.trainers.async_step`): a policy lag or a rollout mesh of its own."""
    return config.rollout.get("policy_lag", 0) > 0 or bool(tuple(config.rollout.get("mesh", ())))


def _validate_off_policy(config, mesh, num_devices, algorithm: alg.Algorithm) -> None:
    """The off-policy correction, the policy lag and the rollout mesh."""
    loss, r = config.loss, config.rollout
    if loss.off_policy_correction not in alg.CORRECTIONS:
        _fail("loss.off_policy_correction", loss.off_policy_correction,
              f"allowed values are {alg.CORRECTIONS}")
    if loss.off_policy_level not in alg.WEIGHT_LEVELS:
        _fail("loss.off_policy_level", loss.off_policy_level,
              f"allowed values are {alg.WEIGHT_LEVELS}")
    _check_range(config, "loss.off_policy_cap", 1.0)
    _check_range(config, "loss.off_policy_low", 0.0, 1.0)
    _check_range(config, "loss.off_policy_high", 1.0)
    _check_range(config, "rollout.policy_lag", 0, integer=True)
    rollout_mesh = tuple(r.mesh)
    if rollout_mesh and (len(rollout_mesh) != 3 or any(
            not isinstance(m, int) or m < 1 for m in rollout_mesh)):
        _fail("rollout.mesh", rollout_mesh, f"expected () (the training mesh's devices) or "
              f"three positive integers for axes {MESH_AXES}")
    if rollout_mesh and num_devices is not None and (
            math.prod(mesh) + math.prod(rollout_mesh) > num_devices):
        _fail("rollout.mesh", rollout_mesh,
              f"the training mesh {mesh} takes {math.prod(mesh)} devices and this one "
              f"{math.prod(rollout_mesh)}: {math.prod(mesh) + math.prod(rollout_mesh)} > "
              f"the {num_devices} that exist (use () to share the training devices)")
    batch = r.num_tasks * r.group_size
    if rollout_mesh and batch % (rollout_mesh[0] * rollout_mesh[1]):
        _fail("rollout.mesh", rollout_mesh, f"batch num_tasks*group_size={batch} must be "
              f"divisible by its data*fsdp={rollout_mesh[0] * rollout_mesh[1]}")
    if algorithm.trainer != "token" and loss.off_policy_correction != "none":
        _fail("loss.off_policy_correction", loss.off_policy_correction,
              f"the {algorithm.trainer} trainer has no off-policy correction: allowed "
              "value is 'none'")
    if not uses_two_programs(config):
        return
    if algorithm.trainer != "token":
        _fail("rollout.policy_lag" if r.policy_lag else "rollout.mesh",
              r.policy_lag if r.policy_lag else rollout_mesh,
              f"the {algorithm.trainer} trainer has the fused step only: allowed value is "
              f"{0 if r.policy_lag else ()}")
    if r.policy_lag > 0 and loss.off_policy_correction == "none":
        _fail("loss.off_policy_correction", "none",
              f"rollout.policy_lag={r.policy_lag} samples with parameters up to "
              f"{r.policy_lag} updates old: choose one of {alg.CORRECTIONS[1:]}")
    if config.updates.get("reuse_rollout_activations", False):
        _fail("updates.reuse_rollout_activations", True, "the rollout's activations stay "
              "on the rollout's side with rollout.policy_lag > 0 or a rollout.mesh: "
              "allowed value is False")
    if config.process.mc_samples > 0:
        _fail("process.mc_samples", config.process.mc_samples, "Monte Carlo branching "
              "needs the fused step (rollout.policy_lag=0, rollout.mesh=()): allowed "
              "value is 0")
