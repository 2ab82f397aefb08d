"""Smoke test of `benchmarks/peers.py` and its harness (`benchmarks/harness.py`) without
any peer install: arl's side at the tiny size, the driver's worker protocol against a
stand-in worker, the FLOP counts, and the peers' plain-Python guess_number against
arl's environment."""

import argparse
import json
import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl import config as config_lib
from arl.envs import TokenChunk

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture(scope="module")
def peers():
    sys.path.insert(0, BENCH)
    try:
        import peers as module  # pylint: disable=import-outside-toplevel
        yield module
    finally:
        sys.path.remove(BENCH)


@pytest.fixture(scope="module")
def harness(peers):  # imported with benchmarks/ on the path, as peers.py imports it
    return peers.harness


@pytest.mark.slow  # compiles arl's step and rollout (~15 s): default suite budget
def test_arl_side_runs_the_tiny_setting_with_forced_generation_length(peers, tmp_path):
    out = peers.main(["--settings=tiny", "--peers=arl", "--rounds=2", "--warmup=1",
                      f"--cache_dir={tmp_path}", "--peak_size=64"])
    setting = peers.protocol.SETTINGS["tiny"]
    result = out["results"][0]
    arl = result["results"]["arl"]
    assert out["failures"] == []
    # Every sample writes exactly gen_len tokens: the end-of-turn id is never sampled.
    assert arl["generated_tokens"] == setting.batch * setting.gen_len
    # arl trains on its [B, S] buffer: BOS + (prompt_len - 1) prompt ids + gen_len.
    assert arl["trained_tokens"] == setting.batch * (setting.prompt_len + setting.gen_len)
    assert 0.0 <= arl["reward_mean"] <= 1.0
    assert len(arl["rounds"]) == 2 and 0 < arl["step_min"] <= arl["step_s"] <= arl["step_max"]
    assert 0 < arl["rollout_s"] and arl["update_flops_per_s"] > 0
    # The shared checkpoint is a Qwen2 config with q/k/v biases, loadable by arl.
    with open(os.path.join(result["checkpoint"], "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    assert hf["model_type"] == "qwen2" and hf["vocab_size"] == setting.vocab
    assert hf["num_key_value_heads"] == setting.num_kv_heads
    # The time to the first step from launch: a fresh arl process, cold then warm cache.
    first = result["first_step"]["arl"]
    assert 0 < first["rerun"] and 0 < first["first run"]
    assert f"| {first['first run']:.1f} / {first['rerun']:.1f} |" in out["text"]
    assert "first step from launch (s): first run / rerun" in out["text"]
    assert peers.FIRST_STEP_PROSE in out["text"] and "arl: python start" in out["text"]


@pytest.mark.slow  # compiles arl's step and rollout (~15 s): default suite budget
def test_executed_update_flops_equal_the_dots_a_profile_sees_run(harness, tmp_path):
    """The "executed of peak" count (the step's jaxpr: update branch, shared-prompt
    branch) equals the matmul FLOPs of the dots the compiled step runs, less its
    rollout's, as `matmul_ceiling.executed_thunks` counts them from a profile."""
    import matmul_ceiling  # pylint: disable=import-outside-toplevel  (benchmarks/ on the path)

    setting = harness.protocol.SETTINGS["tiny"]
    runner = harness.ArlRunner(setting, harness.write_checkpoint(setting, str(tmp_path)),
                               warmup=1)

    def flops(program, run):
        dots = matmul_ceiling.hlo_dots(program.as_text(), matmul_ceiling.executed_thunks(run))
        return sum(dot["runs"] * matmul_ceiling.dot_flops(dot) for dot in dots)

    step = flops(runner.step_program, runner._run_step)  # pylint: disable=protected-access
    rollout = flops(runner.rollout_program, runner._run_rollout)  # pylint: disable=protected-access
    assert runner.ready["executed_update_flops"] > 0
    assert step - rollout == pytest.approx(runner.ready["executed_update_flops"], rel=1e-9)


def test_first_step_from_launch_times_a_fresh_arl_process_then_reuses_its_cache(
        peers, tmp_path, monkeypatch):
    """The arl child runs from launch to its first step twice on one fresh cache
    directory: the first run finds it empty and fills it, the rerun loads from it; the
    user's own caches (here the suite's JAX cache, a stand-in ~/.cache) stay untouched."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    monkeypatch.delenv("ARL_CACHE_DIR", raising=False)
    setting = peers.protocol.SETTINGS["tiny"]
    peers.harness.write_checkpoint(setting, str(tmp_path))
    args = argparse.Namespace(cache_dir=str(tmp_path), first_step_runs=1, ready_timeout=120)
    logs, failures = [], []
    out = peers.first_step_phase(setting, ["arl", "trl"], args, logs.append, {}, failures)
    assert failures == [] and list(out) == ["arl"], (failures, logs)  # trl not installed
    first, rerun = out["arl"]["runs"]
    assert (first["run"], rerun["run"]) == peers.FIRST_STEP_RUNS
    for record in (first, rerun):
        parts = record["parts"]
        assert 0 < parts["first step"] < record["total_s"]
        assert parts["python start"] > 0  # the launch is outside the child's own phases
        assert 0.0 <= record["reward_mean"] <= 1.0
    # The first run compiled into the empty directory; the rerun found those entries.
    assert first["parts"]["from the cache"] == 0 and first["cache_files"] > 0
    assert rerun["parts"]["from the cache"] > 0
    # The rerun may add entries: a small program's compile time straddles JAX's write
    # threshold (arl.caches.MIN_COMPILE_SECS, 0.05 s) on a loaded machine.
    assert rerun["cache_files"] >= first["cache_files"]
    assert not (tmp_path / "home-cache").exists()
    assert out["arl"]["first run"] == first["total_s"]

    step = dict(step_s=0.5, rollout_s=0.25, generated_tokens=16, trained_tokens=32,
                reward_mean=0.5)
    result = {"results": {"arl": peers.summarise(setting, [step], {})}, "first_step": out}
    text = peers.table(result, peak=1e9)
    assert "first step from launch (s): first run / rerun" in text
    assert f"| {first['total_s']:.1f} / {rerun['total_s']:.1f} |" in text
    details = peers.first_step_details(out)
    assert details.startswith("First step from launch, its parts")
    assert "from the cache 0 / " in details and "arl: python start" in details


def test_arl_config_takes_overrides_and_refuses_unknown_keys(harness):
    setting = harness.protocol.SETTINGS["tiny"]
    override = harness.parse_override("updates.reuse_rollout_activations=False")
    assert override == ("updates.reuse_rollout_activations", False)
    assert harness.parse_override("model.attention=blocked") == ("model.attention", "blocked")
    config = harness.arl_config(setting, "checkpoint", dict([override, ("optim.learning_rate",
                                                                     3e-4)]))
    assert config.updates.reuse_rollout_activations is False
    assert config.optim.learning_rate == 3e-4
    default = harness.arl_config(setting, "checkpoint")
    assert default.updates.reuse_rollout_activations == "auto"
    assert config_lib.reuses_rollout_activations(default)
    with pytest.raises(SystemExit, match="updates.no_such_key"):
        harness.arl_config(setting, "checkpoint", {"updates.no_such_key": 1})
    with pytest.raises(SystemExit, match="updates.epochs='two'"):
        harness.arl_config(setting, "checkpoint",
                           dict([harness.parse_override("updates.epochs=two")]))
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        harness.parse_override("updates.epochs")


@pytest.mark.slow  # compiles two steps and two rollouts (~30 s): default suite budget
def test_ab_runner_compares_an_option_that_keeps_the_sampled_tokens(peers, tmp_path):
    import ab  # pylint: disable=import-outside-toplevel  (benchmarks/ on the path)

    rows = ab.main(["updates.reuse_rollout_activations=False", "--settings=tiny",
                    "--rounds=2", f"--cache_dir={tmp_path}"])
    assert [row[0] for row in rows] == ["tiny"]
    assert rows[0][-1] == "yes", rows
    assert all(float(cell) > 0 for cell in rows[0][1:3] + rows[0][4:6]), rows


# The keys arl_config may set away from default_config(): the equal-work settings (the
# task, the sizes, the checkpoint and the optimisation every side runs), none for speed.
_EQUAL_WORK_KEYS = {
    "algorithm", "env.name", "env.kwargs", "rollout.num_tasks", "rollout.group_size",
    "model.hf_checkpoint", "model.dtype", "optim.learning_rate", "optim.max_grad_norm",
    "loss.kl_coef", "updates.epochs", "updates.minibatches", "filters.skip_zero_advantage"}


@pytest.mark.parametrize("setting_name", ["modest", "multiturn"])
def test_arl_row_is_the_default_configuration(harness, setting_name):
    """Every key of arl's config that differs from `default_config()` is an equal-work
    setting: the headline row measures the defaults."""
    config = harness.arl_config(harness.protocol.SETTINGS[setting_name], "checkpoint")
    default = config_lib.default_config()

    def flat(c, prefix=""):
        out = {}
        for key in c.keys():
            if isinstance(c[key], type(c)) and f"{prefix}{key}" != "env.kwargs":
                out.update(flat(c[key], f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = c[key]
        return out

    got, want = flat(config), flat(default)
    changed = {key for key in got if got[key] != want.get(key)}
    assert changed <= _EQUAL_WORK_KEYS, changed - _EQUAL_WORK_KEYS
    assert {"model.hf_checkpoint", "optim.learning_rate"} <= changed  # it sees changes


def test_target_token_reward_is_the_share_of_target_ids(harness):
    import target_token  # pylint: disable=import-outside-toplevel  (benchmarks/ on the path)

    env = target_token.TargetToken(vocab=16, prompt_len=3, gen_len=4)
    params = env.default_params()
    state, ts = env.reset(jax.random.key(0), params)
    prompt = np.asarray(ts.observation.tokens)
    assert prompt.shape == (3,) and ((prompt >= 4) & (prompt < 16)).all()
    tokens = jnp.asarray([3, 7, 3, 3], jnp.int32)
    action = TokenChunk(tokens, jnp.asarray(4, jnp.int32))
    _, ts = jax.jit(env.step)(jax.random.key(1), state, action, params)
    assert float(ts.reward) == pytest.approx(0.75)
    assert float(ts.reward) == pytest.approx(harness.protocol.target_share([3, 7, 3, 3]))
    assert bool(ts.terminated)


def test_update_flops_by_hand(harness):
    s = harness.protocol.SETTINGS["toy"]
    # attention: 128 x 32 x (2 x 4 + 2 x 2) = 49152; MLP 3 x 128 x 256 = 98304 per layer;
    # 2 layers + LM head 128 x 64 = 8192.
    assert harness.matmul_params(s) == 2 * (49152 + 98304) + 8192
    trained = 64 * 24
    per_position = 2 * harness.matmul_params(s) + 4 * 2 * 24 * 128
    assert harness.update_flops(s, trained) == 3 * trained * per_position



def test_matmul_flops_of_a_jaxpr_by_hand(harness):
    """2 x output x contracted per product; a scan's body times its length; a cond's
    branch by the chooser; a while body once; the backward's products after jax.grad;
    the step-level helper takes the outermost cond's costliest branch, resolving the
    conds inside it by the chooser."""
    x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
    one = 2 * 8 * 4 * 16  # x @ w
    scanned = lambda x: jax.lax.scan(lambda c, _: (c, c @ w), x, None, length=3)[1]
    assert harness.matmul_flops(jax.make_jaxpr(scanned)(x)) == 3 * one
    inner = lambda x: jax.lax.cond(x.sum() > 0, lambda: (x @ w).sum(),
                                   lambda: ((x @ w) @ w.T).sum())
    assert harness.matmul_flops(jax.make_jaxpr(inner)(x), max) == one + 2 * 8 * 16 * 4
    assert harness.matmul_flops(jax.make_jaxpr(inner)(x), min) == one
    # forward x @ w and the weight gradient x^T dy (no input gradient: x is a constant)
    grad = jax.grad(lambda w: jax.jit(lambda w: (x @ w).sum())(w))
    assert harness.matmul_flops(jax.make_jaxpr(grad)(w)) == 2 * one
    looped = lambda x: jax.lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ jnp.ones((16, 16))), (0, x))[1]
    assert harness.matmul_flops(jax.make_jaxpr(looped)(x)) == 2 * 8 * 16 * 16
    outer = jax.jit(lambda x: jax.lax.cond(x.sum() > 0, lambda: inner(x) + (x @ w).sum(),
                                           lambda: 0.0))
    assert harness.largest_cond_branch_flops(jax.make_jaxpr(outer)(x), min) == 2 * one

FAKE_WORKER = textwrap.dedent("""
    import argparse, os, sys
    sys.path.insert(0, {worker_dir!r})
    import protocol
    parser = argparse.ArgumentParser()
    for flag in ("--setting", "--checkpoint", "--warmup"):
        parser.add_argument(flag)
    args = parser.parse_args()
    channel = protocol.Channel()
    print("library chatter on stdout must not reach the driver")
    setting = protocol.Setting.from_json(args.setting)
    channel.send("ready", setup_s=0.5, first_step_s=0.25)
    steps = 0
    while channel.next_command() == "step":
        steps += 1
        if steps == 3:
            channel.send("error", message="ValueError: boom")
            sys.exit(1)
        channel.send("step", step_s=0.1 * steps, rollout_s=0.05,
                     generated_tokens=setting.batch * setting.gen_len,
                     trained_tokens=setting.batch, reward_mean=0.5)
""")


def test_worker_protocol_round_trip_and_crash_report(peers, tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER.format(worker_dir=peers.driver.WORKER_DIR))
    setting = peers.protocol.SETTINGS["tiny"]
    runner = peers.driver.WorkerRunner("fake", sys.executable, setting, str(tmp_path), 1,
                                str(tmp_path / "worker.log"), timeout=30, script=str(script))
    assert runner.wait_ready(30)["first_step_s"] == 0.25
    first, second = runner.step(), runner.step()
    assert [first["step_s"], second["step_s"]] == pytest.approx([0.1, 0.2])
    assert first["generated_tokens"] == setting.batch * setting.gen_len
    with pytest.raises(RuntimeError, match="ValueError: boom"):
        runner.step()
    runner.close()
    assert "library chatter" in (tmp_path / "worker.log").read_text()


def test_host_guess_number_replies_like_arl_guess_number(peers):
    from arl.envs import GuessNumber  # pylint: disable=import-outside-toplevel

    protocol = peers.protocol
    env = GuessNumber(max_n=16, max_turns=6)
    params = env.default_params()
    state, ts = env.reset(jax.random.key(3), params)
    hidden = int(state.hidden)
    assert hidden not in (7, 15)  # so that only the last guess below is correct
    host = protocol.GuessNumberHost(hidden, max_turns=6)
    np.testing.assert_array_equal(
        host.prompt_ids()[1:], np.asarray(ts.observation.tokens)[:int(ts.observation.length)])
    step = jax.jit(env.step)
    actions = ["7<eot>", "x<eot>", "-3<eot>", "15", f"{hidden}<eot>"]
    for text in actions:
        ids = env.codec.encode(text)
        padded = np.full((env.action_len,), env.codec.pad_id, np.int32)
        padded[:len(ids)] = ids
        chunk = TokenChunk(jnp.asarray(padded), jnp.asarray(len(ids), jnp.int32))
        state, ts = step(jax.random.key(4), state, chunk, params)
        reply = host.step(ids)
        assert reply == np.asarray(ts.observation.tokens)[:int(ts.observation.length)].tolist()
        assert host.done == bool(ts.done)
    # 5 turns at 0.05, two invalid ones ("x", "-3") at 0.1 more, success 1.0.
    assert host.done and host.episode_return == pytest.approx(1.0 - 5 * 0.05 - 2 * 0.1)
