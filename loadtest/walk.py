"""How far a build config and a streamed chat request travel: the project files their calls cross, and how often
the walk goes back to a file it had already left.

    .venv/bin/python -m policy_bundle.loadtest.walk [--root CHECKOUT] [--config build/configs/main.yaml] [--set K=V]
    .venv/bin/python -m policy_bundle.loadtest.walk --chat [--root CHECKOUT] [--set KEY=VALUE ...]
    .venv/bin/python -m policy_bundle.loadtest.walk --compare LABEL=CHECKOUT ... [--json OUT]

The build walk runs one build in this process (the embedded reference policy by default, no mesh, no ONNX, nothing
registered) under ``sys.setprofile`` and records, in call order, the project file of every call whose arguments hold
the build config or a section of it.

The chat walk builds the embedded reference policy with ``CHECKOUT``'s own CLI (default: this one; any version of
the project, so a layout can be compared with an older one's) into a fresh BentoML store, serves it with a real
``bentoml serve`` whose processes load ``loadtest/walk_site/sitecustomize.py``, warms it with one request, then
records every call in a project file made by each server process while one streamed chat completion (16 tokens,
greedy, pinned to the INT8 variant) is answered: three times, keeping each process's shortest record (the one with
the fewest calls of background loops, health probes among them).

Both print the files in first-visit order, their count and the returns (a call in a file visited before, other than
the one just left). A measure of the code's layout, not a test. ``--compare`` runs both walks of each checkout named
(``this`` is this one), each in a fresh process, and prints them side by side as one table (``--json``: as
docs/results/ keeps it, ``loadtest/results_doc.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]


def walk(files: List[str]) -> dict:
    """Distinct files in first-visit order and the returns to one already left."""
    seen, order, returns, last = set(), [], 0, None
    for f in files:
        if f == last:
            continue
        if f in seen:
            returns += 1
        else:
            seen.add(f)
            order.append(f)
        last = f
    return {"files": len(order), "returns": returns, "calls": len(files), "order": order}


def chat_walk(root: Path, overrides: List[str], repeats: int = 3) -> List[dict]:
    """One streamed chat request's walk in each server process of ``root``'s checkout (see the module's doc)."""
    import os
    import signal
    import subprocess
    import time

    import httpx

    from policy_bundle.loadtest.servers import free_port

    root = root.resolve()
    target = ("policy_bundle.serve.router.service:PolicyRouter" if (root / "serve" / "router").is_dir()
              else "policy_bundle.serve.service:PolicyRouter")
    config = next(c for c in (root / "build/configs/main.yaml", root / "build/configs/reference.yaml") if c.is_file())
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        trace_dir = tmp / "walk"
        trace_dir.mkdir()
        env = {**os.environ, "BENTOML_HOME": str(tmp / "bentoml"), "PYTHONPATH": str(root),
               "POLICY_BUNDLE_DISABLE_VLLM": "1", "POLICY_BUNDLE_ADMIN_TOKEN": "walk-token",
               "POLICY_BUNDLE_STATE_DIR": str(tmp / "state")}
        build = subprocess.run([sys.executable, "-m", "policy_bundle.build.cli", "build", "--config", str(config),
                                "--out", str(tmp / "bundle"), *[a for o in overrides for a in ("--set", o)]],
                               cwd=root, env=env, capture_output=True, text=True)
        if build.returncode != 0:
            raise SystemExit(f"walk: the build in {root} failed:\n{build.stderr[-3000:]}")
        port = free_port()
        site = Path(__file__).resolve().parent / "walk_site"
        serve_env = {**env, "PYTHONPATH": f"{site}{os.pathsep}{root}", "POLICY_BUNDLE_WALK_DIR": str(trace_dir),
                     "POLICY_BUNDLE_WALK_ROOT": str(root)}
        log = (tmp / "serve.log").open("w")
        proc = subprocess.Popen([sys.executable, "-m", "bentoml", "serve", target, "--host", "127.0.0.1", "--port",
                                 str(port)], cwd=root, env=serve_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"walk: the server did not come up:\n{(tmp / 'serve.log').read_text()[-3000:]}")
                try:
                    if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            body = {"model": "policy", "messages": [{"role": "user", "content": "358+64="}], "max_tokens": 16,
                    "temperature": 0, "stream": True}
            headers = {"x-policy-variant": "int8", "x-admin-token": "walk-token",
                       "authorization": "Bearer walk-token"}

            def stream() -> str:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers,
                                  timeout=300) as r:
                    text = r.read().decode()
                    if r.status_code != 200 or "[DONE]" not in text:
                        raise SystemExit(f"walk: the chat request failed: {r.status_code} {text[:500]}\n"
                                         f"{(tmp / 'serve.log').read_text()[-6000:]}")
                    return text

            for attempt in range(30):  # warm: lazy imports, first-call caches; a variant may still be probed down
                try:
                    stream()
                    break
                except SystemExit:
                    if attempt == 29:
                        raise
                    time.sleep(2)
            best, seen = {}, {}  # per process, the fewest calls of ``repeats`` recorded requests: the least of
            for _ in range(repeats):  # the background loops' (health probes, metrics) calls that fall in the window
                for f in trace_dir.glob("[0-9]*.json"):
                    f.unlink()
                (trace_dir / "on").touch()
                time.sleep(0.2)  # each process polls the flag every 50 ms
                stream()
                (trace_dir / "on").unlink()
                time.sleep(1.0)
                for f in trace_dir.glob("[0-9]*.json"):
                    record = json.loads(f.read_text())
                    argv, calls = " ".join(record["argv"]), record["calls"]
                    if not calls:
                        continue
                    seen[argv] = seen.get(argv, 0) + 1
                    if argv not in best or len(calls) < best[argv]["calls"]:
                        path = [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]  # file:function
                        best[argv] = {"process": argv[-120:], "path": path,
                                      **walk([c.rsplit(":", 1)[0] for c in calls])}
            # a process with no call during one of the requests made none of them for the request
            runs = [best[argv] for argv in sorted(best) if seen[argv] == repeats]
            return runs
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()


