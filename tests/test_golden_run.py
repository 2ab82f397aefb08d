"""The refactor guard: every shipped config (reduced) logs the recorded metrics, bit for
bit on a processor with a recording of the case, and to the measured per-metric
tolerances elsewhere (tests/golden_run.py says how the cases are built, how to record
them again and how the tolerances are measured)."""

from __future__ import annotations

import pytest

from tests import golden_run

# Independent runs: let pytest-xdist spread them over both workers (tests/conftest.py).
SPREAD_OVER_WORKERS = True


def _differences(want: list[dict], got: list[dict],
                 tolerances: dict[str, dict] | None = None) -> list[str]:
    """What `got` logs differently from `want`: bit for bit when `tolerances` is None,
    else each metric to tolerances.get(metric) (none: MIN_RTOL)."""
    if len(want) != len(got):
        return [f"{len(got)} records logged, {len(want)} recorded"]
    out = []
    for w, g in zip(want, got):
        step = w["step"]
        for key in sorted(set(w) | set(g)):
            tolerance = None if tolerances is None else tolerances.get(key, {})
            if key not in g:
                out.append(f"step {step}: {key} missing")
            elif key not in w:
                out.append(f"step {step}: {key} not recorded")
            elif not golden_run.close(w[key], g[key], tolerance):
                out.append(f"step {step}: {key} = {g[key]!r}, recorded {w[key]!r}"
                           + ("" if tolerance is None else f" (measured room {tolerance})"))
    return out


def compare(name: str, got: list[dict], here: str) -> tuple[list[str], str]:
    """(differences, how compared) of case `name`'s records `got` on processor `here`:
    bit for bit with this processor's recording, else to the measured tolerances with the
    closest recording."""
    recorded = golden_run.recordings(name)
    assert recorded, f"{name}: no recording (python -m tests.golden_run --record {name})"
    if here in recorded:
        return _differences(recorded[here], got), "bit for bit"
    tolerances = golden_run.tolerances()
    attempts = {host: _differences(records, got, tolerances)
                for host, records in recorded.items()}
    closest = min(attempts, key=lambda host: len(attempts[host]))
    return attempts[closest], (f"to the measured per-metric tolerances (tests/golden/"
                               f"tolerances.json): no recording on {here}; closest recorded "
                               f"on {closest}")


# Five cases run with `pytest -m slow` (default-suite time budget; the nine default cases
# take ~3.5 CPU-minutes, ppo_clipping ~20 CPU-s of it): the calculator tool env, the ERPO mixture, the Llama config,
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
    differences, how = compare(name, got, golden_run.host_signature())
    assert not differences, (f"{name}: {len(differences)} differences ({how}):\n"
                             + "\n".join(differences[:40]))


def test_another_processor_compares_to_measured_tolerances():
    """Off the recording processors each metric has its measured room: rounding within it
    passes, more than it (or any move of a metric that rounding never moved) fails;
    integers and strings compare exactly."""
    want = [{"step": 1, "policy/approx_kl_k3": 1.2144e-4, "loss/total": 0.36,
             "reward_mean": 0.5, "kept": 12}]
    tolerances = {"policy/approx_kl_k3": {"rtol": 1e-2, "atol": 1e-9}}
    rounding = [{"step": 1, "policy/approx_kl_k3": 1.2111e-4, "loss/total": 0.36,
                 "reward_mean": 0.5, "kept": 12}]
    assert _differences(want, rounding, tolerances) == []
    assert len(_differences(want, rounding)) == 1
    changed = [{"step": 1, "policy/approx_kl_k3": 1.25e-4, "loss/total": 0.36001,
                "reward_mean": 0.5625, "kept": 13}]
    assert [d.split(" =")[0] for d in _differences(want, changed, tolerances)] == [
        "step 1: kept", "step 1: loss/total", "step 1: policy/approx_kl_k3",
        "step 1: reward_mean"]


def test_comparison_picks_this_processors_recording(monkeypatch):
    """Bit for bit against the recording of this processor when there is one; else the
    closest recording within the tolerances."""
    recorded = {"cpu A": [{"step": 1, "loss": 0.5}], "cpu B": [{"step": 1, "loss": 0.5001}]}
    monkeypatch.setattr(golden_run, "recordings", lambda name: recorded)
    monkeypatch.setattr(golden_run, "tolerances", lambda: {"loss": {"rtol": 1e-3}})
    got = [{"step": 1, "loss": 0.5001}]
    assert compare("case", got, "cpu B") == ([], "bit for bit")
    assert compare("case", got, "cpu A")[0] == ["step 1: loss = 0.5001, recorded 0.5"]
    assert compare("case", got, "cpu C")[0] == []
    assert compare("case", [{"step": 1, "loss": 0.51}], "cpu C")[0] != []


def test_tolerances_are_the_measured_spread_times_a_factor():
    """Relative and absolute spread per metric, the largest over cases and steps; a metric
    that never moved gets none (it compares to MIN_RTOL)."""
    runs = [[{"step": 1, "kl": 1.0e-4, "loss": 0.25}, {"step": 2, "kl": 4e-9, "loss": 0.5}],
            [{"step": 1, "kl": 1.02e-4, "loss": 0.25}, {"step": 2, "kl": -4e-9, "loss": 0.5}]]
    measured = golden_run.spread(runs)
    assert set(measured) == {"kl"} and measured["kl"]["rtol"] == 2.0
    assert abs(measured["kl"]["atol"] - 2e-6) < 1e-15
    other_case = {"kl": {"rtol": 0.5, "atol": 1e-5}, "grad_norm": {"rtol": 1e-7, "atol": 1e-7}}
    factor = golden_run.SPREAD_FACTOR
    assert golden_run.pooled_tolerances([measured, other_case]) == {
        "grad_norm": {"rtol": 1e-7 * factor, "atol": 1e-7 * factor},
        "kl": {"rtol": 2.0 * factor, "atol": 1e-5 * factor}}
    assert golden_run.close(1e-4, 1e-4 + 1e-5, {"rtol": 1e-3, "atol": 2e-5})
    assert not golden_run.close(0.3, 0.31, {"rtol": 1e-3, "atol": 2e-5})
    assert not golden_run.close(3, "3", {"rtol": 1.0, "atol": 1.0})


def test_every_case_has_a_recording_and_the_tolerances_are_measured():
    for name in golden_run.CASES:
        assert golden_run.recordings(name), name
    tolerances = golden_run.tolerances()
    assert tolerances and all(set(t) == {"rtol", "atol"} for t in tolerances.values())


def test_host_signature_names_the_processor():
    signature = golden_run.host_signature()
    assert signature == golden_run.host_signature() and "cores" in signature
    assert golden_run.processor_dir_name(signature) != golden_run.processor_dir_name(
        signature.replace("cores", "cores "))


def test_differences_catch_one_ulp():
    """On a recording processor the comparison is exact: a metric one float32 ulp off is
    reported."""
    want = [{"step": 1, "loss/total": 0.25}]
    got = [{"step": 1, "loss/total": float.fromhex("0x1.000002p-2")}]
    assert _differences(want, got) == ["step 1: loss/total = 0.2500000298023224, "
                                       "recorded 0.25"]
