"""The engine's hot operations behind one interface (re-exported by `berth.kernels`).

Model code calls these functions and never knows which implementation runs: Triton kernels
for CUDA tensors, the CPU backend (`cpu_ops`: oneDNN GEMMs on packed weights, a C paged
attention kernel) for CPU tensors, and the torch reference, which defines what is correct.
`set_backend("torch" | "triton" | "cpu")` (or `BERTH_KERNEL_BACKEND`) overrides the choice,
e.g. to run the Triton kernels on CPU tensors under `TRITON_INTERPRET=1` in tests, or the
plain torch reference as the oracle.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from berth.kernels import reference
from berth.kernels.metadata import AttentionMetadata
from berth.kernels.rope import rope_cos_sin_cache

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

BACKENDS = ("auto", "torch", "triton", "cpu")


def _checked(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r} ({source})")
    return name


# A typo in the environment must fail loudly, not silently fall back to a default.
_backend = _checked(os.environ.get("BERTH_KERNEL_BACKEND", "auto"), "from BERTH_KERNEL_BACKEND")


def set_backend(name: str) -> None:
    """Force a backend ("torch", "triton") or restore device-based selection ("auto")."""
    global _backend
    _backend = _checked(name, "from set_backend")


def get_backend() -> str:
    return _backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def _implementation(tensor: torch.Tensor) -> ModuleType:
    name = _backend
    if name == "auto":
        name = "triton" if tensor.is_cuda else "cpu" if tensor.device.type == "cpu" else "torch"
    if name == "torch":
        return reference
    if name == "cpu":
        from berth.kernels import cpu_ops

        return cpu_ops
    from berth.kernels import triton_ops  # imported lazily: triton is an optional dependency

    return triton_ops


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A copy of a linear layer's weight [out, in] laid out for the backend's GEMM (done once,
    after loading), or None where the backend uses the weight as it is."""
    return _implementation(weight).pack_linear_weight(weight)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias; `packed` is what `pack_linear_weight(weight)` returned."""
    return _implementation(x).linear(x, weight, bias, packed)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim. With `residual`: returns (norm(x + residual), x + residual)."""
    return _implementation(x).rms_norm(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotates query [T, Hq, D] and key [T, Hk, D] in place for `positions` [T]."""
    _implementation(query).rotary_embedding(positions, query, key, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate | up) -> silu(gate) * up, [T, I]."""
    return _implementation(x).silu_and_mul(x)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatters key/value [T, Hk, D] into caches [num_blocks, block_size, Hk, D] at `slot_mapping`.
    A negative slot is a padding token (a captured decode graph's spare rows): not written.
    A cache of another dtype (a bfloat16 KV cache under a float32 model) stores them rounded."""
    if key_cache.dtype != key.dtype:
        key, value = key.to(key_cache.dtype), value.to(key_cache.dtype)
    _implementation(key).write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens (query [T, Hq, D]) over their sequences' paged cache;
    with a sliding `window`, each token sees only the last `window` positions (itself included).
    Over a cache of another dtype (a bfloat16 KV cache under a float32 model) the CPU backend
    reads the float32 query and writes float32 output, rounding only what the cache holds;
    backends that read one dtype attend in the cache's (the query rounded to it, the output
    back in the query's: one more rounding of each)."""
    implementation = _implementation(query)
    mixed = getattr(implementation, "READS_A_CACHE_OF_ANOTHER_DTYPE", False)
    if key_cache.dtype != query.dtype and not mixed:
        attended = implementation.paged_attention(
            query.to(key_cache.dtype), key_cache, value_cache, metadata, scale, window
        )
        return attended.to(query.dtype)
    return implementation.paged_attention(query, key_cache, value_cache, metadata, scale, window)
