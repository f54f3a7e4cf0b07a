"""The INT8 TorchScript policy as every reader loads and runs it: the gate, serving, the benchmarks."""

from __future__ import annotations

import ctypes
import io
from pathlib import Path
from typing import Optional

import torch

from policy_bundle.quantize.runtime.fbgemm_int8 import fbgemm_saturates, use_fbgemm
from policy_bundle.quantize.runtime.row_stable import probe_row_stable


TRIM_POSITIONS = 256  # a call over at least this many token positions hands the heap it freed back afterwards


class ScriptRunner:
    """A TorchScript policy whose every call runs without the graph executor's optimisations.

    The profiling executor's shape-specialised graphs recompile at every new cache length and more than double the
    process's peak memory, for no speed (docs/benchmarks.md, "The batched engine's threads and lanes"). The switch
    is thread-local
    (``torch.jit.optimized_execution``), so it is set around each call, on whichever thread serves it; attributes
    and methods otherwise pass through.

    A call whose first argument (the tokens, [B, T] with T > 1) holds ``TRIM_POSITIONS`` or more positions returns
    the heap its temporaries grew by to the system afterwards (``release_freed_memory``; ``_trim_after``): glibc keeps
    it otherwise, and the process stays that much larger until it exits (SmolLM2-135M's INT8 policy: an 8 x 64 prefill
    left 80-90 MB resident on a heap of 460 MB; its tensors peak at 17 MB, the rest is the heap's scattered free
    space)."""

    def __init__(self, module: torch.jit.ScriptModule):
        self.module = module

    def __call__(self, *args, **kwargs):
        return _run(self.module, args, kwargs)

    def __getattr__(self, name: str):
        if name == "module":  # not set yet (a copy being built): no recursion through ourselves
            raise AttributeError(name)
        attr = getattr(self.module, name)
        if not callable(attr):
            return attr
        return lambda *args, **kwargs: _run(attr, args, kwargs)


def _run(fn, args: tuple, kwargs: dict):
    """One call of the module or one of its methods: without the executor's optimisations, the heap trimmed after it
    where it was a long one (``_trim_after``)."""
    with torch.jit.optimized_execution(False):
        out = fn(*args, **kwargs)
    _trim_after(args)
    return out


def _trim_after(args: tuple) -> None:
    """``release_freed_memory`` after a call over ``TRIM_POSITIONS`` or more token positions, several per sequence (a
    prefill, a teacher-forced or scored batch); never after a decode step (``[B, 1]`` tokens, however many rows):
    trimming after every step cost 10-15 % of decode speed, each step faulting its temporaries in again. The trim
    covers every arena, so a scored batch on another thread also trims the decode thread's heap (its next step
    faults its temporaries in once)."""
    tokens = args[0] if args else None
    positions = tokens.numel() if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.shape[1] > 1 else 0
    # ``step_seqs``' prompt chunks (a list of [1, T] token tensors) count too; its decode rows are [B, 1], and the
    # lists of its sequences' caches are not tokens
    positions += sum(t.numel() for a in args if isinstance(a, list) for t in a
                     if isinstance(t, torch.Tensor) and t.dtype == torch.long)
    if positions >= TRIM_POSITIONS:
        release_freed_memory()


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; a no-op where there is none).

    Packing the INT8 TorchScript's weights after the load drops each read copy: glibc keeps what they held in its
    heap unless asked (SmolLM2-135M: 638 MB at the peak with one trim at the end, 549 MB with one per weight)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: glibc's where it is the C library
    except (OSError, AttributeError, TypeError):
        return
    trim(0)


def load_torchscript(path: Path, data: Optional[bytes] = None) -> ScriptRunner:
    """The INT8 TorchScript policy as every reader runs it (``ScriptRunner``): the gate, serving, the benchmarks.
    ``data``: the file's bytes, already read and checked (the server loads what it hashed); ``path`` names it."""
    use_fbgemm()  # the file's int8 weights are packed again: for fbgemm, whatever engine ran before
    module = torch.jit.load(io.BytesIO(data)) if data is not None else torch.jit.load(str(path))
    # each int8 weight packed now, one at a time (``FbgemmWeight``: the load's peak), its freed read copy handed back
    # at once: a packed copy is a little larger than the copy it replaces, so it never fits the hole the last one
    # left (SmolLM2-135M: peak 638 MB with one trim at the end, 549 MB with one per weight, the load 1.1 s either way)
    for sub in module.modules():
        if sub.original_name == "FbgemmWeight" and hasattr(sub, "pack_pending"):  # a file from before packs as read
            sub.pack_pending()
            release_freed_memory()
    release_freed_memory()
    require_exact_sums(module, path)
    probe_row_stable(module)  # the float linears' decode chunks, as this CPU's BLAS keeps rows apart
    return ScriptRunner(module)


class InexactInt8Error(RuntimeError):
    """An INT8 policy whose int8 sums would saturate on this CPU (exported without the exact path for every weight)."""


def require_exact_sums(module: torch.jit.ScriptModule, path: Path) -> None:
    """Refuse an INT8 policy that would compute wrong sums here. On a CPU whose fbgemm saturates (AVX2 without VNNI:
    ``fbgemm_saturates``), every int8 weight must take the exact path (``FbgemmWeight.exact_one_row``); an older policy
    sends most weights through fbgemm's saturating kernel (SmolLM2-135M: held-out top-1 0.9362 instead of 0.9856)."""
    if not fbgemm_saturates():
        return
    for sub in module.modules():
        # an older file has no exact_one_row at all: its weights saturate here too
        if sub.original_name == "FbgemmWeight" and not getattr(sub, "exact_one_row", False):
            raise InexactInt8Error(f"{path}: this INT8 policy was exported before exact int8 sums on CPUs without "
                                   "VNNI; fbgemm saturates on this CPU and its answers would be wrong: "
                                   "rebuild the bundle")
