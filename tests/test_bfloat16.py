"""bfloat16 as accelerator users run it, for every experiment in configs/: bfloat16
parameters and activations (`model.param_dtype`, `model.dtype`), float32 master weights
(`arl.optim.float32_master_weights`) and float32 statistics.

The configs are found by listing configs/, so a new config file is covered without
anyone adding it here. A file is not an experiment, and is skipped with its reason shown,
when:

* it defines no `get_config` (recipes.py: pieces the configs share);
* its algorithm is `ppo_vector` (ppo_cartpole.py): a vector env trains an MLP
  actor-critic that `model.dtype` / `model.param_dtype` do not reach (float32 only).

Every other file runs as shipped, at a tiny size (`_tiny_bfloat16`: one layer of width
16, two tasks of two rows, two logged steps); files whose `get_config` takes an
argument get it from `_ARGUMENTS` (grpo_hf_checkpoint.py: a stand-in checkpoint
directory, tests/hf_standins.py, run as shipped: bfloat16, remat, one scanned layer
body, chunked log-probs, its own sizes; only the directory and the task file given).

Two levels, for the default suite's time:

* default: each config's bfloat16 train step is traced (not compiled; 60 CPU-s for the
  module, the stand-in checkpoint's build included, on the 2-core host)
  and checked: every metric leaving the step is float32, and no statistic is computed in
  bfloat16 — no reduction, exponential, logarithm, division or square root on a
  bfloat16 operand anywhere in the step, except the backward pass's sums of gradients
  into bfloat16 parameters and activations (mixed precision: the float32 master weights
  take bfloat16 gradients). The golden case `ppo_guess_number_bfloat16`
  (tests/golden_run.py) runs one config's bfloat16 steps for real in the default suite.
* `-m slow`: each config trains two logged steps through `experiments.train` in
  bfloat16 (warm start, evaluation and the final checkpoint included) and logs finite
  metrics; the checkpoint recipe also resumes, evaluates and exports in bfloat16.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl import config as config_lib
from arl import optim
from arl import trainers
from arl.runs import checkpoint as checkpoint_lib
from arl.runs import evaluation
from arl.runs import writers
from tests import golden_run, optional_envs

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG_DIR = os.path.join(_ROOT, "configs")
CONFIG_FILES = sorted(f[:-3] for f in os.listdir(_CONFIG_DIR)
                      if f.endswith(".py") and f != "__init__.py")

# Primitives that compute a statistic: reductions, transcendentals, divisions, roots.
_STATISTICS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
    "cumsum", "cumprod", "cummax", "cumlogsumexp", "exp", "exp2", "log", "log1p",
    "expm1", "logistic", "tanh", "div", "sqrt", "rsqrt", "pow", "erf", "erf_inv"})


def _tasks_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {a} plus {b}?",
                                        "answer": str(a + b)}) + "\n"
                            for a in range(1, 9) for b in (2, 5)))
    return str(path)


@pytest.fixture(scope="module")
def hf_standin(tmp_path_factory):
    """(stand-in checkpoint directory, task JSONL) for configs/grpo_hf_checkpoint.py."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.hf_standins import build_standin  # pylint: disable=g-import-not-at-top
    directory = build_standin(str(tmp_path_factory.mktemp("standin") / "qwen"), "qwen2")
    return directory, _tasks_file(tmp_path_factory)


# get_config arguments and command-line overrides of the configs that take an argument;
# each is a function of the test's fixtures (request.getfixturevalue).
def _hf_checkpoint_arguments(request):
    directory, tasks = request.getfixturevalue("hf_standin")
    return (directory,), {"env.kwargs.path": tasks}


def _sql_hf_arguments(request):
    directory, _ = request.getfixturevalue("hf_standin")
    return (directory,), {}


_ARGUMENTS = {"grpo_hf_checkpoint": _hf_checkpoint_arguments,
              "grpo_sql_hf": _sql_hf_arguments}