def _json_lines(out: str) -> List[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _walk_process(root: Path, chat: bool) -> str:
    """One walk of ``root`` in a fresh process of this file (as a script: another checkout's code comes first)."""
    import subprocess

    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), *(["--chat"] if chat else []), "--root",
                          str(root)], capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"walk: the {'chat' if chat else 'build'} walk of {root} failed:\n{res.stderr[-3000:]}")
    return res.stdout


SERVICES = {"policy-router": "router", "int8-policy": "variant"}  # the processes a chat walk pinned to INT8 crosses


def chat_figures(out: str) -> dict:
    """A chat walk's output as {"router", "variant", "chat"}: each server process's walk (named by its BentoML
    service) and both together."""
    runs, named = _json_lines(out), {}
    for run in runs[:-1]:
        service = re.search(r"--service-name (\S+)", run["process"])
        role = SERVICES.get(service[1]) if service else None
        if role is None or role in named:
            raise SystemExit(f"walk: a chat walk's process is not one of {sorted(SERVICES)} once each: "
                             f"{run['process']!r}")
        named[role] = run
    return {**named, "chat": runs[-1]}


def compare(checkouts: List[str], out: Path = None, argv: List[str] = None) -> None:
    """Both walks of each ``LABEL=CHECKOUT``, side by side."""
    from policy_bundle.loadtest.results_doc import markdown, table, write_tables

    named = [item.partition("=")[::2] for item in checkouts]
    labels = [label for label, _ in named]
    roots = [ROOT if where in ("", "this") else Path(where).resolve() for _, where in named]
    # every build walk first, on a quiet machine (no server of a chat walk still stopping): the build chooses among
    # its recipes by their measured speed, and a loaded machine can send it down another path
    results = [{"build": _json_lines(_walk_process(root, chat=False))[0]} for root in roots]
    for label, root, res in zip(labels, roots, results):
        res.update(chat_figures(_walk_process(root, chat=True)))
        print(f"[walk] {label}: {json.dumps(res)}", flush=True)

    def cell(w: dict) -> str:
        return f"{w['files']} files, {w['returns']} returns, {w['calls']} calls" if w else "-"
    rows = [[what, *[cell(r.get(key)) for r in results]] for what, key in (
        ("streamed chat: router", "router"), ("streamed chat: INT8 variant", "variant"),
        ("streamed chat: both processes", "chat"), ("the build config through one build", "build"))]
    lead = ("project files crossed (tests, loadtest and virtual environments aside), returns to a file already left, "
            "calls; the chat walk: one streamed chat completion of 16 tokens, greedy, pinned to INT8, each server "
            "process's shortest of three; the build walk: `main.yaml` (`reference.yaml` where there is none), no mesh")
    tab = table(["walk", *labels], rows)
    print(lead + "\n" + markdown(tab))
    if out:
        print(f"figures: {write_tables(out, 'walk', lead, [tab], argv=argv, walks=dict(zip(labels, results)))}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", nargs="+", metavar="LABEL=CHECKOUT", help="both walks of each checkout, one table")
    ap.add_argument("--json", type=Path, help="with --compare: write the table here (docs/results/NAME.json)")
    ap.add_argument("--config", default="build/configs/main.yaml")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--chat", action="store_true", help="walk a streamed chat request through a served bundle")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose build (or, with --chat, whose "
                    "served bundle) is walked: any version of the project")
    ap.add_argument("--path", action="store_true", help="print the walk call by call (file:function)")
    args = ap.parse_args(argv)
    if args.compare:
        compare(args.compare, args.json, argv)
        return 0
    if args.chat:
        runs = chat_walk(args.root, ["export.onnx=false", *args.overrides])
        for run in runs:
            print(json.dumps({k: v for k, v in run.items() if k not in ("order", "path")}))
            print("  " + "\n  ".join(run["path"] if args.path else run["order"]))
        print(json.dumps({"processes": len(runs), "files": len({f for run in runs for f in run["order"]}),
                          "returns": sum(run["returns"] for run in runs), "calls": sum(run["calls"] for run in runs)}))
        return 0

    if args.root != ROOT:  # another checkout's build, walked by this file: run as a script, its code first
        sys.path.insert(0, str(args.root.resolve()))
        for name in [m for m in sys.modules if m == "policy_bundle" or m.startswith("policy_bundle.")]:
            del sys.modules[name]
    import policy_bundle.build
    from policy_bundle.build.config.build_config import load_config
    from policy_bundle.build.pipeline import run_build

    overrides = ["calibration.procs=0", "export.onnx=false", "register.bentoml=false", *args.overrides]
    config = args.root / args.config  # relative to the checkout (an absolute path stays)
    if not config.is_file() and args.config == "build/configs/main.yaml":
        config = args.root / "build/configs/reference.yaml"  # an older checkout's main config
    cfg = load_config(config, tuple(overrides))
    watched = {id(cfg)} | {id(getattr(cfg, f.name)) for f in fields(cfg) if is_dataclass(getattr(cfg, f.name))}
    calls: List[str] = []
    project = Path(policy_bundle.build.__file__).resolve().parents[1]
    root = str(project)

    def profile(frame, event, _arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(root) or any(d in path[len(root):] for d in ("/loadtest/", "/tests/", "/.venv/")):
            return
        code = frame.f_code
        for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
            value = frame.f_locals.get(name)
            if id(value) in watched or type(value).__name__ == "BuildConfig":
                if type(value).__name__ == "BuildConfig":
                    watched.update({id(value)} | {id(getattr(value, f.name)) for f in fields(value)
                                                  if is_dataclass(getattr(value, f.name))})
                calls.append(f"{Path(path).relative_to(project)}:{code.co_name}")
                return

    with tempfile.TemporaryDirectory() as tmp:
        sys.setprofile(profile)
        try:
            run_build(cfg, Path(tmp) / "bundle")
        finally:
            sys.setprofile(None)
    out = walk([c.rsplit(":", 1)[0] for c in calls])
    print(json.dumps({k: v for k, v in out.items() if k != "order"}))
    print("\n".join([c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c] if args.path else out["order"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
