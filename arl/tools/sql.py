"""Run a policy's SQL query against a small SQLite database, and make such databases.

`run_sql(database, query, limits=SqlLimits())` returns an `ExecutionResult` (the same
type as `arl.tools.sandbox.run_python`) whose `observation` is the result as compact text
rows ("name | salary\\nAda | 5200") or a one-line error ("error: no such table: x").
It never raises for anything in the query; bad arguments raise TypeError / ValueError.

The query runs in this process (SQLite releases the GIL, so calls parallelise in
`arl.tools.pool`), guarded by:
  * a read-only database: a private in-memory copy of `bytes`, or a file opened with
    ``file:...?mode=ro``; ``PRAGMA query_only=ON``;
  * an authorizer that allows only reading (SELECT, reading columns, functions other than
    ``load_extension``, recursive CTEs) and denies everything else (INSERT, UPDATE,
    DELETE, DROP, CREATE, ALTER, ATTACH, PRAGMA, transactions, ...); the statement must
    start with SELECT, WITH or VALUES (VACUUM reaches no authorizer), at most
    ``SQLITE_LIMIT_ATTACHED = 0`` databases can be attached, extension loading is off;
  * one statement only;
  * a progress handler that interrupts the statement (while it runs and while rows are
    fetched) after `time_s` seconds or `max_vm_steps` SQLite VM instructions (the
    instruction budget makes the limit deterministic across machines);
  * at most `max_rows` rows fetched, `max_cell_chars` per cell, `max_observation_chars`
    in all; SQLITE_LIMIT_LENGTH bounds any string or blob the query builds.
Memory is bounded only indirectly (time and instruction budget; SQLite's sorter spills
to temporary files): run the env's SQL tool in `arl.tools.sandbox` if that matters.

The generator (`random_company_database`, `make_sql_task`) builds seeded toy databases —
`departments(name, floor)`, `employees(id, name, dept, salary, hire_year)`,
`orders(id, employee_id, amount, year)` — and templated questions whose true answer is
computed in plain Python from the generated rows (not by SQLite), so an environment can
check an answer exactly (`answers_match`). The style follows text-to-SQL benchmarks
such as Spider (Yu et al., 2018) and the SQL tasks of AgentBench (Liu et al., 2023).
"""

from __future__ import annotations

import dataclasses
import decimal
import os
import random
import re
import sqlite3
import tempfile
import time
import urllib.parse

from arl.tools.results import (ExecutionResult, Status, compose_observation,
                               format_seconds, internal_error_result)

_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ,
                              sqlite3.SQLITE_FUNCTION,
                              getattr(sqlite3, "SQLITE_RECURSIVE", 33)})
