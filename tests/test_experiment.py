"""End-to-end tests of `python -m experiments.train` (arl.runs.experiment.run).

A run killed with SIGKILL after step k and restarted must end with the same metrics and
parameters, bit for bit, as an uninterrupted run. The runs share a persistent
compilation cache, so only the first one compiles.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from arl.runs import writers

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Tiny sizes: the point is the experiment loop, not learning.
_VECTOR_FLAGS = (
    "--config=configs/ppo_cartpole.py", "--config.train_steps=6", "--config.log_every=1",
    "--config.checkpoint_every=2", "--config.keep_checkpoints=3",
    "--config.vector.num_envs=2", "--config.vector.num_steps=8",
    "--config.vector.hidden_sizes=(8,8)", "--config.updates.minibatches=2",
    "--config.updates.epochs=2",
)
_TOKEN_FLAGS = (
    "--config=configs/grpo_bandit.py", "--config.train_steps=6", "--config.log_every=1",
    "--config.checkpoint_every=2", "--config.sample_every=3",
    "--config.rollout.num_tasks=4", "--config.rollout.group_size=2",
    "--config.model.d_model=32", "--config.model.num_layers=1", "--config.model.num_heads=2",
    "--config.model.num_kv_heads=2", "--config.model.mlp_dim=64",
    # Auxiliary terms keep the parameters moving even when every GRPO group is degenerate
    # (a random policy never names an arm), so the bitwise comparison bites.
    "--config.loss.echo_coef=0.1",
)


def _train(workdir, flags, cache_dir, *extra):
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *flags, *extra],
        cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=600, check=False)


def _final_state(workdir, step):
    """The raw arrays of checkpoint `step` (no restore target needed)."""
    path = os.path.join(workdir, "checkpoints", str(step), "state")
    return ocp.PyTreeCheckpointer().restore(path)


def _flat_arrays(tree, prefix=""):
    if tree is None:  # a field that holds no arrays
        return {}
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat_arrays(value, f"{prefix}{key}/"))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, value in enumerate(tree):
            out.update(_flat_arrays(value, f"{prefix}{i}/"))
        return out
    if jax.dtypes.issubdtype(getattr(tree, "dtype", None), jax.dtypes.prng_key):
        tree = jax.random.key_data(tree)
    return {prefix: np.asarray(tree)}


def _check_sigkill_resume(tmp_path, flags, kill_after, resumed_from, metric):
    cache = tmp_path / "jax_cache"
    reference = _train(tmp_path / "reference", flags, cache)
    assert reference.returncode == 0, reference.stdout[-3000:]

    killed = _train(tmp_path / "resumed", flags, cache, f"--debug_kill_after_step={kill_after}")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    assert not (tmp_path / "resumed" / "curves.png").exists()
    resumed = _train(tmp_path / "resumed", flags, cache)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"Resumed from step {resumed_from}" in resumed.stdout

    # The killed run logged steps up to kill_after; the resumed one dropped those after
    # its checkpoint and logged them again: the raw file holds each step once.
    raw = [json.loads(line) for line in
           (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in raw] == list(range(1, 7))
    expected = writers.read_metrics(tmp_path / "reference")
    actual = writers.read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in actual] == list(range(1, 7))
    assert actual == expected  # every metric, bitwise (JSON floats round-trip exactly)
    values = [r[metric] for r in expected]
    assert all(np.isfinite(values))

    reference_state = _flat_arrays(_final_state(tmp_path / "reference", 6))
    resumed_state = _flat_arrays(_final_state(tmp_path / "resumed", 6))
    assert sorted(reference_state) == sorted(resumed_state)
    for name, value in reference_state.items():
        assert value.dtype == resumed_state[name].dtype, name
        assert np.array_equal(value, resumed_state[name]), name
    first = _flat_arrays(_final_state(tmp_path / "resumed", resumed_from))
    moved = [n for n in first if "params" in n and not np.array_equal(first[n], resumed_state[n])]
    assert moved, "parameters did not change after the resume: the test would be vacuous"

    for name in ("curves.png", "tensorboard"):
        assert (tmp_path / "resumed" / name).exists(), name
    return expected


@pytest.mark.slow  # three Python processes: ~40 s idle, minutes on a busy machine
def test_sigkill_resume_vector_ppo_is_bitwise_exact(tmp_path):
    # Killed after step 3 (checkpoints at 2, 4, 6): resume recomputes step 3.
    records = _check_sigkill_resume(tmp_path, _VECTOR_FLAGS, kill_after=3, resumed_from=2,
                                    metric="episode_return")
    assert {"episode_return", "loss/total", "entropy"} <= set(records[0])


@pytest.mark.slow
def test_sigkill_resume_token_env_is_bitwise_exact(tmp_path):
    # Killed right after the committed checkpoint of step 4.
    records = _check_sigkill_resume(tmp_path, _TOKEN_FLAGS, kill_after=4, resumed_from=4,
                                    metric="reward_mean")
    assert {"reward_mean", "success_rate", "loss/echo"} <= set(records[0])
    assert "eval/success_rate" in records[2] and "eval/success_rate" in records[5]
    sample = (tmp_path / "resumed" / "samples" / "step_000006.txt").read_text()
    assert sample.count("[agent]") == 2 and "arms:" in sample


def _tiny_vector_config():
    from configs import ppo_cartpole

    c = ppo_cartpole.get_config()
    c.train_steps, c.log_every, c.checkpoint_every = 3, 1, 2
    c.vector.num_envs, c.vector.num_steps, c.vector.hidden_sizes = 2, 8, (8, 8)
    c.updates.epochs, c.updates.minibatches = 1, 2
    c.optim.schedule = "constant"  # so that extending train_steps changes nothing else
    return c


def test_vector_diagnostics_off_logs_less_and_trains_the_same():
    from arl.trainers import VectorPPO

    results = {}
    for diagnostics in (True, False):
        config = _tiny_vector_config()
        config.vector.diagnostics = diagnostics
        trainer = VectorPPO(config)
        state = trainer.init_state()
        for _ in range(2):
            state, metrics = trainer.train_step(state)
        results[diagnostics] = (jax.device_get(state.params), jax.device_get(metrics))
    (params_on, metrics_on), (params_off, metrics_off) = results[True], results[False]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 params_on, params_off)
    assert {"policy/approx_kl_k3", "value/explained_variance", "grad_norm"} <= set(metrics_on)
    assert set(metrics_off) == set(metrics_on) - {
        k for k in metrics_on if k.startswith(("policy/", "value/")) or k == "grad_norm"}
    for name in metrics_off:
        np.testing.assert_allclose(metrics_off[name], metrics_on[name], rtol=1e-6, atol=1e-7)


def test_vector_update_on_the_flat_vector_is_the_per_layer_update():
    """VectorPPO runs the gradient, the clip and Adam on one raveled parameter vector;
    two epochs of one minibatch must equal two plain optax steps on the parameter tree
    (one minibatch, so the epoch shuffle cannot change the loss)."""
    from jax.flatten_util import ravel_pytree

    from arl.trainers import VectorPPO

    config = _tiny_vector_config()
    config.updates.epochs, config.updates.minibatches = 2, 1
    trainer = VectorPPO(config)
    state = trainer.init_state()
    n = trainer.batch_size
    keys = jax.random.split(jax.random.key(3), 5)
    batch = dict(observation=jax.random.normal(keys[0], (n, 4)),
                 action=jax.random.randint(keys[1], (n,), 0, 2),
                 logp=jnp.log(jax.random.uniform(keys[2], (n,), minval=0.3, maxval=0.7)),
                 value=jax.random.normal(keys[3], (n,)),
                 advantages=jax.random.normal(keys[4], (n,)),
                 returns=jax.random.normal(keys[4], (n,)) + 1.0)
    num_params = ravel_pytree(state.params)[0].size
    assert {leaf.shape for leaf in jax.tree.leaves(state.opt_state)} == {(), (num_params,)}
    params, _, metrics = jax.jit(trainer.update)(
        state.params, state.opt_state, batch, jax.random.key(0))

    @jax.jit  # one program: op-by-op dispatch of the reference would dominate the test
    def two_tree_steps(reference):
        tree_opt_state = trainer.optimizer.init(reference)
        grad_norms = []
        for _ in range(2):
            grads, _ = jax.grad(trainer.loss, has_aux=True)(
                reference, batch)
            grad_norms.append(optax.global_norm(grads))
            updates, tree_opt_state = trainer.optimizer.update(grads, tree_opt_state,
                                                               reference)
            reference = optax.apply_updates(reference, updates)
        return reference, grad_norms

    reference, grad_norms = two_tree_steps(state.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 params, reference)
    assert not np.allclose(ravel_pytree(params)[0], ravel_pytree(state.params)[0])
    np.testing.assert_allclose(metrics["grad_norm"], np.mean(grad_norms), rtol=1e-5)
    assert list(metrics) == sorted(metrics)


@pytest.fixture
def compilation_cache(tmp_path):
    """A persistent compilation cache for this test only: the second `run` builds a new
    VectorPPO whose (identical) program is then read back instead of compiled."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_run_in_process_writes_outputs_and_extends(tmp_path, compilation_cache):
    from arl.runs import checkpoint
    from arl.runs import experiment

    del compilation_cache
    config = _tiny_vector_config()
    records = experiment.run(config, str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["episode_return"]) for r in records)
    for name in ("metrics.jsonl", "curves.png", "tensorboard"):
        assert (tmp_path / name).exists(), name
    with checkpoint.Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [2, 3]  # every checkpoint_every steps and at the end

    config.train_steps = 5  # a longer run in the same workdir continues from step 3
    records = experiment.run(config, str(tmp_path))
    assert [r["step"] for r in records] == [4, 5]
    assert [r["step"] for r in writers.read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert experiment.run(config, str(tmp_path)) == []  # already done: nothing to do


def test_run_rejects_an_unwritable_workdir_before_compiling(tmp_path):
    from arl import config as config_lib
    from arl.runs import experiment

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(config_lib.ConfigError, match="workdir"):
        experiment.run(_tiny_vector_config(), str(blocker / "run"))


def test_resume_warns_of_changed_keys_not_of_keys_added_since(monkeypatch):
    """A checkpoint written before a key existed: the key's default is no change."""
    from arl import config as config_lib
    from arl.runs import experiment

    warnings = []
    monkeypatch.setattr(experiment.logging, "warning",
                        lambda fmt, *args: warnings.append(fmt % args))
    current = experiment.config_json(config_lib.default_config())
    saved = json.loads(json.dumps(current))
    del saved["model"]["remat"]
    experiment._warn_config_changes(saved, current)  # pylint: disable=protected-access
    assert not warnings
    saved["optim"]["learning_rate"] = 0.5
    experiment._warn_config_changes(saved, current)  # pylint: disable=protected-access
    assert len(warnings) == 1 and "optim.learning_rate (0.5 -> 0.001)" in warnings[0], warnings
