"""CPU kernels written in C++, built on first use and called through XLA's FFI.

XLA:CPU runs a `lax.scan` as a while loop that pays a fixed cost per iteration (several
thunk launches, a carry copy): a recurrence over thousands of time steps with a few
flops per step is dominated by it. The same recurrence as a plain C++ loop, registered
as an XLA FFI target, runs inside the compiled program (a custom call, no host round
trip) at the speed of the loop itself. `arl.algorithms.gae` uses it on CPU
(`method="auto"` or `"native"`).

Build: the first call of a process compiles the kernel's source (shipped in this
package) with the system C++ compiler (`$CXX`, else `c++`) against the FFI headers of
the installed jaxlib, `-O3 -march=native`, into a cache directory (`$ARL_NATIVE_CACHE`,
else `$XDG_CACHE_HOME/arl/native`, else `~/.cache/arl/native`). The library's file name
hashes the source, the compiler, the flags, the jaxlib version and the CPU, so a cache
shared between machines or versions never loads a stale build; the file is written
under a temporary name and renamed, so concurrent processes never load a partial one.
Without a compiler, or with `ARL_NATIVE=0`, nothing is built and `available()` is False
(callers fall back to their XLA form, with a warning naming the reason when a build
failed).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from importlib import metadata, resources

import jax

# library -> (source file, {FFI target name: exported handler symbol})
LIBRARIES = {
    "gae": ("gae.cc", {"arl_masked_gae": "ArlMaskedGae",
                       "arl_masked_gae_boundaries": "ArlMaskedGaeBoundaries"}),
}
# Tried in order: the host's own instruction set first (its vector width and FMA, as
# XLA:CPU compiles for the host), a portable build where the compiler refuses it.
_FLAG_SETS = (
    ("-O3", "-march=native", "-ffp-contract=off"),
    ("-O3", "-ffp-contract=off"),
)
_COMMON_FLAGS = ("-std=c++17", "-shared", "-fPIC", "-w")

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[str, bool] = {}


def enabled() -> bool:
    """False when the environment sets ARL_NATIVE=0 (never build or load)."""
    return os.environ.get("ARL_NATIVE", "1").strip().lower() not in ("0", "false", "no")


def cache_dir() -> str:
    if os.environ.get("ARL_NATIVE_CACHE"):
        return os.environ["ARL_NATIVE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "arl", "native")


def _cpu_identity() -> str:
    """The CPU model and its feature flags: a -march=native build is only valid there."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags",
                                                            "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler_identity(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=60)
        return out.stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _jaxlib_version() -> str:
    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return jax.__version__


def _build(name: str) -> str:
    """Compiles library `name` into the cache (unless there already) and returns its path."""
    source_name, _ = LIBRARIES[name]
    source = resources.files(__package__).joinpath(source_name).read_bytes()
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler found (looked for `{compiler}`; set $CXX)")
    include = jax.ffi.include_dir()
    # Everything the build depends on but the flags, which each attempt adds.
    build = [source, _compiler_identity(compiler).encode(), _jaxlib_version().encode(),
             _cpu_identity().encode(), platform.machine().encode()]
    directory = cache_dir()
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(b"\0".join(
            build + [" ".join(flags + _COMMON_FLAGS).encode()])).hexdigest()[:20]
        path = os.path.join(directory, f"arl_{name}_{key}.so")
        if os.path.exists(path):
            return path
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            source_path = os.path.join(scratch, source_name)
            with open(source_path, "wb") as f:
                f.write(source)
            partial = os.path.join(scratch, "lib.so")
            command = [compiler, *flags, *_COMMON_FLAGS, f"-I{include}", source_path,
                       "-o", partial]
            started = time.perf_counter()
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if result.returncode == 0:
                os.replace(partial, path)
                _log.info("arl.native: built %r in %.1f s: %s", name,
                          time.perf_counter() - started, path)
                return path
            errors.append(f"`{' '.join(command)}` failed:\n{result.stderr[-2000:]}")
    raise RuntimeError("\n".join(errors))


def available(name: str) -> bool:
    """Builds (once), loads and registers library `name` for the CPU; True on success.

    Failures are reported once per process as a warning and cached: later calls return
    False at once.
    """
    if name not in LIBRARIES:
        raise ValueError(f"arl.native: unknown library {name!r}; allowed values: "
                         f"{', '.join(repr(k) for k in LIBRARIES)}")
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if not enabled():
            _loaded[name] = False
            return False
        try:
            library = ctypes.cdll.LoadLibrary(_build(name))
            for target, symbol in LIBRARIES[name][1].items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                            platform="cpu")
            _loaded[name] = True
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as error:
            warnings.warn(f"arl.native: the {name!r} kernel is unavailable, using its XLA "
                          f"form instead ({error}). Set ARL_NATIVE=0 to skip the build.",
                          RuntimeWarning, stacklevel=2)
            _loaded[name] = False
        return _loaded[name]
