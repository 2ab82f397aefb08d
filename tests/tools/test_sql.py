"""`arl.tools.sql`: read-only queries with limits, the toy databases and their tasks.

Answers computed in Python by the task generator are checked against SQLite running the
reference query, and against a second, plainly written Python computation."""

import hashlib
import os
import sqlite3
import time

import pytest

from arl.tools import sql
from arl.tools.results import Status
from arl.tools.sql import SqlLimits, run_sql

SEED = 7


@pytest.fixture(scope="module")
def company():
    return sql.random_company_database(SEED)


@pytest.fixture(scope="module")
def db_bytes(company):
    return company.to_bytes()


@pytest.fixture
def db_path(company, tmp_path):
    path = tmp_path / "company.sqlite"
    target = sqlite3.connect(path)
    company.connect().backup(target)
    target.close()
    return path


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _count(database, table) -> int:
    result = run_sql(database, f"SELECT COUNT(*) FROM {table}")
    assert result.ok, result
    return int(result.stdout.splitlines()[1])


def assert_error(result, text):
    assert result.status is Status.ERROR, result
    assert result.observation.startswith("error: ") and text in result.observation, result


# ------------------------------------------------------------------------ correct runs


def test_rows_are_rendered_as_compact_text(company, db_bytes):
    result = run_sql(db_bytes, "SELECT name, salary FROM employees ORDER BY id LIMIT 3")
    expected = "name | salary\n" + "\n".join(
        f"{e.name} | {e.salary}" for e in company.employees[:3])
    assert result.status is Status.OK and result.exit_code == 0
    assert result.observation == result.stdout == expected


def test_cells_render_null_floats_blobs_and_newlines(db_bytes):
    result = run_sql(db_bytes, "SELECT NULL, 0.1 + 0.2, x'00ff', 'a' || char(10) || 'b', 7")
    assert result.observation.splitlines()[1] == "NULL | 0.30000000000000004 | x'00ff' | a\\nb | 7"


def test_empty_result_and_path_database(db_path, company):
    assert run_sql(db_path, "SELECT name FROM employees WHERE salary < 0").observation == (
        "name\n(no rows)")
    assert _count(str(db_path), "orders") == len(company.orders)


def test_row_limit_and_cell_and_observation_limits(db_bytes, company):
    result = run_sql(db_bytes,
                     "SELECT a.id, b.id FROM employees a, employees b ORDER BY a.id, b.id",
                     limits=SqlLimits(max_rows=5))
    lines = result.observation.splitlines()
    assert result.ok and result.output_truncated
    assert len(lines) == 1 + 5 + 1 and lines[-1] == "[only the first 5 rows are shown]"
    assert lines[1:6] == ["1 | 1", "1 | 2", "1 | 3", "1 | 4", "1 | 5"]
    long = run_sql(db_bytes, "SELECT printf('%.500c', 'z')", limits=SqlLimits(max_cell_chars=10))
    assert long.observation.splitlines()[1] == "zzzzzzz..."
    wide = run_sql(db_bytes, "SELECT * FROM orders", limits=SqlLimits(max_observation_chars=100))
    assert len(wide.observation) <= 100 and wide.observation.endswith("[output truncated]")


# ----------------------------------------------------------------- writes are refused


@pytest.mark.parametrize("query, message", [
    ("DROP TABLE employees", "only read-only queries"),
    ("INSERT INTO orders VALUES (999, 1, 10, 2020)", "only read-only queries"),
    ("UPDATE employees SET salary = 0", "only read-only queries"),
    ("ATTACH DATABASE '/tmp/arl-attached.sqlite' AS other", "only read-only queries"),
    ("PRAGMA writable_schema = ON", "only read-only queries"),
    ("VACUUM INTO '/tmp/arl-vacuum.sqlite'", "only read-only queries"),
    ("WITH x AS (SELECT 1) DELETE FROM orders", "not authorized"),
    ("WITH x AS (SELECT 1) INSERT INTO orders SELECT 999, 1, 10, 2020", "not authorized"),
    ("SELECT load_extension('/tmp/evil')", "not authorized to use function: load_extension"),
    ("SELECT * FROM employees; DROP TABLE employees", "only one SQL statement"),
    ("SELECT 1; SELECT 2", "only one SQL statement"),
])
def test_writes_attach_and_several_statements_are_refused(query, message, db_bytes, db_path,
                                                          company):
    before = _digest(db_path)
    for database in (db_bytes, db_path):
        assert_error(run_sql(database, query), message)
    assert _digest(db_path) == before
    assert _count(db_bytes, "employees") == _count(db_path, "employees") == len(company.employees)
    assert not os.path.exists("/tmp/arl-attached.sqlite")
    assert not os.path.exists("/tmp/arl-vacuum.sqlite")


