"""The kernel interface for CPU tensors, made fast: same signatures and semantics as `reference`.

Where the time goes on a CPU, and what this backend does about it (the torch reference stays
the definition of correct, and the tests hold this backend to it):

- Linear layers: oneDNN with weights packed once at load (`pack_linear_weight`), instead of
  torch's default GEMM, which on some CPUs (AMD's, for float32) runs at half their speed and
  re-lays out bfloat16 weights on every call; on CPUs with AVX2 but not AVX-512, a C GEMM
  (`cpu/gemm.c`) instead, which oneDNN has no bfloat16 for at all (torch's fallback is a generic
  loop) and whose float32 is faster at decode sizes (`gemm_path`).
- Attention: a C kernel (`cpu/paged_attention.c`) that reads each sequence's keys and values
  in place in the paged cache, for every decode and every prompt token of the step in one
  call, instead of gathering the whole context of every sequence into a dense tensor every
  step and padding all prompts to the longest. Long prompts (`LONG_PREFILL`) go to SDPA's
  flash kernel instead, which computes in GEMM tiles.
- Norms, RoPE, SiLU and the KV cache write: one C call each (`cpu/elementwise.c`) where torch
  needs 2-25 small operators; at decode batch sizes dispatching those costs more than the math.

Anything these kernels do not take (another dtype, a layout they cannot read, no C compiler)
goes to the reference.
"""

from __future__ import annotations

import ctypes
import logging

import torch
import torch.nn.functional as F

from berth.kernels import reference
from berth.kernels.cpu import build
from berth.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)
_PACKABLE = (torch.float32, torch.bfloat16)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "paged_attention": [_P, _I] + [_P] * 4 + [_I] + [_P] * 3 + [_I] * 5 + [_F, _I],
    "rms_norm": [_P] * 5 + [_I, _I, _F],
    "rotary": [_P, _P, _I, _I, _P, _I, _I, _I, _P, _I, _I],
    "silu_and_mul": [_P, _P, _I, _I],
    "write_kv_cache": [_P, _I, _P, _I, _P, _P, _P, _I, _I],
    "linear": [_P, _I, _I, _I, _P, _I, _P, _P, _I],
}
_RETURNS_STATUS = ("paged_attention", "linear")


def _c_function(library: str, name: str, dtype: torch.dtype, cache_dtype: torch.dtype | None = None):
    """`NAME_<dtype>` (over a cache of another dtype: `NAME_<dtype>_<cache dtype>_cache`) from the
    C library, typed; None where there is none for these dtypes."""
    if dtype not in _SUFFIX or (cache_dtype or dtype) not in _SUFFIX:
        return None
    loaded = build.load(library)
    if loaded is None:
        return None
    symbol = name if name == "write_kv_cache" else f"{name}_{_SUFFIX[dtype]}"
    if cache_dtype not in (None, dtype):
        symbol = f"{symbol}_{_SUFFIX[cache_dtype]}_cache"
    function = getattr(loaded, symbol, None)
    if function is None:
        return None
    if function.argtypes is None:
        function.argtypes = _SIGNATURES[name]
        function.restype = ctypes.c_int if name in _RETURNS_STATUS else None
    return function


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    function = _c_function("elementwise", "rms_norm", x.dtype)
    plain = x.is_contiguous() and weight.dtype == x.dtype and weight.is_contiguous()
    if residual is not None:
        plain = plain and residual.dtype == x.dtype and residual.is_contiguous() and residual.shape == x.shape
    if function is None or not plain:
        return reference.rms_norm(x, weight, eps, residual)
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    hidden = x.shape[-1]
    function(
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        summed.data_ptr() if summed is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // hidden,
        hidden,
        eps,
    )
    return out if residual is None else (out, summed)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotates `query` [T, Hq, D] and `key` [T, Hk, D] in place (any row stride, dense heads)."""
    function = _c_function("elementwise", "rotary", query.dtype)
    dense_heads = all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (query, key))
    if (
        function is None
        or not dense_heads
        or key.dtype != query.dtype
        or positions.dtype != torch.int64
        or not positions.is_contiguous()
        or cos_sin_cache.dtype != torch.float32
        or not cos_sin_cache.is_contiguous()
    ):
        reference.rotary_embedding(positions, query, key, cos_sin_cache)
        return
    function(
        positions.data_ptr(),
        query.data_ptr(),
        query.stride(0),
        query.shape[1],
        key.data_ptr(),
        key.stride(0),
        key.shape[1],
        query.shape[2],
        cos_sin_cache.data_ptr(),
        cos_sin_cache.shape[1],
        query.shape[0],
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    function = _c_function("elementwise", "silu_and_mul", x.dtype)
    if function is None or not x.is_contiguous():
        return reference.silu_and_mul(x)
    width = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    function(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], width)
    return out


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    function = _c_function("elementwise", "write_kv_cache", key.dtype)
    dense = all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
    if (
        function is None
        or not dense
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
        or not (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype)
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
    ):
        reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    size = key.element_size()
    function(
        key.data_ptr(),
        key.stride(0) * size,
        value.data_ptr(),
        value.stride(0) * size,
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slot_mapping.data_ptr(),
        key.shape[0],
        key.shape[1] * key.shape[2] * size,
    )


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN takes packed weights of `dtype` on this CPU: bf16 needs AVX-512 (or
    AVX-NE-CONVERT), which not every x86 machine has (an AVX2-only EPYC refuses to pack), and
    which `BERTH_CPU_ISA=avx2` sets aside."""
    if dtype not in _PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and build.isa() == "avx2":
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


