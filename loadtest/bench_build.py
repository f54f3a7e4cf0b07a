"""The build's cost on policies of real shape: build time and peak memory summed over every process the build starts.

A policy is a randomly initialised transformers Qwen3 of a real shape (``--shape``: 0.6b, 1.7b, or 0.3b for the
scale test), saved as safetensors in float32 or bfloat16 with SmolLM2's tokenizer, or the real-LM fixture
(``--shape smollm2``). The build runs as a user would run it (the CLI, a config that sets only the model path,
``recipe.scheme: auto``, the shipped gate and ``register.bentoml: false``); every second the resident sets of the
CLI and all its descendants are summed (RSS, and PSS, which counts a page shared by several processes once). The
vLLM process that checks ``int8-vllm/`` is reported on its own line. Prints one table row per build; nothing is
asserted (random weights are for cost only: their gate verdict is reported, not judged).

    .venv/bin/python -m policy_bundle.loadtest.bench_build --shape 0.6b --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

SHAPES = {  # layers, hidden, intermediate, heads, kv heads, head_dim
    "0.3b": (16, 1024, 3072, 16, 8, 128),
    "0.6b": (28, 1024, 3072, 16, 8, 128),
    "1.7b": (28, 2048, 6144, 16, 8, 128),
}
VOCAB = 49152
GATE = {"min_top1_agreement": 0.98, "max_kl_mean": 0.005, "min_greedy_agreement": 0.5}


def make_policy(shape: str, dtype: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised Qwen3 of ``shape`` (transformers' own init), saved in ``dtype``, with a tokenizer."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    layers, hidden, inter, heads, kv, head_dim = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, tie_word_embeddings=True,
                      max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="100GB")
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


def tree(pid: int) -> List[int]:
    """``pid`` and all its descendants."""
    children: Dict[int, List[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def resident(pid: int) -> Tuple[int, int, bool]:
    """(RSS, PSS) in bytes and whether the process is a vLLM one."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return 0, 0, False
    val = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in rollup[1:] if ln.split()[-1] == "kB"}
    return val.get("Rss", 0), val.get("Pss", 0), "vllm" in cmd.lower() or "EngineCore" in cmd


def run_build(config: Path, out: Path, log: Path, extra_env: Optional[dict] = None,
              stop_after: Optional[float] = None) -> dict:
    """Run the build, sampling memory every second; ``stop_after`` seconds: stop it there (its process group) and
    report what it reached."""
    env = {**os.environ, **(extra_env or {})}
    cmd = [sys.executable, "-m", "policy_bundle.build.cli", "build", "--config", str(config), "--out", str(out),
           "--force"]
    t0 = time.monotonic()
    peak = {"rss": 0, "pss": 0, "vllm_rss": 0, "procs": 0, "main_rss": 0}
    stages: Dict[str, Dict[str, int]] = {}  # the build's stage -> its peaks (RSS, PSS, the CLI alone)
    last = t0
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while proc.poll() is None:
            if stop_after is not None and time.monotonic() - t0 > stop_after and "stopped" not in peak:
                peak["stopped"] = f"stopped at {(time.monotonic() - t0) / 60:.1f} min in {current_stage(log)}"
                print(f"[bench] {peak['stopped']}", flush=True)
                os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its actors
                proc.wait()
                break
            if time.monotonic() - last >= 30:  # the peaks so far and the build's own last line, every 30 s
                last = time.monotonic()
                lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
                print(f"[bench] {last - t0:.0f}s: peak RSS {peak['rss'] / 1e9:.2f} GB, PSS {peak['pss'] / 1e9:.2f} GB "
                      f"(CLI {peak['main_rss'] / 1e9:.2f} GB, vLLM {peak['vllm_rss'] / 1e9:.2f} GB); build: "
                      f"{lines[-1][:160] if lines else '-'}", flush=True)
            rss = pss = vllm = 0
            pids = tree(proc.pid)
            for p in pids:
                r, s, is_vllm = resident(p)
                if is_vllm:
                    vllm += r
                else:
                    rss, pss = rss + r, pss + s
            main = resident(proc.pid)[0]
            peak["main_rss"] = max(peak["main_rss"], main)
            st = stages.setdefault(current_stage(log), {"rss": 0, "pss": 0, "main_rss": 0})
            st["rss"], st["pss"], st["main_rss"] = max(st["rss"], rss), max(st["pss"], pss), max(st["main_rss"], main)
            if rss > peak["rss"]:
                peak["procs"] = len(pids)
            peak["rss"], peak["pss"], peak["vllm_rss"] = max(peak["rss"], rss), max(peak["pss"], pss), max(peak["vllm_rss"], vllm)
            time.sleep(1.0)
    peak["seconds"] = time.monotonic() - t0
    peak["stages"] = stages
    peak["rc"] = proc.returncode
    manifest = out / "bundle.json"
    if "stopped" in peak:
        peak["verdict"] = peak["stopped"]
    elif manifest.is_file():
        m = json.loads(manifest.read_text())
        peak["verdict"] = m.get("gate", {}).get("verdict")
        peak["fp32_layers"] = len(m.get("recipe", {}).get("fp32_layers", []))
    else:
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
        peak["verdict"] = lines[-1][:300] if lines else "no output"
    return peak


