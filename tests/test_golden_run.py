"""The refactor guard: every shipped config (reduced) logs the recorded metrics, bit for
bit (tests/golden_run.py says how the cases are built and how to record them again)."""

from __future__ import annotations

import math

import pytest

from tests import golden_run

# Independent runs: let pytest-xdist spread them over both workers (tests/conftest.py).
SPREAD_OVER_WORKERS = True


def _differences(want: list[dict], got: list[dict]) -> list[str]:
    if len(want) != len(got):
        return [f"{len(got)} records logged, {len(want)} recorded"]
    out = []
    for w, g in zip(want, got):
        step = w["step"]
        for key in sorted(set(w) | set(g)):
            if key not in g:
                out.append(f"step {step}: {key} missing")
            elif key not in w:
                out.append(f"step {step}: {key} not recorded")
            elif not (w[key] == g[key] or (isinstance(w[key], float) and math.isnan(w[key])
                                           and math.isnan(g[key]))):
                out.append(f"step {step}: {key} = {g[key]!r}, recorded {w[key]!r}")
    return out


# Four cases run with `pytest -m slow` (default-suite time budget; the nine default cases
# take ~4 CPU-minutes): the calculator tool env, the ERPO mixture, the Llama config and
# Dr.GRPO, whose code paths default tests check otherwise (tests/envs, tests/models,
# tests/test_learning_reduced.py).
SLOW_CASES = ("drgrpo_guess_number", "erpo_mixture", "grpo_calculator", "llama_calculator")


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CASES else name
    for name in sorted(golden_run.CASES)])
def test_golden_run(name, tmp_path):
    got = golden_run.run_case(name, str(tmp_path))
    differences = _differences(golden_run.load_golden(name), got)
    assert not differences, f"{name}: {len(differences)} differences:\n" + "\n".join(
        differences[:40])


def test_differences_catch_one_ulp():
    """The comparison is exact: a metric one float32 ulp off is reported."""
    want = [{"step": 1, "loss/total": 0.25}]
    got = [{"step": 1, "loss/total": float.fromhex("0x1.000002p-2")}]
    assert _differences(want, got) == ["step 1: loss/total = 0.2500000298023224, "
                                       "recorded 0.25"]