def _experiment(name: str, request):
    """(config as shipped, the get_config arguments, the overrides it needs), or a skip
    naming the rule of the module docstring that excludes `name`."""
    module = importlib.import_module(f"configs.{name}")
    if not callable(getattr(module, "get_config", None)):
        pytest.skip(f"configs/{name}.py defines no get_config: shared pieces, not an "
                    "experiment")
    args, overrides = (), {}
    if name in _ARGUMENTS:
        args, overrides = _ARGUMENTS[name](request)
    else:
        required = [p for p in inspect.signature(module.get_config).parameters.values()
                    if p.default is inspect.Parameter.empty]
        assert not required, (f"configs/{name}.py's get_config needs {required}: add how "
                              "to call it to _ARGUMENTS")
    config = module.get_config(*args)
    optional_envs.skip_without_extra(config)
    if config.algorithm == "ppo_vector":
        pytest.skip(f"configs/{name}.py is a vector-env config: its MLP actor-critic is "
                    "float32 only (model.dtype does not reach it)")
    config.update_from_flattened_dict(overrides)
    return config, args, overrides


def _tiny_bfloat16(config, *, shipped_sizes: bool) -> dict:
    """The overrides (flattened keys) that make `config` a tiny two-step bfloat16 run:
    bfloat16 parameters and activations, two logged steps, evaluation at step 2, a
    two-step warm start where the config has one. Unless `shipped_sizes` (a checkpoint
    brings its own architecture), a one-layer width-16 model and two tasks of two rows
    (of one for critic PPO), rows a multiple of the mesh's batch axes."""
    out = {"model.dtype": "bfloat16", "model.param_dtype": "bfloat16",
           "train_steps": 2, "log_every": 1, "sample_every": 2, "checkpoint_every": 2}
    if config.warm_start.sft_steps > 0:
        out.update({"warm_start.sft_steps": 2, "warm_start.sft_batch": 4})
    if shipped_sizes:
        return out
    out.update({"model.d_model": 16, "model.num_layers": 1, "model.num_heads": 2,
                "model.num_kv_heads": 1, "model.mlp_dim": 32})
    members = max(1, len(config.env.members))
    group = min(config.rollout.group_size, 2)
    batch_axes = math.prod(config.mesh[:2]) if config.mesh else 1
    tasks = members * 2
    while (tasks * group) % (batch_axes * config.updates.minibatches):
        tasks += members
    out.update({"rollout.num_tasks": tasks, "rollout.group_size": group})
    return out


def _bfloat16_config(name, request):
    config, args, overrides = _experiment(name, request)
    tiny = _tiny_bfloat16(config, shipped_sizes=bool(config.model.hf_checkpoint))
    config.update_from_flattened_dict(tiny)
    return config, args, {**overrides, **tiny}


def _sub_jaxprs(value):
    if hasattr(value, "jaxpr") and hasattr(value, "consts"):  # ClosedJaxpr
        yield value.jaxpr
    elif hasattr(value, "eqns"):  # Jaxpr
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def bfloat16_statistics(jaxpr, backward: bool = False):
    """[(primitive, source line, in backward pass)] of every equation of `jaxpr` (nested
    jaxprs included) that computes a statistic (`_STATISTICS`) on a bfloat16 operand."""
    found = []
    for eqn in jaxpr.eqns:
        in_backward = backward or "transpose" in str(eqn.source_info.name_stack)
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                found += bfloat16_statistics(sub, in_backward)
        if eqn.primitive.name in _STATISTICS and any(
                getattr(v.aval, "dtype", None) == jnp.bfloat16 for v in eqn.invars):
            frame = next((f for f in eqn.source_info.traceback.frames
                          if "/arl/" in f.file_name), None) \
                if eqn.source_info.traceback is not None else None
            line = getattr(frame, "start_line", getattr(frame, "line_num", "?"))
            where = f"{os.path.relpath(frame.file_name, _ROOT)}:{line}" if frame else "?"
            found.append((eqn.primitive.name, where, in_backward))
    return found


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_bfloat16_step_keeps_statistics_in_float32(name, request):
    config, _, _ = _bfloat16_config(name, request)
    _check_bfloat16_step(config)


