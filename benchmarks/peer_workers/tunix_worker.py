"""tunix's GRPOLearner as a `benchmarks/peers.py` worker (runs in its own virtual environment).

    python tunix_worker.py --setting '<Setting json>' --checkpoint DIR [--warmup 2]

Loads the shared Qwen2 checkpoint into tunix's own Qwen2 (`tunix.models.qwen2`,
float32, on a 1 x 1 (fsdp, tp) mesh shared by the actor and the vanilla rollout engine,
so sampling reads the trained weights in place), builds an `RLCluster` and a
`GRPOLearner` (beta 0, one iteration, AdamW with global-norm clipping 1.0, temperature
1, top-p 1), runs `--warmup` steps, reports "ready", then one training step per "step"
command (see `protocol.py`).

The training loop is tunix's own `learner.train()`: its data iterator is a gate that
blocks until the driver asks for the next step, so a step's time is one whole iteration
of tunix's loop (generation, rewards, advantages, the actor update, tunix's per-step
bookkeeping), ended when the updated parameters are ready. The rollout time is the time
spent in `RLCluster.generate`. Generation is forced to its full length by an EOS id
outside the vocabulary.

Multi-turn settings are not run. tunix 0.1.7's multi-turn path is
`tunix.rl.agentic.agentic_grpo_learner.GRPOLearner`: an asyncio orchestrator plays each
(agent, environment) pair on its own, renders every turn through a chat-template parser
and calls `RLCluster.generate` once per episode per turn (the learner fixes
`rollout_micro_batch_size = 1`); a turn is capped only by the episode's remaining
`max_response_length` (which `RolloutConfig.max_tokens_to_generate` must equal). The
equal-work setting (6 turns of at most 3 tokens, 64 episodes) would need a chat parser
for a character vocabulary and an override of the learner's `_model_call` to cap each
turn: not done, so the worker reports the setting as not compared.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol  # noqa: E402  pylint: disable=wrong-import-position


class IdTokenizer:
    """Token i is the word f"t{i}" (tunix's tokenizer interface: encode, decode, bos_id,
    eos_id, pad_id). No BOS; the EOS id is `vocab`, which the model never samples."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str, **kwargs) -> list[int]:
        return [int(word[1:]) for word in text.split()]

    def decode(self, ids, **kwargs) -> str:
        return " ".join(f"t{int(i)}" for i in ids)

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return self.vocab

    def pad_id(self) -> int:
        return protocol.PAD_ID


def build(setting: protocol.Setting, checkpoint: str, seed: int, stats: dict):
    import jax
    import numpy as np
    import optax
    from tunix.models.qwen2 import model as qwen2_model
    from tunix.models.qwen2 import params as qwen2_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    if setting.turns:
        raise NotImplementedError(
            "multi-turn not wired: tunix's agentic GRPOLearner generates one episode per "
            "call and caps turns only by the episode's token budget (see the worker's "
            "docstring)")
    # Auto-sharded axes, as tunix's examples build them (jax.make_mesh's explicit axes
    # break its embedding gather).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    config = qwen2_model.ModelConfig(
        num_layers=setting.num_layers, vocab_size=setting.vocab, embed_dim=setting.d_model,
        hidden_dim=setting.mlp_dim, num_heads=setting.num_heads, head_dim=setting.head_dim,
        num_kv_heads=setting.num_kv_heads, rope_theta=int(setting.rope_theta),
        norm_eps=setting.norm_eps, use_tied_embedding=False)
    model = qwen2_params.create_model_from_safe_tensors(checkpoint, config, mesh)
    tokenizer = IdTokenizer(setting.vocab)
    context = setting.prompt_len + setting.gen_len
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.chain(optax.clip_by_global_norm(1.0),
                                        optax.adamw(1e-5, b1=0.9, b2=0.99)),
            eval_every_n_steps=10**9, max_steps=10**6,
            metrics_logging_options=None),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=setting.gen_len, max_prompt_length=setting.prompt_len,
            kv_cache_size=context, temperature=1.0, top_p=1.0, top_k=None,
            eos_tokens=[setting.vocab]))
    cluster = rl_cluster_lib.RLCluster(actor=model, reference=None, tokenizer=tokenizer,
                                       cluster_config=cluster_config)

    def reward(prompts, completions, **kwargs):
        values = [protocol.target_share(tokenizer.encode(c)) for c in completions]
        stats["reward_sum"] += sum(values)
        stats["reward_count"] += len(values)
        return values

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=reward,
        algo_config=grpo_learner.GRPOConfig(num_generations=setting.group_size,
                                            num_iterations=1, beta=0.0, epsilon=0.2))
    generate = cluster.generate

    def timed_generate(*a, **kw):
        start = time.perf_counter()
        out = generate(*a, **kw)
        stats["rollout_s"] += time.perf_counter() - start
        stats["generated"] += sum(len(t) for t in out.tokens)
        stats["trained"] += len(out.tokens) * context
        return out

    cluster.generate = timed_generate
    rng = np.random.default_rng(seed)

    def prompts():  # one array leaf: tunix repeats every leaf of the batch G times
        return np.array([" ".join(f"t{i}" for i in rng.integers(
            protocol.FIRST_PROMPT_ID, setting.vocab, setting.prompt_len))
            for _ in range(setting.num_prompts)])

    return learner, prompts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    channel = protocol.Channel()
    try:
        setting = protocol.Setting.from_json(args.setting)
        stats = {"rollout_s": 0.0, "generated": 0, "trained": 0, "reward_sum": 0.0,
                 "reward_count": 0}
        start = time.perf_counter()
        learner, prompts = build(setting, args.checkpoint, args.seed, stats)
        setup_s = time.perf_counter() - start
        import jax
        from flax import nnx
        from importlib import metadata

        versions = {p: metadata.version(p) for p in ("google-tunix", "jax", "flax")}

        class Gate:
            """The training data: each `next` ends the step before it (parameters ready)
            and blocks until the driver asks for the next one."""

            def __init__(self):
                self.calls = 0
                self.started = None
                self.first_step_s = None

            def __iter__(self):
                return self

            def __next__(self):
                self.calls += 1
                steps_done = self.calls - 1  # call 1 is train()'s peek at the batch size
                if steps_done >= 1:
                    jax.block_until_ready(nnx.state(learner.rl_cluster.actor_trainer.model))
                    elapsed = time.perf_counter() - self.started
                    record = dict(step_s=elapsed, rollout_s=stats["rollout_s"],
                                  generated_tokens=stats["generated"],
                                  trained_tokens=stats["trained"],
                                  reward_mean=stats["reward_sum"] / max(1, stats["reward_count"]))
                    stats.update(rollout_s=0.0, generated=0, trained=0, reward_sum=0.0,
                                 reward_count=0)
                    if steps_done == 1:
                        self.first_step_s = elapsed
                    if steps_done > args.warmup:
                        channel.send("step", **record)
                    elif steps_done == args.warmup:
                        channel.send("ready", setup_s=setup_s,
                                     first_step_s=self.first_step_s, versions=versions)
                if steps_done >= args.warmup:
                    if channel.next_command() != "step":
                        channel.send("bye")
                        os._exit(0)  # pylint: disable=protected-access
                self.started = time.perf_counter()
                return {"prompts": prompts()}

        learner.train(Gate())
        raise RuntimeError("tunix's train loop ended")
    except Exception as e:  # noqa: BLE001 - reported to the driver, which carries on
        traceback.print_exc()
        channel.send("error", message=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        sys.stdout.flush()
        os._exit(1)  # pylint: disable=protected-access


if __name__ == "__main__":
    main()
