"""Rollouts inside the compiled step: multi-turn episodes of a token environment played
by a policy (or a scripted one), Monte Carlo continuations of mid-episode states, and
datasets recorded from episodes (evaluation task sets, scripted demonstrations).

    traj = rollout(env, key, num_tasks=16, group_size=8, model=model, params=params)
    print(render_trajectory(env, traj, row=0))
"""

from arl.rollout.episode_datasets import (Demonstrations, TaskSet, build_demonstrations,
                                          build_task_set, load_demonstrations, load_task_set,
                                          sample_demonstrations)
from arl.rollout.rollouts import (default_row_params, env_ids_of, rollout, scripted_rollout,
                              task_keys)
from arl.rollout.partial_rollouts import (CarriedEpisodes, initial_carried,
                                          partial_slot_rollout)
from arl.rollout.slots import SlotStats, slot_rollout
from arl.rollout.trajectory import (SamplingConfig, Trajectory, chat_format, context_length,
                                    first_observation_length, observation_length,
                                    render_trajectory)
from arl.rollout.turns import (ACTION_SOURCES, RolloutCarry, TurnPlayer, TurnRecord,
                               initial_carry, write_rows)

__all__ = [
    "ACTION_SOURCES", "CarriedEpisodes", "Demonstrations", "RolloutCarry", "SamplingConfig", "SlotStats",
    "TaskSet",
    "Trajectory", "TurnPlayer", "TurnRecord", "build_demonstrations", "build_task_set",
    "chat_format", "context_length", "default_row_params", "env_ids_of",
    "first_observation_length", "initial_carried", "initial_carry", "load_demonstrations", "load_task_set",
    "observation_length", "partial_slot_rollout", "render_trajectory", "rollout", "sample_demonstrations",
    "scripted_rollout", "slot_rollout", "task_keys", "write_rows",
]
