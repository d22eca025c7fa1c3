"""Scatter of the step's new keys and values into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    num_kv_heads,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_key_cache_block,
    stride_key_cache_slot,
    stride_key_cache_head,
    stride_value_cache_block,
    stride_value_cache_slot,
    stride_value_cache_head,
    HEAD_DIM: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    tokens = (tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)).to(tl.int64)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    # A negative slot marks a padding token (e.g. a captured graph's spare rows): nothing to write.
    token_valid = slots >= 0
    blocks = (slots // CACHE_BLOCK_SIZE)[:, None, None]
    in_block = (slots % CACHE_BLOCK_SIZE)[:, None, None]
    heads = tl.arange(0, BLOCK_HEADS)[None, :, None]
    dims = tl.arange(0, BLOCK_DIM)[None, None, :]
    mask = token_valid[:, None, None] & (heads < num_kv_heads) & (dims < HEAD_DIM)
    tokens = tokens[:, None, None]
    key = tl.load(key_ptr + tokens * stride_key_token + heads * stride_key_head + dims, mask=mask)
    value = tl.load(value_ptr + tokens * stride_value_token + heads * stride_value_head + dims, mask=mask)
    key_ptrs = key_cache_ptr + blocks * stride_key_cache_block + in_block * stride_key_cache_slot
    key_ptrs += heads * stride_key_cache_head + dims
    value_ptrs = value_cache_ptr + blocks * stride_value_cache_block + in_block * stride_value_cache_slot
    value_ptrs += heads * stride_value_cache_head + dims
    tl.store(key_ptrs, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_ptrs, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("KV caches need a unit stride on the head dim")
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    num_tokens, num_kv_heads, head_dim = key.shape
    block_heads = triton.next_power_of_2(num_kv_heads)
    block_dim = triton.next_power_of_2(head_dim)
    block_tokens = max(1, min(64, 4096 // (block_heads * block_dim)))
    _write_kv_cache_kernel[(triton.cdiv(num_tokens, block_tokens),)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        HEAD_DIM=head_dim,
        CACHE_BLOCK_SIZE=key_cache.shape[1],
        BLOCK_TOKENS=block_tokens,
        BLOCK_HEADS=block_heads,
        BLOCK_DIM=block_dim,
        num_warps=4,
    )
