"""RMSNorm over the last dim, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    num_rows,
    hidden_size,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_HIDDEN)
    col_valid = cols < hidden_size
    mask = (rows < num_rows)[:, None] & col_valid[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr + rows[:, None] * stride_residual + cols[None, :], mask=mask, other=0.0
        )
        # Rounded to the storage dtype before normalising, exactly like the unfused `x + residual`.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + rows[:, None] * stride_residual_out + cols[None, :], x, mask=mask)
    x32 = x.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(x32 * x32, axis=1) / hidden_size + eps)
    # HF's order: normalise in fp32, round to the activation dtype, then scale by the weight.
    normed = (x32 * inverse_rms[:, None]).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)
    out = normed * weight[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hidden_size = x.shape[-1]
    x2d = _rows(x)
    residual2d = _rows(residual) if residual is not None else None
    # Output dtypes follow torch's promotion, as in the reference.
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x2d.shape, dtype=torch.promote_types(sum_dtype, weight.dtype), device=x.device)
    residual_out = torch.empty(x2d.shape, dtype=sum_dtype, device=x.device) if residual is not None else out

    block_hidden = triton.next_power_of_2(hidden_size)
    # Several rows per program when rows are short: fewer, fuller programs (and a faster interpreter).
    block_rows = max(1, min(64, 4096 // block_hidden))
    elements = block_rows * block_hidden
    num_warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16
    num_rows = x2d.shape[0]
    _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        x2d,
        residual2d if residual2d is not None else x2d,
        weight,
        out,
        residual_out,
        num_rows,
        hidden_size,
        x2d.stride(0),
        residual2d.stride(0) if residual2d is not None else 0,
        out.stride(0),
        residual_out.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROWS=block_rows,
        BLOCK_HIDDEN=block_hidden,
        num_warps=num_warps,
    )
    out = out.view(x.shape)
    return out if residual is None else (out, residual_out.view(x.shape))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., H] as [rows, H] with unit stride along H (a copy only when no such view exists)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()
