"""Rotary position embedding, neox (rotate-half) layout, applied in place to query and key."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    tokens,
    token_valid,
    stride_token,
    stride_head,
    num_heads,
    cos,
    sin,
    HALF_ROTARY: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_HALF)
    offsets = tokens[:, None, None] * stride_token + heads[None, :, None] * stride_head + dims[None, None, :]
    mask = (
        token_valid[:, None, None] & (heads < num_heads)[None, :, None] & (dims < HALF_ROTARY)[None, None, :]
    )
    first = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    second = tl.load(x_ptr + offsets + HALF_ROTARY, mask=mask, other=0.0).to(tl.float32)
    dtype = first.dtype
    first = first.to(tl.float32)
    tl.store(x_ptr + offsets, (first * cos - second * sin).to(dtype), mask=mask)
    tl.store(x_ptr + offsets + HALF_ROTARY, (second * cos + first * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    cos_sin_ptr,
    num_tokens,
    num_q_heads,
    num_kv_heads,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos_sin,
    HALF_ROTARY: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tokens = (tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)).to(tl.int64)
    token_valid = tokens < num_tokens
    positions = tl.load(positions_ptr + tokens, mask=token_valid, other=0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    table_mask = token_valid[:, None] & (dims < HALF_ROTARY)[None, :]
    table = cos_sin_ptr + positions[:, None] * stride_cos_sin + dims[None, :]
    # One table row serves every head of the token: load it once, broadcast over heads.
    cos = tl.load(table, mask=table_mask, other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(table + HALF_ROTARY, mask=table_mask, other=0.0).to(tl.float32)[:, None, :]
    _rotate_heads(
        query_ptr, tokens, token_valid, stride_q_token, stride_q_head, num_q_heads, cos, sin,
        HALF_ROTARY, BLOCK_Q_HEADS, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        key_ptr, tokens, token_valid, stride_k_token, stride_k_head, num_kv_heads, cos, sin,
        HALF_ROTARY, BLOCK_KV_HEADS, BLOCK_HALF,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError(
            "rotary_embedding rotates in place: query and key need a unit stride on the last dim"
        )
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    num_tokens, num_q_heads, _ = query.shape
    num_kv_heads = key.shape[1]
    half_rotary = cos_sin_cache.shape[-1] // 2
    block_half = triton.next_power_of_2(half_rotary)
    block_q_heads = triton.next_power_of_2(num_q_heads)
    block_kv_heads = triton.next_power_of_2(num_kv_heads)
    # ~2k query elements per program: one token for a large model, many for a small one.
    block_tokens = max(1, min(64, 2048 // (block_q_heads * block_half)))
    _rotary_embedding_kernel[(triton.cdiv(num_tokens, block_tokens),)](
        positions,
        query,
        key,
        cos_sin_cache,
        num_tokens,
        num_q_heads,
        num_kv_heads,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        HALF_ROTARY=half_rotary,
        BLOCK_TOKENS=block_tokens,
        BLOCK_Q_HEADS=block_q_heads,
        BLOCK_KV_HEADS=block_kv_heads,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
