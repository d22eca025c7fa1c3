"""Other revisions of the tiny test model, for wakeups that swap one in."""

from __future__ import annotations

import json
from pathlib import Path

from berth.engine.models.tiny_model import make_tiny_model


def reversed_vocabulary(model: Path, seed: int, target: Path, **model_options) -> Path:
    """Another revision of `model`'s architecture (the tiny model's defaults, with
    `model_options` for make_tiny_model: other shapes make one a wakeup refuses): other weights,
    and a tokenizer that maps every ordinary token to another id (the order of the vocabulary
    reversed; special tokens keep theirs). Text tokenized with one revision's tokenizer reads
    as other words to the other, and so do token ids detokenized with it."""
    make_tiny_model(target, seed=seed, **model_options)
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    specials = {token["id"] for token in tokenizer["added_tokens"]}
    vocab = tokenizer["model"]["vocab"]
    ordinary = sorted(i for i in vocab.values() if i not in specials)
    mapping = dict(zip(ordinary, reversed(ordinary)))
    tokenizer["model"]["vocab"] = {token: mapping.get(i, i) for token, i in vocab.items()}
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    return target
