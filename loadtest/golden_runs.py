"""The live golden canary, run by hand against a served bundle: each run's greedy agreement with the build's FP32
completions (INT8 and FP16), and the analysis verdict of the window the runs pool into.

Printed, never asserted. It serves the newest bundle of the BentoML store (``BENTOML_HOME``), or
``POLICY_BUNDLE_VERSION``, with its variants (FP16 on vLLM where importable) and no traffic, so the golden runs are
the only evidence. Run: ``.venv/bin/python -m policy_bundle.loadtest.golden_runs [--runs 6] [--items 16]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import httpx

from policy_bundle.loadtest.servers import Server
from policy_bundle.quantize.runtime.vllm_launch import vllm_env

TOKEN = "golden-runs-admin-token"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--items", type=int, default=16, help="golden items per run (rollout.golden_items)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="golden-runs-"))
    env = vllm_env(POLICY_BUNDLE_ADMIN_TOKEN=TOKEN, POLICY_BUNDLE_STATE_DIR=str(tmp / "state"))
    rollout = {"golden_items": args.items, "golden_interval_s": 86400, "analysis_interval_s": 86400, "shadow_fraction": 0}
    (tmp / "router.yaml").write_text(json.dumps({"rollout": rollout}))  # no loop of its own: only these runs
    env["POLICY_BUNDLE_ROUTER_CONFIG"] = str(tmp / "router.yaml")
    server = Server(env, tmp / "server.log").wait_ready(600)
    headers = {"authorization": f"Bearer {TOKEN}"}

    def admin(action: str) -> dict:
        r = httpx.post(f"{server.url}/admin/rollout", json={"action": action, "reason": "golden_runs"},
                       headers=headers, timeout=1800)
        r.raise_for_status()
        return r.json()

    try:
        for i in range(args.runs):
            run = admin("golden-canary")
            g, verdict = run["golden"], admin("analyse")
            bounds = verdict["metrics"].get("golden_greedy_agreement_bounds")
            print(f"run {i + 1}: INT8 {g['greedy_same']}/{g['items']} ({g['greedy_agreement']:.4f}), FP16 "
                  f"{g['fp16_greedy_agreement']:.4f}; window {verdict['metrics']['golden']['items']} items, "
                  f"bounds {bounds and [round(b, 3) for b in bounds]}: {verdict['verdict']} {verdict['reasons']}",
                  flush=True)
        print("rollout:", httpx.get(f"{server.url}/admin/rollout", headers=headers, timeout=30).json()["state"])
    finally:
        server.stop()


if __name__ == "__main__":
    main()
