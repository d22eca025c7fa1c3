"""Qwen2 (`Qwen2ForCausalLM`): Llama with biases on the Q/K/V projections (always:
`ModelConfig.attention_bias`) and none on o_proj; a sliding window on the layers its config's
`layer_types` name (`ModelConfig.sliding_windows`)."""

from __future__ import annotations

from berth.engine.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    output_bias = False
