"""Mistral (`MistralForCausalLM`): Llama's layers, every one of them attending over a sliding
window when the config sets `sliding_window` (a token sees that many positions, itself
included: `ModelConfig.sliding_windows`)."""

from __future__ import annotations

from berth.engine.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    """Llama's layout; the window comes from the config, into every layer's attention options."""
