"""Python reward functions on the host (`arl.rewards.functions`): episodes decoded
from rollout rows (arl's codec and a checkpoint's chat template), the dataset's prompts
and columns handed over, weights, None, and every failure as one line naming the
function and the row, or scored 0 and counted."""

import jax
import numpy as np
import pytest

from arl.text.hf_codec import HFCodec
from arl.rewards.functions import RewardFunctions, episode_texts, episodes, resolve
from arl.envs.tasks.dataset_task import DatasetTask
from arl.errors import RewardFunctionError
from arl.rollout.rollouts import scripted_rollout
from tests import hf_standins, user_rewards

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _chat_rows(count=8):
    return [{"prompt": [{"role": "system", "content": "Reply with a number."},
                        {"role": "user", "content": f"{a} plus 3?"}],
             "answer": str(a + 3), "weight": float(a) if a % 2 else None, "tag": f"t{a}"}
            for a in range(count)]


@pytest.fixture(scope="module")
def chat_env(tmp_path_factory):
    """dataset_task on a Parquet file of chat prompts, with a Qwen2.5-style stand-in's
    chat template (system message from the rows)."""
    root = tmp_path_factory.mktemp("chat")
    checkpoint = hf_standins.build_standin(str(root / "qwen"), "qwen2")
    codec = HFCodec.from_pretrained(checkpoint)
    return DatasetTask(_parquet(root / "tasks.parquet", _chat_rows()), codec=codec,
                       max_turns=2, eval_fraction=0.25), checkpoint


def test_oracle_episodes_decode_to_the_rows_text_and_columns(chat_env):
    env, checkpoint = chat_env
    assert env.codec.chat.system_prompt == "Reply with a number."
    traj = scripted_rollout(env, jax.random.key(0), num_tasks=6, group_size=1)
    batch = episodes(env, traj.tokens, traj.agent_mask, traj.length, traj.task_rows)
    rows = [int(r) for r in traj.task_rows]
    answers = [env.tasks.answer_texts[r] for r in rows]
    assert batch.completions == answers  # the oracle writes the reference, eot dropped
    assert batch.columns["answer"] == answers
    for b, row in enumerate(rows):
        source = env.tasks.source_prompt(row)
        assert batch.prompts[b] == source and source[0]["role"] == "system"
        a = int(answers[b]) - 3
        assert source[1]["content"] == f"{a} plus 3?"
        assert batch.columns["tag"][b] == f"t{a}"
        assert batch.columns["weight"][b] == (float(a) if a % 2 else None)
        # The whole episode: the prompt's messages, the answer, the env's "correct".
        assert batch.messages[b] == source + [
            {"role": "assistant", "content": answers[b]}, {"role": "user", "content": "correct"}]
    # The rollout's first observation is what transformers' template renders.
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    row = rows[0]
    expected = tokenizer.apply_chat_template(env.tasks.source_prompt(row), tokenize=True,
                                             add_generation_prompt=True)
    expected = list(getattr(expected, "input_ids", expected))
    prompt_len = len(expected)
    assert traj.tokens[0, :prompt_len].tolist() == expected
    assert float(traj.agent_mask[0, prompt_len - 1]) == 0.0
    assert float(traj.agent_mask[0, prompt_len]) == 1.0


def test_wrong_answers_and_replies_in_messages(tmp_path):
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(1, 9)]
    env = DatasetTask(_parquet(tmp_path / "t.parquet", rows), max_turns=2)
    traj = scripted_rollout(env, jax.random.key(1), num_tasks=8, group_size=1,
                            action_source="demonstrator")
    batch = episodes(env, traj.tokens, traj.agent_mask, traj.length, traj.task_rows)
    for b in range(8):
        prompt, turns = episode_texts(env, traj.tokens[b], traj.agent_mask[b], traj.length[b])
        row = int(traj.task_rows[b])
        assert prompt == batch.prompts[b] == env.tasks.source_prompt(row) == f"{row_a(env, row)}+1="
        assert [r for r, _ in turns][:2] == ["assistant", "user"]
        assert turns[1][1] in ("correct", "wrong, try again")
        assert batch.completions[b] == [c for r, c in turns if r == "assistant"][-1]
        assert (turns[1][1] == "correct") == (turns[0][1] == env.tasks.answer_texts[row])


def row_a(env, row):
    return int(env.tasks.answer_texts[row]) - 1


def _batch(completions, dataset_rows=None, **columns):
    from arl.rewards.functions import Episodes
    return Episodes(prompts=[f"p{r}" for r in range(len(completions))],
                    completions=list(completions), messages=[[]] * len(completions),
                    columns=columns, dataset_rows=dataset_rows)


def test_scores_weights_and_none():
    scorer = RewardFunctions(["tests.user_rewards:length", user_rewards.echo_column],
                             weights=[0.5, 2.0])
    scores, errors = scorer.score(_batch(["ab", "", "abcd"], weight=[1.5, None, -2]))
    np.testing.assert_array_equal(scores[:, 0], [2.0, 0.0, 4.0])
    np.testing.assert_array_equal(scores[:, 1], [1.5, np.nan, -2.0])
    assert errors.tolist() == [0, 0] and scorer.names == ["length", "echo_column"]
    np.testing.assert_array_equal(scorer.weights, [0.5, 2.0])


