"""A drill's report: report.md, PNG plots and a JSON of the raw figures."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from policy_bundle.loadtest.soak import WARM_UP  # noqa: E402
from policy_bundle.quantize.percentile import percentile  # noqa: E402


def _buckets(run):
    """About 40 buckets whatever the drill's length, 1 s at least."""
    end = max([r["t"] for r in run.requests] + [s["t"] for s in run.states] + [1.0])
    step = max(1.0, round(end / 40))
    return np.arange(0.0, end + step, step)


def plot_traffic(run, path: Path) -> None:
    edges = _buckets(run)
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for variant, color in (("int8", "tab:orange"), ("fp16", "tab:blue")):
        counts = np.histogram([r["t"] for r in run.requests if r["variant"] == variant], edges)[0]
        total = np.maximum(np.histogram([r["t"] for r in run.requests], edges)[0], 1)
        ax.step(edges[:-1], 100 * counts / total, where="post", color=color, label=f"{variant} share of requests")
    if run.states:
        ax.plot([s["t"] for s in run.states], [s["weight"] for s in run.states], "k--", label="INT8 weight (rollout)")
    for e in run.history:
        if e["event"] in ("promote", "rollback", "analysis-failed", "promoted", "waiting"):
            t = e["ts"] - run.wall_t0
            ax.axvline(t, color={"rollback": "red", "analysis-failed": "tab:red"}.get(e["event"], "green"), alpha=0.4)
            ax.text(t, 102, e["event"], rotation=90, fontsize=7, va="bottom")
    for m in run.marks:
        ax.axvline(m["t"], color="grey", ls="--", alpha=0.6)
        ax.text(m["t"], 112, m["label"], fontsize=7, va="bottom")
    ax.set_ylim(0, 125)
    ax.set_xlabel("seconds")
    ax.set_ylabel("% of traffic")
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_latency(run, path: Path) -> None:
    edges = _buckets(run)
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for variant, color in (("int8", "tab:orange"), ("fp16", "tab:blue")):
        for q, style in ((50, "-"), (95, "--"), (99, ":")):
            xs, ys = [], []
            for lo, hi in zip(edges[:-1], edges[1:]):
                lat = [r["latency"] for r in run.requests if r["variant"] == variant and lo <= r["t"] < hi]
                if lat:
                    xs.append(lo)
                    ys.append(1000 * percentile(lat, q / 100, method="linear"))
            ax.plot(xs, ys, style, color=color, label=f"{variant} p{q}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("latency (ms)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_canary(run, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 3.2))
    rows = [(e["ts"] - run.wall_t0, e["metrics"]) for e in run.history if e.get("metrics")]
    for key, label in (("shadow_agreement", "shadow greedy agreement"), ("int8_error_rate", "INT8 error rate")):
        pts = [(t, m[key]) for t, m in rows if m.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", label=label)
    pts = [(t, m["golden"]["greedy_agreement"]) for t, m in rows if (m.get("golden") or {}).get("greedy_agreement") is not None]
    if pts:
        ax.plot(*zip(*pts), "s-", label="golden greedy agreement (INT8 vs FP32)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("seconds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_load(run, path: Path) -> None:
    """Offered load by outcome per second, admitted latency and the server's memory (overload drill)."""
    end = max([r["t"] for r in run.requests] + [1.0])
    edges = np.arange(0.0, end + 1.0, 1.0)
    fig, (ax, ax_lat, ax_mem) = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    outcomes = (("200", lambda r: r["status"] == 200, "tab:green"),
                ("429/503 + Retry-After", lambda r: r["status"] in (429, 503), "tab:orange"),
                ("other failure", lambda r: r["status"] not in (200, 429, 503), "tab:red"))
    for label, pick, color in outcomes:
        ax.step(edges[:-1], np.histogram([r["t"] for r in run.requests if pick(r)], edges)[0], where="post",
                color=color, label=label)
    ax.set_ylabel("requests/s")
    ax.legend(fontsize=7)
    ok = [r for r in run.requests if r["status"] == 200]
    ax_lat.plot([r["t"] for r in ok], [1000 * r["latency"] for r in ok], ".", ms=2, alpha=0.5, color="tab:blue")
    ax_lat.set_ylabel("admitted latency (ms)")
    ax_mem.plot([x["t"] for x in run.rss], [x["mb"] for x in run.rss], color="k")
    ax_mem.set_ylabel("server RSS (MB)")
    ax_mem.set_xlabel("seconds")
    for a in (ax, ax_lat, ax_mem):
        for m in run.marks:
            a.axvline(m["t"], color="grey", ls="--", alpha=0.6)
    for m in run.marks:
        ax.text(m["t"], ax.get_ylim()[1], m["label"], fontsize=7, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_memory(run, path: Path) -> None:
    """RSS (MB) of every server process against requests served, with the line fitted after warm-up (soak)."""
    labels = sorted({s["label"] for s in run.memory})
    fig, axes = plt.subplots(len(labels), 1, figsize=(9, 1.9 * len(labels) + 0.6), sharex=True, squeeze=False)
    fitted = {g.label: g for g in run.growth}
    for ax, label in zip(axes[:, 0], labels):
        rows = sorted((s for s in run.memory if s["label"] == label), key=lambda s: s["requests"])
        x, y = np.array([s["requests"] for s in rows], float), np.array([s["mb"] for s in rows], float)
        ax.plot(x, y, ".-", ms=3, color="k")
        g = fitted.get(label)
        if g is not None and np.isfinite(g.kb_per_request):
            tx, ty = x[int(len(x) * WARM_UP):], y[int(len(y) * WARM_UP):]  # a least-squares line goes through the means
            ax.plot(tx, ty.mean() + g.kb_per_request / 1024 * (tx - tx.mean()), "--", color="tab:red",
                    label=f"{g.mb_per_1000_requests:+.3f} MB / 1000 requests")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_ylabel(f"{label}\nRSS (MB)", fontsize=8)
    axes[-1, 0].set_xlabel("requests served")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def memory_table(run) -> list:
    md = ["", "## Memory per server process (after warm-up: a line fitted over the last 80 % of samples)", "",
          "| process | pid | first MB | last MB | MB per 1000 requests | KB per request |", "|---|---|---|---|---|---|"]
    return md + [f"| {g.label} | {g.pid} | {g.first_mb:.1f} | {g.last_mb:.1f} | {g.mb_per_1000_requests:+.3f} | "
                 f"{g.kb_per_request:+.4f} |" for g in run.growth]


def write_report(run) -> Path:
    import time

    run.wall_t0 = time.time() - (time.monotonic() - run.t0)
    plots = {"traffic.png": plot_traffic, "latency.png": plot_latency, "canary.png": plot_canary}
    if run.rss:
        plots["load.png"] = plot_load
    if run.memory:
        plots["memory.png"] = plot_memory
    for name, fn in plots.items():
        fn(run, run.out / name)
    ok = sum(r["status"] == 200 for r in run.requests)
    by_variant = {v: sum(r["variant"] == v for r in run.requests) for v in ("int8", "fp16")}
    lat = {v: [r["latency"] for r in run.requests if r["variant"] == v and r["status"] == 200] for v in ("int8", "fp16")}
    figures = {"drill": run.name, "passed": run.passed, "checks": run.checks, "requests": len(run.requests),
               "ok": ok, "by_variant": by_variant,
               "latency_ms": {v: {f"p{q}": 1000 * percentile(x, q / 100, method="linear") for q in (50, 95, 99)}
                              for v, x in lat.items() if x},
               "failures": [r for r in run.requests if r["status"] != 200],
               "figures": run.figures, "history": run.history, "states": run.states, "rss": run.rss,
               "memory": run.memory}
    (run.out / "report.json").write_text(json.dumps(figures, indent=2, default=str))
    md = [f"# Drill `{run.name}`: {'PASSED' if run.passed else 'FAILED'}", ""]
    md += [f"- {'✅' if okk else '❌'} {what}" for what, okk in run.checks] + [""]
    md += [f"{len(run.requests)} requests, {ok} answered 200; by variant: {by_variant}.", ""]
    md += ["| variant | p50 ms | p95 ms | p99 ms |", "|---|---|---|---|"]
    for v, q in figures["latency_ms"].items():
        md.append(f"| {v} | {q['p50']:.0f} | {q['p95']:.0f} | {q['p99']:.0f} |")
    if run.figures:
        md += ["", "## Figures", "", "| figure | value |", "|---|---|"]
        md += [f"| {k} | {v:.1f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in run.figures.items()
               if k != "memory_growth"]  # in the table below
    if run.growth:
        md += memory_table(run)
    md += ["", "## Rollout history", "", "| t (s) | event | weight | reason |", "|---|---|---|---|"]
    for e in run.history:
        md.append(f"| {e['ts'] - run.wall_t0:.0f} | {e['event']} | {e['from_weight']} → {e['to_weight']} | "
                  f"{e['reason'][:120]} |")
    md += [""] + [f"![{name[:-4]}]({name})\n" for name in plots]
    (run.out / "report.md").write_text("\n".join(md))
    return run.out / "report.md"
