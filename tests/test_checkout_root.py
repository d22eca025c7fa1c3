"""Python started in the checkout root, as a new user starts it: the root is first on sys.path, and
the rooms' folders (engine/, kernels/, operator/) must not answer imports of other packages.

transformers imports Hugging Face's `kernels` whenever a model loads; with the root's `kernels/`
answering that import, every `python -c ...` in the root failed at the first model load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]


def run_in_root(*args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    return subprocess.run(
        [sys.executable, *args], cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_model_loads_with_transformers_from_the_checkout_root(tiny_model):
    code = (
        "import sys; from transformers import AutoModelForCausalLM; "
        f"AutoModelForCausalLM.from_pretrained({str(tiny_model)!r}); "
        "import kernels, berth.kernels; print(kernels.__file__); print(berth.kernels.__file__); "
        "print(sys.path[0] == '')"
    )
    result = run_in_root("-c", code)
    assert result.returncode == 0, result.stderr[-2000:]
    hf_kernels, berth_kernels, root_on_path = result.stdout.split()
    assert root_on_path == "True"  # the case in question: the root is on sys.path
    assert Path(hf_kernels).parent.name == "kernels" and Path(hf_kernels).parent.parent != REPOSITORY
    assert Path(berth_kernels) == REPOSITORY / "kernels" / "__init__.py"


@pytest.mark.parametrize("room", ["engine", "kernels", "operator"])
def test_a_room_under_its_bare_name_is_what_that_name_means_elsewhere(room):
    result = run_in_root("-c", f"import {room}; print(getattr({room}, '__file__', None))")
    if result.returncode != 0:  # nothing else has that name: as if the folder were not there
        assert f"ModuleNotFoundError: No module named '{room}'" in result.stderr, result.stderr[-2000:]
    else:
        assert not Path(result.stdout.strip()).is_relative_to(REPOSITORY / room), result.stdout


def test_berth_runs_with_the_module_switch_from_the_checkout_root():
    result = run_in_root("-m", "berth", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "make-tiny-model" in result.stdout
