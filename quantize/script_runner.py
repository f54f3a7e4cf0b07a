"""The INT8 TorchScript policy as every reader loads and runs it: the gate, serving, the benchmarks."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from policy_bundle.quantize.fbgemm_int8 import use_fbgemm


class ScriptRunner:
    """A TorchScript policy whose every call runs without the graph executor's optimisations.

    Measured on SmolLM2-135M's INT8 TorchScript (2 cores, torch 2.13, ``loadtest/bench_int8.py``'s worker): the
    profiling executor's shape-specialised graphs raised the process's peak RSS from 0.84 GB to 2.1-3.4 GB, for no
    speed (four interleaved rounds, medians: decode 35.1 vs 32.7 tok/s, 8 x 64 prefill 621 vs 647 tok/s, batch-32
    decode 272 vs 261 tok/s, within this machine's noise). The switch is thread-local
    (``torch.jit.optimized_execution``), so it is set around each call, on whichever thread serves it; attributes
    and methods otherwise pass through."""

    def __init__(self, module: torch.jit.ScriptModule):
        self.module = module

    def __call__(self, *args, **kwargs):
        with torch.jit.optimized_execution(False):
            return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        if name == "module":  # not set yet (a copy being built): no recursion through ourselves
            raise AttributeError(name)
        attr = getattr(self.module, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with torch.jit.optimized_execution(False):
                return attr(*args, **kwargs)
        return call


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; a no-op where there is none).

    Loading the INT8 TorchScript reads each int8 weight from the file, packs it for fbgemm and drops the read copy:
    on SmolLM2-135M that frees ~120 MB which glibc keeps in its heap (the loaded process stayed at 642 MB RSS; after
    the trim 523 MB)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: glibc's where it is the C library
    except (OSError, AttributeError, TypeError):
        return
    trim(0)


def load_torchscript(path: Path) -> ScriptRunner:
    """The INT8 TorchScript policy as every reader runs it (``ScriptRunner``): the gate, serving, the benchmarks."""
    use_fbgemm()  # the file's int8 weights are packed again as it loads: for fbgemm, whatever engine ran before
    module = torch.jit.load(str(path))
    release_freed_memory()
    return ScriptRunner(module)
