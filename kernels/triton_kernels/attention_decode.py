"""Decode attention (one query token per sequence) over the paged KV cache, flash-decoding style.

A decode step has few sequences but long contexts, so one program per (sequence, KV head) would
leave most of the GPU idle. The context is split into segments processed in parallel, each
producing an unnormalised partial output with its softmax max and sum; a second kernel merges
the segments. With a single segment the first kernel writes the final output itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from berth.kernels.triton_kernels.attention_tile import LOG2_E, attend_tile, dot_options

# Below this many tokens per segment the partial-output traffic outweighs the extra parallelism.
MIN_SEGMENT_TOKENS = 256
MAX_SEGMENTS = 64
# Enough resident programs to hide memory latency: a few waves over the streaming multiprocessors.
PROGRAMS_PER_SM = 4


@triton.jit
def _decode_segment_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    window,
    segment_len,
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
    stride_partial_seq,
    stride_partial_head,
    stride_partial_segment,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    SINGLE_SEGMENT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    segment_start = segment * segment_len
    if segment_start >= seq_len:
        return  # a shorter sequence of the batch: the merge reads only its used segments
    segment_end = tl.minimum(segment_start + segment_len, seq_len)

    # The query heads of one KV head form the rows of the score product (padded to >= 16 rows).
    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * QUERIES_PER_KV + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_mask = (rows < QUERIES_PER_KV)[:, None] & (dims < HEAD_DIM)[None, :]
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    query = tl.load(
        query_ptr + token * stride_query_token + heads[:, None] * stride_query_head + dims[None, :],
        mask=row_mask,
        other=0.0,
    )

    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    # The query is the sequence's last token: every key before seq_len is visible, so no causal
    # mask; a window hides the keys before its start (tiles wholly before it are skipped, and a
    # segment wholly before it leaves a -inf maximum, which the merge weighs 0).
    first_tile_start = segment_start
    if WINDOW:
        window_start = tl.maximum(seq_len - window, 0)
        first_tile_start += tl.maximum(window_start - segment_start, 0) // BLOCK_N * BLOCK_N
    query_positions = tl.zeros([BLOCK_H], dtype=tl.int32) + seq_len - 1
    for tile_start in range(first_tile_start, segment_end, BLOCK_N):
        acc, row_sum, row_max = attend_tile(
            acc, row_sum, row_max, query, query_positions, tile_start, seq_len, block_table_ptr,
            key_cache_ptr, value_cache_ptr, kv_head,
            stride_key_block, stride_key_slot, stride_key_head,
            stride_value_block, stride_value_slot, stride_value_head,
            scale_log2, window, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, CACHE_BLOCK_SIZE,
            MASK_KEYS=True, CAUSAL=False, DOT_PRECISION=DOT_PRECISION, DOT_IN_FP32=DOT_IN_FP32,
            WINDOW=WINDOW,
        )  # fmt: skip

    if SINGLE_SEGMENT:
        out = acc / row_sum[:, None]
        tl.store(
            out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )
    else:
        partial = seq * stride_partial_seq + heads * stride_partial_head + segment * stride_partial_segment
        tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_mask)
        head_valid = rows < QUERIES_PER_KV
        tl.store(partial_max_ptr + partial, row_max, mask=head_valid)
        tl.store(partial_sum_ptr + partial, row_sum, mask=head_valid)


@triton.jit
def _decode_merge_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    segment_len,
    stride_out_token,
    stride_out_head,
    stride_partial_seq,
    stride_partial_head,
    stride_partial_segment,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SEGMENTS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    segments = tl.arange(0, NUM_SEGMENTS_PAD)
    used = segments < tl.cdiv(seq_len, segment_len)
    partial = seq * stride_partial_seq + head * stride_partial_head + segments * stride_partial_segment
    segment_max = tl.load(partial_max_ptr + partial, mask=used, other=float("-inf"))
    segment_sum = tl.load(partial_sum_ptr + partial, mask=used, other=0.0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    segment_out = tl.load(
        partial_out_ptr + partial[:, None] * HEAD_DIM_PAD + dims[None, :], mask=used[:, None], other=0.0
    )
    # Rescale every segment to the global max (log2 domain, as in the segment kernel).
    weight = tl.where(used, tl.exp2(segment_max - tl.max(segment_max, axis=0)), 0.0)
    out = tl.sum(segment_out * weight[:, None], axis=0) / tl.sum(segment_sum * weight, axis=0)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    scale: float,
    segment_len: int | None = None,
    window: int | None = None,
) -> None:
    """Writes `out[query_start_loc[i]]` for each decode sequence i described by the arguments;
    with a `window`, over each sequence's last `window` positions only.

    `segment_len` (a multiple of the key tile) overrides the split; tests use it to exercise
    the merge on short contexts.
    """
    num_seqs = seq_lens.numel()
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    queries_per_kv = num_q_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if head_dim_pad <= 128 else 32
    if segment_len is None:
        segment_len = _segment_len(num_seqs * num_kv_heads, max_seq_len, block_n, query.device)
    elif segment_len % block_n:
        raise ValueError(f"segment_len must be a multiple of {block_n}, got {segment_len}")
    num_segments = triton.cdiv(max_seq_len, segment_len)
    single_segment = num_segments == 1
    if single_segment:
        partial_out = partial_max = partial_sum = out  # unused by the kernel
        partial_strides = (0, 0, 0)
    else:
        partial_max = torch.empty(
            (num_seqs, num_q_heads, num_segments), dtype=torch.float32, device=out.device
        )
        partial_sum = torch.empty_like(partial_max)
        partial_out = torch.empty((*partial_max.shape, head_dim_pad), dtype=torch.float32, device=out.device)
        partial_strides = partial_max.stride()

    _decode_segment_kernel[(num_seqs, num_kv_heads, num_segments)](
        out,
        partial_out,
        partial_max,
        partial_sum,
        query,
        key_cache,
        value_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * LOG2_E,
        window or 0,
        segment_len,
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
        *partial_strides,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_H=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_N=block_n,
        CACHE_BLOCK_SIZE=key_cache.shape[1],
        SINGLE_SEGMENT=single_segment,
        **dot_options(query.dtype, query.device),
        WINDOW=bool(window),
        num_warps=4,
        num_stages=2,
    )
    if single_segment:
        return
    _decode_merge_kernel[(num_seqs, num_q_heads)](
        out,
        partial_out,
        partial_max,
        partial_sum,
        query_start_loc,
        seq_lens,
        segment_len,
        out.stride(0),
        out.stride(1),
        *partial_strides,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        NUM_SEGMENTS_PAD=triton.next_power_of_2(num_segments),
        num_warps=4,
    )


def _segment_len(parallel_programs: int, max_seq_len: int, block_n: int, device: torch.device) -> int:
    """Tokens per segment: enough segments to fill the GPU, none shorter than MIN_SEGMENT_TOKENS."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, parallel_programs)
    most = max(1, min(MAX_SEGMENTS, max_seq_len // MIN_SEGMENT_TOKENS))
    num_segments = max(1, min(wanted, most))
    return triton.cdiv(triton.cdiv(max_seq_len, num_segments), block_n) * block_n
