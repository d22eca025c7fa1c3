"""`python -m berth.kernels.gpu_check`: the Triton kernels on a CUDA GPU.

1. Correctness: every Triton kernel against the torch reference, in bfloat16 and float32, on
   Llama-sized shapes (mixed prefill + decode batches, chunked prefill, long decodes that the
   decode kernel splits into segments).
2. Speed: prefill and decode attention, Triton vs the torch reference vs dense
   `scaled_dot_product_attention` on the same data, timed in the same run.

Exit status: 0 when every check passes, 1 when one fails, 2 when no CUDA device (or no triton)
is present. Takes a few minutes on one GPU, most of it building the batches and compiling.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from berth.kernels import reference
from berth.kernels.rope import rope_cos_sin_cache
from berth.kernels.synthetic_batch import PagedBatch, random_paged_batch
from berth.kernels.tolerances import TOLERANCES

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class AttentionCase:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (cached tokens, new tokens) per sequence
    num_prefills: int
    num_q_heads: int = 32  # Llama-3-8B: 32 query heads, 8 KV heads of 128
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16

    def batch(self, dtype: torch.dtype, device: torch.device, seed: int = 0) -> PagedBatch:
        return random_paged_batch(
            self.seqs, self.num_prefills, self.num_q_heads, self.num_kv_heads, self.head_dim,
            self.block_size, dtype, device, seed,
        )  # fmt: skip


_MIXED = ((0, 1000), (700, 300), (0, 7), (0, 1), (15, 1), (4000, 1), (333, 1))
CHECK_CASES = (
    AttentionCase("llama8b mixed prefill+decode", _MIXED, 3),
    AttentionCase("head 64, block 32, 8:2 heads", _MIXED, 3, 8, 2, 64, 32),
    AttentionCase("head 96, 12:4 heads, chunked", ((1200, 77), (0, 513), (31, 1), (2047, 1)), 2, 12, 4, 96),
    AttentionCase("long decodes (segments)", ((16000, 1), (3000, 1), (5, 1)), 0),
)
BENCH_CASES = (
    AttentionCase("decode 64 x 1k", ((1023, 1),) * 64, 0),
    AttentionCase("decode 64 x 4k", ((4095, 1),) * 64, 0),
    AttentionCase("decode 64 x 16k", ((16383, 1),) * 64, 0),
    AttentionCase("prefill 8 x 1k", ((0, 1024),) * 8, 8),
)


@dataclass
class CheckResult:
    name: str
    dtype: torch.dtype
    max_error: float
    passed: bool

    def line(self) -> str:
        verdict = "ok  " if self.passed else "FAIL"
        dtype = str(self.dtype).removeprefix("torch.")
        return f"  {verdict} {self.name:<40} {dtype:<9} max |error| {self.max_error:.2e}"


def _compare(name: str, actual: torch.Tensor, expected: torch.Tensor, kind: str) -> CheckResult:
    """Within TOLERANCES elementwise (NaN never is); the max error is for the reader."""
    dtype = expected.dtype
    atol, rtol = TOLERANCES[kind, dtype]
    actual, expected = actual.float(), expected.float()
    passed = actual.shape == expected.shape and bool(torch.isclose(actual, expected, rtol, atol).all())
    max_error = float((actual - expected).abs().nan_to_num(float("inf")).max())
    return CheckResult(name, dtype, max_error, passed)


def check_kernels(
    device: torch.device,
    dtypes: Sequence[torch.dtype] = (torch.bfloat16, torch.float32),
    num_tokens: int = 1000,
    hidden_size: int = 4096,
    intermediate_size: int = 14336,
    attention_cases: Sequence[AttentionCase] = CHECK_CASES,
) -> list[CheckResult]:
    """Each Triton kernel against the reference on the same inputs."""
    from berth.kernels import triton_ops

    results = []
    generator = torch.Generator(device=device).manual_seed(0)

    for dtype in dtypes:

        def randn(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, device=device).to(dtype)

        def compare(
            name: str, actual: torch.Tensor, expected: torch.Tensor, kind: str = "elementwise"
        ) -> None:
            results.append(_compare(name, actual, expected, kind))

        x, residual, weight = (
            randn(num_tokens, hidden_size),
            randn(num_tokens, hidden_size),
            randn(hidden_size),
        )
        compare("rms_norm", triton_ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
        actual = triton_ops.rms_norm(x, weight, 1e-5, residual)
        expected = reference.rms_norm(x, weight, 1e-5, residual)
        compare("rms_norm + residual (normed)", actual[0], expected[0])
        compare("rms_norm + residual (sum)", actual[1], expected[1])

        gate_up = randn(num_tokens, 2 * intermediate_size)
        compare("silu_and_mul", triton_ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))

        case = attention_cases[0]
        head_dim = case.head_dim
        cos_sin = rope_cos_sin_cache(head_dim, 8192, 500000.0, LLAMA3_SCALING).to(device)
        positions = torch.randint(0, 8192, (num_tokens,), generator=generator, device=device)
        query, key = (
            randn(num_tokens, case.num_q_heads, head_dim),
            randn(num_tokens, case.num_kv_heads, head_dim),
        )
        expected_query, expected_key = query.clone(), key.clone()
        reference.rotary_embedding(positions, expected_query, expected_key, cos_sin)
        triton_ops.rotary_embedding(positions, query, key, cos_sin)
        compare("rotary_embedding (query, llama3)", query, expected_query)
        compare("rotary_embedding (key, llama3)", key, expected_key)

        num_blocks = -(-num_tokens // case.block_size) + 4
        cache_shape = (num_blocks, case.block_size, case.num_kv_heads, head_dim)
        slots = torch.randperm(num_blocks * case.block_size, generator=generator, device=device)[:num_tokens]
        caches = [randn(*cache_shape), randn(*cache_shape)]
        expected_caches = [cache.clone() for cache in caches]
        new_key, new_value = randn(*key.shape), randn(*key.shape)
        reference.write_kv_cache(new_key, new_value, *expected_caches, slots)
        triton_ops.write_kv_cache(new_key, new_value, *caches, slots)
        compare("write_kv_cache (key cache)", caches[0], expected_caches[0])
        compare("write_kv_cache (value cache)", caches[1], expected_caches[1])

        for case in attention_cases:
            batch = case.batch(dtype, device)
            args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata, case.head_dim**-0.5)
            compare(
                f"paged_attention: {case.name}",
                triton_ops.paged_attention(*args),
                reference.paged_attention(*args),
                "attention",
            )
            del batch
    return results


@dataclass
class BenchRow:
    case: str
    triton_ms: float
    reference_ms: float
    sdpa_ms: float
    throughput: str  # of the Triton kernel: GB/s of KV read (decode), TFLOP/s (prefill)
    matches: bool  # Triton's output was within tolerance of the reference's and dense SDPA's


def cuda_timer(fn: Callable[[], object]) -> float:
    """Median milliseconds per call, CUDA-event timed, L2 flushed between calls."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def benchmark_attention(
    device: torch.device,
    cases: Sequence[AttentionCase] = BENCH_CASES,
    timer: Callable[[Callable[[], object]], float] = cuda_timer,
    dtype: torch.dtype = torch.bfloat16,
) -> list[BenchRow]:
    """Triton vs the reference vs dense SDPA, each case's three timed on the same data.

    Dense SDPA is the bar to beat: the same attention without paging, on contiguous
    [B, H, S, D] tensors (all sequences of a case have the same shape).
    """
    from berth.kernels import triton_ops

    rows = []
    for case in cases:
        batch = case.batch(dtype, device)
        scale = case.head_dim**-0.5
        args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale)
        triton_out = triton_ops.paged_attention(*args)  # also compiles
        reference_ms = _time_or_nan(timer, lambda args=args: reference.paged_attention(*args))
        matches = math.isnan(reference_ms) or (  # NaN: the reference ran out of memory
            _compare(case.name, triton_out, reference.paged_attention(*args), "attention").passed
        )
        triton_ms = timer(lambda args=args: triton_ops.paged_attention(*args))
        dense_sdpa = _dense_sdpa(batch, case, scale)
        dense_out = dense_sdpa().transpose(1, 2).reshape(triton_out.shape)  # same attention, unpaged
        matches = matches and _compare(case.name, triton_out, dense_out, "attention").passed
        sdpa_ms = _time_or_nan(timer, dense_sdpa)
        rows.append(
            BenchRow(
                case.name, triton_ms, reference_ms, sdpa_ms, _throughput(case, dtype, triton_ms), matches
            )
        )
        del batch, args, triton_out, dense_sdpa, dense_out
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _time_or_nan(timer: Callable[[Callable[[], object]], float], fn: Callable[[], object]) -> float:
    try:
        return timer(fn)
    except torch.cuda.OutOfMemoryError:  # the reference's dense copies on a smaller GPU
        torch.cuda.empty_cache()
        return float("nan")


