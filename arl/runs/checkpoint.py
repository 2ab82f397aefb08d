"""Checkpointing of training-state pytrees with orbax, with exact resume.

A training state is any pytree (typically a `flax.struct` dataclass holding
parameters, an optax state, a step counter and a PRNG key). `Checkpointer` wraps
`orbax.checkpoint.CheckpointManager` with two items per step:

* ``state``: the pytree, written with `ocp.args.StandardSave` and read back with
  `ocp.args.StandardRestore(abstract_target)`, so containers (optax named tuples,
  dataclasses) come back as their real types and arrays land on the shardings
  of the abstract target. Typed keys (`jax.random.key`) and raw ``uint32`` keys
  (`jax.random.PRNGKey`) both round-trip bit for bit.
* ``metadata``: a JSON object (the config, host-side counters, ...).

Saves are atomic: orbax writes into a temporary directory, writes
``commit_success.txt`` and renames it to ``<directory>/<step>``.

Integrity: at save, a checksum of every array (`arl.runs.checksums`: two 32-bit lanes
over its bits, computed where the array lives) and a SHA-256 of the JSON metadata are
stored in the metadata item under ``"__arl_integrity__"`` (removed from what `restore`
returns). A restore recomputes them from what it read and accepts the step only if
every one matches: orbax finalises atomically but checks no data, and tensorstore
reads most bit flips inside a data file as valid (different) numbers. A save refuses a
state with NaN or inf in a floating leaf (`NonFiniteStateError`, naming the leaves)
unless ``allow_non_finite=True``.

A checkpoint in a layout no arl release writes (no integrity record, or a key leaf
stored raw where the target holds a typed key or the other way round: written by arl
before its first release) is refused with ONE line, `CheckpointLayoutError`, naming the
step and what differs; it is neither restored nor set aside.

Restoring walks the committed steps from newest to oldest. A step is skipped,
with ONE absl warning naming the step, the reason and where it was moved, when

1. its commit marker (``commit_success.txt``) or an item directory is missing,
2. its metadata cannot be read (truncated or deleted JSON / tree metadata),
3. reading the arrays fails (any error of orbax or tensorstore: truncated or deleted
   data files, garbled chunk headers; orbax re-raises some as a bare ``Exception``),
4. a checksum does not match (bit flips tensorstore read as numbers).

A skipped step is moved aside to ``<directory>/corrupt/<step>-<n>`` so that the
resumed run can save that step number again and `max_to_keep` counts only good
checkpoints. A checkpoint whose tree does not match the abstract target
(different leaves, shapes or dtypes) is NOT treated as corrupt: that is a
program error, and `restore_latest` raises `CheckpointStructureError` (a
`ValueError`) listing the differences instead of discarding good checkpoints.

A save that fails (a full disk, a lost mount) raises `CheckpointWriteError` naming the
directory, the step and the newest committed step, which is left intact; orbax's
temporary directory of the failed step is removed at the next start.
"""

from __future__ import annotations

import contextlib
import json
import logging as std_logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

from absl import logging
from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

from arl.errors import RunStopped
from arl.runs import checksums
from arl.runs import read_failure_noise

PyTree = Any

_STATE_ITEM = "state"
_METADATA_ITEM = "metadata"
_COMMIT_MARKER = "commit_success.txt"
_QUARANTINE_DIR = "corrupt"
INTEGRITY_KEY = "__arl_integrity__"  # in the metadata item: checksums of the step


class CheckpointStructureError(ValueError):
    """The checkpoint on disk does not match the abstract target's tree."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint step is incomplete, its files cannot be read or a checksum differs."""


class CheckpointLayoutError(RunStopped):
    """A checkpoint step in a layout no arl release writes (one line; not restored)."""


class CheckpointWriteError(RunStopped):
    """A save failed (disk full, lost mount); earlier checkpoints are intact."""


class NonFiniteStateError(RunStopped):
    """A state with NaN or inf in a floating leaf was given to `Checkpointer.save`."""


