"""The Triton attention kernels against the torch reference `paged_attention`.

Every batch comes from `random_paged_batch`: blocks scattered over the cache, NaN in every
slot no sequence owns, so reading past a sequence's end or through block-table padding fails.
"""

from __future__ import annotations

import pytest
import torch

from berth.kernels import reference
from berth.kernels.synthetic_batch import random_paged_batch

# (cached tokens, new tokens) per sequence, and how many of them (the first ones) are prefills.
BATCHES = {
    "prefills": ([(0, 1), (0, 17), (0, 45), (0, 130)], 4),
    "short_and_long": ([(0, 150), (0, 1), (0, 2), (0, 3), (0, 1), (190, 1), (1, 1)], 4),
    "chunked_prefill": ([(37, 20), (64, 33), (100, 1), (5, 60)], 4),
    "prefills_and_decodes": ([(0, 23), (40, 9), (0, 1), (14, 1), (32, 1), (250, 1)], 2),
    "decodes": ([(0, 1), (15, 1), (16, 1), (95, 1), (300, 1)], 0),
}
HEAD_AND_BLOCK_SIZES = [(64, 16), (64, 32), (128, 16), (128, 32)]


def attend(implementation, batch, scale: float) -> torch.Tensor:
    return implementation.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "block_size"), HEAD_AND_BLOCK_SIZES)
@pytest.mark.parametrize("batch_name", list(BATCHES))
def test_paged_attention(triton_ops, assert_matches, device, dtype, head_dim, block_size, batch_name):
    seqs, num_prefills = BATCHES[batch_name]
    batch = random_paged_batch(seqs, num_prefills, 8, 2, head_dim, block_size, dtype, device, seed=head_dim)
    scale = head_dim**-0.5
    actual = attend(triton_ops, batch, scale)
    assert_matches(actual, attend(reference, batch, scale), "attention")


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (6, 2, 80), (8, 1, 64), (32, 8, 128)]
)
def test_paged_attention_head_groups(triton_ops, assert_matches, device, num_q_heads, num_kv_heads, head_dim):
    """Plain multi-head; a group of 3 with a head size that is no power of two; multi-query;
    Llama-3-8B's 32:8 heads of 128."""
    seqs, num_prefills = BATCHES["prefills_and_decodes"]
    batch = random_paged_batch(
        seqs, num_prefills, num_q_heads, num_kv_heads, head_dim, 16, device=device, seed=3
    )
    scale = head_dim**-0.5
    assert_matches(attend(triton_ops, batch, scale), attend(reference, batch, scale), "attention")


def test_paged_attention_strided_query(triton_ops, assert_matches, device):
    """The query as a view into a fused QKV output: rows strided, heads contiguous."""
    seqs, num_prefills = BATCHES["prefills_and_decodes"]
    batch = random_paged_batch(seqs, num_prefills, 8, 2, 64, 16, device=device, seed=4)
    fused = torch.zeros(batch.query.shape[0], 12, 64, device=device)
    fused[:, :8] = batch.query
    query = fused[:, :8]
    assert not query.is_contiguous()
    expected = attend(reference, batch, 0.125)
    actual = triton_ops.paged_attention(query, batch.key_cache, batch.value_cache, batch.metadata, 0.125)
    assert_matches(actual, expected, "attention")


@pytest.mark.parametrize("window", [1, 7, 40, 100])
@pytest.mark.parametrize("batch_name", ["prefills", "chunked_prefill", "prefills_and_decodes"])
def test_paged_attention_in_a_sliding_window(triton_ops, assert_matches, device, window, batch_name):
    """Every tile masked by the window's edge as well as the causal one; rows of a query block
    that see no key of a tile stay finite."""
    seqs, num_prefills = BATCHES[batch_name]
    batch = random_paged_batch(seqs, num_prefills, 8, 2, 64, 16, device=device, seed=8)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata, 0.125, window)
    assert_matches(triton_ops.paged_attention(*args), reference.paged_attention(*args), "attention")


@pytest.mark.parametrize("window", [1, 64, 100])
def test_decode_segments_before_the_window_weigh_nothing(triton_ops, assert_matches, device, window):
    """Split decoding with a window: segments wholly before it (a -inf maximum) drop out of the merge."""
    from berth.kernels.triton_kernels.attention_decode import decode_attention

    seqs = [(0, 1), (63, 1), (130, 1), (299, 1)]
    batch = random_paged_batch(seqs, 0, 8, 2, 64, 16, device=device, seed=9)
    md = batch.metadata
    out = torch.full_like(batch.query, float("nan"))
    decode_attention(
        out, batch.query, batch.key_cache, batch.value_cache, md.query_start_loc, md.seq_lens,
        md.block_tables, md.max_seq_len, 0.125, segment_len=64, window=window,
    )  # fmt: skip
    expected = reference.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, 0.125, window)
    assert_matches(out, expected, "attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_split_into_segments(triton_ops, assert_matches, device, dtype, head_dim):
    """Flash-decoding's merge: 64-token segments, sequences using 1 to 5 of them."""
    from berth.kernels.triton_kernels.attention_decode import decode_attention

    seqs = [(0, 1), (63, 1), (64, 1), (130, 1), (299, 1)]
    batch = random_paged_batch(seqs, 0, 8, 2, head_dim, 16, dtype, device, seed=5)
    md = batch.metadata
    out = torch.full_like(batch.query, float("nan"))
    decode_attention(
        out, batch.query, batch.key_cache, batch.value_cache, md.query_start_loc, md.seq_lens,
        md.block_tables, md.max_seq_len, head_dim**-0.5, segment_len=64,
    )  # fmt: skip
    assert_matches(out, attend(reference, batch, head_dim**-0.5), "attention")


def test_decode_segment_policy_through_the_interface(triton_ops, assert_matches, device, monkeypatch):
    """The automatic split (shorter minimum segment so small contexts split) gives the same result."""
    from berth.kernels.triton_kernels import attention_decode

    monkeypatch.setattr(attention_decode, "MIN_SEGMENT_TOKENS", 64)
    seqs = [(40, 1), (300, 1), (1, 1)]
    batch = random_paged_batch(seqs, 0, 4, 1, 64, 16, device=device, seed=6)
    segment_len = attention_decode._segment_len(3, batch.metadata.max_seq_len, 64, torch.device(device))
    assert segment_len < batch.metadata.max_seq_len  # the policy really splits here
    assert_matches(attend(triton_ops, batch, 0.125), attend(reference, batch, 0.125), "attention")


def test_segment_policy():
    from berth.kernels.triton_kernels.attention_decode import MIN_SEGMENT_TOKENS, _segment_len

    cpu = torch.device("cpu")
    assert _segment_len(1, 100, 64, cpu) == 128  # short context: one segment
    assert _segment_len(64 * 8, 16384, 64, cpu) == 16384  # a batch that fills the device alone
    many = _segment_len(8, 16384, 64, cpu)
    assert MIN_SEGMENT_TOKENS <= many < 16384 and many % 64 == 0
