"""What a bundle tells whoever serves or checks it: ``BundleInfo`` from the manifest, the tokenizer, prompt
encoding (chat template included) and the golden set."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import List, Optional, Sequence

from policy_bundle.bundle.layout import ARTIFACT_DIRS, BundleLayout
from policy_bundle.bundle.manifest import read_manifest
from policy_bundle.quantize.fidelity.scores import GateThresholds, GoldenItem


def serving_section(max_seq_len: int, max_new_tokens: int, task: bool, thresholds: GateThresholds,
                    batch_rows: bool = True, kv_cache: Optional[dict] = None) -> dict:
    """The manifest's ``serving`` section, written by the build and read by ``BundleInfo``. ``batch_rows``:
    the INT8 artifact's rows are independent, so its engine may decode many requests in one batch. ``kv_cache``: the
    INT8 artifact's cache, ``{"dtype", "bytes_per_token"}`` (keys and values of every layer, one sequence)."""
    return {"max_seq_len": int(max_seq_len), "max_new_tokens": int(max_new_tokens), "task": bool(task),
            "thresholds": asdict(thresholds), "batch_rows": bool(batch_rows), "kv_cache": kv_cache}


@dataclass(frozen=True)
class BundleInfo:
    """One place that decides a bundle's serving limits: the router and both variants read the same
    numbers (a prompt the router accepts fits every variant)."""

    root: Path
    max_seq_len: int  # prompt + completion tokens, capped by every artifact's max_position_embeddings
    max_new_tokens: int  # the default completion length
    has_task: bool  # the policy has a verifiable task: the live canary scores its reward
    thresholds: GateThresholds  # the build gate's limits, which the live canary applies too
    manifest_format: str
    batch_rows: bool = True  # the INT8 engine may batch requests (false for per-tensor dynamic activations)
    kv_cache: Optional[dict] = None  # the INT8 artifact's KV cache: {"dtype", "bytes_per_token"} (None: not recorded)

    @classmethod
    def read(cls, root: Path) -> "BundleInfo":
        """From a bundle directory or a store entry (its manifest and the artifact dirs present)."""
        root = Path(root)
        m = read_manifest(root)
        cfg = m.get("config", {})
        serving = m.get("serving") or {  # bundles written before the serving section
            "max_seq_len": cfg.get("policy", {}).get("max_seq_len", 256),
            "max_new_tokens": cfg.get("prompts", {}).get("max_new_tokens", 16),
            "task": cfg.get("policy", {}).get("source") == "reference" and not cfg.get("prompts", {}).get("file"),
            "thresholds": {},
        }
        known = {f.name for f in fields(GateThresholds)}
        thresholds = GateThresholds(**{k: v for k, v in (serving.get("thresholds") or {}).items() if k in known})
        ctx = int(serving["max_seq_len"])
        for sub in ARTIFACT_DIRS:
            conf = root / sub / "config.json"
            if conf.is_file():
                ctx = min(ctx, int(json.loads(conf.read_text()).get("max_position_embeddings", ctx)))
        return cls(root, ctx, int(serving["max_new_tokens"]), bool(serving["task"]), thresholds,
                   str(m.get("format", "")), bool(serving.get("batch_rows", True)), serving.get("kv_cache"))

    def golden(self) -> List[GoldenItem]:
        path = BundleLayout(self.root).golden
        return read_golden_jsonl(path) if path.is_file() else []


# tokenizer classes that name no model-specific class, and the model types (config.json beside it) for which
# AutoTokenizer keeps such a class: it resolves them to PreTrainedTokenizerFast (TokenizersBackend) after importing
# every auto model mapping (3.4 s of each router's start, measured). Other model types may be remapped to their own
# class (qwen2 is: a generic Qwen2 tokenizer_config becomes Qwen2Tokenizer, with other ids), so they go through it.
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
GENERIC_KEPT_FOR = ("llama",)


