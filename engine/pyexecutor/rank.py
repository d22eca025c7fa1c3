"""One rank's engine: its shard of the model and its own KV cache, agreed with the other ranks.

Every rank of a world builds the same way (`build_rank`), each from the checkpoint on its own
host: only its shard of the weights, a KV cache for only its KV heads. Then the ranks agree:

- on failure: a rank that cannot load (a missing shard file on its host, no memory) tells the
  others instead of leaving them waiting in the next collective; every rank then fails, and
  rank 0 reports the failing rank's own error;
- on the KV pool: every rank plans its block count from its own memory limits and a profiled
  step (`memory_budget`), and the world uses the smallest (rank 0 schedules blocks that must
  exist on every rank).

Rank 0 then runs the engine loop (`PyExecutor`); the others `follow` it.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from berth.engine.config import EngineConfig
from berth.engine.engine_io import KVCachePlan, LoadProgress, ProgressSink
from berth.engine.models.config import ModelConfig
from berth.engine.models.loader import DTYPES, load_model
from berth.engine.models.parallel import (
    SINGLE,
    TensorParallelGroup,
    attention_shard,
    join_group,
    leave_process_group,
    open_rendezvous,
)
from berth.engine.pyexecutor import kv_slices, step_inputs
from berth.engine.pyexecutor.cuda_graphs import DecodeGraphs
from berth.engine.pyexecutor.kv_cache import KVCacheManager
from berth.engine.pyexecutor.memory_budget import cuda_limit, host_limits, plan_kv_cache
from berth.engine.pyexecutor.model_runner import ModelRunner
from berth.engine.pyexecutor.profile_run import activation_peak_bytes, profile_sequence_lengths
from berth.engine.pyexecutor.sleep import RankMemory, return_freed_memory

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "RankFailedError",
    "build_rank",
    "follow",
    "join_world",
    "leave_world",
    "open_rendezvous",
    "rank_config",
    "rank_memory",
]


class RankFailedError(RuntimeError):
    """Another rank of the world failed to start; `rank_traceback` is its own traceback."""

    def __init__(self, message: str, rank_traceback: str = "") -> None:
        super().__init__(message)
        self.rank_traceback = rank_traceback

    def __reduce__(self):
        return type(self), (str(self), self.rank_traceback)


@dataclass(frozen=True)
class _Failure:
    rank: int
    where: str
    text: str
    traceback: str


def rank_config(config: EngineConfig, local_rank: int, local_size: int) -> EngineConfig:
    """The config as one rank of a world applies it, `local_size` ranks sharing its host: with
    GPUs, each rank takes the one of its local rank; on a CPU the ranks share the host's memory
    (each plans its KV pool from its share) and its cores (each gets its share of threads,
    unless OMP_NUM_THREADS says otherwise)."""
    device = config.resolved_device()
    if device == "cuda":
        return replace(config, device=f"cuda:{local_rank}")
    if device == "cpu" and local_size > 1:
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_size))
        share = config.kv_cache_memory_fraction / local_size
        return replace(config, device=device, kv_cache_memory_fraction=share)
    return replace(config, device=device)


def join_world(
    rank: int, size: int, address: tuple[str, int], config: EngineConfig, store: object | None = None
) -> TensorParallelGroup:
    """Joins the world's collectives (rank 0 passes the store `open_rendezvous` gave it), with
    the config's collective timeout."""
    device = config.device
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    timeout = datetime.timedelta(seconds=config.collective_timeout)
    transitions = datetime.timedelta(seconds=config.transition_collective_timeout)
    return join_group(rank, size, address, torch.device(device), store, timeout, transitions)


def leave_world() -> None:
    """This rank's part in the world ends (`parallel.leave_process_group`: on every way out)."""
    leave_process_group()


