"""notebooks/quickstart.ipynb executes top to bottom (tiny size) with nbclient."""

from __future__ import annotations

import os
import re

import nbformat
import pytest
from nbclient import NotebookClient

_NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "notebooks", "quickstart.ipynb")


def _text(cell):
    return "".join(out.get("text", "") for out in cell.get("outputs", []))


def test_notebook_is_valid_and_has_an_install_cell():
    notebook = nbformat.read(_NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    first_code = next(c for c in notebook.cells if c.cell_type == "code")
    assert 'find_spec("arl") is None' in first_code.source and "pip" in first_code.source
    # Stored with the outputs of one run at the default size (the README links it): the
    # final metrics, the learning curve as a PNG and a transcript.
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert "size: small" in _text(code[1])
    assert re.search(r"step 100: reward_mean=\d\.\d+ success_rate=\d\.\d+", _text(code[2]))
    assert any("image/png" in out.get("data", {}) for out in code[3]["outputs"])
    assert "[agent]" in _text(code[4])
    readme = open(os.path.join(os.path.dirname(os.path.dirname(_NOTEBOOK)), "README.md"),
                  encoding="utf-8").read()
    assert "(notebooks/quickstart.ipynb)" in readme


def test_the_notebooks_config_is_the_quickstart_config(tmp_path):
    """The notebook spells its config out (it runs from a plain install, without the
    repository's configs/): it is configs/grpo_bandit.py's, key for key."""
    import json  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    from configs import grpo_bandit  # pylint: disable=import-outside-toplevel

    notebook = nbformat.read(_NOTEBOOK, as_version=4)
    cell = [c for c in notebook.cells if c.cell_type == "code"][1]
    program = cell.source + "\nprint('@@' + config.to_json(sort_keys=True))\n"
    env = {**os.environ, "ARL_NOTEBOOK_SIZE": "small",
           "ARL_NOTEBOOK_WORKDIR": str(tmp_path / "run")}
    done = subprocess.run([sys.executable, "-c", program], env=env, text=True,
                          capture_output=True, timeout=300, check=False,
                          cwd=os.path.dirname(_NOTEBOOK))
    assert done.returncode == 0, done.stderr[-3000:]
    line = [l for l in done.stdout.splitlines() if l.startswith("@@")][-1]
    assert json.loads(line[2:]) == json.loads(grpo_bandit.get_config().to_json(sort_keys=True))


@pytest.mark.slow  # a fresh kernel compiles the train step and the evaluation: ~1-2 min
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("ARL_NOTEBOOK_SIZE", "tiny")
    monkeypatch.setenv("ARL_NOTEBOOK_WORKDIR", str(tmp_path / "run"))
    notebook = nbformat.read(_NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": os.path.dirname(_NOTEBOOK)}}).execute()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert "size: tiny" in _text(code[1])
    assert "step 2: reward_mean=" in _text(code[2])
    assert any("image/png" in out.get("data", {}) for out in code[3]["outputs"])
    transcript = _text(code[4])
    assert "step_000002.txt" in transcript and "[agent]" in transcript and "arms:" in transcript
    assert (tmp_path / "run" / "checkpoints").is_dir()
