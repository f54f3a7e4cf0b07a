"""The embedded reference policy: a tiny Llama trained (seeded) on the addition task.

Trained in about two minutes on 2 CPU cores, saved as an FP32 HF directory (config, safetensors,
tokenizer, generation_config) so the rest of the pipeline treats it like any other policy path. The
trained directory ships with the package (``trained/``, 3 MB): every machine gets the same weights
without training, and it is retrained (``python -m policy_bundle.quantize.reference.embedded --ship``) only when what
training depends on changes (``cache_key``); a changed key falls back to training into the cache.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from policy_bundle.quantize.reference import task
from policy_bundle.quantize.runtime.decode import greedy_generate
from policy_bundle.quantize.model.policy import Policy, PolicyConfig, full_logits
from policy_bundle.quantize.model.hf_weights import save_hf_weights
from policy_bundle.quantize.runtime.text import ids_to_text


@dataclass(frozen=True)
class TrainConfig:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # GQA, as in the Llama/Qwen policies we serve
    intermediate_size: int = 352
    max_seq_len: int = 32
    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-3
    max_digits: int = 3
    seed: int = 0
    threads: int = 2


def reference_config(tc: TrainConfig) -> PolicyConfig:
    return PolicyConfig(
        family="llama",
        vocab_size=len(task.VOCAB),
        dim=tc.dim,
        n_layers=tc.n_layers,
        n_heads=tc.n_heads,
        n_kv_heads=tc.n_kv_heads,
        head_dim=tc.dim // tc.n_heads,
        intermediate_size=tc.intermediate_size,
        max_seq_len=tc.max_seq_len,
        norm_eps=1e-5,
        tie_embeddings=False,
        bos_token_id=task.VOCAB.index(task.BOS),
        eos_token_id=task.VOCAB.index(task.EOS),
        pad_token_id=task.VOCAB.index(task.PAD),
    )


def default_cache_dir() -> Path:
    root = os.environ.get("POLICY_BUNDLE_CACHE") or Path.home() / ".cache" / "policy-bundle"
    return Path(root)


SHIPPED = Path(__file__).resolve().parent / "trained"


def cache_key(tc: TrainConfig) -> str:
    """What the trained weights depend on: the task, the training code and its config (not this module's other
    functions, so editing them keeps the shipped weights valid)."""
    src = "".join(inspect.getsource(f) for f in (TrainConfig, reference_config, _batch, train_reference)).encode()
    src += Path(task.__file__).read_bytes() + json.dumps(asdict(tc)).encode()
    return hashlib.sha256(src).hexdigest()[:12]


def shipped_policy(tc: TrainConfig) -> Optional[Path]:
    """The packaged reference policy when it was trained by this code and config."""
    meta = SHIPPED / "reference.json"
    if meta.is_file() and json.loads(meta.read_text()).get("key") == cache_key(tc):
        return SHIPPED
    return None


def _batch(items: List[task.TaskItem], tok) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] and a loss mask that is 1 on answer tokens and the EOS only."""
    seqs, masks = [], []
    for it in items:
        p = tok(it.prompt)["input_ids"]
        a = tok(it.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    t = max(map(len, seqs))
    ids = torch.full((len(seqs), t), tok.pad_token_id)
    mask = torch.zeros(len(seqs), t)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def evaluate_accuracy(policy, tok, items: List[task.TaskItem], max_new_tokens: int = 6) -> float:
    """Exact-match task reward of greedy completions, averaged over ``items``."""
    total = 0.0
    for it in items:
        out = greedy_generate(policy, tok(it.prompt)["input_ids"], max_new_tokens, tok.eos_token_id)
        total += task.reward(it.prompt, ids_to_text(tok, out))
    return total / len(items)


def train_reference(tc: TrainConfig, progress: Optional[Callable[[int, int, float], None]] = None) -> Policy:
    torch.manual_seed(tc.seed)
    torch.set_num_threads(tc.threads)
    rng = random.Random(tc.seed)
    golden = frozenset(i.prompt for i in task.golden_set(1000))
    tok = task.build_tokenizer()
    policy = Policy(reference_config(tc)).train()
    opt = torch.optim.AdamW(policy.parameters(), lr=tc.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=tc.lr, total_steps=tc.steps, pct_start=0.1)
    for step in range(tc.steps):
        items = []
        while len(items) < tc.batch_size:
            it = task.make_item(rng, tc.max_digits)
            if it.prompt not in golden:
                items.append(it)
        ids, mask = _batch(items, tok)
        logits = full_logits(policy, ids[:, :-1])
        loss_tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        loss = (loss_tok * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress:
            progress(step + 1, tc.steps, float(loss.detach()))
    return policy.eval()


def write_policy_dir(policy: Policy, cfg: PolicyConfig, out: Path, dtype: torch.dtype = torch.float32) -> None:
    save_hf_weights(policy, cfg, out, dtype)
    task.save_tokenizer(out)
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
           "do_sample": False, "max_new_tokens": 8}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def ensure_reference_policy(
    cache_dir: Optional[Path] = None, tc: TrainConfig = TrainConfig(), log: Callable[[str], None] = print
) -> Path:
    """Path of the cached reference policy, training it first if this machine has none yet."""
    out = (cache_dir or default_cache_dir()) / f"reference-{cache_key(tc)}"
    if (out / "config.json").is_file():
        return out
    if cache_dir is None and shipped_policy(tc) is not None:
        return SHIPPED
    from tqdm import tqdm

    log(f"[reference] training the reference policy ({tc.steps} steps) into {out}")
    t0 = time.monotonic()
    bar = tqdm(total=tc.steps, desc="train", unit="step", disable=None)

    def tick(step: int, total: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    policy = train_reference(tc, tick)
    bar.close()
    tok = task.build_tokenizer()
    acc = evaluate_accuracy(policy, tok, task.golden_set(200))
    log(f"[reference] trained in {time.monotonic() - t0:.1f}s, held-out exact match {acc:.1%}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".reference-", dir=out.parent))
    write_policy_dir(policy, reference_config(tc), tmp)
    (tmp / "reference.json").write_text(json.dumps({"key": cache_key(tc), "train": asdict(tc),
                                                    "golden_accuracy": acc}, indent=2))
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ship(tc: TrainConfig = TrainConfig()) -> Path:
    """Train into a fresh cache and copy the result into the package (``quantize/reference/trained/``)."""
    trained = ensure_reference_policy(Path(tempfile.mkdtemp(prefix="reference-ship-")), tc)
    shutil.rmtree(SHIPPED, ignore_errors=True)
    shutil.copytree(trained, SHIPPED)
    return SHIPPED


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--ship"]:
        raise SystemExit("usage: python -m policy_bundle.quantize.reference.embedded --ship")
    print(f"reference policy shipped at {ship()}")
