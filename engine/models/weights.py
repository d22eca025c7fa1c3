"""Where each tensor of a Hugging Face checkpoint goes in one rank's shard of a decoder model.

Most checkpoints name Q/K/V and gate/up separately; berth fuses each group into one parameter
(one GEMM), so a checkpoint tensor lands in a slice of its fused parameter. A checkpoint that
holds them fused (Phi-3) is read as the separate tensors the others hold (`unfused`), so each
part is sharded on its own. A MoE layer's experts come one tensor per expert and projection (as
transformers' save_pretrained writes them and the hub holds them), or as transformers holds them
in memory, two 3-D tensors for all the experts, which are read expert by expert
(`ExpertTensor`). A rank of a tensor-parallel world reads only
its shard of each tensor (`CheckpointTensor.read`), never the whole: heads for Q/K/V and o_proj,
intermediate features for gate/up and down (each expert's too), vocabulary rows for the
embedding and the LM head; norms and routers are whole on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from berth.engine.models.config import ModelConfig
from berth.engine.models.parallel import AttentionShard, TensorParallelGroup, even_split, vocab_split


class CheckpointTensor(Protocol):
    """A tensor in a checkpoint file, not read yet (`loader.StoredTensor`)."""

    shape: tuple[int, ...]

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        """All of it, or only [start, start + length) along `dim`."""

    def read_region(self, region: tuple[slice, ...]) -> torch.Tensor:
        """The part a slice per dim selects."""


class RegionReader:
    """A checkpoint tensor read through `read_region`: `read` is all of it, or a range of one dim."""

    shape: tuple[int, ...]

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        region = [slice(None)] * len(self.shape)
        if dim is not None:
            region[dim] = slice(start, self.shape[dim] if length is None else start + length)
        return self.read_region(tuple(region))

    def read_region(self, region: tuple[slice, ...]) -> torch.Tensor:
        raise NotImplementedError


class ExpertTensor:
    """Rows [first_row, first_row + num_rows) of expert `expert`'s matrix in a fused 3-D expert
    tensor [experts, rows, columns], read through it: only the part asked for."""

    def __init__(
        self, source: CheckpointTensor, expert: int, first_row: int = 0, num_rows: int | None = None
    ) -> None:
        self.source, self.expert, self.first_row = source, expert, first_row
        self.shape = (source.shape[1] if num_rows is None else num_rows, source.shape[2])

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        bounds = [[self.first_row, self.shape[0]], [0, self.shape[1]]]
        if dim is not None:
            bounds[dim] = [bounds[dim][0] + start, bounds[dim][1] - start if length is None else length]
        rows, columns = (slice(first, first + count) for first, count in bounds)
        return self.source.read_region((slice(self.expert, self.expert + 1), rows, columns))[0]


def per_expert(name: str, source: CheckpointTensor) -> list[tuple[str, CheckpointTensor]]:
    """A fused expert tensor (`...experts.gate_up_proj` [E, 2 I, H], gate rows first, or
    `...experts.down_proj` [E, H, I]) as the per-expert tensors it holds, named as checkpoints
    name them; any other tensor as it is."""
    prefix, fused, kind = name.rpartition(".experts.")
    if not fused or kind not in ("gate_up_proj", "down_proj"):
        return [(name, source)]
    tensors: list[tuple[str, CheckpointTensor]] = []
    for expert in range(source.shape[0]):
        named = f"{prefix}.experts.{expert}."
        if kind == "down_proj":
            tensors.append((named + "down_proj.weight", ExpertTensor(source, expert)))
        else:
            half = source.shape[1] // 2
            tensors.append((named + "gate_proj.weight", ExpertTensor(source, expert, 0, half)))
            tensors.append((named + "up_proj.weight", ExpertTensor(source, expert, half, half)))
    return tensors


class RowSlice(RegionReader):
    """Rows [first_row, first_row + num_rows) of a checkpoint tensor (a weight [out, in] or a
    bias [out]): one part of a tensor fused on disk, read through it, only the part asked for."""

    def __init__(self, source: CheckpointTensor, first_row: int, num_rows: int) -> None:
        self.source, self.first_row = source, first_row
        self.shape = (num_rows, *source.shape[1:])

    def read_region(self, region: tuple[slice, ...]) -> torch.Tensor:
        rows = region[0].indices(self.shape[0])[:2]
        absolute = slice(self.first_row + rows[0], self.first_row + rows[1])
        return self.source.read_region((absolute, *region[1:]))


def unfused(name: str, source: CheckpointTensor, config: ModelConfig) -> list[tuple[str, CheckpointTensor]]:
    """A projection a checkpoint holds fused (Phi-3's `qkv_proj` [q + 2 kv, hidden] and dense
    `gate_up_proj` [2 I, hidden], gate rows first) as the separate tensors other checkpoints
    hold, so that each part is sharded on its own (a rank takes its heads of q, of k and of v,
    not one block of the fused rows); any other tensor as it is."""
    if name.endswith((".qkv_proj.weight", ".qkv_proj.bias")):
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        if source.shape[0] != q + 2 * kv:
            raise ValueError(f"{name}: {source.shape[0]} rows, the config's heads need {q} + 2 x {kv}")
        parts = ((".q_proj.", 0, q), (".k_proj.", q, kv), (".v_proj.", q + kv, kv))
        return [(name.replace(".qkv_proj.", fragment), RowSlice(source, *rows)) for fragment, *rows in parts]
    if name.endswith(".gate_up_proj.weight") and ".experts." not in name and len(source.shape) == 2:
        half = config.intermediate_size
        if source.shape[0] != 2 * half:
            raise ValueError(
                f"{name}: {source.shape[0]} rows, the config's intermediate size needs 2 x {half}"
            )
        return [
            (name.replace(".gate_up_proj.", ".gate_proj."), RowSlice(source, 0, half)),
            (name.replace(".gate_up_proj.", ".up_proj."), RowSlice(source, half, half)),
        ]
    return [(name, source)]


# checkpoint name fragment -> (our fused parameter, which slice of it)
FUSED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class WeightLayout:
    """One rank's view of a checkpoint: `renames` (a family's checkpoint names -> the shared
    layers' names, applied first) and the sharding of `tp`."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallelGroup,
        shard: AttentionShard,
        renames: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.config, self.tp, self.shard, self.renames = config, tp, shard, renames

    def load(self, model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Reads this rank's shard of every checkpoint tensor into `model`'s (fused) parameters;
        every parameter must be covered."""
        params = dict(model.named_parameters())
        loaded: dict[str, set[int]] = {}
        parts = (
            part
            for named in weights
            for expert in per_expert(*named)
            for part in unfused(*expert, self.config)
        )
        for name, source in parts:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            target, index = self.target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} does not belong to this model")
            destination = params[target].data
            if self.num_slices(target) > 1:
                destination = destination.narrow(0, *self.fused_slice(target, index))
            shard = self.shard_of(target, index)
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
        missing = sorted(name for name in params if len(loaded.get(name, ())) < self.num_slices(name))
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")

    def target(self, name: str) -> tuple[str, int]:
        """The parameter a checkpoint tensor goes into, and which slice of it (0 unless fused)."""
        for old, new in self.renames:
            name = name.replace(old, new)
        for fragment, (fused, index) in FUSED.items():
            if fragment in name:
                return name.replace(fragment, fused), index
        return name, 0

    @staticmethod
    def num_slices(name: str) -> int:
        return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1

    def intermediate_split(self, target: str) -> tuple[int, int]:
        """(start, length) of this rank's intermediate features of an MLP or an expert."""
        c = self.config
        size = c.moe_intermediate_size if ".experts." in target else c.intermediate_size
        return even_split(size, self.tp.rank, self.tp.size, "intermediate size")

    def fused_slice(self, target: str, index: int) -> tuple[int, int]:
        """Where checkpoint tensor `index` of a fused parameter goes: (start, length) in dim 0."""
        head_dim, shard = self.config.head_dim, self.shard
        if ".qkv_proj." in target:
            kv = shard.num_kv_heads * head_dim
            sizes = [shard.num_heads * head_dim, kv, kv]
        else:
            sizes = [self.intermediate_split(target)[1]] * 2
        return sum(sizes[:index]), sizes[index]

    def shard_of(self, target: str, index: int) -> tuple[int, int, int] | None:
        """This rank's (dim, start, length) of a checkpoint tensor, or None when every rank
        holds all of it (norms, routers, o_proj's bias)."""
        c, tp, shard = self.config, self.tp, self.shard
        if tp.size == 1:
            return None
        if ".qkv_proj." in target:  # weight [out, in] or bias [out]: split by heads
            if index == 0:
                return 0, shard.first_head * c.head_dim, shard.num_heads * c.head_dim
            return 0, shard.first_kv_head * c.head_dim, shard.num_kv_heads * c.head_dim
        if target.endswith(".o_proj.weight"):
            return 1, shard.first_head * c.head_dim, shard.num_heads * c.head_dim
        if ".gate_up_proj." in target:
            return 0, *self.intermediate_split(target)
        if ".down_proj." in target:
            return 1, *self.intermediate_split(target)
        if target in ("model.embed_tokens.weight", "lm_head.weight"):
            start, held, _ = vocab_split(c.vocab_size, tp.rank, tp.size)
            return 0, start, held
        return None
