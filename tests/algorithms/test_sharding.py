"""Each kernel jitted with its batch sharded over 8 fake CPU devices equals 1 device."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from arl import algorithms as alg

NUM_DEVICES = 8


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < NUM_DEVICES:
        pytest.skip("needs 8 (fake) devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    return jax.make_mesh((NUM_DEVICES,), ("data",),
                         axis_types=(jax.sharding.AxisType.Auto,))


def _inputs():
    rng = np.random.default_rng(0)
    b, t, n = 16, 12, 64
    token = lambda: rng.normal(size=(b, t)).astype(np.float32)
    mask = rng.random((b, t)) < 0.7
    group_ids = rng.integers(0, 8, size=n).astype(np.int32)
    return dict(
        rewards=token(), values=token(), logp=token() - 2, old=token() - 2, mask=mask,
        dones=rng.random((b, t)) < 0.1, turn_end=rng.random((b, t)) < 0.3,
        seq_adv=rng.normal(size=b).astype(np.float32),
        logits=rng.normal(size=(b, t, 5)).astype(np.float32),
        tokens=rng.integers(0, 5, size=(b, t)).astype(np.int32),
        scores=(rng.random(n) < 0.5).astype(np.float32), group_ids=group_ids,
        env_ids=(group_ids % 3).astype(np.int32), valid=rng.random(n) < 0.9)


KERNELS = {
    "gae_scan": lambda x: alg.gae(x["rewards"], x["values"], x["mask"], gamma=0.9, lam=0.8,
                                  dones=x["dones"], method="scan"),
    "gae_associative": lambda x: alg.gae(x["rewards"], x["values"], x["mask"], gamma=0.9,
                                         lam=0.8, dones=x["dones"], method="associative"),
    "discounted_returns": lambda x: alg.discounted_returns(x["rewards"], x["mask"],
                                                           gamma=0.9),
    "turn_level_gae": lambda x: alg.turn_level_gae(x["rewards"], x["values"], x["mask"],
                                                   x["turn_end"], turn_gamma=0.9),
    "whiten": lambda x: alg.whiten(x["rewards"], x["mask"]),
    "token_logprobs": lambda x: alg.token_logprobs(x["logits"], x["tokens"]),
    "entropy": lambda x: alg.entropy(x["logits"]),
    "aggregate": lambda x: [alg.aggregate(x["rewards"], x["mask"], m)
                            for m in alg.AGGREGATIONS],
    "policy_loss": lambda x: alg.policy_loss(x["logp"], x["old"], x["seq_adv"], x["mask"],
                                             dual_clip=3.0),
    "policy_loss_grad": lambda x: jax.grad(lambda lp: alg.policy_loss(
        lp, x["old"], x["seq_adv"], x["mask"], agg="seq-mean-token-mean")[0])(x["logp"]),
    "value_loss": lambda x: alg.value_loss(x["values"], x["old"], x["rewards"], x["mask"],
                                           clip=0.2),
    "kl_penalty": lambda x: [alg.kl_penalty(x["logp"], x["old"], k, mask=x["mask"])
                             for k in alg.KL_KINDS],
    "observation_sft": lambda x: (alg.observation_loss(x["logp"], x["mask"], weight=0.05),
                                  alg.sft_loss(x["logp"], x["mask"])),
    "group_advantages": lambda x: alg.group_advantages(x["scores"], x["group_ids"],
                                                       num_groups=8, valid=x["valid"]),
    "group_statistics": lambda x: alg.group_statistics(x["scores"], x["group_ids"],
                                                       num_groups=8, valid=x["valid"]),
    "rloo": lambda x: alg.rloo_advantages(x["scores"], x["group_ids"], num_groups=8,
                                          valid=x["valid"]),
    "reinforce_pp": lambda x: alg.reinforce_pp_advantages(x["scores"], x["group_ids"],
                                                          num_groups=8, valid=x["valid"]),
    "env_advantages": lambda x: alg.env_advantages(x["scores"], x["group_ids"],
                                                   x["env_ids"], num_groups=8, num_envs=3,
                                                   valid=x["valid"]),
    "starpo": lambda x: alg.starpo_keep_mask(x["scores"], x["group_ids"], num_groups=8,
                                             keep_fraction=0.5, valid=x["valid"]),
    "dapo": lambda x: alg.dapo_zero_variance_mask(x["scores"], x["group_ids"],
                                                  num_groups=8, valid=x["valid"]),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_sharded_equals_single_device(mesh, name):
    inputs = _inputs()
    kernel = jax.jit(KERNELS[name])
    want = kernel(inputs)
    batch_sharded = NamedSharding(mesh, P("data"))
    sharded = {k: jax.device_put(v, batch_sharded) for k, v in inputs.items()}
    with jax.set_mesh(mesh):
        got = kernel(sharded)
    assert any(len(leaf.sharding.device_set) == NUM_DEVICES
               for leaf in jax.tree.leaves(sharded))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6),
                 got, want)
