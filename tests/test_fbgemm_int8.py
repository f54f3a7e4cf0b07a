"""fbgemm's two entry points to one packed int8 weight (``quantize/runtime/fbgemm_int8.py``, ``Int8TokenLinear``): one
row and
several rows give the same floats bitwise, the weight is held and saved once, and that holds whatever quantized
engine ran before and on a CPU whose fbgemm saturates."""

import copy

import pytest
import torch

from policy_bundle.quantize.w8a8.linear import Int8TokenLinear, quantize_weight


def rows_alone_and_together(m, x):
    return m(x), torch.cat([m(x[i : i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576)])
def test_one_row_fbgemm_equals_the_rows_kernel_bitwise(bias, shape, monkeypatch):
    """A batch-1 decode step (fbgemm's dynamic linear) and the same row inside a prefill or a decode batch (fbgemm's
    GEMM over our own quantization) give the same floats: a request's tokens do not depend on what else the engine
    is running. 4000 rows: the quantization written as ``x / scale + zp`` (two roundings
    where fbgemm's fused multiply-add has one) gave another code in about 1 row of 3000, and fails here."""
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(*shape, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(shape[1], shape[0], generator=g))
    m = Int8TokenLinear.from_float(lin)
    # the packed weight is the only int8 copy; 1536 inputs: scaled sums fbgemm cannot hand back, unit scales
    assert m.int_mm_weight.numel() == 0 and m.unit_scales == (shape[0] == 1536)
    x = torch.randn(4000, shape[0], generator=g) * torch.rand(4000, 1, generator=g) * 10
    x[::3] = x[::3].abs()  # one-sided rows: zero point 0
    x[1::7, :6] *= 40  # a few loud channels
    x[5] = 0.0  # fbgemm's all-zero row (scale 0.1)
    x[9] *= 1e-6  # and its smallest-scale widening
    together, alone = rows_alone_and_together(m, x)
    assert torch.equal(together, alone)

    from policy_bundle.quantize.w8a8 import linear as w8a8
    from policy_bundle.quantize.runtime.fbgemm_int8 import fbgemm_saturates, row_qparams

    if fbgemm_saturates():
        # AVX2 without VNNI: one row runs on the rows kernel too (``FbgemmWeight.exact_one_row``), so both sides share
        # one quantization; the negative control is one row on fbgemm's own kernel, whose int16 pair sums saturate
        m.fbgemm.exact_one_row = False
        alone = torch.cat([m(x[i : i + 1]) for i in range(x.shape[0])])
        assert not torch.equal(together, alone)
        return

    def two_roundings(flat, lo=None, hi=None):  # the negative control: the formula this kernel had
        scale, zp = row_qparams(flat, lo, hi)
        return torch.round(flat / scale + zp.float()).clamp(0.0, 255.0), scale, zp

    monkeypatch.setattr(w8a8, "quantize_rows", two_roundings)
    together, alone = rows_alone_and_together(m, x)
    assert not torch.equal(together, alone)


def test_a_weight_whose_sums_fbgemm_cannot_hand_back_keeps_exact_int32_sums(tmp_path):
    """fbgemm's GEMM returns each int32 sum times the channel's scale, in float: the sum comes back exactly only below
    2^22, and unscaled (unit scales) below 2^24. A weight whose sums could pass that (wide, large int8 values) keeps
    a second copy for ``torch._int_mm``; the rows still equal alone, bitwise."""
    g = torch.Generator().manual_seed(2)
    wide = torch.nn.Linear(1100, 64, bias=False)
    with torch.no_grad():
        wide.weight.copy_(torch.randint(120, 128, (64, 1100), generator=g).float())  # sums near 255 * 127 * 1100
    m = Int8TokenLinear.from_float(wide)
    assert m.int_mm_weight.shape == (64, 1100) and not m.unit_scales
    with torch.no_grad():
        narrower = torch.nn.Linear(1000, 64, bias=False)
        narrower.weight.copy_(torch.randint(120, 128, (64, 1000), generator=g).float())  # 128 x 123.5k < 2^24
    narrower = Int8TokenLinear.from_float(narrower)
    # its zero-point term too (up to 128 x 123.5k) is an exact float: the float epilogue, one rounding
    assert narrower.unit_scales and narrower.int_mm_weight.numel() == 0
    together, alone = rows_alone_and_together(narrower, torch.rand(300, 1000, generator=g) * 5)
    assert torch.equal(together, alone)
    x = torch.rand(300, 1100, generator=g) * 5  # all positive: codes near 255, sums near the bound
    together, alone = rows_alone_and_together(m, x)
    assert torch.equal(together, alone) and together.abs().max() > 0
    assert torch.equal(torch.jit.script(m)(x), together)
    path = tmp_path / "wide.ts"
    torch.jit.save(torch.jit.script(m), str(path))
    assert 64 * 1100 < path.stat().st_size < 2 * 64 * 1100  # the kept copy and the packed one: saved once
    loaded = torch.jit.load(str(path))
    assert loaded.int_mm_weight.data_ptr() == loaded.fbgemm.kept.data_ptr()  # and loaded once
    assert torch.equal(loaded(x), together) and torch.equal(loaded(x[:1]), together[:1])
    twin = copy.deepcopy(m)  # an eager copy (the gate converts copies) holds it once too
    assert twin.int_mm_weight.data_ptr() == twin.fbgemm.kept.data_ptr() != m.int_mm_weight.data_ptr()
    assert torch.equal(twin(x), together)


AVX2_ONLY_SCRIPT = """
import torch
from policy_bundle.quantize.runtime.fbgemm_int8 import fbgemm_saturates
from policy_bundle.quantize.w8a8.linear import Int8TokenLinear
assert fbgemm_saturates()
g = torch.Generator().manual_seed(2)
wide = torch.nn.Linear(1100, 64, bias=False)
with torch.no_grad():
    wide.weight.copy_(torch.randint(120, 128, (64, 1100), generator=g).float())
x = torch.rand(40, 1100, generator=g) * 5
m = Int8TokenLinear.from_float(wide)
together = m(x)
# the negative control: fbgemm's own one-row kernel saturates here, the exact rows do not
assert not torch.equal(torch.ops.quantized.linear_dynamic(x[:1], m.fbgemm.packed, False), together[:1])
assert m.fbgemm.exact_one_row
for model in (m, torch.jit.script(m)):
    assert torch.equal(torch.cat([model(row) for row in x.split(1)]), together)
# a weight without a kept copy (the usual case: every SmolLM2-135M projection but down_proj) gets the exact sums too,
# from fbgemm's GEMM over codes split by sign: the same floats as the exact _int_mm path over the same weight
lin = torch.nn.Linear(256, 96, bias=False)
with torch.no_grad():  # weights near +-127, one sign per adjacent pair: fbgemm's int16 pairs overflow
    signs = (torch.randint(0, 2, (96, 128), generator=g) * 2 - 1).repeat_interleave(2, dim=1)
    lin.weight.copy_(torch.randint(100, 128, (96, 256), generator=g) * signs / 127.0)
x = torch.rand(40, 256, generator=g) * 5  # codes over the whole 0-255 range
plain = Int8TokenLinear.from_float(lin)
assert plain.int_mm_weight.numel() == 0 and not plain.unit_scales and plain.fbgemm.exact_one_row
exact = Int8TokenLinear.from_float(lin)
exact.int_mm_weight = exact.int8_weight()  # the exact int32 sums (torch._int_mm) over the same codes
want = exact(x)
assert torch.equal(plain(x), want)
for model in (plain, torch.jit.script(plain)):
    assert torch.equal(torch.cat([model(row) for row in x.split(1)]), want)
# the negative controls: fbgemm's own kernels at one row and at more saturate here
ones = torch.cat([torch.ops.quantized.linear_dynamic(row, plain.fbgemm.packed, False) for row in x.split(1)])
assert bool((ones != want).any(1).all())  # every row saturates
from policy_bundle.quantize.runtime.fbgemm_int8 import quantize_rows
q, scale, zp = quantize_rows(x)
y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(q - 128.0, 1.0, 128, plain.fbgemm.packed)
sat = (y.div(plain.scales).round().to(torch.int32) + (128 - zp.to(torch.int32)) * plain.col_sums).float()
assert bool((sat.mul(scale * plain.scales) != want).any(1).all())
print("ok")
"""


def test_a_cpu_whose_fbgemm_saturates_gets_the_exact_sums_at_one_row_and_at_more():
    """Without VNNI (AVX2 only) fbgemm adds u8 x s8 products in int16 pairs and saturates. This machine has VNNI, so
    the test runs in a process told to use fbgemm's AVX2 kernels: a weight whose sums keep the ``_int_mm`` copy gives a
    row alone what it gives the row in a batch (the exact sums), and a weight without that copy gives the exact sums
    from codes split by sign, where fbgemm's own one-row and several-rows kernels saturate."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", AVX2_ONLY_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
    from policy_bundle.quantize.runtime.fbgemm_int8 import fbgemm_saturates

    here = Int8TokenLinear.from_float(torch.nn.Linear(64, 8))
    assert here.fbgemm.exact_one_row is fbgemm_saturates()  # False here (VNNI): fbgemm's own one-row kernel
    assert isinstance(fbgemm_saturates(), bool)


@pytest.mark.skipif("qnnpack" not in torch.backends.quantized.supported_engines, reason="no qnnpack in this torch")
def test_the_kernel_packs_for_fbgemm_whatever_engine_an_earlier_recipe_left(tmp_path):
    """A torch.ao recipe with ``backend: qnnpack`` sets the process's quantized engine and leaves it. Packing for
    qnnpack gives a weight without fbgemm's several-rows entry point (the negative control); building or loading the
    int8 kernel switches the engine back to fbgemm's."""
    from policy_bundle.quantize.runtime.fbgemm_int8 import pack_int8

    torch.manual_seed(5)
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(5, 64)
    ref = Int8TokenLinear.from_float(lin)
    path = tmp_path / "m.ts"
    torch.jit.save(torch.jit.script(ref), str(path))
    before = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "qnnpack"
        w, s = quantize_weight(lin.weight.detach())
        with pytest.raises(RuntimeError, match="not implemented"):
            torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, 1.0, 128, pack_int8(w, s))
        assert torch.equal(Int8TokenLinear.from_float(lin)(x), ref(x))
        torch.backends.quantized.engine = "qnnpack"
        from policy_bundle.quantize.runtime.script_runner import load_torchscript

        assert torch.equal(load_torchscript(path)(x), ref(x))
    finally:
        torch.backends.quantized.engine = before


