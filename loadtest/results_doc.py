"""docs/benchmarks.md's generated tables, written from the benchmarks' JSON results in docs/results/, so a figure in
them is never copied by hand.

    .venv/bin/python -m policy_bundle.loadtest.results_doc            # rewrite every generated table
    .venv/bin/python -m policy_bundle.loadtest.results_doc --check    # exit 1 naming each table that differs

A benchmark run with ``--json docs/results/NAME.json`` writes its figures with the command that made them and the CPU
it ran on (``write_result``). docs/benchmarks.md holds each generated table between ``<!-- results: NAME -->`` and
``<!-- /results -->``; what is between them is replaced by the rendering of NAME.json (its ``benchmark`` picks the
renderer). Everything outside the markers is prose, written by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "docs" / "results"
BLOCK = re.compile(r"(<!-- results: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16")


def cpu() -> Dict[str, object]:
    """This machine's CPU: its model name, the instruction sets the kernels choose by, the cores this process may use."""
    from policy_bundle.quantize.runtime.fbgemm_int8 import cpu_flags  # torch: only where a result is written

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = cpu_flags()
    return {"model": model, "flags": [f for f in FLAGS if f in flags], "cores": len(os.sched_getaffinity(0))}


def write_result(path: Path, benchmark: str, figures: dict, argv: List[str] = None) -> Path:
    """``figures`` of ``benchmark`` as ``path`` (JSON), with the command that made them and this machine's CPU."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    args = list(sys.argv[1:] if argv is None else argv)
    if "--json" in args:  # where the figures went is not part of how they were made
        del args[args.index("--json"):args.index("--json") + 2]
    args = [a for a in args if not a.startswith("--json=")]
    threads = os.environ.get("OMP_NUM_THREADS")  # how many threads torch used is part of how they were made
    command = " ".join([f"OMP_NUM_THREADS={threads}" if threads else "", ".venv/bin/python -m",
                        f"policy_bundle.loadtest.{benchmark}", shlex.join(args)]).strip()
    path.write_text(json.dumps({"benchmark": benchmark, "command": command, "cpu": cpu(), "figures": figures},
                               indent=1) + "\n")
    return path


def cpu_text(c: dict) -> str:
    flags = [f for f in c.get("flags", []) if f in ("avx2", "avx512f", "avx512_vnni", "amx_int8")]
    sets = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "amx_int8": "AMX"}
    return f"{c.get('model', '?')} ({' + '.join(sets[f] for f in flags) or 'no AVX2'}), {c.get('cores', '?')} cores"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def render_build(res: dict) -> str:
    """``bench_build``: one build's time, memory by stage and the gate's verdict."""
    f = res["figures"]
    gate = f.get("gate") or {}
    held = gate.get("held_out") or {}
    verdict = f"{f['verdict']}" + (f", `{gate['recipe']}`" if gate.get("recipe") else "") + (
        f", {f['fp32_layers']} float linears" if f.get("fp32_layers") is not None else "")
    if held:
        verdict += ": held out " + ", ".join(f"{label} {held[k]:.4g}" for k, label in
                                             (("top1", "top-1"), ("kl_mean", "KL mean"), ("greedy", "greedy")) if k in held)
    lines = [f"`{res['command']}` on {cpu_text(res['cpu'])}:", "",
             "| policy | build time | peak RSS, all build processes | peak PSS | CLI alone | vLLM check (own line) | gate |",
             "|---|---|---|---|---|---|---|",
             f"| {f['policy']} ({f['dtype']}, {_gb(f['weights_bytes'])}), calibration.procs {f['procs']} "
             f"| {f['seconds'] / 60:.1f} min | {_gb(f['rss'])} ({f['rss'] / f['weights_bytes']:.1f}x the weights, "
             f"{f['processes']} processes) | {_gb(f['pss'])} | {_gb(f['main_rss'])} | {_gb(f['vllm_rss'])} "
             f"| {verdict} (exit {f['rc']}) |", "",
             "| stage | time | peak RSS, all build processes | peak PSS | CLI alone |", "|---|---|---|---|---|"]
    for st in f["stages"]:  # in the build's order
        name = st["stage"]
        took = f"{st['seconds']:.1f} s" if st.get("seconds") is not None else "-"
        lines.append(f"| {name} | {took} | {_gb(st['rss'])} | {_gb(st['pss'])} | {_gb(st['main_rss'])} |")
    return "\n".join(lines) + "\n"


NAMES = {"int8": "INT8 TorchScript (1 thread)", "float16": "vLLM FP16", "bfloat16": "vLLM BF16",
         "llama.cpp": "llama.cpp Q8_0 (1 thread, float16 cache)"}


def render_context(res: dict) -> str:
    """``bench_context``: decode tok/s at batch 1 by context position, per engine, and the ratios the targets name."""
    f = res["figures"]
    positions, engines = f["positions"], f["engines"]
    lines = [f"`{res['command']}` on {cpu_text(res['cpu'])}, medians of {f['repeats']}, {f['tokens']} decode steps "
             "timed after a prompt of each length:", "",
             "| engine | " + " | ".join(f"pos {p}" for p in positions) + f" | pos {positions[-1]} vs {positions[0]} | "
             "KV bytes/token |", "|---|" + "---|" * (len(positions) + 2)]
    for engine, fig in engines.items():
        name = NAMES.get(engine, f"INT8 TorchScript, {engine.partition(':')[2]} KV cache (1 thread)")
        lines.append(f"| {name} | " + " | ".join(f"{fig[str(p)]:.1f}" for p in positions)
                     + f" | {fig[str(positions[-1])] / fig[str(positions[0])]:.2f}x | {fig['kv_bytes_per_token']} |")
    for peer in ("llama.cpp", "float16"):
        if "int8" in engines and peer in engines:
            lines.append("")
            lines.append(f"INT8 against {NAMES[peer]}: " + ", ".join(
                f"{engines['int8'][str(p)] / engines[peer][str(p)]:.2f}x at {p}" for p in positions) + ".")
    return "\n".join(lines) + "\n"


def table(columns: List[str], rows: List[list], title: str = "") -> dict:
    """A table as a benchmark keeps it in its results (``figures["tables"]``): column names, rows of cells (a number
    or text, rounded by the benchmark to the precision it means), and an optional line above it."""
    for r in rows:
        if len(r) != len(columns):
            raise ValueError(f"table row {r!r}: {len(r)} cells for {len(columns)} columns")
    return {"title": title, "columns": list(columns), "rows": [list(r) for r in rows]}


def _cell(v) -> str:
    """A number as the benchmark rounded it (13.0 stays 13.0 beside 0.8), a bool as yes/no; a ``|`` escaped."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v).replace("|", "\\|")


