"""Tests for arl.runs.writers: metrics.jsonl, TensorBoard events, samples, plots, progress."""

from __future__ import annotations

import glob
import io
import json
import logging
import math
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from arl.runs import writers


def _read_events(logdir: str) -> list[event_pb2.Event]:
    """Parses TFRecord-framed TensorBoard event files with tensorboardX's protobuf.

    Record layout: uint64 length, uint32 masked CRC of the length, payload,
    uint32 masked CRC of the payload (all little-endian).
    """
    events = []
    paths = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
    assert paths, f"no event files in {logdir}"
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            payload = data[offset + 12 : offset + 12 + length]
            assert len(payload) == length, "truncated event record"
            events.append(event_pb2.Event.FromString(payload))
            offset += 12 + length + 4
    return events


def _scalars(events) -> dict[str, list[tuple[int, float]]]:
    result: dict[str, list[tuple[int, float]]] = {}
    for event in events:
        for value in event.summary.value:
            if value.HasField("simple_value"):
                result.setdefault(value.tag, []).append((event.step, value.simple_value))
    return result


def _strict_json(line: str):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(line, parse_constant=reject)


def test_jsonl_round_trip_of_python_numpy_and_jax_scalars(tmp_path):
    with writers.MetricsWriter(tmp_path, tensorboard=False) as writer:
        written = writer.write(
            3,
            {
                "reward_mean": np.float32(0.25),
                "loss": jnp.asarray(1.5, jnp.float32),
                "tokens": np.int64(1234),
                "episodes": 7,
                "skipped": jnp.asarray(True),
                "one_element": jnp.asarray([2.0]),
                "nan": float("nan"),
                "up": np.float32(np.inf),
                "down": -math.inf,
            },
        )
        writer.write(4, {"reward_mean": 0.5})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = _strict_json(lines[0])
    assert first == {
        "step": 3,
        "reward_mean": 0.25,
        "loss": 1.5,
        "tokens": 1234,
        "episodes": 7,
        "skipped": 1,
        "one_element": 2.0,
        "nan": "nan",
        "up": "inf",
        "down": "-inf",
    }
    assert written == first
    assert isinstance(first["tokens"], int) and isinstance(first["loss"], float)
    assert _strict_json(lines[1]) == {"step": 4, "reward_mean": 0.5}

    records = writers.read_metrics(tmp_path)
    assert [r["step"] for r in records] == [3, 4]
    assert math.isnan(records[0]["nan"])
    assert records[0]["up"] == math.inf and records[0]["down"] == -math.inf
    assert records[0]["loss"] == 1.5


def test_float32_values_round_trip_bitwise(tmp_path):
    values = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    with writers.MetricsWriter(tmp_path, tensorboard=False) as writer:
        for step, value in enumerate(values):
            writer.write(step, {"x": value})
    read = np.asarray([r["x"] for r in writers.read_metrics(tmp_path)], np.float32)
    assert np.array_equal(read, values)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e5m2])
def test_low_precision_floats_are_written_exactly(tmp_path, dtype):
    values = [1.5, -0.25, float("inf")]
    with writers.MetricsWriter(tmp_path, tensorboard=True) as writer:
        for step, value in enumerate(values):
            writer.write(step, {"x": jnp.asarray(value, dtype), "y": np.asarray(value, dtype)})
    records = writers.read_metrics(tmp_path)
    assert [r["x"] for r in records] == values
    assert [r["y"] for r in records] == values


@pytest.mark.parametrize(
    "metrics, message",
    [
        ({"vector": np.zeros(3)}, "metric 'vector' must be a scalar"),
        ({"text": "hello"}, "metric 'text' must be numeric"),
        ({"step": 1}, "must not contain the key 'step'"),
    ],
)
def test_bad_metrics_raise_naming_the_metric(tmp_path, metrics, message):
    with writers.MetricsWriter(tmp_path, tensorboard=False) as writer:
        with pytest.raises(ValueError, match=message):
            writer.write(0, metrics)


