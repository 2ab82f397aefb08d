"""`config.env`: the token environment (a registered name, or a mixture of members),
its constructor arguments and its params; checked by building it (Python only)."""

from __future__ import annotations

import ml_collections

from arl import envs as envs_lib
from arl.config.checks import fail
from arl.envs import registry
from arl.envs.base import SCRIPTED_SOURCES as SFT_SOURCES

# Sections whose keys the schema does not fix: the environment's constructor arguments
# and params (checked against the environment itself), the mixture members and the chat
# template's own arguments (checked by rendering the template).
FREE_FORM_SECTIONS = ("env.kwargs", "env.params", "env.members", "model.chat_template_kwargs")


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "guess_number"
    c.kwargs = ml_collections.ConfigDict()
    # Overrides of the environment's default params (data, e.g. bandit high_prob); not
    # for mixtures, whose members take constructor kwargs.
    c.params = ml_collections.ConfigDict()
    # For name == "mixture": a list of {"name": ..., "kwargs": {...}} members.
    c.members = ()
    return c


def validate(config) -> None:
    """A token environment: the names are registered, the constructors and the params
    accept their arguments, the horizon fits `max_turns` and the demonstrations the
    config asks for are playable."""
    known = envs_lib.registered_names()
    name = config.env.name
    if name == "mixture":
        if len(config.env.members) < 1:
            fail("env.members", config.env.members, "a mixture needs at least one member")
        for i, member in enumerate(config.env.members):
            if not hasattr(member, "get") or not registry.is_known(member.get("name")):
                fail(f"env.members[{i}].name",
                     member.get("name") if hasattr(member, "get") else member,
                     f"allowed values are {known}")
    elif not registry.is_known(name):
        hint = (" (gymnax environments are vector envs: use algorithm='ppo_vector')"
                if str(name).startswith("gymnax:") else
                " (an env of your own: register it in a module named in config.imports)")
        fail("env.name", name, "allowed values for token algorithms are "
             f"{known + ['mixture'] + registry.registered_prefixes()}{hint}")
    # Python only, nothing compiled: the constructors' and the params' checks.
    env = envs_lib.make_env(config.env, codec=envs_lib.checkpoint_codec(config))
    envs_lib.task_params(env, config.env, envs_lib.member_of_task(env, 1))
    rounds = tuple(config.rollout.horizon_rounds)
    if any(h > env.max_turns for h in rounds):
        fail("rollout.horizon_rounds", rounds,
             f"env {name!r} truncates every episode at max_turns={env.max_turns}: use "
             f"rounds in [1, {env.max_turns}]")
    _validate_scripted_sources(config, env)


def _validate_scripted_sources(config, env) -> None:
    """The demonstrations a config asks for must be playable: the warm start and the SFT
    term (without a stored `loss.sft_dataset`) run the env's `<source>_action`."""
    ws, loss = config.warm_start, config.loss
    uses = []
    if ws.sft_steps > 0:
        field = "warm_start.sft_source" if ws.sft_source else "loss.sft_source"
        uses.append((field, ws.sft_source or loss.sft_source, "the warm start"))
    if loss.sft_coef > 0 and not loss.sft_dataset:
        uses.append(("loss.sft_source", loss.sft_source, "the SFT term (loss.sft_coef > 0)"))
    members = getattr(env, "envs", (env,))
    for field, source, user in uses:
        lacking = [getattr(m, "name", type(m).__name__) for m in members
                   if not m.supports_action_source(source)]
        if lacking:
            others = [s for s in SFT_SOURCES if s != source
                      and all(m.supports_action_source(s) for m in members)]
            fail(field, source,
                 f"{user} plays the env's {source}_action, which env {lacking[0]!r} does not "
                 f"define: implement it" + (f" or use {others[0]!r}" if others else ""))
