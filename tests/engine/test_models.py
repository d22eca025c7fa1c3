"""Tiny checkpoints and loading them: transformers reads what we write; we read transformers'
formats (single file, sharded, tied or not, qwen2 biases) in every supported dtype."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from berth.engine import LLM, SamplingParams
from berth.engine.models.loader import load_model, slow_cpu_dtype_warning
from berth.engine.models.tiny_model import make_tiny_model
from berth.kernels.cpu_ops import gemm_path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cli_writes_a_checkpoint_transformers_loads_offline(tmp_path):
    target = tmp_path / "m"
    args = ["--arch", "llama", "--layers", "3", "--hidden-size", "32", "--heads", "4", "--kv-heads", "1"]
    subprocess.run(
        [sys.executable, "-m", "berth", "make-tiny-model", str(target), *args, "--vocab-size", "300"],
        check=True,
        capture_output=True,
        timeout=120,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (3, 32, 1)
    assert config.vocab_size == 300
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    text = "def add(a, b): return a + b"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) < len(text) and tokenizer.decode(ids, skip_special_tokens=True) == text  # trained merges
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "hi" in chat


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=4)
    b = make_tiny_model(tmp_path / "b", seed=4)
    c = make_tiny_model(tmp_path / "c", seed=5)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(a / name) == digest(b / name)
    assert digest(a / "model.safetensors") != digest(c / "model.safetensors")


def test_qwen2_untied_sharded_layout(tiny_qwen2):
    index = json.loads((tiny_qwen2 / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" in names
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert AutoModelForCausalLM.from_pretrained(tiny_qwen2).config.model_type == "qwen2"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_load_model_in_each_dtype(tiny_model, dtype, caplog):
    model = load_model(tiny_model, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    # A dtype this CPU has no fast matmul for loads, and says it will be slow (which branch runs
    # depends on the machine: bfloat16 warns only where neither oneDNN nor gemm.c takes it).
    slow = dtype != torch.float32 and gemm_path(dtype) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ([slow_cpu_dtype_warning(dtype)] if slow else []), warnings


@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 0.1), ("float16", 0.02)])
def test_half_precision_logprobs_stay_close_to_float32(tiny_model, dtype, tolerance):
    """First-token log-probs in half precision are within `tolerance` of float32's."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    prompts = ["the quick brown fox", "def add(a, b):", "lazy"]
    with LLM(tiny_model, executor="in-process", kv_cache_blocks=16) as reference:
        expected = reference.generate(prompts, params)
    with LLM(tiny_model, executor="in-process", kv_cache_blocks=16, dtype=dtype) as half:
        actual = half.generate(prompts, params)
    for want, got in zip(expected, actual):
        want_top = want.outputs[0].logprobs[0]
        got_top = got.outputs[0].logprobs[0]
        for token, logprob in want_top.items():
            if token in got_top:
                assert got_top[token].logprob == pytest.approx(logprob.logprob, abs=tolerance)


def test_missing_weight_is_named(tmp_path, tiny_model):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in tiny_model.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights for: model\.layers\.1\.mlp\.gate_up_proj"):
        load_model(broken)


def test_wrong_shape_is_named(tmp_path, tiny_model):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in tiny_model.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight: checkpoint shape \(7,\)"):
        load_model(broken)


def test_bad_model_directory_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="lacks required fields: vocab_size"):
        load_model(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        load_model(tmp_path)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path = make_tiny_model(tmp_path / "llama3", rope_scaling=scaling, rope_theta=500000.0)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = list(range(3, 83))  # past the original context, where the scaling matters
    expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, 80:].tolist()
    with LLM(path, executor="in-process", kv_cache_blocks=16) as llm:
        ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    assert ours == expected[: len(ours)] and len(ours) == len(expected)


# ---- revisions: what a weight swap checks and what it reports -------------------------------------


def test_the_checkpoint_digest_tells_revisions_apart(tmp_path, tiny_model, tiny_qwen2):
    from berth.engine.models.loader import checkpoint_digest

    same, other = tmp_path / "same", tmp_path / "other"
    make_tiny_model(same, seed=0)
    make_tiny_model(other, seed=1)  # the same config and file sizes: only the weights differ
    assert checkpoint_digest(tiny_model) == checkpoint_digest(same)  # where it lives does not count
    assert checkpoint_digest(other) != checkpoint_digest(tiny_model)
    config = json.loads((same / "config.json").read_text())
    (same / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0}))
    assert checkpoint_digest(same) != checkpoint_digest(tiny_model)
    assert checkpoint_digest(tiny_qwen2).startswith("sha256:")  # sharded: through its index
    with pytest.raises(FileNotFoundError, match="no safetensors checkpoint"):
        checkpoint_digest(tmp_path)


def test_shape_differences_name_every_field_that_changes_a_weight(tmp_path, tiny_model, tiny_qwen2):
    from berth.engine.models.config import ModelConfig

    serving = ModelConfig.from_pretrained(tiny_model)
    seeded = tmp_path / "seeded"
    make_tiny_model(seeded, seed=9)
    assert serving.shape_differences(ModelConfig.from_pretrained(seeded)) == []
    differences = serving.shape_differences(ModelConfig.from_pretrained(tiny_qwen2))
    assert "architecture 'Qwen2ForCausalLM' (serving: 'LlamaForCausalLM')" in differences
    assert "tie_word_embeddings False (serving: True)" in differences
    assert "attention_bias True (serving: False)" in differences
