"""The limits of one sandboxed Python call (`SandboxLimits`): what `run_python` enforces,
what a `code_interpreter` environment configures and a remote executor receives."""

from __future__ import annotations

import dataclasses

_MiB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one `run_python` call (defaults suit a code-interpreter tool call).

    wall_time_s: wall-clock seconds the program may run (from its start; the parent
      adds about 1 s of backstop). cpu_time_s: RLIMIT_CPU, whole seconds (rounded up;
      hard limit one second later). memory_bytes: RLIMIT_AS, address space of each
      process (the interpreter itself needs ~30 MiB). max_processes: RLIMIT_NPROC,
      processes plus threads, at least 2 (effective when run as root or in a user namespace; see
      the module docstring). max_file_bytes: RLIMIT_FSIZE, size of any file written.
      max_disk_bytes: size of the private working directory (tmpfs; with the mount
      namespace only). max_open_files: RLIMIT_NOFILE. max_output_bytes: bytes read
      from each of stdout and stderr; more kills the program (OUTPUT_LIMIT).
      max_observation_chars: length of `ExecutionResult.observation`, marker included.
      traceback_lines: how many final lines of stderr an error observation keeps
      (1: "ZeroDivisionError: division by zero"). max_code_chars: a longer program is
      not run (ERROR observation).
    """

    wall_time_s: float = 5.0
    cpu_time_s: float = 5.0
    memory_bytes: int = 512 * _MiB
    max_processes: int = 16
    max_file_bytes: int = 16 * _MiB
    max_disk_bytes: int = 32 * _MiB
    max_open_files: int = 64
    max_output_bytes: int = 1 * _MiB
    max_observation_chars: int = 2000
    traceback_lines: int = 1
    max_code_chars: int = 100_000

    def __post_init__(self):
        positive_numbers = ("wall_time_s", "cpu_time_s")
        positive_ints = ("memory_bytes", "max_processes", "max_file_bytes", "max_disk_bytes",
                         "max_open_files", "max_output_bytes", "max_observation_chars",
                         "traceback_lines", "max_code_chars")
        for name in positive_numbers:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 < value < float("inf")):
                raise ValueError(f"SandboxLimits.{name} must be a finite number > 0, "
                                 f"got {value!r}")
        for name in positive_ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be an int > 0, got {value!r}")
        if self.memory_bytes < 64 * _MiB:
            raise ValueError("SandboxLimits.memory_bytes must be at least 64 MiB (the "
                             f"interpreter needs ~30 MiB), got {self.memory_bytes}")
        if self.max_processes < 2:
            raise ValueError("SandboxLimits.max_processes must be at least 2 (the worker's "
                             "start takes a second thread for a moment), got "
                             f"{self.max_processes}")
        if self.max_open_files < 16:
            raise ValueError("SandboxLimits.max_open_files must be at least 16, got "
                             f"{self.max_open_files}")
        if self.max_observation_chars < 80:
            raise ValueError("SandboxLimits.max_observation_chars must be at least 80, "
                             f"got {self.max_observation_chars}")
