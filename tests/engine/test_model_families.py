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
from berth.engine.pyexecutor.rank import decode_graphs_for
from tests.engine.conftest import (
    LOGPROB_TOLERANCE,
    check_against_reference,
    hf_greedy,
    kv_blocks_used,
    prompts_of_many_lengths,
)
from tests.support.engine_processes import no_world_outlives

WINDOW = 8
# Phi-3's LongRoPE over a rotary dim of 8 (head_dim 16, partial_rotary_factor 0.5): 4 factors each.
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "partial_rotary_factor": 0.5,
    "short_factor": [1.0, 1.25, 2.0, 3.5],
    "long_factor": [1.5, 3.0, 6.0, 12.0],
}
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
    # Fused qkv_proj / gate_up_proj in the checkpoint; RoPE over half of each head; LongRoPE
    # with an original context (64) none of these prompts reaches: the short factors, cos and
    # sin times the attention factor sqrt(1 + ln(1024 / 64) / ln 64) (the crossing: below).
    "phi3": {"rope_scaling": PHI3_LONGROPE, "original_max_position_embeddings": 64},
    # Layer 0 windowed, layer 1 global, each with its RoPE (local base 100; global 10000 scaled
    # "linear" by 4); head_dim 32; q/k norm and four norms a layer, each 1 + weight; GELU-tanh;
    # embeddings times sqrt(64); softmax scale 24 ** -0.5; final logits capped at 5.
    "gemma3": {
        "head_dim": 32,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_local_base_freq": 100.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 5.0,
    },
}
# Shorter and longer than the window; 30 tokens take two prefill chunks of 16.
PROMPT_LENGTHS = (1, 5, 12, 30)
MAX_NEW = 12
# 14 blocks of 4 slots cannot hold the 4 sequences at their full length: the scheduler preempts.
ENGINE = {"max_num_tokens": 16, "kv_cache_blocks": 14, "kv_block_size": 4, "max_batch_size": 4}
# With the chosen token's log-prob: what soft-capping and RoPE's attention factor change beyond
# the argmax.
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)


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


def check_completion(completion, theirs, hf_logprobs) -> None:
    """Greedy tokens as transformers' (`check_against_reference`), and the log-prob of each
    token both chose, up to the first they differ on, within float32 noise of transformers'."""
    check_against_reference(completion.token_ids, theirs, hf_logprobs)
    for step, (token, reference) in enumerate(zip(completion.token_ids, theirs)):
        if token != reference:
            break
        ours = completion.logprobs[step][token].logprob
        assert ours == pytest.approx(hf_logprobs[step, token].item(), abs=LOGPROB_TOLERANCE), step


def test_greedy_tokens_equal_transformers(family):
    path, prompts, expected = family
    with LLM(path, executor="in-process", **ENGINE) as llm:
        first = [output.outputs[0] for output in llm.generate(prompts, GREEDY)]
        again = [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]
        stats = llm.executor.stats
        assert kv_blocks_used(llm) == 0
    assert stats.num_preemptions >= 1, "the workload was meant to force a preemption"
    assert stats.prefix_cache_hits > 0, "the second round was meant to start from cached blocks"
    for completion, (theirs, hf_logprobs) in zip(first, expected):
        check_completion(completion, theirs, hf_logprobs)
    assert again == [completion.token_ids for completion in first]


@pytest.mark.slow  # an MPI world of two ranks per family
def test_greedy_tokens_of_two_ranks_equal_transformers(family):
    """Heads, intermediate features (each expert's too) and vocabulary split over two ranks."""
    path, prompts, expected = family
    with LLM(path, tensor_parallel_size=2, **ENGINE) as world:
        outputs = world.generate(prompts, GREEDY)
    for output, (theirs, hf_logprobs) in zip(outputs, expected):
        check_completion(output.outputs[0], theirs, hf_logprobs)


# Prompts within Phi-3's original context (16 here) and past it, and one that crosses it while
# generating (12 + 12 tokens).
LONGROPE_PROMPT_LENGTHS = {"within": 5, "crossing": 12, "past": 17, "far_past": 30}


