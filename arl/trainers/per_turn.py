"""The token step in history mode "per turn": every turn a training sample of its own.

    samples = per_turn_rollout(...)                 # [B, K, L]: context_k ++ turn_k
    outcome credit (GRPO, RLOO, ...): A_b = outcome_advantages(episode returns), on
              every token of every turn of episode b (`turn_advantages`)
    GAE (PPO): GAE over the episode's agent tokens turn after turn, each token's value
              read in its own sample (`turn_sample_gae`; token- or turn-level)
    batch   = [B*K, L] rows, mask = turn k's agent tokens x kept episode
    update  = the token trainer's `Learner`, unchanged

The filters (StarPO-S, DAPO) keep or drop whole episodes, so all their turns. Rows of the
batch are episode-major (row b*K + k is turn k of episode b), so a GRPO group's turns
are `group_size * K` consecutive rows (`updates.shuffle="groups"` keeps them together).
The groups' prompts are not scored once (`updates.share_group_prompt` has no effect):
later turns' contexts do not begin with the first turn's generation prompt under every
template.

What the mode does not combine with is refused by `arl.config.history` in one line.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from arl import algorithm_table
from arl import algorithms as alg
from arl import sharding as sharding_lib
from arl.errors import ConfigError
from arl.rollout import per_turn as per_turn_lib
from arl.rollout.turns import write_rows
from arl.text.render_turns import HistoryWindow
from arl.trainers import credit_assignment as credit_lib
from arl.trainers import guards
from arl.trainers.protocol import EvaluationReport
from arl.trainers.policy import shift_right
from arl.trainers.state import TrainState
from arl.trainers.token import TRANSCRIPT_ROWS, StepKeys, TokenTrainer
from arl.trainers.update import UpdateBatch


def turn_advantages(episode_advantages: jax.Array, agent_mask: jax.Array) -> jax.Array:
    """float32 [B, K, L]: episode b's advantage on the agent tokens of each of its turns."""
    return episode_advantages.astype(jnp.float32)[:, None, None] * agent_mask


def agent_tokens(x: jax.Array, context_length: jax.Array, action_len: int) -> jax.Array:
    """[B, K*A]: the agent tokens' entries of per-sample arrays x [B, K, L], turn after
    turn (turn k's token j at k*A + j, read from position context_length[b, k] + j of
    sample k; entries past the turn's length are whatever follows it, to be masked)."""
    batch, turns, length = x.shape
    index = jnp.clip(context_length[..., None] + jnp.arange(action_len), 0, length - 1)
    return jnp.take_along_axis(x, index, axis=2).reshape(batch, turns * action_len)


def to_samples(view: jax.Array, context_length: jax.Array, turn_length: jax.Array,
               length: int) -> jax.Array:
    """Inverse of `agent_tokens`: [B, K*A] -> [B, K, L], entry k*A + j at position
    context_length[b, k] + j of sample k for j < turn_length[b, k], zero elsewhere."""
    batch, turns = context_length.shape
    chunks = view.reshape(batch * turns, -1)
    out = write_rows(jnp.zeros((batch * turns, length), view.dtype), chunks,
                     context_length.reshape(-1), turn_length.reshape(-1))
    return out.reshape(batch, turns, length)


