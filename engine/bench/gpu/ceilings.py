"""The two ceilings every GPU figure is read against, measured on the device at hand: how fast
memory moves (a device-to-device copy, bytes read plus bytes written) and how fast a large
matmul runs. Datasheet numbers are leads; these are what this card does now."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, repeat: int = 10) -> float:
    """Median milliseconds of `fn()`, timed with CUDA events on a GPU (device work is
    asynchronous), with the wall clock on a CPU; after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeat):
            started = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Bytes per second of a device-to-device copy of `nbytes`, counting the bytes read and the
    bytes written (a kernel that reads N bytes once moves N: compare it with this)."""
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), device)
    return 2 * nbytes / (ms / 1e3)


def matmul_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16, size: int = 8192) -> float:
    """FLOP/s of a `size`-cubed matmul on random data (zeros run faster than real data)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    ms = median_ms(lambda: a @ b, device)
    return 2 * size**3 / (ms / 1e3)