@pytest.fixture(scope="module")
def phi3_past_its_original_context(tmp_path_factory):
    """(checkpoint, {name: (prompt, transformers' greedy tokens and log-probs)})."""
    path = make_tiny_model(
        tmp_path_factory.mktemp("phi3-longrope"),
        arch="phi3",
        tie_word_embeddings=False,
        seed=3,
        rope_scaling=PHI3_LONGROPE,
        original_max_position_embeddings=16,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = dict(
        zip(LONGROPE_PROMPT_LENGTHS, prompts_of_many_lengths(tokenizer, LONGROPE_PROMPT_LENGTHS.values()))
    )
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, {name: (prompt, hf_greedy(hf_model, prompt, MAX_NEW)) for name, prompt in prompts.items()}


def longrope_greedy(path, prompts, *, replayed: bool = False):
    """berth's completions; with `replayed`, again from emulated decode graphs (their padded
    static buffers), which must give the same tokens."""
    # Each prompt prefills in one step, nothing is preempted: a prompt split in chunks chooses
    # otherwise (engine/models/rotary.py says how).
    engine = {"max_num_tokens": 64, "kv_cache_blocks": 64, "kv_block_size": 4, "max_batch_size": 4}
    with LLM(path, executor="in-process", **engine) as llm:
        outputs = [output.outputs[0] for output in llm.generate(prompts, GREEDY)]
        if replayed:
            runner = llm.executor.engine.model_runner
            runner.use_decode_graphs(decode_graphs_for(runner, llm.executor.engine.config, emulate=True))
            runner.capture_decode_graphs()
            again = [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]
            assert runner.decode_graphs.num_replays > 0
            assert again == [completion.token_ids for completion in outputs]
        assert llm.executor.stats.num_preemptions == 0
    return outputs


def test_phi3_longrope_past_the_original_context_equals_transformers(phi3_past_its_original_context):
    """A prompt longer than `original_max_position_embeddings` is rotated with LongRoPE's long
    factors from its first token, one within it with the short factors, as transformers does;
    replayed decode steps choose the same (padding rows included)."""
    path, cases = phi3_past_its_original_context
    names = ["within", "past", "far_past"]
    ours = longrope_greedy(path, [cases[name][0] for name in names], replayed=True)
    for completion, name in zip(ours, names):
        check_completion(completion, *cases[name][1])


@pytest.mark.xfail(
    strict=True, reason="transformers recomputes the cache with the long factors at the crossing"
)
def test_phi3_longrope_crossing_while_generating_equals_transformers(phi3_past_its_original_context):
    """Known difference: when a sequence grows past the original context while generating,
    transformers' Phi-3 drops its cache and recomputes every position with the long factors
    (`prepare_inputs_for_generation`); berth rotates the new tokens with them and keeps the keys
    cached before, rotated with the short ones. Matching it is the scheduler's part: recompute the
    sequence at the crossing, and keep LongRoPE's choice in the prefix cache's block keys."""
    path, cases = phi3_past_its_original_context
    (completion,) = longrope_greedy(path, [cases["crossing"][0]])
    check_completion(completion, *cases["crossing"][1])


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


def test_the_config_says_how_each_layer_rotates(tmp_path):
    """RoPE settings in the layouts checkpoints write them in."""
    # Phi-3 / Phi-4-mini as on the hub: `rope_scaling` with the older "su" name, the original
    # context and the partial rotary factor beside it; `factor` from the two lengths.
    phi = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "max_position_embeddings": 131072}
    factors = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    su = write_config(
        tmp_path,
        **phi,
        rope_scaling={"type": "su", **factors},
        original_max_position_embeddings=4096,
        partial_rotary_factor=0.5,
    )
    assert su.rope_scaling == {
        "rope_type": "longrope",
        **factors,
        "original_max_position_embeddings": 4096,
        "factor": 32.0,
    }
    assert (su.head_dim, su.rotary_dim) == (8, 4)
    # transformers 5: everything inside `rope_parameters`.
    nested = {"rope_type": "longrope", "rope_theta": 5e5, "partial_rotary_factor": 0.5, **factors}
    five = write_config(tmp_path, **phi, rope_parameters={**nested, "original_max_position_embeddings": 8192})
    assert five.rope_theta == 5e5 and five.rope_scaling["factor"] == 16.0 and five.rotary_dim == 4
    # Gemma 3, older files: global base and scaling, a local base, every 6th layer global.
    gemma = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "sliding_window": 512}
    old = write_config(
        tmp_path,
        **gemma,
        num_hidden_layers=7,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=6,
    )
    assert old.sliding_windows == (512,) * 5 + (None, 512)
    assert (old.rope_theta, old.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (old.local_rope_theta, old.local_rope_scaling) == (1e4, None)
    # transformers 5: per layer type.
    per_type = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_theta": 1e4},
    }
    new = write_config(tmp_path, **gemma, rope_parameters=per_type, layer_types=["sliding_attention"] * 4)
    assert (new.rope_theta, new.rope_scaling, new.local_rope_theta) == (1e6, None, 1e4)
    assert new.sliding_windows == (512,) * 4


def test_what_berth_does_not_do_is_refused_at_load_naming_the_field(tmp_path):
    gemma = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 8}
    write_config(tmp_path, **gemma, attn_logit_softcapping=50.0)
    with pytest.raises(
        ValueError, match=r"attn_logit_softcapping=50\.0.*no soft-capping of the attention scores"
    ):
        load_model(tmp_path)
    write_config(tmp_path, **gemma, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        load_model(tmp_path)
    write_config(tmp_path, architectures=["LlamaForCausalLM"], hidden_act="relu2")
    with pytest.raises(ValueError, match="hidden_act 'relu2' is not supported"):
        load_model(tmp_path)


@pytest.mark.parametrize("rank", [None, 1])
def test_fused_projections_load_split_and_each_part_sharded(tmp_path, rank, monkeypatch):
    """Phi-3 checkpoints hold `qkv_proj` and `gate_up_proj` fused: a rank takes its heads of q,
    of k and of v (and its features of gate and of up), the same parameters as from a checkpoint
    that holds them apart, reading only its shard."""
    fused = make_tiny_model(tmp_path / "fused", arch="phi3", tie_word_embeddings=False, seed=5)
    apart = tmp_path / "apart"
    apart.mkdir()
    for file in fused.iterdir():
        if file.suffix != ".safetensors":
            (apart / file.name).write_bytes(file.read_bytes())
    state = AutoModelForCausalLM.from_pretrained(fused, dtype=torch.float32).state_dict()
    split = {}
    for name, tensor in state.items():
        if name.endswith("qkv_proj.weight"):
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split([64, 32, 32])):
                split[name.replace("qkv_proj", part)] = rows
        elif name.endswith("gate_up_proj.weight"):
            for part, rows in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                split[name.replace("gate_up_proj", part)] = rows
        else:
            split[name] = tensor
    save_file({name: tensor.contiguous() for name, tensor in split.items()}, apart / "model.safetensors")
    tp = SINGLE if rank is None else TensorParallelGroup(rank, 2)
    expected = dict(load_model(apart, tp=tp).named_parameters())
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
