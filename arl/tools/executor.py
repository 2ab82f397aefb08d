"""Where a tool's Python code runs: the built-in sandbox, or a sandbox service of your own.

An executor is any callable `executor(code: str, limits: SandboxLimits) ->
ExecutionResult` (the `PythonExecutor` protocol) that never raises for anything the code
does. `code_interpreter` takes one (`executor=`; `executor_url=` for `HttpExecutor`):

* `LocalSandbox()` (the default): `arl.tools.sandbox.run_python` on this machine, every
  layer it has (`sandbox_capabilities()`).
* `HttpExecutor(url)`: POSTs the call as JSON to a service (e.g. one that runs the code
  in a VM, gVisor or a SandboxFusion-like farm) and reads an `ExecutionResult` back.
  Request: ``{"code": str, "limits": {SandboxLimits fields}}``; response: ``{"observation":
  str, "status": Status value, "stdout": str, "stderr": str, "exit_code": int | null,
  "output_truncated": bool}`` (missing fields take their defaults). A service that fails,
  times out (`limits.wall_time_s` + `timeout_margin_s`) or answers garbage gives an
  INTERNAL_ERROR result, never an exception.
* `serve(executor, host, port)`: that protocol served over HTTP from this process (stdlib
  `http.server`), the reference implementation of the service side.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Protocol, runtime_checkable

from arl.tools.limits import SandboxLimits
from arl.tools.results import ExecutionResult, Status, internal_error_result, truncate_text
from arl.tools.sandbox import run_python, sandbox_capabilities

_MAX_RESPONSE_BYTES = 8 * 2**20


@runtime_checkable
class PythonExecutor(Protocol):
    """Runs `code` within `limits` and returns its result; never raises for the code."""

    def __call__(self, code: str, limits: SandboxLimits) -> ExecutionResult:
        ...


class LocalSandbox:
    """`run_python` on this machine (interpreter `python`, default: this one)."""

    def __init__(self, python: str | None = None):
        self.python = python

    def __call__(self, code: str, limits: SandboxLimits) -> ExecutionResult:
        return run_python(code, limits=limits, python=self.python)

    def describe(self) -> str:
        return "local sandbox, " + sandbox_capabilities(self.python).describe()

    @property
    def kernel_boundary(self) -> bool:
        return sandbox_capabilities(self.python).kernel_boundary


def result_to_json(result: ExecutionResult) -> dict:
    return {"observation": result.observation, "status": result.status.value,
            "stdout": result.stdout, "stderr": result.stderr, "exit_code": result.exit_code,
            "output_truncated": result.output_truncated}


def result_from_json(data, limits: SandboxLimits, wall_time_s: float) -> ExecutionResult:
    """The `ExecutionResult` in a service's reply, its texts cut to `limits`; raises
    ValueError for a malformed reply."""
    if not isinstance(data, dict) or not isinstance(data.get("observation"), str):
        raise ValueError("the reply has no 'observation' string")
    status = Status(data.get("status", "error"))
    texts = {}
    for name in ("stdout", "stderr"):
        value = data.get(name, "")
        if not isinstance(value, str):
            raise ValueError(f"'{name}' must be a string")
        texts[name] = value.encode()[:limits.max_output_bytes].decode("utf-8", "replace")
    exit_code = data.get("exit_code")
    if exit_code is not None and (isinstance(exit_code, bool) or not isinstance(exit_code, int)):
        raise ValueError("'exit_code' must be an int or null")
    observation, cut = truncate_text(data["observation"], limits.max_observation_chars)
    return ExecutionResult(observation=observation, status=status, exit_code=exit_code,
                           wall_time_s=wall_time_s,
                           output_truncated=bool(data.get("output_truncated")) or cut, **texts)


class HttpExecutor:
    """Sends each call to the service at `url` (module docstring). `headers`: extra HTTP
    headers (e.g. an authorization token); `timeout_margin_s`: seconds allowed beyond the
    call's wall-time limit for the round trip."""

    def __init__(self, url: str, *, headers: dict | None = None, timeout_margin_s: float = 5.0):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// URL, got {url!r}")
        if isinstance(timeout_margin_s, bool) or not isinstance(
                timeout_margin_s, (int, float)) or not 0 < timeout_margin_s < float("inf"):
            raise ValueError(f"timeout_margin_s must be a finite number > 0, got "
                             f"{timeout_margin_s!r}")
        self.url = url
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.timeout_margin_s = float(timeout_margin_s)

    def __call__(self, code: str, limits: SandboxLimits) -> ExecutionResult:
        start = time.monotonic()
        body = json.dumps({"code": code, "limits": dataclasses.asdict(limits)}).encode()
        request = urllib.request.Request(self.url, data=body, headers=self.headers,
                                         method="POST")
        try:
            with urllib.request.urlopen(
                    request, timeout=limits.wall_time_s + self.timeout_margin_s) as reply:
                payload = reply.read(_MAX_RESPONSE_BYTES + 1)
            if len(payload) > _MAX_RESPONSE_BYTES:
                raise ValueError(f"reply longer than {_MAX_RESPONSE_BYTES} bytes")
            return result_from_json(json.loads(payload), limits, time.monotonic() - start)
        except (OSError, ValueError, urllib.error.URLError) as exc:
            return internal_error_result(f"executor service {self.url}: "
                                         f"{type(exc).__name__}: {exc}",
                                         time.monotonic() - start)

    def describe(self) -> str:
        return f"sandbox service at {self.url}"


def serve(executor: PythonExecutor, host: str = "127.0.0.1",
          port: int = 0) -> http.server.ThreadingHTTPServer:
    """Serves `executor` over the `HttpExecutor` protocol on (host, port) from a daemon
    thread; returns the server (its `server_address` has the port; `shutdown()` stops
    it). Each request runs in its own thread."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            try:
                length = int(self.headers.get("Content-Length", "0"))
                request = json.loads(self.rfile.read(length))
                limits = SandboxLimits(**request.get("limits", {}))
                code = request["code"]
                if not isinstance(code, str):
                    raise TypeError("code must be a str")
            except (ValueError, TypeError, KeyError) as exc:
                self._reply(400, {"error": f"{type(exc).__name__}: {exc}"})
                return
            self._reply(200, result_to_json(executor(code, limits)))

        def _reply(self, status, data):
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet: one line per call would flood a run's log
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="arl-executor-service",
                     daemon=True).start()
    return server