def test_tensorboard_events_hold_scalars_and_text(tmp_path):
    with writers.MetricsWriter(tmp_path) as writer:
        for step in range(1, 4):
            writer.write(step, {"reward_mean": 0.5 * step, "success_rate": np.float32(step / 4)})
        writer.write_text(2, "samples/transcript", "prompt: 2+3\nagent: <calc>2+3</calc>")
    events = _read_events(str(tmp_path / "tensorboard"))
    scalars = _scalars(events)
    assert scalars["reward_mean"] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert scalars["success_rate"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    texts = [
        (event.step, value.tensor.string_val[0].decode())
        for event in events
        for value in event.summary.value
        if value.tag.startswith("samples/transcript")
    ]
    assert len(texts) == 1
    step, text = texts[0]
    assert step == 2 and "agent: <calc>2+3</calc>" in text


def test_write_text_files_per_step(tmp_path):
    with writers.MetricsWriter(tmp_path, tensorboard=False) as writer:
        path = writer.write_text(12, "greedy", "turn 1\nturn 2")
        writer.write_text(12, "sampled", "turn A")
        writer.write_text(13, "greedy", "later")
    assert path == os.path.join(str(tmp_path), "samples", "step_000012.txt")
    assert (tmp_path / "samples" / "step_000012.txt").read_text() == (
        "== greedy ==\nturn 1\nturn 2\n== sampled ==\nturn A\n"
    )
    assert (tmp_path / "samples" / "step_000013.txt").read_text() == "== greedy ==\nlater\n"

    # A resumed run rewrites the stale sample file of a step instead of appending.
    with writers.MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write_text(12, "greedy", "rerun")
    assert (tmp_path / "samples" / "step_000012.txt").read_text() == "== greedy ==\nrerun\n"


def test_resume_drops_the_records_after_the_checkpoint(tmp_path):
    with writers.MetricsWriter(tmp_path, tensorboard=False) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"loss": float(step)})
        writer.write(2, {"eval_success": 0.75})  # a second record at step 2
        writer.write_text(3, "greedy", "from the killed run")
    # The crash cut the last record in half.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 4.')
    # Resumed from a checkpoint at step 2: steps 3 and 4 are logged again.
    with writers.MetricsWriter(tmp_path, tensorboard=False, resume_step=2) as writer:
        assert not (tmp_path / "samples" / "step_000003.txt").exists()
        writer.write(3, {"loss": 30.0})
        writer.write(4, {"loss": 40.0})
    lines = [_strict_json(line) for line in
             (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0},
                     {"step": 2, "eval_success": 0.75}, {"step": 3, "loss": 30.0},
                     {"step": 4, "loss": 40.0}]
    assert writers.read_metrics(tmp_path) == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.0, "eval_success": 0.75},
        {"step": 3, "loss": 30.0},
        {"step": 4, "loss": 40.0},
    ]
    # Without resume_step (another program's writer) the file is only appended to.
    with writers.MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(4, {"loss": 41.0})
    assert [_strict_json(line)["step"] for line in
            (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 2, 3, 4, 4]


def test_a_fresh_start_drops_every_record(tmp_path):
    with writers.MetricsWriter(tmp_path) as writer:
        writer.write(1, {"loss": 1.0})
    with writers.MetricsWriter(tmp_path, resume_step=0) as writer:
        writer.write(1, {"loss": 2.0})
    assert writers.read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]
    assert _scalars(_read_events(str(tmp_path / "tensorboard")))["loss"] == [(1, 2.0)]


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert header[12:16] == b"IHDR"
    return struct.unpack(">II", header[16:24])


def test_plot_curves_from_workdir_and_records(tmp_path):
    with writers.MetricsWriter(tmp_path, tensorboard=False) as writer:
        for step in range(0, 50, 5):
            writer.write(step, {"reward_mean": step / 50, "success_rate": step / 100, "loss": 1.0})
        writer.write(55, {"reward_mean": float("nan")})  # skipped in the plot, no error
    out = writers.plot_curves(tmp_path, tmp_path / "plots" / "curves.png")
    assert out == str(tmp_path / "plots" / "curves.png")
    width, height = _png_size(out)
    assert os.path.getsize(out) > 1000 and width > 100 and height > 100

    # Two subplots are taller than one.
    single = writers.plot_curves(
        writers.read_metrics(tmp_path), tmp_path / "one.png", keys=("reward_mean",)
    )
    assert _png_size(single)[1] < height

    vector_records = [{"step": s, "episode_return": 10.0 * s} for s in range(20)]
    vector_png = writers.plot_curves(vector_records, tmp_path / "vector.png")
    assert _png_size(vector_png)[0] > 100