def markdown(t: dict) -> str:
    """One table as docs/benchmarks.md shows it (and the benchmark prints it)."""
    lines = [t["title"], ""] if t.get("title") else []
    lines += ["| " + " | ".join(_cell(c) for c in t["columns"]) + " |", "|" + "---|" * len(t["columns"])]
    lines += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in t["rows"]]
    return "\n".join(lines) + "\n"


def render_tables(res: dict) -> str:
    """A benchmark whose figures are tables (``table``): the command and CPU, what was run (``lead``), each table,
    then the lines the benchmark derived from them (``notes``: ratios, whether outputs were equal)."""
    f = res["figures"]
    head = f"`{res['command']}` on {cpu_text(res['cpu'])}" + (f", {f['lead']}" if f.get("lead") else "") + ":"
    parts = [head + "\n"] + [markdown(t) for t in f["tables"]]
    if f.get("notes"):
        parts.append("\n".join(f["notes"]) + "\n")
    return "\n".join(parts)


def write_tables(path: Path, benchmark: str, lead: str, tables: List[dict], notes: List[str] = (),
                 argv: List[str] = None, **figures) -> Path:
    """``write_result`` of a benchmark whose figures are tables, with any raw figures beside them."""
    return write_result(path, benchmark, {"lead": lead, "tables": tables, "notes": list(notes), **figures}, argv)


RENDERERS: Dict[str, Callable[[dict], str]] = {"bench_build": render_build, "bench_context": render_context}


def renderer(res: dict) -> Callable[[dict], str]:
    """The benchmark's own renderer, else the tables renderer where its figures are tables."""
    if res.get("benchmark") in RENDERERS:
        return RENDERERS[res["benchmark"]]
    if isinstance(res.get("figures"), dict) and "tables" in res["figures"]:
        return render_tables
    raise KeyError(res.get("benchmark"))


def render(doc: str, results: Path) -> str:
    """``doc`` with every generated block rewritten from ``results``/NAME.json; a block without its file is an error."""
    def block(m: re.Match) -> str:
        path = results / f"{m['name']}.json"
        if not path.is_file():
            raise SystemExit(f"results_doc: {DOC.name} names {m['name']!r}, but {path} does not exist")
        res = json.loads(path.read_text())
        try:
            how = renderer(res)
        except KeyError:
            raise SystemExit(f"results_doc: {path}: benchmark {res.get('benchmark')!r} has no renderer and no tables "
                             f"(renderers: {', '.join(RENDERERS)})") from None
        return m.group(1) + how(res) + m.group(4)

    return BLOCK.sub(block, doc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a generated table differs")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    doc = args.doc.read_text()
    new = render(doc, args.results)
    if args.check:
        stale = [m["name"] for m, n in zip(BLOCK.finditer(doc), BLOCK.finditer(new)) if m["body"] != n["body"]]
        if stale:
            print(f"results_doc: {args.doc} differs from {args.results} in: {', '.join(stale)} (run "
                  "python -m policy_bundle.loadtest.results_doc)", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(new)
    print(f"{args.doc}: {len(BLOCK.findall(new))} generated tables from {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
