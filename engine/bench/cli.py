"""`berth bench {throughput,proxy,serve,grammar,sleep,wake}`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import NoReturn

BENCHMARKS = {
    "throughput": ("berth.engine.bench.throughput", "offline throughput: berth vs transformers generate"),
    "proxy": ("berth.engine.bench.proxy", "the proxy + worker shape vs the in-process engine"),
    "serve": ("berth.engine.bench.serve", "load-test a running OpenAI-compatible server"),
    "grammar": (
        "berth.engine.bench.grammar",
        "structured outputs: compile and mask times of the grammar engines (llguidance, xgrammar)",
    ),
    "sleep": ("berth.engine.bench.sleep", "sleep / wakeup: time to PARKED and back, memory released"),
    "wake": (
        "berth.engine.bench.wake",
        "the first request to a sleeping or released world (through the activator) vs wake and cold start",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        if importlib.util.find_spec(module) is None:
            continue
        bench_parser = sub.add_parser(name, help=help_text, description=help_text)
        bench_parser.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(bench_parser)


def run(args: argparse.Namespace) -> NoReturn:
    """Runs the benchmark, then ends the process without the interpreter's teardown.

    Every benchmark has stopped what it started (servers, engines, worlds) and printed its
    report by the time it returns. Twice, in full test runs, a complete report was followed by
    SIGABRT in teardown ("terminate called without an active exception": native code aborting
    while the interpreter finalizes; the cause is not found): the report is not to be failed by
    that."""
    code = int(importlib.import_module(args._module).run(args) or 0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
