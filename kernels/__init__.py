"""berth.kernels: the engine's hot operations behind one interface (`dispatch`), with a Triton,
a CPU and a torch reference implementation of each."""

if __name__ != "berth.kernels":  # imported as a top-level `kernels` from the checkout root
    from berth._rooms import step_aside

    step_aside(__name__, __file__)
else:
    from berth.kernels.dispatch import (
        AttentionMetadata,
        get_backend,
        linear,
        pack_linear_weight,
        paged_attention,
        rms_norm,
        rope_cos_sin_cache,
        rotary_embedding,
        set_backend,
        silu_and_mul,
        use_backend,
        write_kv_cache,
    )

    __all__ = [
        "AttentionMetadata",
        "get_backend",
        "linear",
        "pack_linear_weight",
        "paged_attention",
        "rms_norm",
        "rope_cos_sin_cache",
        "rotary_embedding",
        "set_backend",
        "silu_and_mul",
        "use_backend",
        "write_kv_cache",
    ]
