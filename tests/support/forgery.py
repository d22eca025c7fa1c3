"""Payloads for the tests that prove a message without the engine's key is never unpickled."""

from __future__ import annotations

from pathlib import Path


class LeavesATrace:
    """Unpickling this creates a file: proof that a payload was (or was not) loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))
