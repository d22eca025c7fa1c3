"""The roofline figures of `berth bench throughput`: the FLOPs a workload needs, a GEMM peak."""

from __future__ import annotations

import pytest
import torch

from berth.engine.bench.roofline import matmul_peak, workload_flops
from berth.engine.bench.workload import WorkItem
from berth.engine.models.config import ModelConfig
from berth.kernels.cpu_ops import gemm_path


def test_workload_flops_counts_projections_attention_and_the_lm_head(tiny_model):
    c = ModelConfig.from_pretrained(tiny_model)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    per_token = 2 * c.num_layers * (h * (q + 2 * kv) + q * h + h * 2 * i + i * h)
    # prompt 3 + output 2: tokens 0..3 go through the layers (the last output is never fed back),
    # attending over 1, 2, 3, 4 positions; the LM head runs for the 2 generated tokens.
    expected = 4 * per_token + 4 * c.num_layers * q * (1 + 2 + 3 + 4) + 2 * 2 * h * c.vocab_size
    assert workload_flops(c, [WorkItem([5, 6, 7], 2)]) == pytest.approx(expected)
    assert workload_flops(c, [WorkItem([5, 6, 7], 2)] * 3) == pytest.approx(3 * expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_peak_names_the_fastest_gemm(tiny_model, dtype):
    peak = matmul_peak(ModelConfig.from_pretrained(tiny_model), dtype, rows=64, seconds=0.05)
    assert peak.gflops > 0
    assert peak.path in ("torch.nn.functional.linear", gemm_path(dtype))
