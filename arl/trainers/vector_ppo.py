"""PPO for vector environments (gymnax adapter) as one compiled step, PureJaxRL-style.

    train_step(state) -> (state, metrics)

rollout: `lax.scan` over `num_steps` of a batch of `num_envs` auto-resetting environments
with an MLP actor-critic; signals: masked GAE with episode boundaries (terminated cuts
the trace, truncated bootstraps from the final observation's value); update: a scan over
epochs x minibatches of the clipped PPO objective. Environment state lives in the train
state, so consecutive steps continue the same episodes.

The update runs on ONE flat parameter vector (`jax.flatten_util.ravel_pytree`): the
gradient, the global-norm clip and Adam touch one [P] array per minibatch instead of one
small array per layer, so a small update launches a few large kernels instead of many
tiny ones (docs/performance.md, "Vector PPO"). The loss still sees the usual
parameter tree, and the train state keeps it; only the optimizer state is flat.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct
from jax.flatten_util import ravel_pytree

from arl import algorithm_table
from arl import algorithms as alg
from arl import config as config_lib
from arl import envs as envs_lib
from arl.errors import ConfigError
from arl.optim import make_optimizer, rl_updates
from arl.trainers import guards
from arl.trainers.protocol import EvaluationReport
from arl.trainers.update import scan_epochs
from arl.models.mlp import ActorCritic


@struct.dataclass
class VectorTrainState:
    params: Any
    opt_state: Any  # optimizer state of the raveled parameter vector (see module docstring)
    env_state: Any
    observation: jax.Array  # [num_envs, ...]
    running_return: jax.Array  # float32 [num_envs]: return of the current episodes
    last_episode_return: jax.Array  # float32 []: mean return of the last finished episodes
    step: jax.Array
    key: jax.Array


@struct.dataclass
class Transition:
    observation: jax.Array
    action: jax.Array
    logp: jax.Array
    value: jax.Array
    reward: jax.Array
    done: jax.Array
    truncated: jax.Array
    final_observation: jax.Array  # last observation of the step's episode (pre-reset)


class VectorPPO:
    """Static pieces and the jitted `train_step` of PPO on a (gymnax) vector env."""

    def __init__(self, config: ml_collections.ConfigDict):
        config_lib.validate(config, num_devices=jax.device_count())
        if algorithm_table.get_algorithm(config.algorithm).trainer != "vector":
            raise ConfigError(f"config.algorithm={config.algorithm!r} is not trained by "
                              "VectorPPO (use arl.trainers.build)")
        self.config = config
        v = config.vector
        self.env = envs_lib.AutoReset(envs_lib.make(config.env.name, **dict(config.env.kwargs)))
        self.env_params = self.env.default_params()
        space = self.env.action_space
        if not isinstance(space, envs_lib.Discrete):
            raise ValueError(f"config.env.name={config.env.name!r}: VectorPPO supports "
                             f"discrete action spaces, got {space!r}")
        self.model = ActorCritic(num_actions=space.n, hidden_sizes=tuple(v.hidden_sizes),
                                 activation=v.activation)
        self.critic = self.model.clone(value_only=True)
        self.optimizer = make_optimizer(config.optim, total_updates=rl_updates(config))
        self.batch_size = v.num_envs * v.num_steps
        self.train_step = jax.jit(self.step, donate_argnums=(0,))

    def init_state(self, seed: int | None = None) -> VectorTrainState:
        seed = self.config.seed if seed is None else seed
        n = self.config.vector.num_envs

        @jax.jit
        def init(key):
            init_key, env_key, key = jax.random.split(key, 3)
            env_state, ts = jax.vmap(self.env.reset, in_axes=(0, None))(
                jax.random.split(env_key, n), self.env_params)
            params = self.model.init(init_key, ts.observation[:1])["params"]
            return VectorTrainState(
                params=params, opt_state=self.optimizer.init(ravel_pytree(params)[0]),
                env_state=env_state,
                observation=ts.observation, running_return=jnp.zeros((n,), jnp.float32),
                last_episode_return=jnp.zeros((), jnp.float32),
                step=jnp.zeros((), jnp.int32), key=key)

        return init(jax.random.key(seed))

    def _policy(self, params, observation):
        return self.model.apply({"params": params}, observation)

    def _value(self, params, observation):
        return self.critic.apply({"params": params}, observation)

    def step(self, state: VectorTrainState):
        """One rollout + GAE + update, traced (`train_step` is its jitted, donating
        form; vmap it over states to train several seeds in one program)."""
        c = self.config
        n = c.vector.num_envs
        key, rollout_key, update_key = jax.random.split(state.key, 3)

        def env_step(carry, key):
            env_state, obs, running = carry
            act_key, step_key = jax.random.split(key)
            logits, value = self._policy(state.params, obs)
            action = jax.random.categorical(act_key, logits)
            logp = jnp.take_along_axis(
                jax.nn.log_softmax(logits), action[:, None], axis=-1)[:, 0]
            env_state, ts = jax.vmap(self.env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(step_key, n), env_state, action, self.env_params)
            running = running + ts.reward
            finished_return = jnp.where(ts.done, running, 0.0)
            running = jnp.where(ts.done, 0.0, running)
            transition = Transition(
                observation=obs, action=action, logp=logp, value=value, reward=ts.reward,
                done=ts.done, truncated=ts.truncated,
                final_observation=ts.info["final_observation"])
            return (env_state, ts.observation, running), (transition, finished_return)

        (env_state, obs, running), (traj, finished) = jax.lax.scan(
            env_step, (state.env_state, state.observation, state.running_return),
            jax.random.split(rollout_key, c.vector.num_steps))
        last_value = self._value(state.params, obs)
        # V(final observation) for truncation bootstraps: one batched [T, N] critic forward
        # after the scan (not a second forward inside every environment step), and only
        # when some episode was truncated (GAE reads it nowhere else).
        final_value = jax.lax.cond(
            jnp.any(traj.truncated),
            lambda: self._value(state.params, traj.final_observation),
            lambda: jnp.zeros_like(traj.value))

        # GAE kernels are batch-major [B, T]; the scan produced time-major [T, B].
        to_bt = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731
        advantages, returns = alg.gae(
            to_bt(traj.reward), to_bt(traj.value), jnp.ones((n, c.vector.num_steps), bool),
            gamma=c.advantage.gamma, lam=c.advantage.lam, bootstrap_value=last_value,
            dones=to_bt(traj.done), truncated=to_bt(traj.truncated),
            next_values=to_bt(final_value))
        batch = dict(
            observation=traj.observation.reshape((-1,) + traj.observation.shape[2:]),
            action=traj.action.reshape(-1), logp=traj.logp.reshape(-1),
            value=traj.value.reshape(-1), advantages=to_bt(advantages).reshape(-1),
            returns=to_bt(returns).reshape(-1))

        params, opt_state, metrics = self.update(state.params, state.opt_state, batch,
                                                  update_key)
        # For the host guard (arl.trainers.guards); the parameters' finiteness stands in
        # for the gradient norm, which only `vector.diagnostics` computes.
        faults = guards.rollout_faults(traj.reward.T, (c.env.name,))
        faults.update(guards.update_faults(nonfinite_loss=metrics["loss/total"],
                                           nonfinite_params=optax.global_norm(params)))
        if c.on_non_finite == "skip":
            bad = guards.update_failed(faults) | ~guards.inputs_finite(
                {k: v for k, v in faults.items() if guards.REWARDS in k})
            params, opt_state = guards.keep_unless(bad, (params, opt_state),
                                                   (state.params, state.opt_state))
        metrics.update(faults)
        num_finished = jnp.sum(traj.done)
        episode_return = jnp.where(num_finished > 0,
                                   jnp.sum(finished) / jnp.maximum(num_finished, 1),
                                   state.last_episode_return)
        metrics.update(episode_return=episode_return,
                       episodes_finished=num_finished.astype(jnp.float32),
                       env_steps=(state.step + 1).astype(jnp.float32) * self.batch_size)
        new_state = state.replace(
            params=params, opt_state=opt_state, env_state=env_state, observation=obs,
            running_return=running, last_episode_return=episode_return,
            step=state.step + 1, key=key)
        return new_state, metrics

    def loss(self, params, mb):
        """(total, metrics) of the clipped PPO objective on one minibatch."""
        c = self.config
        logits, values = self._policy(params, mb["observation"])
        logp = jnp.take_along_axis(
            jax.nn.log_softmax(logits), mb["action"][:, None], axis=-1)[:, 0]
        adv = mb["advantages"]
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        ones = jnp.ones((adv.shape[0], 1), jnp.float32)
        clips = algorithm_table.get_policy_loss("ppo").clips(c.loss)  # 0: ppo's default
        pg, pg_metrics = alg.policy_loss(
            logp[:, None], mb["logp"][:, None], adv[:, None], ones,
            clip_low=clips.clip_low, clip_high=clips.clip_high)
        vl, v_metrics = alg.value_loss(
            values[:, None], mb["value"][:, None], mb["returns"][:, None], ones,
            clip=c.loss.value_clip or None)
        ent = jnp.mean(alg.entropy(logits))
        total = pg + c.loss.value_coef * vl - c.loss.entropy_coef * ent
        metrics = {"loss/policy": pg, "loss/value": vl, "entropy": ent, "loss/total": total}
        if c.vector.diagnostics:
            metrics.update({f"policy/{k}": v for k, v in pg_metrics.items()})
            metrics.update({f"value/{k}": v for k, v in v_metrics.items()})
        return total, metrics

    def update(self, params, opt_state, batch, key):
        """Epochs x minibatches of optimizer steps on the raveled parameter vector."""
        c = self.config
        num_mb = c.updates.minibatches
        mb_size = self.batch_size // num_mb
        flat_params, unravel = ravel_pytree(params)
        flat_loss = lambda flat, mb: self.loss(unravel(flat), mb)  # noqa: E731
        grad_fn = jax.grad(flat_loss, has_aux=True)
        first_minibatch = jax.tree.map(lambda x: x[:mb_size], batch)
        names = sorted(jax.eval_shape(flat_loss, flat_params, first_minibatch)[1])
        if c.vector.diagnostics:
            names = sorted(names + ["grad_norm"])

        def deal(epoch_key):
            perm = jax.random.permutation(epoch_key, self.batch_size)
            return jax.tree.map(
                lambda x: x[perm].reshape((num_mb, mb_size) + x.shape[1:]), batch)

        # One [M] vector per minibatch instead of M scalar outputs: fewer operations per
        # iteration, which is what a small update costs on CPU.
        (flat_params, opt_state), packed = scan_epochs(
            grad_fn, self.optimizer, flat_params, opt_state, deal, key, c.updates.epochs,
            grad_norm=c.vector.diagnostics,
            pack=lambda metrics: jnp.stack([metrics[k].astype(jnp.float32) for k in names]))
        means = jnp.mean(packed, axis=(0, 1))
        return unravel(flat_params), opt_state, {k: means[i] for i, k in enumerate(names)}

    def policy_params(self, state: VectorTrainState):
        return state.params

    def warm_start(self, state: VectorTrainState, *, log=None) -> VectorTrainState:
        """Vector environments have no demonstrations: the start state is `state`."""
        del log
        return state

    def evaluation_report(self, state: VectorTrainState, key: jax.Array) -> EvaluationReport:
        """`eval/episode_return`: the mean return of greedy episodes on fresh envs."""
        return EvaluationReport(
            metrics={"eval/episode_return": self.evaluate(state.params, key)})

    def abstract_state(self) -> VectorTrainState:
        """Shapes, dtypes and shardings of the state (orbax restore target): the traced
        init, no compilation and no allocation."""
        return jax.eval_shape(self.init_state)

    def evaluate(self, params, key, *, num_envs: int = 32, max_steps: int = 500,
                 greedy: bool = True) -> jax.Array:
        """Mean undiscounted return of `num_envs` fresh episodes (at most `max_steps`)."""
        return self._evaluate_fn(num_envs, max_steps, greedy)(params, key)

    @functools.lru_cache(maxsize=None)
    def _evaluate_fn(self, num_envs, max_steps, greedy):
        env = self.env.env  # without auto-reset: finished episodes stay finished

        @jax.jit
        def evaluate(params, key):
            reset_key, key = jax.random.split(key)
            state, ts = jax.vmap(env.reset, in_axes=(0, None))(
                jax.random.split(reset_key, num_envs), self.env_params)

            def step(carry, key):
                state, obs, total = carry
                act_key, step_key = jax.random.split(key)
                logits, _ = self._policy(params, obs)
                action = (jnp.argmax(logits, -1) if greedy
                          else jax.random.categorical(act_key, logits))
                state, ts = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                    jax.random.split(step_key, num_envs), state, action, self.env_params)
                return (state, ts.observation, total + ts.reward), None

            (_, _, total), _ = jax.lax.scan(
                step, (state, ts.observation, jnp.zeros((num_envs,), jnp.float32)),
                jax.random.split(key, max_steps))
            return jnp.mean(total)

        return evaluate
