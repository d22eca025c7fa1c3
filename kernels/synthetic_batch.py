"""Random paged-KV batches for checking and timing the attention kernels (tests, `gpu_check`).

A batch is laid out the way the engine lays it out: prefills first, decodes after, each
sequence's blocks scattered over the cache in random order. Every cache slot that no sequence
owns holds NaN, so a kernel that reads past a sequence's end, or through a padding entry of the
block table, poisons its output instead of passing by luck.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from berth.kernels.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D], the new tokens of every sequence
    key_cache: torch.Tensor  # [num_blocks, block_size, Hk, D]
    value_cache: torch.Tensor
    metadata: AttentionMetadata

    def slots(self, seq: int) -> torch.Tensor:
        """Flat cache slots of sequence `seq`'s tokens, positions 0 .. seq_len - 1."""
        block_size = self.key_cache.shape[1]
        positions = torch.arange(int(self.metadata.seq_lens[seq]), device=self.query.device)
        blocks = self.metadata.block_tables[seq].long()[positions // block_size]
        return blocks * block_size + positions % block_size

    def dense_kv(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence `seq`'s keys and values, [seq_len, Hk, D] each, read slot by slot."""
        slots = self.slots(seq)
        flat_shape = (-1, *self.key_cache.shape[2:])
        return self.key_cache.view(flat_shape)[slots], self.value_cache.view(flat_shape)[slots]


def random_paged_batch(
    seqs: Sequence[tuple[int, int]],
    num_prefills: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """`seqs` lists (cached tokens, new tokens) per sequence; the first `num_prefills` are prefills.

    Decodes must have exactly one new token. Keys and values of all tokens, cached and new, are
    already in the cache, as the attention kernels expect.
    """
    if any(new != 1 for _, new in seqs[num_prefills:]):
        raise ValueError("decode sequences have exactly one new token")
    if any(new < 1 or cached < 0 for cached, new in seqs):
        raise ValueError("every sequence needs at least one new token and a non-negative cached length")
    generator = torch.Generator(device=device).manual_seed(seed)
    seq_lens = [cached + new for cached, new in seqs]
    query_lens = [new for _, new in seqs]
    blocks_per_seq = [-(-seq_len // block_size) for seq_len in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 2  # two blocks nobody owns
    order = torch.randperm(num_blocks, generator=generator, device=device).to(torch.int32)
    # Padding entries point at real (NaN-filled or foreign) blocks: only masking keeps them out.
    block_tables = order[
        torch.randint(0, num_blocks, (len(seqs), max_blocks), generator=generator, device=device)
    ]
    next_block = 0
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = order[next_block : next_block + count]
        next_block += count

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32, device=device)
    query_start_loc[1:] = torch.tensor(query_lens, device=device).cumsum(0)
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables,
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        num_prefills=num_prefills,
        num_prefill_tokens=sum(query_lens[:num_prefills]),
        max_query_len=max(query_lens[:num_prefills], default=1),
        max_seq_len=max(seq_lens),
    )
    batch = PagedBatch(
        query=torch.randn(sum(query_lens), num_q_heads, head_dim, generator=generator, device=device).to(
            dtype
        ),
        key_cache=key_cache,
        value_cache=value_cache,
        metadata=metadata,
    )
    new_slots = []
    flat_shape = (-1, num_kv_heads, head_dim)
    for seq, (_, new) in enumerate(seqs):
        slots = batch.slots(seq)
        kv_shape = (slots.numel(), num_kv_heads, head_dim)
        for cache in (key_cache, value_cache):
            cache.view(flat_shape)[slots] = torch.randn(kv_shape, generator=generator, device=device).to(
                dtype
            )
        new_slots.append(slots[slots.numel() - new :])
    metadata.slot_mapping = torch.cat(new_slots)
    return batch