_FIRST_KEYWORDS = ("select", "with", "values")
_PROGRESS_PERIOD = 1000  # VM instructions between two progress-handler calls
_COMMENT = re.compile(r"\s+|--[^\n]*(\n|$)|/\*.*?(\*/|$)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class SqlLimits:
    """Limits of one `run_sql` call: `time_s` wall seconds and `max_vm_steps` SQLite VM
    instructions for executing and fetching; `max_rows` rows shown; `max_cell_chars`
    characters per cell; `max_observation_chars` for the whole observation (marker
    included); `max_query_chars` for the query text; `max_value_bytes`
    (SQLITE_LIMIT_LENGTH) for any string or blob the query builds."""

    time_s: float = 1.0
    max_vm_steps: int = 20_000_000
    max_rows: int = 50
    max_cell_chars: int = 200
    max_observation_chars: int = 2000
    max_query_chars: int = 10_000
    max_value_bytes: int = 1_000_000

    def __post_init__(self):
        if isinstance(self.time_s, bool) or not isinstance(self.time_s, (int, float)) or not (
                0 < self.time_s < float("inf")):
            raise ValueError(f"SqlLimits.time_s must be a finite number > 0, got {self.time_s!r}")
        for name in ("max_vm_steps", "max_rows", "max_cell_chars", "max_observation_chars",
                     "max_query_chars", "max_value_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SqlLimits.{name} must be an int > 0, got {value!r}")
        if self.max_observation_chars < 80:
            raise ValueError("SqlLimits.max_observation_chars must be at least 80, got "
                             f"{self.max_observation_chars}")


def _authorize(action, *_):
    return sqlite3.SQLITE_OK if action in _ALLOWED_ACTIONS else sqlite3.SQLITE_DENY


def _authorize_function(action, arg1, arg2, *_):
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() == "load_extension":
        return sqlite3.SQLITE_DENY
    return _authorize(action)


def _first_keyword(query: str) -> str:
    position = 0
    while True:
        match = _COMMENT.match(query, position)
        if not match or match.end() == position:
            break
        position = match.end()
    word = re.match(r"[A-Za-z]+", query[position:])
    return word.group(0).lower() if word else ""


def _open_read_only(database) -> sqlite3.Connection:
    if isinstance(database, (bytes, bytearray, memoryview)):
        connection = sqlite3.connect(":memory:", isolation_level=None,
                                     check_same_thread=False)
        if hasattr(connection, "deserialize"):
            connection.deserialize(bytes(database))
        else:  # Python < 3.11: copy through a temporary file
            connection.close()
            with tempfile.NamedTemporaryFile(suffix=".sqlite") as copy:
                copy.write(database)
                copy.flush()
                source = sqlite3.connect(_read_only_uri(copy.name), uri=True)
                connection = sqlite3.connect(":memory:", isolation_level=None,
                                             check_same_thread=False)
                source.backup(connection)
                source.close()
    else:
        connection = sqlite3.connect(_read_only_uri(os.fspath(database)), uri=True,
                                     isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA query_only=ON")
    return connection


def _read_only_uri(path: str) -> str:
    return "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"


def format_cell(value, max_chars: int) -> str:
    """One cell as text: NULL, integers as is, floats by `repr` (shortest round trip),
    blobs as x'hex', strings with newlines and tabs escaped; cut to `max_chars`."""
    if value is None:
        text = "NULL"
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, bytes):
        text = "x'" + value[:max_chars].hex() + "'"
    else:
        text = str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    if len(text) > max_chars:
        text = text[:max(max_chars - 3, 1)] + "..."
    return text


def format_rows(columns, rows, more: bool, limits: SqlLimits) -> str:
    """Header line of column names, one line per row, cells joined by " | "."""
    lines = [" | ".join(format_cell(c, limits.max_cell_chars) for c in columns)]
    lines += [" | ".join(format_cell(v, limits.max_cell_chars) for v in row) for row in rows]
    if not rows:
        lines.append("(no rows)")
    if more:
        lines.append(f"[only the first {limits.max_rows} rows are shown]")
    return "\n".join(lines)


def run_sql(database, query: str, *, limits: SqlLimits = SqlLimits()) -> ExecutionResult:
    """Runs the single read-only statement `query` against `database` (the bytes of a
    SQLite database file, e.g. `CompanyDatabase.to_bytes()`, or the path of one) and
    returns the `ExecutionResult` (see the module docstring for the rules)."""
    if not isinstance(query, str):
        raise TypeError(f"query must be a str, got {type(query).__name__}")
    if not isinstance(database, (bytes, bytearray, memoryview, str, os.PathLike)):
        raise TypeError("database must be the bytes of a SQLite database or a path, got "
                        f"{type(database).__name__}")
    if not isinstance(limits, SqlLimits):
        raise TypeError(f"limits must be a SqlLimits, got {type(limits).__name__}")
    start = time.monotonic()

    def error(message, status=Status.ERROR):
        observation, _ = compose_observation("", f"error: {message}",
                                             limits.max_observation_chars)
        return ExecutionResult(observation=observation, status=status,
                               stderr=message, exit_code=1,
                               wall_time_s=time.monotonic() - start)

    if len(query) > limits.max_query_chars:
        return error(f"query longer than {limits.max_query_chars} characters")
    if _first_keyword(query) not in _FIRST_KEYWORDS:
        return error("only read-only queries (SELECT, WITH, VALUES) are allowed")
    try:
        connection = _open_read_only(database)
    except (sqlite3.Error, OSError, ValueError) as exc:
        return internal_error_result(f"cannot open the database: {exc}",
                                     time.monotonic() - start)
    steps = [0]
    deadline = start + limits.time_s
    stopped = [None]

    def progress():
        steps[0] += _PROGRESS_PERIOD
        if steps[0] > limits.max_vm_steps:
            stopped[0] = f"query exceeded {limits.max_vm_steps} steps"
        elif time.monotonic() > deadline:
            stopped[0] = f"timeout after {format_seconds(limits.time_s)} s"
        return 1 if stopped[0] else 0

    try:
        if hasattr(connection, "setlimit"):
            connection.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
            connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, limits.max_value_bytes)
            connection.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, limits.max_query_chars)
        connection.set_authorizer(_authorize_function)
        connection.set_progress_handler(progress, _PROGRESS_PERIOD)
        try:
            cursor = connection.execute(query)
            rows = cursor.fetchmany(limits.max_rows + 1)
            columns = [d[0] for d in cursor.description or ()]
        except (sqlite3.ProgrammingError, sqlite3.Warning) as exc:
            if "one statement" in str(exc):
                return error("only one SQL statement is allowed")
            return error(str(exc))
        except sqlite3.Error as exc:
            if stopped[0]:
                return error(stopped[0], Status.TIMEOUT)
            message = str(exc)
            if message.startswith("not authorized"):
                message += " (read-only: only SELECT queries are allowed)"
            return error(message)
        except (MemoryError, OverflowError, ValueError) as exc:
            return error(f"{type(exc).__name__}: {exc}")
    finally:
        connection.close()
    more = len(rows) > limits.max_rows
    rows = rows[:limits.max_rows]
    text = format_rows(columns, rows, more, limits)
    observation, cut = compose_observation(text, None, limits.max_observation_chars)
    return ExecutionResult(observation=observation, status=Status.OK, stdout=text,
                           exit_code=0, wall_time_s=time.monotonic() - start,
                           output_truncated=more or cut)