ONEDNN = "oneDNN, packed weights"
GEMM_C = "berth's C GEMM, packed weights (gemm.c)"


def gemm_path(dtype: torch.dtype) -> str | None:
    """Which GEMM `linear` runs on weights of `dtype` packed by `pack_linear_weight` on this
    CPU: `GEMM_C`, `ONEDNN`, or None (not packed: torch's own GEMM).

    gemm.c needs AVX2 and FMA (and a C compiler). It takes bfloat16 where oneDNN has none, and
    float32 where oneDNN has nothing wider than AVX2 either: there it matches oneDNN at prefill
    sizes and beats it by a fifth to a third at decode sizes (it streams each weight block once,
    in the order it multiplies it). With AVX-512, oneDNN's float32 is twice as wide."""
    blocked = _gemm_c_available()
    if dtype == torch.float32 and blocked and build.load("gemm").gemm_f32_preferred() == 1:
        return GEMM_C
    if onednn_packs(dtype):
        return ONEDNN
    if dtype == torch.bfloat16 and blocked:
        return GEMM_C
    return None


# gemm.c's BLOCK: its packed weights hold this many output features per column block.
GEMM_BLOCK = 16


def pack_linear_weight(weight: torch.Tensor, path: str | None = None) -> torch.Tensor | None:
    """`weight` [out, in] re-laid out once for the GEMM `gemm_path` picks for its dtype (or for
    `path`): oneDNN's own layout, or column blocks for gemm.c ([ceil(out / GEMM_BLOCK), in,
    GEMM_BLOCK], transposed, zero-padded); None where neither takes it.

    oneDNN's packed layout is chosen without knowing the row counts it will meet, and its
    linear trusts the layout it is given without checking it against the kernel it picks for
    each row count (reorder_weight=false in torch's mkldnn_linear_pointwise). So a packed shape
    is used only once it gave a plain linear's answer at decode and prefill row counts on this
    CPU (`_onednn_verified`); where it did not, the weight goes to gemm.c or stays unpacked."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    path = path or gemm_path(weight.dtype)
    weight = weight.detach()
    if path == ONEDNN:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        if _onednn_verified(weight, packed):
            return packed
        path = GEMM_C if weight.dtype == torch.bfloat16 and _gemm_c_available() else None
    if path == GEMM_C:
        out_features, in_features = weight.shape
        blocks = -(-out_features // GEMM_BLOCK)
        padded = weight.new_zeros(blocks * GEMM_BLOCK, in_features)
        padded[:out_features] = weight
        return padded.view(blocks, GEMM_BLOCK, in_features).transpose(1, 2).contiguous()
    return None


def _gemm_c_available() -> bool:
    library = build.load("gemm")
    return library is not None and library.gemm_available() == 1


# Row counts a packed oneDNN GEMM is checked at: decode batches and prefill chunks, where its
# kernel choice (and so the layout it expects) may change.
VERIFY_ROWS = (1, 2, 5, 16, 64, 256)
# Relative error against the float32 product: rounding alone stays near 2^-8 for bfloat16 (and
# far below for float32); weights read in another layout than they were written give ~1.
VERIFY_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
_verified_shapes: dict[tuple[torch.dtype, int, int], bool] = {}


def _onednn_verified(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether oneDNN's linear on `packed` is `weight`'s linear at every VERIFY_ROWS count
    (checked once per dtype and shape, on random rows)."""
    key = (weight.dtype, *weight.shape)
    if key not in _verified_shapes:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(sum(VERIFY_ROWS), weight.shape[1], generator=generator).to(weight.dtype)
        expected = x.float() @ weight.float().T
        worst, start = 0.0, 0
        for rows in VERIFY_ROWS:
            got = _onednn_linear(x[start : start + rows], packed, None, "none", [], "").float()
            want = expected[start : start + rows]
            worst = max(worst, ((got - want).norm() / want.norm().clamp_min(1e-30)).item())
            start += rows
        _verified_shapes[key] = ok = worst <= VERIFY_TOLERANCE[weight.dtype]
        if not ok:
            logger.warning(
                "oneDNN's packed %s GEMM for a %d x %d weight is off by %.3g (relative) on this CPU: "
                "weights of that shape run on gemm.c (bfloat16) or torch's GEMM instead",
                str(weight.dtype).removeprefix("torch."),
                *weight.shape,
                worst,
            )
    return _verified_shapes[key]


