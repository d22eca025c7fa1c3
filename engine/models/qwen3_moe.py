"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k norm, its own head_dim) and a sparse
MoE block (moe.py) in every `decoder_sparse_step`-th layer except `mlp_only_layers`, whose
experts are `moe_intermediate_size` wide; top-k weights renormalised when `norm_topk_prob`."""

from __future__ import annotations

from berth.engine.models.decoder import DecoderForCausalLM


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    qk_norm = True
