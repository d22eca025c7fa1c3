"""What sleeping releases and waking restores, on one rank: the KV cache and the weights.

Every rank of a world holds its own shard of the weights and its own KV cache, so every rank
runs the same actions, in the same order: rank 0's engine loop decides (between steps) and the
others follow. An action is plain data (`ReleaseMemory`, `StageWeights`, `CommitWakeup`,
`DiscardStagedWeights`) so that it can be broadcast, and `RankMemory.apply` runs it on this
rank and reports the outcome instead of raising, so that rank 0 can see every rank's.

A wakeup is two-phase, so a new model that does not fit leaves every rank as it was: first
every rank loads the weights it will serve aside (`StageWeights`: the new revision, or the
weights a level-2 sleep dropped), then, only if every rank managed, every rank swaps them in
and reallocates its KV cache (`CommitWakeup`); otherwise every rank drops what it staged.

Levels: 1 frees the KV cache and moves the weights to host memory (on a CPU, where host
memory is the device, the weights stay where they are: level 1 frees the KV cache only);
2 drops the weights too, and a wakeup reloads them from the model directory through the
model's own load path (so whatever the loader does after reading, such as repacking weights
for the CPU's GEMM, is done again).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from berth.engine.config import EngineConfig
from berth.engine.engine_io import EngineMemory, ModelRevision
from berth.engine.models.config import ModelConfig
from berth.engine.models.loader import checkpoint_digest
from berth.engine.pyexecutor.kv_cache import KVCacheManager
from berth.engine.pyexecutor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

ModelLoader = Callable[[str], torch.nn.Module]  # a model directory -> this rank's model, loaded


# ---- the actions every rank runs ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReleaseMemory:
    level: int


@dataclass(frozen=True, slots=True)
class StageWeights:
    """Loads aside the weights a wakeup will serve: `model_dir` (a new revision), or, when None,
    the engine's own if a level-2 sleep dropped them (nothing to do otherwise)."""

    model_dir: str | None


@dataclass(frozen=True, slots=True)
class CommitWakeup:
    """Serves what was staged (or brings the offloaded weights back) and reallocates the KV cache."""


@dataclass(frozen=True, slots=True)
class DiscardStagedWeights:
    pass


MemoryAction = ReleaseMemory | StageWeights | CommitWakeup | DiscardStagedWeights


@dataclass(frozen=True, slots=True)
class RankOutcome:
    """One rank's answer to an action: `error` (text, so it can travel) or what it holds now."""

    rank: int
    error: str | None
    memory: EngineMemory | None = None


# ---- one rank's memory ------------------------------------------------------------------------------


