"""The batch-1 GEMV (`triton_kernels/gemv.py`) against torch's product, and when the Triton
backend's `linear` takes it."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize(
    ("dtype", "num_rows", "num_columns"),
    [  # ragged tiles; each of the three tile shapes (the interpreter runs 16k rows slowly: once)
        (torch.bfloat16, 72, 1000),
        (torch.float16, 72, 1000),
        (torch.float16, 5, 64),
        (torch.bfloat16, 16400, 24),
        (torch.bfloat16, 9, 9000),
        (torch.float16, 9, 9000),
    ],
)
def test_gemv_matches_torch(triton_ops, device, dtype, num_rows, num_columns):
    from berth.kernels.triton_kernels.gemv import gemv

    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(1, num_columns, generator=generator).to(dtype).to(device)
    weight = torch.randn(num_rows, num_columns, generator=generator).to(dtype).to(device)
    bias = torch.randn(num_rows, generator=generator).to(dtype).to(device)
    for b in (None, bias):
        expected = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
        # Summed in float32, rounded once: within a unit or two of the float32 product's rounding.
        torch.testing.assert_close(
            gemv(x, weight, b).float(), expected.to(dtype).float(), atol=0.05, rtol=0.02
        )


@pytest.mark.parametrize("capturing", [True, False])
def test_linear_takes_the_gemv_for_one_16_bit_row_in_a_graph_capture_only(
    triton_ops, device, monkeypatch, assert_matches, capturing
):
    import berth.kernels.triton_ops as module

    calls = []

    def recorded(x, weight, bias=None):
        calls.append(tuple(x.shape))
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(module, "gemv", recorded)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    weight = torch.randn(8, 16, device=device)
    for rows, dtype in ((1, torch.bfloat16), (2, torch.bfloat16), (1, torch.float32)):
        x = torch.randn(rows, 16, device=device).to(dtype)
        out = module.linear(x, weight.to(dtype), None, None)
        assert_matches(out, torch.nn.functional.linear(x, weight.to(dtype)))
    assert calls == ([(1, 16)] if capturing else [])