def test_the_authorizer_refuses_writes_behind_the_keyword_check(db_path):
    # The first-keyword check is one layer; the authorizer and query_only are others.
    connection = sql._open_read_only(db_path)
    connection.set_authorizer(sql._authorize_function)
    for statement in ("DROP TABLE employees", "ATTACH ':memory:' AS x", "PRAGMA query_only=OFF",
                      "CREATE TEMP TABLE t(x)", "BEGIN"):
        with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
            connection.execute(statement)
    connection.close()


def test_comments_before_the_query_are_skipped(db_bytes):
    result = run_sql(db_bytes, "/* list */ -- tables\n  select name from sqlite_master "
                               "where type = 'table' order by name")
    assert result.observation == "name\ndepartments\nemployees\norders"
    assert_error(run_sql(db_bytes, "/* */ DROP TABLE employees"), "only read-only queries")


# ------------------------------------------------------------------------------ limits


INFINITE = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"


def test_infinite_recursive_query_hits_the_time_limit(db_bytes):
    start = time.monotonic()
    result = run_sql(db_bytes, INFINITE, limits=SqlLimits(time_s=0.3, max_vm_steps=10**12))
    elapsed = time.monotonic() - start
    assert result.status is Status.TIMEOUT and result.limit_exceeded
    assert result.observation == "error: timeout after 0.3 s"
    assert 0.3 <= elapsed < 1.5


def test_infinite_recursive_query_hits_the_instruction_budget(db_bytes):
    result = run_sql(db_bytes, INFINITE, limits=SqlLimits(time_s=60, max_vm_steps=200_000))
    assert result.status is Status.TIMEOUT
    assert result.observation == "error: query exceeded 200000 steps"
    assert result.wall_time_s < 2.0


def test_huge_cross_join_is_stopped(db_bytes):
    joins = ", ".join(f"orders o{i}" for i in range(6))  # 30**6 = 729 million rows
    counted = run_sql(db_bytes, f"SELECT COUNT(*) FROM {joins}", limits=SqlLimits(time_s=0.5))
    assert counted.status is Status.TIMEOUT and counted.wall_time_s < 2.0
    listed = run_sql(db_bytes, f"SELECT * FROM {joins}", limits=SqlLimits(max_rows=10))
    assert listed.ok and len(listed.stdout.splitlines()) == 1 + 10 + 1  # stopped at 10 rows
    sorted_ = run_sql(db_bytes, f"SELECT * FROM {joins} ORDER BY o0.amount * o5.amount",
                      limits=SqlLimits(time_s=0.5))
    assert sorted_.status is Status.TIMEOUT and sorted_.wall_time_s < 2.0


def test_huge_values_and_syntax_errors(db_bytes):
    assert_error(run_sql(db_bytes, "SELECT randomblob(2000000)"), "string or blob too big")
    assert_error(run_sql(db_bytes, "SELECT * FROM nowhere"), "no such table: nowhere")
    assert_error(run_sql(db_bytes, "SELECT name FROM employees WHERE AND"), "syntax error")
    assert_error(run_sql(db_bytes, "SELEC 1"), "only read-only queries")
    assert_error(run_sql(db_bytes, "SELECT 1" + " " * 20000), "longer than 10000 characters")
    assert_error(run_sql(db_bytes, ""), "only read-only queries")


def test_bad_database_is_an_observation_not_an_exception(tmp_path):
    result = run_sql(b"not a database", "SELECT * FROM employees")
    assert result.status is Status.ERROR and "not a database" in result.observation
    missing = run_sql(tmp_path / "missing.sqlite", "SELECT 1")
    assert missing.status is Status.INTERNAL_ERROR and "cannot open" in missing.observation
    assert not (tmp_path / "missing.sqlite").exists()