# The non-default rollouts: per-turn history (its own trainer and update), slot
# scheduling (its own rollout program) and partial rollouts (episodes carried in the
# state), each on a shipped config.
_ROLLOUT_MODES = {
    "per_turn": ("grpo_hf_checkpoint", {"rollout.history": "per_turn", "loss.sft_coef": 0.0}),
    "slots": ("grpo_guess_number", {"rollout.schedule": "slots", "rollout.num_slots": 2}),
    "partial": ("grpo_guess_number", {
        "rollout.schedule": "slots", "rollout.num_slots": 2, "rollout.carried_groups": 1,
        "loss.off_policy_correction": "tis"}),
}


@pytest.mark.parametrize("mode", sorted(_ROLLOUT_MODES))
def test_bfloat16_step_of_each_rollout_mode_keeps_statistics_in_float32(mode, request):
    name, overrides = _ROLLOUT_MODES[mode]
    config, _, _ = _bfloat16_config(name, request)
    config.update_from_flattened_dict(overrides)
    _check_bfloat16_step(config)


def _check_bfloat16_step(config):
    config_lib.validate(config, num_devices=jax.device_count())
    trainer = trainers.build(config)
    if config.rollout.history == "per_turn":
        assert type(trainer).__name__ == "PerTurnTrainer", type(trainer)
    state = trainer.abstract_state()
    if config.rollout.carried_groups:  # the carried episodes' logits stay in float32
        assert state.rollout_carry.rows.slots.last_logits.dtype == jnp.float32
    closed, (_, metrics) = jax.make_jaxpr(trainer.train_step, return_shape=True)(state)
    not_float32 = {k: str(v.dtype) for k, v in metrics.items()
                   if jnp.issubdtype(v.dtype, jnp.floating) and v.dtype != jnp.float32}
    assert not not_float32, f"metrics leave the step in {not_float32}"
    params = jax.tree.leaves(state.params)
    assert {str(p.dtype) for p in params} == {"bfloat16"}, "the run is not in bfloat16"
    found = bfloat16_statistics(closed.jaxpr)
    forward = sorted({(p, w) for p, w, backward in found if not backward})
    assert not forward, f"statistics computed in bfloat16: {forward}"
    # Only gradient sums, and only sums: no bfloat16 max, exp, log or division anywhere.
    assert {p for p, _, _ in found} <= {"reduce_sum"}, found


def test_the_statistics_check_finds_a_bfloat16_softmax():
    """The check of the test above fails where a statistic is in bfloat16 (a softmax
    written in the activation dtype) and passes its float32 twin."""
    def softmax(x, dtype):
        x = x.astype(dtype)
        e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
        return (e / jnp.sum(e, axis=-1, keepdims=True)).astype(jnp.float32)

    x = jax.ShapeDtypeStruct((2, 8), jnp.bfloat16)
    low = bfloat16_statistics(jax.make_jaxpr(lambda x: softmax(x, jnp.bfloat16))(x).jaxpr)
    # (jnp.sum accumulates bfloat16 in float32 by itself: no bfloat16 reduce_sum.)
    assert sorted({p for p, _, _ in low}) == ["div", "exp", "reduce_max"]
    assert not bfloat16_statistics(jax.make_jaxpr(lambda x: softmax(x, jnp.float32))(x).jaxpr)
    # Gradient sums are told from forward ones.
    grad = jax.make_jaxpr(jax.grad(lambda w, h: jnp.sum((h * w).astype(jnp.float32))))(
        jax.ShapeDtypeStruct((8,), jnp.bfloat16), x)
    assert {(p, b) for p, _, b in bfloat16_statistics(grad.jaxpr)} == {("reduce_sum", True)}


