"""The driver's side of the peer workers (`peers.py`): a peer's virtual environment, the
environment its processes run in, and `WorkerRunner`, which speaks `protocol.py` to one
worker process.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

from peer_workers import protocol

from arl.runs import process_settings

WORKER_DIR = os.path.dirname(os.path.abspath(__file__))
# What each peer's virtual environment installs (pip arguments). torch is pinned to the
# CPU wheel kept on this machine's disk: a plain `torch` requirement pulls a CUDA build
# of several GB.
REQUIREMENTS = {
    "trl": ["torch==2.13.0", "trl"],
    "tunix": ["google-tunix"],
}
# A user's own JAX compilation cache settings (arl.caches leaves them alone when set):
# no part of a measured process's start.
JAX_CACHE_ENVS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                  "JAX_COMPILATION_CACHE_MAX_SIZE")


def peer_python(peer: str, cache_dir: str, log) -> tuple[str | None, str]:
    """(python of the peer's virtual environment, note), creating it on first use; None
    and the reason when it cannot be installed."""
    venv = os.path.join(cache_dir, peer, "venv")
    python = os.path.join(venv, "bin", "python")
    marker = os.path.join(venv, ".arl-bench-installed")
    wanted = " ".join(REQUIREMENTS[peer])
    if os.path.isfile(marker) and open(marker, encoding="utf-8").read() == wanted:
        return python, "cached"
    log(f"[{peer}] installing {wanted} into {venv} (first use; a few minutes) ...")
    start = time.perf_counter()
    install_log = os.path.join(cache_dir, peer, "install.log")
    os.makedirs(os.path.dirname(install_log), exist_ok=True)
    with open(install_log, "w", encoding="utf-8") as f:
        for cmd in ([sys.executable, "-m", "venv", "--clear", venv],
                    [python, "-m", "pip", "install", "--quiet", *REQUIREMENTS[peer]]):
            result = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
            if result.returncode:
                return None, (f"install failed (`{' '.join(cmd[-3:])}` exit "
                              f"{result.returncode}; see {install_log})")
    with open(marker, "w", encoding="utf-8") as f:
        f.write(wanted)
    seconds = time.perf_counter() - start
    log(f"[{peer}] installed in {seconds:.0f} s")
    return python, f"installed in {seconds:.0f} s"


def child_environment(*dropped: str) -> dict:
    """A measured child process's environment: this one's without `dropped` and a
    user's JAX compilation cache settings, its output unbuffered, JAX on the CPU."""
    env = dict(os.environ)
    for name in (*dropped, *JAX_CACHE_ENVS):
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def peer_environment() -> dict:
    """A peer worker's environment: this one's, less what belongs to arl's process (its
    path, the tests' fake devices, a JAX compilation cache: a peer runs with its
    library's defaults), plus the host settings every side gets."""
    env = child_environment("PYTHONPATH", "XLA_FLAGS")
    # arl's host settings (`arl.runs.process_settings`) for every side: freed memory kept
    # mapped (mallopt, set before the worker starts) and, for a JAX peer, computations
    # inline (torch runs every op on the calling thread anyway).
    env["GLIBC_TUNABLES"] = process_settings.GLIBC_TUNABLES
    env["ARL_PEERS_INLINE_DISPATCH"] = "1"
    return env


class WorkerRunner:
    """A peer's worker process; `step()` asks for one training step and returns its
    timings. Raises RuntimeError (with the worker's one-line reason) when it fails."""

    def __init__(self, peer: str, python: str, setting: protocol.Setting, checkpoint: str,
                 warmup: int, log_path: str, timeout: float, script: str | None = None,
                 env: dict | None = None):
        self.name = peer
        self.timeout = timeout
        self._log = open(log_path, "w", encoding="utf-8")
        command = [python, script or os.path.join(WORKER_DIR, f"{peer}_worker.py"),
                   "--setting", setting.to_json(), "--checkpoint", checkpoint,
                   "--warmup", str(warmup)]
        env = peer_environment() if env is None else env
        self.launched = time.perf_counter()  # `ready_s` counts from here
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True, bufsize=1, env=env)
        self.log_path = log_path
        self.ready = None
        self.ready_s = None  # seconds from the launch to reading the "ready" line

    def wait_ready(self, timeout: float) -> dict:
        self.ready = self._expect("ready", timeout)
        self.ready_s = self._received - self.launched
        return self.ready

    def _expect(self, event: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise RuntimeError(f"no '{event}' within {timeout:.0f} s (log: {self.log_path})")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5.0))
            if not ready:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited with code {self.proc.returncode} "
                                       f"(log: {self.log_path})")
                continue
            line = self.proc.stdout.readline()
            self._received = time.perf_counter()
            if not line:
                self.proc.wait()
                raise RuntimeError(f"worker exited with code {self.proc.returncode} "
                                   f"(log: {self.log_path})")
            message = protocol.parse_event(line)
            if message is None:
                continue
            if message["event"] == "error":
                self.close()
                raise RuntimeError(f"{message['message']} (log: {self.log_path})")
            if message["event"] == event:
                return message

    def step(self) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": "step"}) + "\n")
        self.proc.stdin.flush()
        return self._expect("step", self.timeout)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()
        self._log.close()