def test_bad_arguments_raise_clear_errors(db_bytes):
    with pytest.raises(TypeError, match="query must be a str"):
        run_sql(db_bytes, b"SELECT 1")
    with pytest.raises(TypeError, match="database must be"):
        run_sql(123, "SELECT 1")
    with pytest.raises(ValueError, match="SqlLimits.time_s"):
        SqlLimits(time_s=-1)
    with pytest.raises(ValueError, match="SqlLimits.max_rows"):
        SqlLimits(max_rows=0)
    with pytest.raises(ValueError, match="num_employees"):
        sql.random_company_database(0, num_employees=0)


# ----------------------------------------------------------------- databases and tasks


def test_generator_is_seeded_and_well_formed(company):
    again = sql.random_company_database(SEED)
    assert again == company and again.to_bytes() == company.to_bytes()
    assert sql.random_company_database(SEED + 1) != company
    names = [e.name for e in company.employees]
    salaries = [e.salary for e in company.employees]
    assert len(set(names)) == len(names) == 12 and len(set(salaries)) == 12
    departments = {name for name, _ in company.departments}
    assert {e.dept for e in company.employees} <= departments
    assert {o.employee_id for o in company.orders} <= {e.id for e in company.employees}
    assert all(s % 100 == 0 for s in salaries)
    assert all(o.amount % 10 == 0 for o in company.orders)


def _python_answer(db, question):
    """A second, independent reading of each template's question."""
    employees, orders = db.employees, db.orders
    words = question.rstrip("?").split()
    if question.startswith("How many employees work in the"):
        return str(sum(e.dept == words[-2] for e in employees))
    if question.startswith("What is the total salary of the"):
        return str(sum(e.salary for e in employees if e.dept == words[-2]))
    if question.startswith("Who is the highest-paid"):
        return sorted((e for e in employees if e.dept == words[-2]),
                      key=lambda e: e.salary)[-1].name
    if question.startswith("How many employees earn more than"):
        return str(len([e for e in employees if e.salary > int(words[-1])]))
    if question.startswith("What is the average salary in the"):
        dept = words[7]
        values = [e.salary for e in employees if e.dept == dept]
        return str(int(sum(values) / len(values)))
    if question.startswith("What is the total amount of the orders placed by"):
        name, year = words[-3], int(words[-1])
        person = next(e for e in employees if e.name == name)
        return str(sum(o.amount for o in orders if o.employee_id == person.id and o.year == year))
    if question.startswith("How many orders were placed by employees of the"):
        dept = words[-2]
        ids = [e.id for e in employees if e.dept == dept]
        return str(len([o for o in orders if o.employee_id in ids]))
    if question == "Which department has the largest total order amount?":
        totals = {}
        for o in orders:
            dept = next(e.dept for e in employees if e.id == o.employee_id)
            totals[dept] = totals.get(dept, 0) + o.amount
        return max(totals, key=totals.get)
    raise AssertionError(question)


def test_task_answers_match_sqlite_and_a_second_computation():
    templates = set()
    for seed in range(60):
        db, task = sql.make_sql_task(seed)
        result = run_sql(db.to_bytes(), task.reference_sql)
        assert result.ok, (task, result)
        header, value = result.stdout.splitlines()
        assert value == task.answer, (seed, task, result.stdout)
        assert _python_answer(db, task.question) == task.answer, (seed, task)
        assert sql.answers_match(value, task.answer)
        templates.add(" ".join(task.question.split()[:5]))
    assert len(templates) == 8  # the seeds cover every template


def test_tasks_are_deterministic():
    assert sql.make_sql_task(3) == sql.make_sql_task(3)


@pytest.mark.parametrize("given, expected, same", [
    ("5200", "5200", True), (" 5,200.00 ", "5200", True), ("5.2e3", "5200", True),
    ("5201", "5200", False), ("'Ada'.", "ada", True), ("Ada Lovelace", "Ada", False),
    ("engineering", "Engineering", True), ("0.50", ".5", True), ("", "0", False),
])
def test_answers_match(given, expected, same):
    assert sql.answers_match(given, expected) is same
