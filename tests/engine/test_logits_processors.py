"""Penalties, logit bias, min_tokens and min_p, each against a reference computed here by hand
with dense torch on the same logits; rows that ask for nothing are left as they were, greedy
rows are adjusted too, and log-probabilities stay the model's own."""

from __future__ import annotations

import pytest
import torch

from berth.engine.pyexecutor import logits_processors
from berth.engine.pyexecutor.sampler import Sampler
from berth.engine.pyexecutor.sequence import Sequence
from berth.engine.sampling_params import SamplingParams

VOCAB = 32
EOS = 2
PROMPT = [5, 6, 7, 5]


def sequence(output: list[int] = (), prompt: list[int] = PROMPT, **params) -> Sequence:
    seq = Sequence(
        1, 0, prompt, SamplingParams(**params), priority=0.5, max_tokens=16, arrival_time=0.0,
        eos_token_ids=frozenset({EOS}),
    )  # fmt: skip
    seq.token_ids += output
    return seq


def logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def counts(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=VOCAB).float()


def test_rows_that_ask_for_nothing_cost_nothing():
    raw = logits(3)
    plain = [sequence([1, 1], temperature=0), sequence(), sequence(min_tokens=2, output=[3, 4])]
    assert logits_processors.apply(raw, plain) is raw


def test_frequency_and_presence_penalties_count_the_output_only():
    raw = logits(2)
    output = [9, 9, 9, 4, 5]  # 5 is in the prompt too: only its one output occurrence counts
    batch = [sequence(output, frequency_penalty=0.5, presence_penalty=-1.5), sequence(output)]
    before = raw.clone()
    adjusted = logits_processors.apply(raw, batch)
    expected = raw[0] - 0.5 * counts(output) - (-1.5) * (counts(output) > 0).float()
    torch.testing.assert_close(adjusted[0], expected)
    torch.testing.assert_close(adjusted[1], raw[1])  # its neighbour asked for nothing
    assert torch.equal(raw, before), "the sampler's logits are never written into"


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    raw = torch.tensor([[2.0, -2.0, 1.0, -1.0] + [0.5] * (VOCAB - 4)])
    seq = sequence([1, 3, 3], prompt=[0, 8], repetition_penalty=2.0)
    adjusted = logits_processors.apply(raw, [seq])
    seen = counts([0, 8, 1, 3, 3]) > 0
    expected = torch.where(seen, torch.where(raw[0] > 0, raw[0] / 2.0, raw[0] * 2.0), raw[0])
    torch.testing.assert_close(adjusted[0], expected)
    assert adjusted[0, :4].tolist() == [1.0, -4.0, 1.0, -2.0]


def test_penalties_are_applied_per_row_in_one_batch():
    """Rows with different penalties and outputs, between rows that ask for none."""
    raw = logits(4)
    rows = [
        dict(output=[1, 2, 2, 30], frequency_penalty=1.0, repetition_penalty=1.3),
        dict(output=[]),
        dict(output=[2, 7, 7, 7], presence_penalty=2.0, frequency_penalty=-0.25),
        dict(output=[0, 31], prompt=[31, 31, 4], repetition_penalty=0.7),
    ]
    batch = [sequence(**row) for row in rows]
    adjusted = logits_processors.apply(raw, batch)
    for r, seq in enumerate(batch):
        p, expected = seq.params, raw[r].clone()
        seen = counts(seq.token_ids) > 0
        penalized = torch.where(
            expected > 0, expected / p.repetition_penalty, expected * p.repetition_penalty
        )
        expected = torch.where(seen, penalized, expected)
        out = counts(seq.output_token_ids)
        expected -= p.frequency_penalty * out + p.presence_penalty * (out > 0).float()
        torch.testing.assert_close(adjusted[r], expected)


def test_logit_bias_adds_to_its_tokens_only_with_string_keys_read_as_ids():
    raw = logits(2)
    bias = {"3": 100, 17: -100, "0": 2.5}
    adjusted = logits_processors.apply(raw, [sequence(), sequence(logit_bias=bias)])
    expected = raw[1].clone()
    expected[[3, 17, 0]] += torch.tensor([100.0, -100.0, 2.5])
    torch.testing.assert_close(adjusted[1], expected)
    torch.testing.assert_close(adjusted[0], raw[0])


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    raw = logits(4)
    batch = [
        sequence([1, 1], min_tokens=3, stop_token_ids=[9, 10**6]),  # a stop id past the vocabulary
        sequence([1, 1, 1], min_tokens=3, stop_token_ids=[9]),  # reached: nothing banned
        sequence([], min_tokens=1, ignore_eos=True, stop_token_ids=[11]),  # EOS is ignored anyway
        sequence([], min_tokens=1, logit_bias={EOS: 100}),  # the ban beats the bias
    ]
    adjusted = logits_processors.apply(raw, batch)
    expected = raw.clone()
    expected[3, EOS] = float("-inf")
    expected[0, [EOS, 9]] = float("-inf")
    expected[2, 11] = float("-inf")
    torch.testing.assert_close(adjusted, expected)


def test_min_p_drops_tokens_below_its_share_of_the_likeliest_after_temperature():
    raw = logits(3)
    params = [SamplingParams(min_p=0.2), SamplingParams(), SamplingParams(min_p=1.0)]
    kept = logits_processors.apply_min_p(raw, params)
    probs = raw.softmax(dim=-1)
    for r, p in enumerate(params):
        dropped = probs[r] < p.min_p * probs[r].max()
        assert torch.equal(torch.isinf(kept[r]), dropped)
        torch.testing.assert_close(kept[r][~dropped], raw[r][~dropped])
    assert (~torch.isinf(kept[2])).sum() == 1  # min_p 1: only the likeliest is left
    # Through the sampler, after temperature: min_p=1 samples the argmax at any temperature.
    seqs = [sequence(temperature=2.0, min_p=1.0, seed=s) for s in range(8)]
    out = Sampler().sample(raw[2:3].expand(8, VOCAB).contiguous(), seqs)
    assert out.token_ids == [int(raw[2].argmax())] * 8


def test_greedy_rows_honour_bias_and_penalties_and_logprobs_stay_the_models():
    raw = logits(2)
    top = int(raw[0].argmax())
    low = int(raw[0].argmin())
    batch = [
        sequence(temperature=0, logit_bias={low: 100}, logprobs=1),
        sequence([top] * 5, prompt=[top], temperature=0, frequency_penalty=2.0),
    ]
    raw[1] = raw[0]
    out = Sampler().sample(raw, batch)
    assert out.token_ids[0] == low
    penalized = raw[1] - 2.0 * counts([top] * 5)
    assert out.token_ids[1] == int(penalized.argmax()) != top
    logprob, rank, _ = out.logprobs[0]
    assert logprob == pytest.approx(float(raw[0].log_softmax(-1)[low]), abs=1e-5)
    assert rank == VOCAB  # the least likely token of the model's own distribution


def test_a_bias_past_the_vocabulary_fails_its_row_alone():
    raw = logits(2)
    out = Sampler().sample(raw, [sequence(temperature=0), sequence(temperature=0, logit_bias={VOCAB: 1})])
    assert out.token_ids[0] == int(raw[0].argmax())
    assert out.token_ids[1] is None and "outside the vocabulary" in str(out.errors[1])
