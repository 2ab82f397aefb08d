"""`dataset_task`: answer the prompts of a dataset; the reference answers are checked in-graph.

    env = DatasetTask(path="tasks.jsonl", split="train", verifier="numeric", max_turns=2)
    # in a config: c.env.name = "dataset_task"; c.env.kwargs.path = "..."

`path` is a dataset directory written by `python -m experiments.make_dataset` (or
`arl.data.text_tasks.build_text_tasks`), or a file as users keep it: a ``.jsonl`` file of
``{"prompt", "answer"}`` lines, a ``.parquet`` or ``.csv`` file, or a
`datasets.save_to_disk` directory (`arl.data.task_files`; the columns named by
`prompt_key` / `answer_key`; chat prompts as message lists, rendered with the codec's
chat format, their shared system message kept), which is built on first use into a cache
directory (`arl.data.text_tasks.cached_text_tasks`, tokenized with `codec`,
`eval_fraction` of the rows in "eval"); by default, the shipped arithmetic word problems
(`arl.data.word_problems`). A row's other columns are kept for Python reward functions
(`reward_columns`, docs/bring_your_task.md). The whole
`split` is put on the device once, as arrays (prompts [N, prompt_len], reference answers
[N, ...]); they are constants of every compiled program that uses the env.

Episode: the prompt is row r of the split; each agent turn is an answer. The turn's text
(its token ids read as characters through the codec, `arl.text.verifiers`) is checked
against row r's reference by the verifier named by `verifier`:

* "numeric": the final number in the GSM8K convention (the first number after "####" if
  the turn has one, else the last number), compared exactly after normalisation (commas
  dropped, leading / trailing zeros dropped, sign kept: `arl.text.verifiers`);
* "exact": the turn equals the answer text, up to leading / trailing whitespace;
* "normalized": equal after ASCII lower-casing, removing ASCII punctuation and
  collapsing whitespace (short free-text answers).

A correct answer ends the episode with success. A wrong one gets the reply "wrong, try
again" while turns remain (up to `max_turns` attempts; the last wrong attempt ends the
episode, terminated, with the reply "wrong"). A turn with no answer in it (no number for
"numeric"; nothing but whitespace / punctuation for the string verifiers) is a format
error: reply "no answer, try again" (or "no answer" on the last attempt).

Reward per step: correct_reward on a correct answer, wrong_reward on a wrong one,
-format_penalty on a turn without an answer (params; defaults 1, 0, 0.1); a finished
episode's no-op steps give 0. `reward_bounds` is the min and max of those four values.
No process reward (0).

Tasks: `reset` draws the row uniformly from the reset key (so the rows of a GRPO group,
which share the key, share the task), unless `params.task_index >= 0`, which picks row
`task_index % N`. `split_tasks()` returns reset keys and params that visit every row of
the split exactly once (evaluation over a whole eval split):

    keys, params = env.split_tasks()
    traj = arl.rollout.rollout(env, key, num_tasks=env.num_rows, group_size=1,
                               reset_keys=keys, env_params=params, model=..., params=...)

Teachers: `oracle_action` writes the reference answer text (as stored: a GSM8K solution
with its "#### n" line, or just "19"). `demonstrator_action` is right with probability
`params.demonstrator_accuracy`; otherwise it writes a plausible wrong answer: for
"numeric" the reference number with its last digit replaced by another digit (always
wrong), for the string verifiers the answer of another row of the split (wrong unless the
two rows share their answer).

Custom verifiers: `verifier` may also be a jittable function
``verify(response: Response, answer: Answer) -> (correct bool [], parsed bool [])``:
`response` holds the turn's token ids and its characters (code points), `answer` the
row's reference (token ids, and the "exact", "normalized" and "number" forms as code
points, length -1 where a row has no number); `parsed` False makes the turn a format
error. Rewards then follow the params as above. Configs hold data, so register such an
env under a name: ``arl.envs.register("my_task", functools.partial(DatasetTask,
verifier=verify))``.
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arl.data import task_files, text_tasks, word_problems
from arl.envs.base import (NON_NEGATIVE, PROBABILITY, ParamRange, TokenChunk, TokenEnvironment,
                           TokenEnvState, tree_select)
from arl.text import chunks, verifiers
from arl.text.codec import CharCodec, Codec

SPLITS = ("train", "eval")
# Replies: index outcome (CORRECT, WRONG, NO_ANSWER) on the last attempt, 3 + outcome
# while attempts remain.
REPLIES = ("correct", "wrong", "no answer", "correct", "wrong, try again",
           "no answer, try again")
CORRECT, WRONG, NO_ANSWER = range(3)
_LISTED = 10


@struct.dataclass
class DatasetTaskParams:
    task_index: jax.Array  # int32; -1: row drawn from the reset key; >= 0: row index % N
    correct_reward: jax.Array
    wrong_reward: jax.Array
    format_penalty: jax.Array  # a turn with no answer gets -format_penalty
    demonstrator_accuracy: jax.Array  # probability the demonstrator answers correctly


@struct.dataclass
class DatasetTaskState(TokenEnvState):
    row: jax.Array  # int32, the task's row of the split


@struct.dataclass
class Response:
    """One agent turn (cut at end-of-turn): token ids [L] and `length`, and its text as
    code points `chars` [C] (-1 padded) with `num_chars` valid."""

    tokens: jax.Array
    length: jax.Array
    chars: jax.Array
    num_chars: jax.Array


@struct.dataclass
class Answer:
    """The reference of one row: answer token ids [A] and `length`; and the answer text
    in each verifier's form as code points (-1 padded) with its length ("number_length"
    is -1 when the answer holds no number)."""

    tokens: jax.Array
    length: jax.Array
    exact: jax.Array
    exact_length: jax.Array
    normalized: jax.Array
    normalized_length: jax.Array
    number: jax.Array
    number_length: jax.Array


def verify_numeric(response: Response, answer: Answer):
    """The turn's answer number (GSM8K convention) equals the reference number."""
    number, length, found = verifiers.canonical_number(response.chars, response.num_chars)
    return found & verifiers.equal_texts(number, length, answer.number,
                                         answer.number_length), found


