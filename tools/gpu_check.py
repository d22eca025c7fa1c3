"""`make gpu-check`: berth's CUDA path on a GPU machine, in one run (standard library only).

    python3 tools/gpu_check.py                 # on a GPU machine (`make gpu-check`)
    python3 tools/gpu_check.py --dry-run       # the same code paths on a CPU, tiny shapes

It sets itself up on a bare machine that has torch, Triton and transformers but not the rest of
berth's dependencies: the wheels in `--wheels` (default `.whl/`, fetched elsewhere by `make
gpu-wheels` from `tools/gpu-wheels.txt`) are installed into a target directory, nothing from a
network, and berth itself is put on the path from this checkout (no build). Then each check of
`berth.engine.bench.gpu` runs in a process of its own, within its time budget and the run's
(`--budget-seconds`, default 480), one after the other; a check that fails or runs out of time
does not stop the others. At the end: one table, a JSON report (`--out`, default `$OUT` or
`gpu-check/`) with every check's rows, figures, notes and log, and exit 0 only if all passed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
PACKAGE = "berth.engine.bench.gpu"


@dataclass(frozen=True)
class Check:
    name: str
    budget: float  # seconds on one H200
    dry_run_budget: float  # seconds on a 2-core CPU


CHECKS = (
    Check("environment", 45, 60),
    Check("kernels", 120, 300),
    Check("parity", 90, 240),
    Check("decode", 270, 240),
    Check("sleep", 150, 120),
    Check("serve", 60, 120),
)
# What the GPU machine's image brings of what berth's engine imports (torch with its CUDA build,
# Triton, transformers, ...): the carried wheels (tools/gpu-wheels.txt) bring the rest.
GPU_IMAGE_PROVIDES = frozenset({
    "torch", "triton", "transformers", "safetensors", "tokenizers", "numpy", "tqdm", "httpx",
    "prometheus-client", "mpi4py", "matplotlib", "huggingface-hub", "jinja2", "anyio", "click",
    "h11", "psutil", "pyyaml", "pip", "setuptools",
})  # fmt: skip
# Left for the table and the report when the run's budget is nearly spent.
RESERVE_SECONDS = 5
# Below this a check is not started at all.
MIN_CHECK_SECONDS = 20


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="run every check's code on the CPU, tiny shapes"
    )
    parser.add_argument(
        "--out", help="the report: a .json file, or a directory (default: $OUT, or gpu-check/)"
    )
    parser.add_argument("--wheels", default=str(REPOSITORY / ".whl"), help="carried wheels (default .whl/)")
    parser.add_argument("--site", help="where the wheels are installed (default: a temporary directory)")
    parser.add_argument(
        "--workdir", help="where checkpoints are written (default: /dev/shm if roomy, else a temp dir)"
    )
    parser.add_argument(
        "--only", nargs="+", choices=[check.name for check in CHECKS], help="run these checks only"
    )
    parser.add_argument("--budget-seconds", type=float, default=480, help="for the whole run (default 480)")
    args = parser.parse_args(argv)
    if args.budget_seconds <= 0:
        parser.error(f"--budget-seconds must be positive, got {args.budget_seconds}")
    return args


# ---- setup ------------------------------------------------------------------------------------


def install_wheels(wheels: Path, site: Path) -> list[str]:
    """Installs every wheel in `wheels` into `site` (no index, no dependencies resolved: the
    folder holds exactly what is missing). Returns the wheels' file names."""
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not files:
        return []
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, files),
    ]  # fmt: skip
    installed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if installed.returncode != 0:  # e.g. wheels for another Python than this one
        raise SetupError(f"the wheels in {wheels} do not install here: {installed.stderr.strip()[-800:]}")
    return [path.name for path in files]


class SetupError(Exception):
    """The machine cannot run the checks (no GPU, wheels that do not fit): said, exit 2."""


def link_package(site: Path) -> None:
    """`berth` importable from this checkout: its rooms are top-level folders that install as
    subpackages (setup.py), so `site/berth` is a folder of links to them."""
    package = site / "berth"
    package.mkdir(parents=True, exist_ok=True)
    targets = {path.name: path for path in (REPOSITORY / "berth").glob("*.py")}
    targets |= {room: REPOSITORY / room for room in ("engine", "kernels", "operator")}
    for name, target in targets.items():
        link = package / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)