# ---------------------------------------------------------------- toy databases, tasks

DEPARTMENTS = ("engineering", "sales", "marketing", "finance", "support", "research")
FIRST_NAMES = ("Ada", "Alan", "Barbara", "Claude", "Dennis", "Edsger", "Frances", "Grace",
               "Hedy", "Ivan", "John", "Katherine", "Linus", "Margaret", "Niklaus", "Ole",
               "Radia", "Shafi", "Tim", "Vint", "Whitfield", "Yukihiro", "Guido",
               "Donald", "Ken", "Leslie", "Robin", "Sophie", "Tony", "Xavier")


@dataclasses.dataclass(frozen=True)
class Employee:
    id: int
    name: str
    dept: str
    salary: int
    hire_year: int


@dataclasses.dataclass(frozen=True)
class Order:
    id: int
    employee_id: int
    amount: int
    year: int


@dataclasses.dataclass(frozen=True)
class CompanyDatabase:
    """A generated database as plain Python rows (the ground truth for answers)."""

    departments: tuple[tuple[str, int], ...]  # (name, floor)
    employees: tuple[Employee, ...]
    orders: tuple[Order, ...]

    SCHEMA = (
        "CREATE TABLE departments (name TEXT PRIMARY KEY, floor INTEGER NOT NULL);\n"
        "CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, "
        "dept TEXT NOT NULL REFERENCES departments(name), salary INTEGER NOT NULL, "
        "hire_year INTEGER NOT NULL);\n"
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, employee_id INTEGER NOT NULL "
        "REFERENCES employees(id), amount INTEGER NOT NULL, year INTEGER NOT NULL);")

    def connect(self) -> sqlite3.Connection:
        """A fresh in-memory, writable SQLite connection holding these rows."""
        connection = sqlite3.connect(":memory:", isolation_level=None)
        connection.executescript(self.SCHEMA)
        connection.executemany("INSERT INTO departments VALUES (?, ?)", self.departments)
        connection.executemany("INSERT INTO employees VALUES (?, ?, ?, ?, ?)",
                               [dataclasses.astuple(e) for e in self.employees])
        connection.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)",
                               [dataclasses.astuple(o) for o in self.orders])
        return connection

    def to_bytes(self) -> bytes:
        """The SQLite database file as bytes (for `run_sql`)."""
        connection = self.connect()
        try:
            if hasattr(connection, "serialize"):
                return connection.serialize()
            with tempfile.TemporaryDirectory() as directory:  # Python < 3.11
                path = os.path.join(directory, "db.sqlite")
                target = sqlite3.connect(path)
                connection.backup(target)
                target.close()
                with open(path, "rb") as f:
                    return f.read()
        finally:
            connection.close()


