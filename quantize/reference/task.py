"""The reference task: multi-digit addition with an exact-match reward.

A verifiable task gives canaries a real task reward, not only a logit distance. Every number is
written least-significant digit first (the "reversed addition" format: each answer digit then
depends only on digits already seen and one carry, so a few-million-parameter model learns it in a
minute on a CPU). 853 + 46 = 899 is the prompt ``"358+64="`` and the completion ``"998"``, then
EOS. The tokenizer is character-level and saved in HF format so transformers and vLLM load it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import List

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHARS = list("0123456789+=")
VOCAB = [PAD, BOS, EOS] + CHARS


@dataclass(frozen=True)
class TaskItem:
    prompt: str
    answer: str


def make_item(rng: random.Random, max_digits: int) -> TaskItem:
    a = rng.randrange(10 ** rng.randint(1, max_digits))
    b = rng.randrange(10 ** rng.randint(1, max_digits))
    return TaskItem(prompt=f"{_rev(a)}+{_rev(b)}=", answer=_rev(a + b))


def _rev(n: int) -> str:
    return str(n)[::-1]


def make_items(seed: int, n: int, max_digits: int = 3, exclude: frozenset[str] = frozenset()) -> List[TaskItem]:
    """``n`` distinct items drawn with ``seed``, none of whose prompts is in ``exclude``."""
    rng = random.Random(seed)
    seen: set[str] = set(exclude)
    items: List[TaskItem] = []
    while len(items) < n:
        item = make_item(rng, max_digits)
        if item.prompt not in seen:
            seen.add(item.prompt)
            items.append(item)
    return items


# Disjoint splits with fixed seeds: the golden set never overlaps rollouts or training prompts.
GOLDEN_SEED, PROMPT_SEED = 1001, 2002


def golden_set(n: int = 200) -> List[TaskItem]:
    return make_items(GOLDEN_SEED, n)


def rollout_prompts(n: int) -> List[str]:
    golden = frozenset(i.prompt for i in golden_set(1000))
    return [i.prompt for i in make_items(PROMPT_SEED, n, exclude=golden)]


def reward(prompt: str, completion: str) -> float:
    """Exact-match reward: 1.0 when the completion (stripped) is the correct reversed sum, else 0.0."""
    try:
        a, b = prompt.rstrip("=").split("+")
        return 1.0 if completion.strip() == _rev(int(a[::-1]) + int(b[::-1])) else 0.0
    except ValueError:
        return 0.0


def is_task_prompt(prompt: str) -> bool:
    head, _, tail = prompt.partition("+")
    return bool(head.isdigit() and tail.endswith("=") and tail[:-1].isdigit())


def build_tokenizer():
    """Character-level fast tokenizer (BOS prepended, EOS as end of completion)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, VOCAB.index(BOS))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=PAD, model_max_length=64
    )


def save_tokenizer(out: Path) -> None:
    build_tokenizer().save_pretrained(str(out))
