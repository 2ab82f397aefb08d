"""Bad input through the real command line: `python -m experiments.train ...` in a
subprocess must end with ONE line on stderr naming the field, the value and what is
allowed, exit status 2, no traceback, and nothing written (the workdir is not created:
the experiment loop creates it after the config, the environment and the model were accepted
and before anything is compiled).

The cases run as parallel subprocesses of one test (each start imports JAX, ~1 s of
CPU); a failure lists every case that misbehaved and how.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import time


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_USAGE_ERROR = 2
_PARALLEL = 6
_TIMEOUT_S = 240  # a case still running by then accepted its input (generous: busy hosts)


@dataclasses.dataclass(frozen=True)
class Case:
    args: tuple[str, ...]  # after `python -m experiments.train --workdir=<tmp>/run`
    expected: tuple[str, ...]  # fragments of the one line printed
    program: str = "experiments.train"
    workdir: str = "run"  # relative to the case's tmp dir; the file "afile" exists there
    created: bool = False  # the program may create the workdir before failing


_BANDIT = "--config=configs/grpo_bandit.py"
_GUESS = "--config=configs/grpo_guess_number.py"
CATALOGUE = {
    "unknown_key": Case(
        (_BANDIT, "--config.trian_steps=10"),
        ("config.trian_steps=10 is invalid: not a config key",
         "did you mean config.train_steps?")),
    "unknown_key_in_unknown_section": Case(
        (_BANDIT, "--config.optimm.learning_rate=0.1"),
        ("config.optimm.learning_rate", "did you mean config.optim.learning_rate?")),
    "retired_clip_key": Case(
        (_BANDIT, "--config.algorithm=gspo", "--config.loss.gspo_clip_low=0.001"),
        ("config.loss.gspo_clip_low=0.001 is no longer a key: set config.loss.clip_low "
         "with loss.policy_loss='gspo'",)),
    "unknown_policy_loss": Case(
        (_BANDIT, "--config.loss.policy_loss=dpo"),
        ("config.loss.policy_loss='dpo' is invalid: allowed values are", "'cispo'")),
    "bad_algorithm": Case(
        (_BANDIT, "--config.algorithm=a2c"),
        ("config.algorithm='a2c' is invalid: allowed values are", "'grpo'")),
    "infinite_learning_rate": Case(
        (_BANDIT, "--config.optim.learning_rate=inf"),
        ("config.optim.learning_rate=inf is invalid: expected a finite number",)),
    "negative_learning_rate": Case(
        (_BANDIT, "--config.optim.learning_rate=-0.001"),
        ("config.optim.learning_rate=-0.001 is invalid: must be > 0",)),
    # The text "True" parsed as the bool (a string would be refused as not a setting).
    "reuse_activations_with_two_epochs": Case(
        (_BANDIT, "--config.updates.reuse_rollout_activations=True",
         "--config.updates.epochs=2"),
        ("config.updates.reuse_rollout_activations=True is invalid: needs "
         "updates.epochs = 1",)),
    "bad_schedule": Case(
        (_BANDIT, "--config.optim.schedule=step"),
        ("config.optim.schedule='step' is invalid: allowed values are", "'cosine'")),
    "bad_env_name": Case(
        (_BANDIT, "--config.env.name=chess"),
        ("config.env.name='chess' is invalid", "'guess_number'", "config.imports")),
    "env_kwarg_refused_by_constructor": Case(
        (_GUESS, "--config.env.kwargs.max_n=1"),
        ("config.env.kwargs={'max_n': 1} is invalid: env 'guess_number' refused them: "
         "max_n must be an int in [2, 10**8], got 1",)),
    "unknown_env_kwarg": Case(
        (_GUESS, "--config.env.kwargs.max_nn=8"),
        ("config.env.kwargs.max_nn=8 is invalid", "takes no argument 'max_nn'",
         "did you mean max_n?")),
    "env_param_out_of_range": Case(
        (_BANDIT, "--config.env.params.high_prob=1.5"),
        ("config.env.params.high_prob=1.5 is invalid: must be in [0, 1]",)),
    "unknown_env_param": Case(
        (_BANDIT, "--config.env.params.high_porb=0.3"),
        ("config.env.params.high_porb=0.3 is invalid", "did you mean high_prob?")),
    "horizon_beyond_max_turns": Case(
        (_GUESS, "--config.rollout.horizon_rounds=(2,9)"),
        ("config.rollout.horizon_rounds=(2, 9) is invalid", "max_turns=6")),
    "bad_branch_turns": Case(
        ("--config=configs/vineppo_guess_number.py", "--config.process.branch_turns=(1,7)"),
        ("config.process.branch_turns=(1, 7)", "max_turns=7")),
    "bad_attention": Case(
        (_BANDIT, "--config.model.attention=flash"),
        ("config.model.attention='flash' is invalid: allowed values are", "'blocked'")),
    "cudnn_attention_without_gpu": Case(
        (_BANDIT, "--config.model.attention=cudnn"),
        ("config.model.attention='cudnn' is invalid: cuDNN's kernel needs an NVIDIA GPU",)),
    "zero_attention_block": Case(
        (_BANDIT, "--config.model.attention_block=0"),
        ("config.model.attention_block=0 is invalid: must be >= 1",)),
    "mesh_larger_than_devices": Case(
        (_BANDIT, "--config.mesh=(4,4,4)"),
        ("config.mesh=(4, 4, 4) is invalid: needs 64 devices but only",)),
    "bad_loss_agg": Case(
        (_BANDIT, "--config.loss.agg=mean"),
        ("config.loss.agg='mean' is invalid: allowed values are", "'token-mean'")),
    "demonstrator_on_env_without_one": Case(
        ("--config=tests/user_env_config.py", "--config.loss.sft_source=demonstrator"),
        ("config.loss.sft_source='demonstrator' is invalid",
         "env 'say_digit' does not define", "'oracle'")),
    "imports_missing_module": Case(
        (_BANDIT, "--config.imports=no_such_pkg.envs"),
        ("config.imports=('no_such_pkg.envs',) is invalid: importing 'no_such_pkg.envs' "
         "failed",)),
    "workdir_is_a_file": Case(
        (_BANDIT,), ("--workdir=", "afile' is a file, not a directory"), workdir="afile",
        created=True),
    "value_of_the_wrong_type": Case(
        (_BANDIT, "--config.train_steps=ten"), ("--config.train_steps=ten",)),
    "unknown_flag": Case(
        (_BANDIT, "--num_step=3"), ("Unknown command line flag 'num_step'",)),
    "missing_config_file": Case(
        ("--config=configs/no_such_file.py",),
        ("--config='configs/no_such_file.py' could not be loaded", "No such file")),
    "hf_checkpoint_mismatch": Case(
        (_BANDIT, "--config.model.hf_checkpoint={tmp}/hf"),
        ("config.model.hf_checkpoint=", "/hf' is invalid:", "missing 9 tensors")),
    "evaluate_without_checkpoint": Case(
        (), ("--workdir=", "no checkpoint with a stored config"),
        program="experiments.evaluate", workdir="afile_dir", created=True),
    # A run of the user env whose stored config asks for demonstrations: the error names
    # the env's missing demonstrator, so evaluate imported the run's config.imports.
    "evaluate_imports_the_runs_modules": Case(
        (), ("config.loss.sft_source='demonstrator' is invalid",
             "env 'say_digit' does not define"),
        program="experiments.evaluate", created=True),
}


def _write_user_env_checkpoint(workdir):
    import numpy as np

    from arl.runs import checkpoint, experiment
    from tests import user_env_config

    config = user_env_config.get_config()
    config.loss.sft_source = "demonstrator"  # refused: say_digit has no demonstrator
    with checkpoint.Checkpointer(workdir / "checkpoints") as ckpt:
        ckpt.save(1, {"x": np.zeros(2, np.float32)}, force=True,
                  metadata={"config": experiment.config_json(config)})


def _write_mismatched_hf_checkpoint(directory):
    """A Llama checkpoint of a 1-layer model whose config.json claims 2 layers: the
    config is readable, the tensors of layer 1 are missing."""
    import jax

    from arl.envs import CharCodec
    from arl.models import hf_import, transformer

    config = transformer.TransformerConfig(
        vocab_size=CharCodec().vocab_size, d_model=8, num_layers=1, num_heads=2,
        num_kv_heads=2, mlp_dim=16, max_len=64)
    model = transformer.Transformer(config)
    params = model.init(jax.random.key(0), jax.numpy.zeros((1, 4), jax.numpy.int32))["params"]
    hf_import.save_hf_checkpoint(str(directory), jax.tree.map(lambda x: getattr(x, "value", x),
                                                              params), config)
    path = directory / "config.json"
    hf = json.loads(path.read_text())
    hf["num_hidden_layers"] = 2
    path.write_text(json.dumps(hf))


def _prepare(name, case, tmp):
    """The case's directory (in the main thread: imports are not thread-safe)."""
    tmp.mkdir()
    (tmp / "afile").write_text("")
    (tmp / "afile_dir").mkdir()
    if name == "hf_checkpoint_mismatch":
        _write_mismatched_hf_checkpoint(tmp / "hf")
    if name == "evaluate_imports_the_runs_modules":
        _write_user_env_checkpoint(tmp / case.workdir)


