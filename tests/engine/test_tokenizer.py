"""`load_tokenizer`: the same tokenizer `AutoTokenizer` gives, without its imports where it can."""

import json
import shutil
import subprocess
import sys

import pytest
import transformers
from packaging.version import Version
from transformers import AutoTokenizer

from berth.engine.tokenizer import load_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, ça va? 日本"}]
TEXTS = ["Hello world", "  two  spaces\nand a line", "ça va? 日本語 🙂", ""]


def assert_same_tokenizer(ours, reference) -> None:
    assert type(ours) is type(reference)
    assert len(ours) == len(reference)
    assert ours.all_special_ids == reference.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.pad_token_id,
    )
    for text in TEXTS:
        assert ours(text)["input_ids"] == reference(text)["input_ids"]
    if reference.chat_template:
        assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == (
            reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        )


@pytest.mark.parametrize("model", ["tiny_model", "smollm2"])
def test_a_generic_tokenizer_is_the_one_auto_tokenizer_loads(model, request):
    path = request.getfixturevalue(model)
    reference = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert_same_tokenizer(load_tokenizer(path), reference)


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.18"),
    reason="transformers 5.17's tokenizer module imports torch itself (the floor: pyproject.toml)",
)
def test_a_generic_tokenizer_loads_without_torch(smollm2):
    # AutoTokenizer imports torch and every model config: seconds on each server's start.
    script = (
        "import sys; from berth.engine.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(smollm2)!r}); assert t('Hi')['input_ids']; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_checkpoint_naming_no_generic_class_goes_through_auto_tokenizer(tiny_model, tmp_path):
    folder = tmp_path / "unnamed"
    shutil.copytree(tiny_model, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["tokenizer_class"]
    config_file.write_text(json.dumps(config))
    assert_same_tokenizer(load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)))


def test_a_folder_without_a_tokenizer_says_so(tmp_path):
    with pytest.raises((OSError, ValueError), match="tokenizer"):
        load_tokenizer(tmp_path)
