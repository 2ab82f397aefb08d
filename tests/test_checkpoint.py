"""Tests for arl.runs.checkpoint: round trips, retention, corruption fallback, exact resume."""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import struct

from arl.runs import checkpoint
from arl.runs import writers

_PROGRAM = os.path.join(os.path.dirname(__file__), "checkpoint_resume_program.py")


@struct.dataclass
class _State:
    params: dict
    opt_state: optax.OptState
    step: jax.Array
    key: jax.Array
    raw_key: jax.Array


_OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


@functools.partial(jax.jit, static_argnames=("seed", "width"))  # one compile, not ~70
def _make_state(seed: int = 0, width: int = 4) -> _State:
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "dense": {"kernel": jax.random.normal(k1, (3, width)), "bias": jnp.zeros(width)},
        "head": jax.random.normal(k2, (width,), jnp.bfloat16),
    }
    opt_state = _OPTIMIZER.init(params)
    # One update so the moments and the count are not their initial values.
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = _OPTIMIZER.update(grads, opt_state, params)
    return _State(
        params=params,
        opt_state=opt_state,
        step=jnp.asarray(7, jnp.int32),
        key=jax.random.split(jax.random.key(seed + 10), 2),
        raw_key=jax.random.PRNGKey(seed + 20),
    )


def _assert_trees_bitwise_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
            assert a.dtype == e.dtype
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        assert a.dtype == e.dtype and a.shape == e.shape
        assert np.array_equal(np.asarray(a), np.asarray(e))


def _save_steps(directory, state, steps, **kwargs):
    with checkpoint.Checkpointer(directory, **kwargs) as ckpt:
        for step in steps:
            ckpt.save(step, state.replace(step=jnp.asarray(step, jnp.int32)), force=True,
                      metadata={"step": step})


def test_round_trip_restores_real_optax_types_and_both_key_kinds(tmp_path):
    state = _make_state()
    config = ml_collections.ConfigDict({"lr": 1e-3, "mesh": {"data": 2}})
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        assert ckpt.save(7, state, force=True,
                         metadata={"config": config, "episodes": np.int64(12),
                                             "returns": np.arange(3.0)})
    abstract = jax.eval_shape(lambda: _make_state())
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        step, restored, metadata = ckpt.restore_latest(abstract)
    assert step == 7
    assert metadata == {"config": {"lr": 1e-3, "mesh": {"data": 2}}, "episodes": 12,
                        "returns": [0.0, 1.0, 2.0]}
    assert isinstance(restored, _State)
    clip_state, (adam_state, decay_state, lr_state) = restored.opt_state
    assert isinstance(clip_state, optax.EmptyState)
    assert isinstance(adam_state, optax.ScaleByAdamState)
    assert isinstance(decay_state, optax.EmptyState) and isinstance(lr_state, optax.EmptyState)
    assert int(adam_state.count) == 1
    assert jax.dtypes.issubdtype(restored.key.dtype, jax.dtypes.prng_key)
    assert restored.key.shape == (2,)
    assert restored.raw_key.dtype == jnp.uint32 and restored.raw_key.shape == (2,)
    assert restored.params["head"].dtype == jnp.bfloat16
    _assert_trees_bitwise_equal(restored, state)
    # The restored keys keep drawing the same numbers.
    assert np.array_equal(jax.random.uniform(restored.key[1], (4,)),
                          jax.random.uniform(state.key[1], (4,)))


def test_abstract_state_keeps_typed_keys_and_restores_them(tmp_path):
    state = _make_state()
    abstract = checkpoint.abstract_state(state)
    assert abstract.key.dtype == state.key.dtype and abstract.key.shape == (2,)
    assert abstract.raw_key.dtype == jnp.uint32
    assert abstract.params["head"].dtype == jnp.bfloat16
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, force=True)
        _, restored, _ = ckpt.restore_latest(abstract)
    _assert_trees_bitwise_equal(restored, state)


