"""The paged KV cache: the cache tensors, each sequence's block table over the block pool, and
prefix caching.

Prefix caching: a full block's contents are named by a hash chained over every token before
it (parent hash, the block's token ids; the request's `cache_salt` seeds the chain). A block
is recorded under its hash when it is allocated for tokens computed in that step, so a
sequence admitted later (in a later step, or later in the same step: every layer writes the
whole batch's keys and values before any of its attention reads them) starts from the longest
run of cached blocks of its prefix instead of computing it. Different salts give different
chains, so they never share a block. Cached blocks stay cached after their sequences end,
until the pool hands them out again (least recently freed first).

The hashes assume one model: whoever replaces the weights (a wakeup with a new revision) must
start from an empty pool. `release` (a sleep) frees the cache tensors and forgets every
cached prefix with them; `allocate` (a wakeup) starts from a fresh, empty pool.

On a CPU the cache tensors live in an anonymous memory mapping of their own, so that freeing
them gives the pages back to the OS at once: memory from malloc may stay in the process (glibc
keeps freed heap memory, and raises its mmap threshold after each large free), and a sleeping
engine must really shrink.
"""

from __future__ import annotations

import hashlib
import math
import mmap
from array import array

import torch

from berth.engine.pyexecutor.block_pool import BlockHash, KVBlockPool
from berth.engine.pyexecutor.kv_events import KVEventLog, salt_namespace
from berth.engine.pyexecutor.sequence import Sequence