def verify_exact(response: Response, answer: Answer):
    """The turn equals the answer text up to leading / trailing whitespace."""
    text, length, nonempty = verifiers.strip_chars(response.chars, response.num_chars)
    return verifiers.equal_texts(text, length, answer.exact, answer.exact_length), nonempty


def verify_normalized(response: Response, answer: Answer):
    """Equal after lower-casing, removing punctuation and collapsing whitespace."""
    text, length, nonempty = verifiers.normalized_chars(response.chars, response.num_chars)
    return verifiers.equal_texts(text, length, answer.normalized,
                                 answer.normalized_length), nonempty


VERIFIERS: dict[str, Callable] = {"numeric": verify_numeric, "exact": verify_exact,
                                  "normalized": verify_normalized}


def _load(path, split, codec, eval_fraction, split_seed, prompt_key="prompt",
          answer_key="answer"):
    """(TextTasks, codec) of `path` (module docstring), checking the codec and settings."""
    if path is None:
        path = word_problems.SHIPPED_JSONL
    path = os.fspath(path)
    if task_files.is_task_file(path):
        codec = CharCodec() if codec is None else codec
        codec = _with_system_prompt(codec, task_files.read_task_file(
            path, prompt_key=prompt_key, answer_key=answer_key), path)
        path = text_tasks.cached_text_tasks(
            path, codec=codec,
            eval_fraction=0.1 if eval_fraction is None else eval_fraction,
            seed=0 if split_seed is None else split_seed,
            prompt_key=prompt_key, answer_key=answer_key)
        return text_tasks.load_text_tasks(path, split), codec
    if (prompt_key, answer_key) != ("prompt", "answer"):
        raise ValueError(f"prompt_key={prompt_key!r} / answer_key={answer_key!r} apply to "
                         f"a source file; the built dataset {path!r} has its columns fixed")
    tasks = text_tasks.load_text_tasks(path, split)
    metadata = tasks.metadata
    for name, value, key in (("eval_fraction", eval_fraction, "eval_fraction"),
                             ("split_seed", split_seed, "seed")):
        if value is not None and value != metadata.get(key):
            raise ValueError(f"{name}={value!r}, but the dataset {tasks.path!r} was split "
                             f"with {key}={metadata.get(key)!r} (it applies to .jsonl paths, "
                             "which are built on use; leave it unset for a built dataset)")
    if codec is None:
        codec = text_tasks.codec_from_dataset(tasks.path, metadata["tokenizer"])
    elif text_tasks.tokenizer_spec(codec) != metadata["tokenizer"]:
        raise ValueError(f"codec {codec!r} is not the tokenizer the dataset {tasks.path!r} "
                         f"was written with ({metadata['tokenizer']}); pass codec=None to "
                         "use the dataset's own")
    return tasks, codec


