"""A float linear kept in an int8 policy (``quantize/runtime/row_stable.py``): a decode step's rows come out as each
does alone,
in chunks of the rows this CPU's BLAS keeps apart (probed), not one call per row."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from policy_bundle.quantize.runtime import row_stable
from policy_bundle.quantize.runtime.row_stable import RowStableLinear, probe_row_stable, stable_rows_per_call


def float_linear(seed: int = 3) -> torch.nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(1536, 576, bias=False)  # SmolLM2-135M's down_proj, the layer its build keeps in float
    with torch.no_grad():
        lin.weight.copy_(torch.randn(576, 1536, generator=g) * 0.02)
    return lin


def test_a_decode_batchs_rows_come_out_as_alone_at_every_batch_size_in_a_few_calls():
    """Each row of a [B, 1, in] step equals the one-row step, bitwise, at every B from 1 to 40: chunks of at most
    ``rows_per_call`` rows (probed here: several), a lone row in twice. The control: one GEMM over the rows sums in
    another order. A prefill (T > 1) keeps the GEMM."""
    lin = float_linear()
    stable = torch.jit.script(RowStableLinear(lin))
    assert stable.rows_per_call >= 2, "this CPU's BLAS mixes rows even in two-row calls: the fast path is untested"
    with torch.no_grad():
        x = torch.randn(40, 1, 1536, generator=torch.Generator().manual_seed(4))
        alone = torch.cat([stable(x[i : i + 1]) for i in range(40)])
        for rows in range(2, 41):
            assert torch.equal(stable(x[:rows]), alone[:rows]), rows
        assert not torch.equal(lin(x[:16]), alone[:16])  # the float GEMM over 16 rows sums in another order
        y = torch.randn(1, 8, 1536)
        assert torch.equal(stable(y), lin(y))


def test_a_cpu_whose_two_row_calls_differ_keeps_one_call_per_row(monkeypatch):
    """The probe compares each chunk size with the rows alone: where a BLAS sums a two-row call's rows in another
    order (a fault injected into the probe's linear), ``rows_per_call`` is 1 and every row takes its own call."""
    lin = float_linear()
    linear = F.linear

    def mixing(x, weight, bias=None):  # rows beside another row come out 1 ulp off
        out = linear(x, weight, bias)
        return out if x.shape[0] == 2 and torch.equal(x[0], x[1]) else torch.nextafter(out, out + 1)

    monkeypatch.setattr(row_stable.F, "linear", mixing)
    assert stable_rows_per_call(lin.weight, None) == 1
    monkeypatch.undo()
    stable = RowStableLinear(lin)
    stable.rows_per_call = 1
    with torch.no_grad():
        x = torch.randn(8, 1, 1536)
        assert torch.equal(stable(x), torch.cat([lin(x[i : i + 1]) for i in range(8)]))


def test_a_loaded_policy_probes_its_float_linears_on_the_cpu_that_runs_it(tmp_path):
    """``load_torchscript`` probes ``rows_per_call`` again (the file holds the build machine's), so a policy built
    elsewhere never chunks rows this CPU would mix."""
    from policy_bundle.quantize.runtime.script_runner import load_torchscript

    model = torch.nn.Sequential(RowStableLinear(float_linear()))
    model[0].rows_per_call = 1
    torch.jit.save(torch.jit.script(model), str(tmp_path / "m.ts"))
    loaded = load_torchscript(tmp_path / "m.ts")
    (sub,) = [s for s in loaded.module.modules() if s.original_name == "RowStableLinear"]
    assert sub.rows_per_call == stable_rows_per_call(float_linear().weight, None) >= 2
    assert probe_row_stable(torch.nn.Sequential(torch.nn.Linear(4, 4))) == 0


def test_chunks_with_a_lone_last_row_a_bias_an_unaligned_width_and_no_rows():
    """Small chunks leave a lone last row (3 a call, 7 rows: 3 + 3 + 1), which goes in twice; a bias; a width that is
    not a multiple of 16 floats (the chunks' rows start unaligned, and go in as fresh copies); an empty step."""
    for width in (1536, 100):
        lin = torch.nn.Linear(width, 64, bias=True)
        stable = torch.jit.script(RowStableLinear(lin))
        with torch.no_grad():
            x = torch.randn(7, 1, width, generator=torch.Generator().manual_seed(width))
            for per_call in (3, stable_rows_per_call(lin.weight, lin.bias)):
                stable.rows_per_call = per_call
                alone = torch.cat([stable(x[i : i + 1]) for i in range(7)])
                assert torch.equal(stable(x), alone), (width, per_call)
            assert stable(x[:0]).shape == (0, 1, 64)
