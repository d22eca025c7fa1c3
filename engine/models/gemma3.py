"""Gemma 3, text (`Gemma3ForCausalLM`): sliding-window layers interleaved with global ones
(`layer_types`, or every `sliding_window_pattern`-th layer global in older files), the local
layers with a RoPE base of their own (`rope_local_base_freq`, or `rope_parameters`'
"sliding_attention"; the global layers' may be scaled, "linear"); an RMSNorm over each head of q
and k; four norms a layer, each scaling by 1 + weight; a GELU-tanh MLP (`hidden_activation`);
embeddings times sqrt(hidden_size) in the model's dtype; the softmax scale
`query_pre_attn_scalar ** -0.5`; the final logits soft-capped where `final_logit_softcapping`
is set. A config that sets `attn_logit_softcapping` is refused at load (decoder.py): no
attention kernel caps the scores, and transformers' Gemma 3 ignores the field."""

from __future__ import annotations

from berth.engine.models.decoder import DecoderForCausalLM


class Gemma3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
    unit_offset_norms = True
    sandwich_norms = True
    scale_embeddings = True
