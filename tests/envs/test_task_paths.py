"""The tasks live in `arl.envs.tasks`; their first import paths stay valid."""

from __future__ import annotations

import importlib

import pytest

from arl.envs import tasks


@pytest.mark.parametrize("name", tasks.MODULES)
def test_old_import_path_is_the_same_module(name):
    old = importlib.import_module(f"arl.envs.{name}")
    assert old is importlib.import_module(f"arl.envs.tasks.{name}")
    import arl.envs  # pylint: disable=g-import-not-at-top
    assert getattr(arl.envs, name) is old


def test_readme_import_paths():
    from arl.envs.code_interpreter import notebook_cell  # noqa: F401
    from arl.envs.sql_query import SqlQuery
    from arl.envs.tool_use import ToolEnvironment

    assert issubclass(SqlQuery, ToolEnvironment)
