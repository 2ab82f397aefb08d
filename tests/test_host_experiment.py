"""A host environment through the command-line path: `experiments.train` (the experiment loop,
`arl.runs.experiment.run`: warm start, train, evaluate, checkpoint), a resumed run, and
`experiments.evaluate` on its checkpoint, with the shipped `code_interpreter` config at a
tiny size."""

from __future__ import annotations

import os

import pytest
from absl import flags

from arl.runs import experiment, writers
from configs import grpo_code_interpreter


def _config(train_steps):
    c = grpo_code_interpreter.get_config()
    c.train_steps = train_steps
    c.log_every = c.checkpoint_every = c.sample_every = 1
    c.rollout.num_tasks, c.rollout.group_size = 2, 2
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 16, 1, 32
    c.model.num_heads = c.model.num_kv_heads = 2
    c.warm_start.sft_steps, c.warm_start.sft_batch = 2, 4
    return c


@pytest.mark.slow
def test_train_resume_evaluate(tmp_path, capsys):
    workdir = str(tmp_path / "run")
    records = experiment.run(_config(1), workdir)
    assert [r["step"] for r in records] == [1]
    assert "eval/success_rate" in records[0] and "success_rate" in records[0]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[:2] == ["0", "1"]
    samples = os.listdir(os.path.join(workdir, "samples"))
    assert samples and "[env]   " in open(os.path.join(workdir, "samples", samples[0])).read()

    records = experiment.run(_config(2), workdir)  # resumes after step 1
    assert [r["step"] for r in records] == [2]
    assert [r["step"] for r in writers.read_metrics(workdir)] == [1, 2]

    from experiments import evaluate

    argv = ["evaluate", f"--workdir={workdir}", "--num_tasks=4", "--num_transcripts=1"]
    flags.FLAGS(argv)
    try:
        evaluate.main(argv)
    finally:
        flags.FLAGS.unparse_flags()
    out = capsys.readouterr().out
    assert "Checkpoint step 2" in out and "code_interpreter" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines()
             if line.split()[:1] in (["greedy"], ["sampled"], ["demonstrator"], ["oracle"])}
    assert set(lines) == {"greedy", "sampled", "demonstrator", "oracle"}
    assert float(lines["oracle"][3]) == 1.0
    assert "--- sampled transcript 0 ---" in out


@pytest.mark.slow
def test_train_step_on_a_sharded_mesh():
    """On an 8-device data-parallel mesh the host callback runs once for the whole batch
    (gathered to the first device, replies scattered back): the demonstrations' tool
    calls happen and the step trains."""
    import jax

    from arl.trainers import TokenTrainer

    c = _config(1)
    c.rollout.num_tasks, c.rollout.group_size = 4, 2
    c.mesh = (8, 1, 1)
    trainer = TokenTrainer(c)
    state, metrics = trainer.train_step(trainer.init_state())
    jax.block_until_ready(metrics)
    stats = trainer.env.host_stats
    assert stats.host_errors == 0 and stats.live_rows > 0
    assert stats.rows % 8 == 0  # whole batches, one callback each
    assert 0.0 < float(metrics["demo_success_rate"]) <= 1.0
