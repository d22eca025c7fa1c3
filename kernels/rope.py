"""Rotary position embedding tables (computed once per model, on the host side of the kernels)."""

from __future__ import annotations

import math

import torch


def rope_inverse_frequencies(rotary_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies for RoPE, with Llama-3 style frequency scaling when `scaling` asks for it.

    `scaling` is the checkpoint's `rope_scaling` / `rope_parameters` dict; only `rope_type`
    "default" and "llama3" are supported, anything else is refused rather than silently ignored.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq.float()
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, llama3)")
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


def rope_cos_sin_cache(
    rotary_dim: int, max_position: int, base: float, scaling: dict | None = None
) -> torch.Tensor:
    """A float32 table `[max_position, rotary_dim]`: cos in the first half, sin in the second."""
    inv_freq = rope_inverse_frequencies(rotary_dim, base, scaling)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)
