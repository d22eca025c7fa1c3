"""The model facts the engine needs, read from a checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


# The fields that decide the shape of every weight (and of the KV cache): another revision of
# a model can be swapped into an engine only if it keeps them.
SHAPE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "attention_bias",
)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "float32"

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a model directory: {path} does not exist")
        raw = json.loads(path.read_text())
        missing = [key for key in REQUIRED_FIELDS if key not in raw]
        if missing:
            raise ValueError(f"{path} lacks required fields: {', '.join(missing)}")
        architectures = raw.get("architectures") or [""]
        # transformers >= 5 nests RoPE settings in `rope_parameters`; older files use
        # `rope_theta` + `rope_scaling`. Accept both.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        num_heads = raw["num_attention_heads"]
        return cls(
            architecture=architectures[0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has QKV bias; Llama only when `attention_bias` says so.
            attention_bias=raw.get("attention_bias", raw.get("model_type") == "qwen2"),
            eos_token_ids=_eos_ids(raw, Path(model_dir)),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
        )

    def shape_differences(self, other: ModelConfig) -> list[str]:
        """What in `other` gives a weight another shape than in this model ("" when nothing)."""
        return [
            f"{name} {getattr(other, name)!r} (serving: {getattr(self, name)!r})"
            for name in SHAPE_FIELDS
            if getattr(other, name) != getattr(self, name)
        ]


def _eos_ids(raw: dict, model_dir: Path) -> tuple[int, ...]:
    """End-of-sequence ids from config.json and generation_config.json (HF stops on the latter)."""
    ids: list[int] = []
    sources = [raw]
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)
