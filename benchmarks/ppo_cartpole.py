"""PPO on gymnax CartPole-v1: `arl.trainers.vector_ppo` against a PureJaxRL-style rlax program.

Both sides compile one training step (rollout of `num_steps` x `num_envs` transitions,
GAE, 4 epochs x 4 minibatches of clipped-PPO Adam updates) with the PureJaxRL CartPole
hyperparameters: gamma .99, lambda .95, clip .2 (policy and value), entropy .01, value
coefficient .5, learning rate 2.5e-4 decayed linearly to 0 over the same number of updates,
max grad norm .5, separate tanh 64x64 actor and critic torsos with orthogonal init.

The baseline below is written directly with gymnax + rlax + optax + flax, the way
PureJaxRL's `ppo.py` does it (Lu et al. 2022, arXiv 2210.01821). One documented semantic
difference: arl bootstraps truncated episodes (CartPole's 500-step limit) from the value
of the final observation, PureJaxRL treats truncation as termination.

Reported: environment steps per second of the compiled step (compile time apart) at
several numbers of parallel environments, the ratio arl / baseline measured in the same
run (interleaved median), and the learning curve of both at 4 envs (final return).

    python benchmarks/ppo_cartpole.py [--sizes 4:128,64:128,2048:16] [--curve-updates 400]
                                      [--repeats 5] [--no-write]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from typing import Any, NamedTuple

import flax.linen as nn
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import rlax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position

from arl import config as config_lib  # noqa: E402
from arl.trainers import VectorPPO  # noqa: E402

ENV_ID = "CartPole-v1"
HYPER = dict(lr=2.5e-4, gamma=0.99, lam=0.95, clip=0.2, ent_coef=0.01, vf_coef=0.5,
             max_grad_norm=0.5, epochs=4, minibatches=4, hidden=(64, 64))


# ----------------------------------------------------------------------------- arl side
def arl_config(num_envs: int, num_steps: int, num_updates: int):
    c = config_lib.default_config()
    c.algorithm = "ppo_vector"
    c.env.name = f"gymnax:{ENV_ID}"
    c.train_steps = num_updates
    c.vector.num_envs = num_envs
    c.vector.num_steps = num_steps
    c.vector.hidden_sizes = HYPER["hidden"]
    c.vector.activation = "tanh"
    c.updates.epochs = HYPER["epochs"]
    c.updates.minibatches = HYPER["minibatches"]
    c.advantage.gamma = HYPER["gamma"]
    c.advantage.lam = HYPER["lam"]
    c.loss.clip_low = c.loss.clip_high = HYPER["clip"]
    c.loss.value_clip = HYPER["clip"]
    c.loss.value_coef = HYPER["vf_coef"]
    c.loss.entropy_coef = HYPER["ent_coef"]
    c.optim.learning_rate = HYPER["lr"]
    c.optim.schedule = "linear"
    c.optim.max_grad_norm = HYPER["max_grad_norm"]
    return c


class ArlRunner:
    """arl.trainers.VectorPPO's compiled step (its per-minibatch diagnostics on, the
    default) behind the same `step()` face."""

    def __init__(self, num_envs, num_steps, num_updates):
        self.name = "arl"
        self.ppo = VectorPPO(arl_config(num_envs, num_steps, num_updates))
        self.state = self.ppo.init_state()
        self.compiled, self.compile_s = common.compile_jitted(self.ppo.train_step, self.state)

    def step(self):
        self.state, _ = self.compiled(self.state)
        return self.state


# ------------------------------------------------------------------ PureJaxRL baseline
class BaselineActorCritic(nn.Module):
    """PureJaxRL's ActorCritic: separate tanh torsos, orthogonal init, 0.01 policy head."""

    num_actions: int

    @nn.compact
    def __call__(self, x):
        dense = lambda n, g: nn.Dense(n, kernel_init=nn.initializers.orthogonal(g),  # noqa
                                      bias_init=nn.initializers.zeros)
        a = x
        for size in HYPER["hidden"]:
            a = nn.tanh(dense(size, math.sqrt(2))(a))
        logits = dense(self.num_actions, 0.01)(a)
        v = x
        for size in HYPER["hidden"]:
            v = nn.tanh(dense(size, math.sqrt(2))(v))
        return logits, dense(1, 1.0)(v)[..., 0]


