"""The Triton kernels on CUDA: each against the torch reference at Llama-3-8B's shapes and the
tiny test model's, in bfloat16 and float16, within `kernels/tolerances.py`; then attention timed
against torch (prefill: dense `scaled_dot_product_attention`; paged decode: the reference, which
gathers the context and runs SDPA), and the decode kernel's KV read rate as a share of the
device's measured copy bandwidth."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from berth.engine.bench.gpu.ceilings import copy_bandwidth, median_ms
from berth.engine.bench.gpu.result import CheckResult, check_main
from berth.kernels.gpu_check import (
    BENCH_CASES,
    CHECK_CASES,
    AttentionCase,
    benchmark_attention,
    check_kernels,
    cuda_timer,
)

# The tiny test model's attention (`berth make-tiny-model`'s defaults): head dim 16, 4 / 2 heads.
TINY_CASES = (
    AttentionCase("tiny mixed prefill+decode", ((0, 20), (9, 4), (40, 1), (0, 1)), 2, 4, 2, 16, 16),
    AttentionCase("tiny long decodes (segments)", ((3000, 1), (700, 1), (3, 1)), 0, 4, 2, 16, 16),
)
DRY_RUN_CASES = (
    AttentionCase("decode 4 x 100", ((99, 1),) * 4, 0, 4, 2, 64, 16),
    AttentionCase("prefill 2 x 24", ((0, 24),) * 2, 2, 4, 2, 64, 16),
)
DTYPES = (torch.bfloat16, torch.float16)
# The decode kernel streams the KV cache; the bar for it, as a share of copy bandwidth.
DECODE_BANDWIDTH_GOAL = 0.5


def check(result: CheckResult, dry_run: bool, workdir: Path) -> None:
    device = torch.device("cpu" if dry_run else "cuda")
    shapes = [
        ("llama-3-8b", dict(hidden_size=4096, intermediate_size=14336, attention_cases=CHECK_CASES)),
        ("tiny", dict(hidden_size=64, intermediate_size=128, attention_cases=TINY_CASES)),
    ]
    if dry_run:  # the interpreter runs Llama-sized attention for minutes
        shapes = [("tiny", dict(hidden_size=64, intermediate_size=128, attention_cases=TINY_CASES[:1]))]
    for label, shape in shapes:
        checks = check_kernels(device, DTYPES, num_tokens=9 if dry_run else 1000, **shape)
        failed = [c for c in checks if not c.passed]
        worst = {dtype: max(c.max_error for c in checks if c.dtype == dtype) for dtype in DTYPES}
        result.metrics[f"max_error_{label}"] = {str(d).removeprefix("torch."): e for d, e in worst.items()}
        result.add(
            f"{len(checks)} kernel checks at {label} shapes (bf16, fp16)",
            f"{len(checks) - len(failed)} within tolerance; max |error| bf16 {worst[torch.bfloat16]:.1e}, "
            f"fp16 {worst[torch.float16]:.1e}",
            "all within kernels/tolerances.py",
            not failed,
        )
        for failure in failed:
            result.note(f"outside tolerance: {failure.line().strip()}")

    bandwidth = copy_bandwidth(device, 64 << 20 if dry_run else 4 << 30)
    result.metrics["copy_bandwidth_bytes_per_s"] = bandwidth
    timer = (lambda fn: median_ms(fn, device, warmup=1, repeat=2)) if dry_run else cuda_timer
    rows = benchmark_attention(device, DRY_RUN_CASES if dry_run else BENCH_CASES, timer, torch.bfloat16)
    result.metrics["attention_bf16"] = [row.__dict__ for row in rows]
    for row, case in zip(rows, DRY_RUN_CASES if dry_run else BENCH_CASES):
        if case.num_prefills:
            torch_ms, against = row.sdpa_ms, "dense SDPA"
            detail = f"{row.throughput}"
        else:
            torch_ms, against = row.reference_ms, "gather + SDPA"
            kv_bytes = 2 * sum(c + n for c, n in case.seqs) * case.num_kv_heads * case.head_dim * 2
            share = kv_bytes / (row.triton_ms / 1e3) / bandwidth
            result.metrics[f"decode_bandwidth_share {case.name}"] = share
            detail = f"{row.throughput} = {100 * share:.0f} % of copy bandwidth"
        result.add(
            f"attention {case.name} (bf16)",
            f"Triton {row.triton_ms:.3f} ms vs {against} {torch_ms:.3f} ms "
            f"({torch_ms / row.triton_ms:.2f}x); {detail}",
            "matches the reference",
            row.matches,
        )


def main(argv: list[str] | None = None) -> int:
    return check_main("kernels", __doc__.split("\n")[0], check, argv)


if __name__ == "__main__":
    sys.exit(main())
