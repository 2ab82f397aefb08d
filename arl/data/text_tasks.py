"""Prompts and reference answers from a JSONL file, as a tfds array_record dataset.

    path = build_text_tasks("/tmp/data", "tasks.jsonl", codec=CharCodec())
    tasks = load_text_tasks(path, "eval")          # numpy arrays of one split

(`python -m experiments.make_dataset` is the command-line form.) Each line of the input
is a JSON object ``{"prompt": str, "answer": str}`` (an integer answer is accepted and
written as its decimal text; other fields are ignored; blank lines are skipped). Bad
input (a missing or mistyped field, invalid JSON, bytes that are not UTF-8, an empty
file, a row over the limits) is ONE error line naming the file and the first bad line
(the other bad lines' numbers follow on the same line), raised before anything is
written.

The dataset (``<data_dir>/arl_text_tasks/1.0.0``, the directory `load_text_tasks` and
`arl.envs.tasks.dataset_task.DatasetTask` take) has a "train" and an "eval" split (a seeded
shuffle; `eval_fraction` of the rows, rounded, go to "eval"). Each record holds the
prompt and the answer as token ids of the codec (padded to the longest row), their texts,
their 1-based source line, and the answer in every verifier's canonical form as code
points (`arl.text.verifiers`: "exact", "normalized" and "number"; a length of -1 when the
answer holds no number). Prompts and answers longer than the limits are listed and the
build fails, or with `drop_long=True` they are dropped and listed; nothing is cut.

The metadata records the source file (name, sha256, rows), the tokenizer (`{"kind":
"char"}`, or `{"kind": "hf", "sha256": ...}` of the tokenizer's JSON, which is copied
into the dataset directory as ``tokenizer.json``), the split sizes and seed, and the
padded lengths. `cached_text_tasks` builds a JSONL file once into a cache directory keyed
by its content and the build settings (what `DatasetTask(path="x.jsonl")` uses).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
import shutil
import tempfile
from typing import Any, Callable

import numpy as np

from arl import caches
from arl.data import records, task_files
from arl.text import verifiers
from arl.text.codec import CharCodec, Codec

BUILDER_DIR = os.path.join("arl_text_tasks", records.BUILDER_VERSION)
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "eval")
MAX_PROMPT_LEN = 512
MAX_ANSWER_LEN = 256
_FORMAT_VERSION = 2  # bump when the records change meaning (invalidates cached builds)
# What a .jsonl path built on use (DatasetTask(path="x.jsonl")) can do about long rows:
# the env takes no limits, a dataset built by make_dataset can drop them.
CACHED_LONG_ROWS_ADVICE = (
    "shorten or remove those rows, or build the dataset with `python -m "
    "experiments.make_dataset --drop_long` (or higher --max_prompt_len / --max_answer_len) "
    "and set env.kwargs.path to its directory")


# ---------------------------------------------------------------------------- tokenizers
def tokenizer_spec(codec: Codec) -> dict[str, Any]:
    """What identifies a codec's token ids: {"kind": "char"} or the sha256 of an HF
    tokenizer's JSON (plus the vocabulary size)."""
    from arl.text.hf_codec import HFCodec  # pylint: disable=g-import-not-at-top

    if isinstance(codec, HFCodec):
        digest = hashlib.sha256(codec.tokenizer.to_str().encode("utf-8")).hexdigest()
        return {"kind": "hf", "sha256": digest, "vocab_size": int(codec.vocab_size)}
    if type(codec) is CharCodec:  # pylint: disable=unidiomatic-typecheck
        return {"kind": "char", "vocab_size": int(codec.vocab_size)}
    raise ValueError(f"codec must be a CharCodec or an HFCodec, got {type(codec).__name__}")


def codec_from_dataset(path: str, spec: dict[str, Any]) -> Codec:
    """The codec a dataset was tokenized with (its copied tokenizer.json for "hf")."""
    if spec.get("kind") == "char":
        return CharCodec()
    if spec.get("kind") == "hf":
        from arl.text.hf_codec import HFCodec  # pylint: disable=g-import-not-at-top

        return HFCodec(os.path.join(path, TOKENIZER_FILE))
    raise ValueError(f"dataset {path!r} records an unknown tokenizer {spec!r}")


