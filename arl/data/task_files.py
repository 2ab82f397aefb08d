"""Prompts and answers from the files users keep: JSONL, Parquet, CSV, and directories
written by `datasets.Dataset.save_to_disk`.

    tasks = read_task_file("gsm8k.parquet", prompt_key="question", answer_key="solution")

Each row gives one `TextTask`: its prompt (the `prompt_key` column: a string, or a chat
prompt as a list of ``{"role", "content"}`` messages), its answer (the `answer_key`
column: a string or an integer) and its other columns (`TextTask.columns`, JSON values:
what reward functions read, e.g. ``ground_truth`` or test cases). Rows are numbered
from 1: JSONL by line (blank lines skipped), the other formats by row (CSV's header is
not a row).

Chat prompts: messages with roles "system" (first only), then "user" and "assistant"
alternating, ending on "user". `prompt_text` is their contents joined by blank lines (a
codec without a chat template reads that); `prompt_ids` renders them with a
checkpoint's chat format (`arl.text.chat_template`), the system message being the
format's (`system_prompt_of` finds the one the rows share).

Formats: ``.jsonl`` (one JSON object per line), ``.parquet`` (pyarrow), ``.csv`` (a header
row; every value a string), and a directory holding ``state.json`` (one
`datasets.Dataset`) or ``dataset_dict.json`` (its "train" split), read with pyarrow
(the `datasets` package is not needed). pyarrow comes with the ``data`` extra
(``pip install "arl[data]"``).

Bad input is one `ValueError` line naming the file, the row and the column (the other
bad rows' numbers follow on the same line).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import decimal
import json
import os
import re
from typing import Any, Iterator

ROLES = ("system", "user", "assistant")
FILE_FORMATS = (".jsonl", ".parquet", ".csv")
_MAX_LISTED = 20


@dataclasses.dataclass(frozen=True)
class TextTask:
    """One row: its 1-based number, prompt text, answer text, the prompt's messages (None
    for a text prompt) and the row's other columns."""

    line: int
    prompt: str
    answer: str
    messages: tuple | None = None
    columns: dict = dataclasses.field(default_factory=dict)

    @property
    def source_prompt(self):
        """The prompt as the file holds it: the text, or the list of messages."""
        return self.prompt if self.messages is None else [dict(m) for m in self.messages]