class KVCacheManager:
    """Owns the cache tensors and grows each sequence's block table as its tokens are computed."""

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
        enable_prefix_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.event_log: KVEventLog | None = None  # recording KV events: `record_events`
        self.pool = KVBlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        # Since start, in tokens (vLLM's meaning): looked up at admission, and found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # One tensor for all layers: [layer][key|value][block][slot][kv head][dim].
        self.shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_caches: torch.Tensor | None = None
        self._mapping: mmap.mmap | None = None
        self.allocate()

    @property
    def nbytes(self) -> int:
        """The cache tensors' size (whether allocated or not)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def is_allocated(self) -> bool:
        return self.kv_caches is not None

    def allocate(self) -> None:
        """The cache tensors, and a fresh pool: no block is held and no prefix is cached."""
        if self.kv_caches is not None:
            return
        self.pool = self._empty_pool()
        if self.device.type == "cpu":
            # Pages are taken from the OS as the cache is written (zeros until then).
            self._mapping = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            flat = torch.frombuffer(self._mapping, dtype=self.dtype)  # keeps the mapping alive
            self.kv_caches = flat.view(self.shape)
        else:
            self.kv_caches = torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Frees the cache tensors; every cached prefix goes with them. Only when no sequence
        holds a block (a sleep drains or aborts them all first)."""
        if self.pool.num_used:
            raise RuntimeError(f"cannot release the KV cache: {self.pool.num_used} blocks are in use")
        self.pool = self._empty_pool()
        if self.event_log is not None:
            self.event_log.cleared()
        self.kv_caches = None
        if self._mapping is not None:
            # The pages go back now, even if a view of the tensors were still alive somewhere
            # (it would read zeros); the mapping itself goes when its last view does.
            self._mapping.madvise(mmap.MADV_DONTNEED)
            self._mapping = None

    def record_events(self) -> KVEventLog:
        """From now on, every block stored in or evicted from the prefix cache, and every clear,
        is written to the returned log (for `kv_events.KVEventPublisher`)."""
        self.event_log = KVEventLog(self.block_size, self.device.type)
        self.pool.on_evict = self.event_log.removed
        return self.event_log

    def _empty_pool(self) -> KVBlockPool:
        return KVBlockPool(self.pool.num_blocks, self.event_log.removed if self.event_log else None)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks_needed(self, sequence: Sequence, num_new_tokens: int) -> int:
        total = self.blocks_for(sequence.num_computed_tokens + num_new_tokens)
        return max(0, total - len(sequence.block_ids))

    def try_allocate(self, sequence: Sequence, num_new_tokens: int) -> bool:
        """Grows the block table to hold `num_new_tokens` more (computed in this step); False if
        the pool is short."""
        needed = self.new_blocks_needed(sequence, num_new_tokens)
        if needed > self.pool.num_free:
            return False
        if needed:
            sequence.block_ids += self.pool.allocate(needed)
        self._cache_full_blocks(sequence, sequence.num_computed_tokens + num_new_tokens)
        return True

    def free(self, sequence: Sequence) -> None:
        # The last block first: a prefix's first blocks, the most widely shared, are evicted last.
        self.pool.free(reversed(sequence.block_ids))
        sequence.block_ids = []
        sequence.num_cached_blocks = 0

    # ---- prefix caching ---------------------------------------------------------------------------

    def cached_prefix(self, sequence: Sequence) -> list[int]:
        """The blocks holding the longest cached prefix of a sequence that has nothing computed.

        At least its last token is left to compute (the step needs its logits), and the block
        it is in is never one of these: a shared block is read, never written."""
        if not self.enable_prefix_caching:
            return []
        limit = (sequence.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in self._block_hashes(sequence, limit):
            block = self.pool.cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def free_blocks_to_admit(self, prefix: list[int], num_new_tokens: int) -> int:
        """Free blocks that starting from `prefix` and computing `num_new_tokens` more would take."""
        reused = sum(self.pool.is_free(block) for block in prefix)
        return reused + self.blocks_for(len(prefix) * self.block_size + num_new_tokens) - len(prefix)

    def admit(self, sequence: Sequence, prefix: list[int]) -> None:
        """Starts a waiting sequence from its cached prefix (counted in the prefix-cache stats)."""
        for block in prefix:
            self.pool.hold(block)
        sequence.block_ids = list(prefix)
        sequence.num_computed_tokens = len(prefix) * self.block_size
        sequence.num_cached_blocks = len(prefix)
        if sequence.num_cached_tokens is None:  # the first admission's: a re-admission is no new hit
            sequence.num_cached_tokens = sequence.num_computed_tokens
        if self.enable_prefix_caching:
            self.prefix_cache_queries += sequence.num_tokens
            self.prefix_cache_hits += sequence.num_computed_tokens

    def record_full_blocks(self, sequence: Sequence, num_tokens: int) -> None:
        """Blocks written from elsewhere (another engine's KV): recorded as if computed here."""
        self._cache_full_blocks(sequence, num_tokens)

    def _cache_full_blocks(self, sequence: Sequence, num_tokens: int) -> None:
        """Records the sequence's blocks that `num_tokens` fill, so later sequences can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = num_tokens // self.block_size
        if full <= sequence.num_cached_blocks:
            return
        hashes = self._block_hashes(sequence, full)
        stored = [
            index
            for index in range(sequence.num_cached_blocks, full)
            if self.pool.cache(sequence.block_ids[index], hashes[index])
        ]
        sequence.num_cached_blocks = full
        if self.event_log is not None and stored:
            self._log_stored(sequence, hashes, stored)

    def _log_stored(self, sequence: Sequence, hashes: list[BlockHash], stored: list[int]) -> None:
        """One event per run of consecutive blocks stored (a block another one holds breaks it)."""
        size, namespace = self.block_size, salt_namespace(sequence.cache_salt)
        runs: list[list[int]] = []
        for index in stored:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, end = run[0], run[-1] + 1
            parent = hashes[first - 1] if first else None
            tokens = sequence.token_ids[first * size : end * size]
            self.event_log.stored(hashes[first:end], parent, tokens, namespace)

    def _block_hashes(self, sequence: Sequence, count: int) -> list[BlockHash]:
        """The chained hashes of the sequence's first `count` full blocks (computed once each)."""
        hashes = sequence.block_hashes
        size = self.block_size
        while len(hashes) < count:
            index = len(hashes)
            parent = hashes[-1] if hashes else _chain_root(sequence.cache_salt)
            tokens = array("i", sequence.token_ids[index * size : (index + 1) * size])
            hashes.append(hashlib.sha256(parent + tokens.tobytes()).digest())
        return hashes[:count]


def _chain_root(cache_salt: str | None) -> BlockHash:
    # SHA-256, not Python's hash(): a collision would hand one tenant another's keys and values.
    salt = b"" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    return hashlib.sha256(b"berth-kv-prefix\x00" + salt).digest()
