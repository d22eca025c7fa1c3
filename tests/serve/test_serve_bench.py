"""`berth bench serve` end to end: it starts `berth serve` itself, loads it, stops it, measures
the offline baseline, and prints vLLM-style figures and the served / offline ratio."""

from __future__ import annotations

import re
import subprocess
import sys

REPORTED = (
    "Successful requests",
    "Request throughput (req/s)",
    "Output token throughput (tok/s)",
    "Median TTFT (ms)",
    "P99 TTFT (ms)",
    "P90 ITL (ms)",
    "P99 ITL (ms)",
    "Median TPOT (ms)",
    "P99 E2EL (ms)",
    "Offline output throughput (tok/s)",
    "Served / offline output throughput",
)


def figure(stdout: str, label: str) -> float:
    match = re.search(rf"^{re.escape(label)}:\s+([\d.]+)$", stdout, re.MULTILINE)
    assert match, f"{label!r} missing from:\n{stdout}"
    return float(match.group(1))


def test_bench_serve_reports_latencies_throughput_and_the_offline_ratio(tiny_model):
    result = subprocess.run(
        [
            sys.executable, "-m", "berth", "bench", "serve", str(tiny_model), "--num-requests", "12",
            "--input-len", "4", "16", "--output-len", "4", "16", "--batch-size", "8",
            "--max-concurrency", "6",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    values = {label: figure(result.stdout, label) for label in REPORTED}
    assert values["Successful requests"] == 12
    assert figure(result.stdout, "Failed requests") == 0
    assert figure(result.stdout, "Maximum request concurrency") == 6
    assert all(value > 0 for value in values.values()), values
    assert values["P99 TTFT (ms)"] >= values["Median TTFT (ms)"]


def test_bench_serve_refuses_bad_arguments(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "berth", "bench", "serve", str(tmp_path), "--max-concurrency", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--max-concurrency" in result.stderr
    assert "Traceback" not in result.stderr
