"""Small real policies for serving tests: random weights, but a real tokenizer pipeline that behaves like
production ones (SentencePiece-style word pieces whose per-token decode loses the spaces, a chat template)."""

from __future__ import annotations

from pathlib import Path

WORDS = ("the policy answers every question with a short plain sentence about numbers and words it has seen "
         "before : system user assistant one two three four five six seven eight nine ten yes no maybe").split()
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


def sentencepiece_policy(out: Path, max_positions: int = 512) -> Path:
    """A 2-layer Llama with random weights and a Metaspace word-level tokenizer with a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    out = Path(out)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in dict.fromkeys(WORDS):
        vocab[f"\u2581{w}"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    core.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(str(out))
    return out
