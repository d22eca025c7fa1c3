"""Turning logits into tokens: greedy, temperature, top-k, top-p, seeds, log-probabilities.

A failure is isolated to the sequences it belongs to: when sampling the batch fails, each row
is sampled alone; the rows that still fail are reported (their requests fail, the batch goes
on). A failure every row has is not one request's: it is raised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from berth.engine.engine_io import TokenLogprobs
from berth.engine.pyexecutor import logits_processors
from berth.engine.pyexecutor.grammar_masks import StepMasks
from berth.engine.pyexecutor.sequence import Sequence


@dataclass
class SampleOutput:
    token_ids: list[int | None]  # None: that row's sampling failed (see `errors`)
    logprobs: list[TokenLogprobs | None]
    errors: list[BaseException | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, requests: list[Sequence], masks: StepMasks | None = None
    ) -> SampleOutput:
        """One token per row of `logits` [R, V] (float32), for `requests[r]`; the rows `masks`
        constrains (structured outputs) draw only what their grammar allows."""
        raw_wanted = any(r.params.logprobs is not None for r in requests)
        problems = {} if masks is None else {row: p for row, p in zip(masks.rows, masks.errors) if p}
        try:
            constrained = _constrained(logits, masks, copy=raw_wanted)
        except Exception as error:  # masks it cannot apply fail their requests, not the batch
            constrained = logits
            problems = {row: f"its grammar's mask could not be applied: {error!r}" for row in masks.rows}
        out = self._sample_all(constrained, requests, logits)
        for row, problem in problems.items():  # e.g. its output left the grammar: it fails alone
            out.token_ids[row], out.logprobs[row] = None, None
            out.errors[row] = RuntimeError(problem)
        return out

    def _sample_all(self, logits: torch.Tensor, requests: list[Sequence], raw: torch.Tensor) -> SampleOutput:
        seeded = [r for r in requests if r.seed is not None]
        states = [None if r.generator is None else r.generator.get_state() for r in seeded]
        try:
            return self._sample(logits, requests, raw)
        except Exception as error:
            if len(requests) == 1:
                raise
            batch_error = error
        # A seeded sequence draws again from where it was: its tokens stay its own.
        for request, state in zip(seeded, states):
            if state is None:
                request.generator = None
            else:
                request.generator.set_state(state)
        out = SampleOutput([None] * len(requests), [None] * len(requests), [None] * len(requests))
        for row, request in enumerate(requests):
            try:
                alone = self._sample(logits[row : row + 1], [request], raw[row : row + 1])
            except Exception as error:
                out.errors[row] = error
                continue
            out.token_ids[row], out.logprobs[row] = alone.token_ids[0], alone.logprobs[0]
        if all(error is not None for error in out.errors):
            raise batch_error
        return out

    def _sample(self, logits: torch.Tensor, requests: list[Sequence], raw: torch.Tensor) -> SampleOutput:
        logits = logits_processors.apply(logits, requests)  # penalties, bias, min_tokens
        params = [r.params for r in requests]
        greedy = [p.greedy for p in params]
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, g in enumerate(greedy) if not g]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            tokens[rows] = self._random(logits[rows], [requests[i] for i in sampled])
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            self._logprobs(raw, tokens, params, wanted, token_list, logprobs)
        return SampleOutput(token_list, logprobs, [None] * len(requests))

    def _random(self, logits: torch.Tensor, requests: list[Sequence]) -> torch.Tensor:
        params = [r.params for r in requests]
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        scaled = logits_processors.apply_min_p(logits / temperature[:, None], params)
        vocab_size = logits.shape[-1]
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = _apply_top_k_top_p(
                scaled, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device)
            )
        probs = scaled.softmax(dim=-1)
        seeded = [i for i, r in enumerate(requests) if r.seed is not None]
        unseeded = [i for i, r in enumerate(requests) if r.seed is None]
        sampled = torch.empty(len(requests), dtype=torch.long, device=device)
        if unseeded:
            rows = torch.tensor(unseeded, device=device)
            sampled[rows] = torch.multinomial(probs[rows], 1, generator=self._generator(device)).squeeze(1)
        for i in seeded:
            request = requests[i]
            if request.generator is None or request.generator.device != device:
                request.generator = torch.Generator(device=device).manual_seed(request.seed)
            sampled[i] = torch.multinomial(probs[i], 1, generator=request.generator)[0]
        return sampled

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[device]

    @staticmethod
    def _logprobs(logits, tokens, params, wanted, token_list, out) -> None:
        """Log-probabilities of the model's raw distribution (before the logits processors,
        temperature and filters), as vLLM reports them by default."""
        rows = torch.tensor(wanted, device=logits.device)
        logprobs = logits[rows].log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens[rows][:, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        k = max(params[i].logprobs for i in wanted)
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        chosen_list, rank_list = chosen.squeeze(1).tolist(), ranks.tolist()
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for j, i in enumerate(wanted):
            n = params[i].logprobs
            out[i] = (chosen_list[j], rank_list[j], list(zip(top_ids[j][:n], top_values[j][:n])))


def _constrained(logits: torch.Tensor, masks: StepMasks | None, copy: bool = True) -> torch.Tensor:
    """`logits` with each constrained row's forbidden tokens at -inf: a copy when the raw
    logits must still give log-probabilities, else in place (a full pass over the batch's
    logits less)."""
    if masks is None:
        return logits
    keep = [i for i, problem in enumerate(masks.errors) if problem is None]
    if not keep:
        return logits
    rows = [masks.rows[i] for i in keep]
    forbidden = masks.forbidden if len(keep) == len(masks.rows) else masks.forbidden[keep]
    forbidden = torch.from_numpy(forbidden).to(logits.device)
    with torch.inference_mode():  # the model's logits are inference tensors: written in that mode
        constrained = logits.clone() if copy else logits
        if rows == list(range(len(logits))):
            constrained.masked_fill_(forbidden, float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            constrained[index] = constrained[index].masked_fill(forbidden, float("-inf"))
    return constrained


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k, then outside its top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    mask = ranks[None] >= top_k[:, None]
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    # Mass strictly before each token: the most likely token is always kept.
    mass_before = probs.cumsum(dim=-1) - probs
    mask |= mass_before > top_p[:, None]
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(mask, float("-inf")))
