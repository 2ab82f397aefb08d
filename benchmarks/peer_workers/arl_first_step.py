"""arl's side of `benchmarks/peers.py`'s first-step phase (runs in arl's own Python).

    python arl_first_step.py --setting '<Setting json>' --checkpoint DIR

A fresh process does what a notebook user does: its first cell imports arl (through
`peers`, which defines the single-turn environment and `arl_config`) and calls
`arl.setup()` (counted with the imports); then it builds
`TokenTrainer(peers.arl_config(setting, checkpoint))`, `init_state()`, runs one
`train_step` (compiled at that call, as a user gets it) and reads its reward on the
host; then it sends "ready" (`protocol.py`) and waits for "quit". The driver times the
process from outside (launch to the "ready" line); the line carries the process's phases
(`first_step.Timeline`: wall seconds per phase, and the seconds JAX spent tracing,
lowering and compiling or loading from the persistent cache in each) for the details.
The driver points arl's compilation cache (ARL_COMPILATION_CACHE) at a directory of its
choice; `arl.setup()` turns it on there, as in a user's notebook.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

_START = time.time()  # the phases begin here; the driver attributes what came before
BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH_DIR)
import first_step  # noqa: E402  pylint: disable=wrong-import-position  (standard library only)
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position


def main():
    timeline = first_step.Timeline(_START)  # its phase now: "imports"
    args = protocol.worker_arguments()
    channel = protocol.Channel()
    try:
        setting = protocol.Setting.from_json(args.setting)
        import jax  # pylint: disable=import-outside-toplevel
        import peers  # pylint: disable=import-outside-toplevel
        import arl  # pylint: disable=import-outside-toplevel
        from arl.trainers import TokenTrainer  # pylint: disable=import-outside-toplevel

        arl.setup()  # the notebook's documented first cell
        timeline.listen()
        timeline.enter("build trainer")
        trainer = TokenTrainer(peers.arl_config(setting, args.checkpoint))
        timeline.enter("init state")
        state = jax.block_until_ready(trainer.init_state())
        timeline.enter("first step")
        started = time.perf_counter()
        state, metrics = trainer.train_step(state)
        jax.block_until_ready(state)
        reward_mean = float(metrics["reward_mean"])
        first_step_s = time.perf_counter() - started
        timeline.finish()
        phases = timeline.report()
        phases.pop("python start", None)  # ~0 here: the driver measures the process's start
        channel.send("ready", first_step_s=first_step_s, reward_mean=reward_mean,
                     phases=phases)
        channel.next_command()  # "quit" (or the driver's end)
        channel.send("bye")
    except Exception as e:  # noqa: BLE001 - reported to the driver, which carries on
        traceback.print_exc()
        channel.send("error", message=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        sys.exit(1)


if __name__ == "__main__":
    main()
