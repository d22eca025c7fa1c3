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

from berth.engine.models.attention import Attention, AttentionOptions
from berth.engine.models.config import ModelConfig
from berth.engine.models.layers import GatedMLP, Linear, RMSNorm, VocabParallelEmbedding
from berth.engine.models.moe import SparseMoeBlock
from berth.engine.models.parallel import SINGLE, TensorParallelGroup, attention_shard
from berth.engine.models.rotary import RotaryTables
from berth.engine.models.weights import CheckpointTensor, WeightLayout
from berth.kernels import AttentionMetadata


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream. With `sandwich_norms`
    (Gemma) each one's output is normalised too before it is added: four norms, named as Gemma's
    checkpoints name them (its `post_attention_layernorm` is the attention output's, and
    `pre_feedforward_layernorm` the MLP input's, which Llama calls `post_attention_layernorm`)."""

    def __init__(
        self,
        attention: Attention,
        mlp: nn.Module,
        config: ModelConfig,
        *,
        dtype,
        device,
        unit_offset: bool = False,
        sandwich_norms: bool = False,
    ) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(
                config.hidden_size, config.rms_norm_eps, unit_offset=unit_offset, dtype=dtype, device=device
            )

        self.input_layernorm = norm()
        self.self_attn = attention
        self.post_attention_layernorm = norm()
        self.sandwich_norms = sandwich_norms
        if sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = mlp

    def forward(self, positions, hidden, residual, kv_cache, metadata, rope_cache):
        """Returns (this layer's output, the residual stream before it): the next norm adds them."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata, rope_cache)
        if not self.sandwich_norms:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layers: list[DecoderLayer],
        *,
        tp: TensorParallelGroup,
        dtype,
        device,
        unit_offset: bool = False,
    ) -> None:
        super().__init__()
        factory = dict(dtype=dtype, device=device)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp, **factory)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=unit_offset, **factory)


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
    # Gemma's layout: every RMSNorm scales by 1 + weight; four norms a layer; the embeddings
    # times sqrt(hidden_size), that factor rounded to the model's dtype as transformers does.
    unit_offset_norms: ClassVar[bool] = False
    sandwich_norms: ClassVar[bool] = False
    scale_embeddings: ClassVar[bool] = False

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        refuse_unsupported(config)
        self.config = config
        self.tp = tp
        self.attention_shard = attention_shard(config.num_heads, config.num_kv_heads, tp.rank, tp.size)
        factory = dict(dtype=dtype, device=device)
        layers = [
            DecoderLayer(
                Attention(config, self.attention_options(layer), tp=tp, **factory),
                self._mlp(layer, tp, factory),
                config,
                unit_offset=self.unit_offset_norms,
                sandwich_norms=self.sandwich_norms,
                **factory,
            )
            for layer in range(config.num_layers)
        ]
        self.model = DecoderModel(config, layers, tp=tp, unit_offset=self.unit_offset_norms, **factory)
        self.embedding_scale = (
            float(torch.tensor(config.hidden_size**0.5).to(dtype)) if self.scale_embeddings else None
        )
        # Vocab-parallel like the embedding (tied: it *is* this rank's rows of the embedding).
        embedding = self.model.embed_tokens
        tied = embedding.weight if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, embedding.rows, bias=False, **factory, weight=tied)
        # Every layer's RoPE table in one tensor (rotary.py): most models have one.
        self.rotary = RotaryTables(config, [window is not None for window in self._windows()])
        self.rope_cache = self.rotary.table.to(device)

    def _windows(self) -> tuple[int | None, ...]:
        return self.config.sliding_windows or (None,) * self.config.num_layers

    def attention_options(self, layer: int) -> AttentionOptions:
        c = self.config
        return AttentionOptions(
            qkv_bias=c.attention_bias,
            output_bias=c.attention_bias and self.output_bias,
            qk_norm=self.qk_norm,
            qk_norm_unit_offset=self.unit_offset_norms,
            sliding_window=self._windows()[layer],
            scale=None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar**-0.5,
        )

    def _mlp(self, layer: int, tp: TensorParallelGroup, factory: dict) -> nn.Module:
        c = self.config
        if layer in c.sparse_layers:
            renormalize = c.norm_topk_prob if self.renormalize_top_k is None else self.renormalize_top_k
            return SparseMoeBlock(c, renormalize=renormalize, tp=tp, **factory)
        return GatedMLP(c.hidden_size, c.intermediate_size, tp=tp, activation=c.hidden_act, **factory)

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
        if self.embedding_scale is not None:
            hidden = hidden * self.embedding_scale
        rows = [positions] if self.rotary.is_plain else self.rotary.rows(positions, metadata)
        for layer, kv_cache, kind in zip(self.model.layers, kv_caches, self.rotary.layer_kinds):
            hidden, residual = layer(rows[kind], hidden, residual, kv_cache, metadata, self.rope_cache)
        hidden = hidden.index_select(0, logits_indices)
        residual = residual.index_select(0, logits_indices)
        hidden, _ = self.model.norm(hidden, residual)
        logits = self.tp.gather_to_leader(self.lm_head(hidden).float())
        if logits is None:
            return None
        # Every rank holds ceil(V / N) rows: the columns past the vocabulary are padding.
        logits = logits[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

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


def refuse_unsupported(config: ModelConfig) -> None:
    """What a config may ask for that berth does not do: refused at load, naming the field,
    rather than served without it."""
    name = config.architecture or "this model"
    if config.attn_logit_softcapping is not None:
        raise ValueError(
            f"{name}: config.json sets attn_logit_softcapping={config.attn_logit_softcapping}, and "
            "berth's attention kernels have no soft-capping of the attention scores (transformers' "
            "Gemma 3 does not apply it either); set it to null to serve the model without it"
        )
    if config.use_bidirectional_attention:
        raise ValueError(
            f"{name}: config.json sets use_bidirectional_attention (an embedding model's attention, "
            "which sees the tokens after too); berth serves causal language models only"
        )
