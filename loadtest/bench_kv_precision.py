"""What the KV cache's dtype costs in fidelity, apart from any int8 weight: the FP32 policy teacher-forced on a bundle's
golden items (prompt + completion, the gate's tokens) with a bfloat16 cache, attended three ways, against the same
policy with a float32 cache: next-token top-1 agreement and mean KL over the completions' positions; and a float16
cache (the same bytes as bfloat16, three more mantissa bits) under the fused kernel.

- ``fused``: what the engine runs on AVX2 and AMX CPUs and for every prompt chunk (PyTorch's fused attention in
  bfloat16: the queries rounded to it);
- ``products``: oneDNN's bfloat16 products (``blocks.attend_narrow`` native: queries and scores rounded), a decode
  step's kernel on AVX-512 BF16 CPUs without AMX;
- ``float32 queries``: the bfloat16 cache widened and attended in float32 (only the cache's own rounding left; not a
  served kernel: what rounding the queries costs).

    .venv/bin/python -m policy_bundle.loadtest.bench_kv_precision --bundle BUNDLE --source FP32_DIR [--items 80]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True, help="a built bundle: its golden.jsonl")
    ap.add_argument("--source", type=Path, required=True, help="the bundle's FP32 source directory")
    ap.add_argument("--items", type=int, default=0, help="the last N golden items (the held-out ones); 0: all")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from policy_bundle.quantize.model import blocks
    from policy_bundle.quantize.model.hf_weights import load_policy
    from policy_bundle.quantize.model.policy import set_kv_cache

    items = [json.loads(line) for line in (args.bundle / "golden.jsonl").read_text().splitlines() if line.strip()]
    items = items[-args.items:] if args.items else items
    policy = load_policy(args.source)
    served = blocks.attend
    kernels = {
        "fused": served,
        "products": lambda q, k, v, mask, decode: blocks.attend_narrow(q, k, v, mask, True),
        "float32 queries": lambda q, k, v, mask, decode: F.scaled_dot_product_attention(q, k.float(), v.float(),
                                                                                        attn_mask=mask),
    }

    def logits(kv: str, kernel) -> torch.Tensor:
        set_kv_cache(policy, kv)
        blocks.attend = kernel
        out = []
        try:
            with torch.no_grad():
                for it in items:
                    ids = it["prompt_ids"] + it["completion_ids"]
                    k, v = policy.new_cache(1, len(ids))
                    out.append(policy.forward(torch.tensor([ids]), 0, k, v)[0, len(it["prompt_ids"]) - 1:-1].float())
        finally:
            blocks.attend = served
        return torch.cat(out)

    ref = logits("float32", served)
    print(f"{args.source.name}, {len(items)} golden items of {args.bundle}, {ref.shape[0]} tokens "
          f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    print("| cache | attended with | top-1 vs float32 cache | KL mean |")
    print("|---|---|---|---|")
    rows = [("bfloat16", name, kernel) for name, kernel in kernels.items()] + [("float16", "fused", served)]
    for kv, name, kernel in rows:
        x = logits(kv, kernel)
        top1 = (x.argmax(-1) == ref.argmax(-1)).float().mean().item()
        kl = F.kl_div(x.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean().item()
        print(f"| {kv} | {name} | {top1:.4f} | {kl:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
