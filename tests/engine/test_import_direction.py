"""Data flows one way through the engine's rooms: `llm.py` -> `executor/` -> `pyexecutor/` ->
`models/`, with `serve/` as the HTTP face; what crosses the engine's boundary lives in the leaf
`engine_io`. An import that points back up fails here, naming the module and the line."""

from __future__ import annotations

import ast
from pathlib import Path

import berth.engine

ENGINE = Path(berth.engine.__file__).parent
LEAVES = {
    "engine_io",
    "sampling_params",
    "structured_outputs",
    "config",
    "outputs",
    "tokenizer",
    "disaggregation",
}
# room -> the rooms its modules may import from (besides itself)
ALLOWED = {
    "sampling_params": {"structured_outputs"},
    "structured_outputs": {"tokenizer"},  # a grammar's tokens are the model's
    "config": set(),
    "outputs": {"disaggregation"},
    "tokenizer": set(),
    "disaggregation": set(),
    "engine_io": {"sampling_params", "disaggregation"},
    "models": set(),
    "pyexecutor": LEAVES | {"models"},
    "executor": LEAVES | {"pyexecutor"},  # the worker and the in-process shape run the engine
    "llm": LEAVES | {"executor"},
    "serve": LEAVES | {"executor", "llm"},
    "launch": LEAVES | {"executor", "serve"},  # `berth launch`: berth serve over an MPI world
}


def room_of(module: str) -> str:
    """`berth.engine.pyexecutor.scheduler` -> "pyexecutor"; `berth.engine.llm` -> "llm"."""
    return module.removeprefix("berth.engine.").split(".")[0]


def engine_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `berth.engine.*` import in the file, at any depth (also inside
    functions: a lazy import points the same way as an eager one)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, module) for line, module in found if module.startswith("berth.engine.")]


TOP = {"bench", "generate_cli", "__init__"}  # the benchmarks and CLIs at the top may use everything


def room_of_file(path: Path) -> str:
    return path.relative_to(ENGINE).with_suffix("").parts[0]


def test_every_engine_module_belongs_to_a_known_room():
    rooms = {room_of_file(path) for path in ENGINE.rglob("*.py")}
    assert rooms - TOP <= set(ALLOWED), rooms - TOP - set(ALLOWED)


def test_imports_point_down_through_the_rooms():
    wrong = []
    for path in sorted(ENGINE.rglob("*.py")):
        here = room_of_file(path)
        if here in TOP:
            continue
        for line, module in engine_imports(path):
            there = room_of(module)
            if there != here and there not in ALLOWED[here]:
                wrong.append(f"{path.relative_to(ENGINE.parent)}:{line} ({here}) imports {module} ({there})")
    assert not wrong, "imports that point up:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path):
    """The check can fail: a pyexecutor module importing from executor/ is caught."""
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from berth.engine.executor.errors import EngineDeadError\n")
    ((line, imported),) = engine_imports(module)
    assert line == 2 and room_of(imported) not in ALLOWED["pyexecutor"]