@pytest.mark.parametrize("saved_kind", ["typed", "raw"])
def test_a_key_stored_in_the_other_kind_is_refused_in_one_line(tmp_path, saved_kind):
    """A key leaf stored raw where the target holds a typed key (or the other way round:
    arl's layout before its first release) is refused, not converted."""
    typed = jax.random.key(42, impl="rbg")
    raw = jax.random.key_data(typed)
    saved, target = (typed, raw) if saved_kind == "typed" else (raw, typed)
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"key": saved, "w": jnp.ones(3)}, force=True)
        with pytest.raises(checkpoint.CheckpointLayoutError) as error:
            ckpt.restore_latest(checkpoint.abstract_state({"key": target, "w": jnp.ones(3)}))
        _, restored, _ = ckpt.restore_latest(checkpoint.abstract_state({"key": saved,
                                                                         "w": jnp.ones(3)}))
    assert str(error.value) == (
        f"checkpoint step 1 in {tmp_path} is in a layout no arl release writes (its PRNG "
        "keys key are stored in another kind (typed / raw uint32) than the state's): not "
        "restored; start the run in a new workdir")
    assert os.path.isdir(tmp_path / "1")  # refused, not set aside as corrupt
    _assert_trees_bitwise_equal(restored, {"key": saved, "w": jnp.ones(3)})


def test_restore_into_sharded_abstract_target(tmp_path):
    assert jax.device_count() == 8
    mesh = jax.make_mesh((4, 2), ("data", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "tensor"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4), sharding)}
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, params, force=True)
    # Restore onto a different layout: the target's shardings decide placement.
    target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=replicated)}
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        _, restored, _ = ckpt.restore_latest(target)
    assert restored["w"].sharding == replicated
    assert np.array_equal(restored["w"], np.arange(32.0).reshape(8, 4))
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        _, restored, _ = ckpt.restore_latest(checkpoint.abstract_state(params))
    assert restored["w"].sharding == sharding


def test_save_every_force_retention_and_no_overwrite(tmp_path):
    state = _make_state()
    with checkpoint.Checkpointer(tmp_path, max_to_keep=2, save_every=2) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        saved = [ckpt.save(step, state) for step in range(1, 8)]
        assert saved == [False, True, False, True, False, True, False]
        assert ckpt.all_steps() == [4, 6]
        assert ckpt.save(7, state, force=True)
        assert ckpt.all_steps() == [6, 7] and ckpt.latest_step() == 7
        # The final forced save of an already saved step is a no-op.
        assert not ckpt.save(7, state, force=True)
    with checkpoint.Checkpointer(tmp_path, save_every=None) as ckpt:
        assert not ckpt.save(10, state)
        assert ckpt.all_steps() == [6, 7]


def test_async_save_completes_on_wait(tmp_path):
    state = _make_state()
    with checkpoint.Checkpointer(tmp_path, async_save=True) as ckpt:
        assert ckpt.save(3, state, force=True)
        ckpt.wait()
        assert os.path.exists(tmp_path / "3" / "commit_success.txt")
        _, restored, _ = ckpt.restore_latest(checkpoint.abstract_state(state))
    _assert_trees_bitwise_equal(restored, state)


def test_empty_directory_restores_none(tmp_path):
    with checkpoint.Checkpointer(tmp_path / "new") as ckpt:
        assert ckpt.restore_latest(checkpoint.abstract_state(_make_state())) is None


def _data_files(step_dir):
    files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
    assert files, f"no array data files under {step_dir}"
    return files


def _truncate_data(step_dir):
    for path in _data_files(step_dir):
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)


