"""Loading a Hugging Face checkpoint (safetensors, single file or sharded) into our models."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from berth.engine.models.config import ModelConfig
from berth.engine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Below this size a progress bar is noise; above it, users want to see the load moving.
PROGRESS_BAR_MIN_BYTES = 512 << 20


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto' keeps the checkpoint's dtype on GPU; on CPU half precision is slow, so float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        dtype = config.torch_dtype if config.torch_dtype in DTYPES else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no safetensors checkpoint in {model_dir} (model.safetensors or its index)")


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    total = sum(f.stat().st_size for f in files)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="Loading weights", disable=total < PROGRESS_BAR_MIN_BYTES
    ) as progress:
        for path in files:
            with safe_open(str(path), framework="pt") as shard:
                for name in shard.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensor = shard.get_tensor(name)
                    yield name, tensor
                    progress.update(tensor.numel() * tensor.element_size())


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    if config.architecture not in ARCHITECTURES:
        raise ValueError(
            f"architecture {config.architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    device = torch.device(device)
    model = ARCHITECTURES[config.architecture](
        config, dtype=resolve_dtype(dtype, config, device), device=device
    )
    model.load_weights(iterate_weights(checkpoint_files(model_dir)))
    return model.eval()
