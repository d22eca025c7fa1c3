"""Per-request adjustments of the logits before sampling: logit bias, min_tokens, penalties, min_p.

Each touches only the rows whose request asks for it, and only the tokens it concerns: the
common path (no request asks for anything) returns the logits untouched, and nothing here
builds a dense [rows, vocabulary] tensor (a dense bias halves decode throughput, TRT-LLM
#17436). The penalties are vectorised over the rows that want them: one `unique` over their
(row, token) pairs gives every count at once.

`apply` returns new logits and never writes into the ones it is given: the sampler samples a
failed batch again row by row from the same logits, which must not be adjusted twice.
"""

from __future__ import annotations

import torch

from berth.engine.pyexecutor.sequence import Sequence
from berth.engine.sampling_params import SamplingParams


def apply(logits: torch.Tensor, requests: list[Sequence]) -> torch.Tensor:
    """`logits` [R, V] adjusted for `requests[r]` (the same tensor if none asks for anything).

    In vLLM's order: the bias, then min_tokens' ban on ending, then the penalties (which leave
    a banned token banned)."""
    biased = [r for r, seq in enumerate(requests) if seq.params.logit_bias]
    held = [r for r, seq in enumerate(requests) if seq.num_output_tokens < seq.params.min_tokens]
    penalized = [r for r, seq in enumerate(requests) if seq.params.penalized]
    if not (biased or held or penalized):
        return logits
    logits = logits.clone()
    if biased:
        _add_bias(logits, biased, requests)
    if held:
        _hold_end(logits, held, requests)
    if penalized:
        _penalize(logits, penalized, requests)
    return logits


def apply_min_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Masks (to -inf) each row's tokens less likely than `min_p` times its most likely one;
    `scaled` is the logits after temperature. The most likely token always stays."""
    if not any(p.min_p for p in params):
        return scaled
    min_p = torch.tensor([p.min_p for p in params], dtype=scaled.dtype, device=scaled.device)
    probs = scaled.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return scaled.masked_fill(probs < threshold, float("-inf"))


def _add_bias(logits: torch.Tensor, rows: list[int], requests: list[Sequence]) -> None:
    vocab_size = logits.shape[-1]
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row in rows:
        bias = requests[row].params.logit_bias
        # The engine refuses such a request when it arrives (EngineLimits.check_logit_bias);
        # here it fails alone (the sampler isolates the row) instead of indexing out of bounds.
        if max(bias) >= vocab_size:
            raise ValueError(f"logit_bias token id {max(bias)} is outside the vocabulary ({vocab_size})")
        row_ids += [row] * len(bias)
        token_ids += bias.keys()
        biases += bias.values()
    index = _on(logits, row_ids), _on(logits, token_ids)
    logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


def _hold_end(logits: torch.Tensor, rows: list[int], requests: list[Sequence]) -> None:
    """Before `min_tokens` tokens, no token may end the sequence: its stop token ids, and the
    model's EOS unless it is ignored anyway."""
    vocab_size = logits.shape[-1]
    row_ids: list[int] = []
    token_ids: list[int] = []
    for row in rows:
        seq = requests[row]
        ending = set(seq.params.stop_token_ids or ())
        if not seq.params.ignore_eos:
            ending |= seq.eos_token_ids
        ending = [t for t in ending if t < vocab_size]  # a stop id past the vocabulary never comes
        row_ids += [row] * len(ending)
        token_ids += ending
    if token_ids:
        logits[_on(logits, row_ids), _on(logits, token_ids)] = float("-inf")


def _penalize(logits: torch.Tensor, rows: list[int], requests: list[Sequence]) -> None:
    """vLLM's order: repetition (over prompt and output), then frequency and presence (OpenAI's:
    over the output only), each on the distinct (row, token) pairs the sequences hold."""
    params = [requests[row].params for row in rows]
    repeated = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeated:
        row, token, _ = _occurrences(logits, [rows[i] for i in repeated], requests, output_only=False)
        penalty = _on(logits, [params[i].repetition_penalty for i in repeated], logits.dtype)
        penalty = penalty[torch.searchsorted(_on(logits, [rows[i] for i in repeated]), row)]
        values = logits[row, token]
        logits[row, token] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if counted:
        row, token, count = _occurrences(logits, [rows[i] for i in counted], requests, output_only=True)
        if row.numel():
            position = torch.searchsorted(_on(logits, [rows[i] for i in counted]), row)
            frequency = _on(logits, [params[i].frequency_penalty for i in counted], logits.dtype)[position]
            presence = _on(logits, [params[i].presence_penalty for i in counted], logits.dtype)[position]
            logits[row, token] -= frequency * count.to(logits.dtype) + presence


def _occurrences(
    logits: torch.Tensor, rows: list[int], requests: list[Sequence], *, output_only: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of the rows' sequences (their output, or all their
    tokens), and how often each occurs: three 1-D tensors, sorted by row."""
    vocab_size = logits.shape[-1]
    token_ids: list[int] = []
    lengths: list[int] = []
    for row in rows:
        seq = requests[row]
        tokens = seq.output_token_ids if output_only else seq.token_ids
        token_ids += tokens
        lengths.append(len(tokens))
    row_ids = torch.repeat_interleave(_on(logits, rows), _on(logits, lengths))
    keys, counts = torch.unique(row_ids * vocab_size + _on(logits, token_ids), return_counts=True)
    return keys // vocab_size, keys % vocab_size, counts


def _on(logits: torch.Tensor, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(logits.device, non_blocking=True)
