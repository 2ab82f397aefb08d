"""Run outputs on the host: metrics.jsonl, TensorBoard events, samples, plots, progress.

Layout of a workdir::

    workdir/metrics.jsonl            one JSON object per `MetricsWriter.write` call
    workdir/tensorboard/events.*     the same scalars plus text samples (tensorboardX)
    workdir/samples/step_000100.txt  sample trajectories rendered as text
    workdir/curves.png               `plot_curves` output (any path the caller picks)

JSON encoding of metric values: Python/numpy/jax scalars become ints (integer and
bool dtypes) or floats; non-finite floats, which strict JSON cannot hold, are
written as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` and `read_metrics`
turns them back into floats, so every line stays valid JSON and round-trips.

Durability: `MetricsWriter.sync` puts every record written so far on disk (flush and
fsync of metrics.jsonl, the event file, the samples and their directories); the
experiment loop calls it before each checkpoint commits. A writer opened with
``resume_step`` first removes what a run logged past the checkpoint it resumes from,
so after any crash each step is logged once (docs/faults.md).

Only the primary process (``jax.process_index() == 0``) writes; on other hosts
every method is a no-op, so a multi-host program can call them unconditionally.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
SAMPLES_DIR = "samples"
DEFAULT_CURVE_KEYS = ("reward_mean", "success_rate", "episode_return")

_NON_FINITE_STRINGS = frozenset({"nan", "inf", "-inf"})
_EVENT_FILE_MARK = ".tfevents."
_SAMPLE_PREFIX, _SAMPLE_SUFFIX = "step_", ".txt"


def _is_primary_process() -> bool:
    return jax.process_index() == 0


def _scalar_to_json(name: str, value: Any) -> int | float | str:
    """Converts one metric to a JSON value; raises on non-scalars naming the metric."""
    array = np.asarray(value)
    if array.size != 1:
        raise ValueError(
            f"metric {name!r} must be a scalar (Python number, numpy or jax scalar, "
            f"or a size-1 array); got shape {array.shape}."
        )
    array = array.reshape(())
    if array.dtype == np.bool_ or np.issubdtype(array.dtype, np.integer):
        return int(array)
    # jnp.issubdtype, not np's: bfloat16 and the float8 types are floating to JAX only.
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ValueError(
            f"metric {name!r} must be numeric (bool, int or float); got dtype {array.dtype}."
        )
    number = float(array.astype(np.float32))
    if math.isnan(number):
        return "nan"
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    return number


def _json_to_scalar(value: Any) -> Any:
    if isinstance(value, str) and value in _NON_FINITE_STRINGS:
        return float(value)
    return value


def _import_tensorboardx():
    """tensorboardX, imported without torch unless torch is already loaded.

    tensorboardX imports torch, where it is installed, only to name `torch.Tensor` in
    its annotations (it converts torch tensors by importing torch again when given one):
    1.5-5 s of the quickstart's start-up on the 2-core CPU for nothing a run writes
    (`benchmarks/first_step.py`, "other")."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX  # pylint: disable=g-import-not-at-top
        return tensorboardX
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        import tensorboardX  # pylint: disable=g-import-not-at-top
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return tensorboardX


def _fsync_path(path: str) -> None:
    """fsync of a file or directory by path (fsync through any descriptor of a file
    writes its data, whoever wrote it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_durably(path: str, data: bytes) -> None:
    """`path` now holds `data`, all or nothing: a temporary file, synced, renamed over
    it, and the rename synced."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    _fsync_path(os.path.dirname(path) or ".")


def _event_records(data: bytes) -> list[bytes]:
    """The whole TFRecord frames of an event file (uint64 length, uint32 CRC of it,
    payload, uint32 CRC of the payload; little-endian); a frame cut off by a crash
    ends the list."""
    frames, offset = [], 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        end = offset + 12 + length + 4
        if end > len(data):
            break
        frames.append(data[offset:end])
        offset = end
    return frames