class RunnerState(NamedTuple):
    params: Any
    opt_state: Any
    env_state: Any
    obs: jax.Array
    running_return: jax.Array
    last_return: jax.Array
    key: jax.Array


def make_baseline(num_envs: int, num_steps: int, num_updates: int):
    """(init(key) -> RunnerState, update(RunnerState) -> (RunnerState, episode_return)),
    the PureJaxRL update step with rlax's GAE, clipped surrogate and entropy."""
    env, env_params = gymnax.make(ENV_ID)
    network = BaselineActorCritic(env.action_space(env_params).n)
    h = HYPER
    batch_size = num_envs * num_steps
    mb_size = batch_size // h["minibatches"]
    schedule = optax.linear_schedule(h["lr"], 0.0, num_updates * h["epochs"] * h["minibatches"])
    tx = optax.chain(optax.clip_by_global_norm(h["max_grad_norm"]),
                     optax.adam(schedule, eps=1e-5))
    # GAE over time for one environment; vmapped over the environment axis (axis 1).
    gae = jax.vmap(rlax.truncated_generalized_advantage_estimation,
                   in_axes=(1, 1, None, 1), out_axes=1)

    def init(key):
        key, net_key, env_key = jax.random.split(key, 3)
        params = network.init(net_key, jnp.zeros(env.observation_space(env_params).shape))
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(env_key, num_envs), env_params)
        return RunnerState(params, tx.init(params), env_state, obs,
                           jnp.zeros(num_envs), jnp.zeros(()), key)

    def env_step(carry, key):
        params, env_state, obs, running = carry
        act_key, step_key = jax.random.split(key)
        logits, value = network.apply(params, obs)
        action = jax.random.categorical(act_key, logits)
        logp = jax.nn.log_softmax(logits)[jnp.arange(num_envs), action]
        obs, env_state, reward, terminated, truncated, _ = jax.vmap(
            env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(step_key, num_envs), env_state, action, env_params)
        done = (terminated | truncated).astype(jnp.float32)  # PureJaxRL: truncation = end
        running = running + reward
        finished = jnp.where(done, running, 0.0)
        running = jnp.where(done, 0.0, running)
        return (params, env_state, obs, running), (obs, action, logp, value, reward, done,
                                                   finished)

    def loss_fn(params, mb):
        obs, action, old_logp, old_value, adv, target = mb
        logits, value = network.apply(params, obs)
        logp = jax.nn.log_softmax(logits)[jnp.arange(obs.shape[0]), action]
        v_clipped = old_value + jnp.clip(value - old_value, -h["clip"], h["clip"])
        value_loss = 0.5 * jnp.mean(jnp.maximum(jnp.square(value - target),
                                                jnp.square(v_clipped - target)))
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        actor_loss = rlax.clipped_surrogate_pg_loss(jnp.exp(logp - old_logp), adv, h["clip"])
        entropy = jnp.mean(rlax.softmax().entropy(logits))
        return actor_loss + h["vf_coef"] * value_loss - h["ent_coef"] * entropy

    def update(runner: RunnerState):
        key, rollout_key, update_key = jax.random.split(runner.key, 3)
        (_, env_state, obs, running), traj = jax.lax.scan(
            env_step, (runner.params, runner.env_state, runner.obs, runner.running_return),
            jax.random.split(rollout_key, num_steps))
        obs_t, action, logp, value, reward, done, finished = traj
        # traj obs are the observations AFTER each step; the policy saw the one before.
        seen = jnp.concatenate([runner.obs[None], obs_t[:-1]], axis=0)
        _, last_value = network.apply(runner.params, obs)
        values = jnp.concatenate([value, last_value[None]], axis=0)
        advantages = gae(reward, h["gamma"] * (1.0 - done), h["lam"], values)
        targets = advantages + value
        flat = jax.tree.map(lambda x: x.reshape((batch_size,) + x.shape[2:]),
                            (seen, action, logp, value, advantages, targets))

        def epoch(carry, key):
            perm = jax.random.permutation(key, batch_size)
            mbs = jax.tree.map(
                lambda x: x[perm].reshape((h["minibatches"], mb_size) + x.shape[1:]), flat)

            def minibatch(carry, mb):
                params, opt_state = carry
                grads = jax.grad(loss_fn)(params, mb)
                updates, opt_state = tx.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), None

            return jax.lax.scan(minibatch, carry, mbs)[0], None

        (params, opt_state), _ = jax.lax.scan(
            epoch, (runner.params, runner.opt_state), jax.random.split(update_key, h["epochs"]))
        num_done = jnp.sum(done)
        ret = jnp.where(num_done > 0, jnp.sum(finished) / jnp.maximum(num_done, 1),
                        runner.last_return)
        return RunnerState(params, opt_state, env_state, obs, running, ret, key), ret

    return init, update


