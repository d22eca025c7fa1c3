"""`berth generate` and `berth bench throughput` as a user runs them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def berth(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    # faulthandler: a native abort (seen once: "terminate called without an active exception")
    # then shows every thread's Python stack in the failure, not just the signal.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.run(
        [sys.executable, "-m", "berth", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def failure(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\nstdout (tail):\n{result.stdout[-3000:]}\nstderr:\n{result.stderr}"


def test_generate_prints_text_and_tokens_per_second(tiny_model):
    result = berth("generate", str(tiny_model), "--prompt", "hello there", "--max-tokens", "8")
    assert result.returncode == 0, failure(result)
    assert "'hello there' ->" in result.stdout
    assert re.search(r"1 prompts, \d+ tokens in [\d.]+ s: [\d.]+ tokens/s", result.stdout)


def test_generate_refuses_a_missing_model_without_a_traceback(tmp_path):
    result = berth("generate", str(tmp_path / "nowhere"))
    assert result.returncode != 0
    assert "not a model directory" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow  # a benchmark run end to end (an MPI world beside one rank, or transformers beside berth)
def test_bench_throughput_reports_both_engines_the_roofline_tpot_and_a_plot(tiny_model, tmp_path):
    plot = tmp_path / "throughput.png"
    result = berth(
        "bench", "throughput", str(tiny_model), "--num-requests", "6", "--input-len", "4", "8",
        "--output-len", "4", "8", "--batch-size", "4", "--dtype", "bfloat16", "--tpot-requests", "1",
        "--plot", str(plot), "--plot-batch-sizes", "1", "4", "--rounds", "2",
    )  # fmt: skip
    assert result.returncode == 0, failure(result)
    out = result.stdout
    assert "dtype bfloat16" in out
    peak = re.search(r"matmul peak \(bfloat16.*\): ([\d.]+) GFLOPS; the workload needs ([\d.]+) TFLOP", out)
    assert peak and float(peak.group(1)) > 0, out
    again = re.search(r"peak again, after berth's run: ([\d.]+) GFLOPS .* the higher, ([\d.]+)$", out, re.M)
    used = float(again.group(2)) if again else None
    assert used == max(float(peak.group(1)), float(again.group(1))), out
    rounds = re.findall(r"^round (\d): berth ([\d.]+) s, transformers ([\d.]+) s$", out, re.M)
    assert [number for number, _, _ in rounds] == ["1", "2"], out
    for index, engine in enumerate(("berth", "transformers")):
        figures = r" +([\d.]+) s .* ([\d.]+) output tok/s +([\d.]+) GFLOPS = +([\d.]+) % of"
        line = re.search(rf"^{engine}:{figures}", out, re.M)
        assert line and float(line.group(2)) > 0, out
        # Each engine's line is its fastest round.
        assert float(line.group(1)) == min(float(times[index + 1]) for times in rounds), out
        # Both lines are against the higher peak (give or take the printed figures' rounding).
        expected = 100 * float(line.group(3)) / used
        assert float(line.group(4)) == pytest.approx(expected, abs=0.06 + 5 / used), out
    assert re.search(r"ratio berth / transformers: \d+\.\d+x", out)
    assert re.search(r"batch-1 TPOT .*: berth [\d.]+ ms, transformers [\d.]+ ms", out)
    assert re.search(r"batch size   1: berth .* tok/s, transformers .* tok/s", out)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_throughput_with_a_shared_prefix_compares_caching_on_and_off(tiny_model):
    result = berth(
        "bench", "throughput", str(tiny_model), "--shared-prefix-len", "64", "--num-requests", "6",
        "--input-len", "4", "8", "--output-len", "2", "4", "--batch-size", "4",
    )  # fmt: skip
    assert result.returncode == 0, failure(result)
    assert "a shared system prompt of 64 tokens" in result.stdout
    cached = dict(
        re.findall(r"prefix caching (on |off):.*TTFT mean .* from the cache\s+([\d.]+)%", result.stdout)
    )
    assert float(cached["off"]) == 0 and float(cached["on "]) > 50, result.stdout
    assert re.search(r"ratio on / off: throughput \d+\.\d+x, mean TTFT \d+\.\d+x", result.stdout)
    assert "transformers" not in result.stdout


@pytest.mark.slow  # a benchmark run end to end (an MPI world beside one rank, or transformers beside berth)
def test_bench_throughput_with_tensor_parallelism_compares_against_one_rank_and_costs_the_collectives(
    tiny_model,
):
    result = berth(
        "bench", "throughput", str(tiny_model), "--tensor-parallel-size", "2", "--num-requests", "4",
        "--input-len", "4", "8", "--output-len", "4", "8", "--batch-size", "4",
    )  # fmt: skip
    assert result.returncode == 0, failure(result)
    out = result.stdout
    one = re.search(r"^berth TP=1: .* ([\d.]+) output tok/s\s+(\d+) steps", out, re.M)
    two = re.search(
        r"^berth TP=2: .* ([\d.]+) output tok/s\s+(\d+) steps, [\d.]+ ms a step; per step on rank 0: "
        r"(\d+) all-reduces taking ([\d.]+) ms \(\d+ % of the wall time\), other collectives .* ([\d.]+) ms",
        out,
        re.M,
    )
    assert one and two, out
    assert int(one[2]) > 0 and int(two[2]) > 0
    assert int(two[3]) == 2 * 2 + 1  # o_proj and down of each of 2 layers, the vocab-parallel embedding
    assert float(two[4]) > 0
    assert re.search(r"ratio TP=2 / TP=1 throughput: \d+\.\d+x", out)
    assert "transformers" not in out
