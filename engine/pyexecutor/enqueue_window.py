"""The enqueue window: hold newly arrived requests a bounded time so they start as one batch.

With it off (the default) a request is admitted in the first step after it arrives. With a
timeout, a request that arrives while nothing else waits opens a window; requests arriving
while it is open join it; the window closes, and everything in it is admitted (as room
allows), when the first of these happens:

- the timeout has passed since the window opened (so no request waits in it longer);
- the held sequences and the running ones fill the batch (`max_batch_size`);
- with a token ratio, the next step's tokens (the held prompts' uncomputed tokens plus one
  per running sequence) reach `ratio * max_num_tokens`.

Running sequences keep stepping while a window is open: only admission waits, so decoding
streams never stall for it. A request that waits for KV room or a seat after its window closed
never opens a new one, so the window delays a request once, by at most the timeout.
(TensorRT-LLM's `batch_wait_timeout_ms` / `batch_wait_max_tokens_ratio`.)
"""

from __future__ import annotations

import time
from collections.abc import Callable


class EnqueueWindow:
    def __init__(
        self,
        timeout_seconds: float,
        *,
        max_batch_size: int,
        max_tokens: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_seconds = timeout_seconds
        self.max_batch_size = max_batch_size
        self.max_tokens = max_tokens  # 0: no token threshold
        self.clock = clock
        self._closes_at: float | None = None
        self.num_opened = 0  # since start: how many windows held admission

    @property
    def enabled(self) -> bool:
        return self.timeout_seconds > 0

    @property
    def is_open(self) -> bool:
        return self._closes_at is not None

    def open(self) -> None:
        """A request arrived while nothing else waited."""
        if self.enabled and self._closes_at is None:
            self._closes_at = self.clock() + self.timeout_seconds
            self.num_opened += 1

    def holds(self, num_sequences: int, num_tokens: int) -> bool:
        """Whether admission waits this step, given the sequences and tokens the next step would
        carry if the held ones were admitted; closes the window when it stops holding."""
        if self._closes_at is None:
            return False
        full = num_sequences >= self.max_batch_size or (0 < self.max_tokens <= num_tokens)
        if full or self.clock() >= self._closes_at:
            self._closes_at = None
            return False
        return True

    def seconds_left(self) -> float:
        """Until the open window closes by its timeout (0 when none is open)."""
        if self._closes_at is None:
            return 0.0
        return max(0.0, self._closes_at - self.clock())

    def close(self) -> None:
        self._closes_at = None
