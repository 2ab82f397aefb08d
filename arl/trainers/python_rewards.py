"""Python reward functions inside the compiled step: one ordered host callback per step.

    rewards = PythonRewards.from_config(config, env)     # None without reward.functions
    traj, metrics = rewards(traj)                         # traced, inside train_step

After the rollout, the batch's token buffers (and each row's dataset row, where the env
has one) go to the host in ONE `jax.experimental.io_callback`; there
`arl.rewards.functions.RewardFunctions` decodes the episodes and calls every
function of `config.reward.functions` on the batch (a thread pool, a time limit per
call). Their weighted sum is the episode's outcome from the functions:

    reward(episode) = reward.env_weight * (the env's turn rewards)
                      + sum_i reward.weights[i] * f_i(episode)      (None counts 0)

added on the last agent token of the episode's last turn, so every credit family
(GRPO's group scores, GAE, Monte Carlo) reads it like an env reward; `episode_return`
and `turn_rewards` include it. Each function is logged as `reward/<name>/mean` and
`reward/<name>/std` (over the rows it scored) and `reward/<name>/errors` (rows scored 0
after a failure, with `reward.on_error="zero"`).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from arl.errors import quiet_callback_failures
from arl.rewards.functions import RewardFunctions, episodes
from arl.rollout.trajectory import Trajectory


class PythonRewards:
    """The config's Python reward functions as a traceable transform of a trajectory."""

    def __init__(self, env, scorer: RewardFunctions, env_weight: float = 1.0):
        self.env = env
        self.scorer = scorer
        # A failing function raises its one line from the callback: no JAX traceback.
        quiet_callback_failures()
        self.env_weight = float(env_weight)
        # Host callbacks made and wall seconds spent in them (decoding + the functions):
        # what the device waits for each step.
        self.host_calls = 0
        self.host_seconds = 0.0

    @classmethod
    def from_config(cls, config, env) -> "PythonRewards | None":
        r = config.reward
        if not r.functions:
            return None
        scorer = RewardFunctions(tuple(r.functions), tuple(r.weights) or None,
                                 timeout_s=r.timeout_s, on_error=r.on_error,
                                 max_workers=r.max_workers or None)
        return cls(env, scorer, r.env_weight)

    @property
    def names(self) -> list[str]:
        return self.scorer.names

    def host_scores(self, tokens, agent_mask, length, task_rows):
        """(scores float32 [B, F], NaN where unscored; errors int32 [F]) on the host."""
        start = time.perf_counter()
        try:
            rows = None if task_rows.shape[0] == 0 else task_rows
            batch = episodes(self.env, tokens, agent_mask, length, rows)
            return self.scorer.score(batch)
        finally:
            self.host_calls += 1
            self.host_seconds += time.perf_counter() - start

    def scores(self, traj: Trajectory):
        """(scores [B, F], errors [F]) of the functions on `traj` (traced)."""
        batch = traj.tokens.shape[0]
        num = len(self.scorer.functions)
        rows = traj.task_rows if traj.task_rows is not None else jnp.zeros((0,), jnp.int32)
        shapes = (jax.ShapeDtypeStruct((batch, num), jnp.float32),
                  jax.ShapeDtypeStruct((num,), jnp.int32))
        return io_callback(self.host_scores, shapes, traj.tokens, traj.agent_mask,
                           traj.length, rows, ordered=True)

    def __call__(self, traj: Trajectory) -> tuple[Trajectory, dict[str, jax.Array]]:
        """`traj` with the functions' weighted sum added to each episode's outcome (module
        docstring), and their metrics."""
        scores, errors = self.scores(traj)
        scored = ~jnp.isnan(scores)
        values = jnp.where(scored, scores, 0.0)
        total = values @ jnp.asarray(self.scorer.weights)
        metrics = {}
        for i, name in enumerate(self.names):
            count = jnp.sum(scored[:, i])
            mean = jnp.sum(values[:, i]) / jnp.maximum(count, 1)
            var = jnp.sum(jnp.where(scored[:, i], (values[:, i] - mean) ** 2, 0.0)) / \
                jnp.maximum(count, 1)
            metrics[f"reward/{name}/mean"] = mean
            metrics[f"reward/{name}/std"] = jnp.sqrt(var)
            metrics[f"reward/{name}/errors"] = errors[i].astype(jnp.float32)
        return add_outcome(traj, total, self.env_weight), metrics


def add_outcome(traj: Trajectory, outcome: jax.Array, env_weight: float = 1.0) -> Trajectory:
    """`traj` with its env rewards scaled by `env_weight` and `outcome` f32 [B] added on
    each played episode's last agent token of its last turn (the outcome position every
    credit family reads), in `rewards`, `episode_return` and `turn_rewards`. Rows that
    played no turn get nothing."""
    width = traj.turn_end_mask.shape[1]
    last = width - 1 - jnp.argmax(traj.turn_end_mask[:, ::-1] > 0, axis=1)
    played = jnp.any(traj.turn_end_mask > 0, axis=1)
    at_end = (jnp.arange(width)[None, :] == last[:, None]) & played[:, None]
    outcome = jnp.where(played, outcome, 0.0)
    replace = dict(rewards=env_weight * traj.rewards + at_end * outcome[:, None],
                   episode_return=env_weight * traj.episode_return + outcome)
    if traj.turn_rewards is not None:
        turns = traj.turn_rewards.shape[1]
        last_turn = (jnp.arange(turns)[None, :] == traj.num_turns[:, None] - 1)
        replace["turn_rewards"] = env_weight * traj.turn_rewards + last_turn * outcome[:, None]
    return traj.replace(**replace)

