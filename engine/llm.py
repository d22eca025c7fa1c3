"""`LLM`: the user's API — load a model, generate from prompts, sync or async, whole or streamed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from berth.engine.config import EngineConfig
from berth.engine.executor import GenerationRequest, GenerationResult, create_executor
from berth.engine.outputs import RequestOutput
from berth.engine.sampling_params import SamplingParams
from berth.engine.tokenizer import load_tokenizer

Prompt = str | Sequence[int]


class LLM:
    """An inference engine for one model.

        llm = LLM("path/to/model", max_batch_size=32)
        outputs = llm.generate(["Hello", "The sky is"], SamplingParams(temperature=0, max_tokens=32))

    Engine options (`max_batch_size`, `max_num_tokens`, `kv_cache_blocks`, `dtype`, ...) are the
    fields of `EngineConfig`. `executor` picks where the engine runs (see `create_executor`).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        tokenizer: str | Path | None = None,
        executor: str = "proxy",
        **engine_options,
    ) -> None:
        if not (Path(model) / "config.json").is_file():
            # Checked here, before the tokenizer loader mistakes a typo for a hub model id.
            raise FileNotFoundError(f"{model} is not a model directory (no config.json)")
        self.config = EngineConfig(model=str(model), **engine_options)
        self.tokenizer = load_tokenizer(tokenizer or model)
        self._executor = create_executor(self.config, self.tokenizer, mode=executor)

    # ---- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: float | Sequence[float] = 0.5,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates for every prompt (all submitted at once, batched continuously) and returns
        the outputs in the prompts' order."""
        prompt_list = [prompts] if _is_single_prompt(prompts) else list(prompts)
        params_list = _per_prompt(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        priorities = _per_prompt(priority, len(prompt_list), "priority")
        results = [
            self.generate_async(p, sp, priority=pr) for p, sp, pr in zip(prompt_list, params_list, priorities)
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
    ) -> GenerationResult:
        """Submits one prompt; returns at once. Await the result, call `.result()`, or iterate
        it (`for` / `async for`) for streamed updates; `.abort()` stops it."""
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer(prompt)["input_ids"] if text is not None else prompt
        request = GenerationRequest(
            token_ids, sampling_params or SamplingParams(), streaming=streaming, priority=priority
        )
        return self._executor.submit(request, prompt=text)

    # ---- the engine's state -------------------------------------------------------------------

    def check_health(self) -> bool:
        return self._executor.check_health()

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
