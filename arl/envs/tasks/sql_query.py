"""`sql`: answer a question about a small company database by querying it.

Every task has its own generated SQLite database (`arl.tools.random_company_database`:
`departments(name, floor)`, `employees(id, name, dept, salary, hire_year)`,
`orders(id, employee_id, amount, year)`) and a templated question whose answer is
computed in plain Python from the rows (`arl.tools.make_sql_task`; the style of Spider,
Yu et al. 2018, and of AgentBench's database tasks, Liu et al. 2023). The schema is the
same for every task, so the prompt is the question alone:

    prompt  How many employees work in the sales department?
    agent   <sql>SELECT COUNT(*) FROM employees WHERE dept = 'sales'</sql>
    env     COUNT(*)
            3
    agent   <answer>3</answer>
    env     correct

Turns (`arl.envs.tool_use`): "<sql>QUERY</sql>" runs one read-only statement
(`arl.tools.run_sql`: SELECT / WITH / VALUES only, an authorizer, time and VM-step
budgets) and replies the rows (a header, then one line per row, cells joined by " | ")
or "error: ..."; "<answer>TEXT</answer>" ends the episode, compared with
`arl.tools.answers_match` (case, whitespace, quotes and number formatting ignored).

The demonstrator skips the query with probability `skip_tool` and answers a guess (an
estimate within 30 % for a number, another name for a name); otherwise it runs the
reference query and answers its result.
"""

from __future__ import annotations

import random
import threading

from arl.text.codec import CharCodec, Codec
from arl.envs.tool_use import ToolEnvironment, ToolTask, parse_int
from arl.tools.results import ExecutionResult
from arl.tools.sql import (DEPARTMENTS, FIRST_NAMES, SqlLimits, answers_match,
                           make_sql_task, run_sql)


class LazyDatabase:
    """A generated database whose SQLite bytes are built on first use (about 2 ms: only
    episodes that query pay for it), once."""

    def __init__(self, database):
        self.database = database
        self._bytes = None
        self._lock = threading.Lock()

    def to_bytes(self) -> bytes:
        with self._lock:
            if self._bytes is None:
                self._bytes = self.database.to_bytes()
            return self._bytes


def single_cell(result: ExecutionResult) -> str | None:
    """The one cell of a one-row, one-column result, or None."""
    if not result.ok:
        return None
    lines = result.stdout.split("\n")
    if len(lines) != 2 or " | " in lines[0]:
        return None
    return lines[1]


class SqlQuery(ToolEnvironment):
    """Questions about a generated database, answered with a read-only SQL tool.

    Args (see also `arl.envs.tool_use.ToolEnvironment`):
      codec: default `CharCodec()`.
      max_turns: default 2 (one query, one answer).
      obs_len, action_len: reply and turn budgets in tokens (the longest reference
        turn needs 145).
      num_employees, num_orders: database size (`random_company_database`).
      time_s, max_rows: `arl.tools.SqlLimits` of each query.
      tool_format: "tags" (`<sql>...</sql>`) or "template": the checkpoint's own tool
        convention with the declared tool `run_sql(query: str)`, several calls per turn
        where the template renders them (`arl.envs.tool_use`).
      max_invalid_calls, max_calls_per_turn: "template" only: invalid turns in a row
        that end the episode (0: never) and calls one turn may hold
        (`arl.envs.tool_calling`).
    """

    name = "sql"
    tool_tag = "sql"
    tool_function = ("run_sql", "Runs a read-only SQLite query on the company database and "
                     "returns the rows.", "query", "One SELECT statement.")

    def __init__(self, codec: Codec | None = None, max_turns: int = 2, obs_len: int = 48,
                 action_len: int = 148, num_employees: int = 12, num_orders: int = 30,
                 time_s: float = 1.0, max_rows: int = 20, skip_tool: float = 0.3,
                 final_output: bool = False, cache_size: int = 8192,
                 max_workers: int | None = None, step_timeout_s: float | None = 30.0,
                 tool_format: str = "tags", max_invalid_calls: int = 0,
                 max_calls_per_turn: int | None = None):
        super().__init__(codec=codec or CharCodec(), max_turns=max_turns, prompt_len=96,
                         obs_len=obs_len, action_len=action_len, final_output=final_output,
                         skip_tool=skip_tool, cache_size=cache_size,
                         max_workers=max_workers, step_timeout_s=step_timeout_s,
                         tool_format=tool_format, max_invalid_calls=max_invalid_calls,
                         max_calls_per_turn=max_calls_per_turn)
        self.database_kwargs = dict(num_employees=num_employees, num_orders=num_orders)
        self.limits = SqlLimits(time_s=time_s, max_rows=max_rows,
                                max_observation_chars=max(4 * obs_len, 80))
        make_sql_task(0, **self.database_kwargs)  # rejects bad sizes now

    def make_task(self, seed: int, params) -> ToolTask:
        del params
        db, task = make_sql_task(seed, **self.database_kwargs)
        return ToolTask(prompt=task.question, answer=task.answer,
                        solution=task.reference_sql, data=LazyDatabase(db), data_id=seed)

    def run_tool(self, task: ToolTask, source: str) -> ExecutionResult:
        return run_sql(task.data.to_bytes(), source, limits=self.limits)

    def tool_value(self, result: ExecutionResult) -> int | None:
        cell = single_cell(result)
        return None if cell is None else parse_int(cell)

    def shows_answer(self, task: ToolTask, result: ExecutionResult) -> bool:
        cell = single_cell(result)
        return cell is not None and answers_match(cell, task.answer)

    def literal_input(self, value: str) -> str:
        return "SELECT " + (value if parse_int(value) is not None
                            else "'" + value.replace("'", "''") + "'")

    def guess(self, task: ToolTask, rng: random.Random) -> str:
        """An estimate within 30 % (numbers) or another name / department (text)."""
        number = parse_int(task.answer)
        if number is None:
            pool = [n for n in FIRST_NAMES + DEPARTMENTS
                    if not answers_match(n, task.answer)]
            return rng.choice(pool)
        estimate = int(round(number * (1.0 + rng.uniform(-0.3, 0.3))))
        return str(estimate if estimate != number else number + 1)

