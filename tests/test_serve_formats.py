"""Serving a policy with a production-like tokenizer (SentencePiece-style pieces, a chat template) over a real
`bentoml serve`: streamed text equals plain text, chat roles reach the template, one context length; and the
streaming decoder alone on characters split across byte-level pieces."""

import json

import httpx
import pytest

from cli_helpers import SMALL, run_cli
from policies import sentencepiece_policy
from serve_helpers import Server, bundle_version

FORCE = {"int8": {"x-policy-variant": "int8", "x-admin-token": "t"}, "fp16": {"x-policy-variant": "fp16", "x-admin-token": "t"}}
CONTEXT = 320  # above the 256 the variants once assumed on their own


@pytest.fixture(scope="module")
def spm(tmp_path_factory, bentoml_home):
    tmp = tmp_path_factory.mktemp("spm")
    policy = sentencepiece_policy(tmp / "policy")
    out = tmp / "bundle"
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), *SMALL,
                  "--set", f"policy.source={policy}", "--set", f"policy.max_seq_len={CONTEXT}",
                  "--set", "gate.enabled=false", "--set", "export.onnx=false", "--set", "calibration.procs=0",
                  "--set", "name=spm")
    assert res.returncode == 0, res.stderr[-3000:]
    env = {"POLICY_BUNDLE_VERSION": bundle_version(out), "POLICY_BUNDLE_STATE_DIR": str(tmp / "state"),
           "POLICY_BUNDLE_ADMIN_TOKEN": "t", "POLICY_BUNDLE_DISABLE_VLLM": "1",
           # these tests are of formats, not of health: on a CI box whose 2 cores three workers keep busy, one health
           # probe past the default 3 s marked the forced variant down and its stream got a 503
           "POLICY_BUNDLE_HEALTH_TIMEOUT_S": "15"}
    server = Server(env, tmp / "server.log").wait_ready()
    yield server, policy
    server.stop()


def stream_text(url, path, body, headers):
    """The concatenated streamed text, the finish reason, the header's variant and whether [DONE] came."""
    text, finish, done = "", None, False
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish = choice["finish_reason"] or finish
        return text, finish, r.headers["x-policy-variant"], done


@pytest.mark.parametrize("variant", ["int8", "fp16"])
def test_streamed_text_equals_plain_text_with_sentencepiece_pieces(spm, variant):
    server, _ = spm
    for prompt in ("the policy answers", "one two three", "yes no maybe words"):
        body = {"model": "policy", "prompt": prompt, "max_tokens": 12, "temperature": 0}
        plain = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": 1}, headers=FORCE[variant],
                           timeout=60).json()
        text, finish, served, done = stream_text(server.url, "/v1/completions", body, FORCE[variant])
        assert served == variant and done and finish == plain["choices"][0]["finish_reason"]
        assert text == plain["choices"][0]["text"] and " " in text.strip()
        # per-token decoding (what streams once did) loses the word boundaries here
        assert "".join(plain["choices"][0]["logprobs"]["tokens"]) != text


def test_chat_roles_go_through_the_tokenizer_chat_template(spm):
    from policy_bundle.bundle.info import encode_chat, encode_text, load_tokenizer

    server, policy = spm
    tok = load_tokenizer(policy)
    messages = [{"role": "system", "content": "answer with numbers"}, {"role": "user", "content": "one two"}]
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=FORCE["int8"], timeout=60,
                   json={"model": "policy", "messages": messages, "max_tokens": 6, "temperature": 0}).json()
    templated = encode_chat(tok, messages)
    assert r["usage"]["prompt_tokens"] == len(templated) != len(encode_text(tok, "answer with numbers\none two"))
    # the same ids sent as raw text through /v1/completions give the same greedy answer
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    raw = httpx.post(f"{server.url}/v1/completions", headers=FORCE["int8"], timeout=60,
                     json={"model": "policy", "prompt": rendered, "max_tokens": 6, "temperature": 0}).json()
    assert raw["usage"]["prompt_tokens"] == len(templated)
    assert raw["choices"][0]["text"] == r["choices"][0]["message"]["content"]
    streamed, _, _, done = stream_text(server.url, "/v1/chat/completions",
                                       {"model": "policy", "messages": messages, "max_tokens": 6, "temperature": 0},
                                       FORCE["int8"])
    assert done and streamed == r["choices"][0]["message"]["content"]


