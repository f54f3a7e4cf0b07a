"""vLLM on an HF directory over the golden set, in a process of its own (JSON request in, JSON result out).

    python -m policy_bundle.build.artifacts.vllm_golden REQUEST.json RESULT.json PARENT_PID

(it imports vLLM first, then waits for REQUEST.json to appear: see ``VllmGoldenRun``)

Greedy completions of the golden prompts, and the teacher-forced top-k prompt logprobs of each
prompt + reference completion (what the gate's top-1 and KL are computed from). A process of its
own: vLLM starts its engine processes and threads, and a failure to load is an exit code and a
last line, not a crashed build.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

from policy_bundle.quantize.runtime.vllm_launch import apply_vllm_env_defaults, offline_llm


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


class VllmGoldenRun:
    """``run_in_process`` in a fresh Python process that starts at once and imports vLLM while its request is not
    there yet: the build starts one when it begins and ``submit``s the request once int8-vllm/ is written, then
    goes on with its other exports and reads ``result`` last. vLLM's imports and engine start (about 25 s on the
    reference policy, 2 cores) so overlap the build's other stages instead of being waited out. ``close`` stops
    it; the process also quits by itself (removing its work folder) whenever its parent is gone: a build killed
    with no chance to close it does not leave vLLM running the golden set."""

    def __init__(self, timeout_s: float = 900.0) -> None:
        self.timeout_s, self._deadline = timeout_s, None
        self.request: Optional[VllmGoldenRequest] = None
        self._tmp = tempfile.TemporaryDirectory(prefix="vllm-golden-")
        work = Path(self._tmp.name)
        self._req, self._out, self._log = work / "request.json", work / "result.json", work / "output.txt"
        cmd = [sys.executable, "-m", "policy_bundle.build.artifacts.vllm_golden", str(self._req), str(self._out),
               str(os.getpid())]
        with open(self._log, "w") as log:  # a file, not a pipe: nobody reads vLLM's output while it runs
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)

    def submit(self, req: VllmGoldenRequest) -> "VllmGoldenRun":
        """Hand the process its request (written whole, then renamed into place); the timeout counts from here.
        One request per process: ``request`` is what its result answers."""
        if self._deadline is not None:
            raise RuntimeError("VllmGoldenRun.submit: this process already has its request")
        self.request, self._deadline = req, time.monotonic() + self.timeout_s
        part = self._req.with_suffix(".part")
        part.write_text(json.dumps(asdict(req)))
        part.rename(self._req)
        return self

    def result(self) -> VllmGoldenResult:
        """Wait for the submitted run; VllmRunError with vLLM's last error line (or the timeout) on failure."""
        try:
            if self._deadline is None:
                raise RuntimeError("VllmGoldenRun.result before submit")
            try:
                rc = self._proc.wait(timeout=max(0.0, self._deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise VllmRunError(f"vLLM did not finish the golden set in {self.timeout_s:.0f}s") from None
            if rc != 0 or not self._out.is_file():
                raise VllmRunError(last_error_line(self._log.read_text(errors="replace")))
            return VllmGoldenResult(**json.loads(self._out.read_text()))
        finally:
            self.close()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._tmp.cleanup()


def run_vllm_golden(req: VllmGoldenRequest, timeout_s: float = 900.0) -> VllmGoldenResult:
    """``run_in_process`` in a fresh Python process, waited for; VllmRunError with vLLM's last error line."""
    return VllmGoldenRun(timeout_s).submit(req).result()


def quit_when_orphaned(parent: int, work: Path) -> None:
    """A daemon thread for this process's whole life: once ``parent`` (the pid of the build that started it) is no
    longer its parent, the build is gone (even if it died before this process got here): remove the work folder
    and exit at once, whatever vLLM is doing."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        shutil.rmtree(work, ignore_errors=True)
        os._exit(3)

    threading.Thread(target=watch, name="quit-when-orphaned", daemon=True).start()


def wait_for_request(path: Path) -> VllmGoldenRequest:
    """vLLM imported first (the slow part), then the request awaited."""
    apply_vllm_env_defaults()
    import vllm  # noqa: F401

    while not path.exists():
        time.sleep(0.05)
    return VllmGoldenRequest(**json.loads(path.read_text()))


if __name__ == "__main__":
    quit_when_orphaned(int(sys.argv[3]), Path(sys.argv[1]).parent)
    request = wait_for_request(Path(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(asdict(run_in_process(request))))
