r"""`configs/grpo_sql_hf.py` on `sql` or `code_interpreter` (argument "DIR,ENV"): the
shipped env in the checkpoint's own tool-calling format, at a stand-in's sizes, with an
SFT term on the oracle's turns (a template call, then the answer) so the compiled step
runs declared tool calls whatever the fresh policy writes. tests/test_tool_calls.py
trains it through the CLI on each family's stand-in.
"""

from configs import grpo_sql_hf

ENV_KWARGS = {
    "sql": dict(tool_format="template", max_turns=2, obs_len=64, action_len=256,
                max_invalid_calls=2),
    "code_interpreter": dict(tool_format="template", max_turns=2, obs_len=24,
                             action_len=96, max_invalid_calls=2, allow_weak_sandbox=True),
}


def get_config(argument: str = ""):
    directory, env = argument.split(",")
    c = grpo_sql_hf.get_config(directory)
    c.env.name = env
    c.env.kwargs = type(c.env.kwargs)(ENV_KWARGS[env])
    c.model.system_prompt = "Call the tool, then reply <answer>value</answer>."
    c.model.dtype = c.model.param_dtype = "float32"
    c.model.remat, c.model.logprob_chunk = False, 0
    c.rollout.num_tasks, c.rollout.group_size = 2, 2
    c.loss.sft_coef, c.loss.sft_source = 0.5, "oracle"
    c.train_steps, c.log_every, c.checkpoint_every, c.sample_every = 2, 1, 2, 2
    return c
