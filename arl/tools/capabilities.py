"""Which isolation layers `run_python` can use: `SandboxCapabilities`, and the candidates
for this machine from strongest to weakest (`candidate_capabilities`), which
`arl.tools.sandbox.sandbox_capabilities` probes by running a trivial program through the
sandbox itself. The layers: `arl.tools.sandbox` and docs/tools.md."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys

from arl.tools import seccomp


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


def candidate_capabilities() -> list[SandboxCapabilities]:
    """From strongest to weakest; the first that runs a probe program is used."""
    linux = sys.platform.startswith("linux")
    unshare = _find_executable("unshare") if linux else None
    root = os.geteuid() == 0
    filtered = linux and seccomp.filter_program() is not None
    candidates = []
    if unshare:
        full = SandboxCapabilities(
            user_namespace=not root, network_namespace=True, pid_namespace=True,
            mount_namespace=seccomp.syscall_number("pivot_root") is not None,
            uid_drop=root, seccomp=filtered, unshare_path=unshare)
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


def resolve_python(python: str | None) -> str:
    if python is None:
        return os.path.realpath(sys.executable)
    if not isinstance(python, str) or not os.access(python, os.X_OK):
        raise ValueError(f"python must be the path of an executable interpreter, got "
                         f"{python!r}")
    return python
