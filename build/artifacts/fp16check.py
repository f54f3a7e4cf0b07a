"""Check the bundle's FP16 HF directory the way its consumers load it: transformers or vLLM.

Greedy completions of the golden prompts are compared with the FP32 policy's (stored in
golden.jsonl at build time); the bundle is fit to serve when they agree on >= ``min_agreement``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

from policy_bundle.bundle.info import read_golden_jsonl
from policy_bundle.bundle.layout import FP16_DIR, BundleLayout
from policy_bundle.bundle.manifest import read_manifest, verify_files
from policy_bundle.quantize.runtime.vllm_launch import offline_engine


@dataclass(frozen=True)
class Fp16Check:
    engine: str
    items: int
    greedy_agreement: float


def trim_at_eos(ids: List[int], eos: Optional[int]) -> List[int]:
    return ids[: ids.index(eos) + 1] if eos is not None and eos in ids else ids


def transformers_completions(fp16_dir: Path, prompts: List[List[int]], max_new: int, eos: Optional[int]) -> List[List[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(fp16_dir), dtype=torch.float16, local_files_only=True).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                               eos_token_id=eos, pad_token_id=eos)
            outs.append(trim_at_eos(y[0, len(ids):].tolist(), eos))
    return outs


def vllm_completions(fp16_dir: Path, prompts: List[List[int]], max_new: int, eos: Optional[int]) -> List[List[int]]:
    with offline_engine(fp16_dir, "float16") as llm:  # the environment defaults set, vllm imported
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_new)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [trim_at_eos(list(o.outputs[0].token_ids), eos) for o in outs]


def check_fp16(bundle: Path, engine: str = "transformers") -> Fp16Check:
    layout = BundleLayout(bundle)
    manifest = read_manifest(layout.root)
    verify_files(layout.root, manifest, subdir=FP16_DIR)
    golden = read_golden_jsonl(layout.golden)
    max_new = manifest["config"]["prompts"]["max_new_tokens"]
    eos = manifest["policy"]["config"].get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    prompts = [g.prompt_ids for g in golden]
    run = vllm_completions if engine == "vllm" else transformers_completions
    outs = run(layout.fp16_dir, prompts, max_new, eos)
    same = sum(trim_at_eos(g.completion_ids, eos) == o for g, o in zip(golden, outs))
    return Fp16Check(engine, len(golden), same / max(1, len(golden)))
