r"""GRPO on the SQL tool env from your own Hugging Face checkpoint, in the model's own
tool-calling format.

    python -m experiments.train --config=configs/grpo_sql_hf.py:/models/Qwen2.5-0.5B-Instruct \
        --workdir=/tmp/run --export_to=/tmp/run/hf

`configs/grpo_hf_checkpoint.py` (the checkpoint as weights, tokenizer and chat template;
bfloat16, remat, chunked log-probs) on the `sql` env with `tool_format = "template"`:
the tool `run_sql(query)` is in the `tools` list the template renders into the system
turn, the policy calls it as the checkpoint was tuned to (Qwen2.5 / Hermes:
`<tool_call>{"name": "run_sql", "arguments": {"query": "SELECT ..."}}</tool_call>`),
every reply is a `tool` message (the rows, an error, "correct" / "wrong"), and the
policy answers with `<answer>...</answer>`. Before every turn the policy reads what
`apply_chat_template(messages, tools=...)` renders (Llama 3.1: bare JSON calls with
"parameters", results in `ipython` turns as JSON strings). docs/checkpoints.md,
"Tool calls in the template's own convention", says which templates are checked; one
whose tool turns cannot be cut into static pieces is refused in one line
(`--config.env.kwargs.tool_format=tags` keeps the env's own `<sql>` tags).
"""

from configs import grpo_hf_checkpoint


def get_config(model_dir: str = ""):
    c = grpo_hf_checkpoint.get_config(model_dir)
    c.env.name = "sql"
    c.env.kwargs = type(c.env.kwargs)(dict(tool_format="template", max_turns=2,
                                           obs_len=64, action_len=256))
    c.model.system_prompt = ("Answer questions about the company database. Call run_sql, "
                             "then reply <answer>value</answer>.")
    return c
