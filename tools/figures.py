"""Every figure the documents give comes from committed data: this runs a benchmark and keeps its
raw output, renders the documents' tables from those files, and checks that the two agree.

    python tools/figures.py run NAME [--runs 3] --metric KEY LABEL UNIT REGEX ... -- COMMAND ...
        runs COMMAND (at least 3 times) and writes docs/measurements/NAME.json: the command, the
        commit, the machine (CPU model and flags, cores, memory), the date and every run, with
        its output and the figures read from it (the last match of each REGEX's first group)
    python tools/figures.py write [DOCUMENT ...]
        rewrites every table between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->`
    python tools/figures.py check [DOCUMENT ...]   (or --check)
        exits 1 where a document's table differs from what its data renders

NAME is a file in docs/measurements/ (NAME.json, rendered as median and min-max of its runs), or
`gpu-check/REPORT` for a `make gpu-check` report in docs/gpu-check/ (one run, as the check times
each figure once). docs/measurements/README.md describes the file format.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parent.parent
MEASUREMENTS = REPOSITORY / "docs" / "measurements"
GPU_REPORTS = REPOSITORY / "docs" / "gpu-check"
SCHEMA = 1
MINIMUM_RUNS = 3
# The CPU features that decide which kernels run (kernels/cpu_ops.py), as /proc/cpuinfo names them.
CPU_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512F", "avx512_bf16": "AVX-512 BF16", "amx_bf16": "AMX BF16"}
# The environment variables that change what a benchmark measures.
ENVIRONMENT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
SOFTWARE = ("torch", "transformers", "triton")
OUTPUT_KEPT = 20_000  # characters of each run's output kept in the file (its end: the report)
# The code a GPU report's figures depend on: commits touching it after the run leave them unverified.
ENGINE_PATHS = ("engine", "kernels")
DECIMALS = {"x": 2, "s": 2, "ms": 1, "tok/s": 0, "%": 1, "req/min": 1}
BLOCK = re.compile(
    r"<!-- figures:(?P<name>[\w./-]+)(?P<attributes>(?: [\w-]+=[\w.-]+)*) -->\n"
    r"(?P<body>.*?)"
    r"<!-- /figures:(?P=name) -->",
    re.DOTALL,
)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]+`")


class FiguresError(Exception):
    """A measurement that cannot be made or rendered; the message says which and why."""


# Recording a measurement.


def git(*arguments: str) -> str:
    done = subprocess.run(["git", *arguments], cwd=REPOSITORY, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise FiguresError(f"git {' '.join(arguments)}: {done.stderr.strip()}")
    return done.stdout.strip()


def machine() -> dict[str, Any]:
    """The CPU (model, family, flags of interest), the cores this process may use and the memory."""
    cpu: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "cpu family", "model", "flags") and key not in cpu:
            cpu[key] = value.strip()
        if not line.strip() and cpu:
            break  # the first processor's block names them all
    flags = set(cpu.get("flags", "").split())
    memory_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            memory_kib = int(line.split()[1])
    return {
        "cpu_model": cpu.get("model name", platform.processor()),
        "cpu_family": cpu.get("cpu family", ""),
        "cpu_model_number": cpu.get("model", ""),
        "flags": {flag: flag in flags for flag in CPU_FLAGS},
        "cores": len(os.sched_getaffinity(0)),
        "memory_bytes": memory_kib * 1024,
    }


def software() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in SOFTWARE:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[package] = importlib.metadata.version(package)
    return found


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    pattern: str

    def read(self, output: str) -> float:
        matches = re.findall(self.pattern, output, re.MULTILINE)
        if not matches:
            raise FiguresError(f"figure {self.key!r}: /{self.pattern}/ matches nothing in the output")
        last = matches[-1]
        text = last[0] if isinstance(last, tuple) else last
        return float(text.replace(",", ""))


def clean_output(raw: str) -> str:
    """What a terminal would show: a progress bar's carriage-return redraws keep only their end."""
    lines = [line.rsplit("\r", 1)[-1] for line in raw.split("\n")]
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", "\n".join(lines))
    return text[-OUTPUT_KEPT:]


def run_once(argv: Sequence[str], metrics: Sequence[Metric], environment: dict[str, str]) -> dict[str, Any]:
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    clock = time.perf_counter()
    # Bytes, not text: text mode would turn a progress bar's carriage returns into line ends.
    done = subprocess.run(list(argv), cwd=REPOSITORY, env=environment, capture_output=True)
    seconds = time.perf_counter() - clock
    stdout, stderr = (stream.decode(errors="replace") for stream in (done.stdout, done.stderr))
    output = clean_output(stdout + ("\n" + stderr if stderr else ""))
    if done.returncode != 0:
        raise FiguresError(f"{shlex.join(argv)} exited {done.returncode}:\n{output[-3000:]}")
    return {
        "started": started.isoformat(timespec="seconds"),
        "seconds": round(seconds, 2),
        "exit_code": done.returncode,
        "load_average": [round(load, 2) for load in load_before],
        "metrics": {metric.key: metric.read(output) for metric in metrics},
        "output": output,
    }


