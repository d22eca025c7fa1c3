"""The sparse mixture-of-experts block of Mixtral and Qwen3-MoE, in place of a layer's MLP.

A router (a linear layer, replicated) scores every expert for each token; each token goes to
its `top_k` best by softmax probability, weighted by those probabilities (renormalised to sum
to 1 when the model says so: Mixtral always, Qwen3-MoE with `norm_topk_prob`), as transformers
computes them: softmax over every expert in float32 first, top-k of it after.

The step's (token, expert) pairs are grouped by expert, so each expert runs one GEMM pair over
all of its tokens, whatever their number (never a loop over tokens); the weighted outputs go
back to their tokens in one index_add. Tensor parallelism shards each expert like a dense MLP
(its intermediate features split over the ranks): every rank routes the same tokens the same
way, sums its experts' partial outputs, and the ranks' sums are all-reduced once.
"""

from __future__ import annotations

import torch
from torch import nn

from berth.engine.models.config import ModelConfig
from berth.engine.models.layers import GatedMLP, Linear
from berth.engine.models.parallel import TensorParallelGroup


class SparseMoeBlock(nn.Module):
    def __init__(
        self, config: ModelConfig, *, renormalize: bool, tp: TensorParallelGroup, dtype, device
    ) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.renormalize = renormalize
        factory = dict(dtype=dtype, device=device)
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False, **factory)  # the router
        self.experts = nn.ModuleList(
            GatedMLP(
                config.hidden_size,
                config.moe_intermediate_size,
                tp=tp,
                activation=config.hidden_act,
                **factory,
            )
            for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = probabilities.topk(self.top_k, dim=-1)  # [T, top_k] each
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        # The pairs sorted by expert: expert e's rows are one slice of `grouped`.
        experts = chosen.flatten()
        order = experts.argsort(stable=True)
        tokens = order // self.top_k
        # One host sync a layer: the GEMMs' row counts.
        counts = torch.bincount(experts, minlength=len(self.experts)).tolist()
        grouped = x.index_select(0, tokens)
        outputs = torch.empty_like(grouped)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                outputs[start : start + count] = expert.partial(grouped[start : start + count])
            start += count
        # Weighted in the activations' dtype, as Qwen3-MoE does (Mixtral weighs in float32: the
        # same in a float32 model, one rounding apart in bfloat16).
        outputs *= weights.flatten()[order].to(x.dtype)[:, None]
        return self.tp.all_reduce(torch.zeros_like(x).index_add_(0, tokens, outputs))
