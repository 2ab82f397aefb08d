"""The refactor guard: every shipped config (reduced) logs the recorded metrics, bit for
bit on a processor with a recording of the case; on any other, within rooms measured on
the processor itself, with what they cannot bound counted (tests/golden_run.py says how
the cases are built, how to record them again and how the rooms are measured)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from tests import golden_run

# Independent runs: let pytest-xdist spread them over both workers (tests/conftest.py).
SPREAD_OVER_WORKERS = True


class GoldenRoomWarning(UserWarning):
    """A golden case compared off its recording processors: which values its measured
    rooms could not bound (pytest lists these in its warnings summary)."""


def _differences(want: list[dict], got: list[dict]) -> list[str]:
    """What `got` logs differently from `want`, bit for bit."""
    return Comparison.of(want, got, None).differences


@dataclasses.dataclass
class Comparison:
    """Records `got` against recorded `want`: `differences` (each a line), and off a
    recording processor the values compared within a bounded room (`compared`) and
    those whose room spans the value (`unbounded`, 'metric@step', not compared)."""

    differences: list[str]
    compared: int = 0
    unbounded: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, want: list[dict], got: list[dict],
           rooms: list[dict[str, dict]] | None) -> "Comparison":
        """rooms None: bit for bit; else per record of `got` {metric: room}
        (`golden_run.rooms`), a metric with none (not a number) compared exactly."""
        if len(want) != len(got):
            return cls([f"{len(got)} records logged, {len(want)} recorded"])
        out = cls([])
        for index, (w, g) in enumerate(zip(want, got)):
            step = w["step"]
            for key in sorted(set(w) | set(g)):
                if key not in g:
                    out.differences.append(f"step {step}: {key} missing")
                    continue
                if key not in w:
                    out.differences.append(f"step {step}: {key} not recorded")
                    continue
                room = None if rooms is None else rooms[index].get(key)
                if room is not None and golden_run.says_nothing(w[key], room):
                    out.unbounded.append(f"{key}@{step}")
                    continue
                out.compared += key != "step"
                if not golden_run.close(w[key], g[key], room):
                    out.differences.append(
                        f"step {step}: {key} = {g[key]!r}, recorded {w[key]!r}"
                        + ("" if room is None else f" (room measured here: rtol "
                           f"{room['rtol']:.3g}, atol {room['atol']:.3g})"))
        return out


def within_rooms(recorded: dict[str, list[dict]], got: list[dict],
                 rooms: list[dict[str, dict]]) -> tuple[Comparison, str]:
    """(comparison, processor) of `got` with the closest of the `recorded` runs
    ({processor: records}), each value within its measured room."""
    attempts = {host: Comparison.of(records, got, rooms) for host, records in recorded.items()}
    closest = min(attempts, key=lambda host: len(attempts[host].differences))
    return attempts[closest], closest


def unable_to_say(name: str, comparison: Comparison) -> str | None:
    """The reason case `name` says nothing on this processor (None: it says something):
    no logged value was left with a room narrower than itself."""
    if comparison.compared or comparison.differences:
        return None
    return (f"{name}: no recording on this processor, and the rooms measured here span "
            f"all {len(comparison.unbounded)} logged values: the case says nothing here")


# Five cases run with `pytest -m slow` (default-suite time budget; the ten default cases
# take ~4.5 CPU-minutes on a recording processor, about 1.5 x that elsewhere, where each
# runs twice): the calculator tool env, the ERPO mixture, the Llama config,
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
    recorded = golden_run.recordings(name)
    assert recorded, f"{name}: no recording (python -m tests.golden_run --record {name})"
    got = golden_run.run_case(name, str(tmp_path / "as_is"))
    here = golden_run.recorded_here(name)
    if here is not None:
        differences = _differences(here, got)
        assert not differences, (f"{name}: {len(differences)} differences (bit for bit):\n"
                                 + "\n".join(differences[:40]))
        return
    perturbed = golden_run.run_case(name, str(tmp_path / "perturbed"), perturbed=True)
    comparison, closest = within_rooms(recorded, got, golden_run.rooms(got, perturbed))
    assert not comparison.differences, (
        f"{name}: {len(comparison.differences)} differences from the recording on "
        f"{closest}, beyond {golden_run.ROOM_FACTOR:g} x the spread measured here under "
        f"perturbed_rounding:\n" + "\n".join(comparison.differences[:40]))
    reason = unable_to_say(name, comparison)
    if reason:
        pytest.skip(reason)
    if comparison.unbounded:
        warnings.warn(GoldenRoomWarning(
            f"{name}: no recording on this processor; {comparison.compared} values "
            f"compared within rooms measured here, {len(comparison.unbounded)} not "
            f"(room as large as the value): {', '.join(comparison.unbounded)}"))


def test_rooms_are_the_measured_spread_so_far_times_a_factor():
    """Per record, ROOM_FACTOR x the largest relative and absolute difference of each
    metric between the two runs up to that record, a continuous metric's relative room at
    least ROOM_FACTOR x the median of those; what never moved, with the median at 0, gets
    MIN_RTOL and a continuous one MIN_ATOL; a decision never gets the median's room."""
    as_is = [{"step": 1, "kl": 1.0e-4, "loss": 0.25, "kept": 12, "reward_mean": 0.5,
              "env": "a"},
             {"step": 2, "kl": 4e-9, "loss": 0.5, "kept": 12, "reward_mean": 0.5, "env": "a"}]
    perturbed = [{"step": 1, "kl": 1.02e-4, "loss": 0.25, "kept": 12, "reward_mean": 0.5,
                  "env": "a"},
                 {"step": 2, "kl": 4e-9, "loss": 0.5 + 2 ** -24, "kept": 12,
                  "reward_mean": 0.5, "env": "a"}]
    factor, floor = golden_run.ROOM_FACTOR, golden_run.MIN_RTOL
    first, second = golden_run.rooms(as_is, perturbed)
    assert set(first) == set(second) == {"step", "kl", "loss", "kept", "reward_mean"}
    assert first["kl"]["rtol"] == pytest.approx(factor * 0.02 / 1.02)
    assert first["kl"]["atol"] == pytest.approx(factor * 2e-6)
    tiny = golden_run.MIN_ATOL
    assert first["loss"] == first["kept"] == {"rtol": floor, "atol": tiny}
    assert first["step"] == first["reward_mean"] == {"rtol": floor, "atol": 0.0}
    assert second["kl"] == first["kl"]  # the largest so far: step 2's kl did not move
    assert second["loss"]["atol"] == pytest.approx(factor * 2 ** -24)
    median = 2 ** -24 / 0.5  # of kept 0, loss 1.2e-7, kl 0.0196
    assert second["kept"] == {"rtol": pytest.approx(factor * median), "atol": tiny}
    assert second["loss"]["rtol"] == pytest.approx(factor * median)
    assert second["reward_mean"] == second["step"] == {"rtol": floor, "atol": 0.0}


