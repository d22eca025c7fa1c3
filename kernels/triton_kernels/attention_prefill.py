"""Causal attention for prefill and chunked-prefill sequences over the paged KV cache.

A flat varlen batch: no padding, each sequence's new tokens are contiguous in `query`. Keys and
values are all read from the cache (the new ones were written there first), so a chunk whose
prefix was cached in an earlier step needs nothing special. One program handles BLOCK_Q query
tokens of one sequence times all the query heads that share one KV head (GQA): each key/value
tile is loaded once for the whole group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from berth.kernels.triton_kernels.attention_tile import LOG2_E, attend_tile, dot_options


@triton.jit
def _find_sequence(query_start_loc_ptr, query_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning flat query block `query_block`.

    Sequence i owns the flat blocks starting at `query_start_loc[i] // BLOCK_Q + i`: that
    numbering leaves each sequence room for its cdiv(len, BLOCK_Q) blocks without a host-side
    prefix sum, at the price of at most one idle program per sequence.
    """
    low: tl.int32 = 0
    high: tl.int32 = num_seqs
    while low < high:
        mid = (low + high) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= query_block:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _prefill_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    scale_log2,
    window,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_key_block,
    stride_key_slot,
    stride_key_head,
    stride_value_block,
    stride_value_slot,
    stride_value_head,
    stride_block_table,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    QUERIES_PER_KV_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    WINDOW: tl.constexpr,
):
    query_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, query_block, num_seqs, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    block_in_seq = query_block - (query_start // BLOCK_Q + seq)
    if block_in_seq * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # tokens cached by earlier steps

    # Row r is query token r // QUERIES_PER_KV_PAD of the block, head r % QUERIES_PER_KV_PAD of the group.
    BLOCK_M: tl.constexpr = BLOCK_Q * QUERIES_PER_KV_PAD
    rows = tl.arange(0, BLOCK_M)
    token_in_seq = block_in_seq * BLOCK_Q + rows // QUERIES_PER_KV_PAD
    head_in_group = rows % QUERIES_PER_KV_PAD
    heads = kv_head * QUERIES_PER_KV + head_in_group
    row_valid = (token_in_seq < query_len) & (head_in_group < QUERIES_PER_KV)
    dims = tl.arange(0, HEAD_DIM_PAD)
    tokens = (query_start + token_in_seq).to(tl.int64)
    row_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    query = tl.load(
        query_ptr + tokens[:, None] * stride_query_token + heads[:, None] * stride_query_head + dims[None, :],
        mask=row_mask,
        other=0.0,
    )
    query_positions = context_len + token_in_seq

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    first_query_position = context_len + block_in_seq * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_query_position + BLOCK_Q)
    if WINDOW:
        # From the tile holding the first key the block's first query sees; every tile masked
        # (the window's lower edge runs diagonally through them, as the causal edge does).
        first_tile = tl.maximum(first_query_position - window + 1, 0) // BLOCK_N
        for tile in range(first_tile, tl.cdiv(kv_end, BLOCK_N)):
            acc, row_sum, row_max = attend_tile(
                acc, row_sum, row_max, query, query_positions, tile * BLOCK_N, seq_len, block_table_ptr,
                key_cache_ptr, value_cache_ptr, kv_head,
                stride_key_block, stride_key_slot, stride_key_head,
                stride_value_block, stride_value_slot, stride_value_head,
                scale_log2, window, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, CACHE_BLOCK_SIZE,
                MASK_KEYS=True, CAUSAL=True, DOT_PRECISION=DOT_PRECISION, DOT_IN_FP32=DOT_IN_FP32,
                WINDOW=True,
            )  # fmt: skip
    else:
        # Tiles wholly before the block's first query need no mask; the rest (the diagonal) do.
        num_unmasked_tiles = (first_query_position + 1) // BLOCK_N
        for tile in range(0, num_unmasked_tiles):
            acc, row_sum, row_max = attend_tile(
                acc, row_sum, row_max, query, query_positions, tile * BLOCK_N, seq_len, block_table_ptr,
                key_cache_ptr, value_cache_ptr, kv_head,
                stride_key_block, stride_key_slot, stride_key_head,
                stride_value_block, stride_value_slot, stride_value_head,
                scale_log2, window, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, CACHE_BLOCK_SIZE,
                MASK_KEYS=False, CAUSAL=False, DOT_PRECISION=DOT_PRECISION, DOT_IN_FP32=DOT_IN_FP32,
                WINDOW=False,
            )  # fmt: skip
        for tile in range(num_unmasked_tiles, tl.cdiv(kv_end, BLOCK_N)):
            acc, row_sum, row_max = attend_tile(
                acc, row_sum, row_max, query, query_positions, tile * BLOCK_N, seq_len, block_table_ptr,
                key_cache_ptr, value_cache_ptr, kv_head,
                stride_key_block, stride_key_slot, stride_key_head,
                stride_value_block, stride_value_slot, stride_value_head,
                scale_log2, window, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, CACHE_BLOCK_SIZE,
                MASK_KEYS=True, CAUSAL=True, DOT_PRECISION=DOT_PRECISION, DOT_IN_FP32=DOT_IN_FP32,
                WINDOW=False,
            )  # fmt: skip

    if WINDOW:  # padding rows past the sequence's end may have seen no key: not 0 / 0
        row_sum = tl.where(row_sum > 0.0, row_sum, 1.0)
    out = acc / row_sum[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask,
    )


def prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    num_query_tokens: int,
    scale: float,
    window: int | None = None,
) -> None:
    """Writes `out` rows [0, num_query_tokens) for the sequences described by the arguments.

    `query_start_loc` [B + 1], `seq_lens` [B] and `block_tables` [B, *] cover these sequences
    only; their first query token is row 0 of `query`. With a `window`, the token at position p
    sees positions (p - window, p] only.
    """
    num_seqs = seq_lens.numel()
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    queries_per_kv = num_q_heads // num_kv_heads
    queries_per_kv_pad = triton.next_power_of_2(queries_per_kv)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # 128 rows of (token, head) pairs per program, 64 keys per tile: the usual flash-attention
    # shape for head sizes up to 128 on Hopper-class GPUs.
    block_m = max(128 if head_dim_pad <= 128 else 64, queries_per_kv_pad)
    block_q = block_m // queries_per_kv_pad
    block_n = 64 if head_dim_pad <= 128 else 32
    grid = (num_query_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        num_seqs,
        scale * LOG2_E,
        window or 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        QUERIES_PER_KV=queries_per_kv,
        QUERIES_PER_KV_PAD=queries_per_kv_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        CACHE_BLOCK_SIZE=key_cache.shape[1],
        **dot_options(query.dtype, query.device),
        WINDOW=bool(window),
        num_warps=4 if head_dim_pad <= 64 else 8,
        num_stages=2,
    )
