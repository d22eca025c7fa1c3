"""Building blocks shared by the decoder-only models: weights allocated, never initialised.

A checkpoint overwrites every parameter, so layers allocate with `torch.empty` (no random
init: loading an 8B model must not spend minutes drawing numbers it throws away).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from berth import kernels


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, device) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype, device) -> None:
        super().__init__()
        self.weight = _empty(num_embeddings, embedding_dim, dtype=dtype, device=device)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, dtype, device) -> None:
        super().__init__()
        self.weight = _empty(hidden_size, dtype=dtype, device=device)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return kernels.rms_norm(x, self.weight, self.eps, residual)
