"""The decoder-only causal LM every family is, over a flat batch of tokens and a paged KV cache.

The forward pass takes the tokens of many sequences concatenated (no padding) and an
`AttentionMetadata` that tells the attention kernel where each sequence's cached keys and
values live. A family (llama.py, qwen3.py, mixtral.py, ...) is a subclass that says how its
layers differ: the attention's options, how its checkpoints name weights; whether a layer's
MLP is dense or a sparse MoE block comes from the config (`ModelConfig.sparse_layers`).

Sharded over a `TensorParallelGroup` (`parallel.py` says which rank holds what), every module
is built at its shard's size and loads only its shard: a rank never holds, nor reads from the
checkpoint, the weights of another. The kernels read head counts from tensor shapes, so they
run a rank's heads unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from berth import kernels
from berth.engine.models.attention import Attention, AttentionOptions
from berth.engine.models.config import ModelConfig
from berth.engine.models.layers import GatedMLP, Linear, RMSNorm, VocabParallelEmbedding
from berth.engine.models.moe import SparseMoeBlock
from berth.engine.models.parallel import SINGLE, TensorParallelGroup, attention_shard
from berth.engine.models.weights import CheckpointTensor, WeightLayout
from berth.kernels import AttentionMetadata


class DecoderLayer(nn.Module):
    def __init__(self, attention: Attention, mlp: nn.Module, config: ModelConfig, *, dtype, device) -> None:
        super().__init__()
        factory = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = mlp

    def forward(self, positions, hidden, residual, kv_cache, metadata, rope_cache):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata, rope_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(
        self, config: ModelConfig, layers: list[DecoderLayer], *, tp: TensorParallelGroup, dtype, device
    ) -> None:
        super().__init__()
        factory = dict(dtype=dtype, device=device)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp, **factory)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)


class DecoderForCausalLM(nn.Module):
    """Llama's layout; a family overrides the class attributes where its layers differ."""

    # RMSNorm over each head of q and k before RoPE (Qwen3).
    qk_norm: ClassVar[bool] = False
    # o_proj has a bias when the Q/K/V projections do (`attention_bias`); Qwen2's never has one.
    output_bias: ClassVar[bool] = True
    # Whether the MoE top-k weights are renormalised: None, as `norm_topk_prob` says.
    renormalize_top_k: ClassVar[bool | None] = None
    # (fragment, replacement) from the family's checkpoint names to the shared layers' names.
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.attention_shard = attention_shard(config.num_heads, config.num_kv_heads, tp.rank, tp.size)
        factory = dict(dtype=dtype, device=device)
        layers = [
            DecoderLayer(
                Attention(config, self.attention_options(layer), tp=tp, **factory),
                self._mlp(layer, tp, factory),
                config,
                **factory,
            )
            for layer in range(config.num_layers)
        ]
        self.model = DecoderModel(config, layers, tp=tp, **factory)
        # Vocab-parallel like the embedding (tied: it *is* this rank's rows of the embedding).
        embedding = self.model.embed_tokens
        tied = embedding.weight if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, embedding.rows, bias=False, **factory, weight=tied)
        self.rope_cache = kernels.rope_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        ).to(device)

    def attention_options(self, layer: int) -> AttentionOptions:
        c = self.config
        windows = c.sliding_windows
        return AttentionOptions(
            qkv_bias=c.attention_bias,
            output_bias=c.attention_bias and self.output_bias,
            qk_norm=self.qk_norm,
            sliding_window=windows[layer] if windows else None,
        )

    def _mlp(self, layer: int, tp: TensorParallelGroup, factory: dict) -> nn.Module:
        c = self.config
        if layer in c.sparse_layers:
            renormalize = c.norm_topk_prob if self.renormalize_top_k is None else self.renormalize_top_k
            return SparseMoeBlock(c, renormalize=renormalize, tp=tp, **factory)
        return GatedMLP(c.hidden_size, c.intermediate_size, tp=tp, **factory)

    @property
    def supports_decode_graphs(self) -> bool:
        """A MoE block sizes its GEMMs on the host from each step's routing, which a captured
        CUDA graph cannot replay."""
        return not self.config.sparse_layers

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Returns float32 logits for the tokens at `logits_indices` only: on rank 0, which
        samples; every other rank returns None (its share of the logits went to rank 0)."""
        hidden, residual = self.model.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata, self.rope_cache)
        hidden = hidden.index_select(0, logits_indices)
        residual = residual.index_select(0, logits_indices)
        hidden, _ = self.model.norm(hidden, residual)
        logits = self.tp.gather_to_leader(self.lm_head(hidden).float())
        # Every rank holds ceil(V / N) rows: the columns past the vocabulary are padding.
        return logits[:, : self.config.vocab_size] if logits is not None else None

    def pack_weights(self) -> None:
        """Lets the kernel backend lay out every GEMM weight for itself; call after loading."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Reads this rank's shard of every checkpoint tensor into the (fused) parameters; every
        parameter must be covered. Only the shard is read (`CheckpointTensor.read`)."""
        layout = WeightLayout(self.config, self.tp, self.attention_shard, self.checkpoint_renames)
        layout.load(self, weights)
