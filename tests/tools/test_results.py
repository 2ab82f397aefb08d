"""`arl.tools.results`: the result types every tool shares, importable without the
sandbox executor's subprocess machinery."""

from __future__ import annotations

import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_result_types_load_no_subprocess_machinery():
    code = ("import sys\n"
            "from arl.tools.limits import SandboxLimits\n"
            "from arl.tools.results import ExecutionResult, Status, compose_observation\n"
            "print(sorted(m for m in ('subprocess', 'selectors', 'arl.tools.sandbox', "
            "'arl.tools.executor', 'arl.tools.pool') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=_ROOT, env=dict(os.environ, PYTHONPATH=_ROOT))
    assert out.stdout.strip() == "[]"


def test_arl_tools_exports_the_same_objects_as_their_modules():
    import arl.tools  # pylint: disable=import-outside-toplevel
    from arl.tools import limits, results, sandbox, sql  # pylint: disable=import-outside-toplevel

    assert arl.tools.Status is results.Status
    assert arl.tools.ExecutionResult is results.ExecutionResult
    assert arl.tools.SandboxLimits is limits.SandboxLimits
    assert arl.tools.run_python is sandbox.run_python
    assert arl.tools.run_sql is sql.run_sql
    assert set(arl.tools.__all__) <= set(dir(arl.tools))
    for name in arl.tools.__all__:
        assert getattr(arl.tools, name) is not None, name
