"""Which int8 matmul is cheaper than float on this CPU: one linear of SmolLM2-135M's shapes, side by side.

    .venv/bin/python -m policy_bundle.loadtest.bench_kernels [--rows 1 8 32] [--repeat 200] [--json OUT]

Per shape (in -> out features) and rows (1: a batch-1 decode step; 32: a prefill chunk or 32 decoding rows) it
times, in one process, one after the other, and prints the median microseconds and each one's ratio to float:

- ``fp32``: ``F.linear`` (what the FP32 eager policy runs);
- ``int_mm``: our per-token W8A8 (``quantize/w8a8/linear.py``'s ``Int8TokenLinear``: per-row activation scale, int8,
  ``torch._int_mm``, rescale);
- ``fbgemm-dyn``: fbgemm's dynamic quantized linear over per-channel int8 weights (``quantized::linear_dynamic``,
  what torch.ao's ``dynamic`` recipe ships): one activation scale per call, so per-token only at one row;
- ``fbgemm-norm``: per-token scales on fbgemm at any row count: each row mapped onto [0, 1] by its own range
  (exactly 0 and 1 there), so fbgemm's one scale per call is 1/255 for every row, then rescaled and offset back
  with the weight's row sums (tried as ``Int8TokenLinear``'s kernel: docs/recipes.md);
- ``fbgemm-dyn/row``: the same kernel called once per row (per-token scales at any row count).

Also each one's relative error against fp32 on the same inputs (activations with a few large channels, as
real LMs have). Weights and inputs are seeded random at the real shapes: timings depend on shapes, not values.

``--stream``: a batch-1 decode step's linears as they meet the memory, each with its own weight (SmolLM2-135M: 30
layers of fused q/k/v, o, fused gate/up and down, then the head; 134 MB of int8), so the weights come from DRAM
and not from a cache as above. It prints each kernel's milliseconds per step and GB/s of int8 (float) weights,
beside a plain read of the same int8 bytes: how far the one-row kernel is from this machine's memory bandwidth,
which bounds any int8 decode step.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

from policy_bundle.loadtest.results_doc import markdown, table, write_tables
from policy_bundle.quantize.runtime.fbgemm_int8 import pack_int8

SMOLLM2_SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "gate_proj": (576, 1536), "down_proj": (1536, 576),
                  "lm_head": (576, 49152)}


def per_channel_int8(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    return torch.round(w / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8), scales


def kernels(w: torch.Tensor) -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    q, scales = per_channel_int8(w)
    packed = packed_fbgemm(q, scales)
    qt = q.t()

    def int_mm(x: torch.Tensor) -> torch.Tensor:
        row_scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
        xq = torch.round(x / row_scale).clamp(-127, 127).to(torch.int8)
        return torch._int_mm(xq, qt).float() * row_scale * scales

    def fbgemm_dyn(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, packed, True)

    w_sums = (q.float() * scales.unsqueeze(1)).sum(dim=1)

    def fbgemm_norm(x: torch.Tensor) -> torch.Tensor:  # each row mapped onto [0, 1]: per-tensor == per-row
        lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
        span = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
        return torch.ops.quantized.linear_dynamic((x - lo) / span, packed, False) * span + lo * w_sums

    def fbgemm_rows(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.ops.quantized.linear_dynamic(x[i:i + 1], packed, True) for i in range(x.shape[0])])

    return {"fp32": lambda x: F.linear(x, w), "int_mm": int_mm, "fbgemm-dyn": fbgemm_dyn,
            "fbgemm-norm": fbgemm_norm, "fbgemm-dyn/row": fbgemm_rows}


def packed_fbgemm(q: torch.Tensor, scales: torch.Tensor):
    """fbgemm's pre-packed weight of an int8 [out, in] and its scales (``fbgemm_int8.pack_int8``, warnings off:
    quantized tensors are deprecated as a user type, the packing needs one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pack_int8(q, scales)