def test_rooms_end_where_the_runs_take_other_sample_paths():
    """From the first record where the perturbation moved a decision (an episode
    statistic, a clip fraction) or where a clip binds, every room is UNBOUNDED."""
    def record(step, reward=0.5, clip=0.0, loss=0.3, kl=1e-9):
        return {"step": step, "eval_sampled/reward_mean": reward,
                "policy/clip_fraction_high": clip, "loss/total": loss,
                "policy/approx_kl_k3": kl}

    same = [record(1), record(2), record(3)]
    unbounded = golden_run.UNBOUNDED
    for at_2 in ((record(2, reward=0.5625), record(2)), (record(2, clip=0.01), record(2)),
                 (record(2, clip=0.01), record(2, clip=0.01))):
        first, second, third = golden_run.rooms(
            [record(1), at_2[0], record(3)], [record(1, kl=2e-9), at_2[1], record(3)])
        assert first["eval_sampled/reward_mean"] == first["policy/clip_fraction_high"] == {
            "rtol": golden_run.MIN_RTOL, "atol": 0.0}
        assert first["policy/approx_kl_k3"]["rtol"] == golden_run.ROOM_FACTOR * 0.5
        assert golden_run.says_nothing(1e-9, first["policy/approx_kl_k3"])
        assert all(room == unbounded for room in (*second.values(), *third.values()))
    assert not any(room == unbounded for r in golden_run.rooms(same, same) for room in r.values())
    assert golden_run.is_decision_metric("eval/success_rate")
    assert golden_run.is_decision_metric("reward_mean/bandit")
    assert golden_run.is_decision_metric("value/clip_fraction")
    assert not golden_run.is_decision_metric("loss/value")


def test_episode_metrics_name_what_rollout_metrics_logs():
    import jax.numpy as jnp
    from types import SimpleNamespace

    from arl.trainers import credit_assignment

    ones = jnp.ones((2,), jnp.int32)
    traj = SimpleNamespace(episode_return=jnp.ones((2,)), success=ones, num_turns=ones,
                           agent_mask=jnp.ones((2, 3)), length=ones, format_errors=ones,
                           env_ids=jnp.zeros((2,), jnp.int32), episode_stats=None)
    assert set(credit_assignment.rollout_metrics(traj, ("a",))) < set(
        golden_run.EPISODE_METRICS)


