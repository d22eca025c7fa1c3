"""Llama (`LlamaForCausalLM`): the plain decoder, biases on the attention projections when the
config's `attention_bias` says so."""

from __future__ import annotations

from berth.engine.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """The decoder's own layout (decoder.py)."""