def median_us(fn: Callable[[], torch.Tensor], repeat: int) -> float:
    for _ in range(max(3, repeat // 10)):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def threads() -> str:
    n = torch.get_num_threads()
    return f"{n} thread" + ("s" if n != 1 else "")


STEP_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # SmolLM2-135M's layer, q/k/v and gate/up fused


def stream(layers: int, repeat: int) -> Tuple[str, dict]:
    """One decode step's one-row linears, every weight its own (streamed from DRAM): ms per step and GB/s."""
    g = torch.Generator().manual_seed(0)
    shapes = STEP_SHAPES * layers + [SMOLLM2_SHAPES["lm_head"]]
    weights = [torch.randn(n_out, n_in, generator=g) for n_in, n_out in shapes]
    int8 = [per_channel_int8(w) for w in weights]
    fbgemm = [packed_fbgemm(q, s) for q, s in int8]
    onednn = [(torch.ops.onednn.qlinear_prepack(q, [1, q.shape[1]]), torch.ones(q.shape[0]),
               torch.zeros(q.shape[0], dtype=torch.long)) for q, _ in int8]
    xs = {n: torch.randn(1, n, generator=g) for n, _ in shapes}
    qx = {n: torch.randint(0, 256, (1, n), dtype=torch.uint8, generator=g) for n, _ in shapes}
    flat = torch.cat([q.reshape(-1) for q, _ in int8]).view(torch.uint8)
    split = {n: torch.randint(0, 129, (2, n), generator=g).float().sub_(128.0) for n, _ in shapes}
    int8_gb = flat.numel() / 1e9
    runs = {
        "int8 bytes read (max)": (lambda: flat.max(), int8_gb),
        "fbgemm one row (linear_dynamic)": (lambda: [torch.ops.quantized.linear_dynamic(xs[s[0]], p, False)
                                                     for s, p in zip(shapes, fbgemm)], int8_gb),
        # the exact one-row path where fbgemm saturates (AVX2 without VNNI): the codes split by sign, two rows
        "fbgemm GEMM, sign-split codes (2 rows)": (lambda: [
            torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(split[s[0]], 1.0, 128, p)
            for s, p in zip(shapes, fbgemm)], int8_gb),
        "oneDNN one row (qlinear, input pre-quantized)": (lambda: [torch.ops.onednn.qlinear_pointwise(
            qx[s[0]], 1.0, 128, p, one, zero, None, 1.0, 0, torch.float32, "none", [], "")
            for s, (p, one, zero) in zip(shapes, onednn)], int8_gb),
        "fp32 F.linear": (lambda: [F.linear(xs[s[0]], w) for s, w in zip(shapes, weights)], 4 * int8_gb),
    }
    lead = (f"one decode step's linears, {layers} layers + head, {int8_gb * 1e3:.0f} MB of int8, "
            f"{threads()}; median of {repeat} steps")
    print(lead, flush=True)
    rows, base = [], None
    for name, (fn, gb) in runs.items():
        ms = median_us(fn, repeat) / 1e3
        base = base or ms
        rows.append([name, f"{ms:.2f} ms", f"{gb / ms * 1e3:.1f} GB/s", f"{ms / base:.2f}x"])
    return lead, table(["kernel", "ms per step", "weights read", "vs the plain read"], rows)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--stream", action="store_true", help="a decode step's linears with their weights from DRAM")
    ap.add_argument("--layers", type=int, default=30, help="with --stream: decoder layers (SmolLM2-135M: 30)")
    ap.add_argument("--json", type=Path, help="write the table here (docs/results/NAME.json)")
    args = ap.parse_args(argv)
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        torch.backends.quantized.engine = "x86"
    if args.stream:
        with torch.inference_mode():
            lead, tab = stream(args.layers, args.repeat)
    else:
        lead, tab = linears(args.rows, args.repeat)
    print(markdown(tab))
    if args.json:
        print(f"figures: {write_tables(args.json, 'bench_kernels', lead, [tab], argv=argv)}")
    return 0


def linears(row_counts: List[int], repeat: int) -> Tuple[str, dict]:
    """Each SmolLM2-135M linear shape at each row count: every kernel's time as a ratio to fp32 and its error."""
    g = torch.Generator().manual_seed(0)
    lead = (f"torch {torch.__version__}, {threads()}, quantized engine "
            f"{torch.backends.quantized.engine}; median over {repeat} calls, time as a ratio to fp32 `F.linear` in "
            "the same run, relative output error against fp32 on inputs with 4 large channels; seeded random weights "
            "at SmolLM2-135M's shapes")
    print(lead, flush=True)
    rows = []
    with torch.inference_mode():
        for name, (n_in, n_out) in SMOLLM2_SHAPES.items():
            w = torch.randn(n_out, n_in, generator=g) * n_in ** -0.5
            fns = kernels(w)
            for count in row_counts:
                x = torch.randn(count, n_in, generator=g)
                x[:, :4] *= 20.0  # a few outlier channels
                ref = fns["fp32"](x)
                cells, base = [], None
                for k, fn in fns.items():
                    us = median_us(lambda: fn(x), repeat)
                    base = base or us
                    err = float((fn(x) - ref).norm() / ref.norm())
                    cells.append(f"{us:.1f} us" if k == "fp32" else f"{us / base:.2f}x, err {err:.3f}")
                rows.append([f"{name} {n_in} -> {n_out}", count, *cells])
                print("| " + " | ".join(str(c) for c in rows[-1]) + " |", flush=True)
    return lead, table(["shape (in -> out)", "rows", "fp32 `F.linear`", "`torch._int_mm`, per-token scales",
                        "fbgemm dynamic (one scale per call)", "fbgemm, rows mapped onto [0, 1]",
                        "fbgemm dynamic, one call per row"], rows)


if __name__ == "__main__":
    raise SystemExit(main())
