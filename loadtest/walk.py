"""How far the build config travels: the files a build's calls that are handed the config (or one of its sections)
cross, and how often the walk goes back to a file it had already left.

    .venv/bin/python -m policy_bundle.loadtest.walk [--config build/configs/main.yaml] [--set KEY=VALUE ...]

Runs one build in this process (the embedded reference policy by default, no mesh, no ONNX, nothing registered)
under ``sys.setprofile`` and records, in call order, the project file of every call whose arguments hold the build
config or a section of it. Prints the files in first-visit order, their count and the returns (a call in a file
visited before, other than the one just left). A measure of the code's layout, not a test.
"""

from __future__ import annotations

import argparse
import json
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="build/configs/main.yaml")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args(argv)

    from policy_bundle.build.config.build_config import load_config
    from policy_bundle.build.pipeline import run_build

    overrides = ["calibration.procs=0", "export.onnx=false", "register.bentoml=false", *args.overrides]
    cfg = load_config(args.config, tuple(overrides))
    watched = {id(cfg)} | {id(getattr(cfg, f.name)) for f in fields(cfg) if is_dataclass(getattr(cfg, f.name))}
    calls: List[str] = []
    root = str(ROOT)

    def profile(frame, event, _arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(root) or "/loadtest/" in path:
            return
        code = frame.f_code
        for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
            value = frame.f_locals.get(name)
            if id(value) in watched or type(value).__name__ == "BuildConfig":
                if type(value).__name__ == "BuildConfig":
                    watched.update({id(value)} | {id(getattr(value, f.name)) for f in fields(value)
                                                  if is_dataclass(getattr(value, f.name))})
                calls.append(str(Path(path).relative_to(ROOT)))
                return

    with tempfile.TemporaryDirectory() as tmp:
        sys.setprofile(profile)
        try:
            run_build(cfg, Path(tmp) / "bundle")
        finally:
            sys.setprofile(None)
    out = walk(calls)
    print(json.dumps({k: v for k, v in out.items() if k != "order"}))
    print("\n".join(out["order"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
