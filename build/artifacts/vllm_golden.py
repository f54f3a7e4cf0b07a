"""vLLM on an HF directory over the golden set, in a process of its own (JSON request in, JSON result out).

    python -m policy_bundle.build.artifacts.vllm_golden REQUEST.json RESULT.json

Greedy completions of the golden prompts, and the teacher-forced top-k prompt logprobs of each
prompt + reference completion (what the gate's top-1 and KL are computed from). A process of its
own: vLLM starts its engine processes and threads, and a failure to load is an exit code and a
last line, not a crashed build.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

from policy_bundle.quantize.vllm_launch import apply_vllm_env_defaults, offline_llm


@dataclass(frozen=True)
class VllmGoldenRequest:
    model: str
    dtype: str
    max_model_len: int
    max_new_tokens: int
    top_k: int  # prompt logprobs per position (exact distributions when >= the vocabulary)
    prompts: List[List[int]]
    sequences: List[List[int]]  # prompt + reference completion, teacher-forced


@dataclass(frozen=True)
class VllmGoldenResult:
    vllm: str
    load_s: float
    completions: List[List[int]]
    prompt_logprobs: List[List[Optional[Dict[str, float]]]]  # per sequence, per position: token -> logprob


class VllmRunError(RuntimeError):
    """vLLM could not load or run the directory; the message is its last error line."""


def run_in_process(req: VllmGoldenRequest) -> VllmGoldenResult:
    apply_vllm_env_defaults()
    import vllm
    from vllm import SamplingParams

    t0 = time.monotonic()
    llm = offline_llm(req.model, req.dtype, req.max_model_len, max_logprobs=req.top_k)
    load_s = time.monotonic() - t0
    greedy = llm.generate([{"prompt_token_ids": p} for p in req.prompts],
                          SamplingParams(temperature=0.0, max_tokens=req.max_new_tokens), use_tqdm=False)
    forced = llm.generate([{"prompt_token_ids": s} for s in req.sequences],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=req.top_k), use_tqdm=False)
    logprobs = [[None if d is None else {str(t): float(lp.logprob) for t, lp in d.items()} for d in o.prompt_logprobs]
                for o in forced]
    return VllmGoldenResult(vllm.__version__, round(load_s, 2), [list(o.outputs[0].token_ids) for o in greedy], logprobs)


def last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return (errors or lines or ["no output"])[-1][:400]


def run_vllm_golden(req: VllmGoldenRequest, timeout_s: float = 900.0) -> VllmGoldenResult:
    """``run_in_process`` in a fresh Python process; VllmRunError with vLLM's last error line on failure."""
    with tempfile.TemporaryDirectory(prefix="vllm-golden-") as tmp:
        req_path, out_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req_path.write_text(json.dumps(asdict(req)))
        cmd = [sys.executable, "-m", "policy_bundle.build.artifacts.vllm_golden", str(req_path), str(out_path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise VllmRunError(f"vLLM did not finish the golden set in {timeout_s:.0f}s") from None
        if proc.returncode != 0 or not out_path.is_file():
            raise VllmRunError(last_error_line(proc.stderr + proc.stdout))
        return VllmGoldenResult(**json.loads(out_path.read_text()))


if __name__ == "__main__":
    request = VllmGoldenRequest(**json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(asdict(run_in_process(request))))
