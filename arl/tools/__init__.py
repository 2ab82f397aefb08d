"""Host-side tool executors: untrusted Python in a sandboxed subprocess (or a sandbox
service of your own, `arl.tools.executor`), read-only SQL against small SQLite
databases, and a pool that runs a batch of calls in parallel.

Every executor returns an `ExecutionResult` whose `observation` is the text a policy
reads, and never raises for anything the untrusted input does. Threat model, layers,
limits and their defaults: `arl.tools.sandbox` and docs/tools.md.
"""

from arl.tools.executor import HttpExecutor, LocalSandbox, PythonExecutor, serve
from arl.tools.pool import ToolPool, default_max_workers, map_calls
from arl.tools.sandbox import (ExecutionResult, SandboxCapabilities, SandboxLimits, Status,
                               run_python, sandbox_capabilities)
from arl.tools.sql import (CompanyDatabase, SqlLimits, SqlTask, answers_match,
                           make_sql_task, normalize_answer, random_company_database,
                           run_sql)

__all__ = [
    "CompanyDatabase", "ExecutionResult", "HttpExecutor", "LocalSandbox", "PythonExecutor",
    "SandboxCapabilities", "SandboxLimits",
    "SqlLimits", "SqlTask", "Status", "ToolPool", "answers_match", "default_max_workers",
    "make_sql_task", "map_calls", "normalize_answer", "random_company_database",
    "run_python", "run_sql", "sandbox_capabilities", "serve",
]
