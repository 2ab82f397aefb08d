"""A tool task whose tool is Python: how many Collatz steps take n to 1?

A `ToolEnvironment` (host Python, reached from inside the compiled step): `make_task`
draws the task from a seed, `run_tool` runs the agent's cell in the sandbox, `guess` is the
weaker demonstrator's answer without the tool. Played by its oracle, then one GRPO + SFT
train step (docs/host_environments.md, "Train one, or a new tool task").

    python examples/python_tool.py
"""

import random

import jax

import arl
from arl import envs, rollout
from arl.envs.tasks.code_interpreter import notebook_cell
from arl.envs.tool_use import ToolEnvironment, ToolTask
from arl.tools import SandboxLimits, run_python


class CollatzSteps(ToolEnvironment):
    """How many Collatz steps take n to 1? Run Python to find out, then answer."""

    name = "collatz"
    tool_tag = "py"  # tool calls are <py>CELL</py>

    def __init__(self, codec=None, max_turns: int = 2):
        super().__init__(codec=codec or envs.CharCodec(), max_turns=max_turns,
                         prompt_len=24, obs_len=16, action_len=72)
        self.limits = SandboxLimits(wall_time_s=2.0, memory_bytes=256 * 2**20)

    def make_task(self, seed, params):  # host Python; the same seed, the same task
        n = m = random.Random(seed).randint(100, 999)
        steps = 0
        while m > 1:
            m, steps = (m // 2 if m % 2 == 0 else 3 * m + 1), steps + 1
        cell = f"n,k={n},0\nwhile n>1:\n n,k=n//2 if n%2==0 else 3*n+1,k+1\nk"
        return ToolTask(prompt=f"collatz steps of {n}", answer=str(steps), solution=cell)

    def run_tool(self, task, source):  # the agent's cell, in the sandbox
        return run_python(notebook_cell(source), limits=self.limits)

    def guess(self, task, rng):  # the demonstrator's answer without running code
        return str(int(task.answer) + rng.choice([-2, -1, 1, 2]))


envs.register("collatz", CollatzSteps)
env = envs.make("collatz")
traj = rollout.scripted_rollout(env, jax.random.key(0), num_tasks=2, group_size=2,
                                action_source="oracle")
print(rollout.render_trajectory(env, traj, row=0))
assert bool(traj.success.all())

# The rest of arl is unchanged: a train step (GRPO + SFT on the demonstrator) runs the
# policy's and the demonstrator's cells from inside the compiled program.
config = arl.default_config()
config.env.name = "collatz"
config.rollout.num_tasks, config.rollout.group_size = 2, 2
config.model.d_model, config.model.num_layers, config.model.mlp_dim = 32, 1, 64
config.loss.sft_coef, config.loss.sft_source = 0.5, "demonstrator"
trainer = arl.build(config)
state, metrics = trainer.train_step(trainer.init_state())
print(f"collatz: demonstrator success {float(metrics['demo_success_rate']):.2f}")
env.close()
