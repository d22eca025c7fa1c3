"""A random-weight checkpoint with Llama-3-8B's shapes, written on the GPU machine (16 GB of bf16
is not carried there), for the decode and sleep checks; and its tiny stand-in for dry runs.

The weights are drawn on the device (drawing 8 billion numbers on a CPU takes minutes). The
tokenizer is the tiny model's (512 tokens): the checks feed token ids and read token ids back
(`detokenize=False`), since the model's 128,256 ids mostly have no text in it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    # Llama-3's own is 131,072 (with this scaling); 8,192 keeps every sequence's block table short.
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
)
TINY = dict(LLAMA3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
TINY.update(num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
DONE = "berth-random-checkpoint.json"


def random_checkpoint(directory: Path, shapes: dict, dtype: torch.dtype, device: str) -> Path:
    """Writes the checkpoint once (a finished directory is reused) and returns it."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from berth.engine.models.tiny_model import build_tokenizer

    marker = directory / DONE
    if marker.is_file() and json.loads(marker.read_text()).get("shapes") == json.dumps(shapes):
        return directory
    started = time.perf_counter()
    tokenizer = build_tokenizer(512)
    config = LlamaConfig(
        **shapes,
        initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # drawn in the checkpoint's dtype: no float32 copy of 8B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, max_shard_size="4GB")
    tokenizer.save_pretrained(directory)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    marker.write_text(json.dumps({"shapes": json.dumps(shapes), "seconds": time.perf_counter() - started}))
    return directory


def weight_bytes(directory: Path) -> int:
    """The checkpoint's weights, in bytes (what a decode step must read, the embedding aside)."""
    from safetensors import safe_open

    from berth.engine.models.loader import checkpoint_files

    total = 0
    for path in checkpoint_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                piece = handle.get_slice(name)
                total += torch.Size(piece.get_shape()).numel() * _itemsize(piece.get_dtype())
    return total


def _itemsize(dtype: str) -> int:
    return {"BF16": 2, "F16": 2, "F32": 4}[dtype]