# The overload itself: calling through `torch.ops.mkldnn._linear_pointwise` resolves it every time.
_onednn_linear = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if packed.dim() == 3:  # column blocks for gemm.c (oneDNN's packed weights are 2-D)
        return _gemm_c_linear(x, weight, bias, packed)
    return _onednn_linear(x, packed, bias, "none", [], "")


def _gemm_c_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor
) -> torch.Tensor:
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    status = _c_function("gemm", "linear", x.dtype)(
        rows.data_ptr(),
        rows.stride(0),
        rows.shape[0],
        in_features,
        packed.data_ptr(),
        out_features,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        out_features,
    )
    if status != 0:
        raise MemoryError(f"GEMM of {rows.shape[0]} x {in_features} x {out_features}: out of memory")
    return out.view(*x.shape[:-1], out_features)


# `paged_attention` takes a float32 query over a bfloat16 cache as it is (dispatch.paged_attention
# rounds the query to the cache's dtype for backends without this).
READS_A_CACHE_OF_ANOTHER_DTYPE = True

# A prompt (chunk) with more new tokens than this goes to SDPA's flash kernel, which works in
# GEMM-sized tiles; shorter ones are cheaper token by token in the C kernel, in the same call
# as the decodes (one parallel region per layer instead of a handful of small ops per sequence).
LONG_PREFILL = 512


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context: [T, Hq, D]; with
    a `window`, over the last `window` positions of it only."""
    md = metadata
    kernel = _attention_kernel(query, key_cache)
    if kernel is None and key_cache.dtype != query.dtype:  # the reference reads one dtype
        attended = reference.paged_attention(
            query.to(key_cache.dtype), key_cache, value_cache, md, scale, window
        )
        return attended.to(query.dtype)
    if kernel is None:
        return reference.paged_attention(query, key_cache, value_cache, md, scale, window)
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if "cpu_plan" not in md.derived:  # the same for every layer of the step
        md.derived["cpu_plan"] = _plan(md)
    rows, seqs, context_lens, block_tables, long_prefills = md.derived["cpu_plan"]
    for seq in long_prefills:
        _attend_prefill(seq, query, key_cache, value_cache, md, scale, window, out)
    if rows.numel():
        num_kv_heads, head_dim = key_cache.shape[-2:]
        status = kernel(
            query.data_ptr(),
            query.stride(0),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            out.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            rows.data_ptr(),
            seqs.data_ptr(),
            context_lens.data_ptr(),
            rows.numel(),
            query.shape[1],
            num_kv_heads,
            head_dim,
            key_cache.shape[1],
            scale,
            window or 0,  # 0: no window
        )
        if status != 0:
            raise ValueError(
                f"paged attention kernel refused shapes {tuple(query.shape)} / {tuple(key_cache.shape)}"
            )
    return out


def _plan(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Per new token: its row, its sequence and how many positions it attends to (its position
    + 1: causal), and the block tables as the kernel reads them (int32, rows dense); the tokens
    of long prefills are left out and listed for SDPA instead."""
    starts = md.query_start_loc.long()
    query_lens = starts[1:] - starts[:-1]
    seqs = torch.repeat_interleave(torch.arange(md.num_seqs), query_lens)
    tokens = torch.arange(seqs.numel())
    context_lens = md.seq_lens.long()[seqs] - query_lens[seqs] + (tokens - starts[seqs]) + 1
    long_prefills = [
        seq for seq, length in enumerate(query_lens[: md.num_prefills].tolist()) if length > LONG_PREFILL
    ]
    if long_prefills:
        keep = ~torch.isin(seqs, torch.tensor(long_prefills))
        tokens, seqs, context_lens = tokens[keep], seqs[keep], context_lens[keep]
    as_int32 = (t.to(torch.int32).contiguous() for t in (tokens, seqs, context_lens, md.block_tables))
    return (*as_int32, long_prefills)


