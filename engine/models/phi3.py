"""Phi-3 / Phi-4 (`Phi3ForCausalLM`): Llama's layers, read from a checkpoint that holds Q/K/V
as one `qkv_proj` and gate/up as one `gate_up_proj` (split at load, each part sharded on its own:
`weights.unfused`), RoPE over the first `partial_rotary_factor` of each head (Phi-4-mini) and
LongRoPE scaling (`rope_scaling` type "longrope": `short_factor` up to
`original_max_position_embeddings`, `long_factor` past it, cos and sin scaled by the attention
factor: `rotary.py`); a sliding window on every layer when the config sets one."""

from __future__ import annotations

from berth.engine.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    """The decoder's own layout: what differs is in the checkpoint's names and the config's RoPE."""
