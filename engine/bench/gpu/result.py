"""What one GPU check reports: rows of (what, measured, goal, verdict), figures, and notes.

Written as JSON by the check's process and read by `tools/gpu_check.py`, which knows nothing
else of the check (it runs with the standard library only).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Row:
    item: str
    value: str
    goal: str = ""
    ok: bool | None = None  # None: a figure with no goal


@dataclass
class CheckResult:
    check: str
    rows: list[Row] = field(default_factory=list)
    metrics: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    # Written again after every row or note: a check stopped at its time budget keeps its rows.
    path: str | None = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        return self.error is None and all(row.ok is not False for row in self.rows)

    def add(self, item: str, value: str, goal: str = "", ok: bool | None = None) -> None:
        self.rows.append(Row(item, value, goal, ok))
        verdict = {True: "ok", False: "FAIL", None: ""}[ok]
        print(f"  {verdict:<4} {item}: {value}" + (f" (goal: {goal})" if goal else ""), flush=True)
        self.flush()

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  note: {text}", flush=True)
        self.flush()

    def flush(self) -> None:
        if self.path is not None:
            data = asdict(self) | {"passed": self.passed}
            del data["path"]
            Path(self.path).write_text(json.dumps(data, indent=2, default=str))


CheckBody = Callable[[CheckResult, bool, Path], None]  # (result to fill, dry run, work directory)


def check_main(name: str, description: str, body: CheckBody, argv: list[str] | None = None) -> int:
    """A check's command line: `--json PATH` (where its result goes), `--dry-run` (the same code
    on the CPU with tiny shapes), `--workdir DIR` (shared by the checks of one run: the decode
    check's checkpoint serves the sleep check; default a temporary directory)."""
    parser = argparse.ArgumentParser(prog=f"python -m berth.engine.bench.gpu.{name}", description=description)
    parser.add_argument("--json", required=True, help="where the check's result goes")
    parser.add_argument("--dry-run", action="store_true", help="the same code paths on the CPU, tiny shapes")
    parser.add_argument("--workdir", help="where checkpoints are written (default: a temporary directory)")
    args = parser.parse_args(argv)

    def run(result: CheckResult) -> None:
        if args.workdir:
            body(result, args.dry_run, Path(args.workdir))
            return
        with tempfile.TemporaryDirectory() as workdir:
            body(result, args.dry_run, Path(workdir))

    return run_check(name, run, args.json)


def run_check(name: str, body: Callable[[CheckResult], None], json_path: str) -> int:
    """Runs `body`, which fills the result; an exception is the check's error, with its traceback
    on stderr. The result is written whatever happens; exit 0 only when it passed."""
    result = CheckResult(name, path=json_path)
    started = time.perf_counter()
    try:
        body(result)
    except BaseException as error:  # reported, and the exit code says it failed
        traceback.print_exc()
        result.error = f"{type(error).__name__}: {error}"
    result.seconds = time.perf_counter() - started
    result.flush()
    print(f"{name}: {'passed' if result.passed else 'FAILED'} in {result.seconds:.1f} s", file=sys.stderr)
    return 0 if result.passed else 1
