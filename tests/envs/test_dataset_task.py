"""`dataset_task` and its data path: JSONL -> make_dataset -> tfds dataset -> env.

Round trip (prompts decode back to the input lines), evaluation enumeration (every eval
row exactly once), episodes with hand-computed replies and rewards, oracle / demonstrator
success, string verifiers, an HF tokenizer, custom verifiers, errors, and the shipped
word-problem generator. The verifiers themselves: tests/envs/test_verifiers.py; the
shared fuzz / determinism / scan-carry tests: tests/envs/test_token_envs.py."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arl.envs as E
from arl import caches
from arl.data import task_files, text_tasks, word_problems
from arl.text import verifiers
from arl.envs.base import TokenChunk
from arl.envs.tasks.dataset_task import DatasetTask

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODEC = E.CharCodec()
BATCH = 64


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def shipped_dataset(tmp_path_factory):
    """The shipped word problems through the command-line tool (one subprocess)."""
    out = tmp_path_factory.mktemp("word_problems")
    result = subprocess.run(
        [sys.executable, "-m", "experiments.make_dataset",
         f"--input={word_problems.SHIPPED_JSONL}", f"--output={out}", "--tokenizer=char",
         "--eval_fraction=0.1", "--seed=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
    path = result.stdout.strip().splitlines()[-1]
    assert path == os.path.join(str(out), "arl_text_tasks", "1.0.0")
    return path


class Jitted:
    """reset / step / oracle / demonstrator of one env, jitted and vmapped over rows
    (params batched too, so `split_tasks` params run as they are)."""

    def __init__(self, env):
        self.env = env
        self.reset = jax.jit(jax.vmap(env.reset))
        self.step = jax.jit(jax.vmap(env.step))
        self.oracle = jax.jit(jax.vmap(env.oracle_action))
        self.demo = jax.jit(jax.vmap(env.demonstrator_action))

    def play(self, keys, params, policy):
        """Episodes of `policy` from reset keys [B]; (final state, per-turn timesteps)."""
        state, _ = self.reset(keys, params)
        act = self.oracle if policy == "oracle" else self.demo
        key = jax.random.key(99)
        steps = []
        for _ in range(self.env.max_turns):
            key, key_act, key_step = jax.random.split(key, 3)
            batch = keys.shape[0]
            action = act(jax.random.split(key_act, batch), state, params)
            state, ts = self.step(jax.random.split(key_step, batch), state, action, params)
            steps.append(ts)
        return state, steps

    def step_texts(self, state, texts, params, width=24):
        """Step ONE state with each text as the agent's turn (any action width works)."""
        rows = [CODEC.encode_padded(t, width) for t in texts]
        actions = TokenChunk(jnp.asarray(np.stack([r[0] for r in rows])),
                             jnp.asarray([r[1] for r in rows], jnp.int32))
        count = len(texts)
        states = jax.tree.map(lambda x: jnp.broadcast_to(x, (count,) + x.shape), state)
        batched = jax.tree.map(lambda x: jnp.broadcast_to(x, (count,) + x.shape), params)
        return self.step(jax.random.split(jax.random.key(0), count), states, actions, batched)


def batched(params, count):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (count,) + jnp.shape(x)), params)


