"""Tokenizer loading and incremental detokenization (the frontend's Python-heavy work)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tokenizers.decoders import DecodeStream


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's Hugging Face tokenizer, offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files `save_pretrained` writes for `tokenizer`: another process rebuilds the very same
    tokenizer from them (vocabulary, special tokens, chat template) without the model's folder."""
    with tempfile.TemporaryDirectory(prefix="berth-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        return {path.name: path.read_bytes() for path in Path(folder).iterdir() if path.is_file()}


def write_tokenizer_files(files: dict[str, bytes], folder: Path):
    """Writes what `tokenizer_files` gave into `folder` and loads the tokenizer from it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (folder / Path(name).name).write_bytes(content)  # a bare name: nothing outside `folder`
    return load_tokenizer(folder)


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
