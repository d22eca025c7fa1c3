"""`berth generate` and `berth bench throughput` as a user runs them."""

from __future__ import annotations

import re
import subprocess
import sys


def berth(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "berth", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_prints_text_and_tokens_per_second(tiny_model):
    result = berth("generate", str(tiny_model), "--prompt", "hello there", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert "'hello there' ->" in result.stdout
    assert re.search(r"1 prompts, \d+ tokens in [\d.]+ s: [\d.]+ tokens/s", result.stdout)


def test_generate_refuses_a_missing_model_without_a_traceback(tmp_path):
    result = berth("generate", str(tmp_path / "nowhere"))
    assert result.returncode != 0
    assert "not a model directory" in result.stderr and "Traceback" not in result.stderr


def test_bench_throughput_reports_both_engines_and_the_ratio(tiny_model):
    result = berth(
        "bench", "throughput", str(tiny_model), "--num-requests", "8", "--input-len", "4", "8",
        "--output-len", "4", "8", "--batch-size", "4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert re.search(r"berth:.*tok/s", result.stdout)
    assert re.search(r"transformers:.*tok/s", result.stdout)
    assert re.search(r"ratio.*\d+\.\d+", result.stdout, re.IGNORECASE)
