"""Which isolation layers `run_python` gets on this machine: `SandboxCapabilities` and
`sandbox_capabilities(python)`, which probes the candidates from strongest to weakest by
running a trivial program through the sandbox itself (once per interpreter, cached).
The layers: `arl.tools.sandbox` and docs/tools.md."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import sys
import threading

from arl.tools import seccomp

_log = logging.getLogger("arl.tools.sandbox")


@dataclasses.dataclass(frozen=True)
class SandboxCapabilities:
    """Which layers `run_python` uses on this machine (probed once per interpreter path;
    see the module docstring). The audit hooks are always on."""

    user_namespace: bool = False      # non-root: unshare --user --map-root-user
    network_namespace: bool = False
    pid_namespace: bool = False
    mount_namespace: bool = False     # the minimal root (`arl.tools.rootfs`), pivot_root
    uid_drop: bool = False            # root: runs as an ephemeral unprivileged uid
    seccomp: bool = False             # the system-call filter (`arl.tools.seccomp`)
    unshare_path: str | None = None

    @property
    def kernel_boundary(self) -> bool:
        """Whether the kernel, not the audit hooks, bounds what the program can reach:
        the minimal root, the seccomp filter, no network and a private PID namespace."""
        return (self.mount_namespace and self.seccomp and self.network_namespace
                and self.pid_namespace)

    def describe(self) -> str:
        """One line: the layers that are on, and those that are off."""
        layers = {"minimal root": self.mount_namespace, "seccomp": self.seccomp,
                  "network namespace": self.network_namespace,
                  "PID namespace": self.pid_namespace,
                  "unprivileged uid": self.uid_drop or self.user_namespace}
        on = [name for name, active in layers.items() if active] + ["audit hooks"]
        off = [name for name, active in layers.items() if not active]
        return "on: " + ", ".join(on) + ("; off: " + ", ".join(off) if off else "")

    @property
    def unshare_args(self) -> tuple[str, ...]:
        if not self.unshare_path:
            return ()
        args = [self.unshare_path]
        if self.user_namespace:
            args += ["--user", "--map-root-user"]
        if self.network_namespace:
            args += ["--net"]
        if self.pid_namespace:
            args += ["--pid", "--fork", "--kill-child"]
        if self.mount_namespace:
            args += ["--mount", "--ipc", "--uts"]
        return tuple(args) + ("--",) if len(args) > 1 else ()


def _find_executable(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for directory in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK):
            return path
    return None


def _candidate_capabilities() -> list[SandboxCapabilities]:
    """From strongest to weakest; the first that runs a probe program is used."""
    linux = sys.platform.startswith("linux")
    unshare = _find_executable("unshare") if linux else None
    root = os.geteuid() == 0
    filtered = linux and seccomp.seccomp_filter() is not None
    candidates = []
    if unshare:
        full = SandboxCapabilities(
            user_namespace=not root, network_namespace=True, pid_namespace=True,
            mount_namespace=seccomp.pivot_root_number() is not None, uid_drop=root,
            seccomp=filtered, unshare_path=unshare)
        candidates.append(full)
        candidates.append(dataclasses.replace(full, seccomp=False))
        candidates.append(dataclasses.replace(full, mount_namespace=False))
        candidates.append(dataclasses.replace(full, mount_namespace=False,
                                              pid_namespace=False))
    if filtered:
        candidates.append(SandboxCapabilities(uid_drop=root, seccomp=True))
    candidates.append(SandboxCapabilities(uid_drop=root))
    if root:
        candidates.append(SandboxCapabilities())
    return list(dict.fromkeys(candidates))


_capabilities_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _probe_capabilities(python: str) -> SandboxCapabilities:
    from arl.tools import sandbox  # pylint: disable=import-outside-toplevel (a cycle)
    limits = sandbox.SandboxLimits(wall_time_s=10.0)
    failures = []
    for candidate in _candidate_capabilities():
        for _ in range(2):  # a second try, so that a transient failure does not weaken it
            result = sandbox._execute(  # pylint: disable=protected-access
                "print(6 * 7)", limits, python, candidate, audit_hooks=True)
            if result.status is sandbox.Status.OK and result.stdout == "42\n":
                if failures:
                    _log.warning("arl.tools.sandbox: using the weaker isolation %s; stronger "
                                 "candidates failed: %s", candidate, "; ".join(failures))
                return candidate
        failures.append(f"{candidate.unshare_args or 'no namespaces'}: {result.observation}")
    _log.error("arl.tools.sandbox: no isolation works with %s: %s", python, "; ".join(failures))
    return SandboxCapabilities()  # the last resort: each result will say what fails


def sandbox_capabilities(python: str | None = None) -> SandboxCapabilities:
    """The isolation `run_python` uses with interpreter `python` (default: this one).
    The first call probes the candidates (a few tens of ms); later calls are cached."""
    python = resolve_python(python)
    with _capabilities_lock:
        return _probe_capabilities(python)


def resolve_python(python: str | None) -> str:
    if python is None:
        return os.path.realpath(sys.executable)
    if not isinstance(python, str) or not os.access(python, os.X_OK):
        raise ValueError(f"python must be the path of an executable interpreter, got "
                         f"{python!r}")
    return python