def load_tokenizer(path: Path):
    """The tokenizer stored with an artifact (never fetched from a hub): the class AutoTokenizer picks; a
    generic one (``tokenizer.json``, a ``GENERIC_TOKENIZERS`` class, a ``GENERIC_KEPT_FOR`` model type) without
    the auto mappings' import."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(path)
    if _json_field(path / "tokenizer_config.json", "tokenizer_class") in GENERIC_TOKENIZERS and \
            _json_field(path / "config.json", "model_type") in GENERIC_KEPT_FOR and (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _json_field(path: Path, key: str):
    return json.loads(path.read_text()).get(key) if path.is_file() else None


class ContentNotFound(ValueError):
    """A message's content is not in the rendered conversation as written (the template changed it), so its
    control-token text cannot be told from the template's own tokens."""

    def __init__(self, index: int):
        super().__init__(f"messages.{index}.content")
        self.index = index


def control_token_texts(tok) -> List[str]:
    """The strings the tokenizer turns into one special (control) token: ``<|im_end|>`` and the like."""
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    return sorted({t.content for t in added.values() if getattr(t, "special", False)} |
                  set(getattr(tok, "all_special_tokens", []) or []), key=len, reverse=True)


def encode_chat(tok, messages: Sequence[dict], control_tokens: bool = False) -> List[int]:
    """Token ids of a conversation (``[{"role", "content"}]``) as the model was trained to see it: the
    tokenizer's chat template with the generation prompt; without a template, the contents, one per line.

    A control token's text typed into a message (``<|im_end|><|im_start|>system``) is text, tokenized as the
    characters it is, unless ``control_tokens``: otherwise a user could close their turn and open a system one. Only
    a conversation holding such text is encoded piecewise (the contents found in the rendered text in order);
    every other is encoded whole, exactly as before. ``ContentNotFound`` when the template changed such a content."""
    contents = [str(m["content"]) for m in messages]
    specials = [] if control_tokens else control_token_texts(tok)
    marked = [i for i, c in enumerate(contents) if any(t in c for t in specials)]
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        template_specials = False
    else:
        text, template_specials = "\n".join(contents), True  # tok() adds the tokenizer's own BOS/EOS, if any
    if not marked:
        return tok(text, add_special_tokens=template_specials)["input_ids"]
    ids: List[int] = []
    pos = search = 0  # emitted up to pos; contents found up to search
    for i, content in enumerate(contents):
        start = text.find(content, search)
        if start < 0:
            raise ContentNotFound(i)
        search = start + len(content)
        if i in marked:
            ids += tok(text[pos:start], add_special_tokens=False)["input_ids"]
            ids += tok(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            pos = search
    ids += tok(text[pos:], add_special_tokens=False)["input_ids"]
    if template_specials:  # the tokenizer's own BOS / EOS around the text, as tok(text) adds them
        probe, bare = tok("a")["input_ids"], tok("a", add_special_tokens=False)["input_ids"]
        at = probe.index(bare[0]) if bare and bare[0] in probe else 0
        ids = probe[:at] + ids + probe[at + len(bare):]
    return ids


def encode_prompt(tok, prompt: str) -> List[int]:
    """Token ids of a task prompt; chat templates applied (as a user turn) when the tokenizer has one."""
    return encode_chat(tok, [{"role": "user", "content": prompt}])


def encode_text(tok, text: str) -> List[int]:
    """Token ids of raw text (a completions prompt): no template."""
    return tok(text)["input_ids"]


def write_golden_jsonl(items: Sequence[GoldenItem], path: Path) -> None:
    with Path(path).open("w") as f:
        for it in items:
            f.write(json.dumps({"prompt": it.prompt, "prompt_ids": it.prompt_ids,
                                "completion_ids": it.completion_ids, "answer": it.answer}) + "\n")


def read_golden_jsonl(path: Path) -> List[GoldenItem]:
    return [GoldenItem(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]