def _flip_data_bytes(step_dir):
    for path in _data_files(step_dir):
        with open(path, "r+b") as f:
            data = bytearray(f.read())
            data[len(data) // 2] ^= 0xFF
            f.seek(0)
            f.write(data)


def _delete_data(step_dir):
    for path in _data_files(step_dir):
        os.remove(path)


def _delete_commit_marker(step_dir):
    os.remove(os.path.join(step_dir, "commit_success.txt"))


def _delete_json_metadata(step_dir):
    os.remove(os.path.join(step_dir, "metadata", "metadata"))


def _truncate_tree_metadata(step_dir):
    with open(os.path.join(step_dir, "state", "_METADATA"), "r+b") as f:
        f.truncate(10)


# After a failed read, orbax's pending tensorstore callbacks hit a closed event
# loop; the noise is harmless.
_IGNORE_CLOSED_LOOP = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)


@_IGNORE_CLOSED_LOOP
@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (_truncate_data, "unreadable: ValueError"),
        (_flip_data_bytes, "unreadable: ValueError"),
        (_delete_data, "unreadable: ValueError"),
        (_delete_commit_marker, "commit marker commit_success.txt is missing"),
        (_delete_json_metadata, "JSON metadata unreadable: FileNotFoundError"),
        (_truncate_tree_metadata, "tree metadata unreadable"),
    ],
    ids=["truncated-data", "flipped-bytes", "deleted-data", "no-commit-marker",
         "deleted-json", "truncated-tree-metadata"],
)
def test_corrupt_latest_falls_back_to_previous(tmp_path, caplog, corrupt, reason):
    state = _make_state()
    _save_steps(tmp_path, state, [2, 4, 6])
    corrupt(str(tmp_path / "6"))
    with caplog.at_level(logging.WARNING):
        with checkpoint.Checkpointer(tmp_path) as ckpt:
            step, restored, metadata = ckpt.restore_latest(checkpoint.abstract_state(state))
            assert (step, metadata) == (4, {"step": 4})
            _assert_trees_bitwise_equal(restored, state.replace(step=jnp.asarray(4, jnp.int32)))
            # The bad step is moved aside, so the resumed run can save step 6 again.
            assert ckpt.all_steps() == [2, 4]
            assert os.path.isdir(tmp_path / "corrupt" / "6-0")
            assert ckpt.save(6, state, force=True)
            assert ckpt.latest_step() == 6
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    step_warnings = [m for m in warnings if "step 6" in m]
    assert len(step_warnings) == 1, warnings  # one warning: what, why and where it went
    assert "corrupt" in step_warnings[0] and reason in step_warnings[0]
    assert f"moved to {tmp_path / 'corrupt' / '6-0'}" in step_warnings[0]


def _largest_data_file(step_dir):
    return max(_data_files(step_dir), key=os.path.getsize)


def _flip_one_data_byte(step_dir):
    """One byte inside the array data: tensorstore reads it as a different number."""
    path = _largest_data_file(step_dir)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x10
        f.seek(0)
        f.write(data)


def _garble_chunk_header(step_dir):
    """The first byte of the data file: orbax re-raises tensorstore's error as a bare
    Exception."""
    path = _largest_data_file(step_dir)
    with open(path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0x10]))


def _edit_json_metadata(step_dir):
    """Still valid JSON, one value changed."""
    path = os.path.join(step_dir, "metadata", "metadata")
    with open(path) as f:
        text = f.read()
    assert '"step": 6' in text
    with open(path, "w") as f:
        f.write(text.replace('"step": 6', '"step": 7'))


_LARGE = {"w": jnp.arange(4096, dtype=jnp.float32) * 0.37, "b": jnp.ones(16, jnp.bfloat16)}


@_IGNORE_CLOSED_LOOP
@pytest.mark.parametrize("corrupt, reason", [
    (_flip_one_data_byte, "checksum mismatch in w"),
    (_garble_chunk_header, "arrays unreadable: Exception: Encountered error while reading"),
    (_edit_json_metadata, "checksum mismatch in the JSON metadata"),
], ids=["one-flipped-data-byte", "garbled-chunk-header", "edited-json"])
def test_garbled_data_never_restores(tmp_path, caplog, corrupt, reason):
    """Damage tensorstore does not notice (or reports as a bare Exception): the
    checksums catch it and the previous step is restored, bit for bit."""
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        for step in (4, 6):
            ckpt.save(step, jax.tree.map(lambda x, s=step: x * s, _LARGE), force=True,
                      metadata={"step": step})
    corrupt(str(tmp_path / "6"))
    with caplog.at_level(logging.WARNING):
        with checkpoint.Checkpointer(tmp_path) as ckpt:
            step, restored, metadata = ckpt.restore_latest(checkpoint.abstract_state(_LARGE))
    assert (step, metadata) == (4, {"step": 4})
    _assert_trees_bitwise_equal(restored, jax.tree.map(lambda x: x * 4, _LARGE))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0], warnings
    assert os.path.isdir(tmp_path / "corrupt" / "6-0")


