"""Silences the stray tracebacks a failed checkpoint read leaves behind.

When orbax restores a checkpoint whose files are cut short, the first failed array read
ends its `asyncio` event loop while tensorstore still has reads of the same checkpoint
in flight; as each of those finishes, tensorstore's completion callback calls
`loop.call_soon_threadsafe` on the closed loop, and the `RuntimeError('Event loop is
closed')` it raises is reported through `sys.unraisablehook`, which prints a bare
traceback on stderr (in about 4 of 5 runs, depending on the timing), after arl's
one-line warning about the corrupt step. The failure itself is reported (and the step
skipped) by `arl.runs.checkpoint.Checkpointer`; these leftovers carry no information.

`quiet_closed_loop_callbacks()` installs, once per process, an unraisable hook that drops
exactly those reports (a RuntimeError "Event loop is closed" raised in
`call_soon_threadsafe`, with no object) and passes every other one to the hook it
replaced.
"""

from __future__ import annotations

import sys
import threading
import traceback

_LOCK = threading.Lock()
_INSTALLED = False


def is_closed_loop_callback(unraisable) -> bool:
    """Whether an unraisable report is a late callback into a closed asyncio loop."""
    error = unraisable.exc_value
    if unraisable.object is not None or not isinstance(error, RuntimeError) or \
            str(error) != "Event loop is closed":
        return False
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return any(frame.name == "call_soon_threadsafe" for frame in frames)


def quiet_closed_loop_callbacks() -> None:
    """Installs the hook (module docstring); idempotent."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        previous = sys.unraisablehook

        def hook(unraisable):
            if not is_closed_loop_callback(unraisable):
                previous(unraisable)

        sys.unraisablehook = hook
        _INSTALLED = True