def test_the_int8_weight_is_saved_once_and_loaded_only_into_fbgemms_packed_copy(tmp_path):
    torch.manual_seed(3)
    lin = torch.nn.Linear(576, 960, bias=False)
    m = Int8TokenLinear.from_float(lin, rot_block=64)
    path = tmp_path / "m.ts"
    torch.jit.save(torch.jit.script(m), str(path))
    assert 960 * 576 < path.stat().st_size < 1.2 * 960 * 576  # the int8 weight once (not twice, not in float)
    loaded = torch.jit.load(str(path))
    assert all(t.dtype != torch.int8 or t.numel() == 0 for t in loaded.state_dict().values())
    assert torch.equal(loaded.fbgemm.unpacked()[0], m.int8_weight())
    x = torch.randn(7, 576)
    assert torch.equal(loaded(x), m(x)) and torch.equal(loaded(x[:1]), m(x[:1]))


def test_a_loaded_weight_is_packed_at_its_first_use_or_by_the_loader_and_its_read_copy_dropped(tmp_path):
    """``torch.jit.load`` holds every tensor it read until the whole file is read, so a weight packed as it is read
    was held twice at the load's peak: it is packed at its first use, or by ``load_torchscript`` one at a time."""
    from policy_bundle.quantize.runtime.script_runner import load_torchscript

    torch.manual_seed(4)
    m = Int8TokenLinear.from_float(torch.nn.Linear(576, 320, bias=False), rot_block=64)
    path = tmp_path / "m.ts"
    torch.jit.save(torch.jit.script(m), str(path))
    x = torch.randn(5, 576)
    raw = torch.jit.load(str(path))
    assert tuple(raw.fbgemm.pending.shape) == (320, 576)  # read, not packed yet
    again = tmp_path / "again.ts"
    torch.jit.save(raw, str(again))  # saved before its first use: the read weight itself
    assert torch.equal(torch.jit.load(str(again))(x), m(x))
    assert torch.equal(raw(x[:1]), m(x[:1])) and raw.fbgemm.pending.numel() == 0  # the first call packed it
    assert torch.equal(raw(x), m(x))
    runner = load_torchscript(path)
    assert runner.module.fbgemm.pending.numel() == 0 and torch.equal(runner(x), m(x))


