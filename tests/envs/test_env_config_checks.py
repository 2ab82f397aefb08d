"""What a config may ask of an environment, checked on the host before tracing: params
ranges (`param_ranges`), constructor arguments (`build_env`), and the optional scripted
policies (`has_demonstrator`, `has_oracle`).

tests/user_envs.py is imported inside the tests, never at collection: registering
`say_digit` while collecting would change the parametrization of the tests that loop
over `registered_names()`."""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arl.envs as E
from arl.envs.base import ParamRange
from arl.errors import ConfigError

_BUILT_IN = {
    "bandit": E.Bandit(), "guess_number": E.GuessNumber(max_n=16),
    "calculator": E.Calculator(max_digits=2), "frozen_lake": E.FrozenLake(),
    "sokoban": E.make("sokoban"), "countdown": E.make("countdown"),
    "dataset_task": E.make("dataset_task"), "code_interpreter": E.make("code_interpreter"),
    "sql": E.make("sql"),
}


def _ids(num_rows=1):
    return jnp.zeros((num_rows,), jnp.int32)


def test_every_registered_env_is_covered():
    own = [n for n in E.registered_names() if E.registry.factory(n).__module__.startswith("arl.")]
    assert sorted(_BUILT_IN) == own


@pytest.mark.parametrize("name", sorted(_BUILT_IN))
def test_default_params_lie_in_the_declared_ranges(name):
    env = _BUILT_IN[name]
    params = env.default_params()
    ranges = env.param_ranges()
    fields = {f.name for f in dataclasses.fields(params)}
    assert ranges and set(ranges) <= fields, (set(ranges) - fields)
    for field, allowed in ranges.items():
        for value in np.asarray(getattr(params, field)).reshape(-1):
            assert allowed.contains(float(value)), (field, value, allowed)


@pytest.mark.parametrize("allowed,inside,outside,text", [
    (ParamRange(0.0, 1.0), [0.0, 0.5, 1.0], [-1e-6, 1.0 + 1e-6], "[0, 1]"),
    (ParamRange(0.0, 1.0, high_open=True), [0.0, 0.999], [1.0], "[0, 1)"),
    (ParamRange(0.0, None), [0.0, 1e30], [-0.1], "[0, inf)"),
    (ParamRange(2, 16), [2, 16], [1, 17], "[2, 16]"),
    (ParamRange(0.0, 5.0, low_open=True), [1e-9, 5.0], [0.0], "(0, 5]"),
])
def test_param_range_contains_and_reads(allowed, inside, outside, text):
    assert all(allowed.contains(v) for v in inside)
    assert not any(allowed.contains(v) for v in outside)
    assert str(allowed) == text


def test_overrides_reach_the_params():
    env = _BUILT_IN["guess_number"]
    params = E.task_params(env, {"params": {"num_values": 9, "turn_cost": 0.0}}, _ids(3))
    np.testing.assert_array_equal(params.num_values, [9, 9, 9])
    assert params.num_values.dtype == jnp.int32
    np.testing.assert_array_equal(params.turn_cost, [0.0, 0.0, 0.0])
    np.testing.assert_allclose(params.format_penalty, [0.1] * 3)  # not overridden


def test_boolean_array_field_takes_a_tuple():
    env = _BUILT_IN["calculator"]
    params = E.task_params(env, {"params": {"operators": (True, False, True)}}, _ids(2))
    np.testing.assert_array_equal(params.operators, [[True, False, True]] * 2)
    with pytest.raises(ConfigError, match=r"^config\.env\.params\.operators=\(1, 0, 1\) is "
                                          r"invalid: expected True or False"):
        E.task_params(env, {"params": {"operators": (1, 0, 1)}}, _ids())
    with pytest.raises(ConfigError, match=r"expected a value of shape \(3,\)"):
        E.task_params(env, {"params": {"operators": (True, False)}}, _ids())


@pytest.mark.parametrize("field,value,message", [
    ("high_prob", 1.5, r"must be in \[0, 1\]"),
    ("high_prob", -0.01, r"must be in \[0, 1\]"),
    ("high_prob", math.inf, "expected a finite number"),
    ("high_prob", math.nan, "expected a finite number"),
    ("high_prob", "high", "expected a number"),
    ("low_payoff", 1e5, r"must be in \[0, 9999.99\]"),
    ("turn_cost", -0.1, r"must be in \[0, inf\)"),
])
def test_bad_override_names_the_field_and_what_is_allowed(field, value, message):
    env = _BUILT_IN["bandit"]
    with pytest.raises(ConfigError) as info:
        E.task_params(env, {"params": {field: value}}, _ids())
    text = str(info.value)
    assert text.startswith(f"config.env.params.{field}={value!r} is invalid: "), text
    assert re.search(message, text), text


