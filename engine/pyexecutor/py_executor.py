"""`PyExecutor`: the engine loop — fetch, activate, schedule, forward, sample, respond.

It owns the model and the KV cache and runs on one thread (of a worker process, or of the
caller's process in single-process mode). Requests come in through the `RequestQueue`;
every step's responses go out as one batch through `on_responses`. A failure that belongs to
one request (a `RequestError`, or anything raised while admitting or sampling it alone) fails
that request; any other exception is fatal and ends the loop through `on_fatal`.

Sleep and wakeup are control messages on the same queue, taken up between steps by the state
machine in `transitions.py`: each ends with a `TransitionResult` through `on_transition`, after
the responses of the turn that ended it.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable

import torch

from berth.engine.config import EngineConfig
from berth.engine.disaggregation import ContextOnly, GenerationOnly, KVHandle
from berth.engine.engine_io import (
    AbortRequest,
    EngineLimits,
    EngineStalledError,
    EngineStats,
    GenerationRequest,
    KVCachePlan,
    LoadProgress,
    ProgressSink,
    RequestError,
    Response,
    Shutdown,
    Sleep,
    TokenLogprobs,
    TransitionResult,
    Wakeup,
    internal_error,
)
from berth.engine.models.config import ModelConfig
from berth.engine.models.parallel import SINGLE, TensorParallelGroup
from berth.engine.pyexecutor import step_inputs
from berth.engine.pyexecutor.disaggregation import Disaggregation, PullDone
from berth.engine.pyexecutor.enqueue_window import EnqueueWindow
from berth.engine.pyexecutor.grammar_masks import GrammarMasks
from berth.engine.pyexecutor.kv_events import KVEventPublisher
from berth.engine.pyexecutor.kv_transfer import PullRequest, ReleaseRequest
from berth.engine.pyexecutor.model_runner import ModelRunner
from berth.engine.pyexecutor.rank import build_rank, rank_memory
from berth.engine.pyexecutor.request_queue import RequestQueue
from berth.engine.pyexecutor.sampler import Sampler
from berth.engine.pyexecutor.scheduler import Scheduler
from berth.engine.pyexecutor.sequence import Sequence, SequenceState
from berth.engine.pyexecutor.sleep import MemoryAction, RankOutcome, ReleaseMemory, resident_bytes
from berth.engine.pyexecutor.transitions import Transitions
from berth.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How often the loop reports at least while it has work (the stall watchdog listens for it):
# at most this, and at least four times within the stall timeout.
HEARTBEAT_SECONDS = 1.0

ResponseSink = Callable[[list[Response], EngineStats], None]
TransitionSink = Callable[[TransitionResult], None]


class PyExecutor:
    def __init__(
        self, config: EngineConfig, model_runner: ModelRunner, kv_cache_plan: KVCachePlan | None = None
    ) -> None:
        self.config = config
        self.model_runner = model_runner
        self.kv_cache = kv_cache = model_runner.kv_cache
        self.model_config: ModelConfig = model_runner.model.config
        self.limits = engine_limits(config, self.model_config, kv_cache.pool.num_blocks, kv_cache_plan)
        self.request_queue = RequestQueue()
        self.scheduler = Scheduler(
            kv_cache,
            max_batch_size=config.max_batch_size,
            max_num_tokens=config.max_num_tokens,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            window=EnqueueWindow(
                config.batch_wait_timeout_ms / 1000,
                max_batch_size=config.max_batch_size,
                max_tokens=config.batch_wait_max_tokens_ratio * config.max_num_tokens,
            ),
        )
        self.sampler = Sampler(config.seed)
        self.grammar_masks = GrammarMasks(self.model_config)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.memory = rank_memory(model_runner, config)
        self._active: dict[int, list[Sequence]] = {}  # request_id -> its sequences
        self._shutting_down = False
        self.num_preemptions = 0
        self.num_computed_tokens = 0
        self.transitions = Transitions(self)
        self.num_steps = 0
        self._stats_seq = itertools.count(1)  # snapshots are taken on more than one thread
        self._thread: threading.Thread | None = None
        self._start_on_thread: queue.SimpleQueue | None = None  # set by `launch`
        self.kv_events = kv_event_publisher(config)
        if self.kv_events is not None:
            kv_cache.record_events()
        self.disaggregation = Disaggregation(self, config.kv_transfer_endpoint, config.transfer_key())

    @classmethod
    def from_config(
        cls, config: EngineConfig, tp: TensorParallelGroup = SINGLE, on_progress: ProgressSink | None = None
    ) -> PyExecutor:
        """The engine of rank 0 of `tp` (of the only rank, by default): see `rank.build_rank`."""
        return cls(config, *build_rank(config, tp, on_progress))

    @classmethod
    def launch(
        cls, config: EngineConfig, tp: TensorParallelGroup = SINGLE, on_progress: ProgressSink | None = None
    ) -> PyExecutor:
        """`from_config` on a new thread, which then runs the loop once `start()` is called.
        Before it returns, one token goes through the model on every rank (`verify_forward`):
        the first step, which may compile kernels, is done before the engine says it is ready,
        and weights that give no finite logits never serve.

        Why: torch's CPU ops keep one OpenMP thread pool per calling thread. A model built on
        one thread and stepped on another leaves two pools contending for the cores, which
        made every engine step 2-3x slower on a 2-core machine. So the loop's thread builds
        the model, and no other thread of the engine runs torch ops.
        """
        built: queue.SimpleQueue = queue.SimpleQueue()
        start: queue.SimpleQueue = queue.SimpleQueue()

        def main() -> None:
            engine = None
            try:
                engine = cls.from_config(config, tp, on_progress)
                if on_progress is not None:
                    on_progress(LoadProgress("checking the model"))
                problem = engine.verify_forward()
                if problem is not None:  # the worker ends the world (other ranks wait in receive)
                    raise RuntimeError(f"{config.model} failed its check after loading: {problem}")
            except BaseException as error:
                if engine is not None:  # its sockets would outlive an engine that never runs
                    engine.close_sockets()
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

    def start(
        self,
        on_responses: ResponseSink,
        on_fatal: Callable[[BaseException], None],
        on_transition: TransitionSink,
    ) -> None:
        sinks = (on_responses, on_fatal, on_transition)
        if self._start_on_thread is not None:  # launched: its thread waits for these
            self._start_on_thread.put(sinks)
            return
        self._thread = threading.Thread(target=self.run, args=sinks, name="berth-engine-loop", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def run(
        self,
        on_responses: ResponseSink,
        on_fatal: Callable[[BaseException], None],
        on_transition: TransitionSink,
    ) -> None:
        spoke = time.monotonic()
        heartbeat_seconds = min(HEARTBEAT_SECONDS, self.config.stall_timeout / 4)
        try:
            while not self._shutting_down or self.scheduler.has_work():
                responses = self.iterate()
                if self.kv_events is not None:
                    self.kv_events.publish(self.kv_cache.event_log.take())
                # While it has work the loop speaks at least every heartbeat, even if no step
                # answered anyone (non-streamed requests): the stall watchdog hears it step.
                heartbeat = self.scheduler.has_work() and time.monotonic() - spoke >= heartbeat_seconds
                # A pin released or expired frees blocks without a step: the stats say so too.
                if (
                    responses
                    or self.transitions.state_changed
                    or heartbeat
                    or self.disaggregation.pins_changed
                ):
                    self.transitions.state_changed = self.disaggregation.pins_changed = False
                    on_responses(responses, self.stats())
                    spoke = time.monotonic()
                # After the turn's responses: whoever waits for a sleep hears of the requests it
                # aborted first.
                while self.finished_transitions:
                    on_transition(self.finished_transitions.pop(0))
            # Only after an ordered end: a loop that failed may have left a collective half
            # done, and its world is ended by whoever heard of the failure instead.
            self.model_runner.stop_followers()
        except BaseException as error:
            logger.exception("engine loop failed")
            on_fatal(_stalled_collective(error, self.model_runner.tp.size, self.config) or error)
        finally:
            self.close_sockets()

    def close_sockets(self) -> None:
        self.grammar_masks.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.disaggregation.close()

    def iterate(self) -> list[Response]:
        """One turn of the loop: take what is queued (blocking only while idle), then one step,
        then a sleep under way moves on if it can. A sleep's or wakeup's memory work is a turn
        of its own (`transitions.py`)."""
        if self.transitions.has_a_turn_of_its_own:
            self.transitions.take_its_turn()
            return []
        # A sleep taken up in an earlier turn (whose stats said PARKING) moves on after this one.
        draining = self.transitions.parking is not None
        responses = self._fetch_new_requests()
        self.disaggregation.expire_pins()
        responses += self.disaggregation.start_pulls()
        if self.scheduler.has_work():
            responses += self.step()
        if draining:
            responses += self.transitions.continue_sleep()
        return responses

    def step(self) -> list[Response]:
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted)
        if not out.scheduled:
            return []
        inputs, samplers = self.model_runner.prepare(out.scheduled)
        masks = self.grammar_masks.start(samplers)  # on its thread while the forward pass runs
        logits = self.model_runner.forward(inputs)
        self.num_steps += 1
        for sequence, num_new in out.scheduled:
            sequence.num_computed_tokens += num_new
        self.num_computed_tokens += out.num_tokens
        if not samplers:
            return []
        sampled = self.sampler.sample(logits, samplers, None if masks is None else masks.result())
        responses = []
        for i, sequence in enumerate(samplers):
            if sequence.finished:
                continue  # a sibling's failure ended its request in this loop
            error = sampled.errors[i]
            if error is not None:
                logger.error("request %d failed in sampling: %r", sequence.request_id, error)
                responses += self._fail(sequence.request_id, internal_error("sampling"))
                continue
            sequence.state = SequenceState.GENERATION_IN_PROGRESS
            token = sampled.token_ids[i]
            sequence.token_ids.append(token)
            self._check_stop(sequence, token)
            response = self._emit_token(sequence, token, sampled.logprobs[i])
            if sequence.context_only is not None and sequence.finished:
                response.kv_handle = self._pin(sequence)
            if response is not None:
                responses.append(response)
            if sequence.finished:
                self._retire(sequence)
        return responses

    def _fetch_new_requests(self) -> list[Response]:
        """Takes everything queued; blocks while there is nothing to do (for good), or while an
        enqueue window holds all there is (until it closes)."""
        timeout = self.scheduler.seconds_to_wait()
        due = self.disaggregation.seconds_to_wait()  # a pin to expire, a pull to start
        if due is not None:
            timeout = due if timeout is None else min(timeout, due)
        if self.transitions.parking is not None:  # a sleep under way looks again every turn
            timeout = 0 if not self.scheduler.has_work() else min(0.05 if timeout is None else timeout, 0.05)
        first = self.request_queue.get(timeout=timeout)
        items = ([first] if first is not None else []) + self.request_queue.get_nowait_all()
        responses: list[Response] = []
        for item in items:
            if isinstance(item, GenerationRequest):
                responses += self._activate(item)
            elif isinstance(item, AbortRequest):
                responses += self._abort(item.request_id, item.seq_index)
            elif isinstance(item, Shutdown):
                # Stop admitting; what is queued or running is aborted so every client hears back.
                self._shutting_down = True
                responses += self.abort_all(None)
            elif isinstance(item, Sleep):
                responses += self.transitions.begin_sleep(item)
            elif isinstance(item, Wakeup):
                self.transitions.begin_wakeup(item)
            elif isinstance(item, PullRequest):
                self.disaggregation.serve_pull(item)
            elif isinstance(item, ReleaseRequest):
                self.disaggregation.release(item)
            elif isinstance(item, PullDone):
                responses += self.disaggregation.pull_done(item)
        return responses

    # ---- admission at activation: the checks that need the model and the pool ----------------

    def _activate(self, request: GenerationRequest) -> list[Response]:
        """A request that cannot run fails here, alone, whatever let it through: every field is
        checked again (a request unpickled from a socket ran no validation) and so is every
        limit, and an unexpected failure while admitting it is its own."""
        if self._shutting_down:
            error = RequestError("engine is shutting down", "admission_closed")
            return [Response(request.request_id, 0, [], error=error)]
        try:
            group = self._make_sequences(request)
            if isinstance(request.disaggregated, GenerationOnly):
                self.disaggregation.check_generation_only(group, request.disaggregated)
        except RequestError as error:
            return [Response(request.request_id, 0, [], error=error)]
        except ValueError as error:
            return [Response(request.request_id, 0, [], error=RequestError(str(error)))]
        except Exception:
            logger.exception("request %d failed while being admitted", request.request_id)
            return [Response(request.request_id, 0, [], error=internal_error("admission"))]
        self._active[request.request_id] = group
        if isinstance(request.disaggregated, GenerationOnly):
            self.disaggregation.start_generation(group, request.disaggregated)
        else:
            self.scheduler.add(group)
        return []

    def _make_sequences(self, request: GenerationRequest) -> list[Sequence]:
        if request.request_id in self._active:
            raise RequestError(f"request id {request.request_id} is already active")
        request.validate()
        max_tokens = self.limits.check(request)
        params = request.sampling_params
        prompt = request.prompt_token_ids.tolist()
        group: list[Sequence] = []
        for index in range(params.n):
            group.append(
                Sequence(
                    request.request_id,
                    index,
                    prompt,
                    params,
                    priority=request.priority,
                    max_tokens=max_tokens,
                    arrival_time=request.arrival_time,
                    cache_salt=request.cache_salt,
                    group=group,
                    eos_token_ids=self.eos_token_ids,
                )
            )
        for sequence in group:
            sequence.streaming = request.streaming or bool(params.stop_strings)
        self.grammar_masks.attach(group, params)  # a grammar that does not compile fails it here
        if isinstance(request.disaggregated, ContextOnly):
            self.disaggregation.check_context_only(params.n)
            (only,) = group
            only.context_only = (request.disaggregated, only.max_tokens)
            only.max_tokens = 1  # the first token, then the pin
        return group

    # ---- finishing -----------------------------------------------------------------------------

    def _check_stop(self, sequence: Sequence, token: int) -> None:
        params = sequence.params
        if token in params.stop_token_ids:
            sequence.finish("stop", token)
        elif token in self.eos_token_ids and not params.ignore_eos:
            sequence.finish("stop")
        elif sequence.num_output_tokens >= sequence.max_tokens:  # the budget keeps within max_model_len
            sequence.finish("length")

    def _emit_token(self, sequence: Sequence, token: int, logprobs: TokenLogprobs | None) -> Response | None:
        """Streamed sequences get every token at once; others get all of theirs when they finish."""
        if logprobs is not None:
            sequence.unsent_logprobs.append(logprobs)
        if not (sequence.streaming or sequence.finished):
            return None
        return self._response(sequence)

    def _response(self, sequence: Sequence) -> Response:
        unsent = sequence.token_ids[sequence.num_prompt_tokens + sequence.num_sent_tokens :]
        response = Response(
            sequence.request_id,
            sequence.seq_index,
            unsent,
            logprobs=sequence.unsent_logprobs or None,
            finish_reason=sequence.finish_reason,
            stop_reason=sequence.stop_reason,
        )
        if not sequence.sent_any:
            response.queue_seconds = max(
                0.0, (sequence.first_scheduled_time or time.time()) - sequence.arrival_time
            )
            response.num_cached_tokens = sequence.num_cached_tokens
            sequence.sent_any = True
        sequence.num_sent_tokens += len(unsent)
        sequence.unsent_logprobs = []
        return response

    def _pin(self, sequence: Sequence) -> KVHandle | None:
        """A context-only sequence that ended after its first token, with more to generate:
        its blocks are pinned for a generation engine, and its response carries the handle."""
        spec, max_tokens = sequence.context_only
        if sequence.finish_reason != "length" or max_tokens <= 1:
            return None  # it is done for good: nothing to hand on
        return self.disaggregation.pin(sequence, spec)

    def _retire(self, sequence: Sequence) -> None:
        self.disaggregation.forget(sequence)
        self.scheduler.remove(sequence)
        group = self._active.get(sequence.request_id)
        if group is not None and all(s.finished for s in group):
            del self._active[sequence.request_id]

    def abort_all(self, reason: str | None) -> list[Response]:
        responses = []
        for request_id in list(self._active):
            responses += self._abort(request_id, None, reason)
        return responses

    def _abort(self, request_id: int, seq_index: int | None, reason: str | None = None) -> list[Response]:
        group = self._active.get(request_id)
        if group is None:
            logger.debug(
                "abort for request %d, which is not active (finished or unknown): ignored", request_id
            )
            return []
        responses = []
        for sequence in group:
            if sequence.finished or (seq_index is not None and sequence.seq_index != seq_index):
                continue
            sequence.finish("abort", reason)
            responses.append(self._response(sequence))
            self._retire(sequence)
        return responses

    def _fail(self, request_id: int, error: RequestError) -> list[Response]:
        """Ends every sequence of one request with `error` (the batch goes on)."""
        for sequence in self._active.pop(request_id, []):
            if not sequence.finished:
                sequence.finish("abort")
                self.disaggregation.forget(sequence)
                self.scheduler.remove(sequence)
        return [Response(request_id, 0, [], error=error)]

    # ---- what sleep and wakeup (`transitions.py`) do with the engine ------------------------------

    def verify_forward(self) -> str | None:
        """One token through the model on every rank, before admission reopens: what is wrong
        with the restored weights (not finite logits: a poisoned checkpoint, a broken copy), or
        None. It is also the first step after the wakeup, the one that may compile kernels."""
        params = SamplingParams(max_tokens=1)
        probe = Sequence(-1, 0, [0], params, priority=0.0, max_tokens=1, arrival_time=0.0)
        if not self.kv_cache.try_allocate(probe, 1):
            return "no KV block is free for a check step"
        try:
            logits, _ = self.model_runner.execute([(probe, 1)])
        finally:
            self.kv_cache.free(probe)
        if not bool(torch.isfinite(logits).all()):
            return "the model's logits are not finite (NaN or inf) after one token"
        return None

    def memory_actions(self, action: MemoryAction) -> list[RankOutcome]:
        """Runs `action` on every rank of the world, between steps; every rank's outcome, by rank.
        Rank 0 broadcasts it (plain data), each rank runs it on its own shard and KV cache
        (`rank.follow`), and the outcomes are gathered back here."""
        tp = self.model_runner.tp
        if isinstance(action, ReleaseMemory):  # the cache goes: pinned blocks with it
            self.disaggregation.drop_all_pins("the engine went to sleep")
        if tp.size > 1:
            step_inputs.broadcast_memory_action(tp, action)
        outcome = self.memory.apply(action)
        try:
            return tp.all_gather_transition_outcomes(outcome)
        except RuntimeError as error:
            if "timed out" not in str(error).lower():
                raise
            stalled = EngineStalledError(
                f"stalled: a rank of the {tp.size} did not finish {type(action).__name__} within "
                f"{self.config.transition_collective_timeout:g} s ({error})"
            )
            raise stalled from error

    def serve_model_config(self, model_config: ModelConfig) -> None:
        """The model a wakeup swapped in (its end-of-sequence tokens may be other ones)."""
        self.model_config = model_config
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.grammar_masks.serve_model(model_config)

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def finished_transitions(self) -> list[TransitionResult]:
        """Sleeps and wakeups done (or refused) and not sent yet: `run` sends them after each turn."""
        return self.transitions.finished

    # ---- control and introspection ------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.kv_cache.pool
        queue = self.request_queue
        collectives = self.model_runner.tp.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=pool.num_used,
            kv_blocks_total=pool.num_blocks,
            admission=queue.admission_state.value,
            kv_blocks_cached=pool.num_cached,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_computed_tokens=self.num_computed_tokens,
            num_steps=self.num_steps,
            num_all_reduces=collectives.all_reduces,
            all_reduce_seconds=collectives.all_reduce_seconds,
            other_collective_seconds=collectives.other_seconds,
            timestamp=time.time(),
            admission_since=queue.admission_since,
            sleep_level=self.transitions.sleep_level,
            kv_cache_bytes=self.kv_cache.nbytes if self.kv_cache.is_allocated else 0,
            weight_bytes=self.memory.weight_bytes,
            model_revision=self.memory.revision,
            transitions=dict(queue.transitions),
            resident_bytes=resident_bytes(),
            seq=next(self._stats_seq),
        )


def kv_event_publisher(config: EngineConfig) -> KVEventPublisher | None:
    if config.kv_events_endpoint is None:
        return None
    engine_id = config.kv_events_engine_id or f"{socket.gethostname()}:{os.getpid()}"
    return KVEventPublisher(config.kv_events_endpoint, config.kv_events_snapshot_endpoint, engine_id)


def engine_limits(
    config: EngineConfig, model: ModelConfig, num_kv_blocks: int, kv_cache: KVCachePlan | None = None
) -> EngineLimits:
    return EngineLimits(
        max_model_len=config.max_model_len_for(model.max_position_embeddings),
        vocab_size=model.vocab_size,
        max_batch_size=config.max_batch_size,
        max_num_tokens=config.max_num_tokens,
        enable_chunked_prefill=config.enable_chunked_prefill,
        kv_block_size=config.kv_block_size,
        num_kv_blocks=num_kv_blocks,
        kv_cache=kv_cache,
    )


def _stalled_collective(
    error: BaseException, world_size: int, config: EngineConfig
) -> EngineStalledError | None:
    """A collective that timed out (gloo: "Timed out waiting ...", "Operation timed out!") means
    a rank stopped answering: the world stalled, it did not crash."""
    if isinstance(error, EngineStalledError):
        return None  # said already, better
    if world_size == 1 or not isinstance(error, RuntimeError) or "timed out" not in str(error).lower():
        return None
    stalled = EngineStalledError(
        f"stalled: a collective waited {config.collective_timeout:g} s for another rank of the "
        f"{world_size} ({error})"
    )
    stalled.__cause__ = error
    return stalled