def test_bench_kernels_stream_reports_each_kernel_against_a_plain_read(tmp_path):
    """``bench_kernels --stream`` (how far the one-row int8 kernels are from the memory bandwidth, the bound of a
    decode step) reports, per kernel, milliseconds per step, GB/s of weights and the ratio to a plain read of the
    same bytes, that read first."""
    import json

    from policy_bundle.loadtest.bench_kernels import main

    assert main(["--stream", "--layers", "1", "--repeat", "3", "--json", str(tmp_path / "k.json")]) == 0
    figures = json.loads((tmp_path / "k.json").read_text())["figures"]
    assert "1 layers + head" in figures["lead"] and "MB of int8" in figures["lead"]
    rows = {r[0]: r[1:] for r in figures["tables"][0]["rows"]}
    assert list(rows) == ["int8 bytes read (max)", "fbgemm one row (linear_dynamic)",
                          "fbgemm GEMM, sign-split codes (2 rows)", "oneDNN one row (qlinear, input pre-quantized)",
                          "fp32 F.linear"]
    for ms, gbs, ratio in rows.values():
        assert float(ms.removesuffix(" ms")) > 0 and float(gbs.removesuffix(" GB/s")) > 0 and ratio.endswith("x")
    assert rows["int8 bytes read (max)"][2] == "1.00x"


