"""The sampler isolates a failure to the sequences it belongs to: a row that cannot be sampled
(NaN logits) fails alone, its neighbours are sampled as if it were not there (seeded ones
included), and a failure every row has is raised."""

from __future__ import annotations

import pytest
import torch

from berth.engine.pyexecutor.sampler import Sampler
from berth.engine.pyexecutor.sequence import Sequence
from berth.engine.sampling_params import SamplingParams

VOCAB = 32


def sequence(params: SamplingParams) -> Sequence:
    return Sequence(1, 0, [1, 2], params, priority=0.5, max_tokens=4, arrival_time=0.0)


def logits(rows: int, nan_rows: tuple[int, ...] = ()) -> torch.Tensor:
    values = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))
    for row in nan_rows:
        values[row] = float("nan")
    return values


def test_a_row_that_cannot_be_sampled_fails_alone():
    seeded = SamplingParams(temperature=1.0, seed=7, logprobs=2)
    batch = [
        sequence(SamplingParams(temperature=0)),
        sequence(seeded),  # draws before the failing row in the batch attempt
        sequence(SamplingParams(temperature=1.0, seed=9)),  # NaN logits: cannot be sampled
    ]
    alone = sequence(seeded)
    sampler = Sampler()
    first, second = (sampler.sample(logits(3)[1:2], [alone]) for _ in range(2))
    assert first.token_ids != second.token_ids, "pick a seed whose first two draws differ"

    out = Sampler().sample(logits(3, nan_rows=(2,)), batch)

    assert out.token_ids[2] is None and "probability tensor" in str(out.errors[2])
    assert out.errors[0] is None and out.errors[1] is None
    assert out.token_ids[0] == int(logits(3)[0].argmax())
    # The seeded row drew again from where it was, as if alone: its first draw, not its second.
    assert out.token_ids[1] == first.token_ids[0]
    assert out.logprobs[1] == first.logprobs[0]


def test_a_failure_every_row_has_is_raised():
    batch = [sequence(SamplingParams(temperature=1.0)), sequence(SamplingParams(temperature=0.5))]
    with pytest.raises(RuntimeError, match="probability tensor"):
        Sampler().sample(logits(2, nan_rows=(0, 1)), batch)


def test_a_top_k_beyond_the_vocabulary_is_no_filter():
    wide = SamplingParams(temperature=1.0, top_k=2**62, seed=3)
    unfiltered = SamplingParams(temperature=1.0, seed=3)
    assert Sampler().sample(logits(1), [sequence(wide)]).token_ids == (
        Sampler().sample(logits(1), [sequence(unfiltered)]).token_ids
    )