def _attention_kernel(query: torch.Tensor, key_cache: torch.Tensor):
    """The C function for these dtypes (the query's and the cache's: the same, or a float32 query
    over a bfloat16 cache), or None (no compiler, other dtypes, a layout it cannot read)."""
    if not key_cache.is_contiguous():
        return None
    return _c_function("paged_attention", "paged_attention", query.dtype, key_cache.dtype)


def _attend_prefill(
    seq: int, query, key_cache, value_cache, md: AttentionMetadata, scale: float, window, out
) -> None:
    """One long prompt (chunk) through SDPA over its gathered context."""
    start, end = (int(x) for x in md.query_start_loc[seq : seq + 2])
    seq_len = int(md.seq_lens[seq])
    num_new = end - start
    cached = seq_len - num_new
    num_kv_heads, head_dim = key_cache.shape[-2:]
    block_size = key_cache.shape[1]
    positions = torch.arange(seq_len)
    if cached == 0:  # a whole prompt, or its first chunk: its own new tokens only
        slots = md.slot_mapping[start:end]
    else:
        slots = md.block_tables[seq].long()[positions // block_size] * block_size + positions % block_size
    mask = None  # a whole prompt without a window: SDPA's own causal mask
    if cached or window:
        # Bottom-right causal: new token i sits at position cached + i.
        query_positions = (cached + torch.arange(num_new))[:, None]
        mask = positions[None] <= query_positions
        if window:
            mask &= positions[None] > query_positions - window
    # 4-D, [1, heads, tokens, dim]: with 3-D tensors SDPA takes its slow math path on the CPU.
    keys = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).transpose(0, 1)[None]
    values = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).transpose(0, 1)[None]
    keys, values = keys.to(query.dtype), values.to(query.dtype)  # a cache of another dtype: exact
    attended = F.scaled_dot_product_attention(
        query[start:end].transpose(0, 1)[None],
        keys,
        values,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )[0]
    out[start:end] = attended.transpose(0, 1)