def drop_records_after(workdir: str | os.PathLike[str], step: int) -> None:
    """Removes from `workdir` what was logged for steps after `step`: metrics.jsonl
    lines (and lines cut off by a crash), TensorBoard events and sample files. A run
    that resumes from checkpoint `step` calls it first (`MetricsWriter(resume_step=)`):
    it logs those steps again, so each step stays in the files once. Files with nothing
    to remove are left as they are."""
    workdir = os.fspath(workdir)
    path = os.path.join(workdir, METRICS_FILE)
    if os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read()
        kept = []
        for line in data.splitlines(keepends=True):
            try:
                record = json.loads(line)
                keep = line.endswith(b"\n") and int(record["step"]) <= step
            except (ValueError, TypeError, KeyError):
                keep = False
            if keep:
                kept.append(line)
        if len(kept) != len(data.splitlines()):
            _replace_durably(path, b"".join(kept))
    events = os.path.join(workdir, TENSORBOARD_DIR)
    if os.path.isdir(events):
        _import_tensorboardx()
        from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
        for name in sorted(os.listdir(events)):
            if _EVENT_FILE_MARK not in name:
                continue
            event_path = os.path.join(events, name)
            with open(event_path, "rb") as f:
                data = f.read()
            frames = _event_records(data)
            kept = [frame for frame in frames
                    if event_pb2.Event.FromString(frame[12:-4]).step <= step]
            if len(kept) != len(frames) or sum(map(len, frames)) != len(data):
                _replace_durably(event_path, b"".join(kept))
    samples = os.path.join(workdir, SAMPLES_DIR)
    if os.path.isdir(samples):
        for name in os.listdir(samples):
            number = name[len(_SAMPLE_PREFIX):-len(_SAMPLE_SUFFIX)]
            if (name.startswith(_SAMPLE_PREFIX) and name.endswith(_SAMPLE_SUFFIX)
                    and number.isdigit() and int(number) > step):
                os.remove(os.path.join(samples, name))


class _EventFile:
    """A TensorBoard event file written on the caller's thread. tensorboardX's
    SummaryWriter hands events to a thread that writes them when it gets to them, so
    its flush cannot promise that an event is in the file; here `sync` does."""

    def __init__(self, directory: str):
        tensorboardX = _import_tensorboardx()
        from tensorboardX import event_file_writer  # pylint: disable=g-import-not-at-top
        from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top

        os.makedirs(directory, exist_ok=True)
        self._summary = tensorboardX.summary
        self._event = event_pb2.Event
        # Named by the second it was opened and the host; the nanoseconds keep a writer
        # opened in the same second (a quick restart) off this one's file, and after
        # it in name order, the order TensorBoard reads files in.
        self._writer = event_file_writer.EventsWriter(
            os.path.join(directory, "events"), filename_suffix=f".{time.time_ns()}")

    def _add(self, summary, step: int) -> None:
        self._writer.write_event(self._event(summary=summary, step=step,
                                             wall_time=time.time()))

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self._add(self._summary.scalar(name, value), step)

    def add_text(self, name: str, text: str, step: int) -> None:
        self._add(self._summary.text(name, text), step)

    def sync(self) -> None:
        self._writer.flush()  # tensorboardX's RecordWriter flushes and fsyncs

    def close(self) -> None:
        self._writer.close()


