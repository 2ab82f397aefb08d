"""The top-level keys: the algorithm, the seed, the length of the run, its logging and
checkpoint cadence, the device mesh and the modules to import first."""

from __future__ import annotations

import importlib
import math
import os

import ml_collections

from arl.config.checks import check_bool, check_choice, check_range, fail
from arl.errors import ConfigError, one_line
from arl.sharding import MESH_AXES

ON_NON_FINITE = ("stop", "skip")  # on_non_finite (arl.trainers.guards)


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.algorithm = "grpo"
    c.seed = 0
    c.train_steps = 100
    c.log_every = 5
    c.checkpoint_every = 50
    c.keep_checkpoints = 3
    c.sample_every = 25  # write rendered sample trajectories every N steps
    c.mesh = (1, 1, 1)  # (data, fsdp, tensor); product must not exceed the device count
    # Modules imported before the config is validated or used, e.g. ("my_pkg.my_envs",):
    # one that calls `arl.envs.register` (or `arl.register_algorithm`) makes
    # its names valid in `env.name` / `algorithm`. Stored with the checkpoints' config, so
    # resuming and `experiments.evaluate` import them too. Must be importable (installed,
    # or on PYTHONPATH / the working directory).
    c.imports = ()
    # Constrain the model's activations to the mesh (arl.models.partitioning
    # ACTIVATION_AXIS_RULES: batch over data x fsdp, heads and MLP width over tensor):
    # FSDP and tensor-parallel layouts then compile without XLA resharding the residual
    # stream ("involuntary full rematerialization"). No effect on a one-device mesh; on
    # larger meshes the numbers move at float rounding level (another partitioning).
    c.activation_sharding = False
    # A step whose env returned NaN/inf rewards or token ids outside the vocabulary, or
    # whose loss or gradients went non-finite: "stop" ends the run with one line naming
    # the env, the step and the quantity, before that step's state is checkpointed;
    # "skip" keeps the parameters of such a step (the update is skipped inside the
    # compiled step, at the cost of keeping both parameter sets alive for the select)
    # and logs a warning per skipped step (docs/faults.md).
    c.on_non_finite = "stop"
    return c


def import_modules(config: ml_collections.ConfigDict) -> None:
    """Imports the modules of `config.imports` (idempotent), so the names they register
    are known; a module that cannot be imported is a `ConfigError`."""
    modules = config.imports
    if isinstance(modules, str) or not isinstance(modules, (tuple, list)) or any(
            not isinstance(m, str) or not m for m in modules):
        fail("imports", modules, "expected a tuple of module names, e.g. ('my_pkg.my_envs',)")
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as error:
            fail("imports", tuple(modules), f"importing {name!r} failed: {one_line(error)} "
                 "(the module must be installed or on PYTHONPATH)")


def validate(config: ml_collections.ConfigDict, num_devices: int | None) -> None:
    check_range(config, "train_steps", 1, integer=True)
    check_range(config, "log_every", 1, integer=True)
    check_range(config, "checkpoint_every", 1, integer=True)
    check_range(config, "keep_checkpoints", 1, integer=True)
    check_range(config, "seed", 0, integer=True)
    check_range(config, "sample_every", 0, integer=True)
    mesh = tuple(config.mesh)
    check_bool(config, "activation_sharding")
    check_choice(config, "on_non_finite", ON_NON_FINITE)
    if len(mesh) != 3 or any(not isinstance(m, int) or m < 1 for m in mesh):
        fail("mesh", mesh, f"expected three positive integers for axes {MESH_AXES}")
    if num_devices is not None and math.prod(mesh) > num_devices:
        fail("mesh", mesh, f"needs {math.prod(mesh)} devices but only {num_devices} exist")


def validate_workdir(workdir: str) -> None:
    path = os.path.abspath(workdir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--workdir={workdir!r} is a file, not a directory: pass a "
                          "directory (created if missing).")
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"--workdir={workdir!r} cannot be created: {probe!r} is a file, "
                          "not a directory.")
    if not os.access(probe, os.W_OK):
        raise ConfigError(f"--workdir={workdir!r} is not writable (checked {probe!r}).")
