"""`arl.algorithms` stands alone: importing it loads no other layer of arl and no flax or
optax, and examples/compose_kernels.py runs where only jax, chex and arl (without its
extras) are installed."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LOADED = ("import arl.algorithms, sys; print(sorted(m for m in sys.modules "
           "if m.split('.')[0] in {'flax', 'optax', 'arl'}))")


def _run(python, code, env=None, cwd=_ROOT):
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=cwd,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_of_the_kernels_loads_no_other_layer():
    env = dict(os.environ, PYTHONPATH=_ROOT)
    loaded = eval(_run(sys.executable, _LOADED, env).strip().splitlines()[-1])
    assert "arl.algorithms" in loaded and "arl.algorithms.losses" in loaded, loaded
    # arl.backend (the backend's choices, jax only) is the one other module they read.
    others = [m for m in loaded if m != "arl" and not m.startswith("arl.algorithms")]
    assert others == ["arl.backend"], others


def test_the_top_level_names_load_on_first_use():
    env = dict(os.environ, PYTHONPATH=_ROOT)
    out = _run(sys.executable,
               "import arl, sys; assert 'arl.trainers' not in sys.modules; "
               "c = arl.default_config(); print(arl.build.__module__, "
               "arl.Algorithm.__module__, arl.register_algorithm.__module__, "
               "arl.TokenTrainer.__name__, arl.models.__name__, c.algorithm, "
               "'build' in dir(arl))", env)
    assert out.split() == ["arl.trainers", "arl.algorithm_table", "arl.algorithm_table",
                           "TokenTrainer", "arl.models", "grpo", "True"], out
    with pytest.raises(AssertionError, match="has no attribute 'no_such_name'"):
        _run(sys.executable, "import arl; arl.no_such_name", env)


def _requirements(distribution: str, seen: set[str]) -> None:
    """`distribution` and what it requires without extras, transitively (what pip
    installs for it)."""
    name = re.sub(r"[-_.]+", "-", distribution).lower()
    if name in seen:
        return
    seen.add(name)
    for requirement in importlib.metadata.requires(distribution) or ():
        if "extra ==" in requirement:
            continue
        marker = requirement.split(";", 1)[1] if ";" in requirement else ""
        if marker and ("python_version" in marker and "3.12" in marker
                       or "sys_platform" in marker and "win" in marker):
            continue  # setuptools on Python >= 3.12, Windows-only packages
        _requirements(re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0], seen)


def _link_distribution(distribution: str, site: str) -> None:
    """Makes `distribution`, as installed here, importable from `site` (symbolic links to
    its top-level files and its metadata), so no network is needed."""
    dist = importlib.metadata.distribution(distribution)
    tops = {str(f).split("/")[0] for f in dist.files or () if not str(f).startswith("..")}
    for top in tops:
        source = os.path.join(str(dist.locate_file("")), top)
        target = os.path.join(site, top)
        if os.path.exists(source) and not os.path.exists(target) and top != "__pycache__":
            os.symlink(source, target)


@pytest.mark.slow
def test_compose_example_runs_with_only_jax_chex_and_arl(tmp_path):
    example = open(os.path.join(_ROOT, "examples", "compose_kernels.py"),
                   encoding="utf-8").read()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = _run(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                cwd=str(tmp_path)).strip()
    installed: set[str] = set()
    for distribution in ("jax", "jaxlib", "chex"):
        _requirements(distribution, installed)
    for distribution in sorted(installed):
        _link_distribution(distribution, site)
    # arl itself as an editable install without extras does it: its root on the path.
    with open(os.path.join(site, "arl.pth"), "w", encoding="utf-8") as f:
        f.write(_ROOT + "\n")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path),
           "JAX_PLATFORMS": "cpu"}
    have = _run(python, "import importlib.util as u; print([m for m in ('flax', 'optax', "
                "'ml_collections', 'chex', 'jax') if u.find_spec(m)])", env,
                cwd=str(tmp_path))
    assert have.strip() == "['chex', 'jax']", (have, sorted(installed))
    script = tmp_path / "compose.py"
    script.write_text(example)
    result = subprocess.run([python, str(script)], capture_output=True, text=True,
                            cwd=str(tmp_path), env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    assert re.search(r"mean reward \d\.\d\d -> \d\.\d\d \(optimum 6\)", result.stdout)