@_IGNORE_CLOSED_LOOP
def test_read_only_reader_skips_a_garbled_step_without_moving_it(tmp_path):
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        for step in (2, 4):  # the large state: the middle of its data file is array data
            ckpt.save(step, _LARGE, force=True, metadata={"step": step})
    _flip_one_data_byte(str(tmp_path / "4"))
    with checkpoint.Checkpointer(tmp_path, read_only=True) as ckpt:
        step, _, _ = ckpt.restore_latest(checkpoint.abstract_state(_LARGE))
        # The metadata alone (what evaluate and export read first) is intact.
        assert ckpt.latest_metadata() == (4, {"step": 4})
    assert step == 2 and os.path.isdir(tmp_path / "4")


def test_checkpoint_without_checksums_is_refused_in_one_line(tmp_path):
    """Written before checksums existed (no arl release wrote that layout): refused in
    one line by restore and restore_latest, and left where it is."""
    state = _make_state()
    _save_steps(tmp_path, state, [3])
    path = tmp_path / "3" / "metadata" / "metadata"
    saved = json.loads(path.read_text())
    del saved[checkpoint.INTEGRITY_KEY]
    path.write_text(json.dumps(saved))
    expected = (f"checkpoint step 3 in {tmp_path} is in a layout no arl release writes "
                "(it has no checksums): not restored; start the run in a new workdir")
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        for restore in (lambda: ckpt.restore_latest(checkpoint.abstract_state(state)),
                        lambda: ckpt.restore(3, checkpoint.abstract_state(state))):
            with pytest.raises(checkpoint.CheckpointLayoutError) as error:
                restore()
            assert str(error.value) == expected
    assert os.path.isdir(tmp_path / "3") and not os.path.exists(tmp_path / "corrupt")


def test_non_finite_state_is_not_saved(tmp_path):
    state = {"w": jnp.array([1.0, jnp.nan, jnp.inf]), "n": jnp.arange(3)}
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(checkpoint.NonFiniteStateError,
                           match=f"refusing to checkpoint step 1 in {tmp_path} with NaN or "
                                 r"inf values \(non-finite elements per leaf: w \(2\)\)"):
            ckpt.save(1, state, force=True)
        assert ckpt.all_steps() == []
    with checkpoint.Checkpointer(tmp_path, allow_non_finite=True) as ckpt:
        assert ckpt.save(1, state, force=True)
        _, restored, _ = ckpt.restore_latest(checkpoint.abstract_state(state))
    np.testing.assert_array_equal(restored["w"], state["w"])


def test_failed_write_is_one_error_and_keeps_the_last_good_step(tmp_path, monkeypatch):
    """An injected failure as orbax reports tensorstore's: a bare Exception."""
    state = _make_state()
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state, force=True)

        def failing_save(*args, **kwargs):
            raise Exception("UNAVAILABLE: Failed to write: Input/output error")

        monkeypatch.setattr(ckpt._manager, "save", failing_save)
        with pytest.raises(checkpoint.CheckpointWriteError,
                           match=f"could not write checkpoint step 4 to {tmp_path} "
                                 r"\(Exception: UNAVAILABLE: Failed to write: Input/output "
                                 r"error\); the newest "
                                 "committed checkpoint, step 2, is intact"):
            ckpt.save(4, state, force=True)
        monkeypatch.undo()
        assert ckpt.all_steps() == [2]