class MetricsWriter:
    """Appends scalar metrics to ``metrics.jsonl`` and mirrors them to TensorBoard.

    Args:
        workdir: run directory (created if missing).
        tensorboard: also write TensorBoard event files under ``workdir/tensorboard``.
        resume_step: the checkpoint step a run resumes from (0: a fresh start). What
            a killed run logged after it is removed first (`drop_records_after`): the
            run logs those steps again. None keeps everything and appends.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        tensorboard: bool = True,
        resume_step: int | None = None,
    ):
        self._workdir = os.fspath(workdir)
        self._enabled = _is_primary_process()
        self._metrics_file: TextIO | None = None
        self._tensorboard: _EventFile | None = None
        self._sample_steps_written: set[int] = set()
        self._unsynced: set[str] = set()  # files and directories `sync` has to sync
        if not self._enabled:
            return
        os.makedirs(self._workdir, exist_ok=True)
        if resume_step is not None:
            drop_records_after(self._workdir, int(resume_step))
        path = os.path.join(self._workdir, METRICS_FILE)
        needs_newline = False
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                # A crash mid-line leaves a partial record; start ours on a fresh line.
                needs_newline = f.read(1) != b"\n"
        self._metrics_file = open(path, "a", encoding="utf-8")
        if needs_newline:
            self._metrics_file.write("\n")
        self._unsynced.add(self._workdir)  # metrics.jsonl may be new
        if tensorboard:
            self._tensorboard = _EventFile(os.path.join(self._workdir, TENSORBOARD_DIR))
            self._unsynced.add(os.path.join(self._workdir, TENSORBOARD_DIR))

    @property
    def workdir(self) -> str:
        return self._workdir

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Logs one record ``{"step": step, **metrics}``; returns it as written.

        Device arrays are fetched with one `jax.device_get` for the whole mapping.
        """
        if "step" in metrics:
            raise ValueError("metrics must not contain the key 'step'; pass it as `step`.")
        host_metrics = jax.device_get(dict(metrics))
        record: dict[str, Any] = {"step": int(step)}
        for name, value in host_metrics.items():
            record[str(name)] = _scalar_to_json(str(name), value)
        if not self._enabled:
            return record
        if self._metrics_file is None:
            raise RuntimeError("MetricsWriter.write called after close().")
        self._metrics_file.write(json.dumps(record, allow_nan=False) + "\n")
        if self._tensorboard is not None:
            for name, value in record.items():
                if name != "step":
                    self._tensorboard.add_scalar(name, float(value), int(step))
        return record

    def write_text(self, step: int, name: str, text: str) -> str:
        """Saves a text sample (e.g. a rendered trajectory) for `step`.

        Appends ``== name ==`` and the text to ``samples/step_{step:06d}.txt`` (the
        first write of a step in this process truncates a stale file left by a
        crashed run) and adds a TensorBoard text summary. Returns the file path.
        """
        path = os.path.join(self._workdir, SAMPLES_DIR,
                            f"{_SAMPLE_PREFIX}{int(step):06d}{_SAMPLE_SUFFIX}")
        if not self._enabled:
            return path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        mode = "a" if int(step) in self._sample_steps_written else "w"
        self._sample_steps_written.add(int(step))
        with open(path, mode, encoding="utf-8") as f:
            f.write(f"== {name} ==\n{text}\n")
        self._unsynced.update((path, os.path.dirname(path)))
        if self._tensorboard is not None:
            # Fenced so TensorBoard's markdown keeps line breaks and spacing.
            self._tensorboard.add_text(name, f"```\n{text}\n```", int(step))
        return path

    def flush(self) -> None:
        """Hands buffered records to the OS, so they survive the process being killed
        (not the machine going down: `sync`)."""
        if self._metrics_file is not None:
            self._metrics_file.flush()

    def sync(self) -> None:
        """Puts every record written so far on disk: flushed and fsync'ed, with the
        directories of files created since the last call. The experiment loop calls
        it before a checkpoint commits, so a checkpoint never covers a lost record."""
        if self._metrics_file is None:
            return
        self._metrics_file.flush()
        os.fsync(self._metrics_file.fileno())
        if self._tensorboard is not None:
            self._tensorboard.sync()
        for path in sorted(self._unsynced):
            _fsync_path(path)
        self._unsynced.clear()

    def close(self) -> None:
        if self._metrics_file is not None:
            self.sync()
            self._metrics_file.close()
            self._metrics_file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def read_metrics(workdir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads ``workdir/metrics.jsonl`` into one record per step, sorted by step.

    A step logged more than once (by a run that crashed after logging it and by
    the resumed run) is merged key by key, the last occurrence winning, so the
    result is what the resumed run logged plus anything only logged once for
    that step (e.g. evaluation metrics). Lines cut off by a crash are skipped
    with a warning. ``"nan"``/``"inf"``/``"-inf"`` strings become floats.
    """
    path = os.path.join(os.fspath(workdir), METRICS_FILE)
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                logging.warning("Skipping unreadable line %d of %s.", line_number, path)
                continue
            if not isinstance(record, dict) or "step" not in record:
                logging.warning("Skipping line %d of %s: no 'step'.", line_number, path)
                continue
            step = int(record["step"])
            merged = by_step.setdefault(step, {"step": step})
            merged.update({k: _json_to_scalar(v) for k, v in record.items() if k != "step"})
    return [by_step[step] for step in sorted(by_step)]


def plot_curves(
    workdir_or_records: str | os.PathLike[str] | Sequence[Mapping[str, Any]],
    out_png: str | os.PathLike[str],
    keys: Iterable[str] = DEFAULT_CURVE_KEYS,
    *,
    title: str | None = None,
) -> str:
    """Plots each of `keys` present in the records against ``step`` into a PNG.

    Args:
        workdir_or_records: a run directory (read with `read_metrics`) or records.
        out_png: output path; parent directories are created.
        keys: metric names, one subplot each; absent ones are skipped. The
            default covers token envs (``reward_mean``, ``success_rate``) and
            vector envs (``episode_return``).
        title: figure title.

    Returns:
        The path of the written PNG.

    Raises:
        ValueError: none of `keys` occurs in the records (lists the ones that do).
    """
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    if isinstance(workdir_or_records, (str, os.PathLike)):
        records = read_metrics(workdir_or_records)
    else:
        records = list(workdir_or_records)
    keys = list(keys)
    present = [key for key in keys if any(key in record for record in records)]
    if not present:
        available = sorted({k for record in records for k in record if k != "step"})
        raise ValueError(f"keys {keys} not found in the metrics; available keys: {available}.")
    figure, axes = plt.subplots(
        len(present), 1, figsize=(6.4, 2.6 * len(present)), sharex=True, squeeze=False
    )
    for axis, key in zip(axes[:, 0], present):
        points = [
            (record["step"], float(record[key]))
            for record in records
            if key in record and record[key] is not None and math.isfinite(float(record[key]))
        ]
        steps, values = zip(*points) if points else ((), ())
        axis.plot(steps, values, marker="." if len(points) < 50 else None)
        axis.set_ylabel(key)
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    out_png = os.fspath(out_png)
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    figure.savefig(out_png, dpi=100)
    plt.close(figure)
    return out_png


class ProgressBar:
    """One-line progress display: step/total, rate, ETA and a few live metrics.

    On a TTY it draws a tqdm bar on `stream` (stderr by default). When `stream`
    is not a TTY (log files, CI, subprocesses) it prints nothing, unless
    `log_every` is set: then every `log_every` steps it emits one absl
    ``logging.info`` line with the same content.

    Args:
        total: final step.
        initial: starting step (e.g. the step restored from a checkpoint).
        stream: where the bar is drawn; defaults to ``sys.stderr``.
        log_every: non-TTY fallback interval in steps; None keeps it quiet.
        max_metrics: how many metrics `update` shows (the first ones given).
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        stream: TextIO | None = None,
        log_every: int | None = None,
        max_metrics: int = 4,
    ):
        if total < 0 or initial < 0 or initial > total:
            raise ValueError(
                f"need 0 <= initial <= total, got initial={initial}, total={total}."
            )
        if log_every is not None and log_every < 1:
            raise ValueError(f"log_every must be None or >= 1, got {log_every}.")
        self._total = int(total)
        self._initial = int(initial)
        self._step = int(initial)
        self._log_every = log_every
        self._max_metrics = max_metrics
        self._start_time = time.monotonic()
        stream = sys.stderr if stream is None else stream
        is_tty = bool(getattr(stream, "isatty", lambda: False)())
        self._bar = None
        if is_tty and _is_primary_process():
            import tqdm  # pylint: disable=g-import-not-at-top

            self._bar = tqdm.tqdm(
                total=self._total,
                initial=self._initial,
                file=stream,
                dynamic_ncols=True,
                unit="step",
                leave=True,
            )

    @property
    def enabled(self) -> bool:
        """True when a bar is drawn (TTY on the primary process)."""
        return self._bar is not None

    def _format_metrics(self, metrics: Mapping[str, Any]) -> dict[str, str]:
        shown = {}
        for name, value in list(metrics.items())[: self._max_metrics]:
            try:
                shown[name] = f"{float(np.asarray(value)):.4g}"
            except (TypeError, ValueError):
                shown[name] = str(value)
        return shown

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Moves the bar to absolute `step` and shows `metrics` next to it."""
        step = int(step)
        previous, self._step = self._step, step
        shown = self._format_metrics(metrics or {})
        if self._bar is not None:
            if shown:
                self._bar.set_postfix(shown, refresh=False)
            self._bar.update(step - previous)
            return
        if self._log_every is not None and _is_primary_process():
            if step // self._log_every > previous // self._log_every or step == self._total:
                elapsed = time.monotonic() - self._start_time
                rate = (step - self._initial) / elapsed if elapsed > 0 else 0.0
                eta = (self._total - step) / rate if rate > 0 else float("inf")
                details = " ".join(f"{k}={v}" for k, v in shown.items())
                logging.info(
                    "step %d/%d (%.2f steps/s, ETA %.0fs) %s",
                    step, self._total, rate, eta, details,
                )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
