"""`make gpu-check` (tools/gpu_check.py) without a GPU: its dry run, which runs every check's code
on the CPU with tiny shapes, its setup on a bare machine (carried wheels into a target
directory, berth linked from the checkout), its budgets and its report; and that the carried
wheels are what a GPU machine's image lacks of berth's imports."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPOSITORY = Path(__file__).resolve().parent.parent.parent
TOOL = REPOSITORY / "tools" / "gpu_check.py"
CHECKS = ["environment", "kernels", "parity", "decode", "sleep", "serve"]


def load_tool():
    spec = importlib.util.spec_from_file_location("gpu_check_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def probe_wheel(folder: Path) -> Path:
    """A real (tiny) wheel, as `make gpu-wheels` leaves them in .whl/."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "berth_gpu_probe-1.0-py3-none-any.whl"
    info = "berth_gpu_probe-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("berth_gpu_probe.py", "CARRIED = True\n")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: berth-gpu-probe\nVersion: 1.0\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of every check, shared by the tests that read its report."""
    root = tmp_path_factory.mktemp("gpu-check")
    wheels = root / "wheels"
    probe_wheel(wheels)
    command = [
        sys.executable, str(TOOL), "--dry-run", "--out", str(root / "out"), "--wheels", str(wheels),
        "--site", str(root / "site"), "--workdir", str(root / "work"),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=root)
    report = json.loads((root / "out" / "gpu-check.json").read_text())
    return result, report, root


@pytest.mark.slow  # every gpu-check step on the CPU, each in a process of its own
def test_the_dry_run_passes_every_check_and_prints_one_table(dry_run):
    result, report, _ = dry_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert report["dry_run"] and report["passed"]
    assert [check["check"] for check in report["checks"]] == CHECKS
    assert all(check["status"] == "passed" for check in report["checks"])
    for name in CHECKS:
        assert f"== {name}: ok" in result.stdout
    assert result.stdout.rstrip().endswith(f"gpu-check: PASSED; report {report_path(dry_run)}")


def report_path(dry_run) -> Path:
    return dry_run[2] / "out" / "gpu-check.json"


def test_every_check_reports_what_the_issue_asks_for(dry_run):
    _, report, _ = dry_run
    rows = {check["check"]: [row["item"] for row in check["rows"]] for check in report["checks"]}
    metrics = {check["check"]: check["metrics"] for check in report["checks"]}
    assert "copy_bandwidth_bytes_per_s" in metrics["environment"]
    assert metrics["environment"]["versions"]["torch"]  # what Dockerfile.cuda pins
    assert any(item.startswith("attention decode") for item in rows["kernels"])
    assert any("kernel checks at tiny shapes" in item for item in rows["kernels"])
    for model in ("llama", "qwen2"):
        for dtype in ("float32", "bfloat16"):
            for mode in ("graphs", "eager"):
                assert f"{model} {dtype} {mode}: greedy vs transformers" in rows["parity"]
    assert (
        "berth batch-1 TPOT, CUDA graphs" in rows["decode"] and "berth batch-1 TPOT, eager" in rows["decode"]
    )
    assert {"output tokens/s at batch 1", "output tokens/s at batch 2"} <= set(rows["decode"])
    assert "roofline_tpot_s" in metrics["decode"]
    for level in (1, 2):
        assert f"level {level}: greedy tokens after waking" in rows["sleep"]
        assert metrics["sleep"][f"level{level}"]["wake_seconds"] > 0
    assert {"completion, whole and streamed", "SIGTERM"} <= set(rows["serve"])


