r"""GRPO on your own prompts from your own Hugging Face checkpoint, exported back.

    python -m experiments.train --config=configs/grpo_hf_checkpoint.py:/models/Qwen2.5-0.5B-Instruct \
        --config.env.kwargs.path=tasks.jsonl --workdir=/tmp/run --export_to=/tmp/run/hf
    python -m experiments.evaluate --workdir=/tmp/run --split=eval

The argument after the colon is the model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with its chat template, generation_config.json);
`config.model.hf_checkpoint` takes it as one unit: the weights, the tokenizer as the
envs' codec (pad / eos / bos as tokenizer_config.json names them; no BOS for Qwen) and
the chat template, so every episode is the conversation the model was tuned on:
`model.system_prompt` as the system message (empty: the template's default), the JSONL
row's prompt as the user turn, each answer an assistant turn ended by the model's own
end-of-turn token (`<|im_end|>`, `<|eot_id|>`), "wrong, try again" as the next user turn.
Ids of the padded vocabulary (Qwen: 151665 tokens in 151936 rows) are never sampled.

The tasks: `{"prompt": ..., "answer": ...}` lines (`env.kwargs.path`, built into a
dataset on first use with the checkpoint's tokenizer; 10% held out as the "eval" split),
checked by `env.kwargs.verifier` ("numeric": the last number, GSM8K's "#### n";
"exact"; "normalized"), `max_turns = 2` attempts, `action_len = 256` tokens per answer.
The context is the conversation as generated (`rollout.history`): for a template that
renders earlier turns otherwise than the policy wrote them (Qwen3 drops their <think>
blocks), it is what the template's keep-history variant renders (docs/checkpoints.md,
"History modes").
The template's own arguments go in `model.chat_template_kwargs`, e.g.
`--config.model.chat_template_kwargs="{'enable_thinking': False}"`. docs/checkpoints.md
says what each family supports.

Sizes: full fine-tuning at learning rate 1e-6 with bfloat16 parameters and activations
(float32 master weights and Adam moments), each layer rematerialised, the layers scanned
(`layer_unroll = 1`), log-probs in chunks of 256 positions (never the [B, S, vocab]
logits), 8 prompts x 8 samples per step. docs/sharding.md says how to spread a larger
model over devices (`mesh = (1, N, 1)`: FSDP over N chips; LoRA, `model.lora_rank`,
for less optimizer memory). On a CPU only a tiny stand-in trains in reasonable time
(docs/checkpoints.md, "The recipe": seconds per step at 2 layers x 32 wide); a
0.5B model wants an accelerator.
"""

from arl import config as config_lib


def get_config(model_dir: str = ""):
    c = config_lib.default_config()
    c.algorithm = "grpo"
    c.model.hf_checkpoint = model_dir
    c.model.system_prompt = ""
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.remat = True
    c.model.layer_unroll = 1
    c.model.logprob_chunk = 256
    c.env.name = "dataset_task"
    c.env.kwargs.path = ""  # your JSONL: --config.env.kwargs.path=tasks.jsonl
    c.env.kwargs.split = "train"
    c.env.kwargs.verifier = "numeric"
    c.env.kwargs.max_turns = 2
    c.env.kwargs.action_len = 256
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    c.rollout.temperature = 1.0
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 10
    c.optim.max_grad_norm = 1.0
    c.train_steps = 200
    c.checkpoint_every = 50
    return c
