"""experiments/evaluate.py and arl.runs.evaluation on a tiny mixture checkpoint."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from absl import flags

from arl import config as config_lib
from arl import trainers
from arl.runs import checkpoint, evaluation, experiment


def _tiny_mixture_config():
    c = config_lib.default_config()
    c.algorithm = "erpo"
    c.env.name = "mixture"
    c.env.members = ({"name": "bandit", "kwargs": {}},
                     {"name": "bandit", "kwargs": {"low_name": "cat", "high_name": "dog"}})
    c.rollout.num_tasks = 4
    c.rollout.group_size = 2
    c.model.d_model = 32
    c.model.num_layers = 1
    c.model.num_heads = 2
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 64
    return c


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A run directory holding one checkpoint (the initial state) and its config."""
    path = tmp_path_factory.mktemp("eval_run")
    config = _tiny_mixture_config()
    trainer = trainers.build(config)
    with checkpoint.Checkpointer(path / "checkpoints") as ckpt:
        ckpt.save(3, trainer.init_state(), force=True,
                  metadata={"config": experiment.config_json(config)})
    return path


def test_checkpoint_config_round_trips(workdir):
    step, config = evaluation.checkpoint_config(str(workdir))
    assert step == 3
    assert config.algorithm == "erpo"
    assert [m["name"] for m in config.env.members] == ["bandit", "bandit"]
    assert tuple(config.mesh) == (1, 1, 1)
    config_lib.validate(config, num_devices=1)


def test_checkpoint_config_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint with a stored config"):
        evaluation.checkpoint_config(str(tmp_path))


def test_success_table_per_env_and_all():
    traj = evaluation.rollout_lib.Trajectory(
        tokens=None, agent_mask=None, observation_mask=None, behaviour_logp=None,
        rewards=None, turn_end_mask=None, length=None, group_ids=None,
        env_ids=np.array([0, 1, 0, 1]), num_turns=np.array([1, 2, 1, 3]),
        success=np.array([True, False, False, True]),
        terminated=None, episode_return=np.array([1.0, 0.0, -0.5, 0.5]),
        format_errors=np.array([0, 1, 1, 0]))
    rows = evaluation.success_table(("0_bandit", "1_bandit"), traj)
    assert [r["env"] for r in rows] == ["0_bandit", "1_bandit", "all"]
    assert [r["tasks"] for r in rows] == [2, 2, 4]
    np.testing.assert_allclose([r["success_rate"] for r in rows], [0.5, 0.5, 0.5])
    np.testing.assert_allclose([r["return_mean"] for r in rows], [0.25, 0.25, 0.25])
    np.testing.assert_allclose([r["turns_mean"] for r in rows], [1.0, 2.5, 1.75])
    np.testing.assert_allclose([r["format_error_rate"] for r in rows], [0.5, 0.2, 2 / 7])
    text = evaluation.format_table({"greedy": rows})
    assert text.splitlines()[2].split()[:4] == ["greedy", "0_bandit", "2", "0.500"]


@pytest.mark.parametrize("baselines", [
    False, pytest.param(True, marks=pytest.mark.slow)])  # each policy is one more compile
def test_evaluate_cli_prints_table_and_transcripts(workdir, capsys, baselines):
    from experiments import evaluate

    argv = ["evaluate", f"--workdir={workdir}", "--num_tasks=6", "--num_transcripts=2",
            f"--{'' if baselines else 'no'}baselines"]
    flags.FLAGS(argv)
    try:
        evaluate.main(argv)
    finally:
        flags.FLAGS.unparse_flags()
    out = capsys.readouterr().out
    assert "Checkpoint step 3" in out
    lines = {tuple(line.split()[:2]): line.split() for line in out.splitlines()
             if line.split()[:1] in (["greedy"], ["sampled"], ["demonstrator"], ["oracle"])}
    policies = ("greedy", "sampled") + (("demonstrator", "oracle") if baselines else ())
    assert {policy for policy, _ in lines} == set(policies)
    for policy in policies:
        for env in ("0_bandit", "1_bandit", "all"):
            assert (policy, env) in lines, (policy, env)
    # An untrained policy never names an arm; the oracle always picks the better one.
    assert float(lines[("greedy", "all")][3]) == 0.0
    if baselines:
        assert float(lines[("oracle", "all")][3]) == 1.0
    assert lines[("sampled", "all")][2] == "6"
    assert out.count("--- sampled transcript") == 2
    assert "arms: " in out and "[agent]" in out


def test_evaluate_policy_rejects_bad_num_tasks(workdir):
    trainer = trainers.build(evaluation.checkpoint_config(str(workdir))[1])
    with pytest.raises(ValueError, match="num_tasks must be an integer >= 1"):
        evaluation.evaluate_policy(trainer, None, jax.random.key(0), num_tasks=0, greedy=True)


def test_restore_params_of_a_run_at_a_policy_lag(tmp_path):
    """A run at policy lag k checkpoints the pending rollouts' behaviour parameters next to
    the state (two_program.TwoProgramState): evaluation and export read the state's
    parameters out of it, not a behaviour copy."""
    from arl.trainers import two_program

    config = _tiny_mixture_config()
    config.rollout.policy_lag = 2
    config.loss.off_policy_correction = "tis"
    trainer = trainers.build(config)
    assert isinstance(trainer, two_program.TwoProgramTrainer)
    state = trainer.trainer.init_state()
    state = state.replace(params=jax.tree.map(lambda p: p + 0.5, state.params))
    stale = jax.tree.map(lambda p: p - 1.0, state.params)
    with checkpoint.Checkpointer(tmp_path / "checkpoints") as ckpt:
        ckpt.save(7, two_program.TwoProgramState(state=state, behaviour=(stale, stale)),
                  force=True, metadata={"config": experiment.config_json(config)})
    step, params = evaluation.restore_params(trainer, str(tmp_path))
    assert step == 7
    expected = trainer.trainer.policy_params(state)
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_restore_params_of_a_given_step_or_a_one_line_error(workdir):
    """`restore_params(..., step)` (experiments.export --step): that checkpoint, or
    FileNotFoundError naming the steps there are; the trainer for a stored config whose
    mesh this machine cannot hold runs on one device."""
    _, config = evaluation.checkpoint_config(str(workdir))
    config.mesh = (jax.device_count() + 1, 1, 1)
    trainer = evaluation.trainer_for_checkpoint(config)
    assert tuple(trainer.config.mesh) == (1, 1, 1)
    step, params = evaluation.restore_params(trainer, str(workdir), 3)
    assert step == 3
    for got, want in zip(jax.tree.leaves(params),
                         jax.tree.leaves(evaluation.restore_params(trainer, str(workdir))[1])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint 4 in .* \(steps: \[3\]\)"):
        evaluation.restore_params(trainer, str(workdir), 4)