def is_task_file(path) -> bool:
    """Whether `path` is one of the formats `read_task_file` reads."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return any(os.path.isfile(os.path.join(path, name))
                   for name in ("state.json", "dataset_dict.json"))
    return path.endswith(FILE_FORMATS)


def read_task_file(path, *, prompt_key: str = "prompt",
                   answer_key: str = "answer") -> list[TextTask]:
    """The tasks of `path` (module docstring); ValueError listing the bad rows."""
    path = os.fspath(path)
    for name, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        if not isinstance(key, str) or not key:
            raise ValueError(f"{name} must be a column name, got {key!r}")
    if prompt_key == answer_key:
        raise ValueError(f"prompt_key and answer_key name the same column {prompt_key!r}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no dataset file or directory {path!r}")
    if path.endswith(".jsonl"):
        records = _jsonl_records(path)
    elif path.endswith(".parquet"):
        records = _arrow_records(path, _parquet_table(path))
    elif path.endswith(".csv"):
        records = _csv_records(path)
    elif is_task_file(path):
        records = _arrow_records(path, _saved_dataset_table(path))
    else:
        raise ValueError(f"{path!r} is not a dataset file: expected a {', '.join(FILE_FORMATS)} "
                         "file, a datasets.save_to_disk directory or a directory built by "
                         "experiments.make_dataset")
    tasks, errors = [], []
    word = field_word(path)
    for number, record, problem in records:
        if problem is not None:
            errors.append(f"{location(path, number)}: {problem}")
            continue
        try:
            tasks.append(_task(record, number, prompt_key, answer_key, word))
        except ValueError as error:
            errors.append(f"{location(path, number)}: {error}")
    raise_listed(errors, "bad rows", unit=unit_word(path))
    if not tasks:
        raise ValueError(f"{location(path, 1)}: the file holds no tasks (expected "
                         f"{word}s {prompt_key!r} and {answer_key!r})")
    return tasks


def location(path: str, number: int) -> str:
    """Where row `number` of `path` is, in errors: "<file>:<line>" for JSONL (as editors
    read it), "<file>: row <n>" for the other formats."""
    return f"{path}:{number}" if path.endswith(".jsonl") else f"{path}: row {number}"


def unit_word(path: str) -> str:
    """How errors count rows: JSONL "lines", the other formats "rows"."""
    return "lines" if path.endswith(".jsonl") else "rows"


def field_word(path: str) -> str:
    """What errors call a row's entry: a JSONL "field", another format's "column"."""
    return "field" if path.endswith(".jsonl") else "column"


def raise_listed(errors: list[str], what: str, advice: str = "", unit: str = "lines") -> None:
    """One ValueError line: the first of `errors` ("<file>:N: ..." or "<file>: row N:
    ..."), then the `unit` numbers of the others (up to `_MAX_LISTED`), then `advice`."""
    if not errors:
        return
    more = ""
    if len(errors) > 1:
        numbers = [_number_of(e) for e in errors[1:_MAX_LISTED + 1]]
        rest = (f", ... ({len(errors) - 1 - len(numbers)} more)"
                if len(errors) - 1 > len(numbers) else "")
        more = f" (also {what} at {unit} {', '.join(numbers)}{rest})"
    raise ValueError(errors[0] + more + (f"; {advice}" if advice else ""))


def _number_of(error: str) -> str:
    match = re.search(r"(?::| row )(\d+): ", error)
    return match.group(1) if match else "?"


# ------------------------------------------------------------------------ readers
Record = tuple[int, Any, str | None]  # (number, record, problem reading it)


def _jsonl_records(path: str) -> Iterator[Record]:
    number = 0
    with open(path, "rb") as f:
        for number, data in enumerate(f, start=1):
            try:
                raw = data.decode("utf-8")
            except UnicodeDecodeError as error:
                yield number, None, (f"not UTF-8 text (byte 0x{data[error.start]:02x} at "
                                     f"column {error.start + 1})")
                continue
            if not raw.strip():
                continue
            try:
                yield number, json.loads(raw), None
            except json.JSONDecodeError as error:
                yield number, None, (f"not valid JSON ({error.msg} at column "
                                     f"{error.colno})")


def _csv_records(path: str) -> Iterator[Record]:
    with open(path, newline="", encoding="utf-8") as f:
        try:
            reader = csv.DictReader(f)
            for number, row in enumerate(reader, start=1):
                if None in row:
                    yield number, None, (f"{len(row) - 1 + len(row[None])} values for "
                                         f"{len(reader.fieldnames)} columns")
                    continue
                yield number, dict(row), None
        except UnicodeDecodeError as error:
            yield 0, None, f"not UTF-8 text ({error.reason})"


def _pyarrow():
    try:
        import pyarrow  # pylint: disable=g-import-not-at-top
    except ImportError as error:
        raise ImportError("reading Parquet files and datasets.save_to_disk directories "
                          "needs pyarrow: pip install \"arl[data]\"") from error
    return pyarrow


def _parquet_table(path: str):
    _pyarrow()
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

    return pq.read_table(path)


def _saved_dataset_table(path: str):
    """The table of a `save_to_disk` directory (a DatasetDict: its "train" split)."""
    pa = _pyarrow()
    dict_file = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(dict_file):
        with open(dict_file, encoding="utf-8") as f:
            splits = json.load(f).get("splits", [])
        if "train" not in splits:
            raise ValueError(f"{path!r} is a DatasetDict with splits {splits} and no "
                             "'train' split: point env.kwargs.path at one split's directory")
        path = os.path.join(path, "train")
    with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
        files = [entry["filename"] for entry in json.load(f).get("_data_files", [])]
    if not files:
        raise ValueError(f"{path!r}: state.json lists no data files")
    tables = []
    for name in files:
        with pa.memory_map(os.path.join(path, name)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def _arrow_records(path: str, table) -> Iterator[Record]:
    del path
    for number, row in enumerate(table.to_pylist(), start=1):
        yield number, row, None


# ------------------------------------------------------------------------ rows
def _task(record, number: int, prompt_key: str, answer_key: str,
          word: str = "column") -> TextTask:
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object with {word}s {prompt_key!r} and "
                         f"{answer_key!r}, got {type(record).__name__}")
    for key in (prompt_key, answer_key):
        if key not in record:
            hint = f" (it has {sorted(record)}; set prompt_key / answer_key)"
            raise ValueError(f"missing {word} {key!r}{hint}")
    answer = record[answer_key]
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        hint = (" (write decimal answers as strings, e.g. \"2.50\", so their digits are "
                "kept)" if isinstance(answer, float) else "")
        raise ValueError(f"{word} {answer_key!r} must be a string or an integer, got "
                         f"{type(answer).__name__} {answer!r}{hint}")
    if not answer.strip():
        raise ValueError(f"{word} {answer_key!r} is empty")
    prompt, messages = _prompt(record[prompt_key], f"{word} {prompt_key!r}")
    columns = {}
    for key, value in record.items():
        if key in (prompt_key, answer_key):
            continue
        try:
            columns[key] = _jsonable(value)
        except TypeError as error:
            raise ValueError(f"{word} {key!r} {error}") from None
    return TextTask(line=number, prompt=prompt, answer=answer, messages=messages,
                    columns=columns)


def _prompt(value, what: str) -> tuple[str, tuple | None]:
    """(prompt text, messages or None) of a prompt cell; `what` names it in errors."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{what} is empty")
        return value, None
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{what} must be a string or a non-empty list of "
                         f"{{'role', 'content'}} messages, got {type(value).__name__} "
                         f"{value!r}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or \
                not isinstance(message.get("content"), str):
            raise ValueError(f"{what}: message {i} must be an object with string "
                             f"'role' and 'content', got {message!r}")
        messages.append({"role": message["role"], "content": message["content"]})
    roles = [m["role"] for m in messages]
    turns = roles[1:] if roles[0] == "system" else roles
    expected = ["user" if k % 2 == 0 else "assistant" for k in range(len(turns))]
    if not turns or turns != expected or turns[-1] != "user":
        raise ValueError(f"{what}: message roles {roles} are not [system,] user, "
                         "assistant, user, ... ending on user")
    text = "\n\n".join(m["content"] for m in messages)
    return text, tuple(messages)


def _jsonable(value):
    """A cell as JSON data (lists, dicts, numbers, strings, None); dates as ISO text."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (datetime.date, datetime.datetime, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    raise TypeError(f"holds a {type(value).__name__}, which reward functions cannot be "
                    "given (use strings, numbers, lists or objects)")


