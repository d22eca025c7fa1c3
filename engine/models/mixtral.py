"""Mixtral (`MixtralForCausalLM`): Mistral's attention and a sparse MoE block (moe.py) in every
layer, its top-k weights always renormalised. Its checkpoints name the block
`block_sparse_moe` and each expert's projections w1 (gate), w3 (up) and w2 (down)."""

from __future__ import annotations

from berth.engine.models.decoder import DecoderForCausalLM


class MixtralForCausalLM(DecoderForCausalLM):
    renormalize_top_k = True
    checkpoint_renames = (
        (".block_sparse_moe.", ".mlp."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    )
