"""Engine settings: the knobs of the scheduler, the KV cache and the device."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

SCHEDULING_POLICIES = ("fcfs", "priority")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")
# The operator sets this in every pod that runs the engine: the fraction of what the pod's
# memory limit leaves that the KV pool may take (the rest stays for what the operator reserves).
KV_CACHE_MEMORY_FRACTION_ENV = "BERTH_KV_CACHE_MEMORY_FRACTION"
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.9
KV_TRANSFER_KEY_ENV = "BERTH_KV_TRANSFER_KEY"


def _fraction_from_env() -> float:
    text = os.environ.get(KV_CACHE_MEMORY_FRACTION_ENV, "").strip()
    if not text:
        return DEFAULT_KV_CACHE_MEMORY_FRACTION
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{KV_CACHE_MEMORY_FRACTION_ENV} must be a number in (0, 1], got {text!r}") from None


@dataclass
class EngineConfig:
    """Everything the engine needs besides the requests.

    KV cache size (`berth.engine.pyexecutor.memory_budget`): `kv_cache_blocks` or
    `kv_cache_memory` (bytes) when given, else `kv_cache_memory_fraction` (default:
    $BERTH_KV_CACHE_MEMORY_FRACTION, or 0.9) of what the tightest memory limit (the process's
    memory cgroup, the host's available memory, the CUDA device's free memory) leaves once the
    weights are loaded and the largest step's activations (profiled at start) and a headroom
    are set aside; never more than `max_batch_size` sequences of `max_model_len` tokens can
    use, and never less than one of them (the engine refuses to start instead). An override
    the limits cannot hold is refused at start too. `kv_cache_dtype` "auto" stores keys and
    values in the model's dtype; "bfloat16" halves a float32 model's pool per token.

    Prefix caching (on by default, as in vLLM): full KV blocks are kept after their sequence
    ends and reused by later requests that start with the same tokens (and `cache_salt`).

    Tensor parallelism: `tensor_parallel_size` ranks each hold a shard of the model (an MPI
    world; `models/parallel.py` says which shard). With GPUs, each rank uses the GPU of its
    local rank on its host, so `device` is "cuda" (or None), never one GPU for all.
    """

    model: str
    dtype: str = "auto"
    device: str | None = None  # None: CUDA when available, else CPU
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    kv_block_size: int = 16
    kv_cache_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    kv_cache_memory_fraction: float = field(default_factory=_fraction_from_env)
    kv_cache_dtype: str = "auto"
    scheduling_policy: str = "fcfs"
    seed: int = 0
    tensor_parallel_size: int = 1
    # Stall detection: while the engine has work, a step must complete within `stall_timeout`
    # seconds, the first one after load or wakeup within `first_step_timeout` (default: five
    # times as long; it may compile kernels). Past it the engine is dead ("stalled").
    stall_timeout: float = 60.0
    first_step_timeout: float | None = None
    # Every sleep (after its drain, which has its own timeout) and wakeup must complete within
    # `transition_timeout` seconds: past it the engine is dead ("stalled"), as a hung step is.
    transition_timeout: float = 600.0
    # On a GPU, pure decode steps replay CUDA graphs captured at start (`cuda_graphs`); True runs
    # every step eagerly (for debugging, or to compare). Off on a CPU whatever this says.
    enforce_eager: bool = False
    # The enqueue window (`pyexecutor/enqueue_window.py`, off at 0): new requests may wait up to
    # this long for others, to start as one batch; with a ratio in (0, 1], the window also
    # closes once the next step would carry that share of `max_num_tokens`.
    batch_wait_timeout_ms: float = 0.0
    batch_wait_max_tokens_ratio: float = 0.0
    # KV-cache events (`pyexecutor/kv_events.py`, off when None): ZeroMQ endpoints to bind
    # (tcp://HOST:PORT, a port of * picks one; ipc://PATH) for the events and for the snapshots
    # late subscribers ask for, and the engine's name in them (default: host:pid).
    kv_events_endpoint: str | None = None
    kv_events_snapshot_endpoint: str | None = None
    kv_events_engine_id: str | None = None
    # Disaggregated prefill/decode (`berth.engine.disaggregation`): where this engine serves the
    # KV blocks of its context-only requests (a ZeroMQ endpoint; None: it runs none), and the
    # key that signs KV transfers (hex; default $BERTH_KV_TRANSFER_KEY, else $BERTH_ENGINE_KEY,
    # the deployment's key), shared by the context and generation engines.
    kv_transfer_endpoint: str | None = None
    kv_transfer_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "kv_block_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_model_len", "kv_cache_blocks", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.kv_cache_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give kv_cache_blocks or kv_cache_memory, not both")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        fraction = self.kv_cache_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}"
            )
        if self.tensor_parallel_size > 1 and self.device is not None and self.device.startswith("cuda:"):
            raise ValueError(
                f"device {self.device!r} with tensor_parallel_size {self.tensor_parallel_size}: every rank "
                "uses the GPU of its local rank; say device='cuda'"
            )
        for name in ("stall_timeout", "first_step_timeout", "transition_timeout"):
            value = getattr(self, name)
            if value is None and name == "first_step_timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        timeout, ratio = self.batch_wait_timeout_ms, self.batch_wait_max_tokens_ratio
        # At most a second: the loop, blocked in the window, must still speak every heartbeat.
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= 1000:
            raise ValueError(f"batch_wait_timeout_ms must be in [0, 1000], got {timeout!r}")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            raise ValueError(f"batch_wait_max_tokens_ratio must be in [0, 1], got {ratio!r}")
        if timeout / 1000 >= self.stall_timeout / 2:
            raise ValueError(
                f"batch_wait_timeout_ms {timeout:g} must be under half the stall timeout "
                f"({self.stall_timeout:g} s)"
            )
        if ratio and not timeout:
            raise ValueError("batch_wait_max_tokens_ratio needs batch_wait_timeout_ms > 0 (its window)")
        if self.kv_transfer_endpoint is not None and self.transfer_key() is None:
            raise ValueError(
                "kv_transfer_endpoint needs a key that the context and generation engines share: "
                "set BERTH_KV_TRANSFER_KEY (or BERTH_ENGINE_KEY), 64 hex digits"
            )
        for name in ("kv_events_endpoint", "kv_events_snapshot_endpoint", "kv_transfer_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(("tcp://", "ipc://"))):
                raise ValueError(
                    f"{name} must be a ZeroMQ endpoint (tcp://HOST:PORT or ipc://PATH), got {value!r}"
                )
        if self.kv_events_endpoint is None and self.kv_events_snapshot_endpoint is not None:
            raise ValueError("kv_events_snapshot_endpoint needs kv_events_endpoint")
        if self.kv_events_endpoint is not None and not self.enable_prefix_caching:
            raise ValueError(
                "KV-cache events are the prefix cache's: kv_events_endpoint needs prefix caching on"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )

    def transfer_key(self) -> bytes | None:
        """The KV transfer key (`kv_transfer_key`, else from the environment), or None."""
        text = (
            self.kv_transfer_key or os.environ.get(KV_TRANSFER_KEY_ENV) or os.environ.get("BERTH_ENGINE_KEY")
        )
        if not text:
            return None
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise ValueError("the KV transfer key must be hexadecimal") from None
        if len(key) < 16:
            raise ValueError("the KV transfer key must hold at least 16 bytes (32 hex digits)")
        return key

    @property
    def first_step_bound(self) -> float:
        return self.first_step_timeout if self.first_step_timeout is not None else 5 * self.stall_timeout

    @property
    def collective_timeout(self) -> float:
        """How long a collective inside a step waits for the other ranks: well under the stall
        timeout, so that the rank that stopped answering is the one that is named."""
        return self.stall_timeout / 2

    @property
    def transition_collective_timeout(self) -> float:
        """How long a rank waits for the others to finish their part of a sleep or wakeup: past
        the transition timeout, with room for the stall watchdog, which names the stuck rank, to
        speak first; then every rank gives up instead of waiting forever."""
        return self.transition_timeout + 30.0

    def max_model_len_for(self, max_position_embeddings: int) -> int:
        """The longest sequence the engine serves: the configured limit, never past the model's
        positions (its RoPE table). The one place this rule is written."""
        return min(self.max_model_len or max_position_embeddings, max_position_embeddings)

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
