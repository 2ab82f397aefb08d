"""A tiny deterministic training program for the SIGKILL resume test.

    python tests/checkpoint_resume_program.py WORKDIR --steps=12 --save_every=4 \
        [--kill_after=6] --final=FINAL.npz

Adam on a two-layer MLP regression; every step draws its minibatch from the typed
key in the state and adds input noise from the raw ``uint32`` key, so both keys
must round-trip for the run to be reproducible. Each step's loss goes to
``WORKDIR/metrics.jsonl`` (via `MetricsWriter`); checkpoints to
``WORKDIR/checkpoints``. With ``--kill_after=K`` the process sends itself SIGKILL
right after logging step K (no cleanup, no flush beyond what the writers did).
On start it resumes from the latest good checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from arl.runs import checkpoint as checkpoint_lib
from arl.runs import writers as writers_lib

BATCH, IN_DIM, HIDDEN = 16, 3, 8


@struct.dataclass
class TrainState:
    params: dict
    opt_state: optax.OptState
    step: jax.Array
    key: jax.Array  # typed key: jax.random.key
    noise_key: jax.Array  # raw uint32 key: jax.random.PRNGKey


OPTIMIZER = optax.adam(3e-2)


@functools.partial(jax.jit, static_argnums=0)
def init_state(seed: int) -> TrainState:
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "w1": jax.random.normal(k1, (IN_DIM, HIDDEN)) / np.sqrt(IN_DIM),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, 1)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros(1),
    }
    return TrainState(
        params=params,
        opt_state=OPTIMIZER.init(params),
        step=jnp.zeros((), jnp.int32),
        key=jax.random.key(seed + 1),
        noise_key=jax.random.PRNGKey(seed + 2),
    )


def _loss(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    prediction = (hidden @ params["w2"] + params["b2"])[:, 0]
    return jnp.mean((prediction - y) ** 2)


@jax.jit
def train_step(state: TrainState) -> tuple[TrainState, jax.Array]:
    key, batch_key = jax.random.split(state.key)
    noise_key, input_noise_key = jax.random.split(state.noise_key)
    x = jax.random.normal(batch_key, (BATCH, IN_DIM))
    y = jnp.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2]
    x = x + 0.01 * jax.random.normal(input_noise_key, x.shape)
    loss, grads = jax.value_and_grad(_loss)(state.params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return (
        TrainState(params, opt_state, state.step + 1, key, noise_key),
        loss,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save_every", type=int, required=True)
    parser.add_argument("--kill_after", type=int, default=-1)
    parser.add_argument("--final", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    state = init_state(args.seed)
    with checkpoint_lib.Checkpointer(
        os.path.join(args.workdir, "checkpoints"), max_to_keep=2, save_every=args.save_every
    ) as checkpointer:
        restored = checkpointer.restore_latest(checkpoint_lib.abstract_state(state))
        start = 0
        if restored is not None:
            start, state, metadata = restored
            assert metadata["seed"] == args.seed and metadata["step"] == start, metadata
            assert jax.dtypes.issubdtype(state.key.dtype, jax.dtypes.prng_key), state.key
            assert state.noise_key.dtype == jnp.uint32, state.noise_key
            assert int(state.step) == start, state.step
            print(f"resumed from step {start}", flush=True)
        with writers_lib.MetricsWriter(
            args.workdir, tensorboard=False, resume_step=start or None
        ) as writer:
            for step in range(start + 1, args.steps + 1):
                state, loss = train_step(state)
                writer.write(step, {"loss": loss})
                writer.flush()
                checkpointer.save(step, state, metadata={"seed": args.seed, "step": step})
                if step == args.kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
        checkpointer.save(args.steps, state, metadata={"seed": args.seed, "step": args.steps},
                          force=True)
    leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
    np.savez(
        args.final,
        step=np.asarray(state.step),
        key_data=np.asarray(jax.random.key_data(state.key)),
        noise_key=np.asarray(state.noise_key),
        **{jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves},
    )


if __name__ == "__main__":
    main()
