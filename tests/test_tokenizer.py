"""The bundle's tokenizer loader: a generic tokenizer (tokenizer.json, no model-specific class) loads as the class
AutoTokenizer would pick, without importing transformers' auto mappings (3.4 s of every router start)."""

import json
import shutil
import subprocess
import sys

from policy_bundle.bundle.info import encode_chat, load_tokenizer

TEXTS = ["358+64=", "Explain what an API is to a non-programmer.", " leading space, \u00e9 and \u4e2d"]
PROBE = ("import sys; from policy_bundle.bundle.info import load_tokenizer; t = load_tokenizer(sys.argv[1]); "
         "print(type(t).__name__, 'transformers.models.auto.tokenization_auto' in sys.modules)")


def test_a_generic_tokenizer_encodes_and_decodes_as_autotokenizer_does(reference_dir):
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(reference_dir), AutoTokenizer.from_pretrained(str(reference_dir), local_files_only=True)
    assert type(ours) is type(auto)
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == auto(text)["input_ids"] and ours.decode(ids) == auto.decode(ids)
    chat = [{"role": "user", "content": TEXTS[1]}]
    assert encode_chat(ours, chat) == encode_chat(auto, chat)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.bos_token_id,
                                                                         auto.pad_token_id)


def probe(path):
    res = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    name, auto_imported = res.stdout.split()
    return name, auto_imported == "True"


def edited_copy(reference_dir, dest, **fields):
    """The reference tokenizer and config with ``fields`` set (tokenizer_class in one file, model_type in the other)."""
    shutil.copytree(reference_dir, dest)
    for name, key in (("tokenizer_config.json", "tokenizer_class"), ("config.json", "model_type")):
        if key in fields:
            data = json.loads((dest / name).read_text())
            (dest / name).write_text(json.dumps({**data, key: fields[key]}))
    return dest


def test_only_a_generic_class_of_a_llama_model_skips_the_auto_mappings(reference_dir, tmp_path):
    from transformers import AutoTokenizer

    assert probe(reference_dir) == ("TokenizersBackend", False)
    fast = edited_copy(reference_dir, tmp_path / "fast", tokenizer_class="PreTrainedTokenizerFast")
    assert probe(fast) == ("TokenizersBackend", False)
    # a model type AutoTokenizer remaps (qwen2: Qwen2Tokenizer, other ids; so would a model-specific class) goes
    # through AutoTokenizer and gets what it picks
    qwen2 = edited_copy(reference_dir, tmp_path / "qwen2", model_type="qwen2")
    auto = AutoTokenizer.from_pretrained(str(qwen2), local_files_only=True)
    assert type(auto).__name__ != "TokenizersBackend"  # the remap this guards against is real
    assert probe(qwen2) == (type(auto).__name__, True)
    ours = load_tokenizer(qwen2)
    assert type(ours) is type(auto) and all(ours(t)["input_ids"] == auto(t)["input_ids"] for t in TEXTS)
