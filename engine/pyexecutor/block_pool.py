"""`KVBlockPool`: the KV cache's block ids, who holds them, and which hold a cached prefix.

A block is in use while some sequence holds it (its reference count is above zero; several
sequences hold a shared prefix block at once). A free block may still hold a cached prefix:
it keeps its hash, and a later request with that prefix takes it back instead of computing
it again, until the block is handed out for something else. Free blocks are handed out least
recently freed first, so the prefixes used last are kept longest (LRU eviction).
The pool knows nothing about tensors, tokens or sequences.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

BlockHash = bytes


class KVBlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[BlockHash], None] | None = None) -> None:
        self.num_blocks = num_blocks
        self.on_evict = on_evict  # told of every cached prefix a block loses (KV events)
        self._refs = [0] * num_blocks
        # Free blocks, the next one to hand out first: freed blocks join at the end.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks nobody holds (cached ones included: they can be handed out at any time)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a reusable prefix, in use or free."""
        return len(self._block_of)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """`count` blocks nobody holds; each loses the prefix it cached (if any)."""
        if count > len(self._free):
            raise MemoryError(f"KV pool has {len(self._free)} free blocks, {count} requested")
        taken = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._forget_hash(block)
            self._refs[block] = 1
            taken.append(block)
        return taken

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one hold on each block; a block nobody holds any more becomes free (in the order
        given: the first to be freed is the first to be handed out again)."""
        for block in block_ids:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    # ---- cached prefixes ------------------------------------------------------------------------

    def cached_block(self, block_hash: BlockHash) -> int | None:
        return self._block_of.get(block_hash)

    def is_free(self, block: int) -> bool:
        return self._refs[block] == 0

    def hold(self, block: int) -> None:
        """One more holder of a cached block (taking it out of the free blocks if it was free)."""
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def cache(self, block: int, block_hash: BlockHash) -> bool:
        """Records that `block` holds the prefix `block_hash` names; False if it did not (a prefix
        already cached in another block keeps that one: two sequences computed it at once)."""
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._block_of)

    def _forget_hash(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._block_of[block_hash]
            if self.on_evict is not None:
                self.on_evict(block_hash)
