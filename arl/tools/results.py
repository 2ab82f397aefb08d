"""What every tool call returns, whichever executor ran it (the sandbox, a remote
executor, SQL, a host environment's own tool): how it ended (`Status`), the
`ExecutionResult` with the `observation` text a policy reads, and the helpers that
compose that text within a length (truncation, a status line after the output).

No subprocess machinery here: a tool or an environment imports these types without the
sandbox (`arl.tools.sandbox` is one executor that returns them).
"""

from __future__ import annotations

import dataclasses
import enum


class Status(str, enum.Enum):
    """How a call ended."""

    OK = "ok"                          # exit status 0
    ERROR = "error"                    # the program failed (exception, nonzero exit)
    TIMEOUT = "timeout"                # wall-time limit
    CPU_LIMIT = "cpu_limit"            # RLIMIT_CPU (SIGXCPU)
    MEMORY_LIMIT = "memory_limit"      # RLIMIT_AS (MemoryError)
    OUTPUT_LIMIT = "output_limit"      # more than max_output_bytes on stdout or stderr
    FILE_SIZE_LIMIT = "file_size_limit"  # RLIMIT_FSIZE or the working directory is full
    KILLED = "killed"                  # ended by another signal (e.g. SIGSEGV)
    INTERNAL_ERROR = "internal_error"  # the sandbox itself failed to run the call

    def __str__(self):
        return self.value


LIMIT_STATUSES = frozenset({Status.TIMEOUT, Status.CPU_LIMIT, Status.MEMORY_LIMIT,
                            Status.OUTPUT_LIMIT, Status.FILE_SIZE_LIMIT})



@dataclasses.dataclass(frozen=True)
class ExecutionResult:
    """What a tool call produced.

    observation: the text the policy reads (at most the limit's max_observation_chars).
    status: how it ended. stdout / stderr: decoded (UTF-8, errors replaced), at most
    max_output_bytes each. exit_code: the program's exit status (negative: killed by
    that signal; None: not known, e.g. killed by the wall-time limit). wall_time_s: time
    the call took in the parent. output_truncated: the observation or the captured
    output was cut.
    """

    observation: str
    status: Status
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    wall_time_s: float = 0.0
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def timed_out(self) -> bool:
        return self.status is Status.TIMEOUT

    @property
    def limit_exceeded(self) -> bool:
        return self.status in LIMIT_STATUSES


def internal_error_result(message: str, wall_time_s: float = 0.0) -> ExecutionResult:
    return ExecutionResult(observation=f"sandbox error: {message}",
                           status=Status.INTERNAL_ERROR, wall_time_s=wall_time_s)


TRUNCATION_MARKER = "[output truncated]"


def truncate_text(text: str, max_chars: int, marker: str = TRUNCATION_MARKER) -> tuple[str, bool]:
    """`text` cut to at most `max_chars` characters, ending in `marker` if cut."""
    if len(text) <= max_chars:
        return text, False
    keep = max(0, max_chars - len(marker) - 1)
    return text[:keep] + "\n" + marker if keep else marker[:max_chars], True


def compose_observation(body: str, status_line: str | None, max_chars: int) -> tuple[str, bool]:
    """`body` (program output) followed by `status_line`, within `max_chars`: the body is
    cut first (with the truncation marker) so that the status line always survives."""
    if not status_line:
        return truncate_text(body, max_chars)
    status_line = status_line[:max_chars]
    separator = "" if not body or body.endswith("\n") else "\n"
    budget = max_chars - len(status_line) - len(separator)
    if len(body) > budget:
        body, _ = truncate_text(body, max(budget - 1, 0))
        return (body + "\n" if body else "") + status_line, True
    return body + separator + status_line, False


def format_seconds(seconds: float) -> str:
    """1 -> "1.0", 0.25 -> "0.25": at least one decimal, no float noise."""
    return f"{seconds:.1f}" if round(seconds, 1) == seconds else f"{seconds:g}"
