"""Executors (`arl.tools.executor`): the docs' runnable example, the HTTP protocol's
failure modes, and `code_interpreter`'s choice of executor and its refusal of a machine
without the kernel boundary."""

import contextlib
import dataclasses
import http.server
import io
import logging
import os
import re
import threading
import urllib.error
import urllib.request

import pytest

from arl.envs.tasks import code_interpreter
from arl.envs.tasks.code_interpreter import CodeInterpreter
from arl.tools import HttpExecutor, LocalSandbox, PythonExecutor, SandboxLimits, Status, serve
from arl.tools import executor as executor_lib
from arl.tools import results, sandbox

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "tools.md")
QUICK = SandboxLimits(wall_time_s=10.0, cpu_time_s=2.0)


def _docs_example() -> str:
    with open(DOCS, encoding="utf-8") as f:
        text = f.read()
    match = re.search(r"<!-- executor example -->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/tools.md lost its executor example"
    return match.group(1)


def test_the_docs_example_runs_and_prints_what_it_says():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_docs_example(), "docs/tools.md", "exec"), {})  # pylint: disable=exec-used
    assert printed.getvalue() == "42\n\nTrue\n"


@contextlib.contextmanager
def _fake_service(status: int, body: bytes):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("status, body, detail", [
    (200, b"not json", "JSONDecodeError"),
    (200, b'{"stdout": "x"}', "no 'observation' string"),
    (200, b'{"observation": "x", "status": "exploded"}', "'exploded' is not a valid Status"),
    (200, b'{"observation": "x", "exit_code": "0"}', "'exit_code' must be an int"),
    (500, b"{}", "HTTP Error 500"),
])
def test_a_failing_service_gives_an_internal_error_result(status, body, detail):
    with _fake_service(status, body) as url:
        result = HttpExecutor(url)("print(1)", QUICK)
    assert result.status is Status.INTERNAL_ERROR, result
    assert result.observation.startswith(f"sandbox error: executor service {url}: ")
    assert detail in result.observation, result.observation


def test_an_unreachable_service_gives_an_internal_error_result():
    with _fake_service(200, b"{}") as url:
        pass  # closed again: nothing listens there now
    result = HttpExecutor(url, timeout_margin_s=1.0)("print(1)", QUICK)
    assert result.status is Status.INTERNAL_ERROR
    assert "Connection refused" in result.observation, result.observation


def test_a_reply_is_cut_to_the_limits():
    limits = dataclasses.replace(QUICK, max_observation_chars=100, max_output_bytes=10)
    body = b'{"observation": "' + b"a" * 500 + b'", "status": "ok", "stdout": "' + \
        b"b" * 50 + b'", "exit_code": 0}'
    with _fake_service(200, body) as url:
        result = HttpExecutor(url)("print(1)", limits)
    assert result.status is Status.OK and result.exit_code == 0
    assert len(result.observation) == 100 and result.output_truncated
    assert result.stdout == "b" * 10


def test_the_reference_service_refuses_bad_requests_and_runs_good_ones():
    server = serve(LocalSandbox())
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        assert HttpExecutor(url)("print(6 * 7)", QUICK).observation == "42\n"
        bad = urllib.request.Request(url, data=b'{"code": 1}', method="POST")
        with pytest.raises(urllib.error.HTTPError, match="400"):
            urllib.request.urlopen(bad, timeout=10)
        result = HttpExecutor(url)("import os\nos.fork()", QUICK)
        assert result.status is Status.ERROR
        assert result.observation == "PermissionError: sandbox: os.fork is not allowed"
    finally:
        server.shutdown()
        server.server_close()


def test_code_interpreter_sends_cells_to_its_executor():
    calls = []

    def recording(code, limits):
        calls.append((code, limits))
        return results.ExecutionResult(observation="7\n", status=Status.OK, stdout="7\n")

    assert isinstance(recording, PythonExecutor)
    env = CodeInterpreter(executor=recording)
    task = env.make_task(3, None)
    assert env.run_tool(task, "3 + 4").observation == "7\n"
    assert calls == [(code_interpreter.notebook_cell("3 + 4"), env.limits)]


def test_code_interpreter_refuses_a_weak_sandbox_unless_accepted(monkeypatch, caplog):
    weak = sandbox.SandboxCapabilities(uid_drop=True)
    monkeypatch.setattr(executor_lib, "sandbox_capabilities", lambda python=None: weak)
    with pytest.raises(ValueError) as error:
        CodeInterpreter()
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("code_interpreter: the kernel sandbox layers are unavailable "
                              "here (local sandbox, on: unprivileged uid, audit hooks; off: "
                              "minimal root, seccomp, network namespace, PID namespace)")
    assert "env.kwargs.allow_weak_sandbox=True" in message
    monkeypatch.setattr(code_interpreter, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="arl.envs.tasks.code_interpreter"):
        env = CodeInterpreter(allow_weak_sandbox=True)
        CodeInterpreter(allow_weak_sandbox=True)  # said once per process
    assert isinstance(env.executor, LocalSandbox)
    assert [r.getMessage() for r in caplog.records] == [
        "code_interpreter: WEAKER SANDBOX (allowed): local sandbox, on: unprivileged uid, "
        "audit hooks; off: minimal root, seccomp, network namespace, PID namespace"]


def test_bad_executor_arguments_fail_in_one_line():
    with pytest.raises(ValueError, match=r"^allow_weak_sandbox must be True or False, got 'y"):
        CodeInterpreter(allow_weak_sandbox="yes")
    with pytest.raises(ValueError, match="^give executor or executor_url, not both$"):
        CodeInterpreter(executor=LocalSandbox(), executor_url="http://x/")
    with pytest.raises(ValueError, match="^url must be an http:// or https:// URL"):
        CodeInterpreter(executor_url="ftp://x/")
    with pytest.raises(ValueError, match="^executor must be callable"):
        CodeInterpreter(executor=42)
