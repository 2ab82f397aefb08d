"""Smoke test of the benchmark scripts: they import, their helpers work, and the smallest
size of the PPO CartPole baseline runs one update (the full suite is not a test)."""

import importlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
SCRIPTS = ("common", "ppo_cartpole", "agentic_step", "scaling", "sharding_overhead")


def import_benchmark(name: str):
    """A script of benchmarks/ imported as a module (its directory on the path meanwhile,
    for the `common` it imports)."""
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCH)


@pytest.fixture(scope="module")
def bench():
    return {name: import_benchmark(name) for name in SCRIPTS}


def test_record_section_replaces_its_own_section_and_adds_new_ones_at_the_end(bench,
                                                                             tmp_path):
    common = bench["common"]
    path = str(tmp_path / "RESULTS.md")
    common.record_section("A", "first", path)
    common.record_section("B", common.markdown_table(["x", "y"], [(1, 2)]), path)
    common.record_section("A", "second\n\n### sub\n\nmore", path)
    common.record_section("C", "third", path)
    text = open(path, encoding="utf-8").read()
    assert text == ("# Benchmark results\n\n## A\n\nsecond\n\n### sub\n\nmore\n\n"
                    "## B\n\n| x | y |\n|---|---:|\n| 1 | 2 |\n\n## C\n\nthird\n")
    common.record_section("C", "fourth", path)  # the last section, replaced
    assert open(path, encoding="utf-8").read().endswith("## B\n\n| x | y |\n|---|---:|\n"
                                                      "| 1 | 2 |\n\n## C\n\nfourth\n")


def test_padded_replies_lengthen_the_buffer_not_the_reply(bench):
    scaling = bench["scaling"]
    from arl import rollout as rollout_lib
    from arl.envs import GuessNumber
    base = GuessNumber(max_turns=3)
    padded = scaling.PaddedReplies(extra=5, max_turns=3)
    assert rollout_lib.context_length(padded) == rollout_lib.context_length(base) + 3 * 5
    params = padded.default_params()

    @jax.jit
    def both_steps(key):  # one compiled program (eager op-by-op dispatch is slow)
        state, _ = padded.reset(key, params)
        action = padded.oracle_action(key, state, params)
        return padded.step(key, state, action, params)[1], base.step(key, state, action, params)[1]

    ts, ts_base = both_steps(jax.random.key(0))
    assert ts.observation.tokens.shape == (base.obs_len + 5,)
    assert int(ts.observation.length) == int(ts_base.observation.length)
    np.testing.assert_array_equal(ts.observation.tokens[:base.obs_len],
                                  ts_base.observation.tokens)


@pytest.mark.slow  # compiles the whole PPO baseline; default suite budget
def test_smallest_purejaxrl_baseline_update_runs(bench):
    init, update = bench["ppo_cartpole"].make_baseline(num_envs=2, num_steps=8, num_updates=1)
    runner = jax.jit(init)(jax.random.key(0))
    new, episode_return = jax.jit(update)(runner)
    assert new.obs.shape == (2, 4) and np.isfinite(float(episode_return))
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new.params, runner.params)
    assert any(jax.tree.leaves(changed))


def test_scaling_plot_keeps_flat_series_flat(bench):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (flat, steep) = plt.subplots(1, 2)
    flat.loglog([2, 4, 8], [47.0, 50.0, 52.0], base=2)
    steep.loglog([2, 4, 8], [10.0, 80.0, 640.0], base=2)
    steep_limits = steep.get_ylim()
    bench["scaling"]._span_at_least(flat, [47.0, 50.0, 52.0], factor=4.0)
    bench["scaling"]._span_at_least(steep, [10.0, 80.0, 640.0], factor=4.0)
    low, high = flat.get_ylim()
    np.testing.assert_allclose([high / low, low * high], [4.0, 47.0 * 52.0], rtol=1e-6)
    assert steep.get_ylim() == steep_limits
    plt.close(fig)


def test_mesh_layouts_parse_or_exit_with_one_line(bench):
    parse = bench["common"].parse_meshes
    assert parse("8,1,1;2,4,1") == [(8, 1, 1), (2, 4, 1)]
    for bad in ("8,1", "2,0,4", "8,x,1"):
        with pytest.raises(SystemExit, match="three positive sizes"):
            parse(bad)


def test_force_host_devices_replaces_the_device_count_only_when_asked(bench, monkeypatch):
    force = bench["common"].force_host_devices
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8")
    assert force(["--shapes", "tiny", "--devices", "64"]) == 64
    assert os.environ["XLA_FLAGS"] == ("--xla_cpu_foo=1 "
                                       "--xla_force_host_platform_device_count=64")
    assert force(["--devices=2"], default=8) == 2
    assert os.environ["XLA_FLAGS"].endswith("count=2") and "count=64" not in os.environ[
        "XLA_FLAGS"]
    assert force(["--rows", "3"]) == 0 and os.environ["XLA_FLAGS"].endswith("count=2")
    assert force([], default=8) == 8


def test_donated_step_runner_feeds_each_output_to_the_next_call(bench):
    step = jax.jit(lambda s: (s + 1.0, {"value": s}), donate_argnums=(0,))
    seen = []
    run = bench["common"].donated_step_runner(step, jnp.zeros(3), seen.append)
    for _ in range(3):
        run()
    np.testing.assert_array_equal([float(m["value"][0]) for m in seen], [0.0, 1.0, 2.0])


