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

Multi-turn settings run tunix's agentic learner
(`tunix.rl.agentic.agentic_grpo_learner.GRPOLearner`, 0.1.7): its asyncio orchestrator
plays each (agent, environment) pair on its own and calls `RLCluster.generate` once per
episode per turn with that episode's whole conversation (the learner fixes
`rollout_micro_batch_size = 1`: no batching across episodes with the vanilla engine).
The environment is guess_number on the host (`protocol.GuessNumberHost`); the chat
parser lays the conversation out as arl does (prompt, each turn's tokens and its
end-of-turn, the reply; no role markers); the model's character vocabulary is arl's
CharCodec, with BOS before the prompt and end-of-turn as EOS. tunix caps a turn only by
the episode's remaining token budget (`max_response_length`, which
`RolloutConfig.max_tokens_to_generate` must equal), so the worker's learner subclass
caps each `_model_call` at `gen_len` tokens, as arl's action budget does. The rollout
time is the span from the step's first to its last generate call (the calls of
different episodes overlap).
"""

from __future__ import annotations

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


class CharTokenizer:
    """arl's CharCodec ids as tunix's tokenizer interface: one id per character, special
    tokens written as their names ("<eot>"); BOS is prepended to every prompt, the
    end-of-turn token is the EOS that ends a turn's generation."""

    def encode(self, text: str, **kwargs) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            special = next((t for t in protocol.SPECIAL_TOKENS if text.startswith(t, i)), None)
            token = special or text[i]
            ids.append(protocol.CHAR_IDS.get(token, protocol.PAD_ID))
            i += len(token)
        return ids

    def decode(self, ids, **kwargs) -> str:
        return "".join(protocol.CHAR_VOCAB[int(i)] for i in ids
                       if 0 <= int(i) < len(protocol.CHAR_VOCAB))

    def bos_id(self) -> int:
        return protocol.CHAR_BOS_ID

    def eos_id(self) -> int:
        return protocol.CHAR_EOT_ID

    def pad_id(self) -> int:
        return protocol.PAD_ID


def load_model(setting: protocol.Setting, checkpoint: str):
    import jax
    import numpy as np
    from tunix.models.qwen2 import model as qwen2_model
    from tunix.models.qwen2 import params as qwen2_params

    # Auto-sharded axes, as tunix's examples build them (jax.make_mesh's explicit axes
    # break its embedding gather).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    config = qwen2_model.ModelConfig(
        num_layers=setting.num_layers, vocab_size=setting.vocab, embed_dim=setting.d_model,
        hidden_dim=setting.mlp_dim, num_heads=setting.num_heads, head_dim=setting.head_dim,
        num_kv_heads=setting.num_kv_heads, rope_theta=int(setting.rope_theta),
        norm_eps=setting.norm_eps, use_tied_embedding=False)
    return mesh, qwen2_params.create_model_from_safe_tensors(checkpoint, config, mesh)


def optimizer():
    import optax
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5, b1=0.9, b2=0.99))


