"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (as vLLM and
TensorRT-LLM do).

A decode step of a large model on a fast GPU is a few milliseconds of weight reads, and an eager
forward launches a few hundred kernels from Python to do it: at small batches the launches, not
the memory, set the pace. A captured graph replays all of them with one call.

A graph replays fixed addresses and fixed shapes, so:

- every input lives in a static buffer sized for the largest bucket; a step copies its inputs
  into the first rows and pads its batch to the bucket above it. A padding row writes no KV (its
  slot is -1, which every kernel skips) and attends to nothing (its length is 0); its logits
  are garbage that nobody reads (rows never mix: every op is row-wise or per sequence);
- the attention is captured for the longest sequence the engine serves (`max_model_len`), so
  the decode kernel's split into segments is fixed; a shorter sequence leaves the segments past
  its end idle;
- only pure decode steps replay (every sequence has one new token); prefills and mixed steps
  run eagerly, as does a batch larger than the largest bucket;
- a sleep frees the graphs with the memory they captured, and a wakeup, whose weights and KV
  cache live at new addresses, captures them again.

On a CPU there is nothing to capture; `emulate=True` runs the same buffers, padding and
bucketing with an eager forward in place of each replay, so the CPU tests exercise this path.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable

import torch

from berth.engine.pyexecutor.step_inputs import StepInputs
from berth.kernels import AttentionMetadata

logger = logging.getLogger(__name__)

# A padding row's KV slot: every write_kv_cache implementation skips negative slots.
PADDING_SLOT = -1


def capture_sizes(max_batch_size: int) -> list[int]:
    """The batch-size buckets: 1, 2, 4, then every multiple of 8 (vLLM's choice: a batch is
    padded by at most 7 rows), up to and including `max_batch_size`."""
    sizes = [size for size in (1, 2, 4) if size < max_batch_size]
    sizes += range(8, max_batch_size, 8)
    return [*sizes, max_batch_size]


# A captured step: runs it, returns the logits of every (padded) row.
Replay = Callable[[], torch.Tensor]


class DecodeGraphs:
    """The captured decode steps of one model on one KV cache, and their static inputs."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        kv_caches: Callable[[], torch.Tensor],
        device: torch.device,
        *,
        max_batch_size: int,
        max_model_len: int,
        block_size: int,
        emulate: bool = False,
    ) -> None:
        if device.type != "cuda" and not emulate:
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self._forward = forward  # the model's forward (looked up at capture: a wakeup may swap models)
        self._kv_caches = kv_caches
        self.device = device
        self.sizes = capture_sizes(max_batch_size)
        self.max_model_len = max_model_len
        self._max_blocks = -(-max_model_len // block_size)
        self._emulate = emulate
        self._graphs: dict[int, Replay] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.num_replays = 0

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def bucket(self, num_seqs: int) -> int | None:
        """The captured batch size a step of `num_seqs` sequences pads to, or None (too large)."""
        index = bisect_left(self.sizes, num_seqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def can_replay(self, inputs: StepInputs) -> bool:
        num_seqs = inputs.seq_lens.numel()
        return (
            self.captured
            and inputs.num_prefills == 0
            and inputs.input_ids.numel() == num_seqs  # one new token each
            and self.bucket(num_seqs) is not None
        )

    # ---- capture ---------------------------------------------------------------------------------

    def capture(self) -> None:
        """Captures every bucket, largest first (the smaller graphs reuse its memory pool)."""
        self.release()
        started = time.perf_counter()
        self._allocate_buffers()
        pool = None
        for size in reversed(self.sizes):
            self._graphs[size], pool = self._capture_one(size, pool)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started
        logger.info(
            "captured %d decode graphs (batch sizes %s) in %.1f s",
            len(self._graphs),
            ", ".join(map(str, self.sizes)),
            self.capture_seconds,
        )

    def release(self) -> None:
        """Drops the graphs and their buffers (their memory goes back with the allocator's next
        `empty_cache`)."""
        self._graphs.clear()
        self._buffers.clear()

    def _allocate_buffers(self) -> None:
        rows, device = self.sizes[-1], self.device

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self._buffers = {
            "input_ids": zeros(rows, dtype=torch.int64),
            "positions": zeros(rows, dtype=torch.int64),
            "slot_mapping": torch.full((rows,), PADDING_SLOT, dtype=torch.int64, device=device),
            # One query token per row: row i's token is token i.
            "query_start_loc": torch.arange(rows + 1, dtype=torch.int32, device=device),
            "seq_lens": zeros(rows, dtype=torch.int32),
            "block_tables": zeros(rows, self._max_blocks, dtype=torch.int32),
            "logits_indices": torch.arange(rows, dtype=torch.int64, device=device),
        }

    def _step_arguments(self, size: int) -> tuple:
        b = self._buffers
        metadata = AttentionMetadata(
            query_start_loc=b["query_start_loc"][: size + 1],
            seq_lens=b["seq_lens"][:size],
            block_tables=b["block_tables"][:size],
            slot_mapping=b["slot_mapping"][:size],
            num_prefills=0,
            num_prefill_tokens=0,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        return (
            b["input_ids"][:size],
            b["positions"][:size],
            self._kv_caches(),
            metadata,
            b["logits_indices"][:size],
        )

    def _capture_one(self, size: int, pool) -> tuple[Replay, object]:
        # Every row is padding while capturing: nothing is written to the KV cache.
        arguments = self._step_arguments(size)
        if self._emulate:
            return (lambda: self._forward(*self._step_arguments(size))), pool
        # A first run on a side stream compiles the kernels and creates the library handles,
        # which must not happen inside a capture.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(*arguments)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread of this process (a caller reading memory stats) may use
        # CUDA while this one captures.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = self._forward(*arguments)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay, graph.pool()

    # ---- replay ----------------------------------------------------------------------------------

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [R, V] for `inputs.logits_indices`, from the graph of the step's bucket."""
        num_seqs = inputs.seq_lens.numel()
        size = self.bucket(num_seqs)
        b = self._buffers
        width = inputs.block_tables.shape[1]
        b["input_ids"][:num_seqs].copy_(inputs.input_ids, non_blocking=True)
        b["positions"][:num_seqs].copy_(inputs.positions, non_blocking=True)
        b["slot_mapping"][:num_seqs].copy_(inputs.slot_mapping, non_blocking=True)
        b["seq_lens"][:num_seqs].copy_(inputs.seq_lens, non_blocking=True)
        b["block_tables"][:num_seqs, :width].copy_(inputs.block_tables, non_blocking=True)
        # The rows a larger step left behind become padding again.
        b["slot_mapping"][num_seqs:size].fill_(PADDING_SLOT)
        b["seq_lens"][num_seqs:size].fill_(0)
        logits = self._graphs[size]()
        self.num_replays += 1
        return logits.index_select(0, inputs.logits_indices.to(self.device, non_blocking=True))
