"""The INT8 TorchScript runs without the graph executor's profiling and optimisation, on whichever thread calls it
(the switch is thread-local): the profiling executor held 2-3 GB more on SmolLM2-135M's INT8 policy for no speed."""

import os
import subprocess
import sys
import threading

import pytest
import torch

from policy_bundle.quantize.runtime.script_runner import ScriptRunner, load_torchscript


class Tiny(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * 2 + 1).sum(-1)

    @torch.jit.export
    def prefill(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale


def executed_kinds() -> set:
    return {n.kind() for n in torch.jit.last_executed_optimized_graph().nodes()}


def on_thread(fn):
    out = {}
    th = threading.Thread(target=lambda: out.update(value=fn(), kinds=executed_kinds()))
    th.start()
    th.join()
    return out


def test_runner_calls_skip_profiling_on_any_thread_and_raw_module_does_not(tmp_path):
    path = tmp_path / "tiny.ts"
    torch.jit.save(torch.jit.script(Tiny()), str(path))
    x = torch.randn(4, 8)
    raw = torch.jit.load(str(path))
    control = on_thread(lambda: raw(x))
    assert "prim::profile" in control["kinds"]  # the negative control: the default executor profiles its first call

    runner = load_torchscript(path)
    assert isinstance(runner, ScriptRunner)
    got = on_thread(lambda: runner(x))
    assert "prim::profile" not in got["kinds"]
    assert torch.equal(got["value"], Tiny()(x))
    method = on_thread(lambda: runner.prefill(x, 3.0))  # exported methods go through the same switch
    assert "prim::profile" not in method["kinds"]
    assert torch.equal(method["value"], x * 3.0)
    assert torch.equal(runner.prefill(x, scale=2.0), x * 2.0)  # keyword arguments pass through too
    assert hasattr(runner, "prefill") and not hasattr(runner, "decode_batch")  # attributes pass through


CHURN = '''
import sys
from pathlib import Path
from typing import List

import torch

from policy_bundle.quantize.runtime.script_runner import TRIM_POSITIONS, ScriptRunner


class Churn(torch.nn.Module):
    @torch.jit.export
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        # 64 temporaries of 1 MB, then a 2 MB tensor the caller keeps: it sits above them at the heap's top, so glibc
        # keeps the 64 MB freed under it (as a policy's prefill leaves its scattered temporaries)
        held = [torch.ones(262144) for _ in range(64)]
        return torch.ones(524288) * float(len(held))

    @torch.jit.export
    def step_and_prefill(self, tokens: torch.Tensor, prompts: List[torch.Tensor]) -> torch.Tensor:
        return self.prefill(tokens)  # a step's [B, 1] rows and its prompt chunks' tokens, the same churn

    @torch.jit.export
    def step_seqs(self, tokens: torch.Tensor, prompts: List[torch.Tensor], ks: List[torch.Tensor]) -> torch.Tensor:
        return self.prefill(tokens)  # decode rows on caches of their own: the caches are not tokens


def rss_mb() -> int:
    line = [s for s in Path("/proc/self/status").read_text().splitlines() if s.startswith("VmRSS")][0]
    return int(line.split()[1]) // 1024


torch.ones(4 << 20).sum()  # a 16 MB block freed: glibc's mmap threshold rises to it, so 1 MB blocks come from the heap
module = torch.jit.script(Churn())
runner = ScriptRunner(module)
positions = TRIM_POSITIONS + int(sys.argv[1])
shape = [positions, 1] if sys.argv[2] == "steps" else [1, positions]  # a decode step's [B, 1], or one sequence
before = rss_mb()
if sys.argv[2] == "chunks":  # four decode rows and two prompt chunks of the positions between them
    half = positions // 2
    kept = runner.step_and_prefill(torch.zeros([4, 1], dtype=torch.long),
                                   [torch.zeros([1, half], dtype=torch.long), torch.zeros([1, positions - half], dtype=torch.long)])
elif sys.argv[2] == "caches":  # four decode rows on caches of their own, as many positions each
    kept = runner.step_seqs(torch.zeros([4, 1], dtype=torch.long), [], [torch.zeros([1, positions]) for _ in range(4)])
else:
    kept = runner.prefill(torch.zeros(shape, dtype=torch.long))
print(rss_mb() - before)
'''


def grown_mb(script, extra_positions: int, kind: str = "sequence") -> int:
    """A fresh process's resident growth over one call (each its own process: the heap starts the same)."""
    out = subprocess.run([sys.executable, str(script), str(extra_positions), kind], capture_output=True, text=True,
                         check=True, timeout=300)
    return int(out.stdout.strip().splitlines()[-1])


def retained_mb(script, extra_positions: int, kind: str = "sequence", tries: int = 3) -> int:
    """The most a call left resident over up to ``tries`` fresh processes (the negative controls). glibc gives the
    freed temporaries back by itself only when they end up at the heap's top, which depends on the heap the process's
    start left behind (hash seeds and address-space layout vary it): on a loaded machine an untrimmed call has grown
    its process by only 9 MB. A handback that is not ``malloc_trim``'s shows in one process, not in all of them; a
    trim is checked in every process it runs in."""
    best = 0
    for _ in range(tries):
        best = max(best, grown_mb(script, extra_positions, kind))
        if best >= 48:
            break
    return best


@pytest.mark.skipif(any(os.environ.get(v) for v in ("LD_PRELOAD", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")),
                    reason="another allocator or glibc tuning: the heap's growth is not glibc's default")
def test_a_call_over_trim_positions_hands_its_freed_heap_back(tmp_path):
    """A call over TRIM_POSITIONS token positions or more leaves the process no larger than what it still holds; the
    same call one position short of the threshold, or a decode step's [B, 1] tokens over as many rows, keeps the
    freed temporaries resident (the negative controls: trimming after every step slows decoding)."""
    script = tmp_path / "churn.py"  # a file: TorchScript reads the module's source
    script.write_text(CHURN)
    assert retained_mb(script, -1) >= 48  # one position short of the threshold: nothing handed back
    assert retained_mb(script, 0, "steps") >= 48  # as many rows of one token each: a decode step, not trimmed
    assert all(grown_mb(script, 0) <= 16 for _ in range(3))  # the 2 MB it returns, and the interpreter's own
    # a step with prompt chunks (``step_and_prefill``): the chunks' positions count, the decode rows' do not
    assert retained_mb(script, -1, "chunks") >= 48 and grown_mb(script, 0, "chunks") <= 16
    assert grown_mb(script, 0, "caches") >= 48  # a step over its sequences' caches (``step_seqs``): not trimmed
