"""Loading a Hugging Face checkpoint (safetensors, single file or sharded) into our models.

Tensors are read lazily (`StoredTensor`): a rank of a tensor-parallel world reads only its
shard of each from the file (safetensors' slices), never the whole tensor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from berth.engine.models.config import ModelConfig
from berth.engine.models.decoder import DecoderForCausalLM
from berth.engine.models.gemma3 import Gemma3ForCausalLM
from berth.engine.models.llama import LlamaForCausalLM
from berth.engine.models.mistral import MistralForCausalLM
from berth.engine.models.mixtral import MixtralForCausalLM
from berth.engine.models.parallel import SINGLE, TensorParallelGroup
from berth.engine.models.phi3 import Phi3ForCausalLM
from berth.engine.models.qwen2 import Qwen2ForCausalLM
from berth.engine.models.qwen3 import Qwen3ForCausalLM
from berth.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from berth.engine.models.weights import RegionReader
from berth.kernels.cpu_ops import gemm_path

logger = logging.getLogger(__name__)

# A checkpoint's `architectures[0]` -> the family that serves it.
ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
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


def slow_cpu_dtype_warning(dtype: torch.dtype) -> str:
    # Measured on an AVX2-only EPYC: bfloat16 through torch's generic GEMM ran this project's
    # benchmark 5x slower than float32 (gemm.c is what runs bfloat16 there now).
    name = str(dtype).removeprefix("torch.")
    return (
        f"dtype {name}: this CPU has no fast {name} matmul (oneDNN takes float32, and bfloat16 "
        f"only with AVX-512 or AVX-NE-CONVERT; berth's own bfloat16 GEMM needs AVX2 and FMA and "
        f"a C compiler), so every GEMM takes torch's generic path, several times slower than "
        f"float32; dtype 'auto' (float32 on a CPU) is faster here"
    )


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        shards = [model_dir / name for name in names]
        for shard in shards:
            if not shard.is_file():
                raise FileNotFoundError(f"{shard}: a file {index.name} names is missing")
        return shards
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no safetensors checkpoint in {model_dir} (model.safetensors or its index)")


# How much of each end of a weight file goes into its digest.
DIGEST_SAMPLE_BYTES = 1 << 20


def checkpoint_digest(model_dir: str | Path) -> str:
    """A digest ("sha256:...") of what tells one revision of a checkpoint from another, cheap
    enough for every load: config.json, the safetensors index, and each weight file's name, size, and
    first and last MiB (the header with every tensor's name, shape and offset, and weights at
    both ends). Not a hash of every weight byte: two checkpoints that differ only in the middle
    of a file get the same digest."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        path = model_dir / name
        if path.is_file():
            digest.update(f"{name}\0".encode() + path.read_bytes() + b"\0")
    for path in checkpoint_files(model_dir):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as weights:
            digest.update(weights.read(DIGEST_SAMPLE_BYTES))
            if size > 2 * DIGEST_SAMPLE_BYTES:
                weights.seek(size - DIGEST_SAMPLE_BYTES)
            digest.update(weights.read(DIGEST_SAMPLE_BYTES))
    return f"sha256:{digest.hexdigest()}"


class StoredTensor(RegionReader):
    """One tensor of an open safetensors file, read when asked, and only the part asked for."""

    def __init__(
        self, handle, name: str, progress: tqdm, report: Callable[[int, int], None] | None = None
    ) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self._progress = progress
        self._report = report

    def read_region(self, region: tuple[slice, ...]) -> torch.Tensor:
        """The part a slice per dim selects."""
        tensor = self._slice[region]
        self._progress.update(tensor.numel() * tensor.element_size())
        if self._report is not None:
            self._report(self._progress.n, self._progress.total)
        return tensor


def iterate_weights(
    files: list[Path], report: Callable[[int, int], None] | None = None
) -> Iterator[tuple[str, StoredTensor]]:
    """Every tensor of `files`, read lazily; `report(bytes read, bytes in the files)` after each read."""
    # The bar counts bytes read, which for a shard is a part of the files.
    total = sum(f.stat().st_size for f in files)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="Loading weights", disable=total < PROGRESS_BAR_MIN_BYTES
    ) as progress:
        for path in files:
            with safe_open(str(path), framework="pt") as shard:
                for name in shard.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, StoredTensor(shard, name, progress, report)
    if report is not None:
        report(total, total)  # done: headers and a shard's unread parts are never counted as read


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    tp: TensorParallelGroup = SINGLE,
    on_bytes_read: Callable[[int, int], None] | None = None,
) -> DecoderForCausalLM:
    """The model, or with `tp` this rank's shard of it, loaded and packed for the kernels;
    `on_bytes_read(read, total)` hears how far reading the files has come (a few times a second)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    if config.architecture not in ARCHITECTURES:
        raise ValueError(
            f"architecture {config.architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    device = torch.device(device)
    dtype = resolve_dtype(dtype, config, device)
    if device.type == "cpu" and dtype != torch.float32 and gemm_path(dtype) is None:
        logger.warning(slow_cpu_dtype_warning(dtype))
    model = ARCHITECTURES[config.architecture](config, dtype=dtype, device=device, tp=tp)
    model.load_weights(iterate_weights(checkpoint_files(model_dir), _throttled(on_bytes_read)))
    model.pack_weights()
    return model.eval()


# How often a load reports its progress at most (each report may cross a process boundary).
PROGRESS_INTERVAL_SECONDS = 0.25


def _throttled(report: Callable[[int, int], None] | None) -> Callable[[int, int], None] | None:
    if report is None:
        return None
    last = [0.0]

    def throttled(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_INTERVAL_SECONDS or done >= total:
            last[0] = now
            report(done, total)

    return throttled
