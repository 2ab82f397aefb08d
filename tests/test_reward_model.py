"""An outcome reward model from a checkpoint inside the compiled step
(`arl.trainers.reward_model`): each episode's conversation rendered with the reward
model's own chat template and tokenizer, scored like transformers scores the same text,
added by weight to the env's scaled reward on the last turn end; a train step through
`arl.build` logs the scores and keeps the model frozen; the config's checks."""

import jax
import numpy as np
import pytest

import arl
from arl.errors import ConfigError
from arl.runs import checkpoint
from arl.rollout.rollouts import scripted_rollout
from arl.trainers.reward_model import OutcomeRewardModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from tests.hf_standins import build_reward_model_standin
    return build_reward_model_standin(str(tmp_path_factory.mktemp("rm")), "qwen2")


@pytest.fixture(scope="module")
def env_and_traj():
    env = arl.make_env({"name": "dataset_task", "kwargs": {"max_turns": 2}})
    traj = scripted_rollout(env, jax.random.key(3), num_tasks=6, group_size=1,
                            action_source="demonstrator")
    return env, traj


def _config(directory, **fields):
    c = arl.default_config()
    c.env.name = "dataset_task"
    c.reward_model.hf_checkpoint = directory
    for key, value in fields.items():
        setattr(c.reward_model, key, value)
    return c


def _transformers_scores(directory, conversations, max_length):
    """transformers' tokenizer, chat template and classifier on each conversation (the
    last `max_length` ids), one row at a time: no padding involved."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        directory, dtype=torch.float32).eval()
    scores = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][-max_length:]
        with torch.no_grad():
            scores.append(float(model(torch.tensor([ids])).logits[0, 0]))
    return np.array(scores)


def _recording(rm):
    """Keeps each conversation `rm` renders (in call order)."""
    seen = []
    token_ids = rm.token_ids

    def record(conversation):
        seen.append(conversation)
        return token_ids(conversation)
    rm.token_ids = record
    return seen


@pytest.mark.parametrize("max_length, truncated", [(256, 0), (40, 6)])
def test_scores_equal_transformers_and_add_by_weight(reward_model_dir, env_and_traj,
                                                     max_length, truncated):
    env, traj = env_and_traj
    rm = OutcomeRewardModel.from_config(
        _config(reward_model_dir, weight=0.5, max_length=max_length), env)
    seen = _recording(rm)
    params = rm.load()
    out, metrics = jax.jit(lambda p, t: rm(p, t, env_weight=0.25))(params, traj)
    assert len(seen) == 6
    for conversation in seen:  # the prompt, then the agent's turns and the env's replies
        roles = [m["role"] for m in conversation]
        assert len(roles) >= 2 and roles == ["user", "assistant"] * (len(roles) // 2) + [
            "user"] * (len(roles) % 2)
    want = _transformers_scores(reward_model_dir, seen, max_length)
    expected_return = 0.25 * np.asarray(traj.episode_return) + 0.5 * want
    np.testing.assert_allclose(out.episode_return, expected_return, rtol=1e-5, atol=1e-5)
    expected = 0.25 * np.asarray(traj.rewards)
    for b in range(6):
        expected[b, np.flatnonzero(np.asarray(traj.turn_end_mask[b]))[-1]] += 0.5 * want[b]
    np.testing.assert_allclose(out.rewards, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(metrics["reward/reward_model/mean"], want.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["reward/reward_model/std"], want.std(), rtol=1e-4,
                               atol=1e-6)
    assert float(metrics["reward/reward_model/truncated"]) == truncated
    assert want.std() > 1e-3  # the rows' scores differ: a mix-up of rows would show


def test_train_step_scores_episodes_and_keeps_the_model_frozen(reward_model_dir, tmp_path):
    c = _config(reward_model_dir, max_length=128)
    c.rollout.num_tasks, c.rollout.group_size = 2, 2
    c.model.d_model, c.model.num_heads, c.model.num_kv_heads, c.model.mlp_dim = 32, 4, 2, 64
    c.model.num_layers = 1
    trainer = arl.build(c)
    seen = _recording(trainer.reward_model)
    state = trainer.init_state()
    before = jax.tree.map(np.asarray, state.reward_model_params)
    state, metrics = trainer.train_step(state)
    assert len(seen) == 4
    want = _transformers_scores(reward_model_dir, seen, 128)
    np.testing.assert_allclose(metrics["reward/reward_model/mean"], want.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["reward/reward_model/std"], want.std(), rtol=1e-4,
                               atol=1e-6)
    after = state.reward_model_params
    assert all(np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    # Saved with the state, restored into the trainer's target, stepping again.
    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state, force=True)
        _, restored, _ = ckpt.restore_latest(trainer.abstract_state())
    assert all(np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(before), jax.tree.leaves(restored.reward_model_params)))
    _, metrics = trainer.train_step(restored)
    assert np.isfinite(float(metrics["reward/reward_model/mean"]))


@pytest.mark.parametrize("field, value, message", [
    ("hf_checkpoint", "/nonexistent/rm", "is not a directory"),
    ("max_length", 0, "must be >= 1"),
    ("dtype", "float16", "allowed values are"),
])
def test_config_checks_name_the_field(field, value, message):
    c = arl.default_config()
    setattr(c.reward_model, field, value)
    with pytest.raises(ConfigError, match=f"^config.reward_model.{field}=.*{message}"):
        arl.validate(c)


def test_policy_checkpoint_is_refused_as_a_reward_model(tmp_path):
    from tests.hf_standins import build_standin
    c = _config(build_standin(str(tmp_path / "policy"), "qwen2"))
    with pytest.raises(ConfigError, match="^config.reward_model.hf_checkpoint=.*is not a "
                                          "sequence classifier"):
        arl.validate(c)
