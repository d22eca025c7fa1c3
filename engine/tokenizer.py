"""Tokenizer loading and incremental detokenization (the frontend's Python-heavy work)."""

from __future__ import annotations

from pathlib import Path

from tokenizers.decoders import DecodeStream


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's Hugging Face tokenizer, offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one token at a time.

    A token can end in the middle of a UTF-8 character; the stream then holds it back until
    the character is complete, so the text never contains broken characters.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""
