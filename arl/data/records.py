"""Datasets stored with tensorflow-datasets as ``array_record`` files, without TensorFlow:
tfds 4.9 prepares and reads those (`tfds.builder_from_directory(path).as_data_source()`,
read through a grain `MapDataset`).

The builders of arl's three kinds of dataset (`builder_classes`: evaluation task sets and
demonstrations, `arl.rollout.episode_datasets`; prompts and answers from JSONL,
`arl.data.text_tasks`), `prepare` (build once, refuse a different set in the same place)
and `read_all` (every record of a split, in index order). tfds and grain are imported on
first use, so importing arl does not import them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from typing import Any

import numpy as np

BUILDER_VERSION = "1.0.0"  # every builder's tfds version (its directory name)


def _tfds():
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    return tfds


@functools.lru_cache(maxsize=None)  # tfds registers builder classes by name: define once
def builder_classes():
    """The builder classes, defined lazily so importing arl does not import tfds."""
    tfds = _tfds()

    class _Builder(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version(BUILDER_VERSION)
        RELEASE_NOTES = {BUILDER_VERSION: "First version."}

        def __init__(self, *, env_config=None, num_examples=0, seed=0, generate=None,
                     extra_metadata=None, **kwargs):
            self._env_config = env_config
            self._num_examples = num_examples
            self._seed = seed
            self._generate = generate
            self._extra_metadata = extra_metadata or {}
            super().__init__(**kwargs)

        def _metadata(self):
            return tfds.core.MetadataDict(
                env_config=self._env_config, num_examples=self._num_examples,
                seed=self._seed, **self._extra_metadata)

        def _split_generators(self, dl_manager):
            del dl_manager
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            return self._generate()

    class ArlTaskSet(_Builder):
        """Fixed tasks: reset key, environment id and prompt of each."""

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, description="arl evaluation task set",
                features=tfds.features.FeaturesDict({
                    "index": np.int32,
                    "reset_key": tfds.features.Tensor(
                        shape=self._extra_metadata["key_shape"], dtype=np.uint32),
                    "env_id": np.int32,
                    "prompt": tfds.features.Tensor(
                        shape=(self._extra_metadata["prompt_len"],), dtype=np.int32),
                }),
                metadata=self._metadata())

    class ArlDemonstrations(_Builder):
        """Episodes of a scripted policy: token buffers and agent masks."""

        def _info(self):
            width = self._extra_metadata["context_length"]
            return tfds.core.DatasetInfo(
                builder=self, description="arl expert demonstrations",
                features=tfds.features.FeaturesDict({
                    "index": np.int32,
                    "tokens": tfds.features.Tensor(shape=(width,), dtype=np.int32),
                    "agent_mask": tfds.features.Tensor(shape=(width,), dtype=np.uint8),
                    "length": np.int32,
                    "num_turns": np.int32,
                    "success": np.bool_,
                    "episode_return": np.float32,
                    "env_id": np.int32,
                }),
                metadata=self._metadata())

    class ArlTextTasks(_Builder):
        """Prompts and reference answers read from JSONL (`arl.data.text_tasks`): token
        ids of both, the answer text, and the answer in each verifier's canonical form
        as Unicode code points. Two splits, "train" and "eval"."""

        def _split_generators(self, dl_manager):
            del dl_manager
            return {split: self._generate(split) for split in ("train", "eval")}

        def _info(self):
            widths = self._extra_metadata["widths"]

            def ids(width):
                return tfds.features.Tensor(shape=(width,), dtype=np.int32)

            return tfds.core.DatasetInfo(
                builder=self, description="arl prompts and reference answers",
                features=tfds.features.FeaturesDict({
                    "index": np.int32,  # row within its split
                    "line": np.int32,  # 1-based line of the source JSONL file
                    "prompt": ids(widths["prompt"]),
                    "prompt_length": np.int32,
                    "prompt_text": tfds.features.Text(),
                    "answer": ids(widths["answer"]),
                    "answer_length": np.int32,
                    "answer_text": tfds.features.Text(),
                    # {"prompt": as the source holds it, "columns": the row's others}
                    "source_json": tfds.features.Text(),
                    **{f"{form}_chars": ids(widths[form]) for form in CANONICAL_FORMS},
                    **{f"{form}_length": np.int32 for form in CANONICAL_FORMS},
                }),
                metadata=self._metadata())

    return ArlTaskSet, ArlDemonstrations, ArlTextTasks


# The canonical answer forms a text-task record stores (as code points), one per verifier
# of `arl.envs.tasks.dataset_task`; length -1 means the answer has no such form (no number).
CANONICAL_FORMS = ("exact", "normalized", "number")


class _NoVariantWarnings(logging.Filter):
    """Drops tfds's "Variant folder <dir> has no dataset_info.json": it looks for finished
    versions in the directory a new dataset is being written to and warns about the one
    being written (every new dataset logged it once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Variant folder %s has no")


@contextlib.contextmanager
def _no_variant_warnings():
    log_filter, logger = _NoVariantWarnings(), logging.getLogger("absl")  # tfds logs there
    logger.addFilter(log_filter)
    try:
        yield
    finally:
        logger.removeFilter(log_filter)


def prepare(builder_cls, data_dir, **kwargs) -> str:
    with _no_variant_warnings():
        return _prepare(builder_cls, data_dir, **kwargs)


def _prepare(builder_cls, data_dir, **kwargs) -> str:
    tfds = _tfds()
    builder = builder_cls(data_dir=os.fspath(data_dir), file_format="array_record", **kwargs)
    if builder.is_prepared():  # tfds would silently reuse it: only if it is the same set
        on_disk = dict(tfds.builder_from_directory(os.fspath(builder.data_path)).info.metadata)
        wanted = json.loads(json.dumps(dict(builder._metadata())))  # pylint: disable=protected-access
        if on_disk != wanted:
            raise ValueError(f"{os.fspath(builder.data_path)!r} already holds a different "
                             f"dataset ({on_disk}); choose another data_dir")
        return os.fspath(builder.data_path)
    # tfds prints its progress ("Downloading and preparing dataset ...") on stdout and
    # draws progress bars: the programs' stdout is their result (make_dataset prints the
    # directory), so both are silenced.
    tfds.disable_progress_bar()
    with open(os.devnull, "w", encoding="utf-8") as quiet, \
            contextlib.redirect_stdout(quiet):
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(verify_ssl=False))
    return os.fspath(builder.data_path)


def read_all(path: str, split: str = "train") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every record of `split` of the dataset at `path`, as stacked arrays in `index`
    order."""
    import grain  # pylint: disable=g-import-not-at-top

    tfds = _tfds()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no dataset directory {path!r}")
    builder = tfds.builder_from_directory(path)
    if split not in builder.info.splits:
        raise ValueError(f"dataset {path!r} has no split {split!r}; its splits are "
                         f"{sorted(builder.info.splits)}")
    source = builder.as_data_source(split=split)
    if len(source) == 0:
        raise ValueError(f"split {split!r} of dataset {path!r} is empty")
    batch = grain.MapDataset.source(source).batch(len(source))[0]
    order = np.argsort(np.asarray(batch["index"]))  # tfds shuffles records on write
    arrays = {name: np.asarray(value)[order] for name, value in batch.items()}
    return arrays, dict(builder.info.metadata or {})
