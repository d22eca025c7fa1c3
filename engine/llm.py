"""`LLM`: the user's API — load a model, generate from prompts, sync or async, whole or streamed."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from berth.engine.config import EngineConfig
from berth.engine.disaggregation import Disaggregated
from berth.engine.engine_io import DEFAULT_DRAIN_TIMEOUT, ProgressSink, TransitionError, TransitionResult
from berth.engine.executor import GenerationRequest, GenerationResult, create_executor
from berth.engine.outputs import RequestOutput
from berth.engine.sampling_params import SamplingParams
from berth.engine.tokenizer import TokenizerToLoad, load_tokenizer, tokenizer_files

Prompt = str | Sequence[int]


class LLM:
    """An inference engine for one model.

        llm = LLM("path/to/model", max_batch_size=32)
        outputs = llm.generate(["Hello", "The sky is"], SamplingParams(temperature=0, max_tokens=32))

    Engine options (`max_batch_size`, `max_num_tokens`, `kv_cache_blocks`, `dtype`,
    `tensor_parallel_size`, ...) are the fields of `EngineConfig`. `executor` picks where the
    engine runs, and `world` where a tensor-parallel engine's ranks run (an
    `executor.world.MpiWorld`; default: this machine) (see `create_executor`);
    `num_postprocess_workers` N > 0 detokenizes in N processes of their own (proxy only).
    `on_progress` hears how the engine's start comes along (`LoadProgress`: weights read, the
    KV cache sized, the model checked) while the constructor runs.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        tokenizer: str | Path | None = None,
        executor: str = "proxy",
        world=None,
        num_postprocess_workers: int = 0,
        on_progress: ProgressSink | None = None,
        **engine_options,
    ) -> None:
        if not (Path(model) / "config.json").is_file():
            # Checked here, before the tokenizer loader mistakes a typo for a hub model id.
            raise FileNotFoundError(f"{model} is not a model directory (no config.json)")
        self.config = EngineConfig(model=str(model), **engine_options)
        self._tokenizer_follows_model = tokenizer is None  # a weight swap brings its own tokenizer
        self._waking = threading.Lock()  # one wakeup with a new model at a time: it swaps tokenizers
        self._executor = create_executor(
            self.config,
            TokenizerToLoad(tokenizer or model),
            mode=executor,
            world=world,
            num_postprocess_workers=num_postprocess_workers,
            on_progress=on_progress,
        )

    @classmethod
    def attach(cls, address: str, *, key: bytes | None = None) -> AttachedLLM:
        """The engine another process owns (`berth serve MODEL --attach-port PORT`), through its
        attach endpoint at `tcp://HOST:PORT`, signed with `key` (default: BERTH_ENGINE_KEY).
        See `AttachedLLM`."""
        return AttachedLLM(address, key=key)

    # ---- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: float | Sequence[float] = 0.5,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
        disaggregated: Disaggregated | Sequence[Disaggregated | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (all submitted at once, batched continuously) and returns
        the outputs in the prompts' order."""
        prompt_list = [prompts] if _is_single_prompt(prompts) else list(prompts)
        params_list = _per_prompt(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        priorities = _per_prompt(priority, len(prompt_list), "priority")
        splits = _per_prompt(disaggregated, len(prompt_list), "disaggregated")
        results = [
            self.generate_async(p, sp, priority=pr, cache_salt=cache_salt, disaggregated=d)
            for p, sp, pr, d in zip(prompt_list, params_list, priorities, splits)
        ]
        outputs = []
        started = time.perf_counter()
        with tqdm(total=len(results), desc="Generating", unit="req", disable=not use_tqdm) as progress:
            generated = 0
            for result in results:
                output = result.result()
                outputs.append(output)
                generated += sum(len(o.token_ids) for o in output.outputs)
                progress.set_postfix_str(
                    f"{generated / (time.perf_counter() - started):.0f} tok/s", refresh=False
                )
                progress.update()
        return outputs

    def generate_async(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        streaming: bool = False,
        priority: float = 0.5,
        cache_salt: str | None = None,
        tokenized_with=None,
        disaggregated: Disaggregated | None = None,
    ) -> GenerationResult:
        """Submits one prompt; returns at once. Await the result, call `.result()`, or iterate
        it (`for` / `async for`) for streamed updates; `.abort()` stops it.

        `cache_salt` (a tenant's secret, say) keeps this request's prefix-cache reuse among
        requests with the same salt. `tokenized_with`: the tokenizer token ids were made with
        (`llm.tokenizer` when you tokenized): refused if a wakeup has swapped it since.
        `disaggregated`: `ContextOnly()` (run the prompt, return the first token and a KV handle)
        or `GenerationOnly(handle)` (continue from another engine's KV; same prompt and params)."""
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            tokenized_with = self.tokenizer
            token_ids = tokenized_with(prompt)["input_ids"]
        else:
            token_ids = prompt
        request = GenerationRequest(
            token_ids,
            sampling_params or SamplingParams(),
            streaming=streaming,
            priority=priority,
            cache_salt=cache_salt,
            disaggregated=disaggregated,
        )
        return self._executor.submit(request, prompt=text, tokenized_with=tokenized_with)

    # ---- sleep and wakeup ---------------------------------------------------------------------

    def sleep(
        self, level: int = 1, mode: str = "drain", timeout: float = DEFAULT_DRAIN_TIMEOUT
    ) -> TransitionResult:
        """Stops admission and releases the engine's memory; returns once it is parked.

        `mode="drain"` lets the requests in flight finish for up to `timeout` seconds (the rest
        then end with finish_reason "abort"); `mode="abort"` aborts them at once. Level 1 frees
        the KV cache and moves the weights to host memory (on a CPU it frees the KV cache only:
        host memory is where the weights live); level 2 drops the weights too. New requests are
        refused until `wake_up()`. Raises TransitionError (code "conflict") unless the engine is
        running."""
        return self._executor.sleep(level, mode, timeout)

    def wake_up(self, model: str | Path | None = None) -> TransitionResult:
        """Restores the memory a sleep released and admits requests again.

        `model`: another revision of the model (same architecture and shapes), loaded into the
        same processes; one that does not fit raises TransitionError (code "invalid_model") and
        the engine stays asleep, able to wake up with the weights it had."""
        if model is None:
            return self._executor.wake_up(None)
        if not self._waking.acquire(blocking=False):
            raise TransitionError("another wakeup is under way", "conflict", self.admission_state)
        try:
            return self._wake_up_with(str(model))
        finally:
            self._waking.release()

    def _wake_up_with(self, model: str) -> TransitionResult:
        tokenizer = None
        if self._tokenizer_follows_model:
            if not (Path(model) / "config.json").is_file():
                raise TransitionError(
                    f"cannot wake up with {model}: it is not a model directory (no config.json)",
                    "invalid_model",
                    self.admission_state,
                )
            try:  # before anything changes: a revision whose tokenizer cannot load is refused whole
                tokenizer = load_tokenizer(model)
            except Exception as error:
                raise TransitionError(
                    f"cannot wake up with {model}: its tokenizer does not load ({error})",
                    "invalid_model",
                    self.admission_state,
                ) from error
            if tokenizer_files(tokenizer) == tokenizer_files(self.tokenizer):
                tokenizer = None  # the same tokenizer: nothing to swap
        if tokenizer is None or self.admission_state != "parked":
            result = self._executor.wake_up(model)  # nothing to swap, or refused: not parked
        else:
            result = self._wake_up_with_tokenizer(model, tokenizer)
        self.config.model = model
        return result

    def _wake_up_with_tokenizer(self, model: str, tokenizer) -> TransitionResult:
        """The new revision's tokenizer serves before the engine admits again: it is swapped in
        while the engine is parked (every attached frontend is sent to attach again for it, and
        the wakeup takes it to the postprocess workers, if any, ahead of every response of the
        requests it admits), so no request is ever tokenized or detokenized with the other
        revision's. A wakeup the engine refuses (it stays parked, with its own weights) swaps
        the old one back."""
        old = self._executor.tokenizer
        self._executor.replace_tokenizer(tokenizer)
        try:
            return self._executor.wake_up(model)
        except TransitionError:
            self._executor.replace_tokenizer(old)
            raise

    @property
    def tokenizer(self):
        return self._executor.tokenizer

    @property
    def admission_state(self) -> str:
        """ "running", "parking", "parked", "waking"; "failed" once the engine is dead, "shutdown"
        once shutdown has started."""
        return self._executor.admission_state

    # ---- the engine's state -------------------------------------------------------------------

    def check_health(self) -> bool:
        """True while the engine lives; False once it died or shutdown started."""
        return self._executor.check_health()

    @property
    def limits(self):
        """What the engine serves (`EngineLimits`: max_model_len, vocab size, batch, KV pool)."""
        return self._executor.limits

    @property
    def executor(self):
        return self._executor

    def shutdown(self) -> None:
        self._executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


def _is_single_prompt(prompts) -> bool:
    if isinstance(prompts, str):
        return True
    if hasattr(prompts, "ndim"):  # a numpy array or torch tensor of token ids
        return prompts.ndim == 1
    return len(prompts) > 0 and isinstance(prompts[0], int)


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


class AttachedLLM(LLM):
    """An engine this process serves but does not own: its requests' ids carry this frontend's
    id, their results come back to it alone, and `shutdown()` only detaches (the owner aborts
    the requests it left running). It outlives the engine's worlds: while the engine is dead or
    unreachable every call fails with `EngineUnreachableError` (an `EngineDeadError`) and it
    attaches again by itself once an owner answers at `address`. Model, tokenizer and limits
    are the owner's, as it said when this frontend attached."""

    def __init__(self, address: str, *, key: bytes | None = None) -> None:
        from berth.engine.executor import ipc
        from berth.engine.executor.frontend import FrontendExecutor

        self._executor = FrontendExecutor(address, key if key is not None else ipc.key_from_env())

    def wait_attached(self, timeout: float | None = None) -> bool:
        return self._executor.wait_attached(timeout)

    @property
    def config(self) -> EngineConfig:
        return self._executor.config

    @property
    def served_model_name(self) -> str | None:
        info = self._executor.info
        return info.model_name if info is not None else None

    # A frontend never owns the engine's life: its sleep and wakeup are the owner's (the
    # operator drives them there), and every frontend follows the owner's admission state.

    def sleep(self, level: int = 1, mode: str = "drain", timeout: float = DEFAULT_DRAIN_TIMEOUT):
        raise self._not_the_owner("sleep")

    def wake_up(self, model: str | Path | None = None):
        raise self._not_the_owner("wake up")

    def _not_the_owner(self, doing: str) -> TransitionError:
        return TransitionError(
            f"this server is a frontend attached to the engine at {self._executor.address}: it cannot "
            f"{doing} the engine, whose owner (`berth serve MODEL --attach-port`, or `berth launch`) "
            "does that; ask the owner's /admin (every frontend follows its admission state)",
            "not_engine_owner",
            self.admission_state,
        )
