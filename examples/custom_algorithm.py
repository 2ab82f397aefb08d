"""A new algorithm: RLOO's leave-one-out baseline scaled by the group's standard deviation.

An algorithm of the outcome family is one kernel and one row of the algorithm table:
the kernel is checked on a hand-computed batch, then the new name trains two steps on
the bandit (docs/algorithms.md, "Add an algorithm").

    python examples/custom_algorithm.py
"""

import jax.numpy as jnp
import numpy as np

import arl
from arl import algorithms as alg


def loo_std_advantages(batch: arl.OutcomeBatch, settings) -> jnp.ndarray:
    """A_i = (s_i - mean_{j != i} s_j) / (std_g + eps); 0 for degenerate groups."""
    loo = alg.rloo_advantages(batch.scores, batch.group_ids, num_groups=batch.num_groups,
                              valid=batch.valid)
    stats = alg.group_statistics(batch.scores, batch.group_ids,
                                 num_groups=batch.num_groups, valid=batch.valid)
    return loo / (stats.std[batch.group_ids] + settings.eps)


arl.register_algorithm(arl.Algorithm(
    name="rloo_std", credit="outcome", outcome_advantages=loo_std_advantages,
    min_group_size=2, summary="RLOO baseline, scaled by the group std"))

# The kernel on a hand-checked batch: group 0 scores (1, 0), group 1 constant.
batch = arl.OutcomeBatch(scores=jnp.array([1.0, 0.0, 2.0, 2.0]),
                         group_ids=jnp.array([0, 0, 1, 1]), env_ids=jnp.zeros(4, jnp.int32),
                         valid=jnp.ones(4, bool), num_groups=2, num_envs=1)
settings = arl.default_config().advantage
np.testing.assert_allclose(loo_std_advantages(batch, settings),
                           [2 ** 0.5, -(2 ** 0.5), 0.0, 0.0], rtol=1e-5)

# The new name now works everywhere a config goes: here, two train steps on the bandit.
config = arl.default_config()
config.algorithm, config.env.name = "rloo_std", "bandit"
config.rollout.num_tasks, config.rollout.group_size = 4, 4
config.model.d_model, config.model.num_layers, config.model.mlp_dim = 32, 1, 64
config.loss.sft_coef = 1.0  # RL + SFT on the demonstrator, as configs/grpo_bandit.py
trainer = arl.build(config)
state = trainer.init_state()
for _ in range(2):
    state, metrics = trainer.train_step(state)
print(f"rloo_std: loss {float(metrics['loss/total']):.3f}, "
      f"success {float(metrics['success_rate']):.2f}")
