"""Choosing the kernel implementation: by device ("auto"), by call, by context, by environment."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import berth.kernels as kernels
from berth.kernels import reference


@pytest.fixture(autouse=True)
def restore_backend():
    previous = kernels.get_backend()
    yield
    kernels.set_backend(previous)


def spy(monkeypatch, module, name: str) -> list[str]:
    """Records calls to `module.name` (and still runs it)."""
    calls: list[str] = []
    original = getattr(module, name)

    def recorded(*args, **kwargs):
        calls.append(module.__name__)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return calls


def test_auto_picks_the_cpu_backend_for_cpu_tensors(monkeypatch):
    from berth.kernels import cpu_ops

    kernels.set_backend("auto")
    calls = spy(monkeypatch, cpu_ops, "silu_and_mul")
    kernels.silu_and_mul(torch.randn(2, 8))
    assert calls == ["berth.kernels.cpu_ops"]


def test_set_backend_and_use_backend_override(monkeypatch, triton_ops):
    torch_calls = spy(monkeypatch, reference, "silu_and_mul")
    triton_calls = spy(monkeypatch, triton_ops, "silu_and_mul")
    x = torch.randn(2, 8)
    kernels.set_backend("triton")
    assert kernels.get_backend() == "triton"
    kernels.silu_and_mul(x)  # CPU tensor, Triton anyway (the interpreter runs it)
    with kernels.use_backend("torch"):
        assert kernels.get_backend() == "torch"
        kernels.silu_and_mul(x)
    assert kernels.get_backend() == "triton"
    assert len(triton_calls) == 1 and len(torch_calls) == 1


def test_use_backend_restores_after_an_error():
    kernels.set_backend("torch")
    with pytest.raises(RuntimeError), kernels.use_backend("triton"):
        raise RuntimeError("boom")
    assert kernels.get_backend() == "torch"


@pytest.mark.parametrize("name", ["cuda", "Triton", ""])
def test_invalid_backend_name_is_refused(name):
    with pytest.raises(ValueError, match="kernel backend"):
        kernels.set_backend(name)
    with pytest.raises(ValueError), kernels.use_backend(name):
        pass


def _backend_in_fresh_process(value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "BERTH_KERNEL_BACKEND": value}
    code = "import berth.kernels as k; print(k.get_backend())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_environment_variable_sets_the_initial_backend():
    result = _backend_in_fresh_process("torch")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch"


def test_invalid_environment_variable_is_refused():
    result = _backend_in_fresh_process("Torch")
    assert result.returncode != 0 and "kernel backend" in result.stderr