def test_plot_curves_without_known_keys_lists_available(tmp_path):
    with pytest.raises(ValueError, match=r"available keys: \['loss'\]"):
        writers.plot_curves([{"step": 1, "loss": 0.1}], tmp_path / "x.png")


class _FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_draws_on_a_tty():
    stream = _FakeTerminal()
    with writers.ProgressBar(10, initial=2, stream=stream) as bar:
        assert bar.enabled
        for step in range(3, 8):
            bar.update(step, {"reward_mean": np.float32(0.5), "success_rate": 0.25})
    output = stream.getvalue()
    assert "7/10" in output
    assert "reward_mean=0.5" in output and "success_rate=0.25" in output
    assert "step/s" in output or "s/step" in output


def test_progress_bar_is_quiet_off_a_tty(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.INFO):
        with writers.ProgressBar(10, stream=stream) as bar:
            assert not bar.enabled
            for step in range(1, 11):
                bar.update(step, {"loss": 1.0})
    assert stream.getvalue() == ""
    assert not [r for r in caplog.records if "step " in r.getMessage()]


def test_progress_bar_logs_every_n_steps_off_a_tty(caplog):
    # The absl logger's own level: once any test has parsed absl flags it is WARNING.
    with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger="absl"):
        with writers.ProgressBar(10, stream=io.StringIO(), log_every=4) as bar:
            for step in range(1, 11):
                bar.update(step, {"loss": 2.0})
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [m.split()[1] for m in messages] == ["4/10", "8/10", "10/10"]
    assert all("loss=2" in m and "ETA" in m for m in messages)


def test_progress_bar_rejects_bad_arguments():
    with pytest.raises(ValueError, match="initial <= total"):
        writers.ProgressBar(5, initial=6)
    with pytest.raises(ValueError, match="log_every"):
        writers.ProgressBar(5, log_every=0)


def test_resumed_tensorboard_writer_drops_the_events_after_the_checkpoint(tmp_path):
    with writers.MetricsWriter(tmp_path) as writer:
        for step in range(1, 6):
            writer.write(step, {"loss": float(step)})
        writer.write_text(4, "sampled", "stale")
    event_file = glob.glob(str(tmp_path / "tensorboard" / "*tfevents*"))[0]
    with open(event_file, "ab") as f:  # a record cut off by a crash
        f.write(struct.pack("<Q", 100) + b"\0" * 20)
    with writers.MetricsWriter(tmp_path, resume_step=2) as writer:
        writer.write(3, {"loss": 30.0})
        writer.write_text(4, "sampled", "rerun")
    events = _read_events(str(tmp_path / "tensorboard"))  # asserts no frame is cut off
    assert _scalars(events)["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    texts = [(e.step, v.tensor.string_val[0]) for e in events for v in e.summary.value
             if v.HasField("tensor")]
    assert texts == [(4, b"```\nrerun\n```")]


def test_sync_puts_records_on_disk_before_close(tmp_path):
    """After `sync` a reader sees every record, in metrics.jsonl and the event file,
    while the writer is still open (what a SIGKILL right after a checkpoint leaves)."""
    writer = writers.MetricsWriter(tmp_path)
    for step in range(1, 4):
        writer.write(step, {"loss": float(step)})
    writer.write_text(3, "sampled", "text")
    writer.sync()
    assert [json.loads(line)["step"] for line in
            (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert _scalars(_read_events(str(tmp_path / "tensorboard")))["loss"] == [
        (1, 1.0), (2, 2.0), (3, 3.0)]
    writer.close()


def test_write_after_close_raises(tmp_path):
    writer = writers.MetricsWriter(tmp_path, tensorboard=False)
    writer.close()
    with pytest.raises(RuntimeError, match="after close"):
        writer.write(1, {"loss": 1.0})
