"""Every file under examples/ runs as a file (`runpy`, as `python examples/<file>` would
run it) and prints what it claims; examples/bring_your_task/ is run by
tests/test_bring_your_task.py. The README links every example."""

from __future__ import annotations

import glob
import os
import re
import runpy

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXAMPLES = os.path.join(_ROOT, "examples")

# What each example prints when it works (each also asserts its own numbers).
_EXPECTED_OUTPUT = {
    "compose_kernels.py": [r"mean reward \d\.\d\d -> \d\.\d\d \(optimum 6\)"],
    "custom_environment.py": [r"\[env\]   say", r"-- success"],
    "python_tool.py": [r"\[env\]   collatz steps of", r"\[env\]   correct",
                       r"collatz: demonstrator success \d\.\d\d"],
    "custom_algorithm.py": [r"rloo_std: loss -?\d+\.\d{3}, success \d\.\d\d"],
}


def test_every_example_is_checked_and_linked_from_the_readme():
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(_EXAMPLES, "*.py")))
    assert files == sorted(_EXPECTED_OUTPUT)
    readme = open(os.path.join(_ROOT, "README.md"), encoding="utf-8").read()
    for name in files + ["bring_your_task/"]:
        assert f"(examples/{name})" in readme, name


@pytest.mark.parametrize("name", sorted(_EXPECTED_OUTPUT))
def test_example_runs_as_a_file(name, capsys):
    runpy.run_path(os.path.join(_EXAMPLES, name), run_name="__main__")
    out = capsys.readouterr().out
    for pattern in _EXPECTED_OUTPUT[name]:
        assert re.search(pattern, out), (name, pattern, out)
