"""A request as it crosses the executor boundary."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from berth.engine.sampling_params import SamplingParams


@dataclass
class GenerationRequest:
    """What the worker needs to run one request.

    Prompt token ids travel as one int32 buffer, whatever the caller passed: a 32k-token
    prompt is then one 128 KB array on the wire, not 32k Python ints to pickle.
    """

    prompt_token_ids: np.ndarray
    sampling_params: SamplingParams
    streaming: bool = False
    priority: float = 0.5
    arrival_time: float = field(default_factory=time.time)
    client_id: int = -1  # assigned by the executor when submitted

    def __post_init__(self) -> None:
        self.prompt_token_ids = as_token_buffer(self.prompt_token_ids)
        if self.prompt_token_ids.size == 0:
            raise ValueError("prompt must contain at least one token")
        # `not (0 <= p <= 1)` is also true for NaN: reject it here, not deep in a heap.
        if not isinstance(self.priority, (int, float)) or not (0.0 <= self.priority <= 1.0):
            raise ValueError(f"priority must be a number in [0, 1], got {self.priority!r}")
        if isinstance(self.priority, float) and math.isnan(self.priority):
            raise ValueError("priority must not be NaN")


def as_token_buffer(token_ids) -> np.ndarray:
    """A 1-D C-contiguous int32 array of non-negative token ids."""
    if hasattr(token_ids, "detach"):  # torch.Tensor, without importing torch here
        token_ids = token_ids.detach().cpu().numpy()
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"prompt token ids must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"prompt token ids must be integers, got {array.dtype}")
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        raise ValueError("prompt token ids must be non-negative 32-bit integers")
    return np.ascontiguousarray(array, dtype=np.int32)
