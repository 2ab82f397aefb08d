"""Every reward term of a sampled episode, for the transcripts of an evaluation.

    line = reward_terms_lines(trainer, state, rows)[b]
    # "-- reward terms: env +1.000 x 0.5, correctness +1.000 x 1, formatted none x 0.2,
    #     reward_model -0.214 x 1 = +1.286"

An evaluation plays the environment alone (its metrics are the env's success and
return), so a transcript's "(reward ...)" and "return" are the env's. When the run adds
Python reward functions (`arl.trainers.python_rewards`) or an outcome reward model
(`arl.trainers.reward_model`), the episode's reward in training is their weighted sum
with the env's; this line shows each term with its weight and the total, computed for
the transcript's rows the way the train step computes them (the functions called on the
host, the reward model's forward pass jitted once). A function's "none" is a row it did
not score (or failed on, with ``reward.on_error="zero"``): 0 in the total. With
``reward.on_error="raise"`` a failing function ends the run with its one line, as in a
train step.
"""

from __future__ import annotations

import jax
import numpy as np

from arl.rewards.functions import episodes


def _term(name: str, value: float, weight: float) -> str:
    shown = "none" if np.isnan(value) else f"{value:+.3f}"
    return f"{name} {shown} x {weight:g}"


def reward_terms_lines(trainer, state, rows) -> list[str] | None:
    """One line per row of `rows` (a trajectory of the env alone, on the host or device)
    naming every reward term (module docstring); None when the env's reward is the only
    one."""
    functions = getattr(trainer, "python_rewards", None)
    model = getattr(trainer, "reward_model", None)
    if functions is None and model is None:
        return None
    env_weight = float(trainer.config.reward.env_weight)
    env_return = np.asarray(rows.episode_return, np.float64)
    played = np.asarray(rows.turn_end_mask).any(axis=1)
    count = env_return.shape[0]
    columns = [("env", env_return, env_weight)]
    if functions is not None:
        task_rows = None if rows.task_rows is None else np.asarray(rows.task_rows)
        scores, _ = functions.scorer.score(episodes(
            trainer.env, rows.tokens, rows.agent_mask, rows.length, task_rows))
        columns += [(name, scores[:, i].astype(np.float64), float(functions.scorer.weights[i]))
                    for i, name in enumerate(functions.names)]
    if model is not None:
        score_fn = getattr(trainer, "_transcript_reward_model", None)
        if score_fn is None:
            score_fn = jax.jit(lambda params, traj: model.scores(params, traj)[0])
            trainer._transcript_reward_model = score_fn  # pylint: disable=protected-access
        scores = np.asarray(jax.device_get(score_fn(state.reward_model_params, rows)),
                            np.float64)
        columns.append(("reward_model", scores, model.weight))
    lines = []
    for b in range(count):
        total = sum(weight * (0.0 if np.isnan(values[b]) or (name != "env" and not played[b])
                              else values[b]) for name, values, weight in columns)
        terms = ", ".join(_term(name, float(values[b]), weight)
                          for name, values, weight in columns)
        lines.append(f"-- reward terms: {terms} = {total:+.3f}")
    return lines