def test_override_checks_run_while_tracing():
    """The trainer builds its row params inside the jitted step: the checks only read
    the dtype and shape of the defaults, so they work on tracers too."""
    env = _BUILT_IN["bandit"]

    @jax.jit
    def params_of(high_prob):
        return E.task_params(env, {"params": {"high_prob": 0.75}}, _ids(2)).high_prob + high_prob

    np.testing.assert_allclose(params_of(jnp.float32(0.0)), [0.75, 0.75])
    with pytest.raises(ConfigError, match="high_prob=2.0 is invalid"):
        jax.jit(lambda: E.task_params(env, {"params": {"high_prob": 2.0}}, _ids()))()


def test_unknown_param_field_names_the_closest():
    with pytest.raises(ConfigError, match=r"^config\.env\.params\.high_porb=0\.5 is invalid: "
                                          r"BanditParams has no field 'high_porb' \(did you "
                                          r"mean high_prob\?\)"):
        E.task_params(_BUILT_IN["bandit"], {"params": {"high_porb": 0.5}}, _ids())


def test_constructor_arguments_are_checked_against_the_signature():
    with pytest.raises(ConfigError, match=r"^config\.env\.kwargs\.max_nn=8 is invalid: env "
                                          r"'guess_number' \(GuessNumber\) takes no argument "
                                          r"'max_nn' \(did you mean max_n\?\); its arguments "
                                          r"are codec, max_n, max_turns\."):
        E.make_env({"name": "guess_number", "kwargs": {"max_nn": 8}})


def test_constructor_value_error_becomes_a_config_error():
    with pytest.raises(ConfigError) as info:
        E.make_env({"name": "guess_number", "kwargs": {"max_n": 1}})
    assert str(info.value) == ("config.env.kwargs={'max_n': 1} is invalid: env 'guess_number' "
                               "refused them: max_n must be an int in [2, 10**8], got 1")
    assert isinstance(info.value.__cause__, ValueError)


def test_mixture_member_errors_name_the_member():
    members = [{"name": "bandit"}, {"name": "frozen_lake", "kwargs": {"size": 99}}]
    with pytest.raises(ConfigError, match=r"^config\.env\.members\[1\]\.kwargs=\{'size': 99\} "
                                          r"is invalid: env 'frozen_lake' refused them"):
        E.make_env({"name": "mixture", "members": members})


def test_missing_required_argument_is_named():
    from tests import user_envs

    class NeedsSize(user_envs.SayDigit):
        def __init__(self, size, codec=None):
            super().__init__(codec=codec, max_turns=size)

    E.register("_test_needs_size", NeedsSize)
    with pytest.raises(ConfigError, match=r"^config\.env\.kwargs=\{\} is invalid: env "
                                          r"'_test_needs_size' .* needs the arguments \['size'\]"):
        E.make_env({"name": "_test_needs_size"})
    assert E.make_env({"name": "_test_needs_size", "kwargs": {"size": 3}}).max_turns == 3


def test_scripted_policy_capabilities():
    from tests import user_envs

    for env in _BUILT_IN.values():
        assert env.has_oracle and env.has_demonstrator
        assert env.supports_action_source("demonstrator")
    user = user_envs.SayDigit()
    assert user.has_oracle and not user.has_demonstrator
    assert user.supports_action_source("model") and user.supports_action_source("oracle")
    assert not user.supports_action_source("demonstrator")
    assert not user.supports_action_source("teacher")
    assert not E.Mixture([_BUILT_IN["bandit"], user]).has_demonstrator
    assert E.Mixture([_BUILT_IN["bandit"], user]).has_oracle
    assert E.Mixture([_BUILT_IN["bandit"], _BUILT_IN["guess_number"]]).has_demonstrator
    # Wrappers forward the hooks' capabilities.
    assert not E.TurnHorizon(user).has_demonstrator


def test_missing_demonstrator_fails_clearly_when_played():
    from tests import user_envs

    user = user_envs.SayDigit()
    with pytest.raises(NotImplementedError, match="SayDigit defines no demonstrator_action"):
        user.demonstrator_action(jax.random.key(0), None, user.default_params())
    from arl import rollout

    with pytest.raises(NotImplementedError, match="SayDigit defines no demonstrator_action"):
        rollout.scripted_rollout(user, jax.random.key(0), num_tasks=2, group_size=1,
                                 action_source="demonstrator")
