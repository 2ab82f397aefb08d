"""Asynchronous rollouts (arl.trainers.two_program) on fake CPU devices: lag 0 through the
two programs is the synchronous two-program run bit for bit and the fused step to float
tolerance; at lag k update t trains on a rollout of the parameters of step max(t - k, 0);
resharding is exact; bad combinations are one-line config errors."""

import re

import jax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np
import pytest

from arl import config as config_lib
from arl.errors import ConfigError
from arl.trainers import TokenTrainer
from arl.trainers.two_program import TwoProgramTrainer
from tests.test_train import tiny_config

STEPS = 4


def async_config(**loss):
    c = tiny_config()
    c.mesh = (2, 1, 1)
    c.rollout.mesh = (2, 1, 1)  # disaggregated: devices 2-3 sample, 0-1 train
    c.rollout.policy_lag = 1
    c.loss.off_policy_correction = "tis"
    c.loss.echo_coef = 0.1  # the update never skips: the parameters move every step
    for key, value in loss.items():
        c.loss[key] = value
    return c


@pytest.fixture(scope="module")
def trainer():
    return TokenTrainer(async_config())


@pytest.fixture(scope="module")
def fresh_state(trainer):
    """`trainer.init_state()` as a function: the initial state is computed once and each
    call gives a copy on the training devices (init_state compiles its program at every
    call; the updates donate the state, so each run needs its own buffers)."""
    initial = trainer.init_state()
    shardings = trainer.state_shardings()
    return lambda: jax.device_put(initial, shardings, may_alias=False)


@pytest.fixture(scope="module")
def programs(trainer):
    """The two programs, compiled once (they do not depend on the lag)."""
    return TwoProgramTrainer(trainer)


@pytest.fixture
def two(programs, request, monkeypatch):
    monkeypatch.setattr(programs, "policy_lag", getattr(request, "param", 1))
    return programs


def leaves_equal(a, b):
    def host(tree):
        return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                           else x) for x in jax.tree.leaves(tree)]
    x, y = host(a), host(b)
    return len(x) == len(y) and all(np.array_equal(u, v) for u, v in zip(x, y))


def reference_run(two, state, steps, lag):
    """Rollout, wait, update, wait, in order, each rollout fed the parameters of step
    max(t - lag, 0) explicitly; returns (state, [(behaviour params, trajectory,
    metrics)])."""
    params_by_step = {0: two.behaviour_params(state)}
    key = two.state_key(state)
    out = []
    for t in range(steps):
        behaviour = params_by_step[max(t - lag, 0)]
        traj = jax.block_until_ready(two.rollout(behaviour, key, jnp.int32(t)))
        key = two._next_key(key)
        state, metrics = two.update(state, two.to_training(traj), jnp.int32(max(t - lag, 0)))
        params_by_step[t + 1] = two.behaviour_params(jax.block_until_ready(state))
        out.append((jax.device_get(behaviour), jax.device_get(traj), jax.device_get(metrics)))
    return state, out


def recorded_run(two, state, steps, monkeypatch):
    """`two.train_step` from `state`, recording what each rollout was called with."""
    calls = []
    rollout = two.rollout
    monkeypatch.setattr(two, "rollout", lambda params, key, step: calls.append(
        (jax.device_get(params), int(step))) or rollout(params, key, step))
    metrics = []
    state = two.start(state)
    for _ in range(steps):
        state, m = two.train_step(state)
        metrics.append(m)
    monkeypatch.setattr(two, "rollout", rollout)
    return state.state, calls, jax.device_get(metrics)


