"""Compiles every Triton kernel the engine launches for an H100 / H200 (sm_90), without a GPU.

The kernel tests run the kernels in Triton's interpreter, which checks what they compute but
not that Triton's compiler accepts them for a real GPU, nor that they fit its shared memory and
threads. Here Triton's driver is replaced by one that names a Hopper GPU as its target and
launches nothing: each launch of the engine's kernel functions (on CPU tensors, for their
dtypes, strides and specialisations) goes through Triton's real compiler down to a cubin
(`ptxas`, shipped with Triton), and the kernel's resources are checked against sm_90's limits
as Triton checks them before a launch. Their outputs are never written, so nothing is compared.

Triton's driver interface is internal: this follows Triton 3.x (3.6 on the GPU machine, the
suite's own version here).

    python tests/support/hopper_compile.py    # prints each kernel compiled; exit 1 on a failure
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch

# sm_90: 227 KiB of shared memory per block, at most 1,024 threads per block.
SM90_SHARED_MEMORY = 232_448
SM90_MAX_THREADS = 1024


class _Hopper:
    """The part of Triton's driver a compile and a launch use, for an sm_90 that runs nothing."""

    compiled: ClassVar[list[tuple[str, int, int]]] = []  # (kernel, shared memory bytes, warps)

    class utils:  # Triton reads `driver.utils.<function>`
        @staticmethod
        def get_device_properties(device: int) -> dict[str, int]:
            return {"max_shared_mem": SM90_SHARED_MEMORY, "multiprocessor_count": 132, "warpSize": 32}

        @staticmethod
        def load_binary(name, kernel, shared, device):
            return 0, 0, 0, 0, SM90_MAX_THREADS  # module, function, registers, spills, max threads

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_device_interface(self):
        return torch.cuda

    def launcher_cls(self, src, metadata):
        self.compiled.append((src.fn.__name__, metadata.shared, metadata.num_warps))
        return lambda *args, **kwargs: None


@contextmanager
def hopper_target() -> Iterator[list[tuple[str, int, int]]]:
    """Within it, every Triton launch compiles for sm_90 and runs nothing; yields what compiled."""
    from triton.runtime import driver

    driver.set_active(_Hopper())
    try:
        yield _Hopper.compiled
    finally:
        driver._active = None  # the next use creates the real driver again


def launch_every_kernel(dtype: torch.dtype) -> None:
    """Each kernel of the Triton backend, as the engine calls it, at Llama-3-8B's shapes (head
    dim 128, 32 query / 8 KV heads, block 16) and the tiny test model's (head dim 16, 4 / 2)."""
    from berth import kernels
    from berth.kernels.rope import rope_cos_sin_cache
    from berth.kernels.synthetic_batch import random_paged_batch
    from berth.kernels.triton_kernels.attention_decode import decode_attention
    from berth.kernels.triton_kernels.gemv import gemv

    seqs = ((0, 40), (20, 13), (300, 1), (5, 1))  # two prefills (one chunked), two decodes
    shapes = ((4096, 14336, 32, 8, 128), (64, 128, 4, 2, 16))  # hidden, intermediate, heads, head dim
    with kernels.use_backend("triton"):
        for hidden, intermediate, q_heads, kv_heads, head_dim in shapes:
            x = torch.randn(5, hidden).to(dtype)
            weight = torch.randn(hidden).to(dtype)
            kernels.rms_norm(x, weight, 1e-5)
            kernels.rms_norm(x, weight, 1e-5, x.clone())
            kernels.silu_and_mul(torch.randn(5, 2 * intermediate).to(dtype))
            # A graphed batch-1 decode's GEMMs: each of the GEMV's tile shapes, with a bias.
            row = torch.randn(1, hidden).to(dtype)
            for out_features in (3 * hidden, 16384):
                gemv(row, torch.randn(out_features, hidden).to(dtype), torch.randn(out_features).to(dtype))
            gemv(torch.randn(1, 9000).to(dtype), torch.randn(hidden, 9000).to(dtype))
            # As the attention layer calls them: views of the fused QKV projection's output.
            qkv = torch.randn(5, (q_heads + 2 * kv_heads) * head_dim).to(dtype)
            q, k, v = (
                part.view(5, -1, head_dim)
                for part in qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
            )
            cos_sin = rope_cos_sin_cache(head_dim, 512, 500000.0, None)
            kernels.rotary_embedding(torch.arange(5), q, k, cos_sin)
            cache = torch.zeros(8, 16, kv_heads, head_dim, dtype=dtype)
            kernels.write_kv_cache(k, v, cache, cache.clone(), torch.tensor([0, 1, -1, 30, 2]))
            cpu = torch.device("cpu")
            batch = random_paged_batch(seqs, 2, q_heads, kv_heads, head_dim, 16, dtype, cpu, seed=0)
            args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata, head_dim**-0.5)
            kernels.paged_attention(*args)
            # The decode kernel split into segments, then merged (long contexts, decode graphs).
            md = batch.metadata
            out = torch.empty_like(batch.query)
            rows = slice(md.num_prefills, md.num_seqs)
            decode_attention(
                out, batch.query[md.num_prefill_tokens :], batch.key_cache, batch.value_cache,
                md.query_start_loc[rows], md.seq_lens[rows], md.block_tables[rows], md.max_seq_len,
                head_dim**-0.5, segment_len=64,
            )  # fmt: skip


def main() -> int:
    failures = []
    with hopper_target() as compiled:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            try:
                launch_every_kernel(dtype)
            except Exception as error:  # a compile error, or a kernel over sm_90's limits
                failures.append(f"{dtype}: {type(error).__name__}: {error}")
    for name, shared, warps in compiled:
        print(f"compiled for sm_90: {name:<32} shared memory {shared:>7} B, {warps} warps")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures or not compiled else 0


if __name__ == "__main__":
    sys.exit(main())