def current_stage(log: Path) -> str:
    """The stage the build's log last started ("[4/9] calibrate ..."), or "start"."""
    started = [ln for ln in log.read_text(errors="replace").splitlines()
               if ln.startswith("[") and ln.rstrip().endswith(" ...") and "/" in ln.split("]")[0]]
    return started[-1].split("] ", 1)[1].rstrip(" .") if started else "start"


def write_config(path: Path, source: Path, procs: Optional[int]) -> Path:
    lines = ["name: bench-build", "policy:", f"  source: {source}", "recipe:", "  scheme: auto", "gate:"]
    lines += [f"  {k}: {v}" for k, v in GATE.items()]
    lines += ["register:", "  bentoml: false"]
    if procs is not None:
        lines += ["calibration:", f"  procs: {procs}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=[*SHAPES, "smollm2"], default="0.6b")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--procs", type=int, default=None, help="calibration.procs (default: the build's default)")
    ap.add_argument("--stop-after", type=float, default=None, metavar="MIN",
                    help="stop the build after this many minutes and report the stages it reached")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "policy-bundle" / "bench-build")
    ap.add_argument("--json", type=Path, help="also write the figures here (docs/results/NAME.json: "
                    "loadtest/results_doc.py renders them into docs/benchmarks.md)")
    args = ap.parse_args()
    from policy_bundle.loadtest.real_lm import smollm2_dir

    smol = Path(smollm2_dir())
    args.work.mkdir(parents=True, exist_ok=True)
    if args.shape == "smollm2":
        source = smol
    else:
        source = make_policy(args.shape, args.dtype, args.work / f"qwen3-{args.shape}-{args.dtype}", smol)
    weights = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    tag = f"{args.shape}-{args.dtype}-procs{args.procs}"
    cfg = write_config(args.work / f"{tag}.yaml", source, args.procs)
    r = run_build(cfg, args.work / f"bundle-{tag}", args.work / f"{tag}.log",
                  stop_after=None if args.stop_after is None else args.stop_after * 60)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    print("| policy | source | procs | build time | peak RSS, all build processes | peak PSS | CLI alone | "
          "vLLM check (own line) | gate |")
    print(f"| {args.shape} | {args.dtype} {weights / 1e9:.2f} GB | {args.procs if args.procs is not None else 'default'} "
          f"| {r['seconds'] / 60:.1f} min | {r['rss'] / 1e9:.2f} GB ({r['rss'] / weights:.2f}x weights, "
          f"{r['procs']} processes) | {r['pss'] / 1e9:.2f} GB | {r['main_rss'] / 1e9:.2f} GB | "
          f"{r['vllm_rss'] / 1e9:.2f} GB | {r['verdict']} (rc {r['rc']}) |")
    print("\n| stage | peak RSS, all build processes | peak PSS | CLI alone |\n|---|---|---|---|")
    for name, st in r["stages"].items():
        print(f"| {name} | {st['rss'] / 1e9:.2f} GB | {st['pss'] / 1e9:.2f} GB | {st['main_rss'] / 1e9:.2f} GB |")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; log: {args.work / (tag + '.log')}")
    if args.json:
        from policy_bundle.loadtest.results_doc import write_result

        took = stage_seconds(args.work / f"{tag}.log")
        figures = {"policy": "SmolLM2-135M-Instruct" if args.shape == "smollm2" else f"random Qwen3-{args.shape} shape",
                   "dtype": args.dtype, "weights_bytes": weights,
                   "procs": args.procs if args.procs is not None else "default",
                   **{k: r[k] for k in ("seconds", "rss", "pss", "main_rss", "vllm_rss", "verdict", "rc")},
                   "processes": r.get("procs", 0), "fp32_layers": r.get("fp32_layers"),
                   "gate": gate_summary(args.work / f"bundle-{tag}"),
                   "stages": [{"stage": name, **st, "seconds": took.get(name)} for name, st in r["stages"].items()]}
        print(f"figures: {write_result(args.json, 'bench_build', figures)}")


def stage_seconds(log: Path) -> Dict[str, float]:
    """Each stage's time, from the build's own "[i/n] NAME done in Xs" lines."""
    out = {}
    for ln in log.read_text(errors="replace").splitlines():
        m = re.match(r"\[\d+/\d+\] (.+?) done in ([\d.]+)s", ln)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def gate_summary(bundle: Path) -> dict:
    """The shipped recipe and its held-out figures, from the bundle's manifest and gate report (empty when the build
    wrote neither)."""
    manifest, report = bundle / "bundle.json", bundle / "gate_report.json"
    if not manifest.is_file():
        return {}
    recipe = json.loads(manifest.read_text()).get("recipe") or {}
    out = {"recipe": " ".join([str(recipe.get("scheme")), *([f"skip=[{', '.join(recipe['skip'])}]"]
                                                           if recipe.get("skip") else [])])}
    if report.is_file():
        held = json.loads(report.read_text()).get("metrics") or {}  # the gate's verdict: the held-out prompts
        out["held_out"] = {k: held[name] for k, name in (("top1", "top1_agreement"), ("kl_mean", "kl_mean"),
                                                         ("greedy", "greedy_agreement"))
                           if isinstance(held.get(name), (int, float))}
    return out


if __name__ == "__main__":
    main()
