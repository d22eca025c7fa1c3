"""Turns a scheduled batch into the model's flat inputs, runs it, returns the logits to sample.

On a GPU a pure decode step replays a captured CUDA graph (`cuda_graphs`) once
`capture_decode_graphs` has run; every other step runs the model eagerly.

In a tensor-parallel world the leader's runner broadcasts each step's inputs before running
them, and every other rank's runner runs exactly those (`rank.follow`): the same forward, in
the same order, so the collectives inside it pair up.
"""

from __future__ import annotations

import numpy as np
import torch

from berth.engine.models.parallel import SINGLE, TensorParallelGroup
from berth.engine.pyexecutor import step_inputs
from berth.engine.pyexecutor.cuda_graphs import DecodeGraphs
from berth.engine.pyexecutor.kv_cache import KVCacheManager
from berth.engine.pyexecutor.sequence import Sequence
from berth.engine.pyexecutor.step_inputs import StepInputs


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCacheManager,
        device: torch.device,
        tp: TensorParallelGroup = SINGLE,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.tp = tp
        self.decode_graphs: DecodeGraphs | None = None

    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Runs one step. Returns logits [R, V] for the sequences whose every known token is now
        computed (they sample their next token), and those sequences, in row order."""
        inputs, samplers = self.prepare(scheduled)
        return self.forward(inputs), samplers

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The forward pass of prepared inputs, on every rank (rank 0 sends them to the others)."""
        if self.tp.size > 1:
            step_inputs.broadcast(self.tp, inputs)
        return self.run(inputs)

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The forward pass of one step; logits on rank 0, None on the other ranks."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_replay(inputs):
            return graphs.replay(inputs)
        input_ids, positions, metadata, logits_indices = inputs.on(self.device)
        return self.model(input_ids, positions, self.kv_cache.kv_caches, metadata, logits_indices)

    def use_decode_graphs(self, graphs: DecodeGraphs | None) -> None:
        """Replays `graphs` for pure decode steps from now on (None: every step runs eagerly)."""
        if self.decode_graphs is not None:
            self.decode_graphs.release()
        self.decode_graphs = graphs

    def capture_decode_graphs(self) -> None:
        """(Re)captures the decode graphs against the model and KV cache held now: after the
        engine is built, and after every wakeup (new addresses). No-op without graphs."""
        if self.decode_graphs is not None:
            self.decode_graphs.capture()

    def release_decode_graphs(self) -> None:
        """Frees the graphs and what they captured (a sleep); `capture_decode_graphs` again
        before the next replay."""
        if self.decode_graphs is not None:
            self.decode_graphs.release()

    def stop_followers(self) -> None:
        """Rank 0, once its loop has ended in order: every other rank leaves its loop too."""
        if self.tp.size > 1:
            step_inputs.broadcast_stop(self.tp)

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> tuple[StepInputs, list[Sequence]]:
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
        samplers: list[Sequence] = []
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

        inputs = StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.from_numpy(block_tables),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            num_prefills=num_prefills,
            max_query_len=max((n for _, n in batch[:num_prefills]), default=1),
            max_seq_len=max(seq_lens),
        )
        return inputs, samplers
