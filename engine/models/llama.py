"""Llama-family decoder (Llama, Qwen2) over a flat batch of tokens and a paged KV cache.

The forward pass takes the tokens of many sequences concatenated (no padding) and an
`AttentionMetadata` that tells the attention kernel where each sequence's cached keys and
values live. Q/K/V and gate/up projections are fused into one matmul each.

Sharded over a `TensorParallelGroup` (`parallel.py` says which rank holds what), every module
is built at its shard's size and loads only its shard: a rank never holds, nor reads from the
checkpoint, the weights of another. The kernels read head counts from tensor shapes, so they
run a rank's heads unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Protocol

import torch
from torch import nn

from berth import kernels
from berth.engine.models.config import ModelConfig
from berth.engine.models.layers import Linear, RMSNorm, VocabParallelEmbedding
from berth.engine.models.parallel import SINGLE, TensorParallelGroup, attention_shard, even_split, vocab_split
from berth.kernels import AttentionMetadata


class CheckpointTensor(Protocol):
    """A tensor in a checkpoint file, not read yet (`loader.StoredTensor`)."""

    shape: tuple[int, ...]

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        """All of it, or only [start, start + length) along `dim`."""


class Attention(nn.Module):
    """Column-parallel Q/K/V (this rank's heads), row-parallel o_proj (one all-reduce)."""

    def __init__(self, config: ModelConfig, *, tp: TensorParallelGroup, dtype, device) -> None:
        super().__init__()
        self.tp = tp
        shard = attention_shard(config.num_heads, config.num_kv_heads, tp.rank, tp.size)
        self.head_dim = config.head_dim
        self.split_sizes = [shard.num_heads * self.head_dim] + [shard.num_kv_heads * self.head_dim] * 2
        self.scale = self.head_dim**-0.5
        factory = dict(dtype=dtype, device=device)
        self.qkv_proj = Linear(
            config.hidden_size, sum(self.split_sizes), bias=config.attention_bias, **factory
        )
        self.o_proj = Linear(shard.num_heads * self.head_dim, config.hidden_size, bias=False, **factory)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rope_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # Views of the fused projection's output (every kernel takes a row stride): no copies.
        q, k, v = (
            part.view(num_tokens, -1, self.head_dim)
            for part in self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        )
        kernels.rotary_embedding(positions, q, k, rope_cache)
        key_cache, value_cache = kv_cache
        kernels.write_kv_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = kernels.paged_attention(q, key_cache, value_cache, metadata, self.scale)
        # Each rank's heads give a partial sum of the projection: summed over the ranks.
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, -1)))


class MLP(nn.Module):
    """Column-parallel gate/up, row-parallel down (one all-reduce)."""

    def __init__(self, config: ModelConfig, *, tp: TensorParallelGroup, dtype, device) -> None:
        super().__init__()
        self.tp = tp
        _, intermediate = even_split(config.intermediate_size, tp.rank, tp.size, "intermediate size")
        factory = dict(dtype=dtype, device=device)
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate, bias=False, **factory)
        self.down_proj = Linear(intermediate, config.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, *, tp: TensorParallelGroup, dtype, device) -> None:
        super().__init__()
        factory = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = Attention(config, tp=tp, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = MLP(config, tp=tp, **factory)

    def forward(self, positions, hidden, residual, kv_cache, metadata, rope_cache):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata, rope_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, *, tp: TensorParallelGroup, dtype, device) -> None:
        super().__init__()
        factory = dict(dtype=dtype, device=device)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, tp=tp, **factory) for _ in range(config.num_layers))
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
        self.model = DecoderModel(config, tp=tp, dtype=dtype, device=device)
        # Vocab-parallel like the embedding (tied: it *is* this rank's rows of the embedding).
        embedding = self.model.embed_tokens
        tied = embedding.weight if config.tie_word_embeddings else None
        self.lm_head = Linear(
            config.hidden_size, embedding.rows, bias=False, dtype=dtype, device=device, weight=tied
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
        params = dict(self.named_parameters())
        loaded: dict[str, set[int]] = {}
        for name, source in weights:
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
                destination = destination.narrow(0, *self._fused_slice(target, index))
            shard = self._shard_of(target, index)
            if shard is None:
                tensor = source.read()
            else:
                dim, start, length = shard
                if start + length > source.shape[dim]:
                    raise ValueError(f"{name}: checkpoint shape {tuple(source.shape)} is too small to shard")
                tensor = source.read(dim, start, length)
                if target.endswith(("embed_tokens.weight", "lm_head.weight")):
                    destination[length:].zero_()  # padding rows past the vocabulary
                    destination = destination[:length]
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(source.shape)} gives this rank "
                    f"{tuple(tensor.shape)}, the model expects {tuple(destination.shape)}"
                )
            destination.copy_(tensor)
            loaded.setdefault(target, set()).add(index)
        missing = sorted(name for name in params if len(loaded.get(name, ())) < self._num_slices(name))
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")

    @staticmethod
    def _num_slices(name: str) -> int:
        return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1

    def _fused_slice(self, target: str, index: int) -> tuple[int, int]:
        """Where checkpoint tensor `index` of a fused parameter goes: (start, length) in dim 0."""
        c, shard = self.config, self.attention_shard
        if ".qkv_proj." in target:
            kv = shard.num_kv_heads * c.head_dim
            sizes = [shard.num_heads * c.head_dim, kv, kv]
        else:
            sizes = [even_split(c.intermediate_size, self.tp.rank, self.tp.size, "intermediate size")[1]] * 2
        return sum(sizes[:index]), sizes[index]

    def _shard_of(self, target: str, index: int) -> tuple[int, int, int] | None:
        """This rank's (dim, start, length) of a checkpoint tensor, or None when every rank
        holds all of it (norms)."""
        c, tp, shard = self.config, self.tp, self.attention_shard
        if tp.size == 1:
            return None
        if ".qkv_proj." in target:  # weight [out, in] or bias [out]: split by heads
            if index == 0:
                return 0, shard.first_head * c.head_dim, shard.num_heads * c.head_dim
            return 0, shard.first_kv_head * c.head_dim, shard.num_kv_heads * c.head_dim
        if ".o_proj." in target:
            return 1, shard.first_head * c.head_dim, shard.num_heads * c.head_dim
        if ".gate_up_proj." in target:
            return 0, *even_split(c.intermediate_size, tp.rank, tp.size, "intermediate size")
        if ".down_proj." in target:
            return 1, *even_split(c.intermediate_size, tp.rank, tp.size, "intermediate size")
        if target in ("model.embed_tokens.weight", "lm_head.weight"):
            start, held, _ = vocab_split(c.vocab_size, tp.rank, tp.size)
            return 0, start, held
        return None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 is Llama with biases on the Q/K/V projections (`ModelConfig.attention_bias`)."""
