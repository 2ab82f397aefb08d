"""Multi-host: two processes on 127.0.0.1 (two CPU devices each, `jax.distributed`) run
`experiments.train` with mesh (4, 1, 1) and log the same metrics and parameters as one
process with four devices; with asynchronous rollouts, training on device 0 of each
process and the rollout on device 1, as one process with the same two meshes; a mesh
that would lie on one process only is a one-line error."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from arl import trainers
from arl.runs import evaluation, writers

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUN_FLAGS = (
    "--config=configs/grpo_bandit.py", "--config.train_steps=2", "--config.log_every=1",
    "--config.sample_every=0", "--config.rollout.num_tasks=4",
    "--config.rollout.group_size=2", "--config.model.d_model=32",
    "--config.model.num_layers=1", "--config.model.num_heads=2",
    "--config.model.num_kv_heads=2", "--config.model.mlp_dim=64",
    "--config.loss.echo_coef=0.1",  # keeps the parameters moving (see test_experiment.py)
)
_FLAGS = (*_RUN_FLAGS, "--config.mesh=(4,1,1)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(workdir, local_devices, *extra, flags=_FLAGS):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={local_devices}"}
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *flags, *extra],
        cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _params(workdir, steps=2):
    """Final parameters, restored onto one device of this process (another topology)."""
    _, config = evaluation.checkpoint_config(str(workdir))
    config.mesh = (1, 1, 1)
    step, params = evaluation.restore_params(trainers.build(config), str(workdir))
    assert step == steps
    return jax.tree.map(np.asarray, params)


def _run_all(commands, flags=_RUN_FLAGS):
    processes = [_start(*command, flags=flags) for command in commands]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=900)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return [(process.returncode, output) for process, output in zip(processes, outputs)]


def _two_processes(workdir, local_devices, *extra):
    port = _free_port()
    return [(workdir, local_devices, f"--coordinator_address=127.0.0.1:{port}",
             "--num_processes=2", f"--process_id={i}", *extra) for i in range(2)]


@pytest.mark.slow  # three processes each compile the train step: minutes on 2 cores
def test_two_processes_match_one_process_with_four_devices(tmp_path):
    multi = tmp_path / "multi"
    results = _run_all([(tmp_path / "single", 4), *_two_processes(multi, 2)], flags=_FLAGS)
    for returncode, output in results:
        assert returncode == 0, output[-3000:]
    assert "Rank 1 is connected" in results[2][1]  # really two cooperating processes

    single = writers.read_metrics(tmp_path / "single")
    multi_records = writers.read_metrics(multi)  # written by process 0 only
    assert [r["step"] for r in single] == [r["step"] for r in multi_records] == [1, 2]
    for expected, actual in zip(single, multi_records):
        assert sorted(expected) == sorted(actual)
        for name in expected:
            # Cross-process reductions may add in another order: float tolerance, and
            # the near-zero approx-KL diagnostics are compared absolutely.
            np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6,
                                       err_msg=name)
    assert single[0]["entropy"] > 0 and single[0]["grad_norm"] > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 _params(multi), _params(tmp_path / "single"))


# Asynchronous rollouts across two processes (arl.trainers.placement): the training mesh
# takes device 0 of each process and the rollout mesh device 1.
_ASYNC_FLAGS = ("--config.mesh=(2,1,1)", "--config.rollout.mesh=(2,1,1)",
                "--config.loss.off_policy_correction=tis")


@pytest.mark.slow  # five processes each compile two programs: minutes on 2 cores
def test_async_rollouts_on_meshes_over_both_processes(tmp_path):
    """Lag 0 over two processes logs the metrics and parameters of one process with the
    same two meshes (float tolerance: cross-process reductions); lag 1 runs, one version
    stale from step 2 on, and trains the same parameters up to the lag's effect."""
    results = _run_all([
        (tmp_path / "single", 4, *_ASYNC_FLAGS, "--config.train_steps=3"),
        *_two_processes(tmp_path / "lag0", 2, *_ASYNC_FLAGS, "--config.train_steps=3"),
        *_two_processes(tmp_path / "lag1", 2, *_ASYNC_FLAGS, "--config.train_steps=3",
                        "--config.rollout.policy_lag=1"),
    ])
    for returncode, output in results:
        assert returncode == 0, output[-3000:]
    assert "Rank 1 is connected" in results[2][1]  # really two cooperating processes
    single = writers.read_metrics(tmp_path / "single")
    lag0 = writers.read_metrics(tmp_path / "lag0")
    lag1 = writers.read_metrics(tmp_path / "lag1")
    assert [r["step"] for r in single] == [r["step"] for r in lag0] == [1, 2, 3]
    for expected, actual in zip(single, lag0):
        assert sorted(expected) == sorted(actual)
        for name in expected:
            np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6,
                                       err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 _params(tmp_path / "lag0", 3), _params(tmp_path / "single", 3))

    assert [r["off_policy/staleness"] for r in lag1] == [0, 1, 1]
    for name in ("loss/total", "entropy", "reward_mean"):  # step 1 is on-policy: the same
        np.testing.assert_allclose(lag1[0][name], single[0][name], rtol=1e-5, atol=1e-6)
    assert all(np.isfinite(r["loss/total"]) and r["grad_norm"] > 0 for r in lag1)
    assert 0.5 < lag1[2]["off_policy/weight_mean"] < 2  # TIS weights of a 1-step-old policy
    assert lag1[2]["off_policy/kl_behaviour_k3"] > 0