def build_rank(
    config: EngineConfig, tp: TensorParallelGroup = SINGLE, on_progress: ProgressSink | None = None
) -> tuple[ModelRunner, KVCachePlan]:
    """This rank's model shard and KV cache, once every rank of the world has both; and the
    plan the pool was sized by. `on_progress` hears how far this rank has come."""
    report = on_progress or (lambda progress: None)
    model = _agreed(tp, "loading the model", lambda: _load(config, tp, report))
    report(LoadProgress("sizing the KV cache"))
    mc: ModelConfig = model.config
    shard = attention_shard(mc.num_heads, mc.num_kv_heads, tp.rank, tp.size)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    kv_dtype = dtype if config.kv_cache_dtype == "auto" else DTYPES[config.kv_cache_dtype]
    # Every rank profiles the same step at once (the model's all-reduces pair them up).
    plan = _agreed(
        tp, "sizing the KV cache", lambda: plan_memory(config, model, device, kv_dtype, shard.num_kv_heads)
    )
    num_blocks = tp.min_over_ranks(plan.num_blocks)
    plan = replace(plan, num_blocks=num_blocks)
    logger.debug("%s", plan.describe())
    kv_cache = KVCacheManager(
        num_blocks,
        config.kv_block_size,
        num_layers=mc.num_layers,
        num_kv_heads=shard.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=kv_dtype,
        device=device,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    runner = ModelRunner(model, kv_cache, device, tp)
    # A MoE model runs eagerly: its GEMM sizes follow each step's routing (`supports_decode_graphs`).
    if uses_decode_graphs(config, device, tp) and getattr(model, "supports_decode_graphs", True):
        report(LoadProgress("capturing decode graphs"))
        runner.use_decode_graphs(decode_graphs_for(runner, config))
        runner.capture_decode_graphs()
    return runner, plan


def uses_decode_graphs(config: EngineConfig, device: torch.device, tp: TensorParallelGroup) -> bool:
    """CUDA graphs for decode steps: on a GPU, unless `enforce_eager`, with one rank (a world's
    collectives are not captured yet: its ranks run eagerly)."""
    return device.type == "cuda" and not config.enforce_eager and tp.size == 1


def decode_graphs_for(runner: ModelRunner, config: EngineConfig, *, emulate: bool = False) -> DecodeGraphs:
    """The decode graphs of `runner`, for whichever model and KV cache it holds when capturing."""
    max_position_embeddings = runner.model.config.max_position_embeddings
    return DecodeGraphs(
        lambda *step: runner.model(*step),
        lambda: runner.kv_cache.kv_caches,
        runner.device,
        max_batch_size=config.max_batch_size,
        max_model_len=config.max_model_len_for(max_position_embeddings),
        block_size=config.kv_block_size,
        emulate=emulate,
    )


def _agreed(tp: TensorParallelGroup, what: str, build: Callable[[], T]) -> T:
    """`build()` on every rank; a rank that fails tells the others instead of leaving them
    waiting in the next collective, and every rank then fails with the first failing rank's
    error (its own, on that rank)."""
    try:
        result = build()
        failure = None
    except Exception as error:
        if tp.size == 1:
            raise
        logger.exception("rank %d failed while %s", tp.rank, what)
        failure = _Failure(
            tp.rank,
            f"pid {os.getpid()} on {socket.gethostname()}",
            f"{type(error).__name__}: {error}",
            "".join(traceback.format_exception(type(error), error, error.__traceback__)),
        )
        local_error = error
    failures = [f for f in tp.all_gather_objects(failure) if f is not None]
    if failures:
        if failure is not None and failures[0].rank == tp.rank:
            raise local_error  # this rank's own error is the root cause it reports
        first = failures[0]
        raise RankFailedError(
            f"rank {first.rank} of {tp.size} ({first.where}) failed while {what}: {first.text}",
            first.traceback,
        )
    return result


def rank_memory(runner: ModelRunner, config: EngineConfig) -> RankMemory:
    """What sleeping releases and waking restores on this rank; every reload goes through the
    loader (the model's own load path), for this rank's shard, in the dtype it runs."""
    load = functools.partial(
        load_model, dtype=next(runner.model.parameters()).dtype, device=runner.device, tp=runner.tp
    )
    return RankMemory(runner, runner.kv_cache, config, load, rank=runner.tp.rank)


def _load(config: EngineConfig, tp: TensorParallelGroup, report: ProgressSink) -> torch.nn.Module:
    """The model shard, checked against the config."""
    device = torch.device(config.resolved_device())
    model = load_model(
        config.model,
        config.dtype,
        device,
        tp,
        on_bytes_read=lambda done, total: report(LoadProgress("loading weights", done, total)),
    )
    mc: ModelConfig = model.config
    max_model_len = config.max_model_len_for(mc.max_position_embeddings)
    if not config.enable_chunked_prefill and config.max_num_tokens < max_model_len:
        # Without chunking a step must hold a whole sequence: a preempted one is recomputed
        # (prompt and output so far) in one step.
        raise ValueError(
            f"without chunked prefill, max_num_tokens ({config.max_num_tokens}) must be at least "
            f"max_model_len ({max_model_len})"
        )
    return model


def plan_memory(
    config: EngineConfig,
    model: torch.nn.Module,
    device: torch.device,
    kv_dtype: torch.dtype,
    num_kv_heads: int,
) -> KVCachePlan:
    """Sizes this rank's KV pool (for its `num_kv_heads`) from the limits measured now (the
    weights are loaded) and a profiled step (see `memory_budget`); a pool that cannot work
    fails here, with the numbers."""
    mc: ModelConfig = model.config
    max_model_len = config.max_model_len_for(mc.max_position_embeddings)
    bytes_per_token = 2 * mc.num_layers * num_kv_heads * mc.head_dim * kv_dtype.itemsize  # K and V
    bytes_per_block = bytes_per_token * config.kv_block_size
    return_freed_memory(device)  # what loading left in the allocator's free lists is not in use
    limits = [cuda_limit(device)] if device.type == "cuda" else host_limits()
    lengths = profile_sequence_lengths(config.max_num_tokens, max_model_len, config.max_batch_size)
    peak = activation_peak_bytes(
        model,
        lengths,
        num_layers=mc.num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=mc.head_dim,
        kv_dtype=kv_dtype,
        block_size=config.kv_block_size,
        device=device,
    )
    return_freed_memory(device)
    blocks_per_sequence = -(-max_model_len // config.kv_block_size)
    return plan_kv_cache(
        limits=limits,
        bytes_per_block=bytes_per_block,
        block_size=config.kv_block_size,
        dtype=str(kv_dtype).removeprefix("torch."),
        min_blocks=blocks_per_sequence,
        max_useful_blocks=config.max_batch_size * blocks_per_sequence,
        activation_peak=peak,
        memory_fraction=config.kv_cache_memory_fraction,
        explicit_blocks=config.kv_cache_blocks,
        explicit_bytes=config.kv_cache_memory,
    )


def follow(runner: ModelRunner, config: EngineConfig) -> None:
    """A rank other than 0, once built: runs every step rank 0 broadcasts, until it says stop.
    Between steps rank 0 may send a memory action (a sleep or a wakeup): this rank runs it on
    its own shard and KV cache, and its outcome goes back to rank 0 (`PyExecutor.memory_actions`);
    or a KV read or write of a disaggregated request, on this rank's KV heads (`kv_slices`)."""
    memory = rank_memory(runner, config)
    while (message := step_inputs.receive(runner.tp)) is not None:
        if isinstance(message, step_inputs.StepInputs):
            runner.run(message)
        elif isinstance(message, (step_inputs.KVRead, step_inputs.KVWrite)):
            kv_slices.follow(runner, message)
        else:
            runner.tp.all_gather_transition_outcomes(memory.apply(message))
