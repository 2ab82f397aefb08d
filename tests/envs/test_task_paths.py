"""The tasks live in `arl.envs.tasks`, one module each, and nowhere else: `arl.envs`
holds the contract and its machinery, and no second import path names a task module."""

from __future__ import annotations

import importlib

import pytest

from arl.envs import tasks


@pytest.mark.parametrize("name", tasks.MODULES)
def test_a_task_has_one_import_path(name):
    module = importlib.import_module(f"arl.envs.tasks.{name}")
    assert module.__name__ == f"arl.envs.tasks.{name}"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"arl.envs.{name}")
    import arl.envs  # pylint: disable=g-import-not-at-top
    assert not hasattr(arl.envs, name)


def test_readme_import_paths():
    from arl.envs.tasks.code_interpreter import notebook_cell  # noqa: F401
    from arl.envs.tasks.sql_query import SqlQuery
    from arl.envs.tool_use import ToolEnvironment

    assert issubclass(SqlQuery, ToolEnvironment)
