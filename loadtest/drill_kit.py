"""What every drill needs: the small bundle (built, or copied from the drills' bundle cache), the served router
with the drill's rollout settings, the FP16 engine check, the rollout history and the "all answered" check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import httpx
import yaml

from policy_bundle.bundle.layout import BundleLayout
from policy_bundle.loadtest.load import ADMIN, TOKEN, DrillRun
from policy_bundle.loadtest.servers import ROOT, Server
from policy_bundle.quantize.runtime.vllm_launch import vllm_env

SMALL = ["--set", "calibration.samples=64", "--set", "calibration.batch_size=16", "--set", "calibration.golden=64",
         "--set", "calibration.procs=0", "--set", "export.onnx=false",
         "--set", "export.int8_vllm=false"]  # the drills serve INT8 as TorchScript: no vLLM load to gate int8-vllm/
BUILD_TIMEOUT_S = 900
# the copy checked against its manifest, then registered: one process (each start is seconds of both cores)
VERIFY_AND_REGISTER = ("import sys; from pathlib import Path; "
                       "from policy_bundle.bundle.manifest import verify_bundle; "
                       "from policy_bundle.build.artifacts.register import register_bundle; "
                       "verify_bundle(Path(sys.argv[1])); register_bundle(Path(sys.argv[1]), sys.argv[2], sys.argv[3])")


def build_bundle(home: Path, out: Path, broken: bool) -> str:
    """A small reference bundle registered in ``home``; returns its store version.

    With ``POLICY_BUNDLE_DRILL_BUNDLES=DIR`` (the test suite sets it) the first build of each kind is kept
    in DIR and later drills copy it, check it against its manifest and register the copy: the same
    config built again is the same bundle, and the drills test serving, not building."""
    from policy_bundle.bundle.manifest import manifest_hash

    name = "broken" if broken else "good"
    env = {**os.environ, "BENTOML_HOME": str(home)}
    cache = Path(os.environ["POLICY_BUNDLE_DRILL_BUNDLES"]) / name if os.environ.get("POLICY_BUNDLE_DRILL_BUNDLES") \
        else None
    if cache is None:
        return _build(home, out, broken)
    from filelock import FileLock

    cache.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache.with_name(f"{name}.lock"))):  # drills in other processes wait for this build
        if not BundleLayout(cache).manifest.is_file():
            version = _build(home, out, broken)
            tmp = cache.with_name(f".{name}.{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(out, tmp)
            tmp.rename(cache)  # whole or not at all
            return version
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(cache, out)
    version = f"{name}-{manifest_hash(out)[:12]}"
    res = subprocess.run([sys.executable, "-c", VERIFY_AND_REGISTER, str(out), version, manifest_hash(out)], cwd=ROOT,
                         env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"cached bundle {cache}: verify and register failed:\n{res.stderr[-3000:]}")
    return version


def _build(home: Path, out: Path, broken: bool) -> str:
    from policy_bundle.bundle.manifest import manifest_hash

    name = "broken" if broken else "good"
    env = {**os.environ, "BENTOML_HOME": str(home)}
    args = [sys.executable, "-m", "policy_bundle.build.cli", "build", "--config", "build/configs/main.yaml", "--out", str(out),
            "--force", *SMALL, "--set", f"name={name}"]
    if broken:  # a deliberately broken INT8 policy that a gated build would refuse: gate off, one scale x400
        args += ["--set", "gate.enabled=false"]
        env["POLICY_BUNDLE_TEST_FAULT"] = "scale:layer=layers.0.mlp.down_proj:factor=400"
    try:  # bounded: a drill in another process may be waiting on the lock this build holds
        res = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"bundle build ran past {BUILD_TIMEOUT_S} s:\n{(exc.stderr or b'')[-3000:]!r}") from None
    if res.returncode != 0:
        raise RuntimeError(f"bundle build failed:\n{res.stderr[-3000:]}")
    return f"{name}-{manifest_hash(out)[:12]}"


def start_server(run: DrillRun, home: Path, version: str, log_name: str, interval: float,
                 router: Optional[dict] = None, fault: Optional[str] = None) -> Server:
    cfg = run.out / "router.yaml"
    cfg.write_text(yaml.safe_dump({**(router or {}),
                                   "rollout": {"analysis_interval_s": interval, "golden_interval_s": interval * 0.8,
                                               "min_samples": 8, "failure_limit": 2, "golden_items": 16,
                                               # 4 s windows (not 30 s): as long to wait before pausing takes
                                               # more of them (an open window keeps collecting meanwhile)
                                               "inconclusive_limit": 20,
                                               "shadow_fraction": 0.3,
                                               # 4 s windows on a shared 2-core box: p99 is noise here
                                               "max_p99_latency_ratio": 10.0}}))
    env = {"BENTOML_HOME": str(home), "POLICY_BUNDLE_VERSION": version, "POLICY_BUNDLE_ADMIN_TOKEN": TOKEN,
           "POLICY_BUNDLE_STATE_DIR": str(run.out / "state"), "POLICY_BUNDLE_ROUTER_CONFIG": str(cfg),
           "POLICY_BUNDLE_DISABLE_VLLM": "0" if run.fp16_engine == "vllm" else "1", **vllm_env(),
           **({"POLICY_BUNDLE_TEST_FAULT": fault} if fault else {})}
    server = Server(env, run.out / log_name).wait_ready(600 if run.fp16_engine == "vllm" else 300)
    check_fp16_engine(run, server)
    if not run.requests and not run.states:  # the drill's clock starts when traffic can start
        run.t0 = time.monotonic()
    return server


def check_fp16_engine(run: DrillRun, server: Server) -> None:
    """The FP16 variant runs the engine the drill asked for (``/status``: its health dict's ``engine``)."""
    try:
        engine = httpx.get(f"{server.url}/status", timeout=10).json()["variants"]["fp16"].get("engine")
    except (httpx.HTTPError, KeyError, ValueError):
        server.stop()  # the drill's try/finally has not started yet
        raise
    run.figures["fp16_engine"] = engine
    if run.fp16_engine == "vllm":
        run.check(f"the FP16 variant serves with vLLM (/status engine: {engine})", engine == "vllm")
    else:
        run.check(f"the FP16 variant serves with the fallback (/status engine: {engine})", engine != "vllm")


def history(url: str) -> List[dict]:
    return httpx.get(f"{url}/admin/rollout/history", headers=ADMIN, timeout=10).json()["history"]


def all_answered(run: DrillRun, since: float = 0.0) -> bool:
    return all(r["status"] == 200 for r in run.requests if r["t"] >= since)