# ---------------------------------------------------------------------------- data path
def test_jsonl_round_trip_through_make_dataset(shipped_dataset):
    lines = open(word_problems.SHIPPED_JSONL, encoding="utf-8").read().splitlines()
    train = text_tasks.load_text_tasks(shipped_dataset, "train")
    evaluation = text_tasks.load_text_tasks(os.path.dirname(os.path.dirname(shipped_dataset)),
                                            "eval")  # the --output directory works too
    assert (train.num_rows, evaluation.num_rows) == (270, 30)
    assert sorted(train.lines.tolist() + evaluation.lines.tolist()) == list(range(1, 301))
    metadata = train.metadata
    assert metadata["tokenizer"] == {"kind": "char", "vocab_size": CODEC.vocab_size}
    assert metadata["splits"] == {"train": 270, "eval": 30} and metadata["seed"] == 3
    assert metadata["widths"]["prompt"] == train.prompts.shape[1] == max(
        len(json.loads(line)["prompt"]) for line in lines)
    for tasks in (train, evaluation):
        for row in range(tasks.num_rows):
            source = json.loads(lines[tasks.lines[row] - 1])
            length = int(tasks.prompt_lengths[row])
            assert CODEC.decode(tasks.prompts[row, :length]) == source["prompt"]
            assert np.all(tasks.prompts[row, length:] == CODEC.pad_id)
            assert CODEC.decode(tasks.answers[row, :tasks.answer_lengths[row]]) == \
                source["answer"] == tasks.answer_texts[row]
            assert tasks.prompt_texts[row] == source["prompt"]
            chars, count = tasks.forms["number"]
            assert "".join(map(chr, chars[row, :count[row]])) == \
                verifiers.extract_number(source["answer"])


def test_bad_lines_are_listed_with_line_and_field(tmp_path):
    """A JSONL file's bad lines, as `build_text_tasks` and the env read it
    (`task_files.read_task_file`, the one reader of every format)."""
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "ok", "answer": "1"}, {"prompt": 3, "answer": "1"}, "not json", "",
        {"prompt": "b"}, {"prompt": "c", "answer": 1.5}, [1], {"prompt": "d", "answer": " "}])
    with pytest.raises(ValueError) as error:
        task_files.read_task_file(path)
    message = str(error.value)
    # One line: the first bad line in full, then where the other five are.
    assert "\n" not in message
    assert message.startswith(f"{path}:2: field 'prompt' must be a string or a non-empty "
                              "list of {'role', 'content'} messages, got int 3")
    assert message.endswith("(also bad rows at lines 3, 5, 6, 7, 8)")
    for number, expected in [(3, "not valid JSON"), (5, "missing field 'answer'"),
                             (6, "field 'answer' must be a string or an integer, got float"),
                             (7, "expected a JSON object"), (8, "field 'answer' is empty")]:
        bad = write_jsonl(tmp_path / f"bad{number}.jsonl",
                          [{"prompt": "ok", "answer": "1"}] * (number - 1)
                          + [json.loads(l) if l.startswith(("{", "[")) else l
                             for l in [open(path).read().splitlines()[number - 1]]])
        with pytest.raises(ValueError, match=f"^{bad}:{number}: {expected}"):
            task_files.read_task_file(bad)
    assert task_files.read_task_file(write_jsonl(
        tmp_path / "int.jsonl", [{"prompt": "p", "answer": 12}]))[0].answer == "12"


