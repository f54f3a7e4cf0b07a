"""The INT8 TorchScript runs without the graph executor's profiling and optimisation, on whichever thread calls it
(the switch is thread-local): the profiling executor held 2-3 GB more on SmolLM2-135M's INT8 policy for no speed."""

import threading

import torch

from policy_bundle.quantize.script_runner import ScriptRunner, load_torchscript


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
