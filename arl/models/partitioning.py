"""How the decoder's parameters and activations are laid out on a device mesh.

Mesh axes are ("data", "fsdp", "tensor"). Parameters carry logical axis names
(`nn.with_logical_partitioning`), mapped to mesh axes by `LOGICAL_AXIS_RULES`
(`param_partition_specs`, `param_shardings`); activations are pinned to their layout
inside the forward pass by `constrain_activation` under `ACTIVATION_AXIS_RULES`.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import PartitionSpec


# Logical axis name -> mesh axis (or None: replicated). Mesh axes are ("data", "fsdp",
# "tensor"): FSDP shards the model dimension of every matrix, tensor parallelism shards
# heads / MLP hidden / vocabulary (Megatron-style column/row split).
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("length", None),
)


# Activation logical axis name -> mesh axis, for `constrain_activation`. The batch is
# split over data x fsdp everywhere (FSDP is data parallelism whose weights are gathered
# layer by layer); the residual stream's embed dimension stays whole on a device (the
# weights' "embed" axis is the fsdp-sharded one, not the activations'); attention heads
# and the MLP width are split over "tensor" (Megatron-style: column-parallel q/k/v and
# gate/up, row-parallel o_proj and down_proj), as are the logits' vocabulary.
ACTIVATION_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_head_dim", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
)
RESIDUAL = ("activation_batch", "activation_length", "activation_embed")
HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
KV_HEADS = ("activation_batch", "activation_length", "activation_kv_heads",
             "activation_head_dim")
MLP = ("activation_batch", "activation_length", "activation_mlp")
LOGITS = ("activation_batch", "activation_length", "activation_vocab")


def constrain_activation(x: jax.Array, names: Sequence[str],
                         rules: Sequence[tuple[str, Any]] = ACTIVATION_AXIS_RULES
                         ) -> jax.Array:
    """`x` constrained to the sharding its logical axis `names` map to under `rules`,
    on the mesh the caller traces under (`jax.sharding.use_abstract_mesh`; the token
    trainer traces its steps under its mesh).

    Without such a mesh, or on a mesh of one device, `x` is returned as it is (no
    operation at all). A mesh axis that does not divide its dimension (2 KV heads over a
    4-way "tensor" axis) or that the mesh lacks is dropped (replicated). Telling XLA
    where the activations live keeps the partitioner from resharding the residual
    stream to the weights' layout (the "involuntary full rematerialization" of FSDP
    layouts); the same idea as MaxText's activation logical axes.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    table = dict(rules)
    spec = []
    for name, dim in zip(names, x.shape, strict=True):
        axes = table[name]
        names_of = axes if isinstance(axes, tuple) else (axes,)
        if axes is None or any(a not in mesh.shape for a in names_of) or dim % int(
                np.prod([mesh.shape[a] for a in names_of])):
            axes = None
        spec.append(axes)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def _divides(mesh, mesh_axes, dim) -> bool:
    names = mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)
    return dim % int(np.prod([mesh.shape[n] for n in names])) == 0


def param_partition_specs(params_or_boxed, rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES,
                          mesh: jax.sharding.Mesh | None = None):
    """PartitionSpec pytree (mesh axes) for boxed parameters.

    Leaves that are `nn.Partitioned`/`nn.LogicallyPartitioned` boxes (what `model.init`
    and `abstract_params` return) get their logical names mapped through `rules`; plain
    arrays get PartitionSpec() (replicated) — pass boxes, not unboxed params. With `mesh`,
    an axis whose mesh size does not divide the dimension is dropped (replicated) so the
    spec is always valid for `jax.device_put`, e.g. 2 kv heads on a 4-way tensor axis.
    The result has the structure of the unboxed parameters.
    """
    logical = nn.get_partition_spec(params_or_boxed)
    mesh_specs = nn.logical_to_mesh(logical, rules)
    if mesh is None:
        return mesh_specs
    shapes = jax.tree.map(lambda x: x.shape, nn.unbox(params_or_boxed))

    def fit(spec, shape):
        return PartitionSpec(*(axes if axes is None or _divides(mesh, axes, dim) else None
                               for axes, dim in zip(tuple(spec) + (None,) * (len(shape) - len(spec)),
                                                    shape)))

    return jax.tree.map(fit, mesh_specs, shapes,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_shardings(params_or_boxed, mesh: jax.sharding.Mesh,
                    rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES):
    """NamedSharding pytree for `jax.device_put` / `jax.jit(out_shardings=...)`."""
    specs = param_partition_specs(params_or_boxed, rules, mesh)
    return jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))
