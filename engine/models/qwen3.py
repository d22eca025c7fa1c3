"""Qwen3 (`Qwen3ForCausalLM`): an RMSNorm over each head of q and k before RoPE, and a head_dim
of its own (`head_dim` in the config, not hidden_size / heads: ModelConfig reads it)."""

from __future__ import annotations

from berth.engine.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
