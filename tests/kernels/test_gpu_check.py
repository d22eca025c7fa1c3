"""`python -m berth.kernels.gpu_check`: its no-GPU exit, and its code paths on tiny CPU shapes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from berth.kernels import gpu_check
from berth.kernels.gpu_check import AttentionCase

TINY_CASES = (
    AttentionCase("tiny mixed", ((0, 20), (9, 4), (40, 1), (0, 1)), 2, 4, 2, 64, 16),
    AttentionCase("tiny decode", ((70, 1),) * 2, 0, 4, 2, 64, 16),
    AttentionCase("tiny prefill", ((0, 24),) * 2, 2, 4, 2, 64, 16),
)


def test_exits_non_zero_with_a_clear_message_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit of the real command")
def test_module_entry_point_without_cuda():
    result = subprocess.run(
        [sys.executable, "-m", "berth.kernels.gpu_check", "--no-bench"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr


def test_correctness_checks_run_and_pass(triton_ops, device):
    results = gpu_check.check_kernels(
        torch.device(device),
        num_tokens=9,
        hidden_size=64,
        intermediate_size=48,
        attention_cases=TINY_CASES[:1],
    )
    assert len(results) == 2 * 9  # nine checks per dtype
    assert all(result.passed for result in results), "\n".join(result.line() for result in results)


def test_benchmark_table(triton_ops, device):
    """The benchmark's plumbing (batches, dense SDPA inputs, ratios), with a fake timer."""
    timings = iter([2.0, 1.0, 4.0] * len(TINY_CASES))  # reference, Triton, SDPA per case

    def fake_timer(fn):
        fn()
        return next(timings)

    rows = gpu_check.benchmark_attention(torch.device(device), TINY_CASES[1:], fake_timer, torch.float32)
    table = gpu_check.format_table(rows)
    assert [row.case for row in rows] == ["tiny decode", "tiny prefill"]
    assert all(row.matches for row in rows)
    assert "GB/s" in rows[0].throughput and "TFLOP/s" in rows[1].throughput
    assert "2.00x" in table and "4.00x" in table