def test_rmsnorm_sums_the_scale_gradient_in_float32():
    """bfloat16 RMSNorm: the output is HF's (normalise in float32, round, multiply by
    the scale in bfloat16) bit for bit, and the scale's gradient, a sum over every
    token, is summed in float32: RMS error 2.6e-3 of the mean gradient against float64
    (the bfloat16 rounding of the result), where a bfloat16 sum measured 2.5e-2."""
    import flax.linen as nn  # pylint: disable=g-import-not-at-top

    from arl.models.layers import RMSNorm  # pylint: disable=g-import-not-at-top

    x = jax.random.normal(jax.random.key(0), (8, 256, 32)).astype(jnp.bfloat16)
    norm = RMSNorm(1e-6, jnp.bfloat16, jnp.bfloat16)
    scale = (1 + 0.1 * jax.random.normal(jax.random.key(2), (32,))).astype(jnp.bfloat16)
    params = {"params": {"scale": scale}}
    nn.unbox(norm.init(jax.random.key(1), x))  # the parameter tree the module declares
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
              ).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(norm.apply(params, x)),
                                  np.asarray(normed * scale))
    loss = lambda p: jnp.sum(norm.apply(p, x).astype(jnp.float32))  # noqa: E731
    assert not bfloat16_statistics(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    grad = np.asarray(jax.grad(loss)(params)["params"]["scale"], np.float64)
    want = np.sum(np.asarray(normed, np.float64), axis=(0, 1))
    assert np.sqrt(np.mean((grad - want) ** 2)) / np.abs(want).mean() < 5e-3


def test_the_warm_start_hands_rl_its_weights_as_the_float32_master_copy():
    """After the warm start the RL optimizer's master copy is the SFT weights in float32
    (it was the initialisation's: the first RL update then reset the policy to its random
    init; measured on ppo_guess_number_bfloat16: ratio mean 0.28, KL to the reference 7.1
    at step 1, success 0 from step 2), for the policy and PRIME's implicit PRM."""
    from arl.trainers import warm_start  # pylint: disable=g-import-not-at-top

    config = golden_run.CASES["ppo_guess_number_bfloat16"]()
    config.process.implicit_coef = 0.05
    trainer = trainers.build(config)
    state = trainer.init_state()
    sft = jax.tree.map(lambda p: (p.astype(jnp.float32) + 0.5).astype(p.dtype),
                       jax.device_get(state.params))
    started = warm_start.start_state(trainer, sft, state)
    for params, opt_state in ((started.params, started.opt_state),
                              (started.implicit_params, started.implicit_opt_state)):
        masters = [s.master for s in jax.tree.leaves(
            opt_state, is_leaf=lambda x: isinstance(x, optim.MasterWeightsState))
            if isinstance(s, optim.MasterWeightsState)]
        assert len(masters) == 1
        jax.tree.map(lambda p, m, want: (
            np.testing.assert_array_equal(np.asarray(m), np.asarray(p, np.float32)),
            np.testing.assert_array_equal(np.asarray(p), np.asarray(want))),
            params, masters[0], sft)


def test_the_golden_bfloat16_case_runs_bfloat16_and_logged_finite_metrics():
    """The default suite's real bfloat16 steps: the golden case is bfloat16 parameters
    and activations with a KL reference and a critic, and its recordings are finite."""
    config = golden_run.CASES["ppo_guess_number_bfloat16"]()
    assert (config.model.dtype, config.model.param_dtype) == ("bfloat16", "bfloat16")
    assert config.loss.kl_coef > 0 and config.loss.value_coef > 0
    recorded = golden_run.recordings("ppo_guess_number_bfloat16")
    assert recorded
    for records in recorded.values():
        assert [r["step"] for r in records] == [1, 2, 3]
        for record in records:
            bad = {k: v for k, v in record.items()
                   if isinstance(v, float) and not math.isfinite(v)}
            assert not bad, bad


def _cli(program, *args):
    return subprocess.run([sys.executable, "-m", program, *args], cwd=_ROOT,
                          env=dict(os.environ), capture_output=True, text=True, timeout=1200,
                          check=False)


def _flags(name, args, overrides) -> list[str]:
    config_arg = f"configs/{name}.py" + "".join(f":{a}" for a in args)
    return [f"--config={config_arg}"] + [f"--config.{k}={v}" for k, v in overrides.items()]


def _finite_records(workdir):
    records = writers.read_metrics(str(workdir))
    for record in records:
        bad = {k: v for k, v in record.items()
               if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (record["step"], bad)
    return records


@pytest.mark.slow  # 17-700 s a config; 35 minutes for all 18 on the 2-core host under load
@pytest.mark.parametrize("name", CONFIG_FILES)
def test_every_config_logs_two_finite_bfloat16_steps_through_the_cli(name, request,
                                                                    tmp_path):
    config, args, overrides = _bfloat16_config(name, request)
    result = _cli("experiments.train", *_flags(name, args, overrides),
                  f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    records = _finite_records(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert "eval/success_rate" in records[-1]
    assert "loss/total" in records[0] and "grad_norm" in records[0]
    assert os.path.isdir(tmp_path / "checkpoints" / "2")


@pytest.mark.slow  # three CLI runs and an export at the shipped sizes: 7 minutes (2 cores, loaded)
def test_checkpoint_recipe_trains_resumes_evaluates_and_exports_in_bfloat16(
        hf_standin, tmp_path):
    """configs/grpo_hf_checkpoint.py as shipped (bfloat16): two logged steps with a
    checkpoint, a resume to step 3 from it, an evaluation and an export, whose weights are
    the run's bfloat16 parameters, bit for bit."""
    transformers = pytest.importorskip("transformers")
    from arl.models import hf_import  # pylint: disable=g-import-not-at-top

    directory, tasks = hf_standin
    workdir, out = tmp_path / "run", tmp_path / "hf"
    common = [f"--config=configs/grpo_hf_checkpoint.py:{directory}",
              f"--config.env.kwargs.path={tasks}", f"--workdir={workdir}",
              "--config.log_every=1", "--config.checkpoint_every=2"]
    first = _cli("experiments.train", *common, "--config.train_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _cli("experiments.train", *common, "--config.train_steps=3",
                   f"--export_to={out}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from step 2" in resumed.stderr
    assert [r["step"] for r in _finite_records(workdir)] == [1, 2, 3]
    evaluate = _cli("experiments.evaluate", f"--workdir={workdir}", "--split=eval",
                    "--num_transcripts=1")
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    assert "every row of the 'eval' split once (2 rows)" in evaluate.stdout
    # The checkpoint holds bfloat16 parameters that are their float32 master copy
    # rounded, and the export holds them, bit for bit.
    with open(out / "config.json", encoding="utf-8") as f:
        exported = json.load(f)
    assert exported.get("torch_dtype", exported.get("dtype")) == "bfloat16"
    _, stored = evaluation.checkpoint_config(str(workdir))
    trainer = evaluation.trainer_for_checkpoint(stored)
    target = trainer.abstract_state()
    with checkpoint_lib.Checkpointer(str(workdir / "checkpoints"), read_only=True) as ckpt:
        step, state, _ = ckpt.restore_latest(target)
    assert step == 3
    masters = [s.master for s in jax.tree.leaves(
        state.opt_state, is_leaf=lambda x: isinstance(x, optim.MasterWeightsState))
        if isinstance(s, optim.MasterWeightsState)]
    assert len(masters) == 1
    jax.tree.map(lambda p, m: np.testing.assert_array_equal(
        np.asarray(p), np.asarray(m.astype(jnp.bfloat16))), state.params, masters[0])
    assert {str(m.dtype) for m in jax.tree.leaves(masters[0])} == {"float32"}
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"bfloat16"}
    _, params = hf_import.load_hf_checkpoint(str(out), dtype=jnp.bfloat16)
    trained = jax.device_get(trainer.policy_params(state))
    assert jax.tree.structure(trained) == jax.tree.structure(params)
    jax.tree.map(lambda a, b: (np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                               np.testing.assert_equal(a.dtype, b.dtype)), trained, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert str(model.dtype) == "torch.bfloat16"
