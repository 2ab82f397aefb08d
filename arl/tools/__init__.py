"""Host-side tool executors: untrusted Python in a sandboxed subprocess (or a sandbox
service of your own, `arl.tools.executor`), read-only SQL against small SQLite
databases, and a pool that runs a batch of calls in parallel.

Every executor returns an `ExecutionResult` whose `observation` is the text a policy
reads, and never raises for anything the untrusted input does. Threat model, layers,
limits and their defaults: `arl.tools.sandbox` and docs/tools.md. The result types
every tool shares are in `arl.tools.results` (no subprocess machinery), the sandbox's
limits in `arl.tools.limits`.
"""

import importlib

# Imported on first use (PEP 562), so that `from arl.tools.results import Status` (a tool
# or an environment that needs only the result types) loads no subprocess machinery.
_EXPORTS = {
    "HttpExecutor": "executor", "LocalSandbox": "executor", "PythonExecutor": "executor",
    "serve": "executor",
    "ToolPool": "pool", "default_max_workers": "pool", "map_calls": "pool",
    "SandboxCapabilities": "capabilities",
    "SandboxLimits": "limits",
    "ExecutionResult": "results", "Status": "results",
    "run_python": "sandbox", "sandbox_capabilities": "sandbox",
    "CompanyDatabase": "sql", "SqlLimits": "sql", "SqlTask": "sql", "answers_match": "sql",
    "make_sql_task": "sql", "normalize_answer": "sql", "random_company_database": "sql",
    "run_sql": "sql",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"arl.tools.{_EXPORTS[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'arl.tools' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "CompanyDatabase", "ExecutionResult", "HttpExecutor", "LocalSandbox", "PythonExecutor",
    "SandboxCapabilities", "SandboxLimits",
    "SqlLimits", "SqlTask", "Status", "ToolPool", "answers_match", "default_max_workers",
    "make_sql_task", "map_calls", "normalize_answer", "random_company_database",
    "run_python", "run_sql", "sandbox_capabilities", "serve",
]
