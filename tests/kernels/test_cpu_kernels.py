"""The CPU backend (C kernels, oneDNN GEMMs on packed weights) against the torch reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from berth import kernels
from berth.kernels import cpu_ops, reference
from berth.kernels.cpu import build
from berth.kernels.rope import rope_cos_sin_cache
from berth.kernels.synthetic_batch import random_paged_batch

DTYPES = [torch.float32, torch.bfloat16]


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def test_the_c_kernels_build_here():
    """This machine has a C compiler: the fast path must really run, not fall back silently."""
    assert build.load("paged_attention") is not None
    assert build.load("elementwise") is not None


def test_loading_the_kernels_leaves_the_process_floating_point_mode_alone():
    """A library linked with -ffast-math would switch the whole process to flush subnormals."""
    assert build.load("paged_attention") is not None and build.load("elementwise") is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # a subnormal float32
    assert (tiny * 1.0).item() != 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("seqs", "num_prefills"),
    [
        ([(0, 1), (0, 17), (0, 45)], 3),
        ([(37, 20), (64, 33), (100, 1)], 3),  # chunks over a cached prefix
        ([(0, 23), (40, 9), (0, 1), (14, 1), (250, 1), (31, 1)], 2),  # prefills and decodes
        ([(15, 1), (16, 1), (17, 1), (0, 1), (300, 1)], 0),  # decodes across block edges
        ([(0, 600), (100, 520), (0, 30), (3, 1)], 3),  # long prompts: SDPA beside the C kernel
    ],
    ids=["prefills", "chunked", "mixed", "decodes", "long"],
)
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 128, 32), (6, 2, 48, 8)],  # 48: the kernel's generic head size
)
def test_paged_attention_matches_the_reference(
    dtype, seqs, num_prefills, num_q_heads, num_kv_heads, head_dim, block_size
):
    batch = random_paged_batch(
        seqs, num_prefills, num_q_heads, num_kv_heads, head_dim, block_size, dtype=dtype, seed=3
    )
    scale = head_dim**-0.5
    args = (batch.key_cache, batch.value_cache, batch.metadata, scale)
    expected = reference.paged_attention(batch.query, *args)
    actual = cpu_ops.paged_attention(batch.query, *args)
    assert not actual.isnan().any(), "read a slot no sequence owns"
    close(actual, expected, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 7, 16, 100])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (48, 8)])
def test_a_sliding_window_matches_the_reference(dtype, window, head_dim, block_size):
    """The C kernel starts a windowed token's context mid-block; a long prompt (SDPA) masks it,
    whole or as a chunk over a cached prefix."""
    seqs = [(0, 17), (37, 20), (0, 600), (100, 520), (0, 1), (15, 1), (250, 1)]
    batch = random_paged_batch(seqs, 4, 6, 2, head_dim, block_size, dtype=dtype, seed=3)
    args = (batch.key_cache, batch.value_cache, batch.metadata, head_dim**-0.5, window)
    actual = cpu_ops.paged_attention(batch.query, *args)
    assert not actual.isnan().any(), "read a slot no sequence owns"
    expected = reference.paged_attention(batch.query, *args)
    close(actual, expected, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-5)


@pytest.mark.parametrize("seqs", [[(0, 5), (40, 1)], [(0, 600), (3, 1)]], ids=["short", "long"])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_a_float32_query_over_a_bfloat16_cache_rounds_only_the_cache(seqs, head_dim):
    """A float32 model over a bfloat16 KV cache: the query is read and the output written in
    float32 (the C kernel, and SDPA for a long prompt), so the result is float32 attention over
    the cached keys and values as they were rounded, not a bfloat16 attention."""
    batch = random_paged_batch(seqs, 1, 6, 2, head_dim, 16, seed=5)
    keys, values = batch.key_cache.bfloat16(), batch.value_cache.bfloat16()
    scale = head_dim**-0.5
    expected = reference.paged_attention(batch.query, keys.float(), values.float(), batch.metadata, scale)
    actual = kernels.paged_attention(batch.query, keys, values, batch.metadata, scale)
    assert actual.dtype == torch.float32
    close(actual, expected, atol=1e-5, rtol=1e-5)


def test_decode_attention_reads_queries_through_a_row_stride():
    """The model hands over a view of the fused QKV output; the result must not change."""
    batch = random_paged_batch([(20, 1), (70, 1)], 0, 8, 2, 64, 16, seed=4)
    fused = torch.randn(2, (8 + 2 * 2) * 64)
    fused[:, : 8 * 64] = batch.query.reshape(2, -1)
    view = fused[:, : 8 * 64].view(2, 8, 64)
    assert not view.is_contiguous()
    args = (batch.key_cache, batch.value_cache, batch.metadata, 0.125)
    close(cpu_ops.paged_attention(view, *args), reference.paged_attention(batch.query, *args), atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_reference(dtype, with_residual):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=generator).to(dtype)
    weight = torch.randn(576, generator=generator).to(dtype)
    residual = torch.randn(7, 576, generator=generator).to(dtype) if with_residual else None
    kept = residual.clone() if with_residual else None
    actual = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    expected = reference.rms_norm(x, weight, 1e-5, residual)
    atol = 1e-5 if dtype == torch.float32 else 0.0
    if with_residual:
        close(actual[0], expected[0], atol)
        close(actual[1], expected[1], atol)
        assert torch.equal(residual, kept), "the caller's residual must not be overwritten"
    else:
        close(actual, expected, atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_in_place_on_views_of_the_fused_projection(dtype):
    tokens, q_heads, k_heads, head_dim = 6, 9, 3, 64
    table = rope_cos_sin_cache(head_dim, 2048, 100000.0)
    positions = torch.tensor([0, 1, 15, 16, 700, 2047])
    fused = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim).to(dtype)
    mine, theirs = fused.clone(), fused.clone()

    def views(buffer):
        q, k, _ = buffer.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
        return q.view(tokens, q_heads, head_dim), k.view(tokens, k_heads, head_dim)

    cpu_ops.rotary_embedding(positions, *views(mine), table)
    reference.rotary_embedding(positions, *views(theirs), table)
    close(mine, theirs, atol=1e-6 if dtype == torch.float32 else 0.0)
    assert torch.equal(mine[:, -k_heads * head_dim :], fused[:, -k_heads * head_dim :]), "V is untouched"


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])  # a plain copy: any dtype
def test_write_kv_cache_from_views_of_the_fused_projection(dtype):
    tokens, heads, head_dim = 5, 3, 64
    fused = torch.randn(tokens, (9 + 2 * heads) * head_dim).to(dtype)
    _, key, value = fused.split([9 * head_dim, heads * head_dim, heads * head_dim], dim=-1)
    key, value = key.view(tokens, heads, head_dim), value.view(tokens, heads, head_dim)
    slots = torch.tensor([7, 0, 33, 16, 63])
    caches = [torch.full((4, 16, heads, head_dim), float("nan"), dtype=dtype) for _ in range(4)]
    cpu_ops.write_kv_cache(key, value, caches[0], caches[1], slots)
    reference.write_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(), caches[2].nan_to_num())
    assert torch.equal(caches[1].nan_to_num(), caches[3].nan_to_num())
    assert caches[0].isnan().sum() == (64 - tokens) * heads * head_dim, "only the given slots are written"


@pytest.mark.parametrize(
    "write", [cpu_ops.write_kv_cache, reference.write_kv_cache], ids=["cpu", "reference"]
)
def test_write_kv_cache_skips_negative_slots(write):
    """A decode graph's padding rows carry slot -1: nothing is written for them (the C kernel
    would otherwise write before the cache's first byte)."""
    key = torch.randn(4, 2, 64)
    caches = [torch.zeros(2, 16, 2, 64) for _ in range(2)]
    write(key, key, *caches, torch.tensor([3, -1, 17, -1]))
    flat = caches[0].view(-1, 2, 64)
    assert torch.equal(flat[3], key[0]) and torch.equal(flat[17], key[2])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 2, "only the two real tokens are written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_reference(dtype):
    x = torch.randn(5, 2 * 1536).to(dtype)
    close(cpu_ops.silu_and_mul(x), reference.silu_and_mul(x), atol=1e-6 if dtype == torch.float32 else 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_on_packed_weights_is_a_linear(dtype, rows, bias):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 48, generator=generator).to(dtype)
    b = torch.randn(96, generator=generator).to(dtype) if bias else None
    x = torch.randn(rows, 48, generator=generator).to(dtype)
    packed = cpu_ops.pack_linear_weight(weight)
    assert packed is not None, f"no fast GEMM for {dtype} on this machine"
    assert (packed.dim() == 3) == (cpu_ops.gemm_path(dtype) == cpu_ops.GEMM_C)
    atol = 1e-4 if dtype == torch.float32 else 0.1
    close(cpu_ops.linear(x, weight, b, packed), F.linear(x, weight, b), atol=atol, rtol=1e-2)