@pytest.mark.parametrize("two", [0, 2], indirect=True)
def test_pipelined_run_is_the_reference_run_with_delayed_params(fresh_state, two, monkeypatch):
    lag = two.policy_lag
    ref_state, ref = reference_run(two, fresh_state(), STEPS, lag)
    state, calls, metrics = recorded_run(two, fresh_state(), STEPS, monkeypatch)
    # ... and the rollout of the next step, out when the loop stops (train_steps > STEPS)
    assert [step for _, step in calls] == list(range(STEPS + 1))
    for t, ((params, _), (ref_params, _, ref_metrics), m) in enumerate(
            zip(calls, ref, metrics)):
        assert leaves_equal(params, ref_params), t  # the params of step max(t - lag, 0)
        assert leaves_equal(m, ref_metrics), t
        assert m["off_policy/staleness"] == min(t, lag)
    assert leaves_equal(state, ref_state)  # params, optimizer state, step, key
    if lag:  # the delay is real: rollout 2 read version 0, rollout 3 a newer one
        assert leaves_equal(calls[2][0], calls[0][0])
        assert not leaves_equal(calls[3][0], calls[0][0])
        # ... and the update sees it: pi_prox moved away from pi_behave.
        assert metrics[3]["off_policy/kl_behaviour_k3"] > 10 * abs(
            metrics[0]["off_policy/kl_behaviour_k3"])


@pytest.mark.parametrize("two", [0], indirect=True)
def test_lag_zero_matches_the_fused_step(trainer, fresh_state, two, monkeypatch):
    state, calls, metrics = recorded_run(two, fresh_state(), STEPS, monkeypatch)
    fused = fresh_state()
    for t in range(STEPS):
        fused, fused_metrics = trainer.train_step(fused)
        fused_metrics = jax.device_get(fused_metrics)
        for name, value in fused_metrics.items():
            np.testing.assert_allclose(metrics[t][name], value, rtol=1e-4, atol=1e-5,
                                       err_msg=f"step {t}: {name}")
        # On-policy: pi_prox (the trainer's forward) is the sampler's policy up to float
        # rounding, so TIS's weights are 1 and the behaviour KL ~0.
        assert metrics[t]["update_skipped"] == 0
        np.testing.assert_allclose(metrics[t]["off_policy/weight_mean"], 1.0, atol=1e-4)
        assert abs(metrics[t]["off_policy/kl_behaviour_k3"]) < 1e-6
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 jax.device_get(state.params), jax.device_get(fused.params))


def test_resharding_round_trip_is_exact(trainer, fresh_state, two):
    training = {d.id for d in trainer.mesh.devices.flat}
    sampling = {d.id for d in two.mesh.devices.flat}
    assert training == {0, 1} and sampling == {2, 3}
    state = fresh_state()
    on_rollout = two.behaviour_params(state)
    for leaf in jax.tree.leaves(on_rollout):
        assert {d.id for d in leaf.devices()} == sampling
    back = jax.device_put(on_rollout, trainer.layout.param_shardings)
    assert leaves_equal(back, state.params)
    traj = two.rollout(on_rollout, two.state_key(state), jnp.int32(0))
    moved = two.to_training(traj)
    assert {d.id for d in moved.tokens.devices()} == training
    assert leaves_equal(moved, traj)


def test_snapshots_survive_donation(trainer, fresh_state):
    """A behaviour copy is its own buffers: the update that donates the state leaves it."""
    two = TwoProgramTrainer(trainer, mesh=trainer.mesh)  # colocated: same shardings
    state = fresh_state()
    snapshot = two.behaviour_params(state)
    before = jax.device_get(snapshot)
    traj = two.rollout(snapshot, two.state_key(state), jnp.int32(0))
    state, _ = two.update(state, two.to_training(traj), jnp.int32(0))
    assert leaves_equal(snapshot, before)


@pytest.mark.parametrize("two", [2], indirect=True)
def test_a_restored_state_recomputes_the_rollouts_in_flight(fresh_state, two):
    """A state `train_step` did not return itself (here: copied through the host, as a
    checkpoint restores it) carries on bit for bit: the rollouts the first run had in
    flight are sampled again from the behaviour versions in the state."""
    state = two.init_state()
    straight = []
    for _ in range(4):
        state, metrics = two.train_step(state)
        straight.append(jax.device_get(metrics))
    final = jax.device_get(state)

    state = two.start(fresh_state())
    for _ in range(2):
        state, _ = two.train_step(state)
    assert len(state.behaviour) == 2  # versions 0 and 1: rollouts 2 and 3
    shardings = jax.tree.map(lambda x: x.sharding, state)
    restored = jax.device_put(jax.device_get(state), shardings)
    for t in (2, 3):
        restored, metrics = two.train_step(restored)
        assert leaves_equal(jax.device_get(metrics), straight[t]), t
    assert leaves_equal(jax.device_get(restored), final)


