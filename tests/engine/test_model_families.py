"""The families beside Llama (engine/models/: qwen2, qwen3, qwen3_moe, mixtral, mistral) against
transformers, each on a tiny random checkpoint that transformers' own config and model classes
built: in float32 the greedy tokens are equal, at one rank and at two, on prompts shorter and
longer than the sliding window, through chunked prefill, preemption and the prefix cache. And
what the configs say that the checkpoints do not show: which layers are windowed or sparse."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from berth.engine import LLM, SamplingParams
from berth.engine.models import loader
from berth.engine.models.config import ModelConfig
from berth.engine.models.loader import ARCHITECTURES, load_model
from berth.engine.models.parallel import SINGLE, TensorParallelGroup
from berth.engine.models.tiny_model import make_tiny_model
from tests.engine.conftest import check_against_reference, hf_greedy, kv_blocks_used, prompts_of_many_lengths
from tests.support.engine_processes import no_world_outlives

WINDOW = 8
# What each tiny checkpoint sets beyond tiny_model's defaults (2 layers, hidden 64, 4 heads,
# 2 KV heads; the MoE families 4 experts, 2 a token).
FAMILIES = {
    # QKV biases; layer 1 windowed, layer 0 not (the window from `max_window_layers` on).
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    # A head_dim of its own (32, not 64 / 4); q/k norm; layer 1 windowed, layer 0 not.
    "qwen3": {"head_dim": 32, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    # A sparse block in layer 0 and a dense MLP in layer 1 (mlp_only_layers), top-k weights
    # not renormalised (Mixtral's always are).
    "qwen3_moe": {
        "head_dim": 32,
        "moe_intermediate_size": 48,
        "mlp_only_layers": [1],
        "norm_topk_prob": False,
    },
    "mixtral": {},
    "mistral": {"sliding_window": WINDOW},
}
# Shorter and longer than the window; 30 tokens take two prefill chunks of 16.
PROMPT_LENGTHS = (1, 5, 12, 30)
MAX_NEW = 12
# 14 blocks of 4 slots cannot hold the 4 sequences at their full length: the scheduler preempts.
ENGINE = {"max_num_tokens": 16, "kv_cache_blocks": 14, "kv_block_size": 4, "max_batch_size": 4}
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module", autouse=True)
def no_rank_outlives_the_module():
    yield
    no_world_outlives()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint, prompts, transformers' greedy tokens and log-probs for each)."""
    name = request.param
    path = make_tiny_model(
        tmp_path_factory.mktemp(name), arch=name, tie_word_embeddings=False, seed=3, **FAMILIES[name]
    )
    prompts = prompts_of_many_lengths(AutoTokenizer.from_pretrained(path), PROMPT_LENGTHS)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, prompts, [hf_greedy(hf_model, prompt, MAX_NEW) for prompt in prompts]


def test_greedy_tokens_equal_transformers(family):
    path, prompts, expected = family
    with LLM(path, executor="in-process", **ENGINE) as llm:
        first = [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]
        again = [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]
        stats = llm.executor.stats
        assert kv_blocks_used(llm) == 0
    assert stats.num_preemptions >= 1, "the workload was meant to force a preemption"
    assert stats.prefix_cache_hits > 0, "the second round was meant to start from cached blocks"
    for tokens, (theirs, hf_logprobs) in zip(first, expected):
        check_against_reference(tokens, theirs, hf_logprobs)
    assert again == first


@pytest.mark.slow  # an MPI world of two ranks per family
def test_greedy_tokens_of_two_ranks_equal_transformers(family):
    """Heads, intermediate features (each expert's too) and vocabulary split over two ranks."""
    path, prompts, expected = family
    with LLM(path, tensor_parallel_size=2, **ENGINE) as world:
        outputs = world.generate(prompts, GREEDY)
    for output, (theirs, hf_logprobs) in zip(outputs, expected):
        check_against_reference(output.outputs[0].token_ids, theirs, hf_logprobs)


@pytest.mark.parametrize("rank", [None, 1])
def test_experts_load_from_the_3d_tensors_transformers_holds_them_in(tmp_path, rank, monkeypatch):
    """A checkpoint saved from transformers' state dict holds each MoE layer's experts as
    `experts.gate_up_proj` [E, 2 I, H] and `experts.down_proj` [E, H, I]: the same model loads
    from it, at one rank or as a rank's shard, reading only that shard."""
    per_expert = make_tiny_model(tmp_path / "per-expert", arch="mixtral", num_layers=1, seed=4)
    fused = tmp_path / "fused"
    fused.mkdir()
    for file in per_expert.iterdir():
        if file.suffix != ".safetensors":
            (fused / file.name).write_bytes(file.read_bytes())
    state = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32).state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 256, 64)
    state.pop("lm_head.weight")  # tied: the embedding
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, fused / "model.safetensors")
    tp = SINGLE if rank is None else TensorParallelGroup(rank, 2)
    expected = dict(load_model(per_expert, tp=tp).named_parameters())
    read: list[int] = []
    original = loader.StoredTensor.read_region

    def counting(self, region):
        tensor = original(self, region)
        read.append(tensor.numel())
        return tensor

    monkeypatch.setattr(loader.StoredTensor, "read_region", counting)
    model = load_model(fused, tp=tp)
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, expected[name]), name
    assert sum(read) == sum(parameter.numel() for parameter in model.parameters())


def write_config(directory, **fields) -> ModelConfig:
    base = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
    (directory / "config.json").write_text(json.dumps({**base, "num_hidden_layers": 4, **fields}))
    return ModelConfig.from_pretrained(directory)


def test_the_config_says_which_layers_are_windowed_and_which_sparse(tmp_path):
    mistral = write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=16)
    assert mistral.sliding_windows == (16,) * 4 and mistral.sparse_layers == ()
    assert write_config(tmp_path, sliding_window=None).sliding_windows == (None,) * 4
    kinds = ["full_attention", "sliding_attention"] * 2
    mixed = write_config(tmp_path, sliding_window=16, layer_types=kinds)
    assert mixed.sliding_windows == (None, 16, None, 16)
    # Older Qwen2 / Qwen3 files: windowed from max_window_layers on, and only when asked for.
    qwen = {"model_type": "qwen2", "sliding_window": 16, "max_window_layers": 3}
    assert write_config(tmp_path, **qwen, use_sliding_window=True).sliding_windows == (None,) * 3 + (16,)
    assert write_config(tmp_path, **qwen, use_sliding_window=False).sliding_windows == (None,) * 4
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    qwen3_moe = write_config(tmp_path, **moe, decoder_sparse_step=2, mlp_only_layers=[3])
    assert qwen3_moe.sparse_layers == (1,) and qwen3_moe.moe_intermediate_size == 16
    mixtral = write_config(tmp_path, num_local_experts=8, num_experts_per_tok=2)
    assert mixtral.sparse_layers == (0, 1, 2, 3) and mixtral.moe_intermediate_size == 64
    assert mixtral.norm_topk_prob


def test_an_unsupported_architecture_fails_at_start_naming_the_supported_ones(tmp_path, tiny_model):
    for file in tiny_model.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    supported = ", ".join(ARCHITECTURES)
    with pytest.raises(ValueError, match=f"'GPT2LMHeadModel' is not supported \\(supported: {supported}\\)"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        LLM(tmp_path, executor="in-process", kv_cache_blocks=16)
