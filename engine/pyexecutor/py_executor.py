"""`PyExecutor`: the engine loop — fetch, activate, schedule, forward, sample, respond.

It owns the model and the KV cache and runs on one thread (of a worker process, or of the
caller's process in single-process mode). Requests come in through the `RequestQueue`;
every step's responses go out as one batch through `on_responses`. A `RequestError` fails
one request; any other exception is fatal and ends the loop through `on_fatal`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from berth.engine.config import EngineConfig
from berth.engine.executor.errors import RequestError
from berth.engine.executor.request import GenerationRequest
from berth.engine.executor.response import Response, TokenLogprobs
from berth.engine.models.config import ModelConfig
from berth.engine.models.loader import load_model
from berth.engine.pyexecutor.kv_cache import KVCacheManager, plan_num_blocks
from berth.engine.pyexecutor.llm_request import LlmRequest, RequestState
from berth.engine.pyexecutor.model_runner import ModelRunner
from berth.engine.pyexecutor.request_queue import Abort, RequestQueue, Shutdown
from berth.engine.pyexecutor.sampler import Sampler
from berth.engine.pyexecutor.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    """A snapshot sent with every step's responses (for /metrics and /admin/state)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    admission: str
    num_preemptions: int = 0  # since start: a sign the KV pool is too small for the load


ResponseSink = Callable[[list[Response], EngineStats], None]


