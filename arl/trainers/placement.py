"""Where the two programs of asynchronous rollouts run, and how arrays move between them.

One process: the training mesh takes the first prod(config.mesh) devices and a rollout
mesh of its own (`config.rollout.mesh`) the next prod(config.rollout.mesh); arrays move
with `jax.device_put`.

P processes (`jax.distributed`): each mesh takes the same share of every process's
devices, as one places them on a multi-GPU or TPU host: every process gives its first
prod(config.mesh) / P local devices to the training mesh and its next
prod(config.rollout.mesh) / P to the rollout mesh. Each process's training devices then
find the parameters and trajectory rows they need on rollout devices of their own
process, so every move is a copy inside a process (`move`), which works on every backend.
`jax.device_put` itself refuses to reshard between two meshes with different device
sets across processes, and JAX on CPU moves arrays between processes only through
`jax_cross_host_transfer_socket_address`; a mesh on some processes only (rollout on one
host, training on another) is refused with a one-line error before anything is traced.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax

from arl import sharding as sharding_lib
from arl.errors import invalid_field

_WHY_PER_PROCESS = ("the two programs exchange parameters and trajectories inside each "
                    "process only (across processes jax.device_put does not reshard between "
                    "meshes of different devices)")


def _share(config, field: str, shape: tuple, processes: int, local_devices: int) -> int:
    """Devices `shape` takes from each of `processes` processes."""
    size = math.prod(shape)
    if size % processes:
        raise invalid_field(field, shape, f"with {processes} processes the training and "
                            f"rollout meshes each take the same number of devices from "
                            f"every process, as {_WHY_PER_PROCESS}: allowed are shapes of "
                            f"a multiple of {processes} devices")
    if math.prod(config.mesh) // processes + math.prod(config.rollout.mesh) // processes > (
            local_devices):
        raise invalid_field(field, shape, f"the training mesh {tuple(config.mesh)} and the "
                            f"rollout mesh {tuple(config.rollout.mesh)} take "
                            f"{math.prod(config.mesh) // processes} + "
                            f"{math.prod(config.rollout.mesh) // processes} devices of each "
                            f"process, which has {local_devices}")
    return size // processes


def _per_process_devices(take: int, skip: int) -> list:
    """`take` devices of every process, after its first `skip`, process by process."""
    by_process: dict[int, list] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    return [d for p in sorted(by_process) for d in by_process[p][skip:skip + take]]


def training_mesh(config) -> jax.sharding.Mesh | None:
    """The training mesh of a run with a rollout mesh of its own across processes (every
    process's first prod(config.mesh) / P devices), or None where the trainer's default
    (the first prod(config.mesh) devices) is it. Raises `ConfigError` (before anything
    is traced) for meshes that do not divide over the processes."""
    processes = jax.process_count()
    if processes == 1 or not tuple(config.rollout.mesh):
        return None
    local = jax.local_device_count()
    take = _share(config, "mesh", tuple(config.mesh), processes, local)
    _share(config, "rollout.mesh", tuple(config.rollout.mesh), processes, local)
    return sharding_lib.make_mesh(tuple(config.mesh), _per_process_devices(take, 0))


def rollout_mesh(config, training: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """`config.rollout.mesh` on the devices `training` leaves (the module docstring says
    which), or `training` itself for () (colocated)."""
    shape = tuple(config.rollout.mesh)
    if not shape:
        return training
    processes = jax.process_count()
    if processes > 1:
        expected = training_mesh(config)
        if list(training.devices.flat) != list(expected.devices.flat):
            raise invalid_field("mesh", tuple(config.mesh), f"with a rollout.mesh across "
                                f"{processes} processes the training mesh takes the first "
                                f"{math.prod(config.mesh) // processes} devices of every "
                                "process (build the trainer with mesh="
                                "arl.trainers.placement.training_mesh(config))")
        skip = math.prod(config.mesh) // processes
        return sharding_lib.make_mesh(shape, _per_process_devices(
            math.prod(shape) // processes, skip))
    used = {d.id for d in training.devices.flat}
    free = [d for d in jax.devices() if d.id not in used]
    if math.prod(shape) > len(free):
        raise invalid_field("rollout.mesh", shape, f"needs {math.prod(shape)} devices "
                            f"besides the training mesh's {len(used)}; {len(free)} are left")
    return sharding_lib.make_mesh(shape, free)


# ---------------------------------------------------------------------------- moves
def _bounds(index: tuple, shape: tuple) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


@functools.lru_cache(maxsize=256)
def local_plan(source: jax.sharding.Sharding, target: jax.sharding.Sharding, shape: tuple,
               process_of: Callable[[Any], int] = lambda d: d.process_index) -> dict:
    """For each device of `target` (an array of `shape`): a device of `source` in the
    same process whose block holds the target block, and the target block's slices
    within it. Raises ValueError naming a device that has none."""
    sources = [(d, _bounds(i, shape)) for d, i in source.devices_indices_map(shape).items()]
    plan = {}
    for device, index in target.devices_indices_map(shape).items():
        want = _bounds(index, shape)
        for candidate, have in sources:
            if process_of(candidate) == process_of(device) and all(
                    h0 <= w0 and w1 <= h1 for (h0, h1), (w0, w1) in zip(have, want)):
                plan[device] = (candidate, tuple(slice(w0 - h0, w1 - h0) for (h0, _), (w0, w1)
                                                 in zip(have, want)))
                break
        else:
            raise ValueError(f"device {device} (process {process_of(device)}) needs the block "
                             f"{want} of a {shape} array, which no device of its process holds")
    return plan


def check_local(field: str, value, source, target, shape: tuple, what: str,
                process_of: Callable[[Any], int] = lambda d: d.process_index) -> None:
    """Raises `ConfigError` on `field` when `move` could not copy an array of `shape`
    from `source` to `target` inside each process."""
    try:
        local_plan(source, target, tuple(shape), process_of)
    except ValueError as error:
        raise invalid_field(field, value, f"{what} cannot move between the meshes inside "
                            f"each process ({error}); give both meshes the same "
                            f"data*fsdp split over the processes; {_WHY_PER_PROCESS}") from None


def _move_leaf(x: jax.Array, target: jax.sharding.Sharding) -> jax.Array:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_move_leaf(jax.random.key_data(x), target),
                                        impl=jax.random.key_impl(x))
    shards = {shard.device: shard.data for shard in x.addressable_shards}
    plan = local_plan(x.sharding, target, x.shape)
    pieces = []
    for device in target.addressable_devices_indices_map(x.shape):
        source, block = plan[device]
        data = shards[source]
        if any((s.start, s.stop) != (0, n) for s, n in zip(block, data.shape)):
            data = data[block]
        pieces.append(jax.device_put(data, device, may_alias=False))
    return jax.make_array_from_single_device_arrays(x.shape, target, pieces)


def move(tree: Any, shardings: Any) -> Any:
    """`tree` copied onto `shardings` (one sharding, or a tree of them): its own buffers,
    which outlive a later donation of `tree`. One process: `jax.device_put`; several:
    shard by shard inside each process (`local_plan`)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings, may_alias=False)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: _move_leaf(x, shardings), tree)
    return jax.tree.map(_move_leaf, tree, shardings)


__all__ = ["check_local", "local_plan", "move", "rollout_mesh", "training_mesh"]