def _tmpfs(path, size):
    os.makedirs(path)
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")


@pytest.mark.parametrize("spare, reason", [
    (-4096, r"no space left: \d+ bytes free, the state has \d+"),
    (4096, r"\(no space left on device\)"),
], ids=["refused-before-writing", "failed-while-writing"])
def test_full_disk_is_one_error_and_the_last_good_step_restores(tmp_path, spare, reason,
                                                                capfd):
    """A real full disk (a small tmpfs): refused before writing when the state's bytes
    exceed the free space, or failed by tensorstore midway when only the files around
    them do not fit; either way one error, no temporary directory left, the previous
    step restores."""
    mount = tmp_path / "disk"
    _tmpfs(mount, "256k")
    try:
        small = {"w": jnp.arange(256, dtype=jnp.float32)}
        with checkpoint.Checkpointer(mount / "ckpt") as ckpt:
            ckpt.save(1, small, force=True)
            words = (shutil.disk_usage(mount).free - spare) // 4
            big = {"w": jax.random.normal(jax.random.key(0), (words,))}
            with pytest.raises(checkpoint.CheckpointWriteError,
                               match=f"could not write checkpoint step 2 .*{reason}.*"
                                     "step 1, is intact"):
                ckpt.save(2, big, force=True)
        assert sorted(os.listdir(mount / "ckpt")) == ["1"]
        with checkpoint.Checkpointer(mount / "ckpt") as ckpt:
            step, restored, _ = ckpt.restore_latest(checkpoint.abstract_state(small))
        assert step == 1
        np.testing.assert_array_equal(restored["w"], small["w"])
        assert "Traceback" not in capfd.readouterr().err
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_save_killed_midway_leaves_an_ignored_temporary_directory(tmp_path):
    state = _make_state()
    _save_steps(tmp_path, state, [6])
    # What orbax leaves when killed before the atomic rename: a tmp dir, no marker.
    partial = tmp_path / "9.orbax-checkpoint-tmp-1764400000"
    shutil.copytree(tmp_path / "6", partial)
    os.remove(partial / "commit_success.txt")
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [6]
        step, _, _ = ckpt.restore_latest(checkpoint.abstract_state(state))
        assert step == 6
        # Orbax removes it in the background on start, at the latest before a save.
        assert ckpt.save(9, state, force=True)
        assert not partial.exists()
        assert ckpt.all_steps() == [6, 9]


@_IGNORE_CLOSED_LOOP
def test_all_checkpoints_corrupt_returns_none(tmp_path, caplog):
    state = _make_state()
    _save_steps(tmp_path, state, [1, 2])
    _delete_data(str(tmp_path / "1"))
    _delete_commit_marker(str(tmp_path / "2"))
    with caplog.at_level(logging.WARNING):
        with checkpoint.Checkpointer(tmp_path) as ckpt:
            assert ckpt.restore_latest(checkpoint.abstract_state(state)) is None
            assert ckpt.all_steps() == []
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "Checkpoint step 2" in messages and "Checkpoint step 1" in messages


def test_structure_mismatch_raises_and_keeps_checkpoints(tmp_path):
    _save_steps(tmp_path, _make_state(width=4), [1, 2])
    wider = jax.eval_shape(functools.partial(_make_state, width=5))
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(checkpoint.CheckpointStructureError,
                           match=r"params\.dense\.kernel: target \(3, 5\) float32, "
                                 r"checkpoint \(3, 4\) float32"):
            ckpt.restore_latest(wider)
        assert ckpt.all_steps() == [1, 2]
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(checkpoint.CheckpointStructureError,
                           match="extra: in the target, not in the checkpoint"):
            ckpt.restore_latest({"extra": jax.ShapeDtypeStruct((), jnp.float32)})


