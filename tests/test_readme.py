"""The README's code examples run as written (the ten-line Python example, composition
example, custom environment, a Python-tool environment, custom algorithm)."""

from __future__ import annotations

import os
import re

import pytest

_README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "README.md")
_TESTED_SECTIONS = ("## Python", "## Compose `arl.algorithms` into your own train step",
                    "## Add an environment", "## Train with a Python tool",
                    "## Add an algorithm")


def _python_blocks(section_title):
    text = open(_README, encoding="utf-8").read()
    start = text.index(section_title)
    end = text.find("\n## ", start + len(section_title))
    section = text[start:end if end >= 0 else len(text)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


@pytest.mark.parametrize("title", _TESTED_SECTIONS)
def test_readme_example_runs(title, capsys):
    blocks = _python_blocks(title)
    assert len(blocks) == 1, title
    exec(compile(blocks[0], f"README.md:{title}", "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    if title == "## Python":
        assert re.search(r"^step 2: reward_mean -?\d\.\d{3}$", out, flags=re.M), out
    elif title.startswith("## Compose"):
        assert re.search(r"mean reward \d\.\d\d -> \d\.\d\d \(optimum 6\)", out), out
    elif title == "## Add an environment":
        assert "[env]   say" in out and "-- success" in out, out
    elif title == "## Train with a Python tool":
        assert "[env]   collatz steps of" in out and "[env]   correct" in out, out
        assert re.search(r"collatz: demonstrator success \d\.\d\d", out), out
    else:
        assert re.search(r"rloo_std: loss -?\d+\.\d{3}, success \d\.\d\d", out), out


def test_ci_runs_the_readme_test_command():
    text = open(_README, encoding="utf-8").read()
    quickstart = text[text.index("## Quickstart"):]
    commands = re.search(r"```bash\n(.*?)```", quickstart, flags=re.DOTALL).group(1)
    install, test = commands.strip().splitlines()
    assert install.startswith('pip install -e ".[train]" && python -m experiments.train ')
    ci = open(os.path.join(os.path.dirname(_README), ".ci", "run"), encoding="utf-8").read()
    assert test in ci.splitlines(), (test, ci)