def _run(case, tmp):
    """(completed process, wall seconds, workdir), or the TimeoutExpired of a case that
    accepted its input and went on to train."""
    workdir = tmp / case.workdir
    argv = [sys.executable, "-m", case.program, f"--workdir={workdir}",
            *(arg.replace("{tmp}", str(tmp)) for arg in case.args)]
    start = time.monotonic()
    try:
        result = subprocess.run(argv, cwd=_ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                                capture_output=True, text=True, timeout=_TIMEOUT_S,
                                check=False)
    except subprocess.TimeoutExpired as error:  # accepted: it is training
        return error
    return result, time.monotonic() - start, workdir


def _problems(case, outcome) -> list[str]:
    """What is wrong with one case's run (empty when it behaved)."""
    if isinstance(outcome, subprocess.TimeoutExpired):
        return [f"still running after {_TIMEOUT_S} s: the input was accepted"]
    if isinstance(outcome, Exception):
        return [f"could not be set up: {outcome!r}"]
    result, seconds, workdir = outcome
    stderr = result.stderr
    if "Traceback" in stderr:
        return ["printed a traceback ending: " + stderr.strip().splitlines()[-1][:300]]
    lines = [line for line in stderr.splitlines() if line.strip()]
    if len(lines) != 1:
        return [f"printed {len(lines)} lines, not 1: {lines[:5]}"]
    line, problems = lines[0], []
    if not line.startswith(f"{case.program}: error: "):
        problems.append(f"no '{case.program}: error: ' prefix: {line}")
    problems += [f"{fragment!r} not in: {line}" for fragment in case.expected
                 if fragment not in line]
    if result.returncode != _USAGE_ERROR:
        problems.append(f"exit status {result.returncode}, not {_USAGE_ERROR}")
    if result.stdout:
        problems.append(f"printed to stdout: {result.stdout[:200]}")
    if not case.created and workdir.exists():
        problems.append(f"wrote {workdir} before failing")
    if seconds >= _TIMEOUT_S:
        problems.append(f"took {seconds:.0f} s")
    return problems


def test_bad_input_is_one_line_exit_status_2_and_nothing_written(tmp_path):
    """Every case of `CATALOGUE`, run in parallel (one test: pytest-xdist would otherwise
    run a shared fixture once per worker); the failure lists every case that failed."""
    outcomes = {}
    for name, case in CATALOGUE.items():
        try:
            _prepare(name, case, tmp_path / name)
        except Exception as error:  # pylint: disable=broad-except  # reported below
            outcomes[name] = error
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(_PARALLEL) as pool:
        futures = {name: pool.submit(_run, case, tmp_path / name)
                   for name, case in CATALOGUE.items() if name not in outcomes}
        outcomes.update({name: future.result() for name, future in futures.items()})
    print(f"{len(CATALOGUE)} CLI cases in {time.monotonic() - start:.1f} s")
    failures = {name: _problems(CATALOGUE[name], outcomes[name]) for name in CATALOGUE}
    failures = {name: problems for name, problems in failures.items() if problems}
    assert not failures, f"{len(failures)} of {len(CATALOGUE)} cases failed:\n" + "\n".join(
        f"  {name}: {'; '.join(problems)}" for name, problems in sorted(failures.items()))


def test_catalogue_covers_the_required_cases():
    assert len(CATALOGUE) >= 16
