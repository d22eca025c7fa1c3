"""Engine settings: the knobs of the scheduler, the KV cache and the device."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class EngineConfig:
    """Everything the engine needs besides the requests.

    KV cache size: `kv_cache_blocks` when given, else `kv_cache_memory_fraction` of the free
    device memory (of available RAM on CPU), never more than `max_batch_size` sequences of
    `max_model_len` tokens can use.
    """

    model: str
    dtype: str = "auto"
    device: str | None = None  # None: CUDA when available, else CPU
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    kv_block_size: int = 16
    kv_cache_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.9
    scheduling_policy: str = "fcfs"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "kv_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_model_len", "kv_cache_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
