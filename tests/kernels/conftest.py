"""Kernel tests: the Triton kernels run on CPU tensors in Triton's interpreter when no GPU exists.

`TRITON_INTERPRET` is read when a `@triton.jit` function is decorated, and Triton's own
library (`tl.sum`, `tl.max`, ...) is decorated when `triton.language` is first imported. So the
variable must be set before *anything* imports triton. This module is imported during
collection, possibly after other test modules already imported triton (transformers' model
classes do): in that case the Python part of triton is dropped from `sys.modules` and imported
again, which decorates everything afresh in interpreter mode.

With a CUDA device the tests run the compiled kernels on it instead and nothing is changed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest
import torch

from berth.kernels.tolerances import TOLERANCES


def _forget_gpu_decorated_triton() -> None:
    """Drops triton's Python modules (and ours) if they were decorated without the interpreter."""
    language = sys.modules.get("triton.language")
    if language is None:
        return
    from triton.runtime.jit import JITFunction

    if not isinstance(language.sum, JITFunction):
        return  # already decorated for the interpreter
    for name in list(sys.modules):
        is_triton = name == "triton" or (name.startswith("triton.") and not name.startswith("triton._C"))
        if is_triton or name.startswith(("berth.kernels.triton_kernels", "berth.kernels.triton_ops")):
            del sys.modules[name]  # the compiled extension triton._C stays loaded, and is reused


if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    _forget_gpu_decorated_triton()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def triton_ops():
    """The Triton implementation of the kernel interface (skips where triton is not installed)."""
    pytest.importorskip("triton")
    from berth.kernels import triton_ops

    return triton_ops


@pytest.fixture
def assert_matches() -> Callable[..., None]:
    """assert_matches(actual, expected, kind="elementwise" | "attention"), within TOLERANCES."""

    def check(actual: torch.Tensor, expected: torch.Tensor, kind: str = "elementwise") -> None:
        assert actual.dtype == expected.dtype
        assert actual.shape == expected.shape
        atol, rtol = TOLERANCES[kind, expected.dtype]
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)

    return check
