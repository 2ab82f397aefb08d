"""Rollouts inside the compiled step: multi-turn episodes of a token environment played
by a policy (or a scripted one), and Monte Carlo continuations of mid-episode states.

    traj = rollout(env, key, num_tasks=16, group_size=8, model=model, params=params)
    print(render_trajectory(env, traj, row=0))
"""

from arl.rollout.play import (default_row_params, env_ids_of, rollout, scripted_rollout,
                              task_keys)
from arl.rollout.trajectory import (SamplingConfig, Trajectory, chat_format, context_length,
                                    first_observation_length, observation_length,
                                    render_trajectory)
from arl.rollout.turns import (ACTION_SOURCES, RolloutCarry, TurnPlayer, TurnRecord,
                               initial_carry, write_rows)

__all__ = [
    "ACTION_SOURCES", "RolloutCarry", "SamplingConfig", "Trajectory", "TurnPlayer",
    "TurnRecord", "chat_format", "context_length", "default_row_params", "env_ids_of",
    "first_observation_length", "initial_carry", "observation_length", "render_trajectory", "rollout", "scripted_rollout", "task_keys", "write_rows",
]
