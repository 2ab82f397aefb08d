"""Adversarial programs as the agent's actions inside a real compiled train step.

`AttackInterpreter` is the code interpreter with a scripted demonstrator whose turn t is
the attack `ATTACKS[t]`; the train step's SFT term plays that demonstrator, so every
attack runs in the sandbox from inside `TokenTrainer.train_step` (one jitted program:
rollout + demonstrations + update). Each must come back as an observation; the trainer
must survive, its process must be untouched (pid, working directory, environment, no
child left running), a checkpoint written after the attacks must restore, and the next
step from the restored state must be bit for bit the step the live trainer took.
"""

from __future__ import annotations

import dataclasses
import os
import uuid

import jax
import numpy as np
import pytest

import arl
from arl import rollout as rollout_lib
from arl.envs.tasks.code_interpreter import CodeInterpreter
from arl.runs import checkpoint
from arl.trainers import TokenTrainer
from tests.tools.conftest import child_pids
from tests.tools.test_kernel_boundary import WORLD_WRITABLE

MARK = "arlpwned" + uuid.uuid4().hex[:8]
# No brackets in these programs: the built-in CharCodec has none (replies show "?").
ALIASED_IMPORT = ("import sys,glob,importlib.util as u\np,=glob.glob(sys.path.pop()+'/_posixsu*')\n"
                  "u.module_from_spec(u.spec_from_file_location('a._posixsubprocess',p))")
DISK_FILL = "for i in range(3):open(str(i),'w').write('x'*6*10**5)"  # 1 MiB disk here
# (program, what its reply must contain)
ATTACKS = (
    ("while True: pass", "timeout after 0.5 s"),
    ("import os\nos.kill(os.getppid(), 9)", "PermissionError: sandbox: os.kill"),
    ("print(open('/etc/passwd').read())", "PermissionError: sandbox"),
    ("x = bytearray(2**40)", "memory limit exceeded"),
    ("import os\nos.system('kill -9 -1')", "PermissionError: sandbox"),
    ("import socket\nsocket.socket()", "PermissionError: sandbox"),
    ("raise SystemExit(7)", "exit status 7"),
    ("import os\nos.environ.get('ARL_HOST_TEST_SECRET')", "(no output)"),  # not inherited
    # The classes the kernel contains (tests/tools/test_kernel_boundary.py has each with
    # the hooks off too). A blocked extension loaded from its file under another name:
    (ALIASED_IMPORT, "PermissionError: sandbox: module"),
    ("import _xxsubinterpreters", "PermissionError: sandbox: module"),  # sub-interpreters
    (f"open('/run/lock/{MARK}','w')", "PermissionError: sandbox: writing"),
    ("import os\nos.mkfifo('f')", "PermissionError: ?Errno 1? Operation"),  # seccomp
    ("import os\nos.setsid()\nos.fork()", "PermissionError: ?Errno 1? Operation"),  # seccomp
    (DISK_FILL, "OSError: ?Errno 28? No space left"),  # max_disk_bytes
)
# The train step plays four of them (a shorter context compiles faster).
TRAIN_ATTACKS = (ATTACKS[0], ATTACKS[8], ATTACKS[11], ATTACKS[13])
SECRET = ("ARL_HOST_TEST_SECRET", "do-not-leak-42")


class AttackInterpreter(CodeInterpreter):
    name = "attack_interpreter"

    def __init__(self, attacks=ATTACKS):
        action_len = max(len(f"<py>{program}</py>") for program, _ in attacks) + 1
        super().__init__(max_turns=len(attacks), action_len=action_len, obs_len=40,
                         wall_time_s=0.5, cpu_time_s=0.5, memory_mb=128, cache_size=0,
                         step_timeout_s=10.0)
        self.attacks = tuple(attacks)
        self.limits = dataclasses.replace(self.limits, max_disk_bytes=2**20)

    def host_demonstrator(self, episode, rng):
        return f"<py>{self.attacks[episode.turn][0]}</py>"


def _train_env():
    return AttackInterpreter(TRAIN_ATTACKS)


arl.envs.register("attack_interpreter", _train_env)


@pytest.fixture(scope="module", autouse=True)
def secret():
    os.environ[SECRET[0]] = SECRET[1]
    yield
    os.environ.pop(SECRET[0], None)


def _config():
    c = arl.default_config()
    c.env.name = "attack_interpreter"
    c.rollout.num_tasks, c.rollout.group_size = 2, 2
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 16, 1, 32
    c.model.num_heads = c.model.num_kv_heads = 2
    c.loss.sft_coef, c.loss.sft_source = 0.5, "demonstrator"
    return c


def _process_unaffected(pid, cwd):
    assert os.getpid() == pid and os.getcwd() == cwd
    assert os.environ.get(SECRET[0]) == SECRET[1]
    assert child_pids() == [], "a sandbox process outlived its call"
    for directory in WORLD_WRITABLE:
        assert [name for name in os.listdir(directory) if MARK in name] == [], directory


def test_attacks_come_back_as_observations():
    env = AttackInterpreter()
    pid, cwd = os.getpid(), os.getcwd()
    traj = jax.jit(lambda k: rollout_lib.rollout(
        env, k, num_tasks=2, group_size=1, action_source="demonstrator"))(jax.random.key(0))
    tokens, observed = np.asarray(traj.tokens[0]), np.asarray(traj.observation_mask[0]) > 0
    replies, start = [], 0
    while start < len(tokens):  # the runs of observation tokens after the prompt
        if not observed[start]:
            start += 1
            continue
        end = start
        while end < len(tokens) and observed[end]:
            end += 1
        replies.append(env.codec.decode(tokens[start:end], stop_at_pad=False))
        start = end
    assert len(replies) == len(ATTACKS), replies
    for (program, expected), reply in zip(ATTACKS, replies):
        assert expected in reply, (program, reply)
    assert env.host_stats.host_errors == 0
    _process_unaffected(pid, cwd)


def test_train_step_survives_attacks_and_resumes_exactly(tmp_path):
    pid, cwd = os.getpid(), os.getcwd()
    trainer = TokenTrainer(_config())
    state = trainer.init_state()
    state, first = trainer.train_step(state)  # the attacks run inside this program
    assert trainer.env.host_stats.host_errors == 0
    assert trainer.env.host_stats.live_rows > 0
    assert float(first["demo_success_rate"]) == 0.0
    assert all(np.isfinite(float(v)) for v in first.values())
    _process_unaffected(pid, cwd)

    with checkpoint.Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        assert ckpt.save(1, state, force=True)
        step, restored, _ = ckpt.restore_latest(trainer.abstract_state())
    assert step == 1
    live_state, live = trainer.train_step(state)  # attacks again, after the checkpoint
    resumed_state, resumed = trainer.train_step(restored)
    assert {k: float(v) for k, v in live.items()} == {k: float(v) for k, v in resumed.items()}
    for a, b in zip(jax.tree.leaves(live_state.params), jax.tree.leaves(resumed_state.params)):
        np.testing.assert_array_equal(a, b)
    assert int(resumed_state.step) == 2
    _process_unaffected(pid, cwd)