# ------------------------------------------------------------------------ chat prompts
def system_prompt_of(tasks: list[TextTask], path: str) -> str | None:
    """The system message every chat prompt of `tasks` starts with (None: none has
    one); ValueError naming the first row whose system message differs (a chat format
    holds one system prompt per run)."""
    systems = [(t.line, t.messages[0]["content"] if t.messages and
                t.messages[0]["role"] == "system" else None) for t in tasks]
    first = systems[0][1]
    for line, system in systems:
        if system != first:
            raise ValueError(f"{path}: row {line}: its system message {system!r} differs from "
                             f"row {systems[0][0]}'s {first!r}; with a chat template every "
                             "row must share one system prompt")
    return first


def prompt_ids(codec, task: TextTask) -> list[int]:
    """The prompt's token ids between the chat format's first piece and its generation
    prompt (the rollout adds those), or the codec's ids of the prompt text."""
    chat = getattr(codec, "chat", None)
    # Special-token names in a task's text are plain characters (`HFCodec.encode_plain`).
    encode = getattr(codec, "encode_plain", codec.encode)
    if task.messages is None or chat is None:
        return encode(task.prompt)
    turns = [m["content"] for m in task.messages if m["role"] != "system"]
    ids = chat.ids_of_conversation(encode, turns)
    return ids[len(chat.prompt_prefix):len(ids) - len(chat.turn_suffix)]