def turn_sample_gae(turn_rewards, values, context_length, length, action_len: int, *,
                    gamma, lam, turn_level: bool = False, turn_gamma: float = 1.0):
    """(advantages, returns) [B, K, L] of GAE over each episode's agent tokens, turn
    after turn, as `arl.algorithms.gae` (or `turn_level_gae`) gives them on the
    as-generated row: token t's value V(s_t) is the value head's output at the position
    before it in its own sample (for a turn's first token, the end of its rendered
    context); turn k's reward sits on its last token; zero off the agent tokens.

    turn_rewards [B, K]; values [B, K, L] (the head's output at each position,
    `TurnSamples.values`); context_length, length [B, K] (turn k's tokens are
    positions context_length .. length - 1 of sample k, at most `action_len`)."""
    batch, turns, width = values.shape
    turn_length = length - context_length
    before = jnp.concatenate([jnp.zeros_like(values[..., :1]), values[..., :-1]], axis=-1)
    position = jnp.arange(action_len)[None, None, :]
    mask = (position < turn_length[..., None]).astype(jnp.float32)
    turn_end = (position == (turn_length - 1)[..., None]) & (turn_length > 0)[..., None]
    mask, turn_end = (x.reshape(batch, turns * action_len) for x in (mask, turn_end))
    value_view = agent_tokens(before, context_length, action_len) * mask
    rewards = jnp.where(turn_end, jnp.repeat(turn_rewards, action_len, axis=1), 0.0)
    if turn_level:
        advantages, returns = alg.turn_level_gae(rewards, value_view, mask, turn_end,
                                                 gamma=gamma, lam=lam, turn_gamma=turn_gamma)
    else:
        advantages, returns = alg.gae(rewards, value_view, mask, gamma=gamma, lam=lam)
    return (to_samples(advantages * mask, context_length, turn_length, width),
            to_samples(returns * mask, context_length, turn_length, width))


def turn_rows(x: jax.Array) -> jax.Array:
    """[B, K, ...] -> [B*K, ...]: every turn of every episode a row, as the update and the
    warm start train them."""
    return x.reshape((-1,) + x.shape[2:])


def samples_metrics(samples: per_turn_lib.TurnSamples, env_names) -> dict[str, jax.Array]:
    """The rollout metrics of `arl.trainers.credit_assignment.rollout_metrics` for
    episodes played per turn (the env's own per-episode statistics included, e.g.
    `tools/calls_mean`), and the mode's own: turn samples, mean context length,
    episodes ended by a context that did not fit, turns the window dropped."""
    active = samples.active.astype(jnp.float32)
    played = jnp.maximum(jnp.sum(active), 1.0)
    metrics = credit_lib.episode_metrics(
        episode_return=samples.episode_return, success=samples.success,
        num_turns=samples.num_turns, format_errors=samples.format_errors,
        response_tokens=samples.agent_mask.sum(axis=(1, 2)),
        context_tokens_mean=jnp.sum(samples.context_length * active) / played,
        env_ids=samples.env_ids, episode_stats=samples.episode_stats, env_names=env_names)
    metrics.update({
        "per_turn/samples": jnp.sum(active),
        "per_turn/context_overflow_rate": jnp.mean(samples.overflow.astype(jnp.float32)),
        "per_turn/dropped_turns_mean": jnp.sum(
            (jnp.arange(samples.active.shape[1])[None, :] - samples.kept_turns) * active)
        / played,
    })
    return metrics


def render_samples(codec, samples: per_turn_lib.TurnSamples, row: int = 0) -> str:
    """Readable text of one episode: the context of its last turn and that turn, as the
    policy read and wrote them."""
    import numpy as np  # pylint: disable=g-import-not-at-top

    turns = int(samples.num_turns[row])
    lines = []
    if turns:
        k = turns - 1
        start, end = int(samples.context_length[row, k]), int(samples.length[row, k])
        tokens = np.asarray(samples.tokens[row, k])
        lines.append(f"[context of turn {turns}] "
                     + codec.decode(tokens[:start], stop_at_pad=False))
        lines.append("[agent] " + codec.decode(tokens[start:end], stop_at_pad=False))
    status = "success" if bool(samples.success[row]) else "failure"
    lines.append(f"-- {status}, {turns} turns, return "
                 f"{float(samples.episode_return[row]):+.3f}")
    return "\n".join(lines)


