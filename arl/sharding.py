"""Device meshes and shardings: axes ("data", "fsdp", "tensor"), logical-axis rules.

The batch is sharded over data x fsdp; parameters carry logical axis names (set by the
model with `nn.with_logical_partitioning`) mapped to mesh axes by
`arl.models.partitioning.LOGICAL_AXIS_RULES`; optimizer moments follow their parameters.
The same program runs on one device (mesh (1, 1, 1)), on fake CPU devices and on a slice.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Sequence

import jax
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def make_mesh(shape: Sequence[int], devices=None) -> jax.sharding.Mesh:
    """A mesh with axes ("data", "fsdp", "tensor") over the first prod(shape) devices."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or any(s < 1 for s in shape):
        raise ValueError(f"mesh shape {shape} must be three positive integers {MESH_AXES}.")
    devices = jax.devices() if devices is None else devices
    if math.prod(shape) > len(devices):
        raise ValueError(
            f"mesh shape {shape} needs {math.prod(shape)} devices; {len(devices)} available.")
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices[: math.prod(shape)])


def activation_mesh(mesh: jax.sharding.Mesh | None):
    """Context in which a step traces with `mesh` as JAX's abstract mesh, so the model's
    activation constraints (`arl.models.partitioning.constrain_activation`) take effect;
    nothing at all for None or a one-device mesh (the program is then exactly the
    unconstrained one). The trainers pass their mesh when `config.activation_sharding`."""
    if mesh is None or mesh.size == 1:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh) -> NamedSharding:
    """Leading (batch) dimension split over data x fsdp; other dimensions replicated."""
    return NamedSharding(mesh, P(BATCH_AXES))


def layer_major_batch_sharding(mesh) -> NamedSharding:
    """A [layers, batch, ...] array's batch (second) dimension split over data x fsdp."""
    return NamedSharding(mesh, P(None, BATCH_AXES))


def opt_state_shardings(optimizer, opt_state, param_shardings_tree, default):
    """Shardings for an optimizer state: parameter-shaped subtrees follow the params."""
    return optax.tree_map_params(
        optimizer, lambda _, s: s, opt_state, param_shardings_tree,
        transform_non_params=lambda _: default)


def gather_rows(tree: Any, rows: int) -> Any:
    """The first `rows` rows of a batch-sharded pytree as host arrays, gathered from
    every process's shards in a multi-host run."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

        tree = multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(lambda x: jax.device_get(x)[:rows], tree)
