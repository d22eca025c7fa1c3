"""Tensor parallelism: which slice of every weight a rank holds, and the collectives between ranks.

Megatron's layout, as vLLM lays it out for Llama-family models:

- column-parallel (output features split): the fused Q/K/V projection, by heads, and the fused
  gate/up projection, by intermediate features; no communication;
- row-parallel (input features split): o_proj and down_proj; each rank's partial sum is
  all-reduced, one all-reduce per projection, so a decoder layer costs two;
- vocab-parallel embedding and LM head: rank r holds rows [r * V/N, (r + 1) * V/N) of the
  (tied or not) matrix. The embedding looks up only the ids it holds and all-reduces the rows
  (zeros from every other rank); the LM head's partial logits are gathered to rank 0, the only
  rank that samples. Replicating them would be simpler, but the embedding and the head are the
  largest matrices of a small model (SmolLM2: 28 M of its 135 M parameters) and of a large
  vocabulary (Llama 3: 2 x 525 M): each rank would hold what tensor parallelism exists to split.
- norms replicated.

Attention heads are split evenly. KV heads too when there are at least as many as ranks; with
fewer (GQA), each KV head is replicated on N / num_kv_heads consecutive ranks, which are exactly
the ranks whose query heads read it.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch

# The step broadcast's group waits for the leader's next step while the engine is idle: an idle
# engine must not time out. A dead peer is noticed by MPI (which ends the world), not by this.
IDLE_FOREVER = datetime.timedelta(days=365)
# The ranks find each other while each loads its shard: that may take minutes.
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)
# Collectives inside a forward wait only for the slowest rank's share of that forward; the
# engine passes its own bound (`EngineConfig.collective_timeout`), this is the default.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)


@dataclass(frozen=True)
class AttentionShard:
    """One rank's attention heads: query heads [first_head, + num_heads), KV heads
    [first_kv_head, + num_kv_heads) of the checkpoint's."""

    num_heads: int
    num_kv_heads: int
    first_head: int
    first_kv_head: int


