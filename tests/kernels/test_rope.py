"""The cos/sin table and its frequency scalings: Llama 3, linear, Phi-3's LongRoPE."""

from __future__ import annotations

import math

import pytest
import torch

from berth.kernels.rope import rope_attention_factor, rope_cos_sin_cache, rope_inverse_frequencies

LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_default_frequencies_and_table_layout():
    inv_freq = rope_inverse_frequencies(8, 10000.0)
    torch.testing.assert_close(inv_freq, torch.tensor([10000.0 ** (-i / 8) for i in (0, 2, 4, 6)]))
    table = rope_cos_sin_cache(8, 10, 10000.0)
    assert table.shape == (10, 8) and table.dtype == torch.float32
    torch.testing.assert_close(table[7, :4], torch.cos(7 * inv_freq))
    torch.testing.assert_close(table[7, 4:], torch.sin(7 * inv_freq))


def test_llama3_scaling_bands():
    """High frequencies are kept, low ones divided by `factor`, the band between interpolated."""
    inv_freq = rope_inverse_frequencies(128, 500000.0)
    scaled = rope_inverse_frequencies(128, 500000.0, LLAMA31_SCALING)
    wavelen = 2 * math.pi / inv_freq
    high, low = wavelen < 8192 / 4, wavelen > 8192
    torch.testing.assert_close(scaled[high], inv_freq[high])
    torch.testing.assert_close(scaled[low], inv_freq[low] / 8)
    medium = ~high & ~low
    assert medium.any()
    assert ((scaled[medium] < inv_freq[medium]) & (scaled[medium] > inv_freq[medium] / 8)).all()


def test_llama3_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers import modeling_rope_utils as rope_utils

    config = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **LLAMA31_SCALING},
    )
    expected, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_factor == 1.0
    # transformers derives the base frequencies in float32, berth in float64: a few ulps apart.
    actual = rope_inverse_frequencies(128, 500000.0, LLAMA31_SCALING)
    torch.testing.assert_close(actual, expected, atol=0, rtol=1e-6)


@pytest.mark.parametrize("max_position_embeddings", [4096, 131072])
def test_longrope_and_its_attention_factor_match_transformers(max_position_embeddings):
    """Phi-3's LongRoPE: the short and long factors' frequencies over a partial rotary dim, and
    cos / sin scaled by the attention factor (1 when the context is not extended)."""
    from transformers import Phi3Config
    from transformers import modeling_rope_utils as rope_utils

    short, long = [1.0 + i / 8 for i in range(24)], [2.0 + i for i in range(24)]
    scaling = {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "partial_rotary_factor": 0.75,
    }
    config = Phi3Config(
        hidden_size=1024,
        num_attention_heads=16,  # head_dim 64, rotary dim 48
        max_position_embeddings=max_position_embeddings,
        original_max_position_embeddings=4096,
        rope_parameters={**scaling, "rope_theta": 10000.0},
    )
    berth_scaling = {
        **scaling,
        "original_max_position_embeddings": 4096,
        "factor": max_position_embeddings / 4096,
    }
    for seq_len, is_long in ((None, False), (4097, True)):
        expected, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS["longrope"](
            config, "cpu", seq_len=seq_len
        )
        assert torch.equal(rope_inverse_frequencies(48, 10000.0, berth_scaling, long=is_long), expected)
        table = rope_cos_sin_cache(48, 5000, 10000.0, berth_scaling, long=is_long)
        assert rope_attention_factor(berth_scaling) == pytest.approx(attention_factor, rel=1e-12)
        torch.testing.assert_close(table[4999, :24], torch.cos(4999 * expected) * attention_factor)
    assert (attention_factor == 1.0) == (max_position_embeddings == 4096)


def test_linear_scaling_slows_every_frequency():
    scaled = rope_inverse_frequencies(64, 10000.0, {"rope_type": "linear", "factor": 8.0})
    torch.testing.assert_close(scaled, rope_inverse_frequencies(64, 10000.0) / 8)


def test_unsupported_scaling_is_refused():
    with pytest.raises(ValueError, match="yarn"):
        rope_inverse_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