class BaselineRunner:
    name = "baseline"

    def __init__(self, num_envs, num_steps, num_updates):
        init, update = make_baseline(num_envs, num_steps, num_updates)
        self.state = jax.jit(init)(jax.random.key(0))
        self.compiled, self.compile_s = common.compile_jitted(
            jax.jit(update, donate_argnums=(0,)), self.state)

    def step(self):
        self.state, _ = self.compiled(self.state)
        return self.state


# ----------------------------------------------------------------------------- measure
def throughput(num_envs: int, num_steps: int, repeats: int, min_transitions: int = 32768):
    """Row of the throughput table for one size: rates, ratio, compile seconds. Each timed
    call runs enough updates to cover `min_transitions` env steps (at least 2), so small
    sizes are not timed on a few milliseconds of a loaded machine."""
    steps_per_call = max(2, min_transitions // (num_envs * num_steps))
    runners = [ArlRunner(num_envs, num_steps, 1000),
               BaselineRunner(num_envs, num_steps, 1000)]
    for r in runners:  # first executions (allocation, thread pool) outside the timing
        jax.block_until_ready(r.step())

    def run(r):
        def go():
            for _ in range(steps_per_call):
                r.step()
            jax.block_until_ready(r.state)
        return go

    t = common.interleaved_median_times({r.name: run(r) for r in runners}, repeats)
    per_step = {k: v / steps_per_call for k, v in t.items()}
    transitions = num_envs * num_steps
    return dict(num_envs=num_envs, num_steps=num_steps,
                arl_rate=transitions / per_step["arl"],
                base_rate=transitions / per_step["baseline"],
                arl_compile=runners[0].compile_s, base_compile=runners[-1].compile_s)


def learning_curves(num_updates: int, seeds: int, num_envs=4, num_steps=128):
    """Episode return after every update for both programs, [seeds, num_updates] each.

    The seeds run side by side in one `jax.vmap`-ed program per side (as PureJaxRL
    trains seeds), so many seeds cost little more than one on this CPU."""
    ppo = VectorPPO(arl_config(num_envs, num_steps, num_updates))
    arl_state = jax.tree.map(lambda *xs: jnp.stack(xs),
                             *[ppo.init_state(seed) for seed in range(seeds)])
    arl_step = jax.jit(jax.vmap(ppo.step),
                       donate_argnums=(0,))
    init, update = make_baseline(num_envs, num_steps, num_updates)
    base_state = jax.jit(jax.vmap(init))(jax.random.split(jax.random.key(0), seeds))
    base_step = jax.jit(jax.vmap(update), donate_argnums=(0,))
    curves = {"arl": [], "baseline": []}
    for _ in range(num_updates):
        arl_state, metrics = arl_step(arl_state)
        base_state, base_return = base_step(base_state)
        curves["arl"].append(metrics["episode_return"])
        curves["baseline"].append(base_return)
    return {k: np.asarray(jax.device_get(v)).T for k, v in curves.items()}


def plot_curves(curves, num_envs, num_steps, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, c in curves.items():
        steps = (np.arange(c.shape[1]) + 1) * num_envs * num_steps
        label = "arl.trainers.VectorPPO" if name == "arl" else "PureJaxRL-style (rlax+gymnax+optax)"
        ax.plot(steps, c.mean(0), label=label)
        ax.fill_between(steps, np.percentile(c, 25, 0), np.percentile(c, 75, 0), alpha=0.2)
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episode return")
    ax.set_title(f"PPO CartPole-v1, {num_envs} envs (mean, 25-75% over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def curve_summary(curves, num_updates, seeds, seconds, png) -> str:
    """Final return (last 10 updates) mean +- std over seeds, and when 500 is first hit."""
    parts = []
    for name, c in curves.items():
        final = c[:, -10:].mean(axis=1)
        hits = [int(np.argmax(row >= 500)) + 1 for row in c if np.any(row >= 500)]
        first = (f"median first 500-return update at env step {int(np.median(hits)) * 512:,}"
                 if hits else "no 500-return update")
        parts.append(f"{name} {final.mean():.1f} +- {final.std():.1f} ({len(hits)}/{seeds} "
                     f"seeds reach 500; {first})")
    return (f"Learning curve, 4 envs x 128 steps, {num_updates} updates "
            f"({num_updates * 512:,} env steps), {seeds} seeds vmapped ({seconds:.0f} s): "
            f"final return (mean of the last 10 updates; mean +- std over seeds): "
            f"{'; '.join(parts)}. Curve: `{os.path.basename(png)}`.\n")


def parse_sizes(text: str):
    sizes = []
    for item in text.split(","):
        envs, steps = item.split(":")
        sizes.append((int(envs), int(steps)))
    return sizes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="4:128,64:128,2048:16",
                        help="num_envs:num_steps pairs (PureJaxRL uses num_steps 128)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--curve-updates", type=int, default=400,
                        help="updates of the 4-env learning curve (x512 env steps); 0 skips")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)

    rows = []
    for num_envs, num_steps in parse_sizes(args.sizes):
        row = throughput(num_envs, num_steps, args.repeats)
        rows.append(row)
        print(f"envs {num_envs:5d} x {num_steps:3d}: arl {row['arl_rate']:12,.0f}  baseline "
              f"{row['base_rate']:12,.0f} steps/s  ratio "
              f"{row['arl_rate'] / row['base_rate']:.2f}  (compile {row['arl_compile']:.1f}s"
              f" / {row['base_compile']:.1f}s)", flush=True)
    table = common.markdown_table(
        ["parallel envs x steps", "arl env steps/s", "baseline env steps/s",
         "arl / baseline", "compile arl (s)", "compile baseline (s)"],
        [(f"{r['num_envs']} x {r['num_steps']}", common.fmt_rate(r["arl_rate"]),
          common.fmt_rate(r["base_rate"]), f"{r['arl_rate'] / r['base_rate']:.2f}x",
          f"{r['arl_compile']:.1f}", f"{r['base_compile']:.1f}") for r in rows])

    curve_text = ""
    if args.curve_updates > 0:
        start = time.perf_counter()
        curves = learning_curves(args.curve_updates, args.seeds)
        # --no-write leaves the recorded figure alone too.
        png = os.path.join(tempfile.gettempdir() if args.no_write else common.output_dir(),
                           "ppo_cartpole_curve.png")
        plot_curves(curves, 4, 128, png)
        curve_text = "\n" + curve_summary(curves, args.curve_updates, args.seeds,
                                           time.perf_counter() - start, png)
        print(curve_text)

    text = (common.heading("ppo_cartpole.py")

            + f"One compiled PPO update per call (rollout + GAE + 4 epochs x 4 minibatches), "
            f"state donated, median of {args.repeats} interleaved rounds after compilation; "
            f"same hyperparameters on both sides (PureJaxRL CartPole); arl logs its "
            f"per-minibatch diagnostics (`vector.diagnostics`, the default).\n\n{table}\n"
            f"{curve_text}")
    common.publish("PPO on CartPole-v1 (arl vs PureJaxRL-style rlax)", text, not args.no_write)
    return rows


if __name__ == "__main__":
    main()
