"""Turns a scheduled batch into the model's flat inputs, runs it, returns the logits to sample."""

from __future__ import annotations

import numpy as np
import torch

from berth.engine.pyexecutor.kv_cache import KVCacheManager
from berth.engine.pyexecutor.llm_request import LlmRequest
from berth.kernels import AttentionMetadata


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCacheManager, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    def execute(self, scheduled: list[tuple[LlmRequest, int]]) -> tuple[torch.Tensor, list[LlmRequest]]:
        """Runs one step. Returns logits [R, V] for the sequences whose every known token is now
        computed (they sample their next token), and those sequences, in row order."""
        # The attention kernels want multi-token sequences first, then single-token decodes.
        batch = [item for item in scheduled if item[1] > 1] + [item for item in scheduled if item[1] == 1]
        num_prefills = sum(1 for _, n in batch if n > 1)
        block_size = self.kv_cache.block_size

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        samplers: list[LlmRequest] = []
        for request, num_new in batch:
            start = request.num_computed_tokens
            end = start + num_new
            input_ids += request.token_ids[start:end]
            if num_new == 1:
                positions.append(start)
                slots.append(request.block_ids[start // block_size] * block_size + start % block_size)
            else:
                span = np.arange(start, end)
                blocks = np.asarray(request.block_ids)[span // block_size]
                positions += span.tolist()
                slots += (blocks * block_size + span % block_size).tolist()
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if end == request.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
                samplers.append(request)

        max_blocks = max(len(request.block_ids) for request, _ in batch)
        block_tables = np.zeros((len(batch), max_blocks), dtype=np.int32)
        for row, (request, _) in enumerate(batch):
            block_tables[row, : len(request.block_ids)] = request.block_ids

        def to_device(values, dtype) -> torch.Tensor:
            return torch.as_tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        metadata = AttentionMetadata(
            query_start_loc=to_device(query_start_loc, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            block_tables=to_device(block_tables, torch.int32),
            slot_mapping=to_device(slots, torch.int64),
            num_prefills=num_prefills,
            num_prefill_tokens=query_start_loc[num_prefills],
            max_query_len=max((n for _, n in batch[:num_prefills]), default=1),
            max_seq_len=max(seq_lens),
        )
        logits = self.model(
            to_device(input_ids, torch.long),
            to_device(positions, torch.long),
            self.kv_cache.kv_caches,
            metadata,
            to_device(logits_indices, torch.long),
        )
        return logits, samplers
