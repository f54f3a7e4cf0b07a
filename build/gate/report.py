"""The accuracy gate's outcome and its report: what a gate attempt is, what the gate decided, and
gate_report.md / .json with its plots (the search that produces the outcome: ``build/gate/fallback.py``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from torch import nn

from policy_bundle.bundle.layout import BundleLayout
from policy_bundle.quantize.fidelity.scores import FidelityReport, GateThresholds, GateVerdict
from policy_bundle.quantize.percentile import percentile


@dataclass
class Attempt:
    fp32_layers: List[str]
    metrics: dict
    verdict: str
    failures: List[str]


@dataclass
class GateOutcome:
    verdict: GateVerdict
    report: FidelityReport
    fp32_layers: List[str]
    int8: nn.Module
    attempts: List[Attempt] = field(default_factory=list)
    sensitivity: List[Tuple[str, float]] = field(default_factory=list)
    reasons: dict = field(default_factory=dict)  # layer kept in float -> why
    rejected: str = ""  # why the fallback search gave up early, or why the held-out gate prompts failed it
    search_metrics: Optional[dict] = None  # the final candidate on the search prompts (``report``: held out)


# ---- the report ------------------------------------------------------------------------------

METRICS = ("top1_agreement", "kl_mean", "kl_p99", "greedy_agreement", "reward_reference", "reward_candidate",
           "reward_delta", "flips_right_to_wrong", "flips_wrong_to_right")


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def report_json(outcome: GateOutcome, thresholds: GateThresholds, extra: Optional[dict] = None) -> dict:
    return {
        "verdict": outcome.verdict.label,
        "failures": outcome.verdict.failures,
        "thresholds": asdict(thresholds),
        "metrics": outcome.report.summary(),
        "search_metrics": outcome.search_metrics,
        "fp32_layers": [{"layer": n, "reason": outcome.reasons.get(n, "")} for n in outcome.fp32_layers],
        "sensitivity": [{"layer": n, "kl_mean_alone": kl} for n, kl in outcome.sensitivity],
        "attempts": [asdict(a) for a in outcome.attempts],
        **(extra or {}),
    }


def metrics_table(rows: Sequence[Tuple[str, dict]]) -> str:
    head = "| metric | " + " | ".join(name for name, _ in rows) + " |"
    sep = "|---" * (len(rows) + 1) + "|"
    lines = [head, sep]
    for m in METRICS:
        lines.append(f"| {m} | " + " | ".join(_fmt(r.get(m)) for _, r in rows) + " |")
    return "\n".join(lines)


def write_report(out_dir: Path, outcome: GateOutcome, thresholds: GateThresholds, extra: Optional[dict] = None) -> Path:
    """gate_report.json, gate_report.md and its two PNGs (sensitivity, per-token KL)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = BundleLayout(out_dir)
    body = report_json(outcome, thresholds, extra)
    layout.gate_report_json.write_text(json.dumps(body, indent=2))
    pngs = _plots(layout, outcome)
    md = [f"# Accuracy gate: **{body['verdict'].upper()}**", ""]
    if body["failures"]:
        md += ["Missed thresholds:", ""] + [f"- {f}" for f in body["failures"]] + [""]
    md += ["## Final candidate vs FP32 (the held-out gate prompts)", "", metrics_table([("INT8", body["metrics"])]), ""]
    md += ["## Thresholds", "", "\n".join(f"- `gate.{k}`: {v}" for k, v in body["thresholds"].items()), ""]
    if outcome.fp32_layers:
        md += ["## Layers kept in floating point", ""] + [f"- `{r['layer']}`: {r['reason']}" for r in body["fp32_layers"]] + [""]
    else:
        md += ["No layer fallback was needed.", ""]
    if len(outcome.attempts) > 1:
        md += ["## Fallback attempts", "", "| float layers | top-1 | KL mean | KL p99 | reward | verdict |", "|---|---|---|---|---|---|"]
        for a in outcome.attempts:
            m = a.metrics
            md.append(f"| {len(a.fp32_layers)} | {_fmt(m['top1_agreement'])} | {_fmt(m['kl_mean'])} | "
                      f"{_fmt(m['kl_p99'])} | {_fmt(m.get('reward_candidate'))} | {a.verdict} |")
        md.append("")
    cands = (extra or {}).get("candidates") or []
    if len(cands) > 1:
        md += ["## Recipe candidates (auto)", "", f"Winner: **{extra.get('winner_candidate', extra.get('winner'))}**: {extra.get('why')}.", "",
               "| recipe | verdict | float layers | top-1 | KL mean | KL p99 | reward | decode tok/s |",
               "|---|---|---|---|---|---|---|---|"]
        for cand in cands:
            m = cand["metrics"]
            md.append(f"| {cand.get('candidate', cand['scheme'])} | {cand['verdict']} | {len(cand['fp32_layers'])} | "
                      f"{_fmt(m['top1_agreement'])} | {_fmt(m['kl_mean'])} | {_fmt(m['kl_p99'])} | "
                      f"{_fmt(m.get('reward_candidate'))} | {_fmt(cand['decode_tok_s'])} |")
        md.append("")
        md += [f"- `{c['candidate']}`: {c.get('rejected') or c['not_gated']}" for c in cands
               if c.get("rejected") or c.get("not_gated")] + [""]
    md += [f"![{p.stem}]({p.name})" for p in pngs]
    layout.gate_report.write_text("\n".join(md) + "\n")
    return layout.gate_report


def _plots(layout: BundleLayout, outcome: GateOutcome) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    if outcome.sensitivity:
        names = [n for n, _ in outcome.sensitivity][::-1]
        vals = [v for _, v in outcome.sensitivity][::-1]
        fig, ax = plt.subplots(figsize=(8, max(3, 0.22 * len(names))))
        colors = ["tab:red" if n in outcome.fp32_layers else "tab:blue" for n in names]
        ax.barh(names, vals, color=colors)
        ax.set_xscale("log")
        ax.set_xlabel("KL(FP32 || only this layer INT8), mean per token (red: kept in float)")
        ax.tick_params(axis="y", labelsize=7)
        fig.tight_layout()
        paths.append(layout.sensitivity_plot)
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    kl = [max(v, 1e-12) for v in outcome.report.kl_per_token]
    if kl:
        import numpy as np

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.hist(np.log10(kl), bins=40, color="tab:purple")
        ax.set_xlabel("log10 KL(FP32 || INT8) per token")
        ax.set_ylabel("tokens")
        ax.set_title(f"mean {np.mean(kl):.3g}, p99 {percentile(kl, 0.99, method='linear'):.3g}, {len(kl)} tokens")
        fig.tight_layout()
        paths.append(layout.kl_plot)
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    return paths


def add_artifact_comparison(out_dir: Path, fidelity: dict) -> None:
    """Append the exported artifacts side by side (INT8 TorchScript, ONNX, FP16 weights) vs FP32 to the report."""
    layout = BundleLayout(out_dir)
    md, js = layout.gate_report, layout.gate_report_json
    if not md.is_file():
        return
    names = {"int8_torchscript": "INT8 TorchScript", "int8_onnx": "INT8 ONNX", "fp16_hf": "FP16 directory",
             "int8_vllm": "INT8 W8A8 in vLLM"}
    rows = [(names.get(k, k), v) for k, v in fidelity.items()]
    md.write_text(md.read_text() + "\n## Exported artifacts vs FP32 (the gate's golden items; see each artifact's "
                  "notes)\n\n" + metrics_table(rows) + "\n")
    body = json.loads(js.read_text())
    body["artifacts_vs_fp32"] = fidelity
    js.write_text(json.dumps(body, indent=2))
