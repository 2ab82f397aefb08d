"""The README's ten-line Python example runs as written, its quickstart's test command is
the one CI runs, and every relative link in README.md and docs/*.md resolves."""

from __future__ import annotations

import glob
import os
import re

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_README = os.path.join(_ROOT, "README.md")


def _python_blocks(section_title):
    text = open(_README, encoding="utf-8").read()
    start = text.index(section_title)
    end = text.find("\n## ", start + len(section_title))
    section = text[start:end if end >= 0 else len(text)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_readme_python_example_runs(capsys):
    blocks = _python_blocks("## Python")
    assert len(blocks) == 1
    exec(compile(blocks[0], "README.md:## Python", "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert re.search(r"^step 2: reward_mean -?\d\.\d{3}$", out, flags=re.M), out


def test_ci_runs_the_readme_test_command():
    text = open(_README, encoding="utf-8").read()
    quickstart = text[text.index("## Quickstart"):]
    commands = re.search(r"```bash\n(.*?)```", quickstart, flags=re.DOTALL).group(1)
    install, test = commands.strip().splitlines()
    assert install.startswith('pip install -e ".[train]" && python -m experiments.train ')
    ci = open(os.path.join(_ROOT, ".ci", "run"), encoding="utf-8").read()
    assert test in ci.splitlines(), (test, ci)


def _relative_links(path):
    """The targets of the markdown links `[text](target)` in `path` that are files of the
    repository (not URLs, not in-page anchors), without their `#anchor`, outside code."""
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#", 1)[0] for t in targets
            if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


_PAGES = [_README] + sorted(glob.glob(os.path.join(_ROOT, "docs", "*.md")))


@pytest.mark.parametrize("page", _PAGES, ids=lambda p: os.path.relpath(p, _ROOT))
def test_relative_links_resolve(page):
    missing = [t for t in _relative_links(page)
               if not os.path.exists(os.path.join(os.path.dirname(page), t))]
    assert not missing, missing


def test_the_link_check_finds_a_missing_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[here](there.md) [site](https://x.org) [anchor](#a)\n"
                    "```\n[code](not_a_link.md)\n```\n")
    assert _relative_links(str(page)) == ["there.md"]
