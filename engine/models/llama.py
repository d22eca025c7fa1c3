"""Llama-family decoder (Llama, Qwen2) over a flat batch of tokens and a paged KV cache.

The forward pass takes the tokens of many sequences concatenated (no padding) and an
`AttentionMetadata` that tells the attention kernel where each sequence's cached keys and
values live. Q/K/V and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from berth import kernels
from berth.engine.models.config import ModelConfig
from berth.engine.models.layers import Embedding, Linear, RMSNorm
from berth.kernels import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype, device) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.split_sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.scale = self.head_dim**-0.5
        factory = dict(dtype=dtype, device=device)
        self.qkv_proj = Linear(
            config.hidden_size, sum(self.split_sizes), bias=config.attention_bias, **factory
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False, **factory)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rope_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = (
            part.reshape(num_tokens, -1, self.head_dim).contiguous()
            for part in self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        )
        kernels.rotary_embedding(positions, q, k, rope_cache)
        key_cache, value_cache = kv_cache
        kernels.write_kv_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = kernels.paged_attention(q, key_cache, value_cache, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype, device) -> None:
        super().__init__()
        factory = dict(dtype=dtype, device=device)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, **factory)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype, device) -> None:
        super().__init__()
        factory = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = Attention(config, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = MLP(config, **factory)

    def forward(self, positions, hidden, residual, kv_cache, metadata, rope_cache):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata, rope_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype, device) -> None:
        super().__init__()
        factory = dict(dtype=dtype, device=device)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, **factory) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter, which slice of it)
    stacked_params: ClassVar[dict[str, tuple[str, int]]] = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device
            )
        self.rope_cache = kernels.rope_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        ).to(device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Returns float32 logits for the tokens at `logits_indices` only."""
        hidden, residual = self.model.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata, self.rope_cache)
        hidden = hidden.index_select(0, logits_indices)
        residual = residual.index_select(0, logits_indices)
        hidden, _ = self.model.norm(hidden, residual)
        return torch.nn.functional.linear(hidden, self.lm_head.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors into the (fused) parameters; every parameter must be covered."""
        params = dict(self.named_parameters())
        loaded: dict[str, set[int]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            target, index = name, 0
            for fragment, (fused, slice_index) in self.stacked_params.items():
                if fragment in name:
                    target, index = name.replace(fragment, fused), slice_index
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} does not belong to this model")
            destination = params[target].data
            if target != name:
                destination = destination.narrow(0, *self._slice(target, index))
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(destination.shape)}"
                )
            destination.copy_(tensor)
            loaded.setdefault(target, set()).add(index)
        missing = sorted(name for name in params if len(loaded.get(name, ())) < self._num_slices(name))
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")

    @staticmethod
    def _num_slices(name: str) -> int:
        return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1

    def _slice(self, target: str, index: int) -> tuple[int, int]:
        c = self.config
        if ".qkv_proj." in target:
            sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        else:
            sizes = [c.intermediate_size, c.intermediate_size]
        return sum(sizes[:index]), sizes[index]


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 is Llama with biases on the Q/K/V projections (`ModelConfig.attention_bias`)."""