@pytest.mark.parametrize("variant", ["int8", "fp16"])
def test_one_context_length_for_the_router_and_both_variants(spm, variant):
    """A prompt the router accepts fits every variant: the bundle's context (here 320), not a variant default."""
    server, _ = spm
    status = httpx.get(f"{server.url}/status", timeout=30).json()
    assert status["context_tokens"] == CONTEXT
    assert status["variants"][variant]["max_seq_len"] == CONTEXT
    words = " ".join(["one"] * 60)  # 60 prompt tokens
    fits = httpx.post(f"{server.url}/v1/completions", headers=FORCE[variant], timeout=120,
                      json={"model": "policy", "prompt": " ".join([words] * 4) + " two", "max_tokens": 79,
                            "temperature": 0})
    assert fits.status_code == 200, fits.text  # 241 + 79 = 320 tokens
    over = httpx.post(f"{server.url}/v1/completions", headers=FORCE[variant], timeout=60,
                      json={"model": "policy", "prompt": " ".join([words] * 4) + " two", "max_tokens": 80})
    err = over.json()["error"]  # max_tokens' own limit: what the context leaves after this prompt
    assert over.status_code == 400 and err["param"] == "max_tokens" and err["limit"] == 79
    assert f"the context ({CONTEXT})" in err["message"]


def byte_level_tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    core = ByteLevelBPETokenizer()
    core.train_from_iterator(["plain ascii words and spaces", "more words"] * 20, vocab_size=300, min_frequency=1)
    return PreTrainedTokenizerFast(tokenizer_object=core._tokenizer)


def sentencepiece_byte_fallback_tokenizer():
    """A SentencePiece BPE as Llama's tokenizer.json writes one: ``\u2581`` for spaces, and a character outside the
    vocabulary as its UTF-8 bytes, one ``<0xNN>`` token each (byte fallback): é is 2 tokens, 日 3, 🙂 4."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(["plain ascii words and spaces, the policy answers", "more words"] * 20,
                                trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"]))
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for i in range(256):  # the byte tokens are ordinary vocabulary, as in Llama's (not special: decode keeps them)
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    core = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    core.normalizer = normalizer
    core.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


TOKENIZERS = {"byte-level": byte_level_tokenizer, "sentencepiece-byte-fallback": sentencepiece_byte_fallback_tokenizer}


@pytest.mark.parametrize("make", TOKENIZERS)
@pytest.mark.parametrize("stop", [[], ["caf"], ["é"], ["🙂 ok"]])
def test_text_stream_equals_one_decode_for_split_utf8(stop, make):
    from policy_bundle.quantize.runtime.text import ids_to_text
    from policy_bundle.serve.router.openai_api import TextStream

    tok = TOKENIZERS[make]()
    text = "naïve café 日本語 🙂 ok and plain words"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)  # pieces split characters
    stream = TextStream(tok, stop)
    pieces = []
    for i in ids:
        pieces.append(stream.push(i))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    whole = ids_to_text(tok, ids)
    expected = whole[:min([whole.find(s) for s in stop if s in whole] or [len(whole)])]
    assert "".join(pieces) == expected and all("\ufffd" not in p for p in pieces)


def test_the_build_gate_scores_the_text_the_service_returns():
    from policy_bundle.build.config.build_config import load_config
    from policy_bundle.build.gate.measure import fidelity_kwargs
    from policy_bundle.quantize.runtime.text import ids_to_text

    tok = byte_level_tokenizer()
    # a tokenizer whose own decode drops the space before "." (a BPE one only with the second switch)
    tok.clean_up_tokenization_spaces = True
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = tok("words . and spaces")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "words. and spaces"  # what the gate once scored
    assert fidelity_kwargs(load_config(None), tok)["decode"](ids) == ids_to_text(tok, ids) == "words . and spaces"


@pytest.mark.parametrize("make", ["byte-level", "sentencepiece", "sentencepiece-byte-fallback"])
def test_a_long_stream_is_decoded_incrementally_and_adds_up_to_the_whole_decode(make, tmp_path):
    """The stream re-decoded the whole sequence at every token (quadratic in the answer's length); it now decodes
    each token once (tokenizers' DecodeStream) and still adds up to one decode of everything, cut characters too."""
    from policy_bundle.quantize.runtime.text import ids_to_text
    from policy_bundle.serve.router.openai_api import TextStream

    if make in TOKENIZERS:
        tok = TOKENIZERS[make]()
        text = " ".join(["naïve café 日本語 🙂 ok and plain words"] * 120)
    else:
        from policy_bundle.bundle.info import load_tokenizer

        tok = load_tokenizer(sentencepiece_policy(tmp_path / "spm"))
        text = " ".join(["the policy answers every question with a short plain sentence"] * 200)
    ids = tok(text, add_special_tokens=False)["input_ids"][:2000]
    assert len(ids) >= 1500
    stream = TextStream(tok, ["no such stop"])
    assert stream._stream is not None  # the incremental path, not the whole-decode fallback
    pieces = [stream.push(i) for i in ids] + [stream.finish()]
    assert "".join(pieces) == ids_to_text(tok, ids)
    # the shortest prefix that ends inside a character (the word-level SentencePiece splits none: all of it)
    cut = ids if make == "sentencepiece" else \
        next(ids[:n] for n in range(1, len(ids)) if ids_to_text(tok, ids[:n]).endswith("\ufffd"))
    tail = TextStream(tok, [])
    assert "".join([tail.push(i) for i in cut] + [tail.finish()]) == ids_to_text(tok, cut)
