"""Guards below the HTTP tests, each pinned on its own: the engine's greedy cut-off for a tiny temperature (what
a variant's own API does when the router's schema is bypassed), its greedy rows picked together, an artifact symlinked out of its bundle, and a
variant whose health names another build's manifest."""

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch

from policy_bundle.bundle.manifest import BundleVerificationError, read_manifest, verified_artifact, write_manifest


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-300, 1e-6])
def test_the_engine_picks_greedily_below_the_minimum_temperature(temperature):
    from policy_bundle.serve.variants.engines import SamplingParams, pick_token

    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    step = pick_token(logits, SamplingParams(temperature=temperature), torch.Generator().manual_seed(0))
    assert step.token_id == 1 and math.isfinite(step.logprob)
    # the negative control: above the cut-off it samples (a flat distribution picks other tokens too)
    gen = torch.Generator().manual_seed(0)
    picked = {pick_token(torch.zeros(4), SamplingParams(temperature=1.0), gen).token_id for _ in range(50)}
    assert len(picked) > 1


def test_a_steps_greedy_rows_picked_together_are_each_rows_pick_alone():
    """The batched engine picks a step's greedy rows together (``greedy_steps``): each row's token and logprob are
    bitwise what ``pick_token`` gives it alone; a tie takes the first index alike; the token is the argmax of the row's
    log-softmax in double, and the logprob its value there within 1e-5."""
    from policy_bundle.serve.variants.engines import SamplingParams, greedy_steps, pick_token

    logits = torch.randn(17, 49152, generator=torch.Generator().manual_seed(0)) * 5  # a step's rows
    logits[3, 9] = logits[3, 7] = logits[3].max() + 1
    alone = [pick_token(logits[i], SamplingParams(), None) for i in range(17)]
    assert greedy_steps(logits) == alone and alone[3].token_id == 7
    exact = torch.log_softmax(logits.double(), dim=-1)
    assert [s.token_id for s in alone] == exact.argmax(dim=-1).tolist()
    assert all(abs(s.logprob - float(exact[i, s.token_id])) < 1e-5 for i, s in enumerate(alone))
    odd = logits[:3].clone()
    odd[0, 5] = float("inf")
    odd[1, 11] = float("nan")  # a broken row: the same token alone and together, a NaN logprob, no exception
    together, apart = greedy_steps(odd), [pick_token(odd[i], SamplingParams(), None) for i in range(3)]
    assert [s.token_id for s in together] == [s.token_id for s in apart] == [5, 11, alone[2].token_id]
    assert math.isnan(together[1].logprob) and together[2] == alone[2]


def test_an_artifact_symlinked_out_of_the_bundle_is_refused_before_loading(tmp_path):
    outside = tmp_path / "outside.ts"
    outside.write_bytes(b"not ours")
    bundle = tmp_path / "bundle"
    (bundle / "int8").mkdir(parents=True)
    (bundle / "int8" / "policy.ts").write_bytes(b"the real artifact")
    write_manifest(bundle, {"artifacts": {"int8_torchscript": "int8/policy.ts"}})
    manifest = read_manifest(bundle)
    assert verified_artifact(bundle, manifest, "int8_torchscript") == bundle / "int8" / "policy.ts"
    (bundle / "int8" / "policy.ts").unlink()
    (bundle / "int8" / "policy.ts").symlink_to(outside)
    with pytest.raises(BundleVerificationError, match="leads out of the bundle"):
        verified_artifact(bundle, manifest, "int8_torchscript")


class _Gauge:
    def labels(self, **_):
        return self

    def set(self, _):
        pass