def test_long_rows_are_reported_not_cut(tmp_path):
    rows = [{"prompt": "a" * 9, "answer": "1"}, {"prompt": "b", "answer": "2"},
            {"prompt": "c", "answer": "3"}, {"prompt": "d", "answer": "4" * 7}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(ValueError, match=r"^[^\n]*long.jsonl:1: field 'prompt' has 9 tokens, "
                                         r"more than max_prompt_len=5 \(also rows over the "
                                         r"limits at lines 4\); raise max_prompt_len"):
        text_tasks.build_text_tasks(tmp_path / "a", path, max_prompt_len=5, max_answer_len=5)
    assert not (tmp_path / "a").exists()  # nothing written
    with pytest.raises(ValueError, match=r"long.jsonl:2: field 'prompt'.*'é'"):
        text_tasks.build_text_tasks(tmp_path / "b", write_jsonl(
            tmp_path / "long.jsonl", rows[:1] + [{"prompt": "é", "answer": "1"}]))
    logged = []
    out = text_tasks.build_text_tasks(
        tmp_path / "c", write_jsonl(tmp_path / "long.jsonl", rows), max_prompt_len=5,
        max_answer_len=5, drop_long=True, eval_fraction=0.5, log=logged.append)
    tasks = text_tasks.load_text_tasks(out, "train")
    assert tasks.metadata["dropped_lines"] == [1, 4] and tasks.prompts.shape[1] == 1
    assert sum("dropped" in m for m in logged) == 2
    with pytest.raises(ValueError, match="both splits need at least one row"):
        text_tasks.build_text_tasks(tmp_path / "d", path, eval_fraction=0.01)


# ---------------------------------------------------------------------------- episodes
@pytest.fixture(scope="module")
def eval_env(shipped_dataset):
    return Jitted(DatasetTask(shipped_dataset, split="eval", max_turns=2))


def test_split_tasks_visit_every_eval_row_exactly_once(eval_env):
    env = eval_env.env
    keys, params = env.split_tasks()
    state, ts = eval_env.reset(keys, params)
    assert np.asarray(state.row).tolist() == list(range(env.num_rows)) == list(range(30))
    np.testing.assert_array_equal(ts.observation.tokens, env.tasks.prompts)
    grouped_keys, grouped = env.split_tasks(group_size=3)
    rows = np.asarray(eval_env.reset(grouped_keys[:BATCH], jax.tree.map(
        lambda x: x[:BATCH], grouped))[0].row)
    assert rows.tolist() == [i // 3 for i in range(BATCH)]
    assert np.asarray(grouped.task_index).tolist() == [i // 3 for i in range(90)]
    # Without a task index, the row comes from the reset key: shared by equal keys.
    free = batched(env.default_params(), BATCH)
    same = jnp.stack([jax.random.key(5)] * BATCH)
    assert len(set(np.asarray(eval_env.reset(same, free)[0].row).tolist())) == 1
    drawn = eval_env.reset(jax.random.split(jax.random.key(5), BATCH), free)[0].row
    assert len(set(np.asarray(drawn).tolist())) > 15


def test_replies_rewards_and_attempts_hand_computed(shipped_dataset):
    env = DatasetTask(shipped_dataset, split="eval", max_turns=3)
    jitted = Jitted(env)
    params = env.default_params()
    row = 4
    answer = env.tasks.answer_texts[row]
    state, _ = env.reset(jax.random.key(0), env.default_params(task_index=row))
    texts = ["", "  .", f"{int(answer) + 1}", f"it is {answer}", f"#### {answer}",
             f"{answer}<eot>junk", f"{answer} #### 1", f"1,{answer}"]
    new, ts = jitted.step_texts(state, texts, params)
    expected = [("no answer, try again", -0.1, True), ("no answer, try again", -0.1, True),
                ("wrong, try again", 0.0, False), ("correct", 1.0, False),
                ("correct", 1.0, False), ("correct", 1.0, False),
                ("wrong, try again", 0.0, False), ("wrong, try again", 0.0, False)]
    for i, (reply, reward, format_error) in enumerate(expected):
        assert CODEC.decode(ts.observation.tokens[i]) == reply, texts[i]
        assert float(ts.reward[i]) == pytest.approx(reward), texts[i]
        assert bool(ts.info["format_error"][i]) == format_error, texts[i]
        assert bool(ts.terminated[i]) == bool(new.success[i]) == (reply == "correct")
    # The third attempt is the last: a wrong answer ends the episode (terminated, not
    # truncated) with "wrong"; a missing one with "no answer".
    last = state.replace(turn=jnp.asarray(2, jnp.int32))
    new, ts = jitted.step_texts(last, ["0", "", answer], params)
    assert [CODEC.decode(t) for t in ts.observation.tokens] == ["wrong", "no answer", "correct"]
    assert np.asarray(ts.terminated).tolist() == [True] * 3
    assert not np.any(np.asarray(ts.truncated))
    assert np.asarray(new.success).tolist() == [False, False, True]
    assert np.asarray(ts.info["turn"]).tolist() == [3, 3, 3]
    # Rewards are params; the bounds are the min and max of 0 and the three rewards.
    custom = params.replace(correct_reward=jnp.asarray(2.0), wrong_reward=jnp.asarray(-0.5),
                            format_penalty=jnp.asarray(0.25))
    _, ts = jitted.step_texts(state, ["0", "", answer], custom)
    assert np.asarray(ts.reward).tolist() == [-0.5, -0.25, 2.0]
    assert [float(b) for b in env.reward_bounds(custom)] == [-0.5, 2.0]
    assert [float(b) for b in env.reward_bounds(params)] == [pytest.approx(-0.1), 1.0]


def test_oracle_solves_every_row_and_the_demonstrator_is_weaker(eval_env, shipped_dataset):
    env = eval_env.env
    keys, params = env.split_tasks()
    state, steps = eval_env.play(keys, params, "oracle")
    assert bool(jnp.all(state.success)) and int(jnp.max(state.turn)) == 1
    assert float(steps[0].reward.sum()) == env.num_rows
    # Demonstrator, accuracy p per attempt over 2 attempts: success 1 - (1 - p)^2.
    train = Jitted(DatasetTask(shipped_dataset, split="train", max_turns=2))
    keys = jax.random.split(jax.random.key(1), 512)
    for accuracy, expected in [(0.5, 0.75), (0.0, 0.0)]:
        params = batched(train.env.default_params().replace(
            demonstrator_accuracy=jnp.asarray(accuracy, jnp.float32)), 512)
        state, steps = train.play(keys, params, "demonstrator")
        assert float(jnp.mean(state.success)) == pytest.approx(expected, abs=0.06)
        # Its wrong answers are numbers (never a format error) and always wrong.
        assert not any(bool(jnp.any(ts.info["format_error"])) for ts in steps)
    assert float(jnp.mean(state.success)) == 0.0


def test_demonstrator_wrong_numbers_change_the_last_digit(eval_env):
    env = eval_env.env
    keys, params = env.split_tasks()
    state, _ = eval_env.reset(keys, params)
    never = params.replace(demonstrator_accuracy=jnp.zeros_like(params.demonstrator_accuracy))
    action = eval_env.demo(jax.random.split(jax.random.key(3), env.num_rows), state, never)
    for row in range(env.num_rows):
        text = CODEC.decode(action.tokens[row])
        reference = env.tasks.answer_texts[row]
        assert text.endswith("<eot>") and len(text) == len(reference) + len("<eot>")
        assert text[:len(reference) - 1] == reference[:-1] and text[-6] != reference[-1]


def test_string_verifiers_and_a_custom_one(tmp_path):
    path = write_jsonl(tmp_path / "capitals.jsonl", [
        {"prompt": "Capital of France?", "answer": "Paris"},
        {"prompt": "Biggest US city?", "answer": "New York"},
        {"prompt": "Six times seven?", "answer": "42"},
        {"prompt": "Capital of Italy?", "answer": "Rome"}])
    cases = [" Paris\n", "paris", "PARIS!", "Pa ris", "", "?!", "London"]
    for verifier, expected in [
            ("exact", [(True, True), (False, True), (False, True), (False, True),
                       (False, False), (False, True), (False, True)]),
            ("normalized", [(True, True), (True, True), (True, True), (False, True),
                            (False, False), (False, False), (False, True)])]:
        env = DatasetTask(path, split="train", verifier=verifier, eval_fraction=0.25,
                          action_len=12)
        row = env.tasks.answer_texts.index("Paris")
        state, _ = env.reset(jax.random.key(0), env.default_params(task_index=row))
        _, ts = Jitted(env).step_texts(state, cases, env.default_params())
        got = list(zip(np.asarray(ts.info["success"]).tolist(),
                       (~np.asarray(ts.info["format_error"])).tolist()))
        assert got == expected, verifier
    train = text_tasks.load_text_tasks(text_tasks.cached_text_tasks(path, eval_fraction=0.25))
    without = sorted(train.lines[train.forms["number"][1] < 0].tolist())
    assert len(without) == 2 and set(without) <= {1, 2, 4}  # "42" (line 3) has a number
    with pytest.raises(ValueError, match=re.escape(
            f"verifier='numeric' needs a number in every answer; the answers of source "
            f"lines {without} of")):
        DatasetTask(path, split="train", eval_fraction=0.25)
    env = DatasetTask(path, split="eval", verifier="normalized", eval_fraction=0.25)
    keys, params = env.split_tasks()
    jitted = Jitted(env)
    assert bool(jnp.all(jitted.play(keys, params, "oracle")[0].success))

    def within_one(response, answer):
        """A numeric verifier with tolerance 1 (integers up to 9 digits)."""
        from arl.text import parsing
        number, length, found = verifiers.canonical_number(response.chars, response.num_chars)
        digits = jnp.where(number >= 0, number, ord("0"))
        value, ok = parsing.parse_int(digits, 0, length, np.arange(128) - ord("0"), ord("-"))
        ref, _ = parsing.parse_int(jnp.maximum(answer.number, 0), 0, answer.number_length,
                                   np.arange(128) - ord("0"), ord("-"))
        return found & ok & (jnp.abs(value - ref) <= 1), found

    env = DatasetTask(path, split="train", verifier=within_one, eval_fraction=0.25)
    row = env.tasks.answer_texts.index("42")
    state, _ = env.reset(jax.random.key(0), env.default_params(task_index=row))
    _, ts = Jitted(env).step_texts(state, ["41", "#### 43", "44", "none"], env.default_params())
    assert np.asarray(ts.info["success"]).tolist() == [True, True, False, False]
    assert np.asarray(ts.info["format_error"]).tolist() == [False, False, False, True]


def test_hugging_face_tokenizer_dataset(tmp_path):
    from arl.text.hf_codec import HFCodec, train_bpe_tokenizer

    problems = word_problems.generate(40, seed=1)
    corpus = [p["prompt"] for p in problems] + ["correct", "wrong, try again", "no answer"]
    tokenizer_file = tmp_path / "tokenizer.json"
    train_bpe_tokenizer(corpus, vocab_size=300).save(str(tokenizer_file))
    jsonl = write_jsonl(tmp_path / "p.jsonl", problems)
    path = text_tasks.build_text_tasks(tmp_path / "data", jsonl,
                                       codec=HFCodec(str(tokenizer_file)))
    env = E.make("dataset_task", path=path, max_turns=2)  # the dataset's own tokenizer
    assert isinstance(env.codec, HFCodec)
    assert env.tasks.metadata["tokenizer"]["kind"] == "hf"
    assert env.prompt_len < max(len(p["prompt"]) for p in problems)  # subword ids
    for row in range(env.num_rows):
        ids = env.tasks.prompts[row, :env.tasks.prompt_lengths[row]]
        assert env.codec.decode(ids) == env.tasks.prompt_texts[row]
    keys, params = env.split_tasks()
    jitted = Jitted(env)
    assert bool(jnp.all(jitted.play(keys, params, "oracle")[0].success))
    # A config may name the tokenizer file as the codec (registry.make wraps it).
    same = E.make("dataset_task", path=path, codec=str(tokenizer_file))
    assert same.codec.vocab_size == env.codec.vocab_size
    with pytest.raises(ValueError, match="is not the tokenizer the dataset"):
        DatasetTask(path, codec=CODEC)


def test_bad_arguments_name_the_argument(shipped_dataset):
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'eval'\)"):
        DatasetTask(shipped_dataset, split="test")
    with pytest.raises(ValueError, match="verifier must be one of"):
        DatasetTask(shipped_dataset, verifier="fuzzy")
    with pytest.raises(ValueError, match="max_turns must be an int >= 1"):
        DatasetTask(shipped_dataset, max_turns=0)
    with pytest.raises(ValueError, match=r"action_len must be an int >= 3"):
        DatasetTask(shipped_dataset, action_len=2)
    with pytest.raises(ValueError, match=r"split_seed=0, but the dataset .* seed=3"):
        DatasetTask(shipped_dataset, split_seed=0)
    with pytest.raises(FileNotFoundError, match="is not a text-task dataset"):
        DatasetTask(os.path.dirname(shipped_dataset) + "/nowhere")
    with pytest.raises(ValueError, match="task_index must be -1"):
        DatasetTask(shipped_dataset).default_params(task_index=-2)


def test_default_env_is_the_shipped_problems_cached_once(tmp_path, monkeypatch):
    monkeypatch.setenv(caches.CACHE_ENV, str(tmp_path))
    env = E.make("dataset_task")
    assert env.tasks.path.startswith(str(tmp_path)) and env.num_rows == 270
    assert env.tasks.metadata["source"]["file"] == "arithmetic_word_problems.jsonl"
    built = os.listdir(tmp_path / "text_tasks")
    assert E.make("dataset_task", split="eval").num_rows == 30
    assert os.listdir(tmp_path / "text_tasks") == built == [built[0]]  # reused, not rebuilt


# ---------------------------------------------------------------------------- generator
def _solve(prompt):
    """An independent reading of the templates: the numbers in order and the verbs."""
    n = [int(x) for x in re.findall(r"\d+", prompt)]
    if "more and then gives" in prompt:
        return n[0] + n[1] - n[2]
    if "more" in prompt or "Tuesday" in prompt:
        return n[0] + n[1]
    if any(w in prompt for w in ("gives", "lost", "takes")):
        return n[0] - n[1]
    if "each bag" in prompt or "Each pack" in prompt:
        return n[0] * n[1]
    assert "equal" in prompt, prompt
    return n[0] // n[1]


def test_word_problems_are_deterministic_correct_and_shipped():
    problems = word_problems.generate()
    shipped = [json.loads(line) for line in open(word_problems.SHIPPED_JSONL, encoding="utf-8")]
    assert problems == shipped == word_problems.generate(300, 0)
    assert problems != word_problems.generate(300, 1)
    assert len({p["prompt"] for p in problems}) == 300
    for problem in problems:
        assert problem["answer"] == str(_solve(problem["prompt"])), problem
        assert int(problem["answer"]) >= 0
        CODEC.encode(problem["prompt"])  # every character is in the CharCodec vocabulary
    kinds = {"more and then gives": 0, "each": 0, "equal": 0}
    for problem in problems:
        for key in kinds:
            kinds[key] += key in problem["prompt"]
    assert all(count > 20 for count in kinds.values()), kinds


@pytest.mark.parametrize("content,line,message", [
    (b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n', 2,
     "not UTF-8 text (byte 0xe9 at column 16)"),
    (b"", 1, "the file holds no tasks"),
    (b"\n  \n", 1, "the file holds no tasks"),
    (b'{"prompt": "ok", "answer": "1"}\n{"answer": "2"}\n', 2, "missing field 'prompt'"),
    (b'{"prompt": "a long prompt", "answer": "1"}\n', 1,
     "field 'prompt' has 13 tokens, more than max_prompt_len=5"),
])
def test_make_dataset_one_line_exit_2_nothing_written(tmp_path, content, line, message):
    """Every kind of bad JSONL input through the command line: one stderr line naming
    the file and line, exit status 2, nothing on stdout, no output directory."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(content)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.make_dataset", f"--input={path}",
         f"--output={out}", "--max_prompt_len=5"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{path}:{line}: {message}" in lines[0]
    assert not out.exists()
    if "max_prompt_len" in message:
        assert "--drop_long" in lines[0]


def test_dataset_task_long_rows_advise_only_what_it_accepts(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "p" * 600, "answer": "1"},
                                                 {"prompt": "q", "answer": "2"}])
    with pytest.raises(ValueError) as error:
        DatasetTask(path)
    message = str(error.value)
    assert f"{path}:1: field 'prompt' has 600 tokens" in message and "\n" not in message
    assert "drop_long=True" not in message and "make_dataset --drop_long" in message


def test_train_reports_a_bad_jsonl_in_one_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config=configs/grpo_word_problems.py",
         f"--config.env.kwargs.path={path}", f"--workdir={workdir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{path}:2: not UTF-8 text (byte 0xe9 at column 16)" in lines[0]
    assert not workdir.exists()