def test_the_update_is_dispatched_before_the_next_rollout(trainer, fresh_state, two,
                                                          monkeypatch):
    """At lag 1 rollout t + 1 is dispatched after update t (a rollout that holds the
    host would otherwise delay the update), and the run's last step samples none."""
    calls = []
    for name in ("rollout", "update"):
        program = getattr(two, name)
        monkeypatch.setattr(two, name, lambda *args, program=program, name=name: calls.append(
            name) or program(*args))
    monkeypatch.setattr(trainer.config, "train_steps", 3)
    monkeypatch.setattr(two, "_rollout_first", None)
    state = two.start(fresh_state())
    for _ in range(3):
        state, _ = two.train_step(state)
    assert calls == ["rollout", "update", "rollout", "update", "rollout", "update"]
    assert two._rollout_first is False  # decided from the programs: no host env here


def test_the_program_that_calls_the_host_goes_second(two, monkeypatch):
    """A program with host callbacks holds the dispatching thread: the rollout goes
    first only when the update calls the host and the rollout does not."""
    calls_host = jax.jit(lambda *args: io_callback(
        lambda: np.int32(0), jax.ShapeDtypeStruct((), jnp.int32), ordered=True))
    pure = jax.jit(lambda *args: jnp.int32(0))
    for rollout, update, rollout_first in ((pure, pure, False), (calls_host, pure, False),
                                           (pure, calls_host, True),
                                           (calls_host, calls_host, False)):
        monkeypatch.setattr(two, "_rollout_program", rollout)
        monkeypatch.setattr(two, "_update_program", update)
        monkeypatch.setattr(two, "_rollout_first", None)
        assert two.rollout_first((jnp.int32(1),), (jnp.int32(2),)) == rollout_first


@pytest.mark.parametrize("changes,field", [
    (dict(policy_lag=1, correction="none"), "loss.off_policy_correction"),
    (dict(rollout_mesh=(4, 1, 1)), "rollout.mesh"),  # 2 + 4 > ... fine; 2 + 8 is not
    (dict(rollout_mesh=(8, 1, 1)), "rollout.mesh"),
    (dict(rollout_mesh=(1, 1)), "rollout.mesh"),
    (dict(correction="vtrace"), "loss.off_policy_correction"),
    (dict(cap=0.5), "loss.off_policy_cap"),
    (dict(reuse=True), "updates.reuse_rollout_activations"),
    (dict(mc_samples=2), "process.mc_samples"),
])
def test_bad_combinations_are_one_line_errors(changes, field):
    c = async_config()
    c.rollout.policy_lag = changes.get("policy_lag", 1)
    c.loss.off_policy_correction = changes.get("correction", "tis")
    c.rollout.mesh = changes.get("rollout_mesh", (2, 1, 1))
    c.loss.off_policy_cap = changes.get("cap", 2.0)
    c.updates.reuse_rollout_activations = changes.get("reuse", False)
    c.process.mc_samples = changes.get("mc_samples", 0)
    if changes.get("rollout_mesh") == (4, 1, 1):
        config_lib.validate(c, num_devices=8)  # 2 + 4 devices of 8: valid
        return
    with pytest.raises(ConfigError, match="^config." + re.escape(field) + "=") as error:
        config_lib.validate(c, num_devices=8)
    assert "\n" not in str(error.value)


def test_vector_trainer_refuses_a_lag():
    c = config_lib.default_config()
    c.algorithm = "ppo_vector"
    c.env.name = "gymnax:CartPole-v1"
    c.rollout.policy_lag = 1
    with pytest.raises(ConfigError, match="^config.rollout.policy_lag=1 is invalid: the vector"):
        config_lib.validate(c, num_devices=1)


