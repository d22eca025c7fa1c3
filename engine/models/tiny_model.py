"""`berth make-tiny-model DIR`: a small random-weight checkpoint in Hugging Face format.

Tests and the demo need a real checkpoint without a hub download: this writes a model of any
family berth serves (Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE, Phi-3, Gemma 3), built
by transformers' own config and model classes, with random weights and a byte-level BPE
tokenizer trained on a built-in corpus (all 256 bytes are in its alphabet, so no text is out of
vocabulary). The same seed gives the same files.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Large language models generate text one token at a time, and an inference engine batches many
requests together so that every step of the model serves as many users as the memory allows.
Kubernetes operators reconcile the desired state written in a resource with the actual state of
the cluster: they create pods, watch their health and restart what has failed.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
Hello, world! This tokenizer was trained offline, for tests, on a few paragraphs of plain text.
The paged key-value cache stores attention keys and values in fixed-size blocks; a block table maps
each sequence's positions to the blocks it owns, so memory is never wasted on padding.
When the pool of blocks runs short, the scheduler preempts a request and recomputes it later.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 2.71828. Punctuation: ; : , . ! ? ( ) [ ] { }.
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, "<|im_start|>", "<|im_end|>"]

# --arch -> transformers' (config class, model class), and what a tiny one sets beyond the
# common fields: the MoE families get 4 experts, 2 a token.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help="where to write the checkpoint")
    parser.add_argument(
        "--arch", choices=tuple(FAMILIES), default="llama", help="the model family (qwen2 adds QKV bias)"
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=None, help="default: 2 x hidden size")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2, help="fewer than --heads for GQA")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--max-position-embeddings", type=int, default=1024)
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--init-std",
        type=float,
        default=0.25,
        help="weight init std; large enough that greedy choices are decisive, not near-ties",
    )
    parser.add_argument("--max-shard-size", default=None, help="e.g. 200KB to write a sharded checkpoint")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    for name in ("layers", "hidden_size", "heads", "kv_heads", "vocab_size", "max_position_embeddings"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"berth make-tiny-model: --{name.replace('_', '-')} must be positive")
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        raise SystemExit("berth make-tiny-model: --hidden-size must divide by --heads, --heads by --kv-heads")
    if args.vocab_size < 256 + len(SPECIAL_TOKENS):
        raise SystemExit(f"berth make-tiny-model: --vocab-size must be at least {256 + len(SPECIAL_TOKENS)}")
    make_tiny_model(
        args.directory,
        arch=args.arch,
        num_layers=args.layers,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        tie_word_embeddings=args.tie_word_embeddings,
        init_std=args.init_std,
        max_shard_size=args.max_shard_size,
        seed=args.seed,
    )
    print(f"wrote a tiny {args.arch} checkpoint to {args.directory}")
    return 0


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on CORPUS, wrapped for `transformers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=1 << 20,
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_model(
    directory: str | os.PathLike,
    *,
    arch: str = "llama",
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    tie_word_embeddings: bool = True,
    init_std: float = 0.25,
    max_shard_size: str | None = None,
    seed: int = 0,
    head_dim: int | None = None,
    **config_fields,
) -> Path:
    """Writes the checkpoint and returns its directory. `head_dim` (default hidden_size / heads)
    and `config_fields` (`sliding_window=8`, `mlp_only_layers=[1]`, ...) go to the config class."""
    import torch
    import transformers
    from transformers import GenerationConfig

    directory = Path(directory)
    tokenizer = build_tokenizer(vocab_size)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    if arch not in FAMILIES:
        raise ValueError(f"arch must be one of {', '.join(FAMILIES)}, got {arch!r}")
    config_name, model_name, family_fields = FAMILIES[arch]
    if arch == "gemma3":
        # RoPE per layer type: `rope_scaling` goes to the global layers, `rope_local_base_freq`
        # (a config field) sets the local layers' base.
        local = {"rope_type": "default", "rope_theta": config_fields.pop("rope_local_base_freq", 10000.0)}
        rope = {"full_attention": rope, "sliding_attention": local}
    # Qwen3's default head_dim is 128 and Gemma 3's 256, not hidden / heads.
    if head_dim is not None or arch.startswith("qwen3") or arch == "gemma3":
        common["head_dim"] = head_dim or hidden_size // num_heads
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
    config = config_class(**common, **{**family_fields, **config_fields}, rope_parameters=rope)

    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        # Norm weights start at 1 and biases at 0 in HF init; random ones exercise the loader.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, init_std)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    directory.mkdir(parents=True, exist_ok=True)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **save_kwargs)
    tokenizer.save_pretrained(directory)
    return directory
