"""The Triton elementwise kernels against the torch reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from berth.kernels import reference
from berth.kernels.rope import rope_cos_sin_cache

DTYPES = [torch.float32, torch.bfloat16]
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def randn(*shape: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (37, 1000), (3, 5, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(triton_ops, assert_matches, device, dtype, shape, with_residual):
    x = randn(*shape, dtype=dtype, device=device, seed=1)
    weight = randn(shape[-1], dtype=dtype, device=device, seed=2)
    residual = randn(*shape, dtype=dtype, device=device, seed=3) if with_residual else None
    actual = triton_ops.rms_norm(x, weight, 1e-6, residual)
    expected = reference.rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        assert_matches(actual[0], expected[0])
        assert_matches(actual[1], expected[1])
    else:
        assert_matches(actual, expected)


def test_rms_norm_strided_rows_and_float32_weight(triton_ops, assert_matches, device):
    """A row-strided view (a slice of a wider activation) and a weight kept in float32."""
    wide = randn(9, 192, dtype=torch.bfloat16, device=device, seed=4)
    x = wide[:, 32:160]
    weight = randn(128, dtype=torch.float32, device=device, seed=5)
    residual = randn(9, 128, dtype=torch.bfloat16, device=device, seed=6)
    out, summed = triton_ops.rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_sum = reference.rms_norm(x, weight, 1e-5, residual)
    assert out.dtype == torch.float32  # promoted like the reference
    torch.testing.assert_close(out, expected_out, atol=3e-2, rtol=1.6e-2)
    assert_matches(summed, expected_sum)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 128), (37, 2000), (2, 3, 192)])
def test_silu_and_mul(triton_ops, assert_matches, device, dtype, shape):
    x = randn(*shape, dtype=dtype, device=device, seed=7) * 3
    assert_matches(triton_ops.silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (128, 128), (128, 64), (80, 80)])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
def test_rotary_embedding(triton_ops, assert_matches, device, dtype, head_dim, rotary_dim, scaling):
    num_tokens, num_q_heads, num_kv_heads = 19, 8, 2
    cos_sin = rope_cos_sin_cache(rotary_dim, 300, 10000.0, scaling).to(device)
    positions = torch.randint(0, 300, (num_tokens,), generator=torch.Generator().manual_seed(8)).to(device)
    # Query and key as views into one fused QKV projection output, like a model produces them.
    qkv = randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device, seed=9)
    query, key, _ = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    query = query.view(num_tokens, num_q_heads, head_dim)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    expected_query, expected_key = query.clone(), key.clone()
    reference.rotary_embedding(positions, expected_query, expected_key, cos_sin)
    untouched = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].clone()

    triton_ops.rotary_embedding(positions, query, key, cos_sin)
    assert_matches(query, expected_query)
    assert_matches(key, expected_key)
    assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim :], untouched)  # values untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 32)])
def test_write_kv_cache(triton_ops, device, dtype, head_dim, block_size):
    num_tokens, num_kv_heads, num_blocks = 45, 2, 6
    generator = torch.Generator().manual_seed(10)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].to(device)
    kv = randn(num_tokens, 2, num_kv_heads, head_dim, dtype=dtype, device=device, seed=11)
    key, value = kv[:, 0], kv[:, 1]  # strided views
    caches = [
        randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device, seed=seed)
        for seed in (12, 13)
    ]
    expected = [cache.clone() for cache in caches]
    reference.write_kv_cache(key, value, *expected, slots)
    triton_ops.write_kv_cache(key, value, *caches, slots)
    # A copy: exact, and every slot outside `slots` keeps its old content.
    assert torch.equal(caches[0], expected[0])
    assert torch.equal(caches[1], expected[1])


def test_write_kv_cache_skips_negative_slots(triton_ops, device):
    key = randn(4, 2, 64, dtype=torch.float32, device=device, seed=14)
    key_cache = torch.zeros(2, 16, 2, 64, device=device)
    value_cache = torch.zeros(2, 16, 2, 64, device=device)
    slots = torch.tensor([3, -1, 17, -1], device=device)
    triton_ops.write_kv_cache(key, key, key_cache, value_cache, slots)
    flat = key_cache.view(-1, 2, 64)
    assert torch.equal(flat[3], key[0])
    assert torch.equal(flat[17], key[2])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 2  # nothing else written