def _cpu_flags() -> set[str]:
    return set(build._cpu_identity().split())  # the flags line of /proc/cpuinfo


GEMM_C_HERE = {"avx2", "fma"} <= _cpu_flags()


def test_each_dtype_goes_to_the_widest_gemm_this_cpu_has():
    flags = _cpu_flags()
    library = build.load("gemm")
    assert library is not None and library.gemm_available() == int(GEMM_C_HERE)
    # float32: oneDNN where it has AVX-512, gemm.c on AVX2 alone; bfloat16: oneDNN where it has
    # bfloat16 instructions, else gemm.c. BERTH_CPU_ISA=avx2 plays a CPU without AVX-512.
    avx512 = "avx512f" in flags and build.isa() == "native"
    f32 = cpu_ops.GEMM_C if GEMM_C_HERE and not avx512 else cpu_ops.ONEDNN
    bf16 = cpu_ops.ONEDNN if cpu_ops.onednn_packs(torch.bfloat16) else cpu_ops.GEMM_C if GEMM_C_HERE else None
    if not avx512:
        assert bf16 != cpu_ops.ONEDNN
    assert (cpu_ops.gemm_path(torch.float32), cpu_ops.gemm_path(torch.bfloat16)) == (f32, bf16)
    assert cpu_ops.gemm_path(torch.float16) is None