def record(
    name: str,
    argv: Sequence[str],
    metrics: Sequence[Metric],
    runs: int,
    setup: str | None = None,
    note: str | None = None,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> Path:
    """Runs `argv` `runs` times from the repository root and writes docs/measurements/NAME.json.

    The commands run with this interpreter's bin/ first on PATH (the virtualenv's `berth`). A run
    that fails, or whose output lacks a figure, ends the measurement and nothing is written."""
    if runs < MINIMUM_RUNS:
        raise FiguresError(f"--runs must be at least {MINIMUM_RUNS}: a figure is the median of several runs")
    if not metrics:
        raise FiguresError("name at least one --metric to read from the output")
    environment = dict(os.environ)
    environment["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environment.get('PATH', '')}"
    measurement: dict[str, Any] = {
        "schema": SCHEMA,
        "name": name,
        "command": shlex.join(argv),
        "setup": setup,
        "note": note,
        "commit": git("rev-parse", "HEAD"),
        "uncommitted": git("status", "--porcelain", "--untracked-files=no").splitlines(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "software": software(),
        "environment": {key: os.environ[key] for key in ENVIRONMENT if key in os.environ},
        "metrics": [metric.__dict__ for metric in metrics],
        "runs": [],
    }
    for index in range(runs):
        progress(f"figures: {name}: run {index + 1} of {runs}: {shlex.join(argv)}")
        result = run_once(argv, metrics, environment)
        progress(f"figures: {name}: run {index + 1}: {result['seconds']} s, {result['metrics']}")
        measurement["runs"].append(result)
    MEASUREMENTS.mkdir(parents=True, exist_ok=True)
    path = MEASUREMENTS / f"{name}.json"
    path.write_text(json.dumps(measurement, indent=2, ensure_ascii=False) + "\n")
    return path


# Rendering.


def load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FiguresError(f"{shown(path)}: no such data file") from None


def number(value: float, unit: str) -> str:
    shown = f"{value:,.{DECIMALS.get(unit, 2)}f}"
    if unit == "x":
        return f"{shown}x"
    return f"{shown} {unit}" if unit else shown


def describe_machine(found: dict[str, Any]) -> str:
    flags = found["flags"]
    has = [title for flag, title in CPU_FLAGS.items() if flags.get(flag)]
    lacks = [title for flag, title in CPU_FLAGS.items() if not flags.get(flag)]
    family = f" (family {found['cpu_family']})" if found.get("cpu_family") else ""
    features = ", ".join(has) if has else "none of " + ", ".join(CPU_FLAGS.values())
    if has and lacks:
        features += ", no " + ", no ".join(lacks)
    gib = found["memory_bytes"] / 2**30
    return f"{found['cpu_model']}{family} with {features}; {found['cores']} cores, {gib:.1f} GiB"


def shown(path: Path) -> str:
    """A path as the repository names it (as given when it lies elsewhere)."""
    return str(path.relative_to(REPOSITORY)) if path.is_relative_to(REPOSITORY) else str(path)


def link(path: Path, document: Path) -> str:
    return f"[{shown(path)}]({os.path.relpath(path, document.parent)})"


def summarize(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def render_measurement(name: str, document: Path) -> str:
    path = MEASUREMENTS / f"{name}.json"
    data = load(path)
    if data.get("schema") != SCHEMA:
        raise FiguresError(f"{path.name}: schema {data.get('schema')!r}, this tool reads {SCHEMA}")
    runs = data["runs"]
    if len(runs) < MINIMUM_RUNS:
        raise FiguresError(f"{path.name}: {len(runs)} runs; a figure needs at least {MINIMUM_RUNS}")
    loads = [run["load_average"][0] for run in runs]
    changed = len(data.get("uncommitted") or [])
    dirty = f" with {changed} files changed in the working tree (the file lists them)" if changed else ""
    setup = f", after `{data['setup']}`" if data.get("setup") else ""
    caption = (
        f"`{data['command']}`{setup}: the median of {len(runs)} runs and their range, "
        f"{data['date'][:10]}, commit `{data['commit'][:9]}`{dirty}, "
        f"on an {describe_machine(data['machine'])} (load average {min(loads):g}-{max(loads):g} "
        f"as the runs started). Raw output: {link(path, document)}."
    )
    if data.get("note"):
        caption += f" {data['note']}"
    rows = ["| Figure | Median | Min–max |", "| --- | --- | --- |"]
    for metric in data["metrics"]:
        values = [run["metrics"][metric["key"]] for run in runs]
        median, low, high = summarize(values)
        unit = metric["unit"]
        spread = f"{number(low, unit)}–{number(high, unit)}"
        rows.append(f"| {metric['label']} | {number(median, unit)} | {spread} |")
    return "\n" + caption + "\n\n" + "\n".join(rows) + "\n\n"


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def report_commits(path: Path, date: str, as_of: str) -> tuple[str, str, int]:
    """The newest commit before the report's run, the commit that added the report, and how many
    commits touching the engine's code landed after the run, up to `as_of`."""
    relative = str(path.relative_to(REPOSITORY))
    before = git("rev-list", "-1", f"--before={date}", as_of)
    added = git("log", "--diff-filter=A", "--format=%H", as_of, "--", relative).splitlines()
    count = int(git("rev-list", "--count", f"--since={date}", as_of, "--", *ENGINE_PATHS))
    return before, added[-1] if added else "", count


def render_gpu_report(name: str, document: Path, as_of: str) -> str:
    path = GPU_REPORTS / f"{name}.json"
    report = load(path)
    checks = {check["check"]: check for check in report["checks"]}
    environment = checks["environment"]["metrics"]
    versions = environment["versions"]
    bandwidths = [
        check["metrics"]["copy_bandwidth_bytes_per_s"]
        for check in report["checks"]
        if "copy_bandwidth_bytes_per_s" in check["metrics"]
    ]
    before, added, count = report_commits(path, report["date"], as_of)
    stamp = report["date"].replace("T", " ")[:16]
    verdict = "passed" if report["passed"] else "did not pass (a check below missed its goal)"
    caption = (
        f"`make gpu-check` (tools/gpu_check.py), one run on {stamp} UTC: {environment['device']}, "
        f"{environment['multiprocessors']} SMs, Python {environment['python']}, torch {versions['torch']}, "
        f"Triton {versions.get('triton', '-')}, transformers {versions.get('transformers', '-')}; "
        f"the run {verdict}. Report: {link(path, document)}. Each figure is that one run's (the check "
        f"times each once): no spread. Ceilings measured in the run: device-to-device copy "
        f"{min(bandwidths) / 1e12:.2f}-{max(bandwidths) / 1e12:.2f} TB/s (read + written, "
        f"{len(bandwidths)} measurements), bf16 matmul {environment['bf16_matmul_flops'] / 1e12:.0f} "
        "TFLOP/s.\n\n"
        f"The report records no commit: the newest commit before the run is `{before[:9]}`, and the "
        f"report was committed in `{added[:9]}`. **The CUDA path at HEAD is unverified**: {count} "
        f"commits touching {' or '.join(p + '/' for p in ENGINE_PATHS)} landed after the run "
        f"(up to `{as_of[:9]}`, when this table was written; "
        f"`git rev-list --count --since={report['date']} HEAD -- {' '.join(ENGINE_PATHS)}` counts them "
        f"now), until `make gpu-check` runs again."
    )
    rows = ["| Check | What | Result | Goal | Met |", "| --- | --- | --- | --- | --- |"]
    for check in report["checks"]:
        for row in check["rows"]:
            if row["item"] == "engine packages":
                continue  # the versions that matter are in the caption; the report lists them all
            met = {True: "yes", False: "**no**", None: ""}[row["ok"]]
            cells = [check["check"], cell(row["item"]), cell(row["value"]), cell(row["goal"]), met]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n" + caption + "\n\n" + "\n".join(rows) + "\n\n"


@dataclass(frozen=True)
class Block:
    name: str
    attributes: dict[str, str]
    body: str
    start: int
    end: int


def without_code(text: str) -> str:
    """The text with its code (fenced blocks, inline spans) blanked out, every offset kept: a
    marker quoted in code is an example, not a table."""

    def blank(match: re.Match[str]) -> str:
        return re.sub(r"[^\n]", " ", match[0])

    text = FENCE.sub(blank, text)
    return INLINE_CODE.sub(blank, text)


def blocks(text: str) -> list[Block]:
    found = []
    for match in BLOCK.finditer(without_code(text)):
        attributes = dict(pair.split("=", 1) for pair in match["attributes"].split())
        body = text[match.start("body") : match.end("body")]
        found.append(Block(match["name"], attributes, body, match.start(), match.end()))
    return found


def render(block: Block, document: Path, head: str | None) -> tuple[str, dict[str, str]]:
    """The block's body and attributes as its data renders them; `head`, when writing, stamps a GPU
    block's count of later engine commits at that commit (checking recounts at the stamped one)."""
    if block.name.startswith("gpu-check/"):
        as_of = head or block.attributes.get("as-of")
        if not as_of:
            raise FiguresError(f"{block.name}: the marker has no as-of=COMMIT; run `tools/figures.py write`")
        report = block.name.removeprefix("gpu-check/")
        return render_gpu_report(report, document, as_of), {"as-of": as_of[:12]}
    return render_measurement(block.name, document), {}


def rendered(text: str, document: Path, head: str | None) -> str:
    pieces, position = [], 0
    for block in blocks(text):
        body, attributes = render(block, document, head)
        attributes_text = "".join(f" {key}={value}" for key, value in attributes.items())
        pieces += [
            text[position : block.start],
            f"<!-- figures:{block.name}{attributes_text} -->\n{body}<!-- /figures:{block.name} -->",
        ]
        position = block.end
    pieces.append(text[position:])
    return "".join(pieces)


def documents() -> list[Path]:
    """README.md, operator/README.md and every Markdown file under docs/."""
    found = [REPOSITORY / "README.md", REPOSITORY / "operator" / "README.md"]
    return [path for path in found if path.exists()] + sorted((REPOSITORY / "docs").rglob("*.md"))


def unmatched_markers(text: str) -> list[str]:
    code_free = without_code(text)
    opened = Counter(re.findall(r"<!-- figures:([\w./-]+)", code_free))
    closed = Counter(re.findall(r"<!-- /figures:([\w./-]+) -->", code_free))
    paired = Counter(block.name for block in blocks(text))
    return sorted(name for name in opened | closed if not opened[name] == closed[name] == paired[name])


def check(paths: Sequence[Path]) -> list[str]:
    """What differs: one line per table that is not what its data renders."""
    problems = []
    for path in paths:
        text = path.read_text()
        name = shown(path)
        for marker in unmatched_markers(text):
            problems.append(f"{name}: figures:{marker} has no matching pair of markers")
        for block in blocks(text):
            try:
                body, _ = render(block, path, None)
            except FiguresError as error:
                problems.append(f"{name}: figures:{block.name}: {error}")
                continue
            if body != block.body:
                problems.append(f"{name}: figures:{block.name} differs from what its data renders")
    return problems


def write(paths: Sequence[Path]) -> list[Path]:
    head = git("rev-parse", "HEAD")
    changed = []
    for path in paths:
        text = path.read_text()
        new = rendered(text, path, head)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


# The command line.


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["--check"]:
        arguments[0] = "check"
    command: list[str] = []
    if arguments[:1] == ["run"] and "--" in arguments:
        split = arguments.index("--")
        arguments, command = arguments[:split], arguments[split + 1 :]
    parser = argparse.ArgumentParser(prog="tools/figures.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    run_parser = sub.add_parser(
        "run",
        usage="%(prog)s NAME [--runs N] --metric KEY LABEL UNIT REGEX ... -- COMMAND ...",
        help="run a benchmark N times and write docs/measurements/NAME.json",
    )
    run_parser.add_argument("name", help="the data file's name (docs/measurements/NAME.json)")
    run_parser.add_argument("--runs", type=int, default=MINIMUM_RUNS)
    run_parser.add_argument(
        "--metric",
        nargs=4,
        action="append",
        default=[],
        metavar=("KEY", "LABEL", "UNIT", "REGEX"),
        help="a figure: its key, its label in the table, its unit (x, s, ms, tok/s, %%, or '') and "
        "a regular expression whose first group, at its last match in the output, is the number",
    )
    run_parser.add_argument("--setup", help="what was run once before (recorded, not run)")
    run_parser.add_argument("--note", help="a sentence shown under the table's caption")
    for action in ("write", "check"):
        documents_parser = sub.add_parser(action, help=f"{action} the tables of the documents")
        documents_parser.add_argument("documents", nargs="*", type=Path, help="default: every document")
    options = parser.parse_args(arguments)
    try:
        if options.action == "run":
            if not command:
                parser.error("run: give the command after --")
            metrics = [Metric(*spec) for spec in options.metric]
            path = record(options.name, command, metrics, options.runs, options.setup, options.note)
            print(f"figures: wrote {path.relative_to(REPOSITORY)}")
            return 0
        paths = [path.resolve() for path in options.documents] or documents()
        if options.action == "write":
            for path in write(paths):
                print(f"figures: rewrote {shown(path)}")
            return 0
        problems = check(paths)
    except FiguresError as error:
        print(f"figures: {error}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"figures: {problem}", file=sys.stderr)
    if problems:
        print("figures: run `python tools/figures.py write` after changing data or tables", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
