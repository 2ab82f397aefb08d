"""Multi-host: two processes on 127.0.0.1 (two CPU devices each, `jax.distributed`) run
`experiments.train` with mesh (4, 1, 1) and log the same metrics and parameters as one
process with four devices."""

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
_FLAGS = (
    "--config=configs/grpo_bandit.py", "--config.train_steps=2", "--config.log_every=1",
    "--config.sample_every=0", "--config.rollout.num_tasks=4",
    "--config.rollout.group_size=2", "--config.model.d_model=32",
    "--config.model.num_layers=1", "--config.model.num_heads=2",
    "--config.model.num_kv_heads=2", "--config.model.mlp_dim=64",
    "--config.loss.echo_coef=0.1",  # keeps the parameters moving (see test_experiment.py)
    "--config.mesh=(4,1,1)",
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(workdir, local_devices, *extra):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={local_devices}"}
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *_FLAGS, *extra],
        cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _params(workdir):
    """Final parameters, restored onto one device of this process (another topology)."""
    _, config = evaluation.checkpoint_config(str(workdir))
    config.mesh = (1, 1, 1)
    step, params = evaluation.restore_params(trainers.build(config), str(workdir))
    assert step == 2
    return jax.tree.map(np.asarray, params)


@pytest.mark.slow  # three processes each compile the train step: minutes on 2 cores
def test_two_processes_match_one_process_with_four_devices(tmp_path):
    port = _free_port()
    multi = tmp_path / "multi"
    processes = [
        _start(tmp_path / "single", 4),
        *[_start(multi, 2, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                 f"--process_id={i}") for i in range(2)],
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=900)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    assert "Rank 1 is connected" in outputs[2]  # really two cooperating processes

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