@pytest.mark.skipif(not GEMM_C_HERE, reason="gemm.c needs AVX2 and FMA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    # every tile height (1-6, and 19 = 5 + 5 + 5 + 4), several row chunks (48 each), a last
    # column block that is not full, the model's shapes
    [
        *[(1, 96, 48), (2, 100, 48), (3, 17, 5), (4, 33, 64), (5, 16, 1), (6, 48, 7)],
        *[(19, 960, 576), (100, 77, 96), (64, 576, 1536)],
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_the_c_gemm_is_float32_math_rounded_once(dtype, rows, out_features, in_features, bias):
    """float32 products and sums of the operands, rounded to `dtype` once: off the exact sum by
    float32's summation error (its order differs from torch's) plus one rounding. Asked for
    directly: where oneDNN takes a dtype, gemm.c is not used for it, but must still be right."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    # A strided view: every row of x is read through its own stride.
    x = torch.randn(rows, 2 * in_features, generator=generator).to(dtype)[:, :in_features]
    packed = cpu_ops.pack_linear_weight(weight, cpu_ops.GEMM_C)
    assert packed.shape == (-(-out_features // cpu_ops.GEMM_BLOCK), in_features, cpu_ops.GEMM_BLOCK)
    exact = F.linear(x.double(), weight.double(), b.double() if b is not None else None)
    out = cpu_ops.linear(x, weight, b, packed)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    magnitude = F.linear(x.double().abs(), weight.double().abs(), b.double().abs() if b is not None else None)
    summation = (in_features + 1) * 2**-24 * magnitude
    rounding = 2**-8 if dtype == torch.bfloat16 else 2**-24
    assert ((out.double() - exact).abs() <= summation + rounding * (exact.abs() + summation)).all()


@pytest.mark.skipif(not GEMM_C_HERE, reason="gemm.c needs AVX2 and FMA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_c_gemm_takes_leading_dimensions_and_no_rows(dtype):
    weight = torch.randn(40, 24).to(dtype)
    packed = cpu_ops.pack_linear_weight(weight, cpu_ops.GEMM_C)
    x = torch.randn(2, 3, 24).to(dtype)
    out = cpu_ops.linear(x, weight, None, packed)
    assert out.shape == (2, 3, 40)
    close(out, F.linear(x, weight), atol=0.1 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)
    assert cpu_ops.linear(x[:, :0], weight, None, packed).shape == (2, 0, 40)


def test_without_a_compiler_everything_falls_back_to_the_reference(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("BERTH_KERNEL_CACHE", str(tmp_path / "cache"))
    build.load.cache_clear()
    try:
        assert build.load("paged_attention") is None
        batch = random_paged_batch([(0, 5), (9, 1)], 1, 4, 2, 32, 8, seed=5)
        args = (batch.key_cache, batch.value_cache, batch.metadata, 0.2)
        close(cpu_ops.paged_attention(batch.query, *args), reference.paged_attention(batch.query, *args), 0.0)
        x = torch.randn(3, 2 * 16)
        close(cpu_ops.silu_and_mul(x), reference.silu_and_mul(x), 0.0)
    finally:
        build.load.cache_clear()
    assert not (tmp_path / "cache").exists()


def test_a_build_is_cached_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("BERTH_KERNEL_CACHE", str(tmp_path))
    build.load.cache_clear()
    try:
        assert build.load("elementwise") is not None
        built = sorted(tmp_path.iterdir())
        assert [path.suffix for path in built] == [".so"], "one library, no half-written leftovers"
        stamp = built[0].stat().st_mtime_ns
        build.load.cache_clear()
        assert build.load("elementwise") is not None
        assert sorted(tmp_path.iterdir()) == built and built[0].stat().st_mtime_ns == stamp
    finally:
        build.load.cache_clear()


@pytest.mark.skipif(
    not cpu_ops.onednn_packs(torch.float32),
    reason="this torch has no oneDNN (mkldnn): no packed GEMM to check",
)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if cpu_ops.onednn_packs(d)])
def test_a_packed_onednn_gemm_that_gives_another_answer_is_not_used(monkeypatch, caplog, dtype):
    """oneDNN trusts the packed layout at every row count; where it reads it otherwise than it
    was written (a kernel chosen by row count expecting another layout), the weight must not be
    used packed. Played here by a linear whose answer is off at one row count."""
    honest = cpu_ops._onednn_linear

    def off_at_prefill(x, packed, bias, *args):
        out = honest(x, packed, bias, *args)
        return out.flip(-1) if x.shape[0] == 64 else out

    monkeypatch.setattr(cpu_ops, "_onednn_linear", off_at_prefill)
    monkeypatch.setattr(cpu_ops, "_verified_shapes", {})
    weight = torch.randn(40, 24, generator=torch.Generator().manual_seed(3)).to(dtype)
    with caplog.at_level("WARNING", logger=cpu_ops.__name__):
        packed = cpu_ops.pack_linear_weight(weight, cpu_ops.ONEDNN)
    fallback_is_gemm_c = dtype == torch.bfloat16 and GEMM_C_HERE
    assert (packed is not None and packed.dim() == 3) if fallback_is_gemm_c else packed is None
    assert "40 x 24 weight is off by" in caplog.text
    x = torch.randn(3, 24).to(dtype)
    atol = 1e-4 if dtype == torch.float32 else 0.1
    close(cpu_ops.linear(x, weight, None, packed), F.linear(x, weight), atol=atol, rtol=1e-2)


@pytest.mark.skipif(
    not cpu_ops.onednn_packs(torch.float32),
    reason="this torch has no oneDNN (mkldnn): no packed GEMM to check",
)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if cpu_ops.onednn_packs(d)])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536), (3072, 576)])
def test_oneDNN_packed_shapes_of_a_real_model_pass_their_check_here(dtype, out_features, in_features):
    """On every CPU the suite has met, oneDNN's packed GEMM is right at every row count checked:
    a failure here names a CPU where berth runs those weights on another GEMM (slower)."""
    weight = torch.randn(out_features, in_features).to(dtype)
    assert cpu_ops._onednn_verified(weight, torch.ops.mkldnn._reorder_linear_weight(weight, None))


@pytest.mark.slow  # the whole file again in a process with every kernel rebuilt for AVX2
@pytest.mark.skipif(
    not GEMM_C_HERE or build.isa() != "native",
    reason="needs a CPU with AVX2 and FMA; under BERTH_CPU_ISA=avx2 this file already runs that way",
)
def test_the_avx2_path_passes_these_tests_too_on_a_cpu_with_more():
    """`BERTH_CPU_ISA=avx2`: every kernel built for AVX2 + FMA and gemm.c for both dtypes, as on
    an AVX2-only CPU, through this whole file in a process of its own (where
    test_each_dtype_goes_to_the_widest_gemm_this_cpu_has sees gemm.c take both dtypes)."""
    env = {**os.environ, "BERTH_CPU_ISA": "avx2"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not avx2_path"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