def random_company_database(seed: int, *, num_departments: int = 4,
                            num_employees: int = 12, num_orders: int = 30,
                            years: tuple[int, int] = (2019, 2023)) -> CompanyDatabase:
    """A seeded toy company: departments, employees with distinct names and distinct
    salaries (multiples of 100, so "highest paid" has one answer) and orders."""
    for name, value, high in (("num_departments", num_departments, len(DEPARTMENTS)),
                              ("num_employees", num_employees, len(FIRST_NAMES)),
                              ("num_orders", num_orders, 10_000)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise ValueError(f"{name} must be an int in [1, {high}], got {value!r}")
    if not (isinstance(years, tuple) and len(years) == 2 and years[0] <= years[1]):
        raise ValueError(f"years must be a (first, last) tuple with first <= last, got {years!r}")
    rng = random.Random(seed)
    departments = tuple(sorted(rng.sample(DEPARTMENTS, num_departments)))
    floors = rng.sample(range(1, 10), num_departments)
    names = rng.sample(FIRST_NAMES, num_employees)
    salaries = rng.sample(range(30, 200), num_employees)
    employees = tuple(
        Employee(id=i + 1, name=names[i], dept=rng.choice(departments),
                 salary=salaries[i] * 100, hire_year=rng.randint(2010, years[1]))
        for i in range(num_employees))
    orders = tuple(
        Order(id=i + 1, employee_id=rng.randint(1, num_employees),
              amount=rng.randint(1, 500) * 10, year=rng.randint(*years))
        for i in range(num_orders))
    return CompanyDatabase(departments=tuple(zip(departments, floors)),
                           employees=employees, orders=orders)


@dataclasses.dataclass(frozen=True)
class SqlTask:
    """A question about a `CompanyDatabase`, a reference query answering it and the true
    answer (computed in Python) as text."""

    question: str
    reference_sql: str
    answer: str


def _sql_text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _question_templates(db: CompanyDatabase, rng: random.Random):
    """Yields candidate (question, sql, answer or None if ill-defined) for `db`."""
    employees, orders = db.employees, db.orders
    staffed = sorted({e.dept for e in employees})
    dept = rng.choice(staffed)
    in_dept = [e for e in employees if e.dept == dept]
    kind = rng.randrange(8)
    if kind == 0:
        yield (f"How many employees work in the {dept} department?",
               f"SELECT COUNT(*) FROM employees WHERE dept = {_sql_text(dept)}",
               str(len(in_dept)))
    elif kind == 1:
        yield (f"What is the total salary of the {dept} department?",
               f"SELECT SUM(salary) FROM employees WHERE dept = {_sql_text(dept)}",
               str(sum(e.salary for e in in_dept)))
    elif kind == 2:
        best = max(in_dept, key=lambda e: e.salary)
        yield (f"Who is the highest-paid employee in the {dept} department?",
               f"SELECT name FROM employees WHERE dept = {_sql_text(dept)} "
               "ORDER BY salary DESC LIMIT 1", best.name)
    elif kind == 3:
        threshold = rng.choice(sorted(e.salary for e in employees))
        yield (f"How many employees earn more than {threshold}?",
               f"SELECT COUNT(*) FROM employees WHERE salary > {threshold}",
               str(sum(e.salary > threshold for e in employees)))
    elif kind == 4:
        yield (f"What is the average salary in the {dept} department, rounded down to a "
               "whole number?",
               f"SELECT SUM(salary) / COUNT(*) FROM employees WHERE dept = {_sql_text(dept)}",
               str(sum(e.salary for e in in_dept) // len(in_dept)))
    elif kind == 5:
        person = rng.choice(employees)
        year = rng.choice(sorted({o.year for o in orders}))
        total = sum(o.amount for o in orders if o.employee_id == person.id and o.year == year)
        yield (f"What is the total amount of the orders placed by {person.name} in {year}?",
               "SELECT COALESCE(SUM(o.amount), 0) FROM orders o JOIN employees e "
               f"ON o.employee_id = e.id WHERE e.name = {_sql_text(person.name)} "
               f"AND o.year = {year}", str(total))
    elif kind == 6:
        ids = {e.id for e in in_dept}
        yield (f"How many orders were placed by employees of the {dept} department?",
               "SELECT COUNT(*) FROM orders o JOIN employees e ON o.employee_id = e.id "
               f"WHERE e.dept = {_sql_text(dept)}",
               str(sum(o.employee_id in ids for o in orders)))
    else:
        by_id = {e.id: e.dept for e in employees}
        totals = {}
        for o in orders:
            totals[by_id[o.employee_id]] = totals.get(by_id[o.employee_id], 0) + o.amount
        ranked = sorted(totals.items(), key=lambda kv: -kv[1])
        unique = len(ranked) == 1 or (len(ranked) > 1 and ranked[0][1] != ranked[1][1])
        yield ("Which department has the largest total order amount?",
               "SELECT e.dept FROM orders o JOIN employees e ON o.employee_id = e.id "
               "GROUP BY e.dept ORDER BY SUM(o.amount) DESC LIMIT 1",
               ranked[0][0] if ranked and unique else None)


def make_sql_task(seed: int, **database_kwargs) -> tuple[CompanyDatabase, SqlTask]:
    """A seeded database (`random_company_database(seed, **database_kwargs)`) and a
    well-defined templated question about it."""
    db = random_company_database(seed, **database_kwargs)
    rng = random.Random(f"question-{seed}")
    for _ in range(100):
        for question, sql, answer in _question_templates(db, rng):
            if answer is not None:
                return db, SqlTask(question=question, reference_sql=sql, answer=answer)
    raise ValueError(f"no well-defined question for seed {seed}")  # not reached in practice


def normalize_answer(text: str) -> str:
    """Canonical form for exact comparison: trimmed, case-folded, inner whitespace
    collapsed, a trailing period and surrounding quotes dropped, numbers written without
    thousands separators, exponent or trailing zeros ("5,200.00" -> "5200")."""
    text = " ".join(str(text).split()).rstrip(".").strip("'\"`").strip()
    candidate = text.replace(",", "")
    try:
        number = decimal.Decimal(candidate)
    except decimal.InvalidOperation:
        return text.casefold()
    if not number.is_finite():
        return text.casefold()
    return format(number.normalize(), "f")


def answers_match(given: str, expected: str) -> bool:
    """Whether `given` states `expected` (see `normalize_answer`)."""
    return normalize_answer(given) == normalize_answer(expected)
