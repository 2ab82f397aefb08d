"""What the sandbox's minimal root file system holds, for one interpreter.

The supervisor (`arl.tools._sandbox_child`) builds the root in its private mount
namespace from this plan: a read-only tmpfs with, bind-mounted read-only at their own
paths, the interpreter, the directories of its `sys.path` under `-I -S` (the standard
library and lib-dynload; any site-packages / dist-packages inside them covered by an
empty read-only tmpfs), the shared libraries the interpreter and the allowed extension
modules link against (`ldd`), /dev/null (all read-only); then a private /proc (this PID
namespace's processes only) and the size-limited tmpfs at /tmp that is the program's
working directory and its only writable place. Nothing else of the machine exists
inside: no /etc, no /home, no /run, no other world-readable or world-writable path.

Computed once per interpreter (a subprocess and one `ldd` call, ~0.1 s) and cached.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import subprocess

_PATHS_PROGRAM = "import json, sys; print(json.dumps(sys.path))"
MASKED_SUBDIRECTORIES = ("site-packages", "dist-packages")
# /dev/null only: os.urandom and random use getrandom(2); a program could write the host's
# /dev/urandom (0666), which a read-only mount does not prevent for a device.
DEVICES = ("/dev/null",)


@dataclasses.dataclass(frozen=True)
class RootPlan:
    """binds: (source, target, is_directory) read-only bind mounts; masks: directories
    (inside a bind) covered by an empty read-only tmpfs; devices: device nodes, bound
    read-only at their own paths."""

    binds: tuple[tuple[str, str, bool], ...]
    masks: tuple[str, ...]
    devices: tuple[str, ...] = DEVICES

    def to_json(self) -> dict:
        return {"binds": [list(b) for b in self.binds], "masks": list(self.masks),
                "devices": list(self.devices)}


def _is_below(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _library_paths(files: list[str]) -> list[str]:
    """The shared libraries `files` load (ldd's resolved paths, the dynamic loader
    included), or raises OSError when ldd is missing or fails."""
    ldd = shutil.which("ldd") or "/usr/bin/ldd"
    out = subprocess.run([ldd] + files, capture_output=True, text=True, timeout=60,
                         env={"LC_ALL": "C"})
    if out.returncode not in (0, 1) or not out.stdout:
        raise OSError(f"ldd failed: {out.stderr.strip()[:200]}")
    paths = []
    for line in out.stdout.splitlines():
        line = line.strip()
        if "=>" in line:
            line = line.split("=>", 1)[1].strip()
        path = line.split(" (", 1)[0].strip()
        if path.startswith("/") and os.path.isfile(path) and path not in paths:
            paths.append(path)
    return paths


@functools.lru_cache(maxsize=None)
def root_plan(python: str, blocked_modules: frozenset[str] = frozenset()) -> RootPlan:
    """The plan for interpreter `python` (a resolved path). Extension modules whose name
    is in `blocked_modules` bring no libraries in (e.g. no libssl, no libsqlite3)."""
    out = subprocess.run([python, "-I", "-S", "-c", _PATHS_PROGRAM], capture_output=True,
                         text=True, timeout=60, env={})
    if out.returncode != 0:
        raise OSError(f"{python} could not list its sys.path: {out.stderr.strip()[:200]}")
    directories = []
    for entry in json.loads(out.stdout):
        real = os.path.realpath(entry)
        if os.path.isdir(real) and not any(_is_below(real, d) for d in directories):
            directories = [d for d in directories if not _is_below(d, real)] + [real]
    extensions = []
    for directory in directories:
        for root, subdirectories, names in os.walk(directory):
            subdirectories[:] = [d for d in subdirectories if d not in MASKED_SUBDIRECTORIES]
            extensions += [os.path.join(root, n) for n in sorted(names)
                           if n.endswith(".so") and n.split(".")[0] not in blocked_modules]
    binary = os.path.realpath(python)
    binds = [(binary, binary, False)]
    binds += [(d, d, True) for d in directories]
    for library in _library_paths([binary] + extensions):
        real = os.path.realpath(library)
        for target in dict.fromkeys((library, real)):
            if not any(_is_below(target, d) for d in directories):
                binds.append((real, target, False))
    masks = [os.path.join(d, sub) for d in directories for sub in MASKED_SUBDIRECTORIES
             if os.path.isdir(os.path.join(d, sub))]
    return RootPlan(binds=tuple(dict.fromkeys(binds)), masks=tuple(masks))
