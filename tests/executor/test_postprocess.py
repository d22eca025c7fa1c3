"""`postprocess.py`: whatever fails while one request's responses become text fails that request
alone, with an error that tells whoever applies it to abort the request in the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from berth.engine.engine_io import RequestError, Response
from berth.engine.executor.postprocess import RequestPostprocessor
from berth.engine.sampling_params import SamplingParams
from berth.engine.tokenizer import load_tokenizer


class DecodeRaisesOn:
    """A Hugging Face tokenizer (an external library's object) whose `decode` raises on one id,
    as some real ones do (OverflowError on out-of-range ids)."""

    def __init__(self, tokenizer, poison: int) -> None:
        self._tokenizer = tokenizer
        self._poison = poison
        self.backend_tokenizer = tokenizer.backend_tokenizer

    def decode(self, token_ids, **options):
        if self._poison in token_ids:
            raise OverflowError("out of range integral type conversion attempted")
        return self._tokenizer.decode(token_ids, **options)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return load_tokenizer(tiny_model)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=4, logprobs=0),  # logprob decoding
        SamplingParams(max_tokens=4),  # the final full decode
        SamplingParams(max_tokens=4, stop=["zz"], logprobs=0),  # matching stop strings, incrementally
    ],
    ids=["logprobs", "final-decode", "stop-strings"],
)
def test_a_decode_that_raises_fails_the_request_alone(tokenizer, params):
    poisoned = RequestPostprocessor(7, params, DecodeRaisesOn(tokenizer, 42), streaming=False)
    healthy = RequestPostprocessor(8, params, tokenizer, streaming=False)
    logprobs = [(-0.5, 1, [(42, -0.5)])] if params.logprobs is not None else None
    done = Response(7, 0, [42], logprobs=logprobs, finish_reason="length")

    update = poisoned.process(done)
    assert update.error is not None and update.error.code == "internal"
    assert update.error.stage == "postprocess"
    assert not update.engine_finished  # the engine still runs it: the applier aborts it
    assert poisoned.engine_done  # nothing more is postprocessed for it

    fine = healthy.process(Response(8, 0, [42], logprobs=logprobs, finish_reason="length"))
    assert fine.error is None and fine.finish_reason == "length"


def test_an_engine_error_is_passed_on_as_the_engines(tokenizer):
    request = RequestPostprocessor(7, SamplingParams(), tokenizer, streaming=True)
    update = request.process(Response(7, 0, [], error=RequestError("too long", "too_long")))
    assert update.error.code == "too_long" and update.engine_finished
