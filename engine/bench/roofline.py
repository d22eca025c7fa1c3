"""How close a run came to the machine: the FLOPs a workload needs, and the matmul peak.

`workload_flops` counts what any engine must compute for the workload, whatever it wastes: every
prompt token and every fed-back output token goes through all layers (the projections, plus
attention over the positions before it), and the LM head runs once per generated token. Padding,
recomputation after preemption and the LM head over prompt positions are not counted.

`matmul_peak` times GEMMs of the model's own shapes at a large row count, through each path this
CPU has (torch's default GEMM, and the one the engine runs: oneDNN or berth's own C GEMM on
packed weights, `cpu_ops.gemm_path`), and takes the fastest: the figure an engine could
hope for if it did nothing but matmuls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from berth.engine.bench.workload import WorkItem
from berth.engine.models.config import ModelConfig
from berth.kernels.cpu_ops import gemm_path, linear, pack_linear_weight


@dataclass(frozen=True)
class Peak:
    gflops: float
    path: str  # which GEMM reached it


def layer_matmul_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of every projection in one decoder layer (Q/K/V and gate/up fused)."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    return [
        (config.hidden_size, q + 2 * kv),
        (q, config.hidden_size),
        (config.hidden_size, 2 * config.intermediate_size),
        (config.intermediate_size, config.hidden_size),
    ]


def workload_flops(config: ModelConfig, workload: list[WorkItem]) -> float:
    per_token = 2 * config.num_layers * sum(i * o for i, o in layer_matmul_shapes(config))
    # Scores and weighted values: 2 * 2 * heads * head_dim multiply-adds per earlier position.
    per_position = 4 * config.num_layers * config.num_heads * config.head_dim
    lm_head = 2 * config.hidden_size * config.vocab_size
    total = 0.0
    for item in workload:
        computed = len(item.prompt_token_ids) + item.output_len - 1  # the last token is never fed back
        total += computed * per_token
        total += per_position * computed * (computed + 1) / 2
        total += item.output_len * lm_head
    return total


def matmul_peak(config: ModelConfig, dtype: torch.dtype, rows: int = 1024, seconds: float = 0.5) -> Peak:
    """The best GFLOPS of this layer's GEMMs at `rows` tokens, in `dtype`, on the CPU."""
    generator = torch.Generator().manual_seed(0)
    paths: dict[str, Callable[[], float]] = {}
    shapes = layer_matmul_shapes(config)
    inputs = [torch.randn(rows, i, generator=generator).to(dtype) for i, _ in shapes]
    weights = [torch.randn(o, i, generator=generator).to(dtype) for i, o in shapes]
    flops = sum(2 * rows * i * o for i, o in shapes)

    def timed(run: Callable[[], None]) -> float:
        run()  # warm-up: first-call costs (primitive creation) are not speed
        best, deadline = float("inf"), time.perf_counter() + seconds
        while True:
            started = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - started)
            if time.perf_counter() > deadline:
                return flops / best / 1e9

    def aten() -> None:
        for x, w in zip(inputs, weights):
            torch.nn.functional.linear(x, w)

    paths["torch.nn.functional.linear"] = lambda: timed(aten)
    engine_path = gemm_path(dtype)
    if engine_path is not None:  # the GEMM the engine itself runs on this CPU
        packed = [pack_linear_weight(w) for w in weights]

        def engine_gemm() -> None:
            for x, w, p in zip(inputs, weights, packed):
                linear(x, w, None, p)

        paths[engine_path] = lambda: timed(engine_gemm)
    results = {name: measure() for name, measure in paths.items()}
    best = max(results, key=results.get)
    return Peak(results[best], best)