def attention_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> AttentionShard:
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {num_heads} attention heads")
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(
                f"tensor_parallel_size {size} must divide the model's {num_kv_heads} KV heads "
                "(or be a multiple of them)"
            )
        per_rank = num_kv_heads // size
        return AttentionShard(num_heads // size, per_rank, rank * (num_heads // size), rank * per_rank)
    if size % num_kv_heads:
        raise ValueError(
            f"with fewer KV heads ({num_kv_heads}) than ranks, tensor_parallel_size {size} must be a "
            "multiple of them (each KV head is then replicated on the same number of ranks)"
        )
    replicas = size // num_kv_heads
    return AttentionShard(num_heads // size, 1, rank * (num_heads // size), rank // replicas)


def even_split(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """(start, length) of rank's equal share of `total`."""
    if total % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {what} ({total})")
    length = total // size
    return rank * length, length


def vocab_split(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """(start, rows held, rows allocated) of rank's vocabulary rows. Every rank allocates the same
    ceil(V / N) rows (gathered logits need equal shares); the last ones may hold fewer, and the
    rows past the vocabulary are never looked up and never sampled."""
    per_rank = -(-vocab_size // size)
    start = min(rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start), per_rank


@dataclass
class CollectiveCounters:
    """Time this rank spent in collectives, since start: the forward's all-reduces, and the rest
    (the step broadcast, the logits gather). Measured on the CPU only: on a GPU collectives run
    asynchronously and their time shows up in the next synchronisation instead."""

    all_reduces: int = 0
    all_reduce_seconds: float = 0.0
    other_seconds: float = 0.0


@dataclass(frozen=True)
class TensorParallelGroup:
    """The ranks one model is sharded over. `device_group` carries the model's tensors (NCCL on
    CUDA, gloo on CPU); `control_group` (gloo, on the CPU) carries the leader's step inputs. A
    group of size 1 (`SINGLE`) never communicates."""

    rank: int = 0
    size: int = 1
    device_group: object = None
    control_group: object = None
    counters: CollectiveCounters = field(default_factory=CollectiveCounters, compare=False)
    # How long rank 0's sends on the control group wait for the others (None: forever). Between
    # steps every other rank waits to receive, so a send that waits long means a stuck rank.
    leader_timeout: datetime.timedelta | None = None
    # Gathers the outcomes of a sleep's or wakeup's memory action (gloo), with the transitions'
    # bound as its timeout (None: the control group's): a rank that never finishes its part
    # (a reload from a hung file system) fails every other rank's wait, not a year later.
    transition_group: object = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _timed(self, tensor: torch.Tensor, bucket: str = "other_seconds"):
        return _Timer(self.counters, bucket) if tensor.device.type == "cpu" else _NO_TIMER

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        if self.size > 1:
            import torch.distributed as dist

            with self._timed(tensor, "all_reduce_seconds"):
                dist.all_reduce(tensor, group=self.device_group)
            self.counters.all_reduces += 1
        return tensor

    def gather_to_leader(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `tensor` [R, C] concatenated along the last dim [R, N * C] on rank 0;
        None on the others."""
        if self.size == 1:
            return tensor
        parts = self.gather_list_to_leader(tensor)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def gather_list_to_leader(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (of one shape on every rank), by rank, on rank 0; None on the
        others."""
        if self.size == 1:
            return [tensor]
        import torch.distributed as dist

        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_leader else None
        with self._timed(tensor):
            dist.gather(tensor, parts, dst=0, group=self.device_group)
        return parts

    def broadcast_from_leader(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` (a CPU tensor) into every rank's, in place."""
        import torch.distributed as dist

        with self._timed(tensor):
            if self.is_leader and self.leader_timeout is not None:
                # gloo's send waits for the receiver: bounded, as the forward's collectives are.
                work = dist.broadcast(tensor, src=0, group=self.control_group, async_op=True)
                work.wait(self.leader_timeout)
            else:
                dist.broadcast(tensor, src=0, group=self.control_group)

    def broadcast_object_from_leader(self, value: object = None) -> object:
        """Rank 0's `value` on every rank (pickled: for the rare control messages only)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def all_gather_objects(self, value: object) -> list[object]:
        """Every rank's `value`, by rank (pickled: for the rare control messages only)."""
        if self.size == 1:
            return [value]
        import torch.distributed as dist

        values: list[object] = [None] * self.size
        dist.all_gather_object(values, value, group=self.control_group)
        return values

    def all_gather_transition_outcomes(self, value: object) -> list[object]:
        """`all_gather_objects` on the transition group: it raises once its timeout passes."""
        if self.size == 1:
            return [value]
        import torch.distributed as dist

        values: list[object] = [None] * self.size
        dist.all_gather_object(values, value, group=self.transition_group or self.control_group)
        return values

    def min_over_ranks(self, value: int) -> int:
        if self.size == 1:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(tensor.item())


SINGLE = TensorParallelGroup()


class _Timer:
    def __init__(self, counters: CollectiveCounters, bucket: str) -> None:
        self._counters = counters
        self._bucket = bucket

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, *exc_info) -> None:
        elapsed = time.perf_counter() - self._started
        setattr(self._counters, self._bucket, getattr(self._counters, self._bucket) + elapsed)


class _NoTimer:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info) -> None:
        pass


_NO_TIMER = _NoTimer()


# ---- joining a world --------------------------------------------------------------------------


def open_rendezvous(host: str, size: int) -> tuple[object, tuple[str, int]]:
    """Rank 0: a TCP store on a free port of this host; returns it and the address the other
    ranks must be told (their launcher tells them: MPI, in berth)."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False, timeout=RENDEZVOUS_TIMEOUT)
    return store, (host, store.port)


def join_group(
    rank: int,
    size: int,
    address: tuple[str, int],
    device: torch.device,
    store: object | None = None,
    timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
    transition_timeout: datetime.timedelta | None = None,
) -> TensorParallelGroup:
    """Joins the world's process groups (rank 0 passes the store it opened). A collective of a
    forward that waits past `timeout` raises (gloo; NCCL's watchdog aborts the process): a rank
    that stopped answering fails the world instead of hanging it."""
    import torch.distributed as dist

    if store is None:
        store = dist.TCPStore(address[0], address[1], size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=IDLE_FOREVER)
    # Every rank creates the same groups in the same order (new_group is collective).
    transitions = dist.new_group(backend="gloo", timeout=transition_timeout or IDLE_FOREVER)
    return TensorParallelGroup(
        rank, size, dist.group.WORLD, control, leader_timeout=timeout, transition_group=transitions
    )


def leave_process_group() -> None:
    """Destroys this process's process group, if it joined one. Every way out of a rank must:
    a gloo group left for the interpreter's exit to tear down aborts the process ("terminate
    called without an active exception", SIGABRT), and mpiexec then kills the whole world,
    perhaps before rank 0 has told the proxy why it ended."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
