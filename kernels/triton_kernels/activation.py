"""SwiGLU's elementwise half: [T, 2I] (gate | up) -> silu(gate) * up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    num_rows,
    intermediate_size,
    stride_x,
    stride_out,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows < num_rows)[:, None] & (cols < intermediate_size)[None, :]
    gate_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + intermediate_size, mask=mask, other=0.0).to(tl.float32)
    gate32 = gate.to(tl.float32)
    # Rounded to the activation dtype before the product, like the model's `act(gate) * up`.
    silu = (gate32 * tl.sigmoid(gate32)).to(gate.dtype).to(tl.float32)
    out = silu * up
    tl.store(
        out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    intermediate_size = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    num_rows = x2d.shape[0]
    out = torch.empty((num_rows, intermediate_size), dtype=x.dtype, device=x.device)
    block_cols = min(1024, triton.next_power_of_2(intermediate_size))
    block_rows = max(1, min(64, 4096 // block_cols))
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(intermediate_size, block_cols))
    _silu_and_mul_kernel[grid](
        x2d,
        out,
        num_rows,
        intermediate_size,
        x2d.stride(0),
        out.stride(0),
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        num_warps=4,
    )
    return out.view(*x.shape[:-1], intermediate_size)
