"""Torch implementations of the kernel interface: the CPU path and the tests' ground truth."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from berth.kernels.metadata import AttentionMetadata


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
        residual = x
    # Normalise in float32 whatever the storage dtype, as the reference models do.
    x32 = x.float()
    out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotates `query` [T, Hq, D] and `key` [T, Hk, D] in place (neox / rotate-half layout)."""
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotary_dim = cos_sin_cache.shape[-1]
    for x in (query, key):
        rot = x[..., :rotary_dim].float()
        first, second = rot.chunk(2, dim=-1)
        rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
        x[..., :rotary_dim] = rotated.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = key.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context: [T, Hq, D]."""
    md = metadata
    out = torch.empty_like(query)
    if md.num_prefills:
        _attend_padded(query, key_cache, value_cache, md, scale, 0, md.num_prefills, md.max_query_len, out)
    if md.num_decodes:
        _attend_padded(query, key_cache, value_cache, md, scale, md.num_prefills, md.num_seqs, 1, out)
    return out


def _attend_padded(query, key_cache, value_cache, md, scale, first, last, max_query_len, out) -> None:
    """Pads sequences [first, last) to a dense batch, runs SDPA with a causal + length mask."""
    block_size = key_cache.shape[1]
    starts = md.query_start_loc[first:last].long()
    query_lens = md.query_start_loc[first + 1 : last + 1].long() - starts
    seq_lens = md.seq_lens[first:last].long()
    max_seq_len = md.max_seq_len
    num_blocks = -(-max_seq_len // block_size)
    block_table = md.block_tables[first:last, :num_blocks].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        dense = cache[block_table].flatten(1, 2)[:, :max_seq_len]  # [B, S, Hk, D]
        return dense.transpose(1, 2)  # [B, Hk, S, D]

    steps = torch.arange(max_query_len, device=query.device)
    valid = steps[None] < query_lens[:, None]  # [B, Q]
    token_index = torch.where(valid, starts[:, None] + steps[None], 0)
    q = query[token_index].transpose(1, 2)  # [B, Hq, Q, D]
    query_positions = (seq_lens - query_lens)[:, None] + steps[None]  # [B, Q]
    key_positions = torch.arange(max_seq_len, device=query.device)
    mask = (key_positions[None, None] <= query_positions[:, :, None]) & (
        key_positions[None, None] < seq_lens[:, None, None]
    )
    attended = F.scaled_dot_product_attention(
        q, gather(key_cache), gather(value_cache), attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )
    out[token_index[valid]] = attended.transpose(1, 2)[valid]
