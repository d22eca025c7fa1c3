"""One step of online-softmax attention over a tile of keys read through a block table.

Shared by the prefill and the decode kernels. Scores live in the log2 domain (the softmax scale
is pre-multiplied by log2(e)) so the exponentials are `exp2`, one instruction on NVIDIA GPUs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def dot_options(dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    """The tile's constexpr dot settings for this query dtype and device."""
    return {
        # float32 attention keeps full precision; Triton would otherwise round its inputs to tf32.
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        # Triton's interpreter multiplies bf16 dot operands as raw 16-bit integers (triton 3.9).
        # Upcasting is exact (bf16 products fit in fp32), so the result is what a GPU's bf16
        # dot with fp32 accumulation computes. CPU tensors only ever run in the interpreter.
        "DOT_IN_FP32": dtype == torch.bfloat16 and (device.type == "cpu" or _interpreting()),
    }


@triton.jit
def attend_tile(
    acc,
    row_sum,
    row_max,
    query,
    query_positions,
    tile_start,
    seq_len,
    block_table_ptr,
    key_cache_ptr,
    value_cache_ptr,
    kv_head,
    stride_key_block,
    stride_key_slot,
    stride_key_head,
    stride_value_block,
    stride_value_slot,
    stride_value_head,
    scale_log2,
    window,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Folds keys [tile_start, tile_start + BLOCK_N) into (acc, row_sum, row_max); returns them.

    MASK_KEYS: the tile may reach past `seq_len` (those slots hold stale or uninitialised data,
    so they are neither loaded nor scored). CAUSAL: the tile may hold keys after some query.
    WINDOW: a query at position p sees keys (p - window, p] only.
    Without a window, callers guarantee that every row sees an unmasked key in its first tile
    (key 0 is always visible), so `row_max` is finite from then on and no NaN can appear; with
    one, a row may see no key of a tile, and its maximum stays -inf until one comes.
    """
    key_positions = tile_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM_PAD)
    key_valid = key_positions < seq_len
    if MASK_KEYS:
        blocks = tl.load(block_table_ptr + key_positions // CACHE_BLOCK_SIZE, mask=key_valid, other=0)
    else:
        blocks = tl.load(block_table_ptr + key_positions // CACHE_BLOCK_SIZE)
    blocks = blocks.to(tl.int64)
    slots = key_positions % CACHE_BLOCK_SIZE
    dim_valid = dims < HEAD_DIM
    if MASK_KEYS:
        key_mask = dim_valid[:, None] & key_valid[None, :]
        value_mask = key_valid[:, None] & dim_valid[None, :]
    else:
        key_mask = dim_valid[:, None]
        value_mask = dim_valid[None, :]

    # Keys loaded transposed, [HEAD_DIM_PAD, BLOCK_N], so the score product needs no transpose.
    key_offsets = (
        blocks[None, :] * stride_key_block + slots[None, :] * stride_key_slot + kv_head * stride_key_head
    )
    key = tl.load(key_cache_ptr + key_offsets + dims[:, None], mask=key_mask, other=0.0)
    if DOT_IN_FP32:
        query = query.to(tl.float32)
        key = key.to(tl.float32)
    scores = tl.dot(query, key, input_precision=DOT_PRECISION) * scale_log2
    if CAUSAL or WINDOW:
        visible = key_positions[None, :] <= query_positions[:, None]
        if WINDOW:
            visible = visible & (key_positions[None, :] > query_positions[:, None] - window)
        if MASK_KEYS:
            visible = visible & key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    elif MASK_KEYS:
        scores = tl.where(key_valid[None, :], scores, float("-inf"))

    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    if WINDOW:
        # A row that has seen no key yet: subtract 0, so its probabilities are exp2(-inf) = 0
        # and its correction 0, not the NaN of -inf - -inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    else:
        shift = new_max
    probs = tl.exp2(scores - shift[:, None])
    correction = tl.exp2(row_max - shift)
    row_sum = row_sum * correction + tl.sum(probs, axis=1)

    value_offsets = (
        blocks[:, None] * stride_value_block
        + slots[:, None] * stride_value_slot
        + kv_head * stride_value_head
    )
    value = tl.load(value_cache_ptr + value_offsets + dims[None, :], mask=value_mask, other=0.0)
    probs = probs.to(value.dtype)
    if DOT_IN_FP32:
        probs = probs.to(tl.float32)
        value = value.to(tl.float32)
    acc = acc * correction[:, None] + tl.dot(probs, value, input_precision=DOT_PRECISION)
    return acc, row_sum, new_max
