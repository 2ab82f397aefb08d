"""The single compiled training step for token environments: rollout + signals + update.

    trainer = TokenTrainer(config)
    state = trainer.init_state()
    state, metrics = trainer.train_step(state)      # one jax.jit program, state donated

1. rollout   : `arl.rollout.rollout`, a scan over turns with KV-cached decoding (and
               Monte Carlo continuations, `arl.rollout.branching`, where the config asks).
2. signals   : Python reward functions (`arl.trainers.python_rewards`, one host callback)
               and an outcome reward model (`arl.trainers.reward_model`);
               rewards -> advantages by the algorithm's row of the table
               (`arl.trainers.credit_assignment`), StarPO-S and DAPO filters, KL-in-reward,
               process rewards (`arl.trainers.process_reward_models`).
3. update    : a scan over epochs x minibatches of optimizer steps on the loss of
               `arl.trainers.update`; skipped (parameters unchanged) when no advantage in
               the batch is non-zero and no auxiliary term carries gradient.

The pieces: `Policy` (model, LoRA, scoring forward), `StateLayout` (the `TrainState`, its
init and shardings), `CreditAssignment` (advantages), `Learner` (loss and update),
`ProcessModels` (PRMs); this module wires them into one step. `learn` is the step after
its rollout, which `arl.trainers.two_program` runs as a program of its own when the
rollout runs ahead (`config.rollout.policy_lag`, docs/async.md).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from arl import algorithm_table
from arl import algorithms as alg
from arl import config as config_lib
from arl import envs as envs_lib
from arl import rollout as rollout_lib
from arl import sharding as sharding_lib
from arl.optim import make_optimizer, rl_updates
from arl.rollout import episode_datasets as datasets_lib
from arl.errors import ConfigError, one_line
from arl.rollout import branching as branching_lib
from arl.rollout import partial_rollouts as partial_lib
from arl.rollout import slots as slots_lib
from arl.trainers import credit_assignment as credit_lib
from arl.trainers import guards
from arl.trainers.process_reward_models import ProcessModels
from arl.envs.sessions import check_branching
from arl.trainers.python_rewards import PythonRewards
from arl.trainers.reward_terms import reward_terms_lines
from arl.trainers.reward_model import OutcomeRewardModel
from arl.trainers import warm_start as warm_start_lib
from arl.trainers.policy import Policy, load_pretrained, shift_right
from arl.trainers.protocol import EvaluationReport
from arl.trainers.state import StateLayout, TrainState
from arl.trainers.update import Learner, UpdateBatch, sft_weight


TRANSCRIPT_ROWS = 2  # sampled episodes rendered into each evaluation's transcript


class StepKeys(NamedTuple):
    """The PRNG keys of one step, split from `TrainState.key` (`TokenTrainer.step_keys`)."""

    next: jax.Array  # the next step's TrainState.key
    rollout: jax.Array
    demo: jax.Array
    update: jax.Array
    branch: jax.Array


class TokenTrainer:
    """Static pieces of a token-environment experiment and its jitted `train_step`."""

    def __init__(self, config: ml_collections.ConfigDict, *, mesh=None):
        # Validates, and changes nothing global: process settings are `arl.setup()`'s.
        config_lib.validate(config, num_devices=jax.device_count())
        self.algorithm = algorithm_table.get_algorithm(config.algorithm)
        if self.algorithm.trainer != "token":
            raise ConfigError(f"config.algorithm={config.algorithm!r} is trained by "
                              f"the {self.algorithm.trainer} trainer, not TokenTrainer "
                              "(use arl.trainers.build)")
        self.config = config
        self.env = envs_lib.make_env(config.env, codec=envs_lib.checkpoint_codec(config))
        self.env_names = envs_lib.env_names(self.env)
        self.num_envs = len(self.env_names)
        self.context_length = rollout_lib.context_length(self.env)
        self.task_params(1, 1)  # rejects unknown config.env.params fields before tracing
        # config.reward.functions: Python rewards scored on the host inside the step.
        self.python_rewards = PythonRewards.from_config(config, self.env)
        # config.reward_model: a frozen sequence classifier scoring each episode.
        self.reward_model = OutcomeRewardModel.from_config(config, self.env)
        self.policy = Policy.from_config(
            config, vocab_size=self.env.codec.vocab_size,
            context_length=self.context_length, value_head=self.algorithm.critic)
        self.model = self.policy.model
        self.optimizer = make_optimizer(config.optim, total_updates=rl_updates(config),
                                        param_dtype=self.model.config.param_dtype)
        self.sampling = rollout_lib.SamplingConfig(
            temperature=config.rollout.temperature, top_k=config.rollout.top_k,
            top_p=config.rollout.top_p)
        self.batch_size = config.rollout.num_tasks * config.rollout.group_size
        # A group's rows start from the same observation (bos + prompt, or the chat
        # template's first turn): scored once
        # (prompt_len 0: every row read whole).
        self.shared_prompt = dict(
            group_size=config.rollout.group_size,
            prompt_len=(rollout_lib.first_observation_length(self.env)
                        if config.updates.share_group_prompt else 0))
        self.mesh = mesh if mesh is not None else sharding_lib.make_mesh(tuple(config.mesh))
        # The mesh the model's activation constraints follow (config.activation_sharding).
        self.activation_mesh = self.mesh if config.activation_sharding else None
        self.process_models = ProcessModels.from_config(config, self.policy,
                                                        **self.shared_prompt)
        self.uses_reference = (config.loss.kl_coef > 0
                               or self.process_models.uses_implicit_prm)
        self.branch_turns = credit_lib.branch_turns(
            config.process, max_turns=self.env.max_turns,
            group_size=config.rollout.group_size, env_name=config.env.name)
        check_branching(self.env, self.branch_turns, config.process.mc_samples)  # sessions
        # Partial rollouts: the fused step carries the unfinished episodes in its state;
        # two programs carry them beside it (`arl.trainers.two_program`).
        self.carries_episodes = config.rollout.carried_groups > 0
        self.layout = StateLayout(
            self.policy, self.optimizer, self.mesh, self.uses_reference, self.process_models,
            reward_model=self.reward_model,
            initial_carry=(self.initial_rollout_carry if self.carries_episodes
                           and not config_lib.uses_two_programs(config) else None))
        self.credit = credit_lib.CreditAssignment(
            self.algorithm, config, num_envs=self.num_envs, max_turns=self.env.max_turns,
            branch_turns=self.branch_turns)
        self.learner = Learner(self.policy, self.optimizer, config.loss,
                               epochs=config.updates.epochs,
                               minibatches=config.updates.minibatches, mesh=self.mesh,
                               context_length=self.context_length,
                               agent_token_bound=self.env.max_turns * self.env.action_len,
                               observation_token_bound=self.env.max_turns
                               * rollout_lib.observation_length(self.env),
                               shuffle=config.updates.shuffle,
                               reuse_activations=config_lib.reuses_rollout_activations(
                                   config),
                               policy_loss=algorithm_table.chosen_policy_loss(config),
                               rows_within_bounds=True, **self.shared_prompt)
        # Demonstrations for the SFT term: loaded once into device arrays, or None to
        # generate them on the fly with `loss.sft_source`.
        self.demonstrations = None
        if config.loss.sft_coef > 0 and config.loss.sft_dataset:
            try:
                self.demonstrations = datasets_lib.load_demonstrations(
                    config.loss.sft_dataset, env_config=config.env,
                    context_length=self.context_length)
            except (ValueError, OSError) as error:  # another env's set, unreadable files
                raise ConfigError(f"config.loss.sft_dataset={config.loss.sft_dataset!r} is "
                                  f"invalid: {one_line(error)}") from error
        shardings = self.state_shardings()
        self.train_step = jax.jit(
            self.step,
            in_shardings=(shardings,),
            out_shardings=(shardings, sharding_lib.replicated(self.mesh)),
            donate_argnums=(0,),
        )

    @property
    def lora(self):
        return self.policy.lora

    def task_params(self, num_tasks: int, group_size: int = 1):
        """Per-row environment params of `num_tasks` tasks x `group_size` rows: the
        config's (`env.params`, or `env.members[i].params` for a mixture's member i)."""
        return envs_lib.task_params(
            self.env, self.config.env,
            envs_lib.member_of_task(self.env, num_tasks, group_size))

    # ------------------------------------------------------------------ state
    def init_state(self, seed: int | None = None) -> TrainState:
        seed = self.config.seed if seed is None else seed
        init_key, key = jax.random.split(jax.random.key(seed))
        pretrained = load_pretrained(self.config, self.model, self.mesh)
        reward_model = None if self.reward_model is None else self.reward_model.load(self.mesh)
        return self._init_fn(init_key, key, pretrained, reward_model)

    @functools.cached_property
    def _init_fn(self):
        # One jitted function per trainer: a fresh jax.jit per call traced and lowered the
        # initial state again every time (0.64 s of CPU per repeat on a tiny trainer).
        return jax.jit(self.layout.initial, out_shardings=self.state_shardings())

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state (orbax restore target)."""
        return self.layout.abstract()

    def state_shardings(self) -> TrainState:
        return self.layout.shardings()

    @functools.cached_property
    def _merge_fn(self):
        return jax.jit(self.policy.merge, out_shardings=self.layout.param_shardings)

    def policy_params(self, state: TrainState):
        """Parameters of the current policy for `model.apply` / `rollout` / `evaluate`,
        outside jit: `state.params`, or under LoRA the base with the adapters merged (a
        new array per targeted kernel, with the model's shardings)."""
        if self.lora is None:
            return state.params
        return self._merge_fn(state.params, state.base_params)

    def warm_start(self, state: TrainState, *, log: Callable[[str], Any]) -> TrainState:
        """The RL start state after `config.warm_start.sft_steps` of behaviour cloning
        (`arl.trainers.warm_start`); `state` itself when there are none."""
        ws = self.config.warm_start
        if not ws.sft_steps:
            return state
        log(f"Warm start: {ws.sft_steps} SFT steps on "
            f"{ws.sft_source or self.config.loss.sft_source!r} demonstrations before RL.")
        return warm_start_lib.warm_start_state(
            self, state, log=log, log_every=max(1, min(25, ws.sft_steps // 10 or 1)))

    def scripted_demonstrations(self, key: jax.Array, num_tasks: int, source: str, env_params=None):
        """(tokens, agent_mask), [N, T] each: `num_tasks` episodes of the env's scripted
        policy `source` ("oracle" / "demonstrator") as the policy would read and write
        them, for behaviour cloning (`arl.trainers.warm_start`)."""
        demo = rollout_lib.rollout(self.env, key, num_tasks=num_tasks, group_size=1,
                                   action_source=source, env_params=env_params)
        return demo.tokens, demo.agent_mask

    # ------------------------------------------------------------------ step
    def horizon(self, step):
        r = self.config.rollout
        if not r.horizon_rounds:
            return jnp.asarray(self.env.max_turns, jnp.int32)
        return alg.horizon_schedule(step, rounds=tuple(r.horizon_rounds), every=r.horizon_every)

    def rollout(self, policy_params, key: jax.Array, horizon) -> rollout_lib.Trajectory:
        """The rollout of `step` (traceable): `num_tasks` x `group_size` rows, each group
        on one task (`task_params`), so its first observation is prefilled once and
        shared by the group's rows; turn states recorded when Monte Carlo branching
        needs them. Benchmarks time it on its own through this method."""
        c = self.config
        if c.rollout.schedule == "slots":
            return slots_lib.slot_rollout(
                self.env, key, num_tasks=c.rollout.num_tasks, group_size=c.rollout.group_size,
                model=self.model, params=policy_params, sampling=self.sampling,
                horizon=horizon,
                env_params=self.task_params(c.rollout.num_tasks, c.rollout.group_size),
                share_group_prefill=True,
                num_slots=self.num_slots, service_batch=c.rollout.slot_service_batch)
        return rollout_lib.rollout(
            self.env, key, num_tasks=c.rollout.num_tasks, group_size=c.rollout.group_size,
            model=self.model, params=policy_params, sampling=self.sampling, horizon=horizon,
            env_params=self.task_params(c.rollout.num_tasks, c.rollout.group_size),
            record_turn_states=bool(self.branch_turns), share_group_prefill=True,
            record_projections=self.learner.reuse_activations)

    @property
    def num_slots(self) -> int:
        r = self.config.rollout
        return r.num_slots or r.num_tasks * r.group_size

    def initial_rollout_carry(self, key: jax.Array, policy_params) -> partial_lib.CarriedEpisodes:
        """The carried episodes partial rollouts start from (traceable):
        `rollout.carried_groups` fresh groups drawn from `key`, on the tasks the
        positions after the step's own would take."""
        r = self.config.rollout
        return partial_lib.initial_carried(
            self.env, key, carried_groups=r.carried_groups, group_size=r.group_size,
            model=self.model, params=policy_params, num_slots=self.num_slots,
            env_params=self.task_params(r.carried_groups, r.group_size))

    def partial_rollout(self, policy_params, key: jax.Array, horizon, carried, version):
        """The rollout of a step with partial rollouts (traceable): (its trajectory, the
        episodes it carries to the next step, its metrics); `version`: the updates
        `policy_params` has had."""
        r = self.config.rollout
        traj, carried, stats = partial_lib.partial_slot_rollout(
            self.env, key, carried, num_tasks=r.num_tasks, group_size=r.group_size,
            model=self.model, params=policy_params, num_slots=self.num_slots,
            version=version, max_staleness=r.max_staleness, sampling=self.sampling,
            horizon=horizon, env_params=self.task_params(r.num_tasks, r.group_size),
            service_batch=r.slot_service_batch)
        return traj, carried, partial_lib.partial_metrics(traj, stats, version)

    def step(self, state: TrainState) -> tuple[TrainState, dict[str, jax.Array]]:
        """One rollout + signals + update, traced (`train_step` is its jitted, donating
        form with the state's shardings), under the mesh's activation sharding rules
        when `config.activation_sharding`."""
        with sharding_lib.activation_mesh(self.activation_mesh):
            return self._step(state)

    @staticmethod
    def step_keys(key: jax.Array) -> StepKeys:
        """The keys step t draws from `state.key` (its rollout's, demonstrations',
        update's, branching's) and the next step's `state.key`."""
        key, rollout_key, demo_key, update_key = jax.random.split(key, 4)
        key, branch_key = jax.random.split(key)
        return StepKeys(next=key, rollout=rollout_key, demo=demo_key, update=update_key,
                        branch=branch_key)

    def _step(self, state: TrainState) -> tuple[TrainState, dict[str, jax.Array]]:
        keys = self.step_keys(state.key)
        horizon = self.horizon(state.step)
        policy = self.layout.policy_params(state)
        if not self.carries_episodes:
            traj = self.rollout(policy, keys.rollout, horizon)
            return self.learn(state, traj, keys, horizon, behaviour_params=policy)
        traj, carried, rollout_metrics = self.partial_rollout(
            policy, keys.rollout, horizon, state.rollout_carry, state.step)
        state, metrics = self.learn(state.replace(rollout_carry=carried), traj, keys, horizon,
                                    behaviour_params=policy)
        return state, {**metrics, **rollout_metrics}

    def learn(self, state: TrainState, traj: rollout_lib.Trajectory, keys: StepKeys,
              horizon, behaviour_params=None) -> tuple[TrainState, dict[str, jax.Array]]:
        """The step after its rollout (traceable): signals, update, metrics and the next
        state. `traj`: a trajectory of `rollout`, whose rows stay within the env's token
        bounds; the update relies on it without checking (`Learner.rows_within_bounds`).
        `behaviour_params`: the parameters `traj` was sampled with, which Monte Carlo
        branching continues from (None: no branching)."""
        c = self.config
        p = c.process
        key, demo_key, update_key, branch_key = keys.next, keys.demo, keys.update, keys.branch
        batch_axes = sharding_lib.batch_sharding(self.mesh)
        policy = behaviour_params
        projections = traj.projections
        traj = jax.lax.with_sharding_constraint(traj.replace(projections=None), batch_axes)
        if projections is not None:  # layer-major: rows on the second axis
            projections = jax.lax.with_sharding_constraint(
                projections, sharding_lib.layer_major_batch_sharding(self.mesh))
        mask = traj.agent_mask
        metrics = {}
        env_weight = c.reward.env_weight
        if self.python_rewards is not None:  # scales the env's reward by env_weight
            traj, reward_metrics = self.python_rewards(traj)
            metrics.update(reward_metrics)
            env_weight = 1.0
        if self.reward_model is not None:
            traj, reward_metrics = self.reward_model(state.reward_model_params, traj,
                                                     env_weight)
            metrics.update(reward_metrics)

        ref_logp = None
        if self.uses_reference:
            ref_logp = self.policy.score(self.layout.reference_params(state), traj.tokens,
                                         **self.shared_prompt).logp
            ref_logp = jax.lax.stop_gradient(ref_logp)
        old_values = None
        if self.algorithm.critic:
            # Recorded while sampling with the same parameters: no second forward pass.
            old_values = shift_right(traj.values[:, :-1]) * mask

        branch = None
        if self.branch_turns:
            branch = branching_lib.branch_values(
                self.env, branch_key, traj, branch_turns=self.branch_turns,
                num_samples=p.mc_samples, model=self.model, params=policy,
                sampling=self.sampling, horizon=horizon,
                env_params=self.task_params(c.rollout.num_tasks, c.rollout.group_size),
                estimate=p.mc_estimate, gamma=p.turn_gamma)
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
        signals = self.credit(
            traj, rewards, old_values,
            process_rewards=self.process_models.process_rewards(state, traj),
            implicit_rewards=self.process_models.implicit_token_rewards(state, traj, ref_logp),
            branch=branch)
        loss_mask = mask * signals.valid[:, None]
        advantages = signals.advantages * loss_mask
        process_fields, process_metrics = self.process_models.update(
            state, traj, ref_logp, branch)
        metrics.update(process_metrics)

        demo = self._demonstrations(demo_key, batch_axes)
        batch = UpdateBatch(
            tokens=traj.tokens, mask=loss_mask, old_logp=traj.behaviour_logp,
            advantages=advantages, observation_mask=traj.observation_mask,
            old_values=old_values, returns=signals.returns, ref_logp=ref_logp,
            demo_tokens=None if demo is None else demo.tokens,
            demo_mask=None if demo is None else demo.agent_mask)

        has_signal = jnp.any(advantages != 0)
        if demo is not None or c.loss.echo_coef > 0 or not c.filters.skip_zero_advantage:
            has_signal = jnp.ones((), bool)  # the auxiliary terms still carry gradient
        # An env's NaN reward or out-of-range id poisons the loss: counted per env for the
        # host guard; under on_non_finite="skip" the update is skipped instead.
        faults = guards.rollout_faults(traj.rewards, self.env_names, env_ids=traj.env_ids,
                                       tokens=traj.tokens,
                                       vocab_size=self.model.config.vocab_size)
        if c.on_non_finite == "skip":
            has_signal = has_signal & guards.inputs_finite(faults)

        params, opt_state, update_metrics, faults = guards.guarded_update(
            lambda params, opt_state: self.learner.update(
                params, opt_state, batch, update_key, state.step, state.base_params,
                projections),
            has_signal, state.params, state.opt_state, faults, c.on_non_finite)
        metrics.update(faults)

        metrics.update(credit_lib.rollout_metrics(traj, self.env_names))
        metrics.update(signals.metrics)
        metrics.update(update_metrics)
        metrics["update_skipped"] = 1.0 - has_signal.astype(jnp.float32)
        metrics["horizon"] = horizon.astype(jnp.float32)
        if demo is not None:
            metrics["demo_success_rate"] = jnp.mean(demo.success.astype(jnp.float32))
            metrics["sft_coef"] = sft_weight(c.loss, state.step)
        new_state = state.replace(
            params=params, opt_state=opt_state, step=state.step + 1, key=key,
            **process_fields)
        return new_state, metrics

    def _demonstrations(self, key, batch_axes):
        """The SFT term's demonstrations for this step, or None without one: a minibatch
        of the stored set (`loss.sft_dataset`), or fresh episodes of `loss.sft_source`."""
        c = self.config
        if c.loss.sft_coef <= 0:
            return None
        if self.demonstrations is not None:
            demo = datasets_lib.sample_demonstrations(self.demonstrations, key,
                                                      self.batch_size)
        else:
            demo = rollout_lib.rollout(
                self.env, key, num_tasks=c.rollout.num_tasks,
                group_size=c.rollout.group_size, action_source=c.loss.sft_source,
                env_params=self.task_params(c.rollout.num_tasks, c.rollout.group_size))
        return jax.lax.with_sharding_constraint(demo, batch_axes)

    # ------------------------------------------------------------------ evaluation
    @functools.cached_property
    def _evaluate_fn(self):
        c = self.config
        num_rows = c.rollout.num_tasks * c.rollout.group_size

        def evaluate(params, key, greedy):
            sampling = self.sampling.replace(greedy=greedy)
            with sharding_lib.activation_mesh(self.activation_mesh):
                traj = rollout_lib.rollout(
                    self.env, key, num_tasks=num_rows, group_size=1, model=self.model,
                    params=params, sampling=sampling,
                    env_params=self.task_params(num_rows, 1))
            return credit_lib.rollout_metrics(traj, self.env_names), traj

        return jax.jit(evaluate, static_argnames=("greedy",))

    def evaluation_report(self, state: TrainState, key: jax.Array) -> EvaluationReport:
        """Greedy evaluation metrics (`eval/...`), sampled ones (`eval_sampled/...`) and
        the transcripts of `TRANSCRIPT_ROWS` sampled episodes."""
        params = self.policy_params(state)
        greedy_key, sample_key = jax.random.split(key)
        greedy_metrics, _ = self.evaluate(params, greedy_key, greedy=True)
        sampled_metrics, traj = self.evaluate(params, sample_key, greedy=False)
        rows = sharding_lib.gather_rows(traj, TRANSCRIPT_ROWS)
        shown = range(min(TRANSCRIPT_ROWS, rows.tokens.shape[0]))
        texts = [rollout_lib.render_trajectory(self.env, rows, row) for row in shown]
        # Python reward functions / a reward model: every term of each row's reward.
        terms = reward_terms_lines(self, state, rows)
        if terms is not None:
            texts = [f"{text}\n{line}" for text, line in zip(texts, terms)]
        text = "\n\n".join(texts)
        metrics = {f"eval/{k}": v for k, v in greedy_metrics.items()}
        metrics.update({f"eval_sampled/{k}": v for k, v in sampled_metrics.items()})
        return EvaluationReport(metrics=metrics, transcript=text)

    def evaluate(self, params: Any, key: jax.Array, *, greedy: bool = True):
        """Success and reward of the policy on fresh tasks (one sample per task):
        (metrics, trajectory). `params`: policy parameters (`policy_params(state)`) or a
        `TrainState`."""
        if isinstance(params, TrainState):
            params = self.policy_params(params)
        return self._evaluate_fn(params, key, greedy=greedy)
