r"""GRPO on `warehouse` (tests/tool_user_envs.py), a user's own tool env with two tools of
several typed arguments, from a Hugging Face checkpoint in its own tool-calling format.

    python -m experiments.train --config=tests/tool_env_config.py:/models/Qwen2.5-0.5B-Instruct \
        --workdir=/tmp/run

`config.imports` loads the env's module (which registers it); its tools go into the
template's `tools` list; the policy calls them as the checkpoint was tuned to, several
in one turn where the template renders that (Qwen2.5, Qwen3), and reads each result as
a `tool` message. A fresh model rarely writes a valid call, so the SFT term on the
oracle's turns (both calls in one turn, then the answer) gives the update something to
learn from. Sizes are a stand-in's (tests/test_declared_tools.py trains one through the
CLI); a real checkpoint takes configs/grpo_hf_checkpoint.py's (bfloat16, remat, chunked
log-probs, 8 x 8 rollouts).
"""

from configs import grpo_hf_checkpoint


def get_config(model_dir: str = ""):
    c = grpo_hf_checkpoint.get_config(model_dir)
    c.imports = ("tests.tool_user_envs",)
    c.env.name = "warehouse"
    c.env.kwargs = type(c.env.kwargs)(dict(max_turns=2, max_invalid_calls=2))
    c.model.system_prompt = ("Answer with the tools: call stock and price, then reply "
                             "<answer>units;cost</answer>.")
    c.model.dtype = c.model.param_dtype = "float32"
    c.model.remat, c.model.logprob_chunk = False, 0
    c.rollout.num_tasks, c.rollout.group_size = 2, 2
    c.loss.sft_coef, c.loss.sft_source = 0.5, "oracle"
    c.train_steps, c.log_every, c.checkpoint_every, c.sample_every = 2, 1, 2, 0
    return c
