"""`code_interpreter`: answer a question that needs computation, with a Python tool.

Prompt: a question whose answer is beyond the mental arithmetic of a small model, from
one of these families (`FAMILIES`; the answer is computed in plain Python, by a closed
form where there is one, not by the reference program):

    squares    "sum of squares 1..37"            sum(i*i for i in range(1,37+1))  17575
    cubes      "sum of cubes 1..24"              sum(i**3 for i in range(1,24+1)) 90000
    multiples  "sum of multiples of 7 below 500" sum(range(0,500,7))               17885
    digits     "digit sum of 2**150"             sum(map(int,str(2**150)))         181
    product    "product 123*456*789"             123*456*789                 44253432

Turns (`arl.envs.tool_use`): "<py>CODE</py>" runs CODE as a notebook cell in the sandbox
(`arl.tools.run_python` with every layer the machine allows, or the `executor` given):
statements run in order, and
the value of a final expression is printed as a REPL prints it, so
"<py>sum(i*i for i in range(1,37+1))</py>" replies "17575"; an error replies the
traceback's last line ("NameError: name 'x' is not defined"), a limit its status line
("timeout after 2.0 s"); "<answer>N</answer>" ends the episode ("correct" / "wrong").
Replies are cut to `obs_len` tokens (ending in ".."). With `final_output=True` the
episode is one turn: the cell's output is the answer.

The demonstrator is weaker than the oracle in two ways: with probability `skip_tool` it
answers a guess without running code (a rounded estimate within 30 % of the answer,
never the answer), and with probability `buggy_program` its program has a bug (an
off-by-one range, a forgotten step, `*` for `**`, `+` for `*`) whose output it then
answers. Expected success (1 - skip_tool) * (1 - buggy_program): 0.56 at the defaults.

Characters: the built-in `CharCodec` has no brackets, so the reference programs use
none; a reply character the codec lacks is written "?".
"""

from __future__ import annotations

import dataclasses
import logging
import random

from arl.text.codec import CharCodec, Codec
from arl.envs.tool_use import ToolEnvironment, ToolTask
from arl.tools.executor import HttpExecutor, LocalSandbox, PythonExecutor
from arl.tools.limits import SandboxLimits
from arl.tools.results import ExecutionResult

_MiB = 2 ** 20
_log = logging.getLogger(__name__)
_reported: set[str] = set()  # the executor line is logged once per process, not per env

# A notebook cell: run the statements, print the repr of a final expression (not None).
_CELL = '''import ast as _ast
_ns = {{"__name__": "__main__"}}
_tree = _ast.parse({source!r}, "<cell>")
_last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], _ast.Expr) else None
exec(compile(_tree, "<cell>", "exec"), _ns)
if _last is not None:
    _value = eval(compile(_ast.Expression(_last.value), "<cell>", "eval"), _ns)
    if _value is not None:
        print(repr(_value))
'''


def notebook_cell(source: str) -> str:
    """The program `run_python` runs for the cell `source` (module docstring)."""
    return _CELL.format(source=source)


