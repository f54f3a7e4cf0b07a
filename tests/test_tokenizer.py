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


def test_only_a_model_specific_tokenizer_class_goes_through_the_auto_mappings(reference_dir, tmp_path):
    generic = subprocess.run([sys.executable, "-c", PROBE, str(reference_dir)], capture_output=True, text=True)
    assert generic.returncode == 0 and generic.stdout.split() == ["TokenizersBackend", "False"], generic.stderr[-2000:]
    named = tmp_path / "named"  # the same files, naming a model-specific class: AutoTokenizer resolves it
    shutil.copytree(reference_dir, named)
    config = json.loads((named / "tokenizer_config.json").read_text())
    (named / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    assert subprocess.run([sys.executable, "-c", PROBE, str(named)], capture_output=True, text=True).stdout.split()[1] \
        == "False"
    (named / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    auto = subprocess.run([sys.executable, "-c", PROBE, str(named)], capture_output=True, text=True)
    assert auto.returncode == 0 and auto.stdout.split()[1] == "True", auto.stderr[-2000:]