def test_off_recording_values_compare_within_their_rooms():
    """Within its room passes, beyond it fails; what the perturbation never moved
    compares to MIN_RTOL; a room that spans the value is not compared but listed; strings
    compare exactly; a missing metric fails."""
    want = [{"step": 1, "kl": 1.2144e-4, "loss": 0.36, "reward_mean": 0.5, "kept": 12,
             "kl_ref": 7.0e-14, "env": "a"}]
    rooms = [{"step": {"rtol": 1e-6, "atol": 0.0}, "kl": {"rtol": 1e-2, "atol": 1e-9},
              "loss": {"rtol": 1e-4, "atol": 0.0}, "reward_mean": {"rtol": 1e-6, "atol": 0.0},
              "kept": {"rtol": 1e-6, "atol": 0.0}, "kl_ref": {"rtol": 3.0, "atol": 1e-13}}]
    rounding = [{"step": 1, "kl": 1.2111e-4, "loss": 0.36002, "reward_mean": 0.5, "kept": 12,
                 "kl_ref": 3.2e-14, "env": "a"}]
    comparison = Comparison.of(want, rounding, rooms)
    assert comparison.differences == [] and comparison.unbounded == ["kl_ref@1"]
    assert comparison.compared == 5  # kl, loss, reward_mean, kept, env
    changed = [{"step": 1, "kl": 1.25e-4, "loss": 0.3605, "reward_mean": 0.5625, "kept": 13,
                "kl_ref": 7.0e-12, "env": "b"}]
    assert [d.split(" =")[0] for d in Comparison.of(want, changed, rooms).differences] == [
        "step 1: env", "step 1: kept", "step 1: kl", "step 1: loss", "step 1: reward_mean"]
    assert Comparison.of(want, [{k: v for k, v in rounding[0].items() if k != "kl"}],
                         rooms).differences == ["step 1: kl missing"]


def test_a_case_whose_rooms_span_every_value_is_counted_as_saying_nothing():
    want = [{"step": 1, "kl": 1e-14}, {"step": 2, "kl": 2e-14}]
    spanning = [{"step": {"rtol": 1e-6, "atol": 0.0}, "kl": {"rtol": 1.5, "atol": 0.0}}] * 2
    got = [{"step": 1, "kl": 3e-14}, {"step": 2, "kl": 1e-14}]
    comparison = Comparison.of(want, got, spanning)
    assert comparison.unbounded == ["kl@1", "kl@2"] and comparison.compared == 0
    assert "says nothing here" in unable_to_say("case", comparison)
    bounded = [{"step": {"rtol": 1e-6, "atol": 0.0}, "kl": {"rtol": 0.9, "atol": 0.0}}] * 2
    assert unable_to_say("case", Comparison.of(want, got, bounded)) is None


def test_the_closest_recording_is_compared_and_this_processors_bit_for_bit(monkeypatch):
    """Off recording: the recording with the fewest differences. On a recording
    processor `recorded_here` finds its records, unless UNRECORDED_ENV hides them."""
    recorded = {"cpu A": [{"step": 1, "loss": 0.5}], "cpu B": [{"step": 1, "loss": 0.5001}]}
    rooms = [{"loss": {"rtol": 1e-4, "atol": 0.0}}]
    comparison, closest = within_rooms(recorded, [{"step": 1, "loss": 0.50009}], rooms)
    assert (comparison.differences, closest) == ([], "cpu B")
    assert within_rooms(recorded, [{"step": 1, "loss": 0.51}], rooms)[0].differences
    monkeypatch.setattr(golden_run, "recordings", lambda name: recorded)
    monkeypatch.setattr(golden_run, "host_signature", lambda: "cpu B")
    monkeypatch.delenv(golden_run.UNRECORDED_ENV, raising=False)
    assert golden_run.recorded_here("case") == recorded["cpu B"]
    monkeypatch.setenv(golden_run.UNRECORDED_ENV, "1")
    assert golden_run.recorded_here("case") is None
    monkeypatch.setattr(golden_run, "host_signature", lambda: "cpu C")
    monkeypatch.setenv(golden_run.UNRECORDED_ENV, "0")
    assert golden_run.recorded_here("case") is None


def test_perturbed_rounding_moves_each_initial_parameter_one_ulp():
    """Every non-zero float of a module's init one ulp up, in its own dtype (float32 and
    bfloat16), zeros kept; nothing changed after the context."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    dense = nn.Dense(3, param_dtype=jnp.bfloat16)
    key, x = jax.random.key(0), jnp.ones((1, 4))
    for module in (nn.Dense(3), dense):
        plain = module.init(key, x)["params"]
        with golden_run.perturbed_rounding():
            moved = module.init(key, x)["params"]
        for name in ("kernel", "bias"):
            a, b = np.asarray(plain[name], np.float32), np.asarray(moved[name], np.float32)
            up = np.asarray(jnp.nextafter(plain[name], jnp.asarray(jnp.inf, plain[name].dtype)),
                            np.float32)
            np.testing.assert_array_equal(b, np.where(a != 0, up, a))
        assert np.all(np.asarray(moved["kernel"], np.float32) != np.asarray(
            plain["kernel"], np.float32)) and not np.any(np.asarray(moved["bias"]))
        again = module.init(key, x)["params"]
        np.testing.assert_array_equal(np.asarray(again["kernel"], np.float32),
                                      np.asarray(plain["kernel"], np.float32))


def test_every_case_has_a_recording():
    for name in golden_run.CASES:
        assert golden_run.recordings(name), name


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
