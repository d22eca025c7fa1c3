"""The torch reference against the plain formulas it stands for (no Triton involved)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from berth.kernels import reference
from berth.kernels.rope import rope_cos_sin_cache
from berth.kernels.synthetic_batch import random_paged_batch

ATOL = RTOL = 1e-5


@pytest.mark.parametrize(
    ("seqs", "num_prefills"),
    [
        ([(0, 1), (0, 17), (0, 45)], 3),
        ([(37, 20), (64, 33), (100, 1)], 3),  # chunked prefills over a cached prefix
        ([(0, 23), (40, 9), (0, 1), (14, 1), (250, 1)], 2),  # prefills and decodes
    ],
    ids=["prefills", "chunked_prefill", "prefills_and_decodes"],
)
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "block_size"), [(8, 2, 64, 16), (4, 4, 128, 32)]
)
def test_paged_attention_is_dense_causal_attention(
    seqs, num_prefills, num_q_heads, num_kv_heads, head_dim, block_size
):
    """Per sequence: full causal SDPA over all its tokens; the new tokens' rows must match."""
    batch = random_paged_batch(seqs, num_prefills, num_q_heads, num_kv_heads, head_dim, block_size, seed=7)
    generator = torch.Generator().manual_seed(8)
    full_queries = [
        torch.randn(cached + new, num_q_heads, head_dim, generator=generator) for cached, new in seqs
    ]
    query = torch.cat([q[cached:] for q, (cached, _) in zip(full_queries, seqs)])
    scale = head_dim**-0.5
    paged = reference.paged_attention(query, batch.key_cache, batch.value_cache, batch.metadata, scale)

    group = num_q_heads // num_kv_heads
    start = 0
    for seq, (cached, new) in enumerate(seqs):
        keys, values = batch.dense_kv(seq)  # [S, Hk, D]
        dense = F.scaled_dot_product_attention(
            full_queries[seq].transpose(0, 1),  # [Hq, S, D]
            keys.repeat_interleave(group, dim=1).transpose(0, 1),
            values.repeat_interleave(group, dim=1).transpose(0, 1),
            is_causal=True,
            scale=scale,
        ).transpose(0, 1)
        torch.testing.assert_close(paged[start : start + new], dense[cached:], atol=ATOL, rtol=RTOL)
        start += new


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_a_sliding_window_sees_the_last_window_positions(window):
    """Transformers' sliding window: the token at position p sees keys (p - window, p] only
    (`sliding_window_overlay`), for prompts, chunks over a cached prefix and decodes alike."""
    seqs, num_prefills = [(0, 23), (37, 20), (0, 1), (14, 1), (250, 1)], 2
    batch = random_paged_batch(seqs, num_prefills, 8, 2, 64, 16, seed=7)
    scale = 0.125
    paged = reference.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale, window
    )
    start = 0
    for seq, (cached, new) in enumerate(seqs):
        keys, values = batch.dense_kv(seq)  # [S, Hk, D]
        query_positions = torch.arange(cached, cached + new)[:, None]
        key_positions = torch.arange(cached + new)[None]
        mask = (key_positions <= query_positions) & (key_positions > query_positions - window)
        dense = F.scaled_dot_product_attention(
            batch.query[start : start + new].transpose(0, 1),  # [Hq, new, D]
            keys.repeat_interleave(4, dim=1).transpose(0, 1),
            values.repeat_interleave(4, dim=1).transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        ).transpose(0, 1)
        torch.testing.assert_close(paged[start : start + new], dense, atol=ATOL, rtol=RTOL)
        start += new


def test_rms_norm_formula():
    x, residual, weight = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    summed = x + residual
    expected = summed / torch.sqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    out, new_residual = reference.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(new_residual, summed)
    torch.testing.assert_close(reference.rms_norm(summed, weight, 1e-6), expected, atol=ATOL, rtol=RTOL)


def test_silu_and_mul_formula():
    x = torch.randn(7, 2 * 48)
    gate, up = x[:, :48], x[:, 48:]
    torch.testing.assert_close(reference.silu_and_mul(x), gate / (1 + torch.exp(-gate)) * up)


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_embedding_is_hf_rotate_half(rotary_dim):
    """HF Llama: q * cos + rotate_half(q) * sin, on the first `rotary_dim` dims (the rest passes)."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        first, second = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-second, first), dim=-1)

    positions = torch.tensor([0, 5, 1, 99, 42])
    query, key = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angles = positions[:, None].float() * inv_freq[None]
    emb = torch.cat((angles, angles), dim=-1)[:, None]  # [T, 1, rotary_dim]
    expected = []
    for x in (query, key):
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        expected.append(torch.cat((rot * emb.cos() + rotate_half(rot) * emb.sin(), rest), dim=-1))

    reference.rotary_embedding(positions, query, key, rope_cos_sin_cache(rotary_dim, 100, 10000.0))
    torch.testing.assert_close(query, expected[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(key, expected[1], atol=ATOL, rtol=RTOL)


def test_write_kv_cache_places_each_token_at_its_slot():
    key, value = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    key_cache, value_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    slots = torch.tensor([5, 0, 11, 3, 8, 6])
    reference.write_kv_cache(key, value, key_cache, value_cache, slots)
    for token, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, 4)
        assert torch.equal(key_cache[block, offset], key[token])
        assert torch.equal(value_cache[block, offset], value[token])
    assert int((key_cache.abs().sum((2, 3)) > 0).sum()) == 6


def test_paged_attention_ignores_garbage_past_the_sequence_end():
    """Unwritten slots (NaN in a fresh torch.empty cache) must not reach the output."""
    batch = random_paged_batch([(0, 5), (3, 1)], 1, 2, 2, 16, 16, seed=9)  # NaN fills unused slots
    out = reference.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, 0.25)
    assert not out.isnan().any()
