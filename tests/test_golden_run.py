"""The refactor guard: every shipped config (reduced) logs the recorded metrics, bit for
bit (tests/golden_run.py says how the cases are built and how to record them again)."""

from __future__ import annotations

import math

import pytest

from tests import golden_run

# Independent runs: let pytest-xdist spread them over both workers (tests/conftest.py).
SPREAD_OVER_WORKERS = True


def _close(want, got, exact: bool) -> bool:
    if want == got or (isinstance(want, float) and math.isnan(want) and isinstance(got, float)
                       and math.isnan(got)):
        return True
    if exact or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                        for x in (want, got)):
        return False
    return math.isclose(got, want, rel_tol=golden_run.CROSS_HOST_RTOL,
                        abs_tol=golden_run.CROSS_HOST_ATOL)


def _differences(want: list[dict], got: list[dict], exact: bool = True) -> list[str]:
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
            elif not _close(w[key], g[key], exact):
                out.append(f"step {step}: {key} = {g[key]!r}, recorded {w[key]!r}")
    return out


# Five cases run with `pytest -m slow` (default-suite time budget; the eight default cases
# take ~3 CPU-minutes): the calculator tool env, the ERPO mixture, the Llama config,
# Dr.GRPO and REINFORCE++ on frozen lake in bfloat16 (the longest case, ~70 s; the whole
# CI run reached 14 of its 15 minutes with it), whose code paths default tests check
# otherwise (tests/envs, tests/models, tests/algorithms, tests/test_train.py,
# tests/test_learning_reduced.py).
SLOW_CASES = ("drgrpo_guess_number", "erpo_mixture", "grpo_calculator", "llama_calculator",
              "reinforce_pp_whiten_turns")


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CASES else name
    for name in sorted(golden_run.CASES)])
def test_golden_run(name, tmp_path):
    got = golden_run.run_case(name, str(tmp_path))
    recorded_on, here = golden_run.recorded_on(), golden_run.host_signature()
    exact = recorded_on == here
    differences = _differences(golden_run.load_golden(name), got, exact)
    how = ("bit for bit" if exact else
           f"to rtol {golden_run.CROSS_HOST_RTOL} / atol {golden_run.CROSS_HOST_ATOL}: "
           f"recorded on {recorded_on}, running on {here}")
    assert not differences, (f"{name}: {len(differences)} differences ({how}):\n"
                             + "\n".join(differences[:40]))


def test_another_processor_compares_to_a_tolerance():
    """Off the recording processor, rounding-level moves pass and real ones are reported;
    integers and strings still compare exactly."""
    want = [{"step": 1, "policy/approx_kl_k3": 1.2144e-4, "loss/total": 0.36,
             "reward_mean": 0.5, "kept": 12}]
    rounding = [{"step": 1, "policy/approx_kl_k3": 1.2111e-4, "loss/total": 0.36001,
                 "reward_mean": 0.5, "kept": 12}]
    assert _differences(want, rounding, exact=False) == []
    assert len(_differences(want, rounding, exact=True)) == 2
    changed = [{"step": 1, "policy/approx_kl_k3": 1.2144e-4, "loss/total": 0.36,
                "reward_mean": 0.5625, "kept": 13}]
    assert _differences(want, changed, exact=False) == [
        "step 1: kept = 13, recorded 12", "step 1: reward_mean = 0.5625, recorded 0.5"]


def test_host_signature_names_the_processor():
    signature = golden_run.host_signature()
    assert signature == golden_run.host_signature() and "cores" in signature


def test_differences_catch_one_ulp():
    """The comparison is exact: a metric one float32 ulp off is reported."""
    want = [{"step": 1, "loss/total": 0.25}]
    got = [{"step": 1, "loss/total": float.fromhex("0x1.000002p-2")}]
    assert _differences(want, got) == ["step 1: loss/total = 0.2500000298023224, "
                                       "recorded 0.25"]