@pytest.mark.parametrize("local_devices,flags,field", [
    # One device per process: the training mesh on process 0, the rollout mesh on 1.
    (1, ("--config.mesh=(1,1,1)", "--config.rollout.mesh=(1,1,1)"), "mesh"),
    pytest.param(2, ("--config.mesh=(2,1,1)", "--config.rollout.mesh=(1,1,1)"),
                 "rollout.mesh", marks=pytest.mark.slow),  # the same check, other field
])
def test_a_mesh_on_one_process_only_is_a_one_line_error(tmp_path, local_devices, flags,
                                                        field):
    """Both processes end with the same one-line error before compiling (exit 2)."""
    results = _run_all(_two_processes(tmp_path / "run", local_devices, *flags,
                                      "--config.rollout.policy_lag=1",
                                      "--config.loss.off_policy_correction=tis"))
    for returncode, output in results:
        assert returncode == 2, output[-3000:]
        errors = [line for line in output.splitlines() if "error: config." in line]
        assert len(errors) == 1, output[-3000:]
        assert errors[0].startswith(f"experiments.train: error: config.{field}=(")
        assert "same number of devices from every process" in errors[0]
        assert "allowed are shapes of a multiple of 2 devices" in errors[0]
        assert "Compiling" not in output and "Traceback" not in output
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow  # two processes compile the train step
def test_sigterm_on_one_process_stops_both_at_the_same_step(tmp_path):
    """A preemption notice (SIGTERM) to process 1 only: JAX's preemption service makes
    both processes stop after the same step s, write checkpoint s together and end with
    the same one line and exit status 143; the logs hold steps 1..s once."""
    import signal
    import time

    workdir = tmp_path / "run"
    port = _free_port()
    processes = [_start(workdir, 1, f"--coordinator_address=127.0.0.1:{port}",
                        "--num_processes=2", f"--process_id={i}",
                        flags=(*_RUN_FLAGS, "--config.mesh=(2,1,1)",
                               "--config.train_steps=100000", "--config.checkpoint_every=1000"))
                 for i in range(2)]
    try:
        metrics = workdir / writers.METRICS_FILE
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert time.monotonic() < deadline and all(
                p.poll() is None for p in processes), "the run did not log 3 steps"
            time.sleep(0.05)
        processes[1].send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=600)[0] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    steps = sorted(int(name) for name in os.listdir(workdir / "checkpoints") if name.isdigit())
    assert len(steps) == 1, os.listdir(workdir / "checkpoints")
    step = steps[0]
    expected = (f"experiments.train: stopped by SIGTERM after step {step} (checkpoint {step} "
                f"saved in {workdir / 'checkpoints'}); run the same command again to resume "
                "(exit status 143)")
    for process, output in zip(processes, outputs):
        assert process.returncode == 143, output[-3000:]
        assert [line for line in output.splitlines() if "stopped by" in line] == [expected]
        assert "Traceback" not in output
    assert [r["step"] for r in writers.read_metrics(workdir)] == list(range(1, step + 1))
    assert metrics.read_text().count("\n") == step
    assert not [name for name in os.listdir(workdir / "checkpoints") if "tmp" in name]