class PyExecutor:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.model_config: ModelConfig = model.config
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.kv_cache = kv_cache
        self.request_queue = RequestQueue()
        self.scheduler = Scheduler(
            kv_cache,
            max_batch_size=config.max_batch_size,
            max_num_tokens=config.max_num_tokens,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.model_runner = ModelRunner(model, kv_cache, kv_cache.kv_caches.device)
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self._active: dict[int, list[LlmRequest]] = {}  # client_id -> its sequences
        self._shutting_down = False
        self.num_preemptions = 0
        self._thread: threading.Thread | None = None
        self._start_on_thread: queue.SimpleQueue | None = None  # set by `launch`

    @classmethod
    def from_config(cls, config: EngineConfig) -> PyExecutor:
        device = torch.device(config.resolved_device())
        model = load_model(config.model, config.dtype, device)
        mc: ModelConfig = model.config
        dtype = next(model.parameters()).dtype
        max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        bytes_per_block = (
            2 * mc.num_layers * config.kv_block_size * mc.num_kv_heads * mc.head_dim * dtype.itemsize
        )
        num_blocks = plan_num_blocks(
            explicit_blocks=config.kv_cache_blocks,
            memory_fraction=config.kv_cache_memory_fraction,
            bytes_per_block=bytes_per_block,
            max_useful_blocks=config.max_batch_size * -(-max_model_len // config.kv_block_size),
            device=device,
        )
        kv_cache = KVCacheManager(
            num_blocks,
            config.kv_block_size,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=dtype,
            device=device,
        )
        return cls(config, model, kv_cache)

    @classmethod
    def launch(cls, config: EngineConfig) -> PyExecutor:
        """`from_config` on a new thread, which then runs the loop once `start()` is called.

        Why: torch's CPU ops keep one OpenMP thread pool per calling thread. A model built on
        one thread and stepped on another leaves two pools contending for the cores, which
        made every engine step 2-3x slower on a 2-core machine. So the loop's thread builds
        the model, and no other thread of the engine runs torch ops.
        """
        built: queue.SimpleQueue = queue.SimpleQueue()
        start: queue.SimpleQueue = queue.SimpleQueue()

        def main() -> None:
            try:
                engine = cls.from_config(config)
            except BaseException as error:
                built.put(error)
                return
            engine._start_on_thread = start
            built.put(engine)
            engine.run(*start.get())

        thread = threading.Thread(target=main, name="berth-engine-loop", daemon=True)
        thread.start()
        outcome = built.get()
        if isinstance(outcome, BaseException):
            raise outcome
        outcome._thread = thread
        return outcome

    # ---- the loop -----------------------------------------------------------------------------

    def start(self, on_responses: ResponseSink, on_fatal: Callable[[BaseException], None]) -> None:
        if self._start_on_thread is not None:  # launched: its thread waits for these
            self._start_on_thread.put((on_responses, on_fatal))
            return
        self._thread = threading.Thread(
            target=self.run, args=(on_responses, on_fatal), name="berth-engine-loop", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def run(self, on_responses: ResponseSink, on_fatal: Callable[[BaseException], None]) -> None:
        try:
            while not self._shutting_down or self.scheduler.has_work():
                responses = self.iterate()
                if responses:
                    on_responses(responses, self.stats())
        except BaseException as error:
            logger.exception("engine loop failed")
            on_fatal(error)

    def iterate(self) -> list[Response]:
        """One turn of the loop: take what is queued (blocking only while idle), then one step."""
        responses = self._fetch_new_requests()
        if self.scheduler.has_work():
            responses += self.step()
        return responses

    def step(self) -> list[Response]:
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted)
        if not out.scheduled:
            return []
        logits, samplers = self.model_runner.execute(out.scheduled)
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
        sampled = self.sampler.sample(logits, samplers) if samplers else None
        responses = []
        for i, request in enumerate(samplers):
            request.state = RequestState.GENERATION_IN_PROGRESS
            token = sampled.token_ids[i]
            request.token_ids.append(token)
            self._check_stop(request, token)
            response = self._emit_token(request, token, sampled.logprobs[i])
            if response is not None:
                responses.append(response)
            if request.finished:
                self._retire(request)
        return responses

    def _fetch_new_requests(self) -> list[Response]:
        """Takes everything queued; blocks only while there is nothing to do."""
        idle = not self.scheduler.has_work()
        first = self.request_queue.get(timeout=None if idle else 0)
        items = ([first] if first is not None else []) + self.request_queue.get_nowait_all()
        responses: list[Response] = []
        for item in items:
            if isinstance(item, GenerationRequest):
                responses += self._activate(item)
            elif isinstance(item, Abort):
                responses += self._abort(item.client_id, item.seq_index)
            elif isinstance(item, Shutdown):
                # Stop admitting; what is queued or running is aborted so every client hears back.
                self._shutting_down = True
                for client_id in list(self._active):
                    responses += self._abort(client_id, None)
        return responses

    # ---- admission at activation: the checks that need the model and the pool ----------------

    def _activate(self, request: GenerationRequest) -> list[Response]:
        if self._shutting_down:
            return [_error(request.client_id, "engine is shutting down", "admission_closed")]
        try:
            group = self._make_sequences(request)
        except RequestError as error:
            return [_error(request.client_id, str(error), error.code)]
        self._active[request.client_id] = group
        self.scheduler.add(group)
        return []

    def _make_sequences(self, request: GenerationRequest) -> list[LlmRequest]:
        params = request.sampling_params
        prompt = request.prompt_token_ids.tolist()
        num_prompt = len(prompt)
        vocab_size = self.model_config.vocab_size
        if request.client_id in self._active:
            raise RequestError(f"request id {request.client_id} is already active")
        if max(prompt) >= vocab_size:
            bad = next(t for t in prompt if t >= vocab_size)
            raise RequestError(
                f"prompt token id {bad} is out of range for the vocabulary (size {vocab_size})"
            )
        if params.n > self.config.max_batch_size:
            raise RequestError(f"n={params.n} exceeds max_batch_size={self.config.max_batch_size}")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {num_prompt + max_tokens} "
                f"exceeds the model's maximum length of {self.max_model_len} tokens",
                "too_long",
            )
        if not self.config.enable_chunked_prefill and num_prompt > self.config.max_num_tokens:
            raise RequestError(
                f"prompt ({num_prompt} tokens) exceeds max_num_tokens={self.config.max_num_tokens} "
                "and chunked prefill is disabled",
                "too_long",
            )
        # The last sampled token is never written to the cache.
        blocks_needed = self.kv_cache.blocks_for(num_prompt + max_tokens - 1)
        capacity = self.kv_cache.pool.num_blocks
        if blocks_needed > capacity:
            raise RequestError(
                f"request can never fit in the KV cache: it needs {blocks_needed} blocks of "
                f"{self.kv_cache.block_size} tokens (prompt {num_prompt} + max_tokens {max_tokens}) "
                f"but the pool holds {capacity} blocks",
                "too_long",
            )
        group: list[LlmRequest] = []
        for index in range(params.n):
            group.append(
                LlmRequest(
                    request.client_id,
                    index,
                    prompt,
                    params,
                    priority=request.priority,
                    max_tokens=max_tokens,
                    arrival_time=request.arrival_time,
                    group=group,
                )
            )
        for sequence in group:
            sequence.streaming = request.streaming or bool(params.stop_strings)
        return group

    # ---- finishing -----------------------------------------------------------------------------

    def _check_stop(self, request: LlmRequest, token: int) -> None:
        params = request.params
        if token in params.stop_token_ids:
            request.finish("stop", token)
        elif token in self.eos_token_ids and not params.ignore_eos:
            request.finish("stop")
        elif request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.finish("length")

    def _emit_token(self, request: LlmRequest, token: int, logprobs: TokenLogprobs | None) -> Response | None:
        """Streamed sequences get every token at once; others get all of theirs when they finish."""
        if logprobs is not None:
            request.unsent_logprobs.append(logprobs)
        if request.first_token_time is None:
            request.first_token_time = time.time()
        if not (request.streaming or request.finished):
            return None
        return self._response(request)

    def _response(self, request: LlmRequest) -> Response:
        unsent = request.token_ids[request.num_prompt_tokens + request.num_sent_tokens :]
        response = Response(
            request.client_id,
            request.seq_index,
            unsent,
            logprobs=request.unsent_logprobs or None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        if request.num_sent_tokens == 0 and unsent:
            response.first_token_time = request.first_token_time
        if not request.sent_any:
            response.queue_seconds = max(
                0.0, (request.first_scheduled_time or time.time()) - request.arrival_time
            )
            request.sent_any = True
        request.num_sent_tokens += len(unsent)
        request.unsent_logprobs = []
        return response

    def _retire(self, request: LlmRequest) -> None:
        self.scheduler.remove(request)
        group = self._active.get(request.client_id)
        if group is not None and all(s.finished for s in group):
            del self._active[request.client_id]

    def _abort(self, client_id: int, seq_index: int | None) -> list[Response]:
        group = self._active.get(client_id)
        if group is None:
            logger.debug(
                "abort for request %d, which is not active (finished or unknown): ignored", client_id
            )
            return []
        responses = []
        for sequence in group:
            if sequence.finished or (seq_index is not None and sequence.seq_index != seq_index):
                continue
            sequence.finish("abort")
            responses.append(self._response(sequence))
            self._retire(sequence)
        return responses

    # ---- control and introspection ------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.kv_cache.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=pool.num_used,
            kv_blocks_total=pool.num_blocks,
            admission=self.request_queue.admission_state.value,
            num_preemptions=self.num_preemptions,
        )


def _error(client_id: int, message: str, code: str) -> Response:
    return Response(client_id, 0, [], error=message, error_code=code)
