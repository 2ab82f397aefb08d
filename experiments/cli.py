"""What the command-line programs share: one-line errors for bad input, quiet logs.

    if __name__ == "__main__":
        cli.run(main)          # instead of absl's app.run(main)

Bad input ends the program with ONE line on stderr, ``<program>: error: <message>``,
and exit status 2 (`USAGE_ERROR`), never a traceback: an unknown or malformed flag, a
config file that cannot be loaded, a misspelt config key (``--config.trian_steps=10``:
the closest valid key is named), and every `arl.errors.ConfigError`, wherever it is
raised (`arl.config.validate`, environment and model construction, checkpoint import),
as well as `app.UsageError`. A bug in a config file's own code (a NameError in
`get_config`) still shows its traceback. A run ended on a fault it names
(`arl.errors.RunStopped`: a checkpoint that could not be written, a non-finite step, a
failing Python reward function with its function and row) is one line too, with exit
status 1 (`RUN_STOPPED`).

Logging: by default only `arl`'s and `experiments`' INFO lines are shown (start or
resume, warm start, one progress line every `log_every` steps with rate, ETA, reward and
success), plus every library's warnings and errors; the libraries' INFO chatter (orbax
logs each checkpoint save in detail, JAX its backend probes) is dropped. Passing
``--verbosity`` (``-v``), ``--alsologtostderr`` or ``--logtostderr`` shows everything
again.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, NoReturn

from absl import app, flags
from absl import logging as absl_logging

from arl.errors import ConfigError, RunStopped, one_line

USAGE_ERROR = 2  # exit status of every rejected input (as argparse and getopt tools use)
RUN_STOPPED = 1  # exit status of a run ended on a named fault (arl.errors.RunStopped)
_LOUD_FLAGS = ("verbosity", "alsologtostderr", "logtostderr")
_OWN_PACKAGES = ("arl", "experiments")


def program_name() -> str:
    """`experiments.train` under ``python -m``, else the script's file name."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None else os.path.basename(sys.argv[0] or "arl")


def fail(message, status: int = USAGE_ERROR) -> NoReturn:
    """Ends the program: one line on stderr, exit status `status`."""
    sys.stderr.write(f"{program_name()}: error: {one_line(message)}\n")
    sys.stderr.flush()
    sys.exit(status)


def parse_flags(argv: list[str], config_flag: str = "config") -> list[str]:
    """absl's flag parsing with every rejection as one line (`fail`)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        fail(error)
    except OSError as error:  # the config file could not be loaded (seen via an override)
        fail(f"--{config_flag}: {_load_failure(error)}")
    except (KeyError, AttributeError):
        # ml_collections could not apply an override: name the unknown key if one is.
        message = _unknown_override(argv, config_flag)
        if message is None:
            raise
        fail(message)


def _unknown_override(argv: list[str], config_flag: str) -> str | None:
    from arl import config as config_lib  # pylint: disable=g-import-not-at-top

    prefixes = (f"--{config_flag}.", f"-{config_flag}.")
    for arg in argv[1:]:
        if arg.startswith(prefixes):
            path = arg.split("=", 1)[0].split(".", 1)[1]
            try:
                config_lib.check_key_path(path)
            except ConfigError as error:
                return str(error)
    return None


def _load_failure(error: BaseException) -> str:
    """The last line of ml_collections' report (e.g. "[Errno 2] No such file ...")."""
    cause = error.__cause__ or error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return lines[-1] if lines else repr(cause)


def loaded_config(holder: flags.FlagHolder):
    """The value of a `config_flags.DEFINE_config_file` flag; a config file that could
    not be loaded (ml_collections defers that error to the first use) is a `fail`."""
    config = holder.value
    try:
        config.keys()
    except OSError as error:
        fail(f"--{holder.name}={flags.FLAGS[holder.name].config_filename!r} could not be "
             f"loaded: {_load_failure(error)}")
    return config


# Warnings orbax issues on every read-only open (how evaluation reads a run, possibly
# beside a live trainer): they describe the intended mode, not a problem.
_EXPECTED_WARNINGS = ("CheckpointManagerOptions.read_only=True",
                      "Given directory is read only")


class _OwnInfoOnly(logging.Filter):
    """Passes warnings and errors from everyone (but `_EXPECTED_WARNINGS`), and lower
    levels only from records logged by code under `roots` (absl routes every library's
    records to one handler, so the caller's file is what tells them apart)."""

    def __init__(self, roots: tuple[str, ...]):
        super().__init__()
        self._roots = roots

    def filter(self, record: logging.LogRecord) -> bool:
        if os.path.abspath(record.pathname).startswith(self._roots):
            return True
        if record.levelno == logging.WARNING and str(record.msg).startswith(
                _EXPECTED_WARNINGS):
            return False
        return record.levelno >= logging.WARNING


def quiet_library_logs() -> logging.Filter:
    """Installs `_OwnInfoOnly` for `arl` and `experiments` on absl's handler; returns it
    (remove it with `absl.logging.get_absl_handler().removeFilter(...)`)."""
    roots = []
    for name in _OWN_PACKAGES:
        module = sys.modules.get(name) or __import__(name)
        roots.append(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
    log_filter = _OwnInfoOnly(tuple(roots))
    absl_logging.get_absl_handler().addFilter(log_filter)
    return log_filter


def run(main: Callable[[list[str]], None], *, config_flag: str = "config") -> None:
    """`app.run(main)` with one-line errors (`parse_flags`, and `ConfigError` /
    `app.UsageError` raised by `main`) and quiet library logs unless a logging flag is
    given."""

    def checked_main(argv):
        if not any(name in flags.FLAGS and flags.FLAGS[name].present for name in _LOUD_FLAGS):
            quiet_library_logs()
        try:
            return main(argv)
        except (ConfigError, app.UsageError) as error:
            fail(error)
        except RunStopped as error:
            fail(error, RUN_STOPPED)

    app.run(checked_main, flags_parser=lambda argv: parse_flags(argv, config_flag))