def _experiment_config():
    """A tiny bandit run at lag 2, disaggregated; `_EXPERIMENT_FLAGS` on the command line."""
    from configs import grpo_bandit

    c = grpo_bandit.get_config()
    c.train_steps, c.log_every, c.checkpoint_every, c.sample_every = 7, 1, 2, 3
    c.rollout.num_tasks, c.rollout.group_size = 4, 2
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 32, 1, 64
    c.model.num_heads = c.model.num_kv_heads = 2
    c.warm_start.sft_steps = 0
    c.loss.echo_coef = 0.1  # keeps the parameters moving when every group is degenerate
    c.rollout.policy_lag = 2
    c.rollout.mesh = (1, 1, 1)
    c.loss.off_policy_correction = "decoupled"
    c.loss.off_policy_level = "sequence"
    return c


_EXPERIMENT_FLAGS = (
    "--config=configs/grpo_bandit.py", "--config.train_steps=7", "--config.log_every=1",
    "--config.checkpoint_every=2", "--config.sample_every=3",
    "--config.rollout.num_tasks=4", "--config.rollout.group_size=2",
    "--config.model.d_model=32", "--config.model.num_layers=1", "--config.model.mlp_dim=64",
    "--config.model.num_heads=2", "--config.model.num_kv_heads=2",
    "--config.warm_start.sft_steps=0", "--config.loss.echo_coef=0.1",
    "--config.rollout.policy_lag=2", "--config.rollout.mesh=(1,1,1)",
    "--config.loss.off_policy_correction=decoupled", "--config.loss.off_policy_level=sequence",
)


