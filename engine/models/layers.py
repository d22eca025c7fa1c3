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
    """With `residual`: returns (norm(x + residual), x + residual). `unit_offset` is Gemma's
    RMSNorm: the features scaled by 1 + weight, in float32 before the one rounding to the
    activations' dtype (Llama's scales the rounded normalised features by the weight)."""

    def __init__(self, hidden_size: int, eps: float, *, dtype, device, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = _empty(hidden_size, dtype=dtype, device=device)
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.unit_offset:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        scale = 1.0 + self.weight.float()
        if x.dtype == torch.float32:  # one rounding either way: the kernels' norm is Gemma's
            return kernels.rms_norm(x, scale, self.eps, residual)
        if residual is not None:
            x = residual = x + residual
        x32 = x.float()
        out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * scale).to(x.dtype)
        return out if residual is None else (out, residual)


# The gated MLP's activations (a config's `hidden_act` / `hidden_activation`), applied to the
# gate half of [T, 2 I] (gate | up) and multiplied by the up half.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] (gate | up) -> gelu(gate, tanh approximation) * up, as Gemma's MLP."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) over this rank's slice of the intermediate features:
    column-parallel gate/up (one fused GEMM), row-parallel down. A dense layer's MLP, and each
    expert of a sparse MoE block (which sums its experts before the ranks). `activation`: SiLU
    (Llama's and most families'), or Gemma's GELU with the tanh approximation."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        tp: TensorParallelGroup,
        dtype,
        device,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
            )
        self.act_and_mul = kernels.silu_and_mul if activation == "silu" else gelu_tanh_and_mul
        self.tp = tp
        _, intermediate = even_split(intermediate_size, tp.rank, tp.size, "intermediate size")
        factory = dict(dtype=dtype, device=device)
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate, bias=False, **factory)
        self.down_proj = Linear(intermediate, hidden_size, bias=False, **factory)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (all of it with one rank)."""
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x))