class RankMemory:
    """The device memory of one rank's engine: its model (held by the model runner) and its KV
    cache, and what a sleep has done to them."""

    def __init__(
        self,
        runner: ModelRunner,
        kv_cache: KVCacheManager,
        config: EngineConfig,
        load: ModelLoader,
        *,
        rank: int = 0,
    ) -> None:
        self.runner = runner
        self.kv_cache = kv_cache
        self.config = config
        self.device = kv_cache.device
        self.rank = rank
        self._load = load
        self.model_config: ModelConfig = runner.model.config
        self.model_dir = str(config.model)
        self.revision = model_revision(self.model_dir)
        self.level = 0  # what the last sleep released (0: awake)
        self._staged: tuple[torch.nn.Module, str, ModelRevision] | None = None
        self.weight_bytes = self._weights_on_device()  # kept up to date: stats read it every step

    def apply(self, action: MemoryAction) -> RankOutcome:
        try:
            if isinstance(action, ReleaseMemory):
                self.release(action.level)
            elif isinstance(action, StageWeights):
                self.stage(action.model_dir)
            elif isinstance(action, CommitWakeup):
                self.commit()
            elif isinstance(action, DiscardStagedWeights):
                self.discard()
            else:
                raise TypeError(f"unknown memory action {action!r}")
        except Exception as error:
            logger.exception("rank %d failed to %s", self.rank, type(action).__name__)
            return RankOutcome(self.rank, f"{type(error).__name__}: {error}")
        finally:
            self.weight_bytes = self._weights_on_device()
        return RankOutcome(self.rank, None, self.memory())

    # ---- sleep ------------------------------------------------------------------------------------

    def release(self, level: int) -> None:
        self.runner.release_decode_graphs()  # they hold the old addresses, and memory of their own
        self.kv_cache.release()
        model = self.runner.model
        if level == 2:
            self.runner.model = None  # the last reference: its tensors are freed with it
            del model
        elif self.device.type != "cpu":
            move_weights(model, torch.device("cpu"))
        self.level = level
        return_freed_memory(self.device)

    # ---- wakeup -----------------------------------------------------------------------------------

    def stage(self, model_dir: str | None) -> None:
        if model_dir is None and self.level != 2:
            return  # the weights are still held (maybe in host memory): the commit brings them back
        target = self.model_dir if model_dir is None else str(model_dir)
        revision = model_revision(target)  # an unreadable directory fails here, before any load
        if model_dir is not None:
            self._check_fits(target)
        model = self._load(target)
        self._staged = (model, target, revision)

    def commit(self) -> None:
        if self._staged is not None:
            model, self.model_dir, self.revision = self._staged
            self._staged = None
            previous, self.runner.model = self.runner.model, model
            self.model_config = model.config
            del previous, model  # a level-1 swap drops the old weights here
            return_freed_memory(self.device)
        elif self.device.type != "cpu":
            move_weights(self.runner.model, self.device)
        self.kv_cache.allocate()
        self.runner.capture_decode_graphs()  # the weights and the KV cache moved
        self.level = 0

    def discard(self) -> None:
        if self._staged is not None:
            self._staged = None
            return_freed_memory(self.device)

    def _check_fits(self, model_dir: str) -> None:
        """A new revision must have every weight's shape (and the limits the server was told)
        of the one serving: checked from its config.json before a byte of weights is read. The
        loader then checks every tensor's shape against the model it builds."""
        new = ModelConfig.from_pretrained(model_dir)
        differences = self.model_config.shape_differences(new)
        serving_len = self.config.max_model_len_for(self.model_config.max_position_embeddings)
        new_len = self.config.max_model_len_for(new.max_position_embeddings)
        if new_len != serving_len:
            differences.append(f"max_model_len {new_len} (serving: {serving_len})")
        if differences:
            raise ValueError(
                f"{model_dir} does not fit the model this engine serves: {'; '.join(differences)}"
            )

    # ---- what it holds ----------------------------------------------------------------------------

    def _weights_on_device(self) -> int:
        model = self.runner.model
        return tensor_bytes(model, self.device) if model is not None else 0

    def memory(self) -> EngineMemory:
        allocated = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
        return EngineMemory(
            device=str(self.device),
            kv_cache_bytes=self.kv_cache.nbytes if self.kv_cache.is_allocated else 0,
            weight_bytes=self.weight_bytes,
            resident_bytes=resident_bytes(),
            device_allocated_bytes=allocated,
        )


def model_revision(model_dir: str) -> ModelRevision:
    return ModelRevision(path=os.path.abspath(model_dir), digest=checkpoint_digest(model_dir))


# ---- memory, measured and given back -------------------------------------------------------------


def tensor_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of every tensor the model holds on `device`'s kind: its parameters and buffers, and
    what sits beside them (the kernel backend's packed copies of weights, the RoPE table); a
    tied tensor once."""
    held: dict[int, int] = {}
    for module in model.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(value, torch.Tensor) and value.device.type == device.type:
                held[id(value)] = value.nbytes
    return sum(held.values())


def move_weights(model: torch.nn.Module, device: torch.device) -> None:
    """Moves every parameter and buffer to `device` in place (the modules keep their tensors'
    identities, so a tied weight stays tied). To host memory it is pinned, so the way back is
    a fast DMA copy."""
    pin = device.type == "cpu" and torch.cuda.is_available()
    for tensor in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values():
        if pin:
            moved = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            moved.copy_(tensor.data)
        else:
            moved = tensor.data.to(device)
        tensor.data = moved
    repack = getattr(model, "pack_weights", None)
    if device.type != "cpu" and callable(repack):
        repack()  # the kernel backend's own copies are rebuilt from the weights now in place


def return_freed_memory(device: torch.device) -> None:
    """Gives what the engine just dropped back to whoever else needs it: the CUDA driver
    (torch's caching allocator keeps freed blocks until told), and the OS (glibc keeps freed
    heap memory in its arenas until `malloc_trim`; the KV pool on a CPU is a mapping of its
    own and went back when it was unmapped)."""
    gc.collect()  # what only a reference cycle still held
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    _malloc_trim()


def _malloc_trim() -> None:
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def resident_bytes(pid: int | str = "self") -> int:
    """A process's resident set size (this one's by default); 0 where /proc is not there to say."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
