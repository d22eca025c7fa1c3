"""Rotary position embedding tables (computed once per model, on the host side of the kernels)."""

from __future__ import annotations

import math

import torch


def rope_inverse_frequencies(
    rotary_dim: int, base: float, scaling: dict | None = None, *, long: bool = False
) -> torch.Tensor:
    """Inverse frequencies for RoPE, scaled as `scaling` asks.

    `scaling` is the checkpoint's `rope_scaling` / `rope_parameters` dict; `rope_type` "default",
    "linear" (positions slowed by `factor`), "llama3" and "longrope" (Phi-3's per-frequency
    `short_factor`, or `long_factor` with `long`) are supported, anything else is refused rather
    than silently ignored.
    """
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "longrope":
        # As transformers computes them, in float32.
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        if factors.numel() != rotary_dim // 2:
            raise ValueError(
                f"LongRoPE {'long' if long else 'short'}_factor has {factors.numel()} entries, "
                f"the rotary dim {rotary_dim} needs {rotary_dim // 2}"
            )
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (factors * base**exponents)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type != "llama3":
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3, longrope)"
        )
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled).float()


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by (transformers' `attention_scaling`): LongRoPE's
    `attention_factor`, by default sqrt(1 + ln(factor) / ln(original context)) when `factor`
    (the context's extension) is above 1; 1 for every other type."""
    scaling = scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))


def rope_cos_sin_cache(
    rotary_dim: int, max_position: int, base: float, scaling: dict | None = None, *, long: bool = False
) -> torch.Tensor:
    """A float32 table `[max_position, rotary_dim]`: cos in the first half, sin in the second
    (both times `rope_attention_factor`). LongRoPE has two: the short factors' (`long=False`)
    and the long ones'; which one a token reads is the model's choice."""
    inv_freq = rope_inverse_frequencies(rotary_dim, base, scaling, long=long)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    attention_factor = rope_attention_factor(scaling)
    return table if attention_factor == 1.0 else table * attention_factor
