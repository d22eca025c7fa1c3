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
    padding = slot_mapping < 0
    if padding.any():  # a captured decode graph's spare rows: nothing is written for them
        keep = ~padding
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context: [T, Hq, D]. With
    a `window`, the token at position p sees positions (p - window, p] only (transformers'
    sliding window: itself and the window - 1 before it)."""
    md = metadata
    out = torch.empty_like(query)
    if md.num_prefills:
        _attend_prefills(query, key_cache, value_cache, md, scale, out, window)
    if md.num_decodes:
        _attend_decodes(query, key_cache, value_cache, md, scale, out, window)
    return out


def _context_slots(md: AttentionMetadata, rows: slice, max_seq_len: int, block_size: int) -> torch.Tensor:
    """The cache slot of every context position of sequences `rows`: [B, S], int64.

    Positions past a sequence's end point at its position 0 (always written), so a gather
    never reads stale or never-written slots (NaN in a fresh `torch.empty` cache): a masked-out
    score still multiplies its value, and 0 * NaN is NaN.
    """
    key = ("slots", rows.start, rows.stop, max_seq_len, block_size)
    if key not in md.derived:
        seq_lens = md.seq_lens[rows].long()
        positions = torch.arange(max_seq_len, device=seq_lens.device)[None]
        positions = torch.where(positions < seq_lens[:, None], positions, 0)
        blocks = md.block_tables[rows].long().gather(1, positions // block_size)
        md.derived[key] = blocks * block_size + positions % block_size
    return md.derived[key]


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cached tokens at `slots` [B, S] as a dense [B, Hk, S, D] tensor."""
    flat = cache.view(-1, *cache.shape[2:])
    # index_select is several times faster on CPU than advanced indexing.
    return flat.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[2:]).transpose(1, 2)


def _attend_decodes(query, key_cache, value_cache, md, scale, out, window) -> None:
    """One query token per sequence: a dense batch with a length mask."""
    first = md.num_prefills
    tokens = slice(md.num_prefill_tokens, md.num_prefill_tokens + md.num_decodes)
    rows = slice(first, md.num_seqs)
    max_seq_len = md.max_seq_len
    slots = _context_slots(md, rows, max_seq_len, key_cache.shape[1])
    key = ("decode_mask", window)  # layers of one step may have different windows
    if key not in md.derived:
        seq_lens = md.seq_lens[rows].long()
        positions = torch.arange(max_seq_len, device=query.device)[None]
        mask = positions < seq_lens[:, None]
        if window is not None:
            mask &= positions >= seq_lens[:, None] - window
        md.derived[key] = mask
    mask = md.derived[key]  # [B, S]
    attended = F.scaled_dot_product_attention(
        query[tokens].unsqueeze(2),  # [B, Hq, 1, D]
        _gather(key_cache, slots),
        _gather(value_cache, slots),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    out[tokens] = attended.squeeze(2)


def _attend_prefills(query, key_cache, value_cache, md, scale, out, window) -> None:
    """Several query tokens per sequence: pad queries and keys, mask causally and by length."""
    last = md.num_prefills
    starts = md.query_start_loc[:last].long()
    query_lens = md.query_start_loc[1 : last + 1].long() - starts
    seq_lens = md.seq_lens[:last].long()
    max_seq_len = max(int(seq_lens.max()), 1)
    steps = torch.arange(md.max_query_len, device=query.device)
    valid = steps[None] < query_lens[:, None]  # [B, Q]
    token_index = torch.where(valid, starts[:, None] + steps[None], 0)
    query_positions = (seq_lens - query_lens)[:, None] + steps[None]  # [B, Q]
    key_positions = torch.arange(max_seq_len, device=query.device)
    mask = (key_positions[None, None] <= query_positions[:, :, None]) & (
        key_positions[None, None] < seq_lens[:, None, None]
    )
    if window is not None:
        mask &= key_positions[None, None] > query_positions[:, :, None] - window
    slots = _context_slots(md, slice(0, last), max_seq_len, key_cache.shape[1])
    attended = F.scaled_dot_product_attention(
        query[token_index].transpose(1, 2),  # [B, Hq, Q, D]
        _gather(key_cache, slots),
        _gather(value_cache, slots),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )
    out[token_index[valid]] = attended.transpose(1, 2)[valid]


def pack_linear_weight(weight: torch.Tensor) -> None:
    """The weight is used as it is."""
    return None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    return F.linear(x, weight, bias)
