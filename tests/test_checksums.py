"""arl.runs.checksums: digests against a NumPy reference, layout independence, and what
they catch (one flipped bit in any dtype, two swapped elements)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl.runs import checksums

_MASK = 0xFFFFFFFF


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK
    return h ^ (h >> 16)


def _reference_digest(words: np.ndarray) -> str:
    """The module docstring's formula, element by element in Python integers."""
    lane_1 = lane_2 = 0
    for i, w in enumerate(int(x) for x in words.reshape(-1)):
        mixed = _fmix32((w + i * 0x9E3779B9) & _MASK)
        lane_1 = (lane_1 + mixed) & _MASK
        lane_2 = (lane_2 + mixed * (2 * i + 1)) & _MASK
    return f"{lane_1:08x}{lane_2:08x}"


@pytest.mark.parametrize("dtype, view", [
    (np.float32, np.uint32), (np.int32, np.uint32), (jnp.bfloat16, np.uint16),
    (np.int8, np.uint8), (np.uint8, np.uint8)])
def test_digest_matches_the_formula(dtype, view):
    values = np.random.default_rng(0).normal(size=(3, 5)) * 50
    array = np.asarray(values).astype(dtype)
    words = array.view(view).astype(np.uint64)
    assert checksums.tree_checksums({"x": array})["x"].digest == _reference_digest(words)


def test_keys_hash_their_key_data_and_bool_its_values():
    typed = jax.random.key(3)
    record = checksums.tree_checksums({"typed": typed, "raw": jax.random.key_data(typed),
                                       "flags": np.array([True, False, True])})
    assert record["typed"].digest == record["raw"].digest
    assert record["typed"].digest == _reference_digest(
        np.asarray(jax.random.key_data(typed)).astype(np.uint64))
    assert record["flags"].digest == _reference_digest(np.array([1, 0, 1], np.uint64))


def test_sharded_equals_unsharded_and_names_follow_orbax():
    assert jax.device_count() == 8
    mesh = jax.make_mesh((4, 2), ("data", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    values = jnp.arange(64.0).reshape(8, 8) * 1.5
    sharded = jax.device_put(values, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("data", "tensor")))
    # Leaves on two device sets (a rollout mesh apart from the training mesh).
    other = jax.device_put(values, jax.devices()[5])
    record = checksums.tree_checksums({"a": {"w": sharded}, "b": [other, values]})
    assert list(record) == ["a.w", "b.0", "b.1"]
    assert record["a.w"] == record["b.0"] == record["b.1"]
    assert record["a.w"].digest == _reference_digest(np.asarray(values).view(np.uint32))


def test_one_flipped_bit_or_two_swapped_elements_change_the_digest():
    rng = np.random.default_rng(1)
    original = rng.normal(size=(64,)).astype(np.float32)
    base = checksums.tree_checksums({"x": original})["x"].digest
    digests = {base}
    for element, bit in zip(rng.integers(0, 64, 20), rng.integers(0, 32, 20)):
        flipped = original.copy()
        flipped.view(np.uint32)[element] ^= np.uint32(1 << int(bit))
        digests.add(checksums.tree_checksums({"x": flipped})["x"].digest)
    swapped = original.copy()
    swapped[[3, 40]] = swapped[[40, 3]]
    digests.add(checksums.tree_checksums({"x": swapped})["x"].digest)
    assert len(digests) == 22


def test_non_finite_counts_floating_leaves_only():
    record = checksums.tree_checksums({
        "f": jnp.array([1.0, jnp.nan, -jnp.inf, 2.0]),
        "h": jnp.array([jnp.inf], jnp.bfloat16),
        "i": jnp.array([-1, 2**31 - 1], jnp.int32),
        "k": jax.random.key(0)})
    assert {name: check.non_finite for name, check in record.items()} == {
        "f": 2, "h": 1, "i": 0, "k": 0}
