"""reasoning-gym tasks as arl environments: `config.env.name = "reasoning_gym:<task>"`.

    python -m experiments.train --config=configs/grpo_reasoning_gym.py --workdir=/tmp/rg \
        --config.env.name=reasoning_gym:chain_sum

reasoning-gym (`pip install 'arl[reasoning-gym]'`, tested with 0.1.25) generates
procedural reasoning tasks and scores answers. What maps to what:

* rows: `reasoning_gym.create_dataset(<task>, size=size, seed=seed, **task_kwargs)`
  (`env.kwargs.size`, `seed`, `task_kwargs`: the task's own config fields), generated
  once at construction; an episode plays row `task seed mod size` (the rows of a GRPO
  group share it).
* prompt: the row's `question`; the agent's turn is the answer (surrounding whitespace
  dropped).
* reward: the task's `score_answer(answer, row)`. With `exact=True` (the default) the
  reward is 1 only when the score is 1 (full credit), else 0: reasoning-gym's default
  scorer gives `len(oracle) / len(answer)` credit to any answer that contains the oracle
  answer, which a policy learns to exploit (writing "1111" for an answer of "1" scores
  0.25 every time). `exact=False` keeps the partial credit.
* success: a score of 1. The oracle: the row's `answer`. No demonstrator.
* one turn (`max_turns=1`); with more, a wrong answer gets the reply "wrong, try again".

* a mixture: `reasoning_gym:composite` with `task_kwargs.datasets` a list of
  `{"name": <task>, "weight": <number>, "config": {<the task's fields>}}` (reasoning-gym's
  `DatasetSpec`s): rows drawn from the tasks by weight, each scored by its own task. The
  rows report their task as a mixture member does (`info["env_id"]`, from the memory
  field `task_index`), so metrics.jsonl has `reward_mean/<i>_<task>` and
  `success_rate/<i>_<task>` per task, evaluation tables a row per task, and ERPO pools
  its statistics per task (`member_names`; `arl.envs.env_names`).

Not mapped: curricula. Text the codec cannot write becomes "?" (the character codec has no "[" or
"]"); use a Hugging Face tokenizer (`env.kwargs.codec`) for tasks that need them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp

from arl.envs.host import HostEnvironment, HostTurn
from arl.errors import did_you_mean, one_line
from arl.text.codec import CharCodec, Codec

PREFIX = "reasoning_gym"
COMPOSITE = "composite"  # reasoning-gym's weighted mixture of tasks
TASK_FIELD = "task_index"  # a composite row's task, in `member_names` order
WRONG_REPLY = "wrong, try again"


def _library():
    try:
        import reasoning_gym  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        raise ValueError("env 'reasoning_gym:<task>' needs the reasoning-gym package: "
                         "pip install 'arl[reasoning-gym]'") from error
    return reasoning_gym


class ReasoningGymTask(HostEnvironment):
    """One reasoning-gym task (module docstring)."""

    def __init__(self, task: str, size: int = 1000, seed: int = 0,
                 task_kwargs: dict | None = None, exact: bool = True,
                 codec: Codec | None = None, max_turns: int = 1, action_len: int = 16,
                 prompt_len: int | None = None):
        library = _checked_task(task)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"size={size!r} must be an int >= 1 (rows generated)")
        if not isinstance(exact, bool):
            raise ValueError(f"exact={exact!r} must be True or False")
        self.task_name = task
        self.name = f"{PREFIX}:{task}"
        task_kwargs = _plain(task_kwargs or {})
        self.member_names = None  # the tasks of a composite (metrics per task)
        if task == COMPOSITE:
            specs, self.member_names = _composite_specs(task_kwargs.get("datasets"))
            task_kwargs = {**task_kwargs, "datasets": specs}
            self.memory_fields = (TASK_FIELD,)
        try:
            self.dataset = library.create_dataset(task, size=size, seed=seed, **task_kwargs)
        except (TypeError, ValueError, AssertionError, KeyError) as error:
            shown = _plain(task_kwargs) if task != COMPOSITE else {
                **task_kwargs, "datasets": [spec.name for spec in task_kwargs["datasets"]]}
            raise ValueError(f"reasoning-gym's {task!r} refused task_kwargs={shown!r}: "
                             f"{type(error).__name__}: {one_line(error)}") from error
        self.rows = [self.dataset[i] for i in range(size)]
        self.exact = exact
        self.codec = codec if codec is not None else CharCodec()
        self.max_turns = int(max_turns)
        self.action_len = int(action_len)
        longest = max(len(self.codec.encode(row["question"])) for row in self.rows)
        self.prompt_len = int(prompt_len) if prompt_len is not None else longest + 1
        self.obs_len = max(len(self.codec.encode(WRONG_REPLY)) + 1, 4)

    def default_params(self):
        return ()

    def reward_bounds(self, params):
        return jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32)

    def make_task(self, seed: int, params) -> dict[str, Any]:
        return self.rows[seed % len(self.rows)]

    def prompt(self, task, params) -> str:
        return task["question"]

    def initial_memory(self, task, params) -> dict:
        if self.member_names is None:
            return {}
        return {TASK_FIELD: self.member_names.index(task["metadata"]["source_dataset"])}

    def _info(self, state, format_error):
        info = super()._info(state, format_error)
        if self.member_names is not None:  # the row's task, as a mixture's member
            info["env_id"] = state.memory[0].astype(jnp.int32)
        return info

    def score(self, answer: str, row: dict) -> float:
        """The reward of `answer` on `row`: the task's score, or 1/0 on full credit
        with `exact`."""
        value = float(self.dataset.score_answer(answer, row))
        return float(value == 1.0) if self.exact else value

    def host_step(self, episode, action: str) -> HostTurn:
        answer = action.strip()
        success = float(self.dataset.score_answer(answer, episode.task)) == 1.0
        reward = self.score(answer, episode.task)
        last = episode.turn + 1 >= self.max_turns
        return HostTurn(reply="correct" if success else WRONG_REPLY, reward=reward,
                        terminated=success or last, success=success,
                        format_error=not answer)

    def host_oracle(self, episode) -> str:
        return str(episode.task["answer"])


def _plain(value):
    """`value` with ConfigDicts (a config's nested sections) as plain dicts."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _composite_specs(datasets) -> tuple[list, tuple[str, ...]]:
    """reasoning-gym's `DatasetSpec`s of a composite's `task_kwargs.datasets` (a list of
    {"name", "weight", "config"}) and the task names, in that order (ValueError naming
    the entry otherwise)."""
    from reasoning_gym.composite import DatasetSpec  # pylint: disable=import-outside-toplevel
    from reasoning_gym.factory import DATASETS  # pylint: disable=import-outside-toplevel

    if not isinstance(datasets, list) or not datasets:
        raise ValueError(f"task_kwargs.datasets={datasets!r} must be a non-empty list of "
                         "{'name': <task>, 'weight': <number>, 'config': {...}} for "
                         f"{PREFIX}:{COMPOSITE}")
    specs = []
    for i, entry in enumerate(datasets):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or \
                set(entry) - {"name", "weight", "config"}:
            raise ValueError(f"task_kwargs.datasets[{i}]={entry!r} must be {{'name': <task>, "
                             "'weight': <number>, 'config': {...}} (weight and config "
                             "optional)")
        if entry["name"] not in DATASETS or entry["name"] == COMPOSITE:
            raise ValueError(f"task_kwargs.datasets[{i}].name={entry['name']!r}: reasoning-gym "
                             f"has no such task{did_you_mean(entry['name'], DATASETS)}")
        specs.append(DatasetSpec(name=entry["name"], weight=float(entry.get("weight", 1.0)),
                                 config=dict(entry.get("config") or {})))
    return specs, tuple(spec.name for spec in specs)


def _checked_task(task: str):
    """The library, once `task` is known to be one of its tasks (ValueError naming the
    closest task otherwise)."""
    library = _library()
    from reasoning_gym.factory import DATASETS  # pylint: disable=import-outside-toplevel

    if task not in DATASETS:
        raise ValueError(f"reasoning-gym has no task {task!r}"
                         f"{did_you_mean(task, DATASETS, 'reasoning_gym:')}; its tasks are "
                         f"{sorted(DATASETS)}")
    return library


def factory(task: str):
    """What "reasoning_gym:<task>" builds (ValueError: no such task, or no library)."""
    _checked_task(task)
    return functools.partial(ReasoningGymTask, task)