def test_setup_installs_the_carried_wheels_and_links_berth_from_the_checkout(dry_run):
    result, report, root = dry_run
    assert report["carried_wheels"] == ["berth_gpu_probe-1.0-py3-none-any.whl"]
    assert (root / "site" / "berth_gpu_probe.py").is_file()
    assert (root / "site" / "berth" / "engine").resolve() == REPOSITORY / "engine"
    assert "1 carried wheels installed" in result.stdout
    for check in report["checks"]:
        assert Path(check["log"]).is_file()  # the logs come back with the report


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    result = subprocess.run(
        [sys.executable, str(TOOL), "--out", str(tmp_path), "--wheels", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr and "--dry-run" in result.stderr


def test_wheels_that_do_not_install_here_are_a_clear_refusal(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "broken-1.0-cp399-cp399-manylinux_2_17_x86_64.whl").write_bytes(b"not a zip")
    result = subprocess.run(
        [sys.executable, str(TOOL), "--dry-run", "--out", str(tmp_path),
         "--wheels", str(tmp_path / "wheels")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    assert "do not install here" in result.stderr and "Traceback" not in result.stderr


def test_bad_arguments_are_refused(tmp_path):
    for args in (["--only", "nope"], ["--budget-seconds", "0"]):
        result = subprocess.run(
            [sys.executable, str(TOOL), "--dry-run", "--out", str(tmp_path), *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 2, args
        assert "error:" in result.stderr


def test_a_check_over_its_budget_is_stopped_and_reported(tmp_path):
    """Its process group is killed at the budget; the others would still run."""
    tool = load_tool()
    args = tool.parse_arguments(["--dry-run"])
    site = tmp_path / "site"
    tool.link_package(site)
    env = tool.check_environment(site, dry_run=True)
    check = tool.Check("environment", 0.5, 0.5)  # importing torch alone takes longer
    result = tool.run_check(check, 0.5, args, env, tmp_path, tmp_path)
    assert result["status"] == "timed out"
    assert result["error"] == "the check wrote no result"
    assert "\n== environment: TIMEOUT" in "\n" + tool.table([result])


def test_the_run_budget_leaves_checks_out_rather_than_overrun(tmp_path):
    result = subprocess.run(
        [sys.executable, str(TOOL), "--dry-run", "--out", str(tmp_path), "--budget-seconds", "10",
         "--wheels", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert result.returncode == 1
    assert {check["status"] for check in report["checks"]} == {"not run"}


def _berth_imports() -> set[str]:
    """Top-level modules berth's engine, kernels and CLI import (lazily too), less the stdlib."""
    names = set()
    for room in ("engine", "kernels", "berth"):
        for path in (REPOSITORY / room).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"berth", "__future__"}


def _carried() -> dict[str, str]:
    lines = (REPOSITORY / "tools" / "gpu-wheels.txt").read_text().splitlines()
    pins = [re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line) for line in lines if line and line[0] != "#"]
    assert all(pins), "every line of tools/gpu-wheels.txt pins one distribution"
    return {_canonical(pin[1]): pin[2] for pin in pins}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_carried_wheels_and_the_image_cover_every_import_of_the_engine():
    provides = {_canonical(name) for name in load_tool().GPU_IMAGE_PROVIDES}
    carried = set(_carried())
    distributions = importlib.metadata.packages_distributions()
    imported = {_canonical(d) for module in _berth_imports() for d in distributions.get(module, [module])}
    assert imported - provides - carried == set(), (
        "imported by berth, on no GPU machine: add to tools/gpu-wheels.txt"
    )


def test_every_carried_wheel_has_what_it_requires_on_the_gpu_machine():
    """Each wheel's own requirements (for CPython 3.12 on Linux) are carried or in the image."""
    available = set(_carried()) | {_canonical(name) for name in load_tool().GPU_IMAGE_PROVIDES}
    environment = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                   "platform_system": "Linux", "implementation_name": "cpython", "extra": ""}  # fmt: skip
    missing = {}
    for name in _carried():
        for text in importlib.metadata.requires(name) or []:
            requirement = Requirement(text)
            applies = requirement.marker is None or requirement.marker.evaluate(environment)
            if applies and _canonical(requirement.name) not in available:
                missing.setdefault(name, []).append(text)
    assert not missing, f"carried wheels need more than the image and the others bring: {missing}"