def check_environment(site: Path, dry_run: bool) -> dict[str, str]:
    """The environment every check runs in: the site first on the path, offline, unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env |= {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    if dry_run:
        env["TRITON_INTERPRET"] = "1"  # the Triton kernels on CPU tensors
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def default_workdir() -> Path:
    """/dev/shm when it can hold the 16 GB checkpoint twice over (reading it back is then memory
    speed), else the temp directory."""
    shm = Path("/dev/shm")
    try:
        roomy = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize > 40 << 30
    except OSError:
        roomy = False
    return Path(tempfile.mkdtemp(prefix="berth-gpu-check-", dir=shm if roomy else None))


def cuda_problem(env: dict[str, str]) -> str | None:
    """Why the checks cannot run on a GPU here, or None."""
    probe = "import torch; print(torch.cuda.is_available(), torch.__version__, torch.version.cuda)"
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return "importing torch took over 120 s"
    if out.returncode != 0:
        return f"torch does not import: {out.stderr.strip()[-500:]}"
    available, version, cuda = out.stdout.split()
    if available != "True":
        return f"no CUDA device: torch.cuda.is_available() is False (torch {version}, built for CUDA {cuda})"
    return None


# ---- running the checks ---------------------------------------------------------------------------


def run_check(check: Check, budget: float, args, env: dict[str, str], workdir: Path, logs: Path) -> dict:
    """One check in a process of its own; its result as it wrote it, plus how it ended."""
    result_path = workdir / f"{check.name}.json"  # merged into the report
    log_path = logs / f"{check.name}.log"
    command = [
        sys.executable,
        "-m",
        f"{PACKAGE}.{check.name}",
        "--json",
        str(result_path),
        "--workdir",
        str(workdir),
    ]
    if args.dry_run:
        command.append("--dry-run")
    print(f"gpu-check: {check.name} (budget {budget:.0f} s)", flush=True)
    started = time.monotonic()
    with log_path.open("w") as log:
        process = subprocess.Popen(
            # Not in the checkout: its top-level `berth/` folder would shadow the linked package.
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=workdir,
        )
        try:
            code = process.wait(timeout=budget)
            status = "passed" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            _stop(process)
            status = "timed out"
    seconds = time.monotonic() - started
    try:
        result = json.loads(result_path.read_text())
    except (OSError, ValueError):
        result = {"rows": [], "metrics": {}, "notes": [], "error": "the check wrote no result"}
    if status == "failed" and not result.get("error") and result.get("passed", False):
        result["error"] = f"exit code {code}"  # it reported success, then its process failed
    result.update(check=check.name, status=status, seconds=seconds, budget=budget, log=str(log_path))
    print(f"gpu-check: {check.name} {status} in {seconds:.0f} s", flush=True)
    return result


def _stop(process: subprocess.Popen) -> None:
    """The check and every process it started (a server, an engine's workers)."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


# ---- the report -------------------------------------------------------------------------------------


def table(results: list[dict]) -> str:
    """One line per row of every check: check, what, measured, goal, verdict."""
    lines = []
    for result in results:
        verdict = {"passed": "ok", "failed": "FAIL", "timed out": "TIMEOUT", "not run": "SKIP"}[
            result["status"]
        ]
        lines.append(f"== {result['check']}: {verdict} ({result.get('seconds', 0):.0f} s)")
        for row in result.get("rows", []):
            mark = {True: "ok", False: "FAIL", None: "  "}[row["ok"]]
            goal = f"  [goal: {row['goal']}]" if row["goal"] else ""
            lines.append(f"  {mark:<4} {row['item']}: {row['value']}{goal}")
        if result.get("error"):
            lines.append(f"  FAIL {result['error']}")
        lines.extend(f"  note: {note}" for note in result.get("notes", []))
    return "\n".join(lines)


def report_path(out: str | None) -> Path:
    target = Path(out or os.environ.get("OUT") or "gpu-check")
    if target.suffix == ".json":
        target.parent.mkdir(parents=True, exist_ok=True)
        return target
    target.mkdir(parents=True, exist_ok=True)
    return target / "gpu-check.json"


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    with contextlib.ExitStack() as cleanup:
        site = Path(args.site) if args.site else _temporary(cleanup, prefix="berth-gpu-site-")
        workdir = Path(args.workdir) if args.workdir else _temporary(cleanup, default_workdir())
        return run(args, site, workdir)


def _temporary(cleanup: contextlib.ExitStack, path: Path | None = None, prefix: str = "") -> Path:
    """A directory this run made, removed when it ends (the 16 GB checkpoint with it)."""
    path = path or Path(tempfile.mkdtemp(prefix=prefix))
    cleanup.callback(shutil.rmtree, path, ignore_errors=True)
    return path


def run(args: argparse.Namespace, site: Path, workdir: Path) -> int:
    deadline = time.monotonic() + args.budget_seconds
    report = report_path(args.out)
    logs = report.parent / "logs"
    logs.mkdir(exist_ok=True)
    try:
        installed = install_wheels(Path(args.wheels), site)
    except SetupError as error:
        print(f"gpu-check: {error}", file=sys.stderr)
        return 2
    link_package(site)
    env = check_environment(site, args.dry_run)
    print(f"gpu-check: {len(installed)} carried wheels installed into {site}; berth from {REPOSITORY}")
    if not args.dry_run and (problem := cuda_problem(env)):
        advice = "Run it on a machine with an NVIDIA GPU, or use --dry-run."
        print(f"gpu-check: {problem}. {advice}", file=sys.stderr)
        return 2
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for check in CHECKS:
        if args.only and check.name not in args.only:
            continue
        left = deadline - time.monotonic() - RESERVE_SECONDS
        budget = min(check.dry_run_budget if args.dry_run else check.budget, left)
        if budget < MIN_CHECK_SECONDS:
            results.append({"check": check.name, "status": "not run", "error": "the run's budget was spent"})
            continue
        results.append(run_check(check, budget, args, env, workdir, logs))
    passed = all(result["status"] == "passed" for result in results)
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "passed": passed,
        "budget_seconds": args.budget_seconds,
        "carried_wheels": installed,
        "checks": results,
    }
    report.write_text(json.dumps(summary, indent=2))
    for result in results:
        if result["status"] in ("failed", "timed out") and result.get("log"):
            tail = Path(result["log"]).read_text(errors="replace").splitlines()[-15:]
            print(f"\n--- {result['check']}: the end of its log ({result['log']})", *tail, sep="\n")
    print("\n" + table(results))
    print(f"\ngpu-check: {'PASSED' if passed else 'FAILED'}; report {report}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