def _dense_sdpa(batch: PagedBatch, case: AttentionCase, scale: float) -> Callable[[], torch.Tensor]:
    num_new = case.seqs[0][1]
    keys, values = zip(*(batch.dense_kv(seq) for seq in range(len(case.seqs))))
    key = torch.stack(keys).transpose(1, 2).contiguous()  # [B, Hk, S, D]
    value = torch.stack(values).transpose(1, 2).contiguous()
    query = batch.query.view(len(case.seqs), num_new, case.num_q_heads, case.head_dim).transpose(1, 2)
    query = query.contiguous()  # [B, Hq, Q, D]
    # A prefill without cached tokens is plain causal attention; a decode's one query sees all.
    causal = num_new > 1
    try:
        F.scaled_dot_product_attention(query[:1, :, :1], key[:1], value[:1], enable_gqa=True)
    except (TypeError, RuntimeError):  # torch < 2.5: no grouped-query SDPA, repeat the KV heads
        group = case.num_q_heads // case.num_kv_heads
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        return lambda: F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale)
    return lambda: F.scaled_dot_product_attention(
        query, key, value, is_causal=causal, scale=scale, enable_gqa=True
    )


def _throughput(case: AttentionCase, dtype: torch.dtype, triton_ms: float) -> str:
    seconds = triton_ms / 1e3
    if case.num_prefills == 0:
        tokens = sum(cached + new for cached, new in case.seqs)
        kv_bytes = 2 * tokens * case.num_kv_heads * case.head_dim * dtype.itemsize
        return f"{kv_bytes / seconds / 1e9:,.0f} GB/s"
    # Causal: query i of a sequence sees (cached + i + 1) keys; 2 matmuls of 2 flops per MAC.
    pairs = sum(new * cached + new * (new + 1) // 2 for cached, new in case.seqs)
    flops = 4 * pairs * case.num_q_heads * case.head_dim
    return f"{flops / seconds / 1e12:,.1f} TFLOP/s"


def format_table(rows: Sequence[BenchRow]) -> str:
    header = (
        f"{'case':<18} {'Triton ms':>10} {'torch ref ms':>13} {'SDPA dense ms':>14} "
        f"{'ref/Triton':>11} {'SDPA/Triton':>12} {'Triton throughput':>18}  matches ref"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.case:<18} {row.triton_ms:>10.3f} {row.reference_ms:>13.3f} {row.sdpa_ms:>14.3f} "
            f"{row.reference_ms / row.triton_ms:>10.2f}x {row.sdpa_ms / row.triton_ms:>11.2f}x "
            f"{row.throughput:>18}  {'yes' if row.matches else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m berth.kernels.gpu_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--no-bench", action="store_true", help="correctness checks only")
    parser.add_argument("--no-check", action="store_true", help="timings only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
            "Run it on a machine with an NVIDIA GPU and a CUDA build of torch.",
            file=sys.stderr,
        )
        return 2
    try:
        import triton
    except ImportError:
        print("gpu_check: triton is not installed (pip install 'berth[triton]')", file=sys.stderr)
        return 2

    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}: torch {torch.__version__}, triton {triton.__version__}")
    failed = False
    if not args.no_check:
        started = time.perf_counter()
        print("\nTriton kernels vs the torch reference:")
        results = check_kernels(device)
        for result in results:
            print(result.line())
        failed = not all(result.passed for result in results)
        passed = sum(result.passed for result in results)
        print(f"  {passed}/{len(results)} passed in {time.perf_counter() - started:.0f} s")
    if not args.no_bench:
        print("\nAttention, bfloat16, 32 query / 8 KV heads of 128, block 16 (median of CUDA-event timings):")
        rows = benchmark_attention(device)
        print(format_table(rows))
        failed = failed or not all(row.matches for row in rows)
    print("\nFAILED" if failed else "\nOK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