def test_a_variant_serving_another_builds_manifest_is_not_ready():
    from policy_bundle.serve.router.pool import VariantPool

    def service(sha):
        async def health():
            return {"ready": True, "engine": "test", "manifest_sha256": sha}

        return SimpleNamespace(to_async=SimpleNamespace(health=health))

    metrics = SimpleNamespace(fp16_fallback=_Gauge(), engine=_Gauge(), set_variant=lambda *a: None)
    pool = VariantPool({"int8": service("a" * 64), "fp16": service("b" * 64)}, SimpleNamespace(health_timeout_s=3.0),
                       note=lambda *a: None, on_error=lambda *a: None, metrics=metrics, expected_manifest="a" * 64)
    health = asyncio.run(pool.refresh())
    assert health["int8"]["ready"] and not health["fp16"]["ready"] and not pool.ready()
    assert "not the router's pair" in health["fp16"]["error"]
    pool.expected_manifest = "b" * 64  # the control: the same probe against its own pair
    assert asyncio.run(pool.refresh())["fp16"]["ready"]


def test_the_router_stays_ready_while_one_variant_restarts_once_both_came_up():
    """/readyz needed both variants: one restarting took the pod out of its Service though fail-over could serve."""
    from policy_bundle.serve.router.pool import VariantPool

    up = {"int8": False, "fp16": True}

    def service(name):
        async def health():
            if not up[name]:
                raise ConnectionRefusedError("restarting")
            return {"ready": True, "engine": "test"}

        return SimpleNamespace(to_async=SimpleNamespace(health=health))

    notes = []
    pool = VariantPool({n: service(n) for n in up}, SimpleNamespace(health_timeout_s=3.0),
                       note=lambda *a: notes.append(a[0]), on_error=lambda *a: None,
                       metrics=SimpleNamespace(fp16_fallback=_Gauge(), engine=_Gauge(), set_variant=lambda *a: None))
    asyncio.run(pool.refresh())
    assert not pool.ready() and pool.degraded() == ["int8"]  # never came up whole: not ready
    up["int8"] = True
    asyncio.run(pool.refresh())
    assert pool.ready() and pool.degraded() == []
    up["int8"] = False
    for _ in range(3):  # three refused probes: down
        asyncio.run(pool.refresh())
    assert "variant-down" in notes and pool.ready() and pool.degraded() == ["int8"]  # FP16 serves everything
    up["fp16"] = False
    for _ in range(3):
        asyncio.run(pool.refresh())
    assert not pool.ready() and pool.degraded() == ["int8", "fp16"]  # nothing can serve


@pytest.mark.parametrize("health, why", [
    ({"engine_state": "dead"}, "its engine stopped"),
    ({"batch": {"decode_thread_alive": False}}, "its decode thread died"),
    ({"batch": {"active": 2, "pending": 1, "last_step_age_s": 5.0, "decode_thread_alive": True}},
     "stalled: no decode step for 5.0s while 3 request(s) wait"),
    ({"batch": {"active": 2, "pending": 0, "last_step_age_s": 0.5, "decode_thread_alive": True}}, None),  # working
    ({"batch": {"active": 0, "pending": 0, "last_step_age_s": 0.0, "decode_thread_alive": True}}, None),  # idle
    ({"engine_state": "running", "batch": None}, None),  # vLLM, alive
])
def test_a_variant_whose_probe_answers_but_whose_engine_cannot_serve_is_not_ready(health, why):
    from policy_bundle.serve.router.pool import VariantPool

    async def probe():
        return {"ready": True, "engine": "test", **health}

    pool = VariantPool({n: SimpleNamespace(to_async=SimpleNamespace(health=probe)) for n in ("int8", "fp16")},
                       SimpleNamespace(health_timeout_s=3.0), note=lambda *a: None, on_error=lambda *a: None,
                       metrics=SimpleNamespace(fp16_fallback=_Gauge(), engine=_Gauge(), set_variant=lambda *a: None))
    got = asyncio.run(pool.refresh())["int8"]
    if why is None:
        assert got["ready"] and not got.get("stalled")
    else:
        assert not got["ready"] and got["stalled"] and got["error"].startswith(why)


def test_a_vllm_engine_whose_core_died_reports_dead():
    from policy_bundle.serve.variants.engines import VllmEngine

    engine = VllmEngine.__new__(VllmEngine)
    engine.engine = SimpleNamespace(errored=False)
    assert engine.state() == "running"
    engine.engine = SimpleNamespace(errored=True)
    assert engine.state() == "dead"
