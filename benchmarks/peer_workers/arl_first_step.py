"""arl's side of `benchmarks/peers.py`'s first-step phase (runs in arl's own Python).

    python arl_first_step.py --setting '<Setting json>' --checkpoint DIR

A fresh process does what a notebook user does (`harness.notebook_first_step`: imports
arl and calls `arl.setup()`, counted with the imports; builds
`TokenTrainer(arl_config(setting, checkpoint))`, `init_state()`, runs one `train_step`
compiled at that call and reads its reward on the host); then it sends "ready"
(`protocol.py`) and waits for "quit". The driver times the process from outside (launch
to the "ready" line); the line carries the process's phases (`harness.Timeline`) for the
details. The driver points arl's compilation cache (ARL_COMPILATION_CACHE) at a
directory of its choice; `arl.setup()` turns it on there, as in a user's notebook.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

_START = time.time()  # the phases begin here; the driver attributes what came before
BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH_DIR)
import harness  # noqa: E402  pylint: disable=wrong-import-position  (standard library only)
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position


def main():
    timeline = harness.Timeline(_START)  # its phase now: "imports"
    args = protocol.worker_arguments()
    channel = protocol.Channel()
    try:
        setting = protocol.Setting.from_json(args.setting)
        first_step_s, reward_mean = harness.notebook_first_step(
            timeline, setting, args.checkpoint, config_phase="build trainer")
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
