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
    "num_experts",
    "moe_intermediate_size",
    "sparse_layers",
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
    # Per layer: how many positions back a token sees (itself included), None for all of them.
    sliding_windows: tuple[int | None, ...] = ()
    # Mixture of experts (0 experts: none). `sparse_layers` are the layers whose MLP is the
    # sparse block; every expert is a gated MLP of `moe_intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[int, ...] = ()
    # Where it was read from (its tokenizer is there too); "" for a config made in memory.
    model_dir: str = ""

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
        num_layers = raw["num_hidden_layers"]
        # Mixtral's `num_local_experts`; Qwen3-MoE's `num_experts` (transformers 5 writes the former).
        num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
        return cls(
            architecture=architectures[0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
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
            model_dir=str(model_dir),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
            sliding_windows=_sliding_windows(raw, num_layers),
            num_experts=num_experts,
            num_experts_per_tok=(raw.get("num_experts_per_tok") or 0) if num_experts else 0,
            # Mixtral's experts are `intermediate_size` wide; Qwen3-MoE's `moe_intermediate_size`.
            moe_intermediate_size=(
                (raw.get("moe_intermediate_size") or raw["intermediate_size"]) if num_experts else 0
            ),
            # Mixtral always renormalises the top-k weights; Qwen3-MoE when `norm_topk_prob`.
            norm_topk_prob=raw.get("norm_topk_prob", True),
            sparse_layers=_sparse_layers(raw, num_layers, num_experts),
        )

    def shape_differences(self, other: ModelConfig) -> list[str]:
        """What in `other` gives a weight another shape than in this model ("" when nothing)."""
        return [
            f"{name} {getattr(other, name)!r} (serving: {getattr(self, name)!r})"
            for name in SHAPE_FIELDS
            if getattr(other, name) != getattr(self, name)
        ]


def _sliding_windows(raw: dict, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window, as transformers applies it: `layer_types` where the config lists them
    (transformers >= 5 writes them for the families that mix windowed and full layers, Qwen2 and
    Qwen3: layers from `max_window_layers` on, where older files say only that), otherwise every
    layer (Mistral, Mixtral, Qwen3-MoE). `use_sliding_window: false` turns the window off."""
    window = raw.get("sliding_window")
    if not window or raw.get("use_sliding_window") is False:
        return (None,) * num_layers
    types = raw.get("layer_types")
    if types is None and raw.get("model_type") in ("qwen2", "qwen3") and "max_window_layers" in raw:
        first = raw["max_window_layers"]
        types = ["sliding_attention" if layer >= first else "full_attention" for layer in range(num_layers)]
    if types is None:
        return (window,) * num_layers
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def _sparse_layers(raw: dict, num_layers: int, num_experts: int) -> tuple[int, ...]:
    """The layers whose MLP is the sparse MoE block: every `decoder_sparse_step`-th one, except
    `mlp_only_layers` (Qwen3-MoE's rule; Mixtral has neither field: every layer)."""
    if not num_experts:
        return ()
    step = raw.get("decoder_sparse_step") or 1
    dense = set(raw.get("mlp_only_layers") or ())
    return tuple(layer for layer in range(num_layers) if (layer + 1) % step == 0 and layer not in dense)


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