def _with_system_prompt(codec, tasks, path):
    """`codec`, or the same checkpoint's codec whose chat format starts with the system
    message the rows' chat prompts share (`task_files.system_prompt_of`)."""
    chat = getattr(codec, "chat", None)
    if chat is None or not any(t.messages for t in tasks):
        return codec
    system = task_files.system_prompt_of(tasks, path)
    if system is None or system == chat.system_prompt:
        return codec
    if chat.system_prompt is not None:
        raise ValueError(f"{path}: the rows' system message {system!r} differs from the "
                         f"codec's system prompt {chat.system_prompt!r} (config.model."
                         "system_prompt): leave that empty to use the rows'")
    directory = getattr(codec, "directory", None)
    if directory is None:
        raise ValueError(f"{path}: the rows' chat prompts hold a system message, which needs "
                         "a codec from a checkpoint directory (HFCodec.from_pretrained)")
    return type(codec).from_pretrained(
        directory, system_prompt=system, template_kwargs=getattr(codec, "template_kwargs", None))


def _wrong_numbers(codec: Codec, number_chars: np.ndarray, number_lengths: np.ndarray,
                   numeric: bool) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [R, 9, W] ids, int32 [R, 9] lengths): row r's reference number (canonical
    text, code points) with its last digit moved up by k + 1 (mod 10), encoded by the
    codec; empty when the verifier is not numeric."""
    rows = number_chars.shape[0]
    if not numeric:
        return np.zeros((rows, 9, 1), np.int32), np.zeros((rows, 9), np.int32)
    encoded = []
    for chars, length in zip(number_chars, number_lengths):
        text = "".join(chr(c) for c in chars[:max(int(length), 0)])
        variants = []
        for shift in range(1, 10):
            wrong = text[:-1] + str((int(text[-1]) + shift) % 10) if text else ""
            variants.append(codec.encode(wrong))
        encoded.append(variants)
    width = max(1, max(len(ids) for variants in encoded for ids in variants))
    table = np.full((rows, 9, width), codec.pad_id, np.int32)
    lengths = np.zeros((rows, 9), np.int32)
    for r, variants in enumerate(encoded):
        for k, ids in enumerate(variants):
            table[r, k, :len(ids)] = ids
            lengths[r, k] = len(ids)
    return table, lengths


class DatasetTask(TokenEnvironment):
    """Prompts and verified answers from a dataset (module docstring).

    Args:
      path: a dataset directory, a .jsonl file, or None (the shipped word problems).
      split: "train" or "eval".
      verifier: "numeric", "exact", "normalized", or a function (module docstring).
      max_turns: attempts per episode (>= 1); wrong answers get "wrong, try again".
      codec: the codec of the token ids (default: the dataset's own; for a .jsonl path
        the codec to tokenize with, default `CharCodec`).
      action_len: the per-turn token budget (default: the longest reference answer, or
        wrong demonstrator answer, plus end-of-turn; a larger one leaves room to reason).
      eval_fraction, split_seed: how a .jsonl path is split (defaults 0.1 and 0); for a
        built dataset they must match its metadata if given.
      max_token_chars: ids whose text is longer read as one unknown character
        (`arl.text.verifiers.char_table`).
      prompt_key, answer_key: the source file's prompt and answer columns.
    """

    name = "dataset_task"

    def __init__(self, path: str | None = None, split: str = "train",
                 verifier: str | Callable = "numeric", max_turns: int = 1,
                 codec: Codec | None = None, action_len: int | None = None,
                 eval_fraction: float | None = None, split_seed: int | None = None,
                 max_token_chars: int = 16, prompt_key: str = "prompt",
                 answer_key: str = "answer"):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if isinstance(verifier, str):
            if verifier not in VERIFIERS:
                raise ValueError(f"verifier must be one of {sorted(VERIFIERS)} or a function, "
                                 f"got {verifier!r}")
        elif not callable(verifier):
            raise ValueError(f"verifier must be one of {sorted(VERIFIERS)} or a function, "
                             f"got {verifier!r}")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        tasks, codec = _load(path, split, codec, eval_fraction, split_seed, prompt_key,
                             answer_key)
        self.tasks = tasks  # host copy: texts, source lines, metadata
        self.codec = codec
        self.split = split
        self.verifier_name = verifier if isinstance(verifier, str) else getattr(
            verifier, "__name__", "custom")
        self._verify = VERIFIERS[verifier] if isinstance(verifier, str) else verifier
        self.max_turns = max_turns
        self.num_rows = tasks.num_rows

        number_chars, number_lengths = tasks.forms["number"]
        self._numeric = verifier == "numeric"
        if self._numeric and np.any(number_lengths < 0):
            lines = sorted(tasks.lines[number_lengths < 0].tolist())
            raise ValueError(f"verifier='numeric' needs a number in every answer; the answers "
                             f"of source lines {lines[:_LISTED]}"
                             f"{' ...' if len(lines) > _LISTED else ''} of {tasks.path!r} "
                             f"({split}) hold none (use verifier='exact' or 'normalized')")
        # The demonstrator's wrong numbers, tokenized here as the codec writes them: the
        # reference number with its last digit moved up by k = 1..9 (mod 10).
        self._wrong_ids, self._wrong_lengths = _wrong_numbers(
            codec, number_chars, number_lengths, self._numeric)

        self.prompt_len = int(tasks.prompts.shape[1])
        self.obs_len = max(len(codec.encode(reply)) for reply in REPLIES)
        wrong_width = self._wrong_ids.shape[-1] if self._numeric else 0
        needed = max(int(tasks.answer_lengths.max()), wrong_width) + 1
        if action_len is None:
            action_len = needed
        if isinstance(action_len, bool) or not isinstance(action_len, int) or \
                action_len < needed:
            raise ValueError(f"action_len must be an int >= {needed} (the longest reference "
                             f"answer plus end-of-turn), got {action_len!r}")
        self.action_len = action_len

        table, counts = verifiers.char_table(codec, max_token_chars)
        self._char_table = jnp.asarray(table)
        self._char_counts = jnp.asarray(counts)
        self._prompts = jnp.asarray(tasks.prompts)
        self._prompt_lengths = jnp.asarray(tasks.prompt_lengths)
        self._answers = Answer(
            tokens=jnp.asarray(tasks.answers), length=jnp.asarray(tasks.answer_lengths),
            exact=jnp.asarray(tasks.forms["exact"][0]),
            exact_length=jnp.asarray(tasks.forms["exact"][1]),
            normalized=jnp.asarray(tasks.forms["normalized"][0]),
            normalized_length=jnp.asarray(tasks.forms["normalized"][1]),
            number=jnp.asarray(number_chars), number_length=jnp.asarray(number_lengths))

    def __repr__(self) -> str:
        return (f"DatasetTask({self.tasks.path!r}, split={self.split!r}, "
                f"verifier={self.verifier_name!r}, rows={self.num_rows}, "
                f"max_turns={self.max_turns})")

    def default_params(self, task_index: int = -1) -> DatasetTaskParams:
        if isinstance(task_index, bool) or not isinstance(task_index, int) or task_index < -1:
            raise ValueError(f"task_index must be -1 (drawn from the reset key) or a row "
                             f"index >= 0, got {task_index!r}")
        return DatasetTaskParams(
            task_index=jnp.asarray(task_index, jnp.int32),
            correct_reward=jnp.asarray(1.0, jnp.float32),
            wrong_reward=jnp.asarray(0.0, jnp.float32),
            format_penalty=jnp.asarray(0.1, jnp.float32),
            demonstrator_accuracy=jnp.asarray(0.5, jnp.float32))

    def param_ranges(self):
        """task_index -1 (drawn from the reset key) or a row (taken modulo the split's size);
        rewards any finite number; the penalty >= 0; the demonstrator's accuracy a
        probability."""
        return dict(task_index=ParamRange(-1, None), correct_reward=ParamRange(),
                    wrong_reward=ParamRange(), format_penalty=NON_NEGATIVE,
                    demonstrator_accuracy=PROBABILITY)

    def reward_bounds(self, params: DatasetTaskParams):
        values = jnp.stack([jnp.zeros((), jnp.float32), params.correct_reward,
                            params.wrong_reward, -params.format_penalty])
        return jnp.min(values), jnp.max(values)

    def split_tasks(self, group_size: int = 1, params: DatasetTaskParams | None = None):
        """(reset_keys [N * group_size], params [N * group_size]) that run every row of
        the split exactly once per group, in row order (row i: entries i*G .. i*G+G-1);
        `params` (unbatched, default `default_params()`) supplies the rewards."""
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        params = self.default_params() if params is None else params
        rows = jnp.repeat(jnp.arange(self.num_rows, dtype=jnp.int32), group_size)
        batched = jax.tree.map(lambda x: jnp.broadcast_to(x, rows.shape + jnp.shape(x)), params)
        keys = jnp.repeat(jax.random.split(jax.random.key(0), self.num_rows), group_size, axis=0)
        return keys, batched.replace(task_index=rows)

    # -- Python reward functions (arl.rewards.functions)
    def task_row(self, state: DatasetTaskState) -> jax.Array:
        """The row of the split an episode plays (recorded by the rollout)."""
        return state.row

    def reward_prompts(self, rows) -> list:
        """Each row's prompt as the source file holds it (a string or a message list)."""
        return [self.tasks.source_prompt(r) for r in rows]

    def reward_columns(self, rows) -> dict[str, list]:
        """The reward functions' columns: "answer" (the reference text) and the source
        rows' other columns, one value per row."""
        columns = {"answer": [self.tasks.answer_texts[r] for r in rows]}
        for name in self.tasks.column_names:
            columns[name] = [self.tasks.source_columns(r).get(name) for r in rows]
        return columns

    # -- episode
    def answer(self, row: jax.Array) -> Answer:
        """The reference of `row` (traced)."""
        return jax.tree.map(lambda x: x[row], self._answers)

    def _reset(self, key, params: DatasetTaskParams):
        drawn = jax.random.randint(key, (), 0, self.num_rows, jnp.int32)
        index = jnp.asarray(params.task_index, jnp.int32)
        row = jnp.where(index >= 0, index % self.num_rows, drawn).astype(jnp.int32)
        false = jnp.zeros((), bool)
        state = DatasetTaskState(turn=jnp.zeros((), jnp.int32), terminated=false,
                                 truncated=false, success=false, row=row)
        return state, TokenChunk(self._prompts[row], self._prompt_lengths[row])

    def response(self, content: TokenChunk) -> Response:
        chars, num_chars = verifiers.token_chars(self._char_table, self._char_counts,
                                                 content.tokens, content.length)
        return Response(content.tokens, content.length, chars, num_chars)

    def _transition(self, key, state: DatasetTaskState, content: TokenChunk,
                    params: DatasetTaskParams):
        del key
        correct, parsed = self._verify(self.response(content), self.answer(state.row))
        parsed = jnp.asarray(parsed, bool)
        correct = jnp.asarray(correct, bool) & parsed
        retry = state.turn + 1 < self.max_turns
        outcome = jnp.where(correct, CORRECT, jnp.where(parsed, WRONG, NO_ANSWER))
        reply = chunks.select_text(self.codec, outcome + 3 * retry.astype(jnp.int32),
                                   REPLIES, self.obs_len)
        reward = jnp.where(correct, params.correct_reward,
                           jnp.where(parsed, params.wrong_reward, -params.format_penalty))
        new_state = state.replace(terminated=correct | ~retry, success=correct)
        return new_state, reply, reward, ~parsed

    # -- teachers
    def _with_eot(self, body: TokenChunk) -> TokenChunk:
        eot = TokenChunk(jnp.asarray([self.codec.eot_id], jnp.int32), jnp.asarray(1, jnp.int32))
        return chunks.concat_chunks(body, eot, self.action_len, self.codec.pad_id)

    def _answer_chunk(self, row) -> TokenChunk:
        return self._with_eot(TokenChunk(self._answers.tokens[row], self._answers.length[row]))

    def oracle_action(self, key, state: DatasetTaskState, params) -> TokenChunk:
        """The reference answer text of the row, then end-of-turn."""
        del key, params
        return self._answer_chunk(state.row)

    def _wrong_answer(self, key, row) -> TokenChunk:
        if not self._numeric:
            other = (row + jax.random.randint(key, (), 1, max(self.num_rows, 2))) % self.num_rows
            return self._answer_chunk(other)
        shift = jax.random.randint(key, (), 1, 10) - 1
        return self._with_eot(TokenChunk(jnp.asarray(self._wrong_ids)[row, shift],
                                         jnp.asarray(self._wrong_lengths)[row, shift]))

    def demonstrator_action(self, key, state: DatasetTaskState,
                            params: DatasetTaskParams) -> TokenChunk:
        """Right with probability `params.demonstrator_accuracy` (each attempt),
        otherwise a plausible wrong answer (module docstring)."""
        key_coin, key_wrong = jax.random.split(key)
        right = jax.random.uniform(key_coin) < params.demonstrator_accuracy
        return tree_select(right, self._answer_chunk(state.row),
                           self._wrong_answer(key_wrong, state.row))
