"""A request's keys and values as the whole model's KV heads, read from and written into the
slices the ranks of a tensor-parallel world hold (disaggregated prefill and decode).

Each rank caches only its KV heads (`parallel.attention_shard`: a contiguous slice, or, with
fewer KV heads than ranks, one head replicated on consecutive ranks). What crosses between
engines is always every head of the model, so the two sides may split them differently (TP 1
on one, TP 2 on the other): rank 0 gathers the slices into the whole on the context side, and
on the generation side every rank takes its own slice of the whole rank 0 broadcasts.

Only rank 0 decides when (in its loop's turn, between steps): it broadcasts the command and
the KV slots, and every other rank, waiting for its next step (`rank.follow`), runs its part
at once. So every rank runs the same sequence of collectives, which is what keeps them paired.
"""

from __future__ import annotations

import numpy as np
import torch

from berth.engine.models.parallel import AttentionShard, attention_shard
from berth.engine.pyexecutor import step_inputs
from berth.engine.pyexecutor.model_runner import ModelRunner
from berth.engine.pyexecutor.step_inputs import KVRead, KVWrite


def slots_of(block_ids: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """The cache slots of a sequence's first `num_tokens` tokens."""
    positions = np.arange(num_tokens)
    blocks = np.asarray(block_ids, dtype=np.int64)[positions // block_size]
    return torch.from_numpy(blocks * block_size + positions % block_size)


def shards(runner: ModelRunner) -> list[AttentionShard]:
    """Every rank's attention heads, by rank."""
    config, size = runner.model.config, runner.tp.size
    return [attention_shard(config.num_heads, config.num_kv_heads, rank, size) for rank in range(size)]


def whole_heads(parts: list[torch.Tensor], by_rank: list[AttentionShard]) -> torch.Tensor:
    """The model's KV heads from every rank's slice [..., heads, dim] (a head replicated on
    several ranks is taken once, from the first)."""
    taken: list[torch.Tensor] = []
    next_head = 0
    for part, shard in zip(parts, by_rank):
        if shard.first_kv_head == next_head:
            taken.append(part)
            next_head += shard.num_kv_heads
    return torch.cat(taken, dim=-2)


def rank_slice(whole: torch.Tensor, shard: AttentionShard) -> torch.Tensor:
    """This rank's heads of the whole model's [..., heads, dim]."""
    return whole[..., shard.first_kv_head : shard.first_kv_head + shard.num_kv_heads, :]


def read(runner: ModelRunner, slots: torch.Tensor) -> torch.Tensor:
    """Rank 0: the keys and values in `slots`, every head of the model, on the CPU:
    [layer][key|value][token][kv head][dim]."""
    if runner.tp.size > 1:
        step_inputs.broadcast_kv_read(runner.tp, slots)
    parts = _gather_slices(runner, slots)
    return whole_heads([part.cpu() for part in parts], shards(runner))


def write(runner: ModelRunner, slots: torch.Tensor, whole: torch.Tensor) -> None:
    """Rank 0: writes `whole` (every head of the model, any dtype) into `slots` on every rank."""
    kv = runner.kv_cache
    whole = whole.to(kv.dtype).contiguous()
    if runner.tp.size > 1:
        step_inputs.broadcast_kv_write(runner.tp, slots, whole.view(torch.uint8).flatten())
    _write_slice(runner, slots, whole)


def follow(runner: ModelRunner, command: KVRead | KVWrite) -> None:
    """A rank other than 0: its part of the read or write rank 0 broadcast."""
    if isinstance(command, KVRead):
        _gather_slices(runner, command.slots)
        return
    kv, config = runner.kv_cache, runner.model.config
    shape = (kv.shape[0], 2, command.slots.numel(), config.num_kv_heads, kv.shape[5])
    _write_slice(runner, command.slots, command.data.view(kv.dtype).view(shape))


def _gather_slices(runner: ModelRunner, slots: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's slice of `slots` to rank 0 (by rank); None on the other ranks."""
    kv = runner.kv_cache
    layers, _, _, _, heads, dim = kv.shape
    flat = kv.kv_caches.view(layers, 2, -1, heads, dim)
    mine = flat[:, :, slots.to(flat.device)].contiguous()
    return runner.tp.gather_list_to_leader(mine)


def _write_slice(runner: ModelRunner, slots: torch.Tensor, whole: torch.Tensor) -> None:
    kv = runner.kv_cache
    layers, _, _, _, heads, dim = kv.shape
    flat = kv.kv_caches.view(layers, 2, -1, heads, dim)
    flat[:, :, slots.to(flat.device)] = rank_slice(whole, shards(runner)[runner.tp.rank]).to(flat.device)
