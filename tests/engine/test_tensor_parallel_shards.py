"""Sharding a checkpoint for tensor parallelism, without processes: which heads, rows and columns
each rank holds, that together the ranks hold exactly the checkpoint, and that a rank reads
only its shard from the files (the forward over real ranks: tests/executor/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from berth.engine.models import loader
from berth.engine.models.loader import load_model
from berth.engine.models.parallel import TensorParallelGroup, attention_shard, vocab_split


def checkpoint(path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in loader.checkpoint_files(path):
        tensors.update(load_file(file))
    return tensors


def test_heads_split_evenly_and_kv_heads_replicate_when_fewer_than_ranks():
    halves = [attention_shard(8, 4, r, 2) for r in range(2)]
    assert [(s.num_heads, s.first_head, s.num_kv_heads, s.first_kv_head) for s in halves] == [
        (4, 0, 2, 0),
        (4, 4, 2, 2),
    ]
    # 2 KV heads, 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1 (their query heads' group).
    shards = [attention_shard(8, 2, r, 4) for r in range(4)]
    assert [(s.num_heads, s.first_head, s.num_kv_heads, s.first_kv_head) for s in shards] == [
        (2, 0, 1, 0),
        (2, 2, 1, 0),
        (2, 4, 1, 1),
        (2, 6, 1, 1),
    ]
    for shard in shards:  # each query head's KV head (GQA groups of 4) is the rank's
        assert {head // 4 for head in range(shard.first_head, shard.first_head + 2)} == {shard.first_kv_head}
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's 4 attention heads"):
        attention_shard(4, 2, 0, 3)
    with pytest.raises(ValueError, match="multiple of them"):
        attention_shard(6, 2, 0, 3)
    assert [vocab_split(10, r, 3) for r in range(3)] == [(0, 4, 4), (4, 4, 4), (8, 2, 4)]


@pytest.mark.parametrize(("checkpoint_fixture", "size"), [("tiny_qwen2", 2), ("tiny_tp3", 3)])
def test_the_ranks_hold_the_checkpoint_between_them(checkpoint_fixture, size, request):
    path = request.getfixturevalue(checkpoint_fixture)
    full = checkpoint(path)
    ranks = [load_model(path, tp=TensorParallelGroup(rank, size)) for rank in range(size)]
    config = ranks[0].config
    d = config.head_dim

    def rebuilt(name: str, dim: int) -> torch.Tensor:
        return torch.cat([dict(model.named_parameters())[name].data for model in ranks], dim=dim)

    layer = "model.layers.1"
    vocab = config.vocab_size
    assert torch.equal(rebuilt(f"{layer}.mlp.down_proj.weight", 1), full[f"{layer}.mlp.down_proj.weight"])
    assert torch.equal(
        rebuilt(f"{layer}.self_attn.o_proj.weight", 1), full[f"{layer}.self_attn.o_proj.weight"]
    )
    assert torch.equal(rebuilt("model.embed_tokens.weight", 0)[:vocab], full["model.embed_tokens.weight"])
    gate_up = [m.get_parameter(f"{layer}.mlp.gate_up_proj.weight").data for m in ranks]
    gate = torch.cat([g[: g.shape[0] // 2] for g in gate_up])
    assert torch.equal(gate, full[f"{layer}.mlp.gate_proj.weight"])
    for rank, model in enumerate(ranks):
        shard = attention_shard(config.num_heads, config.num_kv_heads, rank, size)
        qkv = model.get_parameter(f"{layer}.self_attn.qkv_proj.weight").data
        q, k, _ = qkv.split([shard.num_heads * d, shard.num_kv_heads * d, shard.num_kv_heads * d])
        first_q, first_kv = shard.first_head * d, shard.first_kv_head * d
        assert torch.equal(q, full[f"{layer}.self_attn.q_proj.weight"][first_q : first_q + len(q)])
        assert torch.equal(k, full[f"{layer}.self_attn.k_proj.weight"][first_kv : first_kv + len(k)])
        if config.attention_bias:
            bias = model.get_parameter(f"{layer}.self_attn.qkv_proj.bias").data
            assert torch.equal(
                bias[: len(q)], full[f"{layer}.self_attn.q_proj.bias"][first_q : first_q + len(q)]
            )
        # Norms are replicated; the vocabulary rows past the end are zero padding.
        assert torch.equal(
            model.get_parameter(f"{layer}.input_layernorm.weight"), full[f"{layer}.input_layernorm.weight"]
        )
        _, held, rows = vocab_split(vocab, rank, size)
        assert model.model.embed_tokens.weight.shape[0] == rows
        assert not model.model.embed_tokens.weight[held:].any()
    if not config.tie_word_embeddings:
        assert torch.equal(rebuilt("lm_head.weight", 0)[:vocab], full["lm_head.weight"])
    if config.num_kv_heads < size:  # every rank holds the (one) KV head whole
        for model in ranks:
            qkv = model.get_parameter(f"{layer}.self_attn.qkv_proj.weight").data
            _, k, v = qkv.split([config.num_heads // size * d, d, d])
            assert torch.equal(k, full[f"{layer}.self_attn.k_proj.weight"])
            assert torch.equal(v, full[f"{layer}.self_attn.v_proj.weight"])


def test_a_rank_reads_only_its_shard_from_the_files(tiny_qwen2, monkeypatch):
    read: list[int] = []
    original = loader.StoredTensor.read

    def counting(self, *args, **kwargs):
        tensor = original(self, *args, **kwargs)
        read.append(tensor.numel())
        return tensor

    monkeypatch.setattr(loader.StoredTensor, "read", counting)
    load_model(tiny_qwen2)
    whole = sum(read)
    read.clear()
    model = load_model(tiny_qwen2, tp=TensorParallelGroup(1, 2))
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    # Half of everything that is split, all of the (tiny) norms, nothing more.
    assert sum(read) == (whole - norms) // 2 + norms
    assert sum(read) == sum(p.numel() for p in model.parameters())