def build_multiturn(setting: protocol.Setting, checkpoint: str, seed: int, stats: dict):
    """tunix's agentic GRPO learner on guess_number: one (agent, environment) pair per
    episode, each turn a `RLCluster.generate` call of that episode's conversation."""
    import threading

    import numpy as np
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.agentic import agentic_grpo_learner
    from tunix.rl.agentic.environments import base_environment
    from tunix.rl.agentic.parser.chat_template_parser import parser as parser_lib
    from tunix.rl.rollout import base_rollout

    mesh, model = load_model(setting, checkpoint)
    tokenizer = CharTokenizer()
    prompt_text = "guess 0-15"
    budget = setting.turns * (setting.gen_len + max(len(r) for r in protocol.GUESS_REPLIES))

    class PlainParser(parser_lib.BaseChatTemplateParser):
        """The conversation as arl lays it out: prompt, then each turn's tokens, its
        end-of-turn, the reply; no role markers."""

        def _init_tokens(self):
            return parser_lib.TokenConfig(eot_token="<eot>")

        def _init_generation_prompt(self):
            return ""

        def _handle_first_message(self, messages):
            return ""

        def _parse_system(self, content):
            return ""

        def _parse_user(self, content):
            return content

        def _parse_assistant(self, content):
            return content + "<eot>"

    class GuessNumberEnv(base_environment.BaseTaskEnv):
        def __init__(self, task=None, **kwargs):
            super().__init__(task, max_steps=setting.turns, **kwargs)
            self.game = None

        def _initial_observation(self):
            hidden = int(np.asarray(self.task["hidden"]).reshape(-1)[0])  # a batch of one
            self.game = protocol.GuessNumberHost(hidden, setting.turns)
            return prompt_text

        def _step_impl(self, action):
            before = self.game.episode_return
            reply = self.game.step(tokenizer.encode(str(action)))
            if self.game.done:
                with lock:
                    stats["reward_sum"] += self.game.episode_return
                    stats["reward_count"] += 1
            return base_environment.EnvStepResult(
                observation=tokenizer.decode(reply), done=self.game.done, info={},
                reward=self.game.episode_return - before)

    class CappedTurns(agentic_grpo_learner.GRPOLearner):
        """Caps every turn at `gen_len` tokens (tunix caps a turn only by the episode's
        remaining token budget)."""

        def _model_call(self, chat_lists, env=None, max_generation_steps=None):
            steps = setting.gen_len if max_generation_steps is None else min(
                max_generation_steps, setting.gen_len)
            start = time.perf_counter()
            out = super()._model_call(chat_lists, env, max_generation_steps=steps)
            end = time.perf_counter()
            with lock:
                stats["first_generate"] = min(stats.get("first_generate") or start, start)
                stats["last_generate"] = max(stats.get("last_generate") or end, end)
                stats["generated"] += sum(len(t) for t in out.tokens)
                stats["generate_calls"] += 1
            return out

    lock = threading.Lock()
    cluster = rl_cluster_lib.RLCluster(
        actor=model, reference=None, tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh,
                          rl_cluster_lib.Role.REFERENCE: mesh,
                          rl_cluster_lib.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optimizer(), eval_every_n_steps=10**9, max_steps=10**6,
                metrics_logging_options=None),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=budget, max_prompt_length=setting.prompt_len,
                kv_cache_size=256, temperature=1.0, top_p=1.0, top_k=None,
                return_logprobs=True)))
    learner = CappedTurns(
        rl_cluster=cluster, reward_fns=None, chat_parser=PlainParser(tokenizer),
        algo_config=agentic_grpo_learner.GRPOConfig(
            num_generations=setting.group_size, num_iterations=1, beta=0.0, epsilon=0.2,
            max_response_length=budget, system_prompt=""),
        env_class=GuessNumberEnv)
    rng = np.random.default_rng(seed)

    def batch():
        return {"prompts": np.array([prompt_text] * setting.num_prompts),
                "hidden": rng.integers(0, 16, size=setting.num_prompts)}

    return learner, batch


def build(setting: protocol.Setting, checkpoint: str, seed: int, stats: dict):
    import numpy as np
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    mesh, model = load_model(setting, checkpoint)
    tokenizer = IdTokenizer(setting.vocab)
    context = setting.prompt_len + setting.gen_len
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer(),
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

    def batch():  # one array leaf: tunix repeats every leaf of the batch G times
        return {"prompts": np.array([" ".join(f"t{i}" for i in rng.integers(
            protocol.FIRST_PROMPT_ID, setting.vocab, setting.prompt_len))
            for _ in range(setting.num_prompts)])}

    return learner, batch


def main():
    args = protocol.worker_arguments()
    if os.environ.get("ARL_PEERS_INLINE_DISPATCH") == "1":
        # What arl's training CLI does (`arl.runs.process_settings.run_computations_inline`),
        # before JAX's backend starts, as the driver asks for every side.
        import jax
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    channel = protocol.Channel()
    try:
        setting = protocol.Setting.from_json(args.setting)
        stats = {"rollout_s": 0.0, "generated": 0, "trained": 0, "reward_sum": 0.0,
                 "reward_count": 0, "generate_calls": 0, "first_generate": None,
                 "last_generate": None}
        start = time.perf_counter()
        learner, batch = (build_multiturn if setting.turns else build)(
            setting, args.checkpoint, args.seed, stats)
        setup_s = time.perf_counter() - start
        import jax
        from flax import nnx
        from importlib import metadata

        versions = {p: metadata.version(p) for p in ("google-tunix", "jax", "flax")}
        # Multi-turn: tunix trains on the prompt padded to max_prompt_length and the
        # conversation padded to max_response_length.
        trained_per_step = setting.batch * (setting.prompt_len + setting.turns * (
            setting.gen_len + max(len(r) for r in protocol.GUESS_REPLIES)))

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
                    rollout_s = stats["rollout_s"]
                    if stats["first_generate"] is not None:  # concurrent per-episode calls
                        rollout_s = stats["last_generate"] - stats["first_generate"]
                    record = dict(step_s=elapsed, rollout_s=rollout_s,
                                  generated_tokens=stats["generated"],
                                  trained_tokens=stats["trained"] or trained_per_step,
                                  generate_calls=stats["generate_calls"],
                                  reward_mean=stats["reward_sum"] / max(1, stats["reward_count"]))
                    stats.update(rollout_s=0.0, generated=0, trained=0, reward_sum=0.0,
                                 reward_count=0, generate_calls=0, first_generate=None,
                                 last_generate=None)
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
                return batch()

        learner.train(Gate())
        raise RuntimeError("tunix's train loop ended")
    except Exception as e:  # noqa: BLE001 - reported to the driver, which carries on
        traceback.print_exc()
        channel.send("error", message=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        sys.stdout.flush()
        os._exit(1)  # pylint: disable=protected-access


if __name__ == "__main__":
    main()
