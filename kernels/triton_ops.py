"""The kernel interface implemented with Triton: same signatures and semantics as `reference`.

Each function validates nothing beyond what the kernels need and launches the kernels in
`berth.kernels.triton_kernels`; the torch reference stays the definition of correct.
"""

from __future__ import annotations

import torch

from berth.kernels import reference
from berth.kernels.metadata import AttentionMetadata
from berth.kernels.reference import pack_linear_weight  # the weights are used as they are
from berth.kernels.triton_kernels.activation import silu_and_mul
from berth.kernels.triton_kernels.attention_decode import decode_attention
from berth.kernels.triton_kernels.attention_prefill import prefill_attention
from berth.kernels.triton_kernels.gemv import gemv
from berth.kernels.triton_kernels.kv_cache import write_kv_cache
from berth.kernels.triton_kernels.rms_norm import rms_norm
from berth.kernels.triton_kernels.rope import rotary_embedding

__all__ = [
    "linear",
    "pack_linear_weight",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv_cache",
]


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """torch's GEMM (cuBLAS), except for one row of 16-bit values while a CUDA graph is being
    captured (a batch-1 decode step), which `gemv` streams faster (its docstring has the
    figures). Eagerly, Triton's launch from Python costs more than it saves: measured on an
    H200 at Llama-3-8B's shapes, eager batch-1 decode took 16.7 ms a token with cuBLAS and
    24.7 ms with the GEMV; replayed from graphs, 5.27 ms and 4.78 ms."""
    if (
        x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and torch.cuda.is_current_stream_capturing()
    ):
        return gemv(x, weight, bias)
    return reference.linear(x, weight, bias, packed)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context: [T, Hq, D]; with
    a `window`, over the last `window` positions of it only."""
    md = metadata
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("KV caches need a unit stride on the head dim")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    # Prefills come first in the batch, decodes after: two launches over disjoint rows of `out`.
    if md.num_prefills:
        prefill_attention(
            out,
            query,
            key_cache,
            value_cache,
            md.query_start_loc[: md.num_prefills + 1],
            md.seq_lens[: md.num_prefills],
            md.block_tables[: md.num_prefills],
            md.num_prefill_tokens,
            scale,
            window,
        )
    if md.num_decodes:
        decode_attention(
            out,
            query,
            key_cache,
            value_cache,
            md.query_start_loc[md.num_prefills : md.num_seqs],
            md.seq_lens[md.num_prefills :],
            md.block_tables[md.num_prefills :],
            md.max_seq_len,
            scale,
            window=window,
        )
    return out
