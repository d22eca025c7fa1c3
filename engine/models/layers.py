"""Building blocks shared by the decoder-only models: weights allocated, never initialised.

A checkpoint overwrites every parameter, so layers allocate with `torch.empty` (no random
init: loading an 8B model must not spend minutes drawing numbers it throws away).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from berth import kernels
from berth.engine.models.parallel import TensorParallelGroup, even_split, vocab_split


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b through the kernel backend. After the weights are loaded, `pack()` lets the
    backend keep a copy laid out for its GEMM (oneDNN's blocked layout on the CPU), used by every
    call instead of re-laying out the weight each time. `weight` stays the source of truth (a
    shard of it, once tensor parallelism splits it): whoever changes it must `pack()` again."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype,
        device,
        weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        # A given `weight` is shared (a tied LM head is the embedding matrix).
        self.weight = (
            weight if weight is not None else _empty(out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed = kernels.pack_linear_weight(self.weight)

    def forward(self, x: torch.Tensor, *, add_bias: bool = True) -> torch.Tensor:
        """`add_bias=False` leaves the bias to the caller: a row-parallel layer adds it once,
        after summing the ranks' partial products, not once per rank."""
        return kernels.linear(x, self.weight, self.bias if add_bias else None, self.packed)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding (all of them with one rank): ids it does not hold look
    up zeros, and the all-reduce over the ranks puts every row together."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, tp: TensorParallelGroup, dtype, device
    ) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.held, self.rows = vocab_split(num_embeddings, tp.rank, tp.size)
        self.weight = _empty(self.rows, embedding_dim, dtype=dtype, device=device)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.start
        elsewhere = (local < 0) | (local >= self.held)
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        rows.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.tp.all_reduce(rows)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, dtype, device) -> None:
        super().__init__()
        self.weight = _empty(hidden_size, dtype=dtype, device=device)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) over this rank's slice of the intermediate features:
    column-parallel gate/up (one fused GEMM), row-parallel down. A dense layer's MLP, and each
    expert of a sparse MoE block (which sums its experts before the ranks)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, tp: TensorParallelGroup, dtype, device
    ) -> None:
        super().__init__()
        self.tp = tp
        _, intermediate = even_split(intermediate_size, tp.rank, tp.size, "intermediate size")
        factory = dict(dtype=dtype, device=device)
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate, bias=False, **factory)
        self.down_proj = Linear(intermediate, hidden_size, bias=False, **factory)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (all of it with one rank)."""
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x))