@pytest.mark.parametrize("function,row,message", [
    ("explodes_on_x", 1, "raised ValueError: cannot score 'x' on dataset row 41, prompt "
     "'p1', completion 'x' (batch row 1 of 3)"),
    ("nan_on_y", 2, "returned the non-finite value nan on dataset row 7, prompt 'p2', "
     "completion 'y' (batch row 2 of 3)"),
    ("too_few", None, "returned list of length 2, not one number (or None) per row for 3"),
])
def test_failures_are_one_line_naming_function_and_row(function, row, message):
    spec = f"tests.user_rewards:{function}"
    rows = [12, 41, 7]  # the rows of the env's dataset the batch played
    with pytest.raises(RewardFunctionError) as error:
        RewardFunctions([spec]).score(_batch(["a", "x", "y"], dataset_rows=rows))
    text = str(error.value)
    assert "\n" not in text and text.startswith(f"reward function {spec!r} ")
    assert message in text and "reward.on_error='zero'" in text
    # on_error="zero": the bad rows score 0 (NaN: left out of the function's mean, like
    # an unscored row) and are counted apart; the others keep theirs.
    scorer = RewardFunctions([spec], on_error="zero")
    scores, errors = scorer.score(_batch(["a", "x", "y"], dataset_rows=rows))
    bad = [row] if row is not None else [0, 1, 2]
    assert errors.tolist() == [len(bad)]
    expected = [np.nan if r in bad else 1.0 for r in range(3)]
    np.testing.assert_array_equal(scores[:, 0], expected)
    assert message in scorer.failure


def test_an_env_without_a_dataset_names_the_prompt_only():
    with pytest.raises(RewardFunctionError, match=r"on prompt 'p1', completion 'x' "
                                                  r"\(batch row 1 of 2\);"):
        RewardFunctions(["tests.user_rewards:explodes_on_x"]).score(_batch(["a", "x"]))


def test_a_slow_function_is_cut_at_its_time_limit():
    scorer = RewardFunctions(["tests.user_rewards:sleeps", "tests.user_rewards:length"],
                             timeout_s=0.2, on_error="zero")
    scores, errors = scorer.score(_batch(["ab", "c"]))
    assert errors.tolist() == [2, 0]
    np.testing.assert_array_equal(scores, [[np.nan, 2.0], [np.nan, 1.0]])
    with pytest.raises(RewardFunctionError, match=r"^reward function 'tests.user_rewards:"
                                                  r"sleeps' did not return within "
                                                  r"timeout_s=0.2 s on a batch of 2 rows"):
        RewardFunctions(["tests.user_rewards:sleeps"], timeout_s=0.2).score(_batch(["a", "b"]))


@pytest.mark.parametrize("spec,message", [
    ("tests.user_rewards", "expected 'module:function'"),
    ("tests.no_such_module:f", "importing 'tests.no_such_module' failed"),
    ("tests.user_rewards:missing", "has no 'missing'"),
    ("tests.user_rewards:NOT_A_FUNCTION", "is a int, not a function"),
])
def test_resolve_names_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve(spec)


def test_bad_settings():
    with pytest.raises(ValueError, match="weights must be 1 finite numbers"):
        RewardFunctions(["tests.user_rewards:length"], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="share a name"):
        RewardFunctions(["tests.user_rewards:length", user_rewards.length])
    with pytest.raises(ValueError, match="on_error must be one of"):
        RewardFunctions(["tests.user_rewards:length"], on_error="ignore")


def test_columns_may_not_shadow_arguments(tmp_path):
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1), "completions": "x"} for a in range(4)]
    env = DatasetTask(_parquet(tmp_path / "t.parquet", rows), eval_fraction=0.25)
    traj = scripted_rollout(env, jax.random.key(0), num_tasks=2, group_size=1)
    with pytest.raises(RewardFunctionError, match="column 'completions' has the name of a "
                                                  "reward function argument"):
        episodes(env, traj.tokens, traj.agent_mask, traj.length, traj.task_rows)


def test_any_token_env_gives_its_decoded_turns():
    """An env without a dataset (guess_number, several turns): the prompt is the decoded
    first observation, no columns; the turns are what `render_trajectory` shows."""
    from arl.envs import make_env  # pylint: disable=g-import-not-at-top
    from arl.rollout.trajectory import render_trajectory  # pylint: disable=g-import-not-at-top

    env = make_env({"name": "guess_number"})
    traj = scripted_rollout(env, jax.random.key(2), num_tasks=4, group_size=1,
                            action_source="demonstrator")
    assert traj.task_rows is None
    batch = episodes(env, traj.tokens, traj.agent_mask, traj.length, traj.task_rows)
    assert batch.columns == {}
    for b in range(4):
        shown = render_trajectory(env, traj, b).splitlines()[:-1]
        # "[agent] text    (reward +0.000)" and "[env]   text": 8 characters of prefix.
        # render_trajectory spells the agent's end-of-turn token; the episodes drop it.
        texts = [line[8:].split("    (reward")[0].removesuffix("<eot>") for line in shown]
        assert batch.prompts[b] == texts[0]
        assert [m["content"] for m in batch.messages[b]] == texts
        assert [m["role"] for m in batch.messages[b]][:3] == ["user", "assistant", "user"]
        agent_lines = [t for line, t in zip(shown, texts) if line.startswith("[agent]")]
        assert batch.completions[b] == agent_lines[-1]
        assert int(traj.num_turns[b]) >= 2
