"""Errors a user can act on. Kept apart so every layer can raise them without import
cycles (the config schema imports the environment registry and the algorithm table)."""


class ConfigError(ValueError):
    """A configuration field has a value outside its allowed set."""


def invalid_field(field: str, value, allowed: str) -> ConfigError:
    """The error for `config.<field>` = `value`, saying what is `allowed`."""
    return ConfigError(f"config.{field}={value!r} is invalid: {allowed}.")
