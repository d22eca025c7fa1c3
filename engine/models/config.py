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
    # RoPE rotates the first head_dim * partial_rotary_factor features of each head (Phi-4-mini:
    # 0.75), the rest pass through.
    partial_rotary_factor: float = 1.0
    # The RoPE of the sliding-window layers where it differs from the global layers' (Gemma 3's
    # `rope_local_base_freq`, or `rope_parameters["sliding_attention"]`); None: the same.
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    # The gated MLP's activation ("silu"; Gemma's "gelu_pytorch_tanh").
    hidden_act: str = "silu"
    # Gemma: the softmax scale is query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    query_pre_attn_scalar: float | None = None
    # tanh soft-capping of the final logits / of the attention scores (None: none).
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # Gemma 3 as an embedding model: attention that sees the tokens after too.
    use_bidirectional_attention: bool = False
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
        rope = _rope(raw)
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
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
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
            partial_rotary_factor=rope.partial_rotary_factor,
            local_rope_theta=rope.local_theta,
            local_rope_scaling=rope.local_scaling,
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
            use_bidirectional_attention=bool(raw.get("use_bidirectional_attention")),
        )

    @property
    def rotary_dim(self) -> int:
        """How many features of each head RoPE rotates (transformers': int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def shape_differences(self, other: ModelConfig) -> list[str]:
        """What in `other` gives a weight another shape than in this model ("" when nothing)."""
        return [
            f"{name} {getattr(other, name)!r} (serving: {getattr(self, name)!r})"
            for name in SHAPE_FIELDS
            if getattr(other, name) != getattr(self, name)
        ]


@dataclass(frozen=True)
class _Rope:
    theta: float
    scaling: dict | None
    partial_rotary_factor: float
    local_theta: float | None
    local_scaling: dict | None


def _rope(raw: dict) -> _Rope:
    """The RoPE settings, from any of the layouts checkpoints write them in: transformers >= 5
    nests them in `rope_parameters` (per layer type for Gemma 3: "full_attention" and
    "sliding_attention"); older files have `rope_theta` + `rope_scaling` (and Gemma 3's
    `rope_local_base_freq` for its local layers)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    local = None
    if isinstance(params.get("full_attention"), dict) or isinstance(params.get("sliding_attention"), dict):
        local = dict(params.get("sliding_attention") or {})
        params = params.get("full_attention") or {}
    params = dict(params)
    # Gemma 3's config class defaults: 1e6 for the global layers, 1e4 for the local ones.
    gemma3 = raw.get("model_type") in ("gemma3_text", "gemma3")
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or (1e6 if gemma3 else 10000.0))
    # Phi-3 writes the factor beside `rope_scaling`, transformers 5 inside `rope_parameters`.
    partial = float(params.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor") or 1.0)
    local_theta = raw.get("rope_local_base_freq") or (10000.0 if gemma3 else None)
    local_scaling = None
    if local is not None:
        local_theta = float(local.pop("rope_theta", None) or local_theta or 10000.0)
        local.pop("partial_rotary_factor", None)
        local_scaling = _rope_scaling(local, raw)
    return _Rope(
        theta=theta,
        scaling=_rope_scaling(params, raw),
        partial_rotary_factor=partial,
        local_theta=None if local_theta is None else float(local_theta),
        local_scaling=local_scaling,
    )


def _rope_scaling(params: dict, raw: dict) -> dict | None:
    """A RoPE scaling dict with "rope_type" set, and for LongRoPE the two lengths it needs as
    transformers reads them (`original_max_position_embeddings` beside the dict wins, as Phi-3
    writes it; `factor` defaults to max_position_embeddings / original); None for plain RoPE."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    # Phi-3's early names for LongRoPE (transformers maps "yarn" to it for Phi-3 only).
    if rope_type == "su" or (rope_type == "yarn" and raw.get("model_type") == "phi3"):
        rope_type = "longrope"
    if rope_type == "default":
        return None
    scaling = {key: value for key, value in params.items() if key != "type"}
    scaling["rope_type"] = rope_type
    if rope_type == "longrope":
        max_positions = raw.get("max_position_embeddings", 2048)
        # Phi3Config's own default when the file has neither (transformers' standardisation).
        fallback = 4096 if raw.get("model_type") == "phi3" else max_positions
        original = (
            raw.get("original_max_position_embeddings")
            or scaling.get("original_max_position_embeddings")
            or fallback
        )
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None:
            scaling["factor"] = max_positions / original
    return scaling


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
    if types is None and raw.get("sliding_window_pattern"):  # older Gemma 3 files: every n-th layer global
        pattern = raw["sliding_window_pattern"]
        types = [
            "full_attention" if (layer + 1) % pattern == 0 else "sliding_attention"
            for layer in range(num_layers)
        ]
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