def test_matmul_ceiling_finds_every_dot_of_a_compiled_program_and_its_runs():
    matmul_ceiling = import_benchmark("matmul_ceiling")

    def program(x, w, q, k):
        y = x @ w                                       # [32, 24] x [24, 40], runs once
        scores = jnp.einsum("bqd,bkd->bqk", q, k)       # batched, runs once

        def body(h, _):
            return jnp.tanh(h @ w[:, :24]), None        # [32, 24] x [24, 24], 7 times

        h, _ = jax.lax.scan(body, x, None, length=7)
        return y.sum() + scores.sum() + h.sum()

    args = (jnp.ones((32, 24)), jnp.ones((24, 40)), jnp.ones((3, 5, 8)), jnp.ones((3, 6, 8)))
    compiled = jax.jit(program).lower(*args).compile()
    executed = matmul_ceiling.executed_thunks(lambda: jax.block_until_ready(compiled(*args)))
    dots = matmul_ceiling.hlo_dots(compiled.as_text(), executed)
    runs = {}
    for dot in dots:
        key = (tuple(sorted(dot["lhs"] + dot["rhs"])), len(dot["numbers"][1][0]))
        runs[key] = runs.get(key, 0) + dot["runs"]
    assert runs == {(tuple(sorted((32, 24, 24, 40))), 0): 1,
                    (tuple(sorted((3, 5, 8, 3, 6, 8))), 1): 1,
                    (tuple(sorted((32, 24, 24, 24))), 0): 7}
    batched = next(d for d in dots if d["numbers"][1][0])
    assert matmul_ceiling.dot_flops(batched) == 2 * 3 * 5 * 6 * 8
    plain = next(d for d in dots if d["runs"] == 1 and not d["numbers"][1][0])
    assert matmul_ceiling.dot_flops(plain) == 2 * 32 * 24 * 40

    # The same program's dots timed alone: every run counted once, the costliest logged.
    logged = []
    seconds, work, timed_dots, distinct = matmul_ceiling.dots_alone(
        compiled.as_text(), executed, 1, logged.append, top=2)
    assert work == 2 * 32 * 24 * 40 + 2 * 3 * 5 * 6 * 8 + 7 * 2 * 32 * 24 * 24
    assert (len(timed_dots), distinct, len(logged)) == (3, 3, 2)
    assert seconds > 0 and all(line.startswith("dot f32") for line in logged)


def test_dots_counted_from_a_profile_drop_the_branch_not_taken():
    """Counted from the trace of one call, a conditional's untaken branch contributes no
    dot and a loop's dot runs its trip count (mean over calls)."""
    matmul_ceiling = import_benchmark("matmul_ceiling")

    def program(x, w, v, take_w):
        def body(h, _):
            return jnp.tanh(h @ w[:, :24]), None        # [32, 24] x [24, 24], 7 times

        h, _ = jax.lax.scan(body, x, None, length=7)
        branch = jax.lax.cond(take_w, lambda: (x @ w).sum(),       # [32, 24] x [24, 40]
                              lambda: (x @ v).sum())                # [32, 24] x [24, 3]
        return h.sum() + branch

    args = (jnp.ones((32, 24)), jnp.ones((24, 40)), jnp.ones((24, 3)), jnp.asarray(True))
    compiled = jax.jit(program).lower(*args).compile()
    text = compiled.as_text()
    executed = matmul_ceiling.executed_thunks(
        lambda: jax.block_until_ready(compiled(*args)), calls=2)
    counted = {(dot["rhs"], dot["runs"]) for dot in matmul_ceiling.hlo_dots(text, executed)}
    assert counted == {((24, 24), 7), ((24, 40), 1)}, counted
    executed = matmul_ceiling.executed_thunks(
        lambda: jax.block_until_ready(compiled(args[0], args[1], args[2], jnp.asarray(False))))
    counted = {(dot["rhs"], dot["runs"]) for dot in matmul_ceiling.hlo_dots(text, executed)}
    assert counted == {((24, 24), 7), ((24, 3), 1)}, counted


def test_first_step_table_has_one_row_per_shown_phase_of_each_case():
    """benchmarks/first_step.py: one table over the cases; a phase shorter than
    SHOWN_PHASE_SECS in every run is left out, the first logged step always shown."""
    first_step = import_benchmark("first_step")

    def phase(wall, compile_s=0.0, compiled=0, hits=0):
        return {"wall": wall, "trace": 0.0, "lower": 0.0, "compile": compile_s,
                "compiled": compiled, "cache hits": hits}

    results = [{"phases": {"imports": phase(5.0), "config": phase(0.3),
                           "first step": phase(39.7, 31.8, 1)},
                "first_log": 54.7, "load": 1.0, "programs": []},
               {"phases": {"imports": phase(4.9), "config": phase(0.6),
                           "first step": phase(11.6, 2.5, 1, 1)},
                "first_log": 20.7, "load": 1.0, "programs": []}]
    rows = first_step.rows("quickstart", results)
    assert [row[:2] for row in rows] == [
        ["quickstart", "imports"], ["quickstart", "config"], ["quickstart", "first step"],
        ["quickstart", "**first logged step**"]]
    assert rows[2][2:] == ["39.7 (0.0 / 0.0 / 31.8)", "11.6 (0.0 / 0.0 / 2.5)",
                           "1 (0) / 1 (1)"]
    results[1]["phases"]["config"] = phase(0.4)  # under 0.5 s in both runs: left out
    assert "config" not in [row[1] for row in first_step.rows("quickstart", results)]
    table = first_step.markdown(first_step.columns(results, before=False), rows)
    assert table.splitlines()[1] == "|---|---|---:|---:|---:|"
