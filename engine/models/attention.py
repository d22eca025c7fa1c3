"""The decoder's self-attention: one layer whose options cover the families berth serves.

Column-parallel Q/K/V (this rank's heads, one fused GEMM), row-parallel o_proj (one all-reduce).
What tells one family's attention from another's is an `AttentionOptions`, never a copy of the
layer: biases (Qwen2, Llama's `attention_bias`), an RMSNorm over each head of q and k before
RoPE (Qwen3; Gemma 3's scales by 1 + weight), a sliding window (Mistral, Gemma 3; Qwen2 / Qwen3
on some layers), the softmax scale (Gemma's `query_pre_attn_scalar`). Soft-capping of the
scores is not an option (no kernel has it): a config that sets `attn_logit_softcapping` is
refused at load (decoder.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from berth import kernels
from berth.engine.models.config import ModelConfig
from berth.engine.models.layers import Linear, RMSNorm
from berth.engine.models.parallel import TensorParallelGroup, attention_shard
from berth.kernels import AttentionMetadata


@dataclass(frozen=True)
class AttentionOptions:
    qkv_bias: bool = False
    output_bias: bool = False
    # RMSNorm over each head's head_dim features of q and k, before RoPE (Qwen3, Gemma 3);
    # Gemma's scales by 1 + weight (`layers.RMSNorm`'s unit_offset).
    qk_norm: bool = False
    qk_norm_unit_offset: bool = False
    # A token sees only the last `sliding_window` positions, itself included (transformers').
    sliding_window: int | None = None
    # The softmax scale; None: head_dim ** -0.5 (Gemma's: query_pre_attn_scalar ** -0.5).
    scale: float | None = None


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, options: AttentionOptions, *, tp: TensorParallelGroup, dtype, device
    ) -> None:
        super().__init__()
        self.tp = tp
        shard = attention_shard(config.num_heads, config.num_kv_heads, tp.rank, tp.size)
        self.head_dim = config.head_dim
        self.split_sizes = [shard.num_heads * self.head_dim] + [shard.num_kv_heads * self.head_dim] * 2
        self.scale = options.scale if options.scale is not None else self.head_dim**-0.5
        self.sliding_window = options.sliding_window
        factory = dict(dtype=dtype, device=device)
        self.qkv_proj = Linear(config.hidden_size, sum(self.split_sizes), bias=options.qkv_bias, **factory)
        self.o_proj = Linear(
            shard.num_heads * self.head_dim, config.hidden_size, bias=options.output_bias, **factory
        )
        # One weight of head_dim, shared by every head (so replicated on every rank).
        self.q_norm = self.k_norm = None
        if options.qk_norm:
            offset = options.qk_norm_unit_offset
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=offset, **factory)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=offset, **factory)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rope_cache: torch.Tensor,
    ) -> torch.Tensor:
        """`positions`: each token's row of `rope_cache` (its position, offset where a model has
        more than one table: rotary.py)."""
        num_tokens = hidden.shape[0]
        # Views of the fused projection's output (every kernel takes a row stride): no copies.
        q, k, v = (
            part.view(num_tokens, -1, self.head_dim)
            for part in self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        )
        if self.q_norm is not None:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        kernels.rotary_embedding(positions, q, k, rope_cache)
        key_cache, value_cache = kv_cache
        kernels.write_kv_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = kernels.paged_attention(q, key_cache, value_cache, metadata, self.scale, self.sliding_window)
        # Each rank's heads give a partial sum of the projection: summed over the ranks, and the
        # bias added once to the sum.
        out = self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, -1), add_bias=False))
        return out if self.o_proj.bias is None else out + self.o_proj.bias
