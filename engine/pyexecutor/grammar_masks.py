"""The executor's side of structured outputs (engine/structured_outputs.py): a matcher for each
constrained sequence, and the masks of a step computed on a thread while its forward pass runs.

A matcher follows its sequence's output by catching up on the tokens it has not seen before each
mask: the same code serves a sequence that just sampled, one recomputed after a preemption (its
tokens stay), and one whose first token came from a context world (disaggregated serving).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence as Rows
from dataclasses import dataclass

import numpy as np

from berth.engine.models.config import ModelConfig
from berth.engine.pyexecutor.sequence import Sequence
from berth.engine.sampling_params import SamplingParams
from berth.engine.structured_outputs import Grammars, forbidden_tokens


@dataclass
class StepMasks:
    """What a step's sampler needs: the rows (of the step's samplers) that are constrained, and
    for each either the tokens its grammar forbids now or why its matcher failed."""

    rows: list[int]
    forbidden: np.ndarray  # [len(rows), vocab] bool
    errors: list[str | None]


class GrammarMasks:
    def __init__(self, model_config: ModelConfig) -> None:
        self._grammars = _grammars(model_config)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def serve_model(self, model_config: ModelConfig) -> None:
        """A wakeup swapped the model in: its tokenizer may be another one."""
        grammars = _grammars(model_config)
        old = self._grammars
        if (grammars.model_dir, grammars.vocab_size, grammars.eos_token_ids) != (
            old.model_dir,
            old.vocab_size,
            old.eos_token_ids,
        ):
            self._grammars = grammars

    def attach(self, sequences: list[Sequence], params: SamplingParams) -> None:
        """Gives each sequence of a new request its matcher; ValueError when the grammar does not
        compile (the request fails alone, at admission)."""
        if params.structured_outputs is None:
            return
        for sequence in sequences:
            sequence.matcher = self._grammars.matcher(params.structured_outputs)
            sequence.num_matched_tokens = 0

    def start(self, samplers: list[Sequence]) -> concurrent.futures.Future[StepMasks] | None:
        """The masks of the rows of `samplers` that are constrained, on the grammar thread (None:
        no row is)."""
        rows = [row for row, sequence in enumerate(samplers) if sequence.matcher is not None]
        if not rows:
            return None
        return self._thread.submit(self._masks, rows, [samplers[row] for row in rows])

    def _masks(self, rows: list[int], sequences: Rows[Sequence]) -> StepMasks:
        errors: list[str | None] = []
        for sequence in sequences:
            output = sequence.token_ids[sequence.num_prompt_tokens :]
            unseen = output[sequence.num_matched_tokens :]
            if unseen and not sequence.matcher.consume_tokens(unseen):
                errors.append(f"the output left its grammar: {sequence.matcher.get_error()}")
            else:
                errors.append(None)
            sequence.num_matched_tokens = len(output)
        bitmask = self._grammars.fill_bitmask([s.matcher for s in sequences])
        return StepMasks(rows, forbidden_tokens(bitmask, self._grammars.vocab_size), errors)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def _grammars(model_config: ModelConfig) -> Grammars:
    return Grammars(model_config.model_dir, model_config.vocab_size, model_config.eos_token_ids)
