"""The single compiled training step for token environments: rollout + signals + update.

    train_step(state) -> (state, metrics)      # one jax.jit program, state donated

1. rollout   : `arl.rollout.rollout` — a scan over turns with KV-cached decoding.
2. signals   : rewards -> advantages (PPO GAE / GRPO / Dr.GRPO / RLOO / REINFORCE++ /
               ERPO), StarPO-S and DAPO filters, KL-in-reward.
3. update    : a scan over epochs x minibatches of optax updates on
               policy + value + KL(ref) - entropy + ECHO + SFT terms; skipped (parameters
               unchanged) when no advantage in the batch is non-zero.

`Trainer(config)` builds the pieces from an `ml_collections` config (see `arl.config`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct

from arl import algorithms as alg
from arl import branching as branching_lib
from arl import config as config_lib
from arl import credit as credit_lib
from arl import datasets as datasets_lib
from arl import envs as envs_lib
from arl import rollout as rollout_lib
from arl import sharding as sharding_lib
from arl.models import lora as lora_lib
from arl.models import transformer as transformer_lib


@struct.dataclass
class TrainState:
    """The trained parameters and everything else a step carries.

    Full fine-tuning: `params` is the policy's parameter tree and `ref_params` a frozen
    copy of the initial policy when a KL term or PRIME needs the reference.
    LoRA (model.lora_rank > 0): `params` holds only the trainable part,
    {"lora": adapters} (plus {"value_head": ...} for PPO, whose critic head is trained
    with the adapters), `base_params` the frozen base weights, and the policy is
    `Trainer.policy_params(state)` = merge_lora(base, adapters); the reference policy is
    the base itself, so `ref_params` stays None (no second copy)."""

    params: Any
    opt_state: Any
    ref_params: Any  # None unless a KL term needs the reference policy (and not LoRA)
    step: jax.Array  # int32 []
    key: jax.Array
    # The learned process reward model and its optimizer state (process.train_prm), and
    # PRIME's implicit PRM (process.implicit_coef > 0); None when unused.
    prm_params: Any = None
    prm_opt_state: Any = None
    implicit_params: Any = None
    implicit_opt_state: Any = None
    # The frozen base weights under LoRA (model.lora_rank > 0); None otherwise.
    base_params: Any = None


def make_env(env_config: ml_collections.ConfigDict):
    """Builds the environment named by `config.env` (a single env or a mixture)."""
    if env_config.name == "mixture":
        members = [
            envs_lib.make(m["name"], **dict(m.get("kwargs", {}))) for m in env_config.members
        ]
        return envs_lib.Mixture(members)
    return envs_lib.make(env_config.name, **dict(env_config.kwargs))


def env_names(env) -> tuple[str, ...]:
    members = getattr(env, "envs", None)
    if members is None:
        return (getattr(env, "name", "env"),)
    return tuple(f"{i}_{getattr(m, 'name', 'env')}" for i, m in enumerate(members))


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    o = config.optim
    total = max(1, config.train_steps * config.updates.epochs * config.updates.minibatches)
    if o.schedule == "constant":
        decay = optax.constant_schedule(o.learning_rate)
    elif o.schedule == "linear":
        decay = optax.linear_schedule(o.learning_rate, 0.0, max(1, total - o.warmup_steps))
    else:
        decay = optax.cosine_decay_schedule(o.learning_rate, max(1, total - o.warmup_steps))
    if o.warmup_steps:
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps), decay],
            [o.warmup_steps])
    else:
        schedule = decay
    parts = []
    if o.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(o.max_grad_norm))
    parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))
    return optax.chain(*parts)


def sft_weight(config, step):
    """alpha of RL + alpha*SFT: constant, or held for `sft_hold_steps` and then decayed
    linearly to `sft_coef_final` over `sft_decay_steps` (high early, lower later)."""
    c = config.loss
    if c.sft_coef_final < 0:
        return jnp.asarray(c.sft_coef, jnp.float32)
    frac = jnp.clip((step - c.sft_hold_steps) / max(1, c.sft_decay_steps), 0.0, 1.0)
    return (c.sft_coef + frac * (c.sft_coef_final - c.sft_coef)).astype(jnp.float32)


def _override_params(params, overrides: dict, field: str):
    """`params` with some fields replaced; unknown fields are a ConfigError."""
    if not overrides:
        return params
    fields = {f.name for f in dataclasses.fields(params)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise config_lib.ConfigError(
            f"config.{field} has unknown fields {unknown}; {type(params).__name__} fields "
            f"are {sorted(fields)}")
    return params.replace(**{k: jnp.full_like(getattr(params, k), v)
                             for k, v in overrides.items()})


def _shift_right(x):
    """Pads a [B, S-1] per-prediction array to [B, S] so index t belongs to token t."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)


