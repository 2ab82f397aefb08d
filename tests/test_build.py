"""One build: `arl.build(config)` is the trainer the experiment loop (and so the command
line, `experiments.train` -> `arl.runs.experiment.run`) runs, for every experiment in
configs/ plus a policy-lag and a rollout-mesh variant, and both run a config to the same
metrics.

The configs are found by listing configs/ (a new file is covered without anyone adding
it); each is built at a small model size (building compiles nothing). The configs that
take a Hugging Face checkpoint directory get a stand-in (tests/hf_standins.py).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os

import jax
import numpy as np
import pytest
from flax import struct

import arl
from arl import trainers
from arl.runs import checkpoint as checkpoint_lib
from arl.runs import evaluation
from arl.runs import experiment
from tests import golden_run, optional_envs

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(f[:-3] for f in os.listdir(os.path.join(_ROOT, "configs"))
                      if f.endswith(".py") and f != "__init__.py")


@pytest.fixture(scope="module")
def hf_standin(tmp_path_factory):
    """(stand-in Qwen2 checkpoint directory, a task JSONL) for the configs that take one."""
    pytest.importorskip("transformers")
    from tests.hf_standins import build_standin  # pylint: disable=import-outside-toplevel
    directory = build_standin(str(tmp_path_factory.mktemp("standin") / "qwen"), "qwen2")
    tasks = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"What is {a} plus 2?",
                                         "answer": str(a + 2)}) + "\n" for a in range(8)))
    return directory, str(tasks)


# get_config arguments and overrides of the configs that take an argument.
_ARGUMENTS = {
    "grpo_hf_checkpoint": lambda standin: ((standin[0],), {"env.kwargs.path": standin[1]}),
    "grpo_sql_hf": lambda standin: ((standin[0],), {}),
}


def _shipped(name, request):
    """configs/`name`.py's config at a small model size, or a skip for a file that is no
    experiment (no get_config)."""
    module = importlib.import_module(f"configs.{name}")
    if not callable(getattr(module, "get_config", None)):
        pytest.skip(f"configs/{name}.py defines no get_config: shared pieces")
    args, overrides = (), {}
    if name in _ARGUMENTS:
        args, overrides = _ARGUMENTS[name](request.getfixturevalue("hf_standin"))
    else:
        assert not [p for p in inspect.signature(module.get_config).parameters.values()
                    if p.default is inspect.Parameter.empty], f"add {name} to _ARGUMENTS"
    config = module.get_config(*args)
    optional_envs.skip_without_extra(config)
    config.update_from_flattened_dict(overrides)
    if config.algorithm != "ppo_vector" and not config.model.hf_checkpoint:
        golden_run._small_model(config, kv_heads=min(config.model.num_kv_heads, 2))  # pylint: disable=protected-access
    return config


def _lag_1(config):
    config.rollout.policy_lag, config.loss.off_policy_correction = 1, "tis"
    return config


def _rollout_mesh(config):  # on the fake CPU devices: device 0 trains, device 1 samples
    config.mesh, config.rollout.mesh = (1, 1, 1), (1, 1, 1)
    return config


VARIANTS = {"lag_1": _lag_1, "rollout_mesh": _rollout_mesh}
CASES = [(name, None) for name in CONFIG_FILES] + [
    ("grpo_bandit", "lag_1"), ("ppo_guess_number", "lag_1"),
    ("grpo_bandit", "rollout_mesh")]


def _expected_type(config):
    """The trainer a config describes (docs/async.md, README): written out here."""
    if config.algorithm == "ppo_vector":
        return trainers.VectorPPO
    if config.rollout.policy_lag > 0 or tuple(config.rollout.mesh):
        return trainers.TwoProgramTrainer
    return trainers.TokenTrainer


def _devices(mesh):
    return [d.id for d in mesh.devices.flat]


def _placement(trainer):
    """Where a trainer runs: (type, training devices, rollout devices, policy lag)."""
    if isinstance(trainer, trainers.TwoProgramTrainer):
        return (type(trainer), _devices(trainer.trainer.mesh), _devices(trainer.mesh),
                trainer.policy_lag)
    mesh = getattr(trainer, "mesh", None)
    return type(trainer), mesh and _devices(mesh), None, None


@pytest.mark.parametrize("name,variant", CASES,
                         ids=[n if v is None else f"{n}-{v}" for n, v in CASES])
def test_build_is_the_trainer_the_experiment_loop_runs(name, variant, request, tmp_path,
                                                       monkeypatch):
    config = _shipped(name, request)
    if variant is not None:
        config = VARIANTS[variant](config)
    built = arl.build(config)
    assert type(built) is _expected_type(config)  # pylint: disable=unidiomatic-typecheck
    if variant == "rollout_mesh":
        assert _placement(built)[1:3] == ([0], [1])
    if variant == "lag_1":
        assert built.policy_lag == 1

    ran = []
    monkeypatch.setattr(experiment, "_run_locked",
                        lambda trainer, *_: ran.append(trainer) or [])
    experiment.run(config, str(tmp_path / "run"))
    assert len(ran) == 1 and _placement(ran[0]) == _placement(built)


def _lag_1_bandit():
    config = _lag_1(golden_run.grpo_bandit())
    config.warm_start.sft_steps, config.sample_every, config.train_steps = 0, 0, 2
    config.loss.echo_coef = 0.1  # the update never skips: the parameters move every step
    return config


def test_build_and_the_experiment_loop_give_the_same_metrics_at_a_policy_lag(tmp_path):
    """The steps of a lag-1 run through `arl.build(config).train_step` log what
    `experiment.run` logs (bitwise): the same two programs, the same stale rollouts."""
    records = experiment.run(_lag_1_bandit(), str(tmp_path / "run"))
    trainer = arl.build(_lag_1_bandit())
    state = trainer.init_state()
    through_build = []
    for _ in range(2):
        state, metrics = trainer.train_step(state)
        through_build.append(jax.device_get(metrics))
    assert [r["step"] for r in records] == [1, 2]
    assert [m["off_policy/staleness"] for m in through_build] == [0, 1]
    for record, metrics in zip(records, through_build):
        # faults/* are the loop's non-finite guard's to read (arl.runs.run_guards), unlogged
        metrics = {k: v for k, v in metrics.items() if not k.startswith("faults/")}
        assert set(metrics) <= set(record)
        for key, value in metrics.items():
            assert record[key] == pytest.approx(float(value), rel=0, abs=0, nan_ok=True), key


@struct.dataclass
class AsyncCheckpoint:  # the name of `TwoProgramState` before the rename, same fields
    state: trainers.TrainState
    behaviour: tuple


def test_a_checkpoint_written_under_the_old_state_name_restores(tmp_path):
    """Orbax stores a pytree by its structure (field names), not its class: a two-program
    checkpoint written as `AsyncCheckpoint` restores into a `TwoProgramState`."""
    config = _lag_1_bandit()
    trainer = arl.build(config)
    state = trainer.trainer.init_state()
    state = state.replace(params=jax.tree.map(lambda p: p + 0.5, state.params))
    stale = jax.tree.map(lambda p: p - 1.0, state.params)
    with checkpoint_lib.Checkpointer(tmp_path / experiment.CHECKPOINT_DIR) as ckpt:
        ckpt.save(2, AsyncCheckpoint(state=state, behaviour=(stale,)), force=True,
                  metadata={"config": experiment.config_json(config)})
    step, params = evaluation.restore_params(trainer, str(tmp_path))
    assert step == 2
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with checkpoint_lib.Checkpointer(tmp_path / experiment.CHECKPOINT_DIR,
                                     read_only=True) as ckpt:
        restored, _ = ckpt.restore(2, trainer.abstract_state())
    assert isinstance(restored, trainers.TwoProgramState)
    for got, want in zip(jax.tree.leaves(restored.behaviour), jax.tree.leaves(stale)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
