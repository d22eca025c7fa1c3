"""The paged KV cache: a pool of fixed-size blocks and the per-request block tables over it."""

from __future__ import annotations

import os

import torch

from berth.engine.pyexecutor.llm_request import LlmRequest


class KVBlockPool:
    """Hands out block ids; knows nothing about tensors or requests."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids are handed out first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"KV pool has {len(self._free)} free blocks, {count} requested")
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        return taken[::-1]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))


class KVCacheManager:
    """Owns the cache tensors and grows each request's block table as its tokens are computed."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.block_size = block_size
        self.pool = KVBlockPool(num_blocks)
        # One tensor for all layers: [layer][key|value][block][slot][kv head][dim].
        self.kv_caches = torch.empty(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks_needed(self, request: LlmRequest, num_new_tokens: int) -> int:
        total = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, total - len(request.block_ids))

    def try_allocate(self, request: LlmRequest, num_new_tokens: int) -> bool:
        """Grows the request's block table to hold `num_new_tokens` more; False if the pool is short."""
        needed = self.new_blocks_needed(request, num_new_tokens)
        if needed > self.pool.num_free:
            return False
        if needed:
            request.block_ids += self.pool.allocate(needed)
        return True

    def free(self, request: LlmRequest) -> None:
        if request.block_ids:
            self.pool.free(request.block_ids)
            request.block_ids = []


def plan_num_blocks(
    *,
    explicit_blocks: int | None,
    memory_fraction: float,
    bytes_per_block: int,
    max_useful_blocks: int,
    device: torch.device,
) -> int:
    """How many blocks the pool gets: the explicit count, or a fraction of free memory capped at
    what `max_batch_size` full-length sequences could ever use."""
    if explicit_blocks is not None:
        return explicit_blocks
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
    else:
        free_bytes = _available_host_memory()
    return max(1, min(int(free_bytes * memory_fraction) // bytes_per_block, max_useful_blocks))


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