class Trainer:
    """Static pieces of an experiment and its jitted `train_step`."""

    def __init__(self, config: ml_collections.ConfigDict, *, mesh=None):
        config_lib.validate(config, num_devices=jax.device_count())
        if config.algorithm == "ppo_vector":
            raise ValueError("config.algorithm='ppo_vector' is trained by arl.vector_ppo.")
        self.config = config
        self.env = make_env(config.env)
        self.env_names = env_names(self.env)
        self.num_envs = len(self.env_names)
        self.context_length = rollout_lib.context_length(self.env)
        self.row_params(1, 1)  # rejects unknown config.env.params fields before tracing
        m = config.model
        model = (self._pretrained_model(config) if m.get("hf_checkpoint", "")
                 else self._fresh_model(config))
        # model.layer_unroll 0 = every layer of this architecture (fresh or checkpoint).
        self.model = model.clone(config=dataclasses.replace(
            model.config, layer_unroll=m.layer_unroll or model.config.num_layers))
        self.optimizer = make_optimizer(config)
        self.sampling = rollout_lib.SamplingConfig(
            temperature=config.rollout.temperature, top_k=config.rollout.top_k,
            top_p=config.rollout.top_p)
        self.batch_size = config.rollout.num_tasks * config.rollout.group_size
        self.mesh = mesh if mesh is not None else sharding_lib.make_mesh(tuple(config.mesh))
        p = config.process
        self.uses_implicit_prm = p.implicit_coef > 0
        self.uses_reference = config.loss.kl_coef > 0 or self.uses_implicit_prm
        self.lora = None
        if m.get("lora_rank", 0) > 0:
            self.lora = lora_lib.LoraConfig(rank=m.lora_rank, alpha=float(m.lora_alpha),
                                            targets=tuple(m.lora_targets))
        self.branch_turns = self._branch_turns()
        self.prm_model = None
        self.prm_optimizer = None
        if p.train_prm or self.uses_implicit_prm:
            self.prm_optimizer = optax.chain(
                optax.clip_by_global_norm(config.optim.max_grad_norm or 1e9),
                optax.adam(p.prm_learning_rate))
        if p.train_prm:
            self.prm_model = transformer_lib.Transformer(
                dataclasses.replace(self.model.config, value_head=True))
        # Demonstrations for the SFT term: loaded once into device arrays, or None to
        # generate them on the fly with `loss.sft_source`.
        self.demonstrations = None
        if config.loss.sft_coef > 0 and config.loss.get("sft_dataset", ""):
            self.demonstrations = datasets_lib.load_demonstrations(
                config.loss.sft_dataset, env_config=config.env,
                context_length=self.context_length)
        self._state_shardings = None
        self.train_step = self._compile_train_step()

    def _fresh_model(self, config):
        m = config.model
        return transformer_lib.Transformer(transformer_lib.TransformerConfig(
            vocab_size=self.env.codec.vocab_size,
            d_model=m.d_model,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            mlp_dim=m.mlp_dim,
            max_len=self.context_length,
            rope_theta=m.rope_theta,
            tie_embeddings=m.tie_embeddings,
            value_head=config.algorithm == "ppo",
            dtype=jnp.dtype(m.dtype),
        ))

    def _pretrained_model(self, config):
        """The architecture of `model.hf_checkpoint` (float32 master weights, activations in
        `model.dtype`); its weights are loaded by `init_state`."""
        from arl.models import hf_import
        m = config.model
        model_config = hf_import.load_hf_config(
            m.hf_checkpoint, dtype=jnp.dtype(m.dtype), param_dtype=jnp.float32,
            max_len=self.context_length, value_head=config.algorithm == "ppo")
        if model_config.vocab_size < self.env.codec.vocab_size:
            raise config_lib.ConfigError(
                f"config.model.hf_checkpoint={m.hf_checkpoint!r} has vocab_size "
                f"{model_config.vocab_size} < the env codec's {self.env.codec.vocab_size}: "
                f"use the checkpoint's own tokenizer (env.kwargs.codec=<tokenizer.json>)")
        return transformer_lib.Transformer(model_config)

    def _branch_turns(self) -> tuple[int, ...]:
        """Turns to fork before for Monte Carlo values (process.branch_turns, validated
        against the env's max_turns); turn 0 too when groups cannot supply its value."""
        p = self.config.process
        if p.mc_samples < 1:
            return ()
        max_turns = self.env.max_turns
        turns = tuple(p.branch_turns) or tuple(range(1, max_turns))
        bad = [t for t in turns if not 0 <= t < max_turns]
        if bad or len(set(turns)) != len(turns):
            raise config_lib.ConfigError(
                f"config.process.branch_turns={tuple(p.branch_turns)} must be distinct turns "
                f"in [0, max_turns={max_turns}) of env {self.config.env.name!r}")
        if self.config.rollout.group_size < 2 and 0 not in turns:
            turns = (0,) + turns
        if not turns:  # max_turns == 1 with groups: the group mean is the only value
            turns = (0,)
        return tuple(sorted(turns))

    def row_params(self, num_tasks: int, group_size: int):
        """Per-row environment params: defaults with the config's overrides applied
        (`env.params`, or `env.members[i].params` for a mixture's member i)."""
        if isinstance(self.env, envs_lib.Mixture):
            members = tuple(
                _override_params(env.default_params(), dict(m.get("params", {})),
                                 f"env.members[{i}].params")
                for i, (env, m) in enumerate(zip(self.env.envs, self.config.env.members)))
            member = jnp.arange(num_tasks, dtype=jnp.int32) % self.env.num_envs
            return self.env.batch_params(jnp.repeat(member, group_size), members)
        params = _override_params(self.env.default_params(),
                                  dict(self.config.env.get("params", {})), "env.params")
        return envs_lib.broadcast_params(params, num_tasks * group_size)

    # ------------------------------------------------------------------ state
    def init_state(self, seed: int | None = None) -> TrainState:
        seed = self.config.seed if seed is None else seed
        init_key, key = jax.random.split(jax.random.key(seed))
        pretrained = None
        if self.config.model.get("hf_checkpoint", ""):
            from arl.models import hf_import
            _, pretrained = hf_import.load_hf_checkpoint(
                self.config.model.hf_checkpoint, config=self.model.config, mesh=self.mesh)
        return jax.jit(self._initial_state, out_shardings=self.state_shardings())(
            init_key, key, pretrained)

    def _initial_state(self, init_key, key, pretrained=None) -> TrainState:
        dummy = jnp.zeros((1, self.context_length), jnp.int32)
        policy_key, prm_key = jax.random.split(init_key)
        params = nn.unbox(self.model.init(policy_key, dummy)["params"])
        if pretrained is not None:  # the checkpoint's weights; a value head stays fresh
            params = {**params, **pretrained}
        if self.lora is not None:
            # The weights above become the frozen base (and the reference policy); the
            # trainable state is the adapters (B = 0: the policy starts as the base).
            base = params
            params = {"lora": lora_lib.init_lora(jax.random.fold_in(init_key, 1), base,
                                                 self.lora)}
            if "value_head" in base:  # PPO's critic head trains with the adapters
                params["value_head"] = base["value_head"]
            state = TrainState(params=params, opt_state=self.optimizer.init(params),
                               ref_params=None, step=jnp.zeros((), jnp.int32), key=key,
                               base_params=base)
            params = base  # PRIME's implicit PRM (below) starts as the reference
        else:
            state = TrainState(
                params=params,
                opt_state=self.optimizer.init(params),
                ref_params=params if self.uses_reference else None,
                step=jnp.zeros((), jnp.int32),
                key=key,
            )
        if self.prm_model is not None:
            prm_params = nn.unbox(self.prm_model.init(prm_key, dummy)["params"])
            state = state.replace(prm_params=prm_params,
                                  prm_opt_state=self.prm_optimizer.init(prm_params))
        if self.uses_implicit_prm:  # PRIME: the implicit PRM starts as the reference
            state = state.replace(implicit_params=params,
                                  implicit_opt_state=self.prm_optimizer.init(params))
        return state

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state (orbax restore target)."""
        abstract = jax.eval_shape(self.init_state_unsharded_shape)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract, self.state_shardings())

    def init_state_unsharded_shape(self):
        return self._initial_state(jax.random.key(0), jax.random.key(0))

    def state_shardings(self):
        if self._state_shardings is None:
            param_shardings = transformer_lib.param_shardings(
                transformer_lib.abstract_params(self.model), self.mesh)
            abstract = jax.eval_shape(self.init_state_unsharded_shape)
            replicated = sharding_lib.replicated(self.mesh)

            def opt_shardings(optimizer, opt_state, param_shardings):
                return sharding_lib.opt_state_shardings(
                    optimizer, opt_state, param_shardings, replicated)

            if self.lora is not None:  # adapters replicated, the base sharded
                trainable = jax.tree.map(lambda _: replicated, abstract.params)
                shardings = TrainState(
                    params=trainable,
                    opt_state=opt_shardings(self.optimizer, abstract.opt_state, trainable),
                    ref_params=None, step=replicated, key=replicated,
                    base_params=param_shardings)
            else:
                shardings = TrainState(
                    params=param_shardings,
                    opt_state=opt_shardings(self.optimizer, abstract.opt_state,
                                            param_shardings),
                    ref_params=param_shardings if self.uses_reference else None,
                    step=replicated,
                    key=replicated,
                )
            if self.prm_model is not None:
                prm_shardings = transformer_lib.param_shardings(
                    transformer_lib.abstract_params(self.prm_model), self.mesh)
                shardings = shardings.replace(
                    prm_params=prm_shardings,
                    prm_opt_state=opt_shardings(self.prm_optimizer, abstract.prm_opt_state,
                                                prm_shardings))
            if self.uses_implicit_prm:
                shardings = shardings.replace(
                    implicit_params=param_shardings,
                    implicit_opt_state=opt_shardings(
                        self.prm_optimizer, abstract.implicit_opt_state, param_shardings))
            self._state_shardings = shardings
        return self._state_shardings

    # ------------------------------------------------------------------ policy
    def _merge(self, trainable, base):
        """The policy's parameter tree: `trainable` itself, or under LoRA the base with
        the adapters merged in (and PPO's trained value head)."""
        if self.lora is None:
            return trainable
        merged = lora_lib.merge_lora(base, trainable["lora"], self.lora)
        if "value_head" in trainable:
            merged = {**merged, "value_head": trainable["value_head"]}
        return merged

    def _policy(self, state: TrainState):
        return self._merge(state.params, state.base_params)

    def _reference(self, state: TrainState):
        """The reference policy's parameters: the frozen base under LoRA."""
        return state.base_params if self.lora is not None else state.ref_params

    @functools.cached_property
    def _merge_fn(self):
        param_shardings = transformer_lib.param_shardings(
            transformer_lib.abstract_params(self.model), self.mesh)
        return jax.jit(self._merge, out_shardings=param_shardings)

    def policy_params(self, state: TrainState):
        """Parameters of the current policy for `model.apply` / `rollout` / `evaluate`,
        outside jit: `state.params`, or under LoRA the base with the adapters merged (a
        new array per targeted kernel, with the model's shardings)."""
        if self.lora is None:
            return state.params
        return self._merge_fn(state.params, state.base_params)

    # ------------------------------------------------------------------ step
    def _compile_train_step(self):
        shardings = self.state_shardings()
        return jax.jit(
            self._train_step,
            in_shardings=(shardings,),
            out_shardings=(shardings, sharding_lib.replicated(self.mesh)),
            donate_argnums=(0,),
        )

    def horizon(self, step):
        r = self.config.rollout
        if not r.horizon_rounds:
            return jnp.asarray(self.env.max_turns, jnp.int32)
        return alg.horizon_schedule(step, rounds=tuple(r.horizon_rounds), every=r.horizon_every)

    def _forward(self, params, tokens):
        """Per-token log-probs, entropies and values aligned to token index."""
        if self.config.model.logprob_chunk:
            return self._chunked_forward(params, tokens)
        out = self.model.apply({"params": params}, tokens)
        logits = out.logits[:, :-1] / jnp.maximum(self.config.rollout.temperature, 1e-6)
        logp = _shift_right(alg.token_logprobs(logits, tokens[:, 1:]))
        ent = _shift_right(alg.entropy(logits))
        values = None if out.values is None else _shift_right(out.values[:, :-1])
        return logp, ent, values

    def _chunked_forward(self, params, tokens):
        """`_forward` without [B, T, V] logits: log-probs and entropies from the hidden
        states, `model.logprob_chunk` positions at a time (arl.models.logprobs)."""
        from arl.models.logprobs import chunked_token_logprobs
        out = self.model.apply({"params": params}, tokens, return_hidden=True,
                               compute_logits=False)
        # (h W) / tau == h (W / tau): scale the [D, V] matrix, not the logits.
        unembed = transformer_lib.unembedding_matrix(params, self.model.config).astype(
            jnp.float32) / jnp.maximum(self.config.rollout.temperature, 1e-6)
        logp, ent = chunked_token_logprobs(out.hidden[:, :-1], unembed, tokens[:, 1:],
                                           self.config.model.logprob_chunk)
        values = None if out.values is None else _shift_right(out.values[:, :-1])
        return _shift_right(logp), _shift_right(ent), values

    def _train_step(self, state: TrainState):
        c = self.config
        p = c.process
        key, rollout_key, demo_key, update_key = jax.random.split(state.key, 4)
        key, branch_key = jax.random.split(key)
        horizon = self.horizon(state.step)
        batch_axes = sharding_lib.batch_sharding(self.mesh)
        row_params = self.row_params(c.rollout.num_tasks, c.rollout.group_size)
        policy = self._policy(state)
        traj = rollout_lib.rollout(
            self.env, rollout_key, num_tasks=c.rollout.num_tasks,
            group_size=c.rollout.group_size, model=self.model, params=policy,
            sampling=self.sampling, horizon=horizon, env_params=row_params,
            record_turn_states=bool(self.branch_turns))
        traj = jax.lax.with_sharding_constraint(traj, batch_axes)
        mask = traj.agent_mask
        metrics = {}

        ref_logp = None
        if self.uses_reference:
            ref_logp, _, _ = self._forward(self._reference(state), traj.tokens)
            ref_logp = jax.lax.stop_gradient(ref_logp)
        old_values = None
        if c.algorithm == "ppo":
            # Recorded while sampling with the same parameters: no second forward pass.
            old_values = _shift_right(traj.values[:, :-1]) * mask

        branch = None
        if self.branch_turns:
            branch = branching_lib.branch_values(
                self.env, branch_key, traj, branch_turns=self.branch_turns,
                num_samples=p.mc_samples, model=self.model, params=policy,
                sampling=self.sampling, horizon=horizon, env_params=row_params,
                estimate="mean_return" if c.algorithm == "vineppo" else p.mc_estimate,
                gamma=p.turn_gamma)
            main_steps = jnp.maximum(jnp.sum(traj.num_turns), 1).astype(jnp.float32)
            metrics.update({
                "mc/env_steps": branch.env_steps.astype(jnp.float32),
                "mc/tokens": branch.tokens.astype(jnp.float32),
                "mc/env_steps_per_rollout_step": branch.env_steps / main_steps,
                "mc/value_mean": jnp.sum(branch.values) / jnp.maximum(jnp.sum(branch.known), 1),
            })

        rewards = traj.rewards
        if self.uses_reference and c.loss.kl_in_reward:
            rewards = rewards - c.loss.kl_coef * alg.kl_penalty(
                traj.behaviour_logp, ref_logp, "k1") * mask
        process_rewards = p.reward_weight * traj.process_rewards
        if self.prm_model is not None and p.prm_weight > 0:
            process_rewards = process_rewards + p.prm_weight * credit_lib.prm_turn_rewards(
                self.prm_model, state.prm_params, traj)
        implicit = None
        if self.uses_implicit_prm:
            logp_phi, _, _ = self._forward(state.implicit_params, traj.tokens)
            implicit = credit_lib.implicit_rewards(logp_phi, ref_logp, mask, p.implicit_coef)
        advantages, returns, seq_valid, signal_metrics = self._advantages(
            traj, rewards, old_values, process_rewards=process_rewards,
            implicit_rewards=implicit, branch=branch)
        loss_mask = mask * seq_valid[:, None]
        advantages = advantages * loss_mask
        prm_updates = self._update_process_models(state, traj, ref_logp, branch)
        metrics.update(prm_updates.pop("metrics"))

        demo = None
        if c.loss.sft_coef > 0 and self.demonstrations is not None:
            # A stored set (loss.sft_dataset): a minibatch drawn by index, on device.
            demo = datasets_lib.sample_demonstrations(
                self.demonstrations, demo_key, self.batch_size)
            demo = jax.lax.with_sharding_constraint(demo, batch_axes)
        elif c.loss.sft_coef > 0:
            demo = rollout_lib.rollout(
                self.env, demo_key, num_tasks=c.rollout.num_tasks,
                group_size=c.rollout.group_size, action_source=c.loss.sft_source,
                env_params=self.row_params(c.rollout.num_tasks, c.rollout.group_size))
            demo = jax.lax.with_sharding_constraint(demo, batch_axes)
        batch = dict(
            tokens=traj.tokens, mask=loss_mask, old_logp=traj.behaviour_logp,
            advantages=advantages, observation_mask=traj.observation_mask)
        if old_values is not None:
            batch.update(old_values=old_values, returns=returns)
        if ref_logp is not None:
            batch.update(ref_logp=ref_logp)
        if demo is not None:
            batch.update(demo_tokens=demo.tokens, demo_mask=demo.agent_mask)

        has_signal = jnp.any(advantages != 0)
        if demo is not None or c.loss.echo_coef > 0 or not c.filters.skip_zero_advantage:
            has_signal = jnp.ones((), bool)  # the auxiliary terms still carry gradient

        def do_update(operand):
            params, opt_state = operand
            return self._update(params, opt_state, batch, update_key, state.step,
                                state.base_params)

        def skip_update(operand):
            params, opt_state = operand
            return params, opt_state, self._zero_update_metrics()

        params, opt_state, update_metrics = jax.lax.cond(
            has_signal, do_update, skip_update, (state.params, state.opt_state))

        metrics.update(self._rollout_metrics(traj))
        metrics.update(signal_metrics)
        metrics.update(update_metrics)
        metrics["update_skipped"] = 1.0 - has_signal.astype(jnp.float32)
        metrics["horizon"] = horizon.astype(jnp.float32)
        if demo is not None:
            metrics["demo_success_rate"] = jnp.mean(demo.success.astype(jnp.float32))
            metrics["sft_coef"] = sft_weight(c, state.step)
        new_state = state.replace(
            params=params, opt_state=opt_state, step=state.step + 1, key=key, **prm_updates)
        return new_state, metrics

    def _update_process_models(self, state, traj, ref_logp, branch):
        """One optimizer step of the learned PRM (on the Monte Carlo labels) and of
        PRIME's implicit PRM (on the outcome); returns the new state fields + metrics."""
        p = self.config.process
        out = {"metrics": {}}
        if self.prm_model is not None:
            labels = branch.success if p.mc_estimate == "mean_return" else branch.values
            grads, metrics = jax.grad(credit_lib.prm_loss, has_aux=True)(
                state.prm_params, self.prm_model, traj, labels, branch.known)
            updates, opt_state = self.prm_optimizer.update(
                grads, state.prm_opt_state, state.prm_params)
            out.update(prm_params=optax.apply_updates(state.prm_params, updates),
                       prm_opt_state=opt_state)
            out["metrics"].update(metrics)
        if self.uses_implicit_prm:
            def loss(params):
                logp_phi, _, _ = self._forward(params, traj.tokens)
                return credit_lib.implicit_prm_loss(logp_phi, ref_logp, traj.agent_mask,
                                                    traj.success, p.implicit_coef)
            grads, metrics = jax.grad(loss, has_aux=True)(state.implicit_params)
            updates, opt_state = self.prm_optimizer.update(
                grads, state.implicit_opt_state, state.implicit_params)
            out.update(implicit_params=optax.apply_updates(state.implicit_params, updates),
                       implicit_opt_state=opt_state)
            out["metrics"].update(metrics)
        return out

    # ------------------------------------------------------------------ signals
    def _advantages(self, traj, rewards, old_values, *, process_rewards=None,
                    implicit_rewards=None, branch=None):
        """Token advantages: the algorithm's outcome advantage (weighted by
        process.outcome_weight) plus process-reward and PRIME implicit-reward advantages
        (group leave-one-out baselines, turn-discounted returns); for PPO the rewards are
        summed before GAE; for VinePPO turn advantages come from Monte Carlo values."""
        c = self.config
        p = c.process
        mask = traj.agent_mask
        num_groups = c.rollout.num_tasks
        scores = rewards.sum(axis=1)
        group_ids = traj.group_ids
        metrics = {}
        stats = alg.group_statistics(scores, group_ids, num_groups=num_groups)
        metrics["degenerate_group_fraction"] = stats.degenerate_fraction()
        metrics["within_group_reward_std"] = jnp.mean(stats.std)

        seq_valid = jnp.ones(scores.shape, jnp.float32)
        if c.filters.starpo_keep_fraction < 1.0:
            keep = alg.starpo_keep_mask(
                scores, group_ids, num_groups=num_groups,
                keep_fraction=c.filters.starpo_keep_fraction)
            seq_valid = seq_valid * keep.astype(jnp.float32)
        if c.filters.dapo_zero_variance:
            keep = alg.dapo_zero_variance_mask(scores, group_ids, num_groups=num_groups)
            seq_valid = seq_valid * keep.astype(jnp.float32)
        metrics["kept_fraction"] = jnp.mean(seq_valid)
        valid = seq_valid > 0

        returns = None
        dense = jnp.zeros_like(rewards)
        if process_rewards is not None:
            dense = dense + process_rewards * traj.turn_end_mask
        if c.algorithm == "vineppo":
            advantages = self._vine_advantages(traj, rewards, branch, valid)
            return advantages * mask, returns, seq_valid, metrics
        if c.algorithm == "ppo":
            rewards = p.outcome_weight * rewards + dense
            if implicit_rewards is not None:
                rewards = rewards + p.implicit_weight * implicit_rewards
            if c.advantage.turn_level:
                advantages, returns = alg.turn_level_gae(
                    rewards, old_values, mask, traj.turn_end_mask,
                    gamma=c.advantage.gamma, lam=c.advantage.lam,
                    turn_gamma=c.advantage.turn_gamma)
            else:
                advantages, returns = alg.gae(
                    rewards, old_values, mask, gamma=c.advantage.gamma, lam=c.advantage.lam)
            if c.advantage.whiten:
                advantages = alg.whiten(advantages, mask * seq_valid[:, None])
            return advantages * mask, returns, seq_valid, metrics

        if c.algorithm in ("grpo", "drgrpo"):
            seq_adv = alg.group_advantages(
                scores, group_ids, num_groups=num_groups,
                scale_by_std=c.algorithm == "grpo", eps=c.advantage.eps, valid=valid)
        elif c.algorithm == "rloo":
            seq_adv = alg.rloo_advantages(scores, group_ids, num_groups=num_groups, valid=valid)
        elif c.algorithm == "reinforce_pp":
            seq_adv = alg.reinforce_pp_advantages(
                scores, group_ids, num_groups=num_groups, valid=valid)
        elif c.algorithm == "erpo":
            seq_adv = alg.env_advantages(
                scores, group_ids, traj.env_ids, num_groups=num_groups,
                num_envs=self.num_envs, eps=c.advantage.eps, valid=valid,
                centre_on_env_mean=c.advantage.erpo_centre_on_env_mean)
        else:  # pragma: no cover - validate() rejects this earlier
            raise ValueError(c.algorithm)
        advantages = p.outcome_weight * seq_adv[:, None] * mask
        if process_rewards is not None and (p.reward_weight > 0 or p.prm_weight > 0):
            advantages = advantages + alg.process_advantages(
                dense, traj.turn_end_mask, mask, group_ids, num_groups=num_groups,
                gamma=p.turn_gamma) * valid[:, None]
        if implicit_rewards is not None:
            advantages = advantages + p.implicit_weight * alg.process_advantages(
                implicit_rewards, mask, mask, group_ids, num_groups=num_groups,
                gamma=1.0) * valid[:, None]
        return advantages, returns, seq_valid, metrics

    def _vine_advantages(self, traj, rewards, branch, valid):
        """VinePPO turn advantages r_k + gamma V(s_k+1) - V(s_k) from Monte Carlo values;
        V(s_0) is the leave-one-out mean return of the row's group unless turn 0 was
        branched."""
        c = self.config
        p = c.process
        max_turns = self.env.max_turns
        turn_rewards = p.outcome_weight * alg.tokens_to_turns(
            rewards, traj.turn_end_mask, traj.agent_mask, num_turns=max_turns)
        # The continuations' returns are in units of the env's reward, like `rewards`.
        values, known = p.outcome_weight * branch.values, branch.known
        if 0 not in self.branch_turns:  # group_size >= 2 (see _branch_turns)
            discounts = p.turn_gamma ** jnp.arange(max_turns, dtype=jnp.float32)
            returns = jnp.sum(turn_rewards * discounts, axis=1)
            loo = alg.rloo_advantages(returns, traj.group_ids,
                                      num_groups=c.rollout.num_tasks, valid=valid)
            values = values.at[:, 0].set(returns - loo)  # the mean return of the others
            known = known.at[:, 0].set(True)
        turn_adv = alg.vine_advantages(turn_rewards, values, known, traj.num_turns,
                                       gamma=p.turn_gamma)
        advantages = alg.turns_to_tokens(turn_adv, traj.turn_end_mask, traj.agent_mask)
        if c.advantage.whiten:
            advantages = alg.whiten(advantages, traj.agent_mask * valid[:, None])
        return advantages

    # ------------------------------------------------------------------ update
    def _loss(self, params, mb, step, base=None):
        """Loss of the trainable `params` (under LoRA merged into the frozen `base`)."""
        c = self.config
        params = self._merge(params, base)
        logp, ent, values = self._forward(params, mb["tokens"])
        mask = mb["mask"]
        norm = None
        if c.loss.agg == "seq-mean-token-sum-norm":
            norm = c.loss.norm or float(self.context_length)
        pg, metrics = alg.policy_loss(
            logp, mb["old_logp"], mb["advantages"], mask, clip_low=c.loss.clip_low,
            clip_high=c.loss.clip_high, dual_clip=c.loss.dual_clip or None,
            agg=c.loss.agg, norm=norm)
        metrics = {f"policy/{k}": v for k, v in metrics.items()}
        total = pg
        metrics["loss/policy"] = pg
        ent_mean = alg.aggregate(ent, mask, "token-mean")
        metrics["entropy"] = ent_mean
        if c.loss.entropy_coef > 0:
            total = total - c.loss.entropy_coef * alg.aggregate(ent, mask, c.loss.agg, norm=norm)
        if c.algorithm == "ppo":
            vl, vmetrics = alg.value_loss(
                values, mb["old_values"], mb["returns"], mask,
                clip=c.loss.value_clip or None, agg=c.loss.agg, norm=norm)
            total = total + c.loss.value_coef * vl
            metrics["loss/value"] = vl
            metrics.update({f"value/{k}": v for k, v in vmetrics.items()})
        if "ref_logp" in mb:
            kl = alg.aggregate(alg.kl_penalty(logp, mb["ref_logp"], c.loss.kl_kind), mask,
                               "token-mean")
            metrics["kl_ref"] = kl
            if not c.loss.kl_in_reward:
                total = total + c.loss.kl_coef * alg.aggregate(
                    alg.kl_penalty(logp, mb["ref_logp"], c.loss.kl_kind), mask, c.loss.agg,
                    norm=norm)
        if c.loss.echo_coef > 0:
            echo = alg.observation_loss(logp, mb["observation_mask"])
            total = total + c.loss.echo_coef * echo
            metrics["loss/echo"] = echo
        if "demo_tokens" in mb:
            demo_logp, _, _ = self._forward(params, mb["demo_tokens"])
            sft = alg.sft_loss(demo_logp, mb["demo_mask"])
            total = total + sft_weight(c, step) * sft
            metrics["loss/sft"] = sft
        metrics["loss/total"] = total
        return total, metrics

    def _update(self, params, opt_state, batch, key, step, base=None):
        c = self.config
        num_mb = c.updates.minibatches
        mb_size = self.batch_size // num_mb
        batch_axes = sharding_lib.batch_sharding(self.mesh)
        grad_fn = jax.grad(self._loss, has_aux=True)

        def epoch(carry, epoch_key):
            params, opt_state = carry
            perm = jax.random.permutation(epoch_key, self.batch_size)
            shuffled = jax.tree.map(lambda x: x[perm].reshape((num_mb, mb_size) + x.shape[1:]),
                                    batch)

            def minibatch(carry, mb):
                params, opt_state = carry
                mb = jax.lax.with_sharding_constraint(mb, batch_axes)
                grads, metrics = grad_fn(params, mb, step, base)
                updates, opt_state = self.optimizer.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
                metrics["grad_norm"] = optax.global_norm(grads)
                return (params, opt_state), metrics

            return jax.lax.scan(minibatch, (params, opt_state), shuffled)

        (params, opt_state), metrics = jax.lax.scan(
            epoch, (params, opt_state), jax.random.split(key, c.updates.epochs))
        return params, opt_state, jax.tree.map(jnp.mean, metrics)

    def _zero_update_metrics(self):
        shapes = jax.eval_shape(
            lambda: self._update_metric_shapes())
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def _update_metric_shapes(self):
        batch = self._dummy_batch()
        state = self.init_state_unsharded_shape()
        _, metrics = self._loss(state.params, batch, jnp.zeros((), jnp.int32),
                                state.base_params)
        metrics = dict(metrics)
        metrics["grad_norm"] = jnp.zeros((), jnp.float32)
        return metrics

    def _dummy_batch(self):
        c = self.config
        shape = (1, self.context_length)
        f = jnp.zeros(shape, jnp.float32)
        batch = dict(tokens=jnp.zeros(shape, jnp.int32), mask=f, old_logp=f,
                     advantages=f, observation_mask=f)
        if c.algorithm == "ppo":
            batch.update(old_values=f, returns=f)
        if self.uses_reference:
            batch.update(ref_logp=f)
        if c.loss.sft_coef > 0:
            batch.update(demo_tokens=jnp.zeros(shape, jnp.int32), demo_mask=f)
        return batch

    # ------------------------------------------------------------------ metrics
    def _rollout_metrics(self, traj):
        ret = traj.episode_return
        success = traj.success.astype(jnp.float32)
        agent_tokens = traj.agent_mask.sum(axis=1)
        metrics = {
            "reward_mean": jnp.mean(ret),
            "reward_std": jnp.std(ret),
            "success_rate": jnp.mean(success),
            "turns_mean": jnp.mean(traj.num_turns.astype(jnp.float32)),
            "response_tokens_mean": jnp.mean(agent_tokens),
            "context_tokens_mean": jnp.mean(traj.length.astype(jnp.float32)),
            "format_error_rate": jnp.sum(traj.format_errors)
            / jnp.maximum(jnp.sum(traj.num_turns), 1),
        }
        if self.num_envs > 1:
            counts = jax.ops.segment_sum(jnp.ones_like(ret), traj.env_ids, self.num_envs)
            sums = jax.ops.segment_sum(ret, traj.env_ids, self.num_envs)
            succ = jax.ops.segment_sum(success, traj.env_ids, self.num_envs)
            for i, name in enumerate(self.env_names):
                metrics[f"reward_mean/{name}"] = sums[i] / jnp.maximum(counts[i], 1)
                metrics[f"success_rate/{name}"] = succ[i] / jnp.maximum(counts[i], 1)
        return metrics

    # ------------------------------------------------------------------ evaluation
    @functools.cached_property
    def _evaluate_fn(self):
        c = self.config

        def evaluate(params, key, greedy):
            sampling = self.sampling.replace(greedy=greedy)
            traj = rollout_lib.rollout(
                self.env, key, num_tasks=c.rollout.num_tasks * c.rollout.group_size,
                group_size=1, model=self.model, params=params, sampling=sampling,
                env_params=self.row_params(c.rollout.num_tasks * c.rollout.group_size, 1))
            return self._rollout_metrics(traj), traj

        return jax.jit(evaluate, static_argnames=("greedy",))

    def evaluate(self, params, key, *, greedy: bool = True):
        """Success and reward of the policy on fresh tasks (one sample per task).

        `params`: policy parameters (`policy_params(state)`) or a `TrainState`."""
        if isinstance(params, TrainState):
            params = self.policy_params(params)
        return self._evaluate_fn(params, key, greedy=greedy)