# ---------------------------------------------------------------------------- building
def _encode(codec: Codec, text, where: str, field: str, errors: list[str]):
    """The ids of `text` (a string, or a `TextTask`'s prompt: `task_files.prompt_ids`)."""
    try:
        if isinstance(text, task_files.TextTask):
            return task_files.prompt_ids(codec, text)
        return getattr(codec, "encode_plain", codec.encode)(text)
    except ValueError as error:
        errors.append(f"{where}: {field}: {error}")
        return []


def _split_order(count: int, seed: int) -> list[int]:
    """A seeded shuffle of range(count) that only uses `random.Random.random`, whose
    sequence Python guarantees across versions."""
    rng = random.Random(seed)
    keys = [rng.random() for _ in range(count)]
    return sorted(range(count), key=lambda i: keys[i])


def _sha256_source(path: str) -> str:
    """sha256 of a file, or of a directory's files (names and bytes, sorted)."""
    if not os.path.isdir(path):
        return _sha256_file(path)
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            digest.update(os.path.relpath(full, path).encode("utf-8"))
            digest.update(_sha256_file(full).encode("ascii"))
    return digest.hexdigest()


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_text_tasks(data_dir, jsonl_path, *, codec: Codec | None = None,
                     eval_fraction: float = 0.1, seed: int = 0,
                     max_prompt_len: int = MAX_PROMPT_LEN,
                     max_answer_len: int = MAX_ANSWER_LEN, drop_long: bool = False,
                     log: Callable[[str], None] | None = None,
                     long_rows_advice: str = "", prompt_key: str = "prompt",
                     answer_key: str = "answer") -> str:
    """Writes the tasks of `jsonl_path` as a dataset under `data_dir`; returns its
    directory. `jsonl_path` may also be any file `arl.data.task_files` reads (Parquet,
    CSV, a `datasets.save_to_disk` directory), with the columns `prompt_key` and
    `answer_key`; chat prompts are tokenized with the codec's chat format
    (`task_files.prompt_ids`), and each row's prompt as given and its other columns are
    kept (`TextTasks.source_prompt` / `source_columns`). `codec` (default `CharCodec()`) tokenizes prompts and answers;
    `max_prompt_len` / `max_answer_len` are the limits in tokens (module docstring).
    Bad input is one ValueError line naming the file and the (first) line, raised
    before anything is written; `long_rows_advice` replaces the advice of the error for
    rows over the limits (the options the caller offers)."""
    codec = CharCodec() if codec is None else codec
    spec = tokenizer_spec(codec)
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or \
            not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be a number in (0, 1), got {eval_fraction!r}")
    for name, value in (("max_prompt_len", max_prompt_len), ("max_answer_len", max_answer_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    log = log or (lambda message: None)
    jsonl_path = os.fspath(jsonl_path)
    tasks = task_files.read_task_file(jsonl_path, prompt_key=prompt_key,
                                      answer_key=answer_key)
    word = task_files.field_word(jsonl_path)
    chat = getattr(codec, "chat", None)
    if chat is not None and any(t.messages for t in tasks):
        system = task_files.system_prompt_of(tasks, jsonl_path)
        if system is not None and system != chat.system_prompt:
            raise ValueError(f"{jsonl_path}: the rows' system message {system!r} is not the "
                             f"codec's chat system prompt {chat.system_prompt!r} (dataset_task "
                             "takes it from the rows: point env.kwargs.path at the file)")

    errors, too_long, rows = [], [], []
    for task in tasks:
        where = task_files.location(jsonl_path, task.line)
        prompt = _encode(codec, task, where, f"{word} {prompt_key!r}", errors)
        answer = _encode(codec, task.answer, where, f"{word} {answer_key!r}", errors)
        long = [f"{field} has {len(ids)} tokens, more than {name}={limit}"
                for field, ids, name, limit in ((f"{word} {prompt_key!r}", prompt,
                                                 "max_prompt_len", max_prompt_len),
                                                (f"{word} {answer_key!r}", answer,
                                                 "max_answer_len", max_answer_len))
                if len(ids) > limit]
        if long:
            too_long.append((task.line, f"{where}: " + "; ".join(long)))
            continue
        number = verifiers.extract_number(task.answer)
        source = json.dumps({"prompt": task.source_prompt, "columns": task.columns},
                            ensure_ascii=False)
        rows.append(dict(line=task.line, prompt=prompt, answer=answer, source=source,
                         prompt_text=task.prompt, answer_text=task.answer,
                         exact=verifiers.strip_text(task.answer),
                         normalized=verifiers.normalize_text(task.answer), number=number))
    unit = task_files.unit_word(jsonl_path)
    task_files.raise_listed(errors, f"text the codec {codec!r} cannot encode", unit=unit)
    if too_long and not drop_long:
        task_files.raise_listed([message for _, message in too_long],
                                "rows over the limits", unit=unit, advice=long_rows_advice or "raise max_prompt_len / max_answer_len or pass "
                      "drop_long=True to drop them")
    for _, message in too_long:
        log(f"dropped {message}")

    num_eval = int(round(eval_fraction * len(rows)))
    if not 1 <= num_eval <= len(rows) - 1:
        raise ValueError(f"eval_fraction={eval_fraction} of {len(rows)} rows gives "
                         f"{num_eval} eval rows; both splits need at least one row")
    order = _split_order(len(rows), seed)
    split_rows = {"eval": [rows[i] for i in order[:num_eval]],
                  "train": [rows[i] for i in order[num_eval:]]}
    widths = {"prompt": max(len(r["prompt"]) for r in rows),
              "answer": max(len(r["answer"]) for r in rows)}
    for form in records.CANONICAL_FORMS:
        widths[form] = max([1] + [len(r[form]) for r in rows if r[form] is not None])

    def generate(split):
        for index, row in enumerate(split_rows[split]):
            record = {"index": index, "line": row["line"],
                      "prompt_text": row["prompt_text"], "answer_text": row["answer_text"],
                      "source_json": row["source"]}
            for field in ("prompt", "answer"):
                padded = np.full((widths[field],), codec.pad_id, np.int32)
                padded[: len(row[field])] = row[field]
                record[field] = padded
                record[f"{field}_length"] = len(row[field])
            for form in records.CANONICAL_FORMS:
                text = row[form]
                chars, length = verifiers.code_points(text or "", widths[form])
                record[f"{form}_chars"] = chars
                record[f"{form}_length"] = length if text is not None else -1
            yield index, record

    metadata = {
        "source": {"file": os.path.basename(jsonl_path), "sha256": _sha256_source(jsonl_path),
                   "rows": len(tasks), "prompt_key": prompt_key, "answer_key": answer_key},
        "tokenizer": spec, "eval_fraction": float(eval_fraction),
        "splits": {split: len(split_rows[split]) for split in SPLITS},
        "widths": widths,
        "limits": {"max_prompt_len": max_prompt_len, "max_answer_len": max_answer_len},
        "dropped_lines": [line for line, _ in too_long],
        "answers_with_number": sum(r["number"] is not None for r in rows),
        "format_version": _FORMAT_VERSION,
    }
    builder = records.builder_classes()[2]
    path = records.prepare(builder, data_dir, env_config=None,
                           num_examples=len(rows), seed=seed, generate=generate,
                           extra_metadata=metadata)
    if spec["kind"] == "hf":
        with open(os.path.join(path, TOKENIZER_FILE), "w", encoding="utf-8") as f:
            f.write(codec.tokenizer.to_str())
    log(f"wrote {path}: train {metadata['splits']['train']} rows, eval "
        f"{metadata['splits']['eval']} rows; prompt {widths['prompt']} tokens, answer "
        f"{widths['answer']} tokens; {metadata['answers_with_number']}/{len(rows)} answers "
        f"hold a number")
    return path


# ---------------------------------------------------------------------------- reading back
@dataclasses.dataclass(frozen=True)
class TextTasks:
    """One split of a text-task dataset, as numpy arrays in row order.

    prompts int32 [N, P] (pad-padded) and prompt_lengths [N]; answers int32 [N, A] and
    answer_lengths [N]; forms[form] = (code points int32 [N, W], lengths int32 [N]) for
    each of `CANONICAL_FORMS` (length -1: no such form); lines [N] (source line);
    prompt_texts, answer_texts (lists of str); metadata (the dataset's)."""

    path: str
    split: str
    prompts: np.ndarray
    prompt_lengths: np.ndarray
    answers: np.ndarray
    answer_lengths: np.ndarray
    forms: dict[str, tuple[np.ndarray, np.ndarray]]
    lines: np.ndarray
    prompt_texts: list[str]
    answer_texts: list[str]
    metadata: dict[str, Any]
    # Per row, JSON of {"prompt": the prompt as the source holds it, "columns": its other
    # columns}; empty for datasets written before they were kept.
    sources: list[str] = dataclasses.field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return int(self.prompts.shape[0])

    @functools.cached_property
    def _decoded_sources(self) -> list[dict[str, Any]]:
        return [json.loads(s) for s in self.sources]

    def source_prompt(self, row: int):
        """Row `row`'s prompt as the source file holds it (text, or a message list)."""
        if not self.sources:
            return self.prompt_texts[row]
        return self._decoded_sources[row]["prompt"]

    def source_columns(self, row: int) -> dict[str, Any]:
        """Row `row`'s columns other than the prompt and the answer."""
        return self._decoded_sources[row]["columns"] if self.sources else {}

    @functools.cached_property
    def column_names(self) -> list[str]:
        """Every column name some row holds, in first-seen order."""
        names = {}
        for source in self._decoded_sources:
            names.update(dict.fromkeys(source["columns"]))
        return list(names)


def dataset_path(path) -> str:
    """The dataset directory of `path`: itself when it holds a built dataset, else the
    ``arl_text_tasks/<version>`` directory under it (what `make_dataset --output` got)."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "dataset_info.json")):
        return path
    nested = os.path.join(path, BUILDER_DIR)
    if os.path.isfile(os.path.join(nested, "dataset_info.json")):
        return nested
    raise FileNotFoundError(
        f"{path!r} is not a text-task dataset (no dataset_info.json in it or in "
        f"{nested!r}); build one with `python -m experiments.make_dataset`")


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def load_text_tasks(path, split: str = "train") -> TextTasks:
    """One split ("train" or "eval") of the dataset at `path` (see `dataset_path`)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = dataset_path(path)
    arrays, metadata = records.read_all(path, split)
    if "tokenizer" not in metadata or "widths" not in metadata:
        raise ValueError(f"{path!r} is not a text-task dataset (its metadata has no "
                         "tokenizer / widths)")
    return TextTasks(
        path=path, split=split,
        prompts=arrays["prompt"].astype(np.int32),
        prompt_lengths=arrays["prompt_length"].astype(np.int32),
        answers=arrays["answer"].astype(np.int32),
        answer_lengths=arrays["answer_length"].astype(np.int32),
        forms={form: (arrays[f"{form}_chars"].astype(np.int32),
                      arrays[f"{form}_length"].astype(np.int32))
               for form in records.CANONICAL_FORMS},
        lines=arrays["line"].astype(np.int32),
        prompt_texts=[_text(t) for t in arrays["prompt_text"]],
        answer_texts=[_text(t) for t in arrays["answer_text"]],
        metadata=metadata,
        sources=[_text(t) for t in arrays["source_json"]] if "source_json" in arrays else [])


# ---------------------------------------------------------------------------- cache
def cached_text_tasks(jsonl_path, *, codec: Codec | None = None, eval_fraction: float = 0.1,
                      seed: int = 0, max_prompt_len: int = MAX_PROMPT_LEN,
                      max_answer_len: int = MAX_ANSWER_LEN, cache_dir=None,
                      prompt_key: str = "prompt", answer_key: str = "answer") -> str:
    """The dataset of `jsonl_path`, built on first use into
    ``<cache_dir or arl.caches.cache_root()>/text_tasks/<key>`` (key: a hash of the
    file's bytes, the tokenizer and the settings), so a changed file or tokenizer builds
    anew.
    Concurrent callers (test workers) each build into a private directory and the first
    rename wins."""
    codec = CharCodec() if codec is None else codec
    chat = getattr(codec, "chat", None)
    settings = {"source": _sha256_source(os.fspath(jsonl_path)),
                "tokenizer": tokenizer_spec(codec),
                "chat": None if chat is None else repr(chat),
                "prompt_key": prompt_key, "answer_key": answer_key,
                "eval_fraction": float(eval_fraction), "seed": int(seed),
                "max_prompt_len": max_prompt_len, "max_answer_len": max_answer_len,
                "format_version": _FORMAT_VERSION}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]
    root = os.path.join(os.fspath(cache_dir or caches.cache_root()), "text_tasks")
    final = os.path.join(root, key)
    if not os.path.isdir(final):
        os.makedirs(root, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=f".{key}-", dir=root)
        try:
            build_text_tasks(scratch, jsonl_path, codec=codec, eval_fraction=eval_fraction,
                             seed=seed, max_prompt_len=max_prompt_len,
                             max_answer_len=max_answer_len,
                             long_rows_advice=CACHED_LONG_ROWS_ADVICE,
                             prompt_key=prompt_key, answer_key=answer_key)
            try:
                os.rename(scratch, final)
            except OSError:  # another process finished first: use its copy
                if not os.path.isdir(final):
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return os.path.join(final, BUILDER_DIR)
