"""The rooms' folders (engine/, kernels/, operator/) are `berth.engine`, `berth.kernels` and
`berth.operator`, never top-level packages of their own.

Python started in the checkout root (`python -c ...`, `python -m ...`, a script there) puts the
root first on sys.path, where `kernels/` would answer Hugging Face's `import kernels` (which
transformers makes whenever a model loads) and `engine/` any other `import engine`. A room
imported under its bare name steps aside: it loads what the name means without the checkout
root, or fails as a missing module does.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path


def step_aside(name: str, init_file: str) -> None:
    """Put in `sys.modules[name]` the module `name` is elsewhere on sys.path (the import
    statement returns it), or raise ModuleNotFoundError as if the room were not there."""
    root = Path(init_file).resolve().parent.parent
    path = [entry for entry in sys.path if Path(entry or os.curdir).resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (the checkout's {name}/ is berth.{name}, not a top-level package)",
            name=name,
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
