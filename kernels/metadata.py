"""What the attention kernels need to know about one step's flat batch of tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Describes a flat batch of new tokens from many sequences over a paged KV cache.

    Sequences `[0, num_prefills)` may have any number of new tokens (a whole prompt or a chunk
    of one whose start is already cached); sequences `[num_prefills, B)` are decodes with
    exactly one new token each. New tokens of sequence `i` are `query[query_start_loc[i] :
    query_start_loc[i + 1]]`; they are the last tokens of that sequence, whose total length
    (cached prefix + new tokens, already written to the cache) is `seq_lens[i]`.
    """

    query_start_loc: torch.Tensor  # int32 [B + 1], on the device
    seq_lens: torch.Tensor  # int32 [B], on the device
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], on the device
    slot_mapping: torch.Tensor  # int64 [T]: flat cache slot (block * block_size + offset) per new token
    num_prefills: int
    num_prefill_tokens: int
    max_query_len: int  # over the prefill sequences (1 when there are none)
    max_seq_len: int
    # Tensors derived from the above, computed once per step and shared by every layer.
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills
