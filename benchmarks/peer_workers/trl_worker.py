"""TRL's GRPOTrainer as a `benchmarks/peers.py` worker (runs in its own virtual environment).

    python trl_worker.py --setting '<Setting json>' --checkpoint DIR [--warmup 2]

Builds a GRPOTrainer on the shared Qwen2 checkpoint (float32, beta 0, one optimizer step
per generation batch, temperature 1, no top-k / top-p), runs `--warmup` steps, reports
"ready", then runs one training step per "step" command (see `protocol.py`).

The training loop is TRL's own `trainer.train()`; a TrainerCallback holds it at the start
of every step until the driver asks for the next one, so a step's time is one whole
iteration of the loop (batch fetch, generation, rewards, loss, backward, optimizer, the
trainer's per-step bookkeeping). The rollout time is the time spent in
`GRPOTrainer._generate` (tokenisation, `model.generate`, decoding), measured by wrapping
that method.

Single-turn settings: `generation_kwargs={"min_new_tokens": gen_len}` forces exactly
`gen_len` tokens. Multi-turn settings: TRL's experimental `rollout_func` plays
guess_number on the host, one `model.generate` call per turn over the unfinished rows
(the whole context is prefilled again each turn), and marks the environment's replies
with `env_mask` so the loss skips them.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol  # noqa: E402  pylint: disable=wrong-import-position


def word_tokenizer(vocab: int, prefix: str):
    """A Hugging Face fast tokenizer whose token i is the word f"{prefix}{i}": prompts are
    whitespace-separated ids, so text and ids map one to one (no BOS/EOS added)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    words = {f"{prefix}{i}": i for i in range(vocab)}
    core = Tokenizer(models.WordLevel(words, unk_token=f"{prefix}{protocol.PAD_ID}"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=f"{prefix}{protocol.PAD_ID}",
        eos_token=f"{prefix}{protocol.EOT_ID}", unk_token=f"{prefix}{protocol.PAD_ID}")


def ids_text(ids, prefix: str) -> str:
    return " ".join(f"{prefix}{i}" for i in ids)


def make_multiturn_rollout(setting: protocol.Setting, stats: dict, seed: int):
    """TRL `rollout_func`: guess_number episodes, one `generate` call per turn."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)

    def rollout_func(prompts, trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        group = trainer.num_generations
        hidden = np.repeat(rng.integers(0, 16, size=len(prompts) // group), group)
        games = [protocol.GuessNumberHost(int(h), setting.turns) for h in hidden]
        contexts = [g.prompt_ids() for g in games]
        prompt_ids = [list(c) for c in contexts]
        completion = [[] for _ in games]
        env_mask = [[] for _ in games]
        logprobs = [[] for _ in games]
        was_training = model.training
        model.eval()
        for _ in range(setting.turns):
            rows = [i for i, g in enumerate(games) if not g.done]
            if not rows:
                break
            width = max(len(contexts[i]) for i in rows)
            ids = torch.full((len(rows), width), protocol.PAD_ID, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):  # left padding, as TRL's own generation does
                ids[r, width - len(contexts[i]):] = torch.tensor(contexts[i])
                mask[r, width - len(contexts[i]):] = 1
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=setting.gen_len,
                    do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                    eos_token_id=protocol.CHAR_EOT_ID, pad_token_id=protocol.PAD_ID,
                    return_dict_in_generate=True, output_logits=True)
            new = out.sequences[:, width:]
            step_logp = torch.stack(
                [torch.log_softmax(l.float(), dim=-1) for l in out.logits], dim=1)
            stats["generate_calls"] += 1
            for r, i in enumerate(rows):
                action = new[r].tolist()
                if protocol.CHAR_EOT_ID in action:
                    action = action[:action.index(protocol.CHAR_EOT_ID) + 1]
                lp = [float(step_logp[r, t, tok]) for t, tok in enumerate(action)]
                reply = games[i].step(action)
                contexts[i] += action + reply
                completion[i] += action + reply
                env_mask[i] += [1] * len(action) + [0] * len(reply)
                logprobs[i] += lp + [0.0] * len(reply)
                stats["generated"] += len(action)
        if was_training:
            model.train()
        return {"prompt_ids": prompt_ids, "completion_ids": completion, "logprobs": logprobs,
                "env_mask": env_mask, "episode_return": [g.episode_return for g in games]}

    return rollout_func


def build(setting: protocol.Setting, checkpoint: str, seed: int, stats: dict):
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(seed)
    multiturn = setting.turns > 0
    prefix = "c" if multiturn else "t"
    tokenizer = word_tokenizer(setting.vocab, prefix)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    rng = np.random.default_rng(seed)
    rows = setting.num_prompts * 200
    if multiturn:
        prompts = [ids_text(protocol.GuessNumberHost(0, setting.turns).prompt_ids(), prefix)
                   ] * rows
    else:
        prompts = [ids_text(rng.integers(protocol.FIRST_PROMPT_ID, setting.vocab,
                                         setting.prompt_len), prefix) for _ in range(rows)]
    dataset = Dataset.from_dict({"prompt": prompts})

    def reward(prompts, completions, completion_ids, episode_return=None, **kwargs):
        if multiturn:
            values = list(episode_return)
        else:
            values = [protocol.target_share(ids) for ids in completion_ids]
        stats["reward_sum"] += sum(values)
        stats["reward_count"] += len(values)
        return values

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="arl-peers-trl-"),
        per_device_train_batch_size=setting.batch, gradient_accumulation_steps=1,
        num_generations=setting.group_size, max_completion_length=(
            setting.turns * (setting.gen_len + 7) if multiturn else setting.gen_len),
        generation_kwargs=None if multiturn else {"min_new_tokens": setting.gen_len},
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
        learning_rate=1e-5, max_grad_norm=1.0, max_steps=10**6, logging_steps=10**6,
        save_strategy="no", report_to="none", use_cpu=True, bf16=False, fp16=False,
        disable_tqdm=True, dataloader_num_workers=0, seed=seed,
        mask_truncated_completions=False,
        gradient_checkpointing=False)  # TRL defaults to True: it recomputes the forward
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=make_multiturn_rollout(setting, stats, seed) if multiturn else None)

    generate = trainer._generate

    def timed_generate(*a, **kw):
        start = time.perf_counter()
        out = generate(*a, **kw)
        stats["rollout_s"] += time.perf_counter() - start
        completion_ids = out[1]
        if not multiturn:
            stats["generated"] += sum(len(c) for c in completion_ids)
        stats["trained"] += len(completion_ids) * (
            max(len(p) for p in out[0]) + max(len(c) for c in completion_ids))
        return out

    trainer._generate = timed_generate
    return trainer, torch


def main():
    args = protocol.worker_arguments()
    channel = protocol.Channel()
    try:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        setting = protocol.Setting.from_json(args.setting)
        stats = {"rollout_s": 0.0, "generated": 0, "trained": 0, "generate_calls": 0,
                 "reward_sum": 0.0, "reward_count": 0}
        start = time.perf_counter()
        trainer, torch = build(setting, args.checkpoint, args.seed, stats)
        setup_s = time.perf_counter() - start
        from transformers import TrainerCallback

        class Gate(TrainerCallback):
            """Holds the loop at each step's start; reports the step that just ended."""

            def __init__(self):
                self.steps = 0
                self.started = None
                self.first_step_s = None

            def _finish(self):
                elapsed = time.perf_counter() - self.started
                record = dict(step_s=elapsed, rollout_s=stats["rollout_s"],
                              generated_tokens=stats["generated"],
                              trained_tokens=stats["trained"],
                              generate_calls=stats["generate_calls"],
                              reward_mean=stats["reward_sum"] / max(1, stats["reward_count"]))
                for key in stats:
                    stats[key] = 0
                return record

            def on_step_begin(self, args_, state, control, **kwargs):
                if self.started is not None:
                    record = self._finish()
                    self.steps += 1
                    if self.steps == 1:
                        self.first_step_s = record["step_s"]
                    if self.steps > args.warmup:
                        channel.send("step", **record)
                    elif self.steps == args.warmup:
                        channel.send(
                            "ready", setup_s=setup_s, first_step_s=self.first_step_s,
                            versions=versions(), threads=torch.get_num_threads())
                if self.steps >= args.warmup:
                    if channel.next_command() != "step":
                        channel.send("bye")
                        os._exit(0)  # pylint: disable=protected-access
                self.started = time.perf_counter()

        trainer.add_callback(Gate())
        trainer.train()
    except Exception as e:  # noqa: BLE001 - reported to the driver, which carries on
        traceback.print_exc()
        channel.send("error", message=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        sys.exit(1)


def versions() -> dict:
    from importlib import metadata
    out = {}
    for package in ("trl", "transformers", "torch", "accelerate"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    main()
