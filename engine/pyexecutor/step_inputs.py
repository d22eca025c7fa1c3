"""One step's model inputs: what the leader builds from its schedule and every rank runs.

In a tensor-parallel world only rank 0 schedules: the other ranks hold weights and a KV cache
but no request state. Before every forward rank 0 broadcasts that step's inputs (token ids,
positions, KV slots, block tables, the rows whose logits are sampled) as two flat int64 tensors:
a fixed-size header, then the data it describes. Nothing is pickled per step. New requests and
aborts need no message of their own (a request reaches a follower as rows of the batches it is
in; an aborted one leaves them), and the ids rank 0 samples reach every rank as the next step's
input tokens, which is all a follower ever does with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from berth.engine.models.parallel import TensorParallelGroup
from berth.kernels import AttentionMetadata

# header[0]: what the followers do next
STOP, RUN, MEMORY, KV_READ, KV_WRITE = 0, 1, 2, 3, 4
# header: command, tokens, sequences, prefills, block-table width, logit rows, max query len, max seq len
HEADER_SIZE = 8


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max blocks]
    logits_indices: torch.Tensor  # int64 [R]: the token rows whose logits are sampled
    num_prefills: int
    max_query_len: int
    max_seq_len: int

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input ids, positions, attention metadata, logits indices) on `device`."""

        def moved(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device, non_blocking=True)

        metadata = AttentionMetadata(
            query_start_loc=moved(self.query_start_loc),
            seq_lens=moved(self.seq_lens),
            block_tables=moved(self.block_tables),
            slot_mapping=moved(self.slot_mapping),
            num_prefills=self.num_prefills,
            num_prefill_tokens=int(self.query_start_loc[self.num_prefills]),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
        )
        return moved(self.input_ids), moved(self.positions), metadata, moved(self.logits_indices)


@dataclass
class KVRead:
    """Every rank: gather your slice of these KV slots to rank 0 (`kv_slices`)."""

    slots: torch.Tensor  # int64 [T]


@dataclass
class KVWrite:
    """Every rank: write your slice of `data` (every KV head of the model) into these KV slots."""

    slots: torch.Tensor  # int64 [T]
    data: torch.Tensor  # uint8: [layer][key|value][token][kv head][dim] in the cache's dtype


def broadcast(group: TensorParallelGroup, inputs: StepInputs) -> None:
    """Rank 0: sends the step to every other rank (which is waiting in `receive`)."""
    num_seqs, max_blocks = inputs.block_tables.shape
    header = torch.tensor(
        [
            RUN,
            inputs.input_ids.numel(),
            num_seqs,
            inputs.num_prefills,
            max_blocks,
            inputs.logits_indices.numel(),
            inputs.max_query_len,
            inputs.max_seq_len,
        ],
        dtype=torch.int64,
    )
    group.broadcast_from_leader(header)
    parts = (
        inputs.input_ids,
        inputs.positions,
        inputs.slot_mapping,
        inputs.query_start_loc,
        inputs.seq_lens,
        inputs.block_tables.flatten(),
        inputs.logits_indices,
    )
    group.broadcast_from_leader(torch.cat([part.to(torch.int64) for part in parts]))


def broadcast_stop(group: TensorParallelGroup) -> None:
    """Rank 0: tells every other rank that no step follows (an ordered shutdown)."""
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[0] = STOP
    group.broadcast_from_leader(header)


def broadcast_memory_action(group: TensorParallelGroup, action: object) -> None:
    """Rank 0, between steps: every other rank runs `action` next (a `sleep.MemoryAction`: plain
    data, pickled, as a sleep or a wakeup is rare)."""
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[0] = MEMORY
    group.broadcast_from_leader(header)
    group.broadcast_object_from_leader(action)


def broadcast_kv_read(group: TensorParallelGroup, slots: torch.Tensor) -> None:
    """Rank 0, between steps: every other rank gathers its slice of `slots` to rank 0 next."""
    group.broadcast_from_leader(_header(KV_READ, slots.numel()))
    group.broadcast_from_leader(slots.to(torch.int64))


def broadcast_kv_write(group: TensorParallelGroup, slots: torch.Tensor, data: torch.Tensor) -> None:
    """Rank 0, between steps: every other rank writes its slice of `data` (uint8) into `slots`."""
    group.broadcast_from_leader(_header(KV_WRITE, slots.numel(), data.numel()))
    padded = torch.zeros(-(-data.numel() // 8) * 8, dtype=torch.uint8)  # whole int64s
    padded[: data.numel()] = data
    group.broadcast_from_leader(torch.cat([slots.to(torch.int64), padded.view(torch.int64)]))


def _header(command: int, *values: int) -> torch.Tensor:
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[0] = command
    header[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return header


def receive(group: TensorParallelGroup) -> StepInputs | KVRead | KVWrite | object | None:
    """Every rank but 0: the next step, a KV read or write, a memory action, or None when rank 0
    stops the world."""
    header = torch.empty(HEADER_SIZE, dtype=torch.int64)
    group.broadcast_from_leader(header)
    command, tokens, seqs, prefills, max_blocks, rows, max_query_len, max_seq_len = header.tolist()
    if command == STOP:
        return None
    if command == MEMORY:
        return group.broadcast_object_from_leader()
    if command in (KV_READ, KV_WRITE):
        num_slots, num_bytes = tokens, seqs
        data = torch.empty(num_slots + -(-num_bytes // 8), dtype=torch.int64)
        group.broadcast_from_leader(data)
        if command == KV_READ:
            return KVRead(data)
        return KVWrite(data[:num_slots], data[num_slots:].view(torch.uint8)[:num_bytes])
    if command != RUN:
        raise RuntimeError(f"unknown step command {command} from rank 0")
    sizes = [tokens, tokens, tokens, seqs + 1, seqs, seqs * max_blocks, rows]
    data = torch.empty(sum(sizes), dtype=torch.int64)
    group.broadcast_from_leader(data)
    input_ids, positions, slots, starts, seq_lens, tables, logits_indices = data.split(sizes)
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        query_start_loc=starts.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_tables=tables.to(torch.int32).view(seqs, max_blocks),
        logits_indices=logits_indices,
        num_prefills=prefills,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
    )
