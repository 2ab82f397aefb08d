"""Writes docs/api.md, the API reference, from the public names' signatures and docstrings.

    python docs/make_api.py            # rewrite docs/api.md
    python docs/make_api.py --check    # exit 1 if docs/api.md is not what it would write

tests/test_api_reference.py runs the check, so the reference follows the code.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_MD = os.path.join(ROOT, "docs", "api.md")
# (module, names): the public face first, then each package's exported names (`__all__`).
SECTIONS = (
    ("arl", None),
    ("arl.runs.process_settings", ("setup", "Settings")),
    ("arl.runs.experiment", ("run",)),
    ("arl.config", None),
    ("arl.algorithm_table", ("Algorithm", "OutcomeBatch", "PolicyLoss", "ClipSettings",
                             "register_algorithm", "register_policy_loss", "get_algorithm",
                             "get_policy_loss", "chosen_policy_loss", "algorithm_names",
                             "policy_loss_names")),
    ("arl.trainers", None),
    ("arl.rollout", None),
    ("arl.envs", None),
    ("arl.text", None),
    ("arl.data", None),
    ("arl.algorithms", None),
)


def _public_names(module, names):
    if names is not None:
        return list(names)
    if module.__name__ == "arl":
        return sorted(module._EXPORTS)  # pylint: disable=protected-access
    return sorted(getattr(module, "__all__", ()))


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    # Defaults that are functions or objects print their address: keep their name only.
    return re.sub(r"<(?:function|class|built-in function) ([\w.]+)(?: at 0x[0-9a-f]+)?>",
                  r"\1", re.sub(r" at 0x[0-9a-f]+", "", text))


def _summary(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()


def reference() -> str:
    lines = ["# API reference", "",
             "Generated from the docstrings by `python docs/make_api.py` (checked up to date "
             "by `tests/test_api_reference.py`): each public name with its signature and the "
             "first paragraph of its docstring. The layers are in "
             "[architecture.md](architecture.md).", ""]
    for module_name, names in SECTIONS:
        module = importlib.import_module(module_name)
        lines += [f"## `{module_name}`", "", _summary(module) or "", ""]
        for name in _public_names(module, names):
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue
            kind = "class" if inspect.isclass(obj) else (
                "function" if callable(obj) else "constant")
            if kind == "constant":
                lines.append(f"- `{name}` = `{obj!r}`")
                continue
            lines.append(f"- **`{name}{_signature(obj)}`** ({kind}): {_summary(obj)}")
        lines.append("")
    return "\n".join(line.rstrip() for line in lines).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = reference()
    if args.check:
        with open(API_MD, encoding="utf-8") as f:
            if f.read() != text:
                print("docs/api.md is out of date: run python docs/make_api.py",
                      file=sys.stderr)
                return 1
        return 0
    with open(API_MD, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
