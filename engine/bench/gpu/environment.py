"""The machine and the software the GPU checks ran with, and the ceilings they are read against.

Its `versions` metric is what `images/Dockerfile.cuda` pins: every distribution berth's engine
imports, at the version this machine has.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from pathlib import Path

import torch

from berth.engine.bench.gpu.ceilings import copy_bandwidth, matmul_flops
from berth.engine.bench.gpu.result import CheckResult, check_main

# The distributions the engine and its server import (pyproject's dependencies less the
# operator's, plus the GPU's own): what an image that serves on a GPU must pin.
ENGINE_DISTRIBUTIONS = (
    "torch", "triton", "transformers", "safetensors", "tokenizers", "numpy", "tqdm", "pyzmq",
    "pydantic", "pydantic-core", "fastapi", "starlette", "uvicorn", "httpx", "prometheus-client",
    "mpi4py", "huggingface-hub", "jinja2",
)  # fmt: skip


def distribution_versions(names: tuple[str, ...] = ENGINE_DISTRIBUTIONS) -> dict[str, str | None]:
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def check(result: CheckResult, dry_run: bool, workdir: Path) -> None:
    device = torch.device("cpu" if dry_run else "cuda")
    versions = distribution_versions()
    result.metrics["versions"] = versions
    result.metrics["python"] = sys.version.split()[0]
    result.metrics["platform"] = platform.platform()
    result.add(
        "python / torch", f"{sys.version.split()[0]} / {torch.__version__} (CUDA {torch.version.cuda})"
    )
    missing = sorted(name for name, version in versions.items() if version is None)
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        result.metrics["device"] = properties.name
        result.metrics["device_memory_bytes"] = properties.total_memory
        result.metrics["multiprocessors"] = properties.multi_processor_count
        result.add(
            "device",
            f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB, "
            f"{properties.multi_processor_count} SMs, compute capability "
            f"{properties.major}.{properties.minor}",
        )
    result.add("engine packages", ", ".join(f"{n} {v}" for n, v in versions.items() if v), ok=not missing)
    if missing:
        result.note(f"missing: {', '.join(missing)} (carried wheels: tools/gpu-wheels.txt)")
    size = 64 << 20 if dry_run else 4 << 30
    bandwidth = copy_bandwidth(device, size)
    result.metrics["copy_bandwidth_bytes_per_s"] = bandwidth
    result.add("device-to-device copy (read + write)", f"{bandwidth / 1e12:.2f} TB/s")
    flops = matmul_flops(device, torch.bfloat16, 256 if dry_run else 8192)
    result.metrics["bf16_matmul_flops"] = flops
    result.add("bf16 matmul, random data", f"{flops / 1e12:.0f} TFLOP/s")


def main(argv: list[str] | None = None) -> int:
    return check_main("environment", __doc__.split("\n")[0], check, argv)


if __name__ == "__main__":
    sys.exit(main())
