"""The RoPE tables of a model's layers, stacked in one float32 tensor the rotary kernels index.

Most models have one table. Gemma 3 has two, one for its global layers and one for its
sliding-window layers (another base); Phi-3's LongRoPE has two for one set of layers, the short
factors' and the long ones'. Every table sits at a row offset of one tensor [rows, rotary_dim],
and the kernels read row `offset + position`: a layer's "positions" are those rows, worked out
once a step for each kind of layer, so no kernel knows there is more than one table.

LongRoPE chooses by the length of the sequence, as transformers does: the long factors for a
sequence longer than `original_max_position_embeddings`, the short ones up to it. Here each
sequence of the step chooses for its new tokens by its own length after the step (`seq_lens`):
transformers' choice for a prompt prefilled in one step, whatever its length, and for every
token generated within the original context or after a prompt longer than it. Where they differ:
- a sequence that grows past the original context while generating: transformers' Phi-3 drops
  its cache there and recomputes every position with the long factors; berth rotates the new
  tokens with them and keeps the keys cached before, rotated with the short ones (matching it
  is the scheduler's part: recompute the sequence at the crossing, with the choice in the prefix
  cache's block keys; a sequence preempted after crossing is recomputed with the long factors);
- a prompt past the original context whose first prefill chunks end within it: those chunks
  take the short factors (transformers sees the whole prompt at once);
- the prefix cache may give a prompt past the original context blocks another prompt wrote with
  the short factors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from berth import kernels
from berth.engine.models.config import ModelConfig
from berth.kernels import AttentionMetadata


@dataclass(frozen=True)
class _Kind:
    """Where one kind of layer's table starts: `short` for every token, or with LongRoPE, `short`
    for tokens of sequences no longer than `original` and `long` for the others."""

    short: int
    long: int
    original: int | None = None


class RotaryTables:
    def __init__(self, config: ModelConfig, windowed: list[bool]) -> None:
        """`windowed[layer]`: whether the layer has a sliding window (which picks the local RoPE
        where the config has one)."""
        c = config
        tables: list[torch.Tensor] = []
        kinds: dict[str, int] = {}
        self.kinds: list[_Kind] = []
        self.layer_kinds: list[int] = []
        for layer_windowed in windowed:
            local = layer_windowed and c.local_rope_theta is not None
            theta, scaling = (
                (c.local_rope_theta, c.local_rope_scaling) if local else (c.rope_theta, c.rope_scaling)
            )
            key = json.dumps([theta, scaling], sort_keys=True)
            if key not in kinds:
                kinds[key] = len(self.kinds)
                self.kinds.append(self._add(tables, c, theta, scaling))
            self.layer_kinds.append(kinds[key])
        self.table = torch.cat(tables) if len(tables) > 1 else tables[0]

    @staticmethod
    def _add(tables: list[torch.Tensor], c: ModelConfig, theta: float, scaling: dict | None) -> _Kind:
        start = sum(len(table) for table in tables)
        if (scaling or {}).get("rope_type") != "longrope":
            tables.append(kernels.rope_cos_sin_cache(c.rotary_dim, c.max_position_embeddings, theta, scaling))
            return _Kind(start, start)
        original = scaling["original_max_position_embeddings"]
        # The short factors serve only sequences within the original context.
        tables.append(kernels.rope_cos_sin_cache(c.rotary_dim, original, theta, scaling))
        tables.append(
            kernels.rope_cos_sin_cache(c.rotary_dim, c.max_position_embeddings, theta, scaling, long=True)
        )
        return _Kind(start, start + original, original)

    @property
    def is_plain(self) -> bool:
        """One table, read at the positions themselves."""
        return len(self.kinds) == 1 and self.kinds[0] == _Kind(0, 0)

    def rows(self, positions: torch.Tensor, metadata: AttentionMetadata) -> list[torch.Tensor]:
        """For each kind of layer, the table row of each new token (int64, like `positions`).
        Device ops only, no host sync: a captured decode graph replays them."""
        rows = []
        seq_lens = None
        for kind in self.kinds:
            if kind.original is None:
                rows.append(positions if kind.short == 0 else positions + kind.short)
                continue
            if seq_lens is None:
                seq_lens = _token_seq_lens(positions, metadata)
            rows.append(positions + torch.where(seq_lens > kind.original, kind.long, kind.short))
        return rows


def _token_seq_lens(positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """The length (after this step) of each new token's sequence."""
    ends = metadata.query_start_loc[1:]
    tokens = torch.arange(positions.numel(), dtype=ends.dtype, device=positions.device)
    sequence = torch.searchsorted(ends, tokens, right=True).clamp_(max=max(metadata.num_seqs - 1, 0))
    return metadata.seq_lens[sequence]