OLD_CODE_SCRIPT = """
import sys
from pathlib import Path
from policy_bundle.quantize.runtime.script_runner import InexactInt8Error, load_torchscript
load_torchscript(Path(sys.argv[1]))  # exported with exact sums: loads
try:
    load_torchscript(Path(sys.argv[2]))
except InexactInt8Error as exc:
    print("refused:", exc)
"""


def test_a_policy_exported_before_exact_sums_is_refused_where_fbgemm_saturates(tmp_path):
    """A file carries its own TorchScript code: one exported before exact sums sends most weights through fbgemm's
    saturating kernel on a CPU without VNNI. Such a file (made here by editing the saved code back) is refused there
    with a message naming the fix (this machine where it saturates, and a process told to use AVX2 alone), and loads
    where fbgemm does not saturate."""
    import os
    import re
    import subprocess
    import sys
    import zipfile

    from policy_bundle.quantize.runtime.fbgemm_int8 import fbgemm_saturates
    from policy_bundle.quantize.runtime.script_runner import InexactInt8Error, load_torchscript

    new = tmp_path / "new.ts"
    torch.jit.save(torch.jit.script(Int8TokenLinear.from_float(torch.nn.Linear(64, 8))), str(new))
    old = tmp_path / "old.ts"
    edited = 0
    with zipfile.ZipFile(new) as src, zipfile.ZipFile(old, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("quantize/runtime/fbgemm_int8.py"):
                text, edited = re.subn(r"self\.exact_one_row = _\d+\(\)", "self.exact_one_row = False", data.decode())
                data = text.encode()
            dst.writestr(item, data)
    assert edited == 1  # __setstate__ sets it (__init__ is not saved code)
    if fbgemm_saturates():  # this machine (AVX2 without VNNI): refused here too
        with pytest.raises(InexactInt8Error, match="rebuild the bundle"):
            load_torchscript(old)
    else:  # a CPU with VNNI: loads as it is
        assert load_torchscript(old).module.fbgemm.exact_one_row is False
    env = {**os.environ, "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", OLD_CODE_SCRIPT, str(new), str(old)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "refused:" in res.stdout and "rebuild the bundle" in res.stdout
