"""Stopping a run at a step boundary on SIGTERM or SIGINT, every process at one step.

    with preemption.StopSignals() as stop:
        for step in ...:
            ...                                  # the step, logged
            if stop.requested(step):             # checkpoint `step`, flush, then
                raise preemption.Preempted(...)  # the one line and the exit status

SIGTERM is what a preemptible TPU or GPU VM, Kubernetes and Slurm send before they
kill a job (after a grace period, with SIGKILL); SIGINT is Ctrl-C.

* One process: both set a flag that `requested` reads after each step. The handlers
  are installed only for the block (and only from the main thread); once one has fired
  the previous ones are back, so a second Ctrl-C interrupts at once (KeyboardInterrupt)
  and a second SIGTERM ends the process.
* Several processes (`jax.distributed`): JAX's preemption service catches SIGTERM on
  any process and the processes agree on the step to stop at
  (`jax.experimental.multihost_utils.reached_preemption_sync_point`, which `requested`
  calls at every step, as it requires); SIGINT is passed on to it as SIGTERM. With the
  service off (`jax_enable_preemption_service=False`) signals act as without this
  module.
"""

from __future__ import annotations

import signal
import threading

from absl import logging
import jax
from jax.experimental import multihost_utils

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The exit status of a run stopped by `signum`: 128 + its number (143 for SIGTERM,
    130 for SIGINT), what a shell reports for a process the signal ended, so
    schedulers and scripts that look for those read a preempted run as one."""
    return 128 + int(signum)


class Preempted(Exception):
    """A run stopped by a signal after a checkpoint of its last completed step was
    written and its logs flushed; `str()` is the one line that says so."""

    def __init__(self, signum: int, step: int, checkpoint_dir: str, saved: bool):
        self.signum, self.step = int(signum), int(step)
        self.exit_code = exit_code(signum)
        name = signal.Signals(signum).name
        where = (f"checkpoint {step} saved in {checkpoint_dir}" if saved else
                 "no step to save" if step == 0 else
                 f"checkpoint {step} was already in {checkpoint_dir}")
        super().__init__(f"stopped by {name} after step {step} ({where}); run the same "
                         f"command again to resume (exit status {self.exit_code})")


class StopSignals:
    """Context manager: SIGTERM and SIGINT ask the loop to stop (module docstring)."""

    def __init__(self):
        self.received: int | None = None  # the signal this process got, if any
        self._previous: dict[int, object] = {}
        self._multi = jax.process_count() > 1
        self._synced = self._multi and jax.config.jax_enable_preemption_service

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            logging.warning("Training outside the main thread: SIGTERM and SIGINT end "
                            "the run without a checkpoint of the last step.")
            return self
        if self._multi and not self._synced:
            logging.warning("jax_enable_preemption_service is off: SIGTERM and SIGINT "
                            "end the run without a checkpoint of the last step.")
            return self
        # Several processes: SIGTERM stays with JAX's preemption service.
        for signum in (signal.SIGINT,) if self._multi else _SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        del frame
        if self.received is None:
            self.received = signum
        self._restore()
        if self._multi:
            signal.raise_signal(signal.SIGTERM)  # to JAX's preemption notifier

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def requested(self, step: int) -> bool:
        """Whether the run stops after `step` (every process gets the same answer)."""
        if self._multi:
            return self._synced and multihost_utils.reached_preemption_sync_point(step)
        return self.received is not None

    @property
    def signum(self) -> int:
        """The signal to report: this process's, else SIGTERM (another process's
        preemption notice)."""
        return self.received if self.received is not None else signal.SIGTERM

    def __exit__(self, *exc_info) -> None:
        self._restore()