# Read failures of orbax and tensorstore: tensorstore raises ValueError (DATA_LOSS,
# OUT_OF_RANGE, NOT_FOUND, ...) and orbax re-raises some of them as a bare `Exception`.
_READ_ERRORS = (OSError, ValueError, KeyError)


def _is_read_error(error: BaseException) -> bool:
    return isinstance(error, _READ_ERRORS) or type(error) is Exception


def _verify(step_state: PyTree, metadata: dict[str, Any], record: Any) -> None:
    """Raises CheckpointCorruptError unless `step_state` and `metadata` are what was
    saved with `record`."""
    problem = checksums.integrity_problem(step_state, metadata, record)
    if problem is not None:
        raise CheckpointCorruptError(problem)


def abstract_state(state: PyTree) -> PyTree:
    """Returns `jax.ShapeDtypeStruct` leaves (with shardings) mirroring `state`.

    Use it as the restore target when a concrete state (e.g. a freshly
    initialised one) is at hand; `jax.eval_shape(init_fn, ...)` works too.
    """
    return jax.tree.map(_abstract_leaf, state)


def _abstract_leaf(leaf: Any) -> Any:
    # Not ocp.utils.to_shape_dtype_struct: it turns typed keys into raw uint32.
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if isinstance(leaf, (np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return leaf


def _to_json_compatible(value: Any) -> Any:
    """Converts numpy/jax scalars and arrays and ConfigDicts to JSON types."""
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return _to_json_compatible(value.to_dict())
    if isinstance(value, Mapping):
        return {str(k): _to_json_compatible(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json_compatible(v) for v in value]
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        return np.asarray(value).tolist()
    raise TypeError(
        f"metadata value {value!r} of type {type(value).__name__} is not JSON "
        "serialisable; allowed: dict, list, tuple, str, bool, int, float, None, "
        "numpy/jax arrays and ml_collections.ConfigDict."
    )


def _physical_shape_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype as stored on disk (typed PRNG keys are stored as key data)."""
    dtype = leaf.dtype
    if _is_typed_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, dtype))
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(leaf.shape), np.dtype(dtype)


def _is_typed_key(leaf: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key)


def _key_kind_differences(restored: PyTree, target: PyTree) -> list[str]:
    """The key leaves stored in another kind (typed / raw uint32) than `target`'s."""
    flat = jax.tree_util.tree_flatten_with_path(target)[0]
    return [".".join(ocp.tree.str_keypath(path)) for (path, want), got in
            zip(flat, jax.tree.leaves(restored))
            if hasattr(want, "dtype") and _is_typed_key(want) != _is_typed_key(got)]


def _structure_differences(abstract: PyTree, saved_tree: PyTree) -> list[str]:
    """Lists leaves whose presence, shape or dtype differ between target and disk."""
    # Leaf names as orbax writes them: attribute/key/index path joined by ".".
    expected = {
        ".".join(ocp.tree.str_keypath(path)): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    saved = ocp.tree.to_flat_dict(saved_tree, sep=".")
    differences = []
    for name in sorted(set(expected) - set(saved)):
        differences.append(f"{name}: in the target, not in the checkpoint")
    for name in sorted(set(saved) - set(expected)):
        differences.append(f"{name}: in the checkpoint, not in the target")
    for name in sorted(set(expected) & set(saved)):
        target_leaf, saved_leaf = expected[name], saved[name]
        if not hasattr(target_leaf, "dtype") or not hasattr(saved_leaf, "dtype"):
            continue
        shape, dtype = _physical_shape_dtype(target_leaf)
        if tuple(saved_leaf.shape) != shape or np.dtype(saved_leaf.dtype) != dtype:
            differences.append(
                f"{name}: target {shape} {dtype}, checkpoint "
                f"{tuple(saved_leaf.shape)} {np.dtype(saved_leaf.dtype)}"
            )
    return differences


def _leaf_names(tree: PyTree) -> tuple[list[str], Any, list[Any]]:
    """(leaf names as orbax writes them, the tree's structure, its leaves)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [".".join(ocp.tree.str_keypath(path)) for path, _ in flat], treedef, [
        leaf for _, leaf in flat]


def _none_paths(tree: PyTree, is_target: bool = False) -> set[str]:
    """Names of the None fields of `tree` (a state, or orbax's tree metadata)."""
    if is_target:
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
        return {".".join(ocp.tree.str_keypath(path)) for path, leaf in flat if leaf is None}
    found = set()

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, prefix + (str(key),))
        elif isinstance(node, (list, tuple)):
            for index, value in enumerate(node):
                walk(value, prefix + (str(index),))
        elif node is None:
            found.add(".".join(prefix))

    walk(tree, ())
    return found


def _disk_shaped(abstract: PyTree, saved_tree: PyTree) -> PyTree:
    """`abstract`'s leaves in the nesting of the checkpoint's tree metadata."""
    names, _, leaves = _leaf_names(abstract)
    by_name = dict(zip(names, leaves))

    def build(node, prefix):
        if isinstance(node, dict):
            return {key: build(value, prefix + (str(key),)) for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            return [build(value, prefix + (str(i),)) for i, value in enumerate(node)]
        return None if node is None else by_name[".".join(prefix)]

    return build(saved_tree, ())


def _into_target(restored: PyTree, abstract: PyTree) -> PyTree:
    """Arrays restored in the checkpoint's nesting, in `abstract`'s structure."""
    flat = ocp.tree.to_flat_dict(restored, sep=".")
    names, treedef, _ = _leaf_names(abstract)
    return jax.tree_util.tree_unflatten(treedef, [flat[name] for name in names])


class _DropOrbaxErrors(std_logging.Filter):
    """Drops error records logged from orbax's code (its writer threads' reports)."""

    _ROOT = os.path.dirname(os.path.abspath(ocp.__file__)) + os.sep

    def filter(self, record: std_logging.LogRecord) -> bool:
        return not (record.levelno >= std_logging.ERROR
                    and os.path.abspath(record.pathname).startswith(self._ROOT))


def _first_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text[:300]}"


class Checkpointer:
    """Saves and restores a training-state pytree plus JSON metadata.

    Usage::

        with Checkpointer(workdir / "checkpoints", save_every=100) as ckpt:
            restored = ckpt.restore_latest(abstract_state(initial_state))
            step, state, meta = restored if restored else (0, initial_state, {})
            for step in range(step + 1, num_steps + 1):
                state, metrics = train_step(state)
                ckpt.save(step, state, metadata={"config": config.to_dict()})
            ckpt.save(num_steps, state, force=True)

    Args:
        directory: where step directories live; created if missing.
        max_to_keep: number of most recent checkpoints kept (older ones deleted).
        save_every: `save` writes when ``step % save_every == 0``; ``None`` means
            only forced saves write.
        async_save: if True, `save` returns while orbax writes in the background
            (call `wait()` before relying on the files); by default `save` returns
            after the checkpoint is committed, so a crash right after it loses nothing.
        read_only: for readers beside a running trainer (evaluation): never writes,
            never cleans up the trainer's in-flight temporary directories, never moves
            a corrupt step aside.
        allow_non_finite: save states with NaN or inf in floating leaves (by default
            `save` raises `NonFiniteStateError`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int = 3,
        save_every: int | None = None,
        async_save: bool = False,
        read_only: bool = False,
        allow_non_finite: bool = False,
    ):
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep must be an integer >= 1, got {max_to_keep!r}.")
        # A corrupt step's failed read leaves tracebacks of late callbacks on stderr.
        read_failure_noise.quiet_closed_loop_callbacks()
        if save_every is not None and (not isinstance(save_every, int) or save_every < 1):
            raise ValueError(
                f"save_every must be None or an integer >= 1, got {save_every!r}."
            )
        # epath keeps remote filesystems (gs://...) working alongside local paths.
        self._directory = epath.Path(directory)
        if not str(self._directory).startswith(("gs://", "s3://")):
            self._directory = epath.Path(os.path.abspath(os.fspath(directory)))
        self._save_every = save_every
        self._async_save = async_save
        self._read_only = read_only
        self._allow_non_finite = allow_non_finite
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=not read_only,
            # Leftovers of a save killed midway; a reader must not touch them (they may
            # belong to a save in flight).
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save,
            read_only=read_only,
        )
        self._manager = ocp.CheckpointManager(
            self._directory,
            # Handlers given up front so a fresh process can read item metadata
            # before its first save.
            item_handlers={
                _STATE_ITEM: ocp.StandardCheckpointHandler(),
                _METADATA_ITEM: ocp.JsonCheckpointHandler(),
            },
            options=options,
        )

    @property
    def directory(self) -> epath.Path:
        return self._directory

    def should_save(self, step: int, *, force: bool = False) -> bool:
        """Whether `save(step, ..., force=force)` would write (ignoring existing steps)."""
        return force or (self._save_every is not None and step % self._save_every == 0)

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves `state` and `metadata` as checkpoint `step` if due.

        Writes when ``step % save_every == 0`` or `force`. A step that is already on
        disk is never overwritten (e.g. the final forced save right after a periodic
        one): the call returns False.

        Returns:
            True if a checkpoint was written (or, with ``async_save``, started).

        Raises:
            NonFiniteStateError: a floating leaf holds NaN or inf (nothing written).
            CheckpointWriteError: writing failed (e.g. the disk is full); the step is not
                committed and earlier steps are intact.
        """
        if self._read_only:
            raise ValueError(f"Checkpointer({str(self._directory)!r}) is read-only")
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}.")
        if not self.should_save(step, force=force):
            return False
        if step in self._manager.all_steps():
            return False
        json_metadata = _to_json_compatible(dict(metadata or {}))
        if INTEGRITY_KEY in json_metadata:
            raise ValueError(f"metadata key {INTEGRITY_KEY!r} is reserved for checksums")
        record, non_finite = checksums.integrity_record(state, json_metadata)
        if non_finite and not self._allow_non_finite:
            raise NonFiniteStateError(
                f"refusing to checkpoint step {step} in {self._directory} with NaN or inf "
                f"values (non-finite elements per leaf: {checksums.listing(non_finite)}); "
                "allow_non_finite=True saves it anyway")
        self._check_free_space(step, state)
        args = ocp.args.Composite(**{
            _STATE_ITEM: ocp.args.StandardSave(state),
            _METADATA_ITEM: ocp.args.JsonSave({**json_metadata, INTEGRITY_KEY: record}),
        })
        with self._failures_as_write_errors(step):
            saved = self._manager.save(step, args=args, force=True)  # due: decided above
            if not self._async_save:
                self._manager.wait_until_finished()
        return bool(saved)

    def wait(self) -> None:
        """Blocks until any in-flight save is committed (CheckpointWriteError if it
        failed)."""
        with self._failures_as_write_errors(None):
            self._manager.wait_until_finished()

    @contextlib.contextmanager
    def _failures_as_write_errors(self, step: int | None):
        """Turns a failed write into one `CheckpointWriteError`; orbax's worker threads
        would also log it, with its traceback, once per thread: those records are
        dropped (the error is raised here instead)."""
        log_filter = _DropOrbaxErrors()
        logger = logging.get_absl_logger()  # orbax logs through absl's logger
        logger.addFilter(log_filter)
        try:
            yield
        except Exception as error:  # pylint: disable=broad-except
            if not _is_read_error(error):  # a program error, not the filesystem's
                raise
            if step is not None:
                self._remove_partial(step)
            raise self._write_error(step, error) from error
        finally:
            logger.removeFilter(log_filter)

    def _remove_partial(self, step: int) -> None:
        """Frees the space of a failed save of `step` now (orbax would at the next
        start)."""
        if jax.process_index() != 0:
            return
        for partial in self._directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(partial, ignore_errors=True)

    def _check_free_space(self, step: int, state: PyTree) -> None:
        """CheckpointWriteError before writing when the local disk cannot hold the
        state's bytes (uncompressed: an upper bound), so a full disk ends cleanly. Not
        with several processes: each sees its own disk, and one refusing alone would
        leave the others waiting in orbax's save."""
        if str(self._directory).startswith(("gs://", "s3://")) or jax.process_count() > 1:
            return
        needed = sum(int(np.prod(getattr(leaf, "shape", ()))) *
                     np.dtype(_physical_shape_dtype(leaf)[1]).itemsize
                     for leaf in jax.tree.leaves(state) if hasattr(leaf, "dtype"))
        try:
            free = shutil.disk_usage(self._directory).free
        except OSError:
            return
        if free < needed:
            raise self._write_error(step, OSError(
                f"no space left: {free} bytes free, the state has {needed}"))

    def _write_error(self, step: int | None, error: BaseException) -> CheckpointWriteError:
        committed = [s for s in self._committed_steps() if s != step]
        last = (f"the newest committed checkpoint, step {committed[-1]}, is intact"
                if committed else "no earlier checkpoint exists")
        what = f"checkpoint step {step}" if step is not None else "a checkpoint"
        text = str(error)
        # tensorstore's message names the failing file deep in orbax's temporary tree.
        reason = ("no space left on device" if "No space left on device" in text
                  or "os_error_code='28'" in text else _first_line(error))
        return CheckpointWriteError(
            f"could not write {what} to {self._directory} ({reason}); {last}")

    def _committed_steps(self) -> list[int]:
        try:
            return sorted(int(path.name) for path in self._directory.iterdir()
                          if path.name.isdigit() and (path / _COMMIT_MARKER).exists())
        except OSError:
            return []

    def all_steps(self) -> list[int]:
        """Committed steps on disk, ascending (not yet checked for corruption)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None (not yet checked for corruption)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int, abstract_target: PyTree) -> tuple[PyTree, dict[str, Any]]:
        """Restores checkpoint `step` into the structure of `abstract_target`.

        Raises:
            CheckpointStructureError: the tree on disk does not match the target.
            CheckpointCorruptError: a commit marker is missing, files are unreadable or
                a checksum does not match what was saved.
            CheckpointLayoutError: the step is in a layout no arl release writes.
        """
        self._check_committed(step)
        try:
            saved_tree = self._manager.item_metadata(step)[_STATE_ITEM]
        except Exception as error:  # pylint: disable=broad-except
            if not _is_read_error(error):  # JSONDecodeError is a ValueError
                raise
            raise CheckpointCorruptError(
                f"tree metadata unreadable: {_first_line(error)}"
            ) from error
        saved_tree = getattr(saved_tree, "tree", saved_tree)
        if saved_tree is None:
            raise CheckpointCorruptError("tree metadata unreadable")
        differences = _structure_differences(abstract_target, saved_tree)
        if differences:
            raise CheckpointStructureError(
                f"checkpoint step {step} in {self._directory} does not match "
                "abstract_target:\n  " + "\n  ".join(differences)
            )
        # A field that holds no arrays (None) may be in the target and not on disk, or
        # the other way round: a state class grew an optional field since the checkpoint
        # was written. Orbax restores only its own nesting, so the arrays are restored
        # in the checkpoint's nesting and put back into the target's.
        item = abstract_target
        if _none_paths(abstract_target, is_target=True) != _none_paths(saved_tree):
            item = _disk_shaped(abstract_target, saved_tree)
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    **{
                        _STATE_ITEM: ocp.args.StandardRestore(item),
                        _METADATA_ITEM: ocp.args.JsonRestore(),
                    }
                ),
            )
        except Exception as error:  # pylint: disable=broad-except
            if not _is_read_error(error):
                raise
            raise CheckpointCorruptError(
                f"arrays unreadable: {_first_line(error)}"
            ) from error
        if item is not abstract_target:
            restored = {**restored, _STATE_ITEM: _into_target(restored[_STATE_ITEM],
                                                              abstract_target)}
        metadata = restored[_METADATA_ITEM]
        if not isinstance(metadata, dict):
            raise CheckpointCorruptError(f"metadata is {type(metadata).__name__}, not a dict")
        metadata = dict(metadata)
        record = metadata.pop(INTEGRITY_KEY, None)
        if record is None:
            raise self._layout_error(step, "it has no checksums")
        keys = _key_kind_differences(restored[_STATE_ITEM], abstract_target)
        if keys:
            raise self._layout_error(step, f"its PRNG keys {checksums.listing(keys)} are stored "
                                     "in another kind (typed / raw uint32) than the state's")
        _verify(restored[_STATE_ITEM], metadata, record)
        return restored[_STATE_ITEM], metadata

    def _layout_error(self, step: int, what: str) -> CheckpointLayoutError:
        return CheckpointLayoutError(
            f"checkpoint step {step} in {self._directory} is in a layout no arl release "
            f"writes ({what}): not restored; start the run in a new workdir")

    def latest_metadata(self) -> tuple[int, dict[str, Any]] | None:
        """The newest committed step whose metadata is readable, and that metadata
        (no arrays are read); None when there is none."""
        self.wait()
        for step in reversed(self.all_steps()):
            try:
                self._check_committed(step)
                restored = self._manager.restore(
                    step, args=ocp.args.Composite(**{_METADATA_ITEM: ocp.args.JsonRestore()}))
            except Exception as error:  # pylint: disable=broad-except
                if isinstance(error, CheckpointCorruptError) or _is_read_error(error):
                    continue
                raise
            metadata = restored[_METADATA_ITEM]
            if not isinstance(metadata, dict):
                continue
            metadata = dict(metadata)
            record = metadata.pop(INTEGRITY_KEY, None)
            if isinstance(record, dict) and record.get(
                    "metadata_sha256") != checksums.metadata_digest(metadata):
                continue
            return step, metadata
        return None

    def restore_latest(
        self, abstract_target: PyTree
    ) -> tuple[int, PyTree, dict[str, Any]] | None:
        """Restores the newest readable checkpoint.

        Args:
            abstract_target: pytree of `jax.ShapeDtypeStruct` (with shardings, see
                `abstract_state`) or of concrete arrays, shaped like the saved state.

        Returns:
            ``(step, state, metadata)``, or None when no good checkpoint exists.
            Unreadable steps are reported with an absl warning and moved to
            ``<directory>/corrupt/``.

        Raises:
            CheckpointStructureError: a readable checkpoint does not match the target.
        """
        self.wait()
        for step in reversed(self.all_steps()):
            try:
                state, metadata = self.restore(step, abstract_target)
            except CheckpointCorruptError as error:
                moved = self._quarantine(step)
                logging.warning(
                    "Checkpoint step %d in %s is corrupt or incomplete (%s); %s"
                    "falling back to the previous checkpoint.",
                    step, self._directory, error,
                    f"moved to {moved}; " if moved else "")
                continue
            return step, state, metadata
        return None

    def close(self) -> None:
        """Waits for pending saves and releases orbax resources."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _step_directory(self, step: int) -> epath.Path:
        return self._directory / str(step)

    def _check_committed(self, step: int) -> None:
        step_dir = self._step_directory(step)
        for relative in (
            _COMMIT_MARKER,
            f"{_STATE_ITEM}/{_COMMIT_MARKER}",
            f"{_METADATA_ITEM}/{_COMMIT_MARKER}",
        ):
            if not (step_dir / relative).exists():
                raise CheckpointCorruptError(f"commit marker {relative} is missing")
        try:
            json.loads((step_dir / _METADATA_ITEM / _METADATA_ITEM).read_text())
        except (OSError, ValueError) as error:
            raise CheckpointCorruptError(
                f"JSON metadata unreadable: {_first_line(error)}"
            ) from error

    def _quarantine(self, step: int) -> epath.Path | None:
        """Moves an unreadable step out of orbax's sight (primary process only); returns
        where it went (None: not moved)."""
        destination = None
        if jax.process_index() == 0 and not self._read_only:
            quarantine = self._directory / _QUARANTINE_DIR
            quarantine.mkdir(parents=True, exist_ok=True)
            suffix = 0
            while (quarantine / f"{step}-{suffix}").exists():
                suffix += 1
            destination = quarantine / f"{step}-{suffix}"
            try:
                self._step_directory(step).rename(destination)
            except OSError as error:
                logging.warning("Could not move corrupt checkpoint step %d: %s", step, error)
                destination = None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
            multihost_utils.sync_global_devices(f"arl_checkpoint_quarantine_{step}")
        self._manager.reload()
        return destination