class PerTurnTrainer(TokenTrainer):
    """A `TokenTrainer` whose rollout plays per turn (`arl.rollout.per_turn`) and whose
    update trains each turn as a sample (module docstring). Built by `arl.build` for
    `rollout.history="per_turn"`."""

    def __init__(self, config, *, mesh=None):
        r = config.rollout
        self.window = HistoryWindow(turns=r.history_window_turns,
                                    tokens=r.history_window_tokens)
        super().__init__(config, mesh=mesh)
        trouble = per_turn_lib.per_turn_error(self.env)
        if trouble is not None:
            raise ConfigError(f"config.rollout.history='per_turn' is invalid: env "
                              f"{config.env.name!r}: {trouble}.")
        self.turns = self.env.max_turns
        self.sample_length = per_turn_lib.sample_length(self.env, self.window)
        if self.window.tokens and self.window.tokens < (
                per_turn_lib.first_observation_length(self.env)):
            raise ConfigError(
                f"config.rollout.history_window_tokens={self.window.tokens} is invalid: the "
                f"system prompt and the task alone take up to "
                f"{per_turn_lib.first_observation_length(self.env)} tokens")
        self.shared_prompt = dict(group_size=1, prompt_len=0)
        self.learner = dataclasses.replace(
            self.learner, context_length=self.sample_length,
            agent_token_bound=self.env.action_len, observation_token_bound=0,
            group_size=config.rollout.group_size * self.turns, prompt_len=0,
            reuse_activations=False)

    def rollout(self, policy_params, key, horizon) -> per_turn_lib.TurnSamples:
        c = self.config
        return per_turn_lib.per_turn_rollout(
            self.env, key, num_tasks=c.rollout.num_tasks, group_size=c.rollout.group_size,
            model=self.model, params=policy_params, sampling=self.sampling, horizon=horizon,
            env_params=self.task_params(c.rollout.num_tasks, c.rollout.group_size),
            window=self.window)

    def scripted_demonstrations(self, key, num_tasks: int, source: str, env_params=None):
        """(tokens, agent_mask), [N * max_turns, L]: the scripted episodes played per turn,
        each turn a sample (its context as rendered before it, and the turn), as RL trains
        them; turns an episode did not play have an empty mask."""
        demo = per_turn_lib.per_turn_rollout(
            self.env, key, num_tasks=num_tasks, group_size=1, action_source=source,
            env_params=env_params, window=self.window)
        return turn_rows(demo.tokens), turn_rows(demo.agent_mask)

    def learn(self, state: TrainState, samples: per_turn_lib.TurnSamples, keys: StepKeys,
              horizon, behaviour_params=None):
        del behaviour_params  # no Monte Carlo branching in this mode
        c = self.config
        batch_axes = sharding_lib.batch_sharding(self.mesh)
        samples = jax.lax.with_sharding_constraint(samples, batch_axes)
        num_groups = c.rollout.num_tasks
        scores = samples.episode_return
        metrics = {}
        stats = alg.group_statistics(scores, samples.group_ids, num_groups=num_groups)
        metrics["degenerate_group_fraction"] = stats.degenerate_fraction()
        metrics["within_group_reward_std"] = jnp.mean(stats.std)
        valid = jnp.ones(scores.shape, jnp.float32)
        if c.filters.starpo_keep_fraction < 1.0:
            valid = valid * alg.starpo_keep_mask(
                scores, samples.group_ids, num_groups=num_groups,
                keep_fraction=c.filters.starpo_keep_fraction).astype(jnp.float32)
        if c.filters.dapo_zero_variance:
            valid = valid * alg.dapo_zero_variance_mask(
                scores, samples.group_ids, num_groups=num_groups).astype(jnp.float32)
        metrics["kept_fraction"] = jnp.mean(valid)
        mask = samples.agent_mask * valid[:, None, None]
        old_values = returns = None
        if self.algorithm.credit == "gae":  # per turn: GAE over the episode's turns
            advantages, returns = turn_sample_gae(
                c.process.outcome_weight * samples.turn_rewards, samples.values,
                samples.context_length, samples.length, self.env.action_len,
                gamma=c.advantage.gamma, lam=c.advantage.lam,
                turn_level=c.advantage.turn_level, turn_gamma=c.advantage.turn_gamma)
            advantages, returns = turn_rows(advantages), turn_rows(returns)
            if c.advantage.whiten:
                advantages = alg.whiten(advantages, turn_rows(mask))
            old_values = (shift_right(turn_rows(samples.values)[:, :-1])
                          * turn_rows(samples.agent_mask))
        else:  # the episode's advantage on every turn
            outcome = algorithm_table.OutcomeBatch(
                scores=scores, group_ids=samples.group_ids, env_ids=samples.env_ids,
                valid=valid > 0, num_groups=num_groups, num_envs=self.num_envs)
            episode_adv = c.process.outcome_weight * self.algorithm.outcome_advantages(
                outcome, c.advantage)
            advantages = turn_rows(turn_advantages(episode_adv, mask))
        tokens, mask = turn_rows(samples.tokens), turn_rows(mask)
        advantages = advantages * mask
        old_logp = turn_rows(samples.behaviour_logp)
        ref_logp = None
        if self.uses_reference:
            ref_logp = jax.lax.stop_gradient(self.policy.score(
                self.layout.reference_params(state), tokens, **self.shared_prompt).logp)
        batch = UpdateBatch(tokens=tokens, mask=mask, old_logp=old_logp,
                            advantages=advantages, observation_mask=jnp.zeros_like(mask),
                            old_values=old_values, returns=returns, ref_logp=ref_logp)
        has_signal = jnp.any(advantages != 0)
        if not c.filters.skip_zero_advantage:
            has_signal = jnp.ones((), bool)
        faults = guards.rollout_faults(samples.turn_rewards, self.env_names,
                                       env_ids=samples.env_ids,
                                       tokens=samples.tokens.reshape(scores.shape[0], -1),
                                       vocab_size=self.model.config.vocab_size)
        if c.on_non_finite == "skip":
            has_signal = has_signal & guards.inputs_finite(faults)

        params, opt_state, update_metrics, faults = guards.guarded_update(
            lambda params, opt_state: self.learner.update(
                params, opt_state, batch, keys.update, state.step, state.base_params),
            has_signal, state.params, state.opt_state, faults, c.on_non_finite)
        metrics.update(faults)
        metrics.update(samples_metrics(samples, self.env_names))
        metrics.update(update_metrics)
        metrics["update_skipped"] = 1.0 - has_signal.astype(jnp.float32)
        metrics["horizon"] = horizon.astype(jnp.float32)
        new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                                  key=keys.next)
        return new_state, metrics

    # ------------------------------------------------------------------ evaluation
    @functools.cached_property
    def _evaluate_fn(self):
        c = self.config
        num_rows = c.rollout.num_tasks * c.rollout.group_size

        def evaluate(params, key, greedy):
            sampling = self.sampling.replace(greedy=greedy)
            with sharding_lib.activation_mesh(self.activation_mesh):
                samples = per_turn_lib.per_turn_rollout(
                    self.env, key, num_tasks=num_rows, group_size=1, model=self.model,
                    params=params, sampling=sampling,
                    env_params=self.task_params(num_rows, 1), window=self.window)
            return samples_metrics(samples, self.env_names), samples

        return jax.jit(evaluate, static_argnames=("greedy",))

    def evaluation_report(self, state: TrainState, key: jax.Array) -> EvaluationReport:
        """Greedy and sampled evaluation metrics, and the last turn of `TRANSCRIPT_ROWS`
        sampled episodes as the policy read and wrote it."""
        params = self.policy_params(state)
        greedy_key, sample_key = jax.random.split(key)
        greedy_metrics, _ = self.evaluate(params, greedy_key, greedy=True)
        sampled_metrics, samples = self.evaluate(params, sample_key, greedy=False)
        rows = jax.device_get(sharding_lib.gather_rows(samples, TRANSCRIPT_ROWS))
        shown = range(min(TRANSCRIPT_ROWS, rows.tokens.shape[0]))
        text = "\n\n".join(render_samples(self.env.codec, rows, row) for row in shown)
        metrics = {f"eval/{k}": v for k, v in greedy_metrics.items()}
        metrics.update({f"eval_sampled/{k}": v for k, v in sampled_metrics.items()})
        return EvaluationReport(metrics=metrics, transcript=text)
