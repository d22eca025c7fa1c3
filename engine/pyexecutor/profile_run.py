"""The profiling forward pass: the peak memory the largest step takes beyond the weights.

Run once at start-up, before the KV pool exists (as vLLM's profile run): a step of
`max_num_tokens` prompt tokens in as few sequences as `max_model_len` allows (the longest
prefills take the most attention scratch) through the engine's own model runner, over a
scratch KV cache just large enough for them. What it measures is the growth of the process's
peak resident memory (CPU: `/proc/self/status` VmHWM, reset first through
`/proc/self/clear_refs`) or of torch's peak CUDA allocation during the step; the scratch cache
is written before the measurement starts, so it is not counted.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from berth.engine.pyexecutor.kv_cache import KVCacheManager
from berth.engine.pyexecutor.model_runner import ModelRunner
from berth.engine.pyexecutor.sequence import Sequence
from berth.engine.sampling_params import SamplingParams


def profile_sequence_lengths(max_num_tokens: int, max_model_len: int, max_batch_size: int) -> list[int]:
    """The prompt lengths of the largest step the scheduler can make: `max_num_tokens` tokens
    (or all that `max_batch_size` full-length sequences hold), each sequence at most
    `max_model_len - 1` (a prompt leaves room for one output token)."""
    longest = max(1, max_model_len - 1)
    remaining = min(max_num_tokens, longest * max_batch_size)
    lengths = []
    while remaining > 0:
        lengths.append(min(longest, remaining))
        remaining -= lengths[-1]
    return lengths


def activation_peak_bytes(
    model: torch.nn.Module,
    lengths: list[int],
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype,
    block_size: int,
    device: torch.device,
) -> int:
    """Runs one step of prompts of `lengths` tokens; the peak memory it took beyond what was
    held before it."""
    num_blocks = sum(-(-length // block_size) for length in lengths)
    scratch = KVCacheManager(
        num_blocks,
        block_size,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=kv_dtype,
        device=device,
        enable_prefix_caching=False,
    )
    scratch.kv_caches.zero_()  # its pages are taken now, not during the measured step
    params = SamplingParams(max_tokens=1)
    sequences = [
        Sequence(index, 0, [0] * length, params, priority=0.0, max_tokens=1, arrival_time=0.0)
        for index, length in enumerate(lengths)
    ]
    for sequence in sequences:
        scratch.try_allocate(sequence, sequence.num_tokens)
    runner = ModelRunner(model, scratch, device)
    scheduled = [(sequence, sequence.num_tokens) for sequence in sequences]
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            runner.execute(scheduled)
            torch.cuda.synchronize(device)
            return max(0, torch.cuda.max_memory_allocated(device) - before)
        before = _reset_peak_resident()
        runner.execute(scheduled)
        return max(0, _status_bytes("VmHWM") - before)
    finally:
        for sequence in sequences:
            scratch.free(sequence)
        scratch.release()


def _reset_peak_resident() -> int:
    """Resets this process's peak RSS to its current RSS (Linux's clear_refs "5") and returns
    the RSS now. Where the peak cannot be reset it stays the whole life's: an overestimate,
    which sizes the pool smaller, never too large."""
    _return_free_heap_to_the_os()
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")


def _return_free_heap_to_the_os() -> None:
    """glibc keeps freed heap pages resident for reuse; a step that reuses them does not raise
    the peak RSS, and the profile would read near zero in a process that has run steps (or
    anything else) before. `malloc_trim(0)` hands those pages back first, so the step's
    activations fault in pages of their own and are counted."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    malloc_trim = getattr(ctypes.CDLL(libc_name), "malloc_trim", None)
    if malloc_trim is not None:  # glibc only; musl and others have no such call
        malloc_trim(0)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0
