"""Datasets as users keep them (`arl.data.task_files`, through `dataset_task`): JSONL,
Parquet, CSV and `datasets.save_to_disk` directories give the same tasks; column
mapping, chat prompts, extra columns, the held-out split; bad rows as one line naming
file, row and column."""

import csv
import json
import re

import pytest

from arl.data import task_files
from arl.text.codec import CharCodec
from arl.envs.tasks.dataset_task import DatasetTask

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = [{"question": f"What is {a} times 3?", "solution": str(3 * a), "source": "mul",
         "level": a % 4, "tests": [a, 3]} for a in range(1, 21)]


def _write(path, rows, kind):
    path = str(path)
    if kind == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif kind == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif kind in ("saved", "saved_dict"):
        datasets = pytest.importorskip("datasets")
        data = datasets.Dataset.from_list(rows)
        if kind == "saved_dict":
            data = datasets.DatasetDict({"train": data, "test": data.select(range(2))})
        data.save_to_disk(path)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved", "saved_dict"])
def test_every_format_gives_the_same_tasks_and_columns(tmp_path, kind):
    path = _write(tmp_path / f"tasks.{kind}", ROWS, kind)
    if kind.startswith("saved"):
        path = str(tmp_path / f"tasks.{kind}")
    tasks = task_files.read_task_file(path, prompt_key="question", answer_key="solution")
    assert [(t.prompt, t.answer) for t in tasks] == [(r["question"], r["solution"])
                                                     for r in ROWS]
    assert [t.line for t in tasks] == list(range(1, 21))
    assert [t.columns for t in tasks] == [{"source": r["source"], "level": r["level"],
                                           "tests": r["tests"]} for r in ROWS]


def test_csv_values_are_text(tmp_path):
    path = _write(tmp_path / "t.csv", ROWS, "csv")
    tasks = task_files.read_task_file(path, prompt_key="question", answer_key="solution")
    assert [(t.prompt, t.answer) for t in tasks] == [(r["question"], r["solution"])
                                                     for r in ROWS]
    assert tasks[4].columns == {"source": "mul", "level": "1", "tests": "[5, 3]"}


def test_dataset_task_on_parquet_keeps_the_split_and_the_columns(tmp_path):
    path = _write(tmp_path / "t.parquet", ROWS, "parquet")
    train = DatasetTask(path, prompt_key="question", answer_key="solution",
                        eval_fraction=0.25)
    held_out = DatasetTask(path, split="eval", prompt_key="question", answer_key="solution",
                           eval_fraction=0.25)
    assert (train.num_rows, held_out.num_rows) == (15, 5)
    seen = sorted(train.tasks.answer_texts + held_out.tasks.answer_texts, key=int)
    assert seen == [r["solution"] for r in ROWS]
    for env in (train, held_out):
        for row in range(env.num_rows):
            a = int(env.tasks.answer_texts[row]) // 3
            length = int(env.tasks.prompt_lengths[row])
            assert CharCodec().decode(env.tasks.prompts[row, :length]) == \
                f"What is {a} times 3?" == env.tasks.source_prompt(row)
            assert env.tasks.source_columns(row) == {"source": "mul", "level": a % 4,
                                                     "tests": [a, 3]}
    columns = held_out.reward_columns([0, 2])
    assert set(columns) == {"answer", "source", "level", "tests"}
    assert columns["answer"] == [held_out.tasks.answer_texts[0], held_out.tasks.answer_texts[2]]


def test_chat_prompts_without_a_template_join_their_contents(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": f"{a}+{a}?"}], "answer": str(2 * a)}
            for a in range(8)]
    env = DatasetTask(_write(tmp_path / "chat.parquet", rows, "parquet"), eval_fraction=0.25)
    for row in range(env.num_rows):
        a = int(env.tasks.answer_texts[row]) // 2
        assert env.tasks.prompt_texts[row] == f"Be brief.\n\n{a}+{a}?"
        assert env.tasks.source_prompt(row) == rows[a]["prompt"]
        length = int(env.tasks.prompt_lengths[row])
        assert CharCodec().decode(env.tasks.prompts[row, :length]) == f"Be brief.\n\n{a}+{a}?"


def test_rows_must_share_one_system_message(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "A" if a != 3 else "B"},
                        {"role": "user", "content": "q"}], "answer": "1"} for a in range(5)]
    path = _write(tmp_path / "s.parquet", rows, "parquet")
    tasks = task_files.read_task_file(path)
    with pytest.raises(ValueError, match=r"s.parquet: row 4: its system message 'B' differs "
                                         r"from row 1's 'A'"):
        task_files.system_prompt_of(tasks, path)
    assert task_files.system_prompt_of(tasks[:3], path) == "A"


GOOD = {"question": "q", "solution": "1"}
CHAT = [{"role": "user", "content": "q"}]


@pytest.mark.parametrize("good,bad,message", [
    (GOOD, {"question": "q", "solution": None},
     "row 3: column 'solution' must be a string or an integer, got NoneType None"),
    (GOOD, {"question": " ", "solution": "1"}, "row 3: column 'question' is empty"),
    ({"question": CHAT, "solution": "1"},
     {"question": [{"role": "assistant", "content": "hi"}], "solution": "1"},
     r"row 3: column 'question': message roles \['assistant'\] are not \[system,\] user"),
    ({"question": CHAT, "solution": "1"},
     {"question": [{"role": "user", "content": None}], "solution": "1"},
     "row 3: column 'question': message 0 must be an object with string 'role' and "
     "'content'"),
    (GOOD, {"question": "q", "solution": "1", "blob": b"\x00"},
     "row 3: column 'blob' holds a bytes"),
])
def test_bad_parquet_rows_are_one_line_naming_file_row_and_column(tmp_path, good, bad,
                                                                   message):
    path = str(tmp_path / "bad.parquet")
    rows = [good, good, bad, good, bad]
    keys = list(dict.fromkeys(k for r in rows for k in r))  # one schema: None elsewhere
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path)
    with pytest.raises(ValueError) as error:
        task_files.read_task_file(path, prompt_key="question", answer_key="solution")
    text = str(error.value)
    assert "\n" not in text and text.startswith(f"{path}: ")
    assert re.search(message, text), text
    assert text.endswith("(also bad rows at rows 5)")


def test_bad_csv_and_jsonl_rows(tmp_path):
    path = str(tmp_path / "bad.csv")
    with open(path, "w", encoding="utf-8") as f:
        f.write("question,solution\nq,1\nq,\nq,1,extra\n")
    with pytest.raises(ValueError, match=r"bad.csv: row 2: column 'solution' is empty \(also "
                                         r"bad rows at rows 3\)$"):
        task_files.read_task_file(path, prompt_key="question", answer_key="solution")
    path = _write(tmp_path / "bad.jsonl", [{"q": "x", "a": "1"}, {"q": "y"},
                                           {"q": "z", "a": 2.5}], "jsonl")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field 'a'.* \(also bad rows "
                                         r"at lines 3\)$"):
        task_files.read_task_file(path, prompt_key="q", answer_key="a")
    with pytest.raises(ValueError, match="not a dataset file"):
        task_files.read_task_file(str(tmp_path))