def test_sigkilled_cli_run_at_lag_two_resumes_exactly(tmp_path):
    """`experiments.train` at lag 2, killed with SIGKILL after step 5 (checkpoint 4
    committed; rollout 5 in flight, versions 3-5 held on the rollout side), restarted on
    the same workdir, ends bit for bit where an uninterrupted run ends: metrics of every
    step, params, optimizer state, key, and the behaviour versions in the last
    checkpoint. Checkpoints hold the behaviour parameters of the rollouts not yet trained
    on; the resumed run recomputes those rollouts (docs/async.md, "Exactness")."""
    import json
    import os
    import signal

    from arl.runs import experiment, writers
    from tests.test_experiment import _final_state, _flat_arrays, _train

    # The uninterrupted run in this process (the same XLA flags as the CLI runs, which
    # inherit them), the interrupted one through the CLI.
    reference = experiment.run(_experiment_config(), str(tmp_path / "reference"))
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", tmp_path / "jax_cache")
    killed = _train(tmp_path / "resumed", _EXPERIMENT_FLAGS, cache,
                    "--debug_kill_after_step=5")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    assert sorted(os.listdir(tmp_path / "resumed" / "checkpoints")) == ["2", "4"]
    resumed = _train(tmp_path / "resumed", _EXPERIMENT_FLAGS, cache)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "Resumed from step 4" in resumed.stdout
    assert "differs from the checkpoint" not in resumed.stdout

    raw = [json.loads(line) for line in
           (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in raw] == [1, 2, 3, 4, 5, 6, 7]  # 5 dropped, logged again
    assert writers.read_metrics(tmp_path / "resumed") == writers.read_metrics(
        tmp_path / "reference") == reference  # every metric of every step, bitwise
    assert [r["off_policy/staleness"] for r in reference] == [0, 1, 2, 2, 2, 2, 2]
    assert "eval/success_rate" in reference[5]  # evaluation runs on the async path

    final = [_flat_arrays(_final_state(tmp_path / run, 7)) for run in ("reference", "resumed")]
    assert sorted(final[0]) == sorted(final[1])
    for name, value in final[0].items():
        assert value.dtype == final[1][name].dtype and np.array_equal(value, final[1][name]), name
    assert {name.split("/")[0] for name in final[0]} == {"state", "behaviour"}
    assert {name.split("/")[1] for name in final[0] if name.startswith("behaviour")} == {
        "0", "1"}  # the versions of rollouts 7 and 8
    # Evaluation and export read the policy out of such a checkpoint.
    from arl import trainers
    from arl.runs import evaluation
    step, params = evaluation.restore_params(trainers.build(_experiment_config()),
                                             str(tmp_path / "resumed"))
    assert step == 7 and leaves_equal(params, _final_state(tmp_path / "resumed", 7)[
        "state"]["params"])
    at_resume = _flat_arrays(_final_state(tmp_path / "resumed", 4))
    assert any(not np.array_equal(at_resume[name], final[1][name]) for name in final[1]
               if name.startswith("state/params")), "vacuous: the params did not move"


# Placement across processes (arl.trainers.placement), with the eight devices of this
# process standing for two processes of four: the plan of each move and its refusals.
def _two_processes(device):
    return device.id // 4


def _mesh(ids):
    from arl import sharding as sharding_lib
    by_id = {d.id: d for d in jax.devices()}
    return sharding_lib.make_mesh((len(ids), 1, 1), [by_id[i] for i in ids])


def test_meshes_sharing_every_process_move_inside_each_process():
    from arl import sharding as sharding_lib
    from arl.trainers import placement
    training, rollout = _mesh([0, 4]), _mesh([1, 5])  # device 0 and 1 of each "process"
    plan = placement.local_plan(sharding_lib.batch_sharding(rollout),
                                sharding_lib.batch_sharding(training), (8, 3), _two_processes)
    assert {d.id: (s.id, block) for d, (s, block) in plan.items()} == {
        0: (1, (slice(0, 4), slice(0, 3))), 4: (5, (slice(0, 4), slice(0, 3)))}
    # A target block inside a larger source block is sliced out of it.
    plan = placement.local_plan(sharding_lib.replicated(_mesh([1, 5])),
                                sharding_lib.batch_sharding(_mesh([0, 2, 4, 6])), (8,),
                                _two_processes)
    assert {d.id: (s.id, block) for d, (s, block) in plan.items()} == {
        0: (1, (slice(0, 2),)), 2: (1, (slice(2, 4),)), 4: (5, (slice(4, 6),)),
        6: (5, (slice(6, 8),))}


@pytest.mark.parametrize("training,rollout", [
    ([0, 1], [4, 5]),  # training in one process, rollout in the other
    ([0, 4], [5, 1]),  # both on every process, but the rows of process 0 sample in 1
])
def test_a_move_across_processes_is_a_one_line_config_error(training, rollout):
    from arl import sharding as sharding_lib
    from arl.trainers import placement
    with pytest.raises(ConfigError, match=r"^config\.rollout\.mesh=\(2, 1, 1\) is invalid: "
                       r"the trajectory rows cannot move between the meshes inside each "
                       r"process \(device .* needs the block") as error:
        placement.check_local("rollout.mesh", (2, 1, 1),
                              sharding_lib.batch_sharding(_mesh(rollout)),
                              sharding_lib.batch_sharding(_mesh(training)), (8,),
                              "the trajectory rows", _two_processes)
    assert "\n" not in str(error.value)


def test_shard_by_shard_move_is_device_put():
    """The cross-process move, run here in one process: the same arrays as
    `jax.device_put`, typed keys included, on buffers of their own."""
    from arl import sharding as sharding_lib
    from arl.trainers import placement
    source, target = _mesh([1, 5]), _mesh([0, 2, 4, 6])
    x = jax.device_put(jnp.arange(24.0).reshape(8, 3), sharding_lib.batch_sharding(source))
    keys = jax.device_put(jax.random.split(jax.random.key(1), 8),
                          sharding_lib.batch_sharding(source))
    replicated = jax.device_put(x, sharding_lib.replicated(source))
    for array, sharding in ((x, sharding_lib.batch_sharding(target)),
                            (replicated, sharding_lib.replicated(target)),
                            (replicated, sharding_lib.batch_sharding(target)),
                            (keys, sharding_lib.batch_sharding(target))):
        moved = placement._move_leaf(array, sharding)  # pylint: disable=protected-access
        assert moved.sharding == sharding
        assert leaves_equal(moved, jax.device_put(array, sharding))
        assert {d.id for d in moved.devices()} == {0, 2, 4, 6}