def _squares(rng):
    n = rng.randint(10, 99)
    return (f"sum of squares 1..{n}", f"sum(i*i for i in range(1,{n}+1))",
            f"sum(i*i for i in range(1,{n}))", n * (n + 1) * (2 * n + 1) // 6)


def _cubes(rng):
    n = rng.randint(10, 99)
    return (f"sum of cubes 1..{n}", f"sum(i**3 for i in range(1,{n}+1))",
            f"sum(i**3 for i in range(1,{n}))", (n * (n + 1) // 2) ** 2)


def _multiples(rng):
    k, n = rng.randint(3, 9), rng.randint(100, 999)
    m = (n - 1) // k
    return (f"sum of multiples of {k} below {n}", f"sum(range(0,{n},{k}))",
            f"sum(range({k},{n}))", k * m * (m + 1) // 2)


def _digits(rng):
    n = rng.randint(20, 199)
    return (f"digit sum of 2**{n}", f"sum(map(int,str(2**{n})))",
            f"sum(map(int,str(2*{n})))", sum(int(d) for d in str(pow(2, n))))


def _product(rng):
    a, b, c = (rng.randint(100, 999) for _ in range(3))
    return f"product {a}*{b}*{c}", f"{a}*{b}*{c}", f"{a}*{b}+{c}", a * b * c


@dataclasses.dataclass(frozen=True)
class CodeTask(ToolTask):
    """A `ToolTask` with the demonstrator's buggy twin of the reference program."""

    buggy: str = ""


FAMILIES = {"squares": _squares, "cubes": _cubes, "multiples": _multiples,
            "digits": _digits, "product": _product}


class CodeInterpreter(ToolEnvironment):
    """Questions that need computation, answered with a sandboxed Python tool.

    Args (see also `arl.envs.tool_use.ToolEnvironment`):
      codec: default `CharCodec()`.
      max_turns: default 2 (the oracle's: one cell, one answer).
      families: which task families (`FAMILIES`) to draw from, uniformly.
      obs_len: reply tokens (outputs and one-line errors; longer ones are cut).
      action_len: tokens per agent turn (the longest reference turn needs 42).
      wall_time_s, cpu_time_s, memory_mb: the sandbox's limits per cell (the CPU
        limit above the wall limit: a runaway single-threaded cell then always reads
        "timeout after 2.0 s", whatever the machine's load, so runs replay exactly).
      skip_tool, buggy_program: the demonstrator's weaknesses (module docstring).
      final_output: one turn; the cell's output is the answer.
      executor: where cells run (`arl.tools.executor.PythonExecutor`; default the local
        sandbox, `LocalSandbox()`); executor_url: shorthand for
        `HttpExecutor(executor_url)` (config: `env.kwargs.executor_url`).
      allow_weak_sandbox: with the local sandbox, run even where the kernel layers
        (minimal root, seccomp, network and PID namespaces) are unavailable; otherwise
        such a machine is refused with one line at construction.
      tool_format: "tags" (`<py>...</py>`) or "template": the checkpoint's own tool
        convention with the declared tool `run_python(code: str)`, several calls per turn
        where the template renders them (`arl.envs.tool_use`).
      max_invalid_calls, max_calls_per_turn: "template" only: invalid turns in a row
        that end the episode (0: never) and calls one turn may hold
        (`arl.envs.tool_calling`).
    """

    name = "code_interpreter"
    tool_tag = "py"
    tool_function = ("run_python", "Runs a Python cell and returns what it prints; the "
                     "value of a final expression is printed.", "code", "The cell's source.")

    def __init__(self, codec: Codec | None = None, max_turns: int = 2,
                 families: tuple[str, ...] = tuple(FAMILIES), obs_len: int = 24,
                 action_len: int = 44, wall_time_s: float = 2.0, cpu_time_s: float = 3.0,
                 memory_mb: int = 256, skip_tool: float = 0.3, buggy_program: float = 0.2,
                 final_output: bool = False, cache_size: int = 16384,
                 max_workers: int | None = None, step_timeout_s: float | None = 30.0,
                 executor: PythonExecutor | None = None, executor_url: str = "",
                 allow_weak_sandbox: bool = False, tool_format: str = "tags",
                 max_invalid_calls: int = 0, max_calls_per_turn: int | None = None):
        families = tuple(families)
        unknown = [f for f in families if f not in FAMILIES]
        if not families or unknown:
            raise ValueError(f"families must be a non-empty subset of {tuple(FAMILIES)}, "
                             f"got {families!r}")
        if not 0.0 <= buggy_program <= 1.0:
            raise ValueError(f"buggy_program must be in [0, 1], got {buggy_program!r}")
        super().__init__(codec=codec or CharCodec(), max_turns=max_turns, prompt_len=32,
                         obs_len=obs_len, action_len=action_len, final_output=final_output,
                         skip_tool=skip_tool, cache_size=cache_size,
                         max_workers=max_workers, step_timeout_s=step_timeout_s,
                         tool_format=tool_format, max_invalid_calls=max_invalid_calls,
                         max_calls_per_turn=max_calls_per_turn)
        self.families = families
        self.buggy_program = float(buggy_program)
        self.limits = SandboxLimits(wall_time_s=wall_time_s, cpu_time_s=cpu_time_s,
                                    memory_bytes=int(memory_mb) * _MiB,
                                    max_observation_chars=max(4 * obs_len, 80),
                                    max_output_bytes=64 * 1024)
        self.executor = _choose_executor(executor, executor_url, allow_weak_sandbox)

    def make_task(self, seed: int, params) -> CodeTask:
        del params
        rng = random.Random(seed)
        family = self.families[rng.randrange(len(self.families))]
        prompt, solution, buggy, answer = FAMILIES[family](rng)
        return CodeTask(prompt=prompt, answer=str(answer), solution=solution, buggy=buggy)

    def run_tool(self, task: ToolTask, source: str) -> ExecutionResult:
        del task
        return self.executor(notebook_cell(source), self.limits)

    def guess(self, task: ToolTask, rng: random.Random) -> str:
        """A mental estimate: within 30 % of the answer, rounded to two significant
        digits, never the answer itself."""
        answer = int(task.answer)
        estimate = answer * (1.0 + rng.uniform(-0.3, 0.3))
        digits = max(len(str(abs(int(estimate)))) - 2, 0)
        value = int(round(estimate, -digits))
        return str(value if value != answer else answer + 1)

    def demonstrator_input(self, task: ToolTask, rng: random.Random) -> str:
        """The reference program, or with probability `buggy_program` its buggy twin."""
        return task.buggy if rng.random() < self.buggy_program else task.solution


def _choose_executor(executor, executor_url, allow_weak_sandbox) -> PythonExecutor:
    """The executor, after the one-line report of where cells run (module docstring)."""
    if not isinstance(allow_weak_sandbox, bool):
        raise ValueError(f"allow_weak_sandbox must be True or False, got {allow_weak_sandbox!r}")
    if executor is not None and executor_url:
        raise ValueError("give executor or executor_url, not both")
    if executor_url:
        executor = HttpExecutor(executor_url)
    if executor is None:
        executor = LocalSandbox()
        if not executor.kernel_boundary:
            if not allow_weak_sandbox:
                raise ValueError(
                    f"code_interpreter: the kernel sandbox layers are unavailable here "
                    f"({executor.describe()}); set env.kwargs.allow_weak_sandbox=True to run "
                    f"with this weaker isolation, or env.kwargs.executor_url to use a "
                    f"sandbox service")
            _report(logging.WARNING, "code_interpreter: WEAKER SANDBOX (allowed): "
                    + executor.describe())
            return executor
    if not callable(executor):
        raise ValueError(f"executor must be callable (code, limits) -> ExecutionResult, got "
                         f"{type(executor).__name__}")
    describe = getattr(executor, "describe", None)
    _report(logging.INFO, "code_interpreter: cells run in "
            + (describe() if callable(describe) else type(executor).__name__))
    return executor


def _report(level: int, line: str) -> None:
    if line not in _reported:
        _reported.add(line)
        _log.log(level, "%s", line)
