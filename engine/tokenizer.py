"""Tokenizer loading and incremental detokenization (the frontend's Python-heavy work)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenizers.decoders import DecodeStream

# The generic `tokenizers`-backed class (one class under two names since transformers 5), which
# berth's own checkpoints and most recent ones name in tokenizer_config.json.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's Hugging Face tokenizer, offline.

    A checkpoint that names the generic class is loaded by that class itself: `AutoTokenizer`
    would give the same tokenizer, but it imports torch and the model configs first (~3.5 s of
    CPU against ~1 s, on every server start)."""
    folder = Path(model_dir)
    if _tokenizer_class(folder) in GENERIC_TOKENIZER_CLASSES and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _tokenizer_class(folder: Path) -> str | None:
    try:
        return json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None  # AutoTokenizer then says what is wrong, if anything is


@dataclass(frozen=True)
class TokenizerToLoad:
    """A tokenizer an executor loads itself. Loading one imports transformers (seconds of CPU):
    the proxy executor does it while its worker process boots, on another core."""

    model_dir: str | Path

    def load(self):
        return load_tokenizer(self.model_dir)


def loaded(tokenizer):
    """`tokenizer`, loaded if it is a `TokenizerToLoad`."""
    return tokenizer.load() if isinstance(tokenizer, TokenizerToLoad) else tokenizer


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