def test_bad_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep must be an integer >= 1"):
        checkpoint.Checkpointer(tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="save_every must be None or an integer >= 1"):
        checkpoint.Checkpointer(tmp_path, save_every=0)
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(TypeError, match="metadata value .* is not JSON serialisable"):
            ckpt.save(1, {"x": jnp.zeros(2)}, force=True, metadata={"f": object()})
        with pytest.raises(ValueError, match="step must be >= 0"):
            ckpt.save(-1, {"x": jnp.zeros(2)}, force=True)


def _run_program(workdir, final, *extra, cache_dir):
    # A shared persistent compilation cache lets the resumed run skip compiling.
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    return subprocess.Popen(
        [sys.executable, _PROGRAM, str(workdir), "--steps=12", "--save_every=4",
         f"--final={final}", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )


def test_sigkill_and_resume_is_bitwise_exact(tmp_path):
    cache = tmp_path / "jax_cache"
    reference = _run_program(tmp_path / "reference", tmp_path / "reference.npz", cache_dir=cache)
    killed = _run_program(tmp_path / "resumed", tmp_path / "unused.npz", "--kill_after=6",
                          cache_dir=cache)
    killed_output, _ = killed.communicate(timeout=300)
    reference_output, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, reference_output
    assert killed.returncode == -signal.SIGKILL, killed_output
    assert not os.path.exists(tmp_path / "unused.npz")
    with checkpoint.Checkpointer(tmp_path / "resumed" / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [4]

    resumed = _run_program(tmp_path / "resumed", tmp_path / "resumed.npz", cache_dir=cache)
    resumed_output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, resumed_output
    assert "resumed from step 4" in resumed_output

    # Steps 5 and 6 were logged by the killed run; the resumed writer (resume_step=4)
    # dropped them and they were logged again: each step once.
    raw = [line for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [int(line.split(",")[0].split(":")[1]) for line in raw] == list(range(1, 13))
    reference_losses = [r["loss"] for r in writers.read_metrics(tmp_path / "reference")]
    resumed_records = writers.read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed_records] == list(range(1, 13))
    assert np.array_equal(np.float32([r["loss"] for r in resumed_records]),
                          np.float32(reference_losses))
    # The loss moved, so the comparison above is not between constants.
    assert len(set(reference_losses)) == 12

    expected, actual = np.load(tmp_path / "reference.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(expected.files) == sorted(actual.files)
    for name in expected.files:
        assert expected[name].dtype == actual[name].dtype, name
        assert np.array_equal(expected[name], actual[name]), name
    assert int(actual["step"]) == 12


@struct.dataclass
class _Before:
    params: jax.Array
    pair: tuple
    unused: object = None


@struct.dataclass
class _After:  # _Before after a release: one more optional field, one dropped
    params: jax.Array
    pair: tuple
    carried: object = None


def test_a_state_class_that_grew_or_lost_an_empty_field_restores(tmp_path):
    """A checkpoint written before a state class gained an optional field (None unless
    used) restores into the new class, and one with a None field the class no longer
    has restores too: the arrays are the same, found by name."""
    key = jax.random.key(3)
    before = _Before(params=jnp.arange(4.0), pair=(key, {"m": jnp.ones((2, 2))}))
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, before, force=True)
    target = checkpoint.abstract_state(_After(params=before.params, pair=before.pair))
    with checkpoint.Checkpointer(tmp_path, read_only=True) as ckpt:
        restored, _ = ckpt.restore(1, target)
    assert isinstance(restored, _After) and restored.carried is None
    np.testing.assert_array_equal(restored.params, before.params)
    np.testing.assert_array_equal(jax.random.key_data(restored.pair[0]),
                                  jax.random.key_data(key))
    np.testing.assert_array_equal(restored.pair[1]["m"], np.ones((2, 2)))
    # A field that holds arrays on one side only is still a structure error.
    with checkpoint.Checkpointer(tmp_path, read_only=True) as ckpt:
        with pytest.raises(checkpoint.CheckpointStructureError, match="carried"):
            ckpt.restore(1, target.replace(carried=jax.ShapeDtypeStruct((2,), jnp.float32)))
